#!/usr/bin/env bash
# The layout-equivalence matrix of issue #51 (too costly for the suite): {1F1B, Chimera,
# Chimera-ZB, ZBV} x T {1,2} x CP {1,2} x EP {1,2} x packed documents x gradient accumulation
# {1,4}, every value of every axis at least twice, through tools/check_equivalence.py (fp32,
# 1e-5 relative). Exit 0 when every layout agrees with one process. See docs/EQUIVALENCE.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
STEPS=${STEPS:-3}
COMMON="--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64
  --max-position-embeddings 64 --micro-batch-size 1 --lr 1e-3 --vocab-size 499 --mock-data
  --position-embedding-type rope --group-query-attention --num-query-groups 2"
status=0
# shellcheck disable=SC2086
$PY tools/check_equivalence.py --steps "$STEPS" --layouts-file tools/equivalence_matrix/moe.txt \
  -- $COMMON --global-batch-size 8 --num-experts 4 --moe-router-topk 2 || status=1
# shellcheck disable=SC2086
$PY tools/check_equivalence.py --steps "$STEPS" --layouts-file tools/equivalence_matrix/packed.txt \
  -- $COMMON --global-batch-size 4 --reset-attention-mask --reset-position-ids \
  --eod-mask-loss || status=1
exit $status
