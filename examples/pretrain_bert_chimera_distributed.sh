#!/usr/bin/env bash
# Multi-node Chimera pretraining of the paper's BERT-48 (48 layers, hidden 1024, 16 heads, seq 128).
# Run once per node with NODE_RANK set; DRY_RUN=1 prints the command instead of running it;
# TP_SIZE=T adds tensor (and sequence) parallelism, W = nodes x GPUs per node / (T x PP).
#   NNODES=4 NODE_RANK=0 GPUS_PER_NODE=8 MASTER_ADDR=node001 bash examples/pretrain_bert_chimera_distributed.sh
set -euo pipefail

# ---- paths -------------------------------------------------------------------------------------
DATA_PATH=${DATA_PATH:-data/corpus_text_sentence}           # sentence-split .bin/.idx prefix
VOCAB_FILE=${VOCAB_FILE:-data/bert-vocab.txt}               # WordPiece vocabulary
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/bert48_chimera}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-runs/bert48_chimera}

# ---- cluster -----------------------------------------------------------------------------------
NNODES=${NNODES:-4}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}

# ---- parallelism (the paper's best BERT-48 setting on 32 GPUs: W=8, D=4, B=8) --------------------
PP=${PP:-4}
CHIMERA_PIPES=${CHIMERA_PIPES:-2}
# tensor parallelism inside a node (T ranks per stage; world = TP_SIZE x W x PP). With TP_SIZE > 1
# the residual stream is split along the sequence too unless SEQUENCE_PARALLEL=0.
TP_SIZE=${TP_SIZE:-1}
SEQUENCE_PARALLEL=${SEQUENCE_PARALLEL:-1}
MICRO_BATCH=${MICRO_BATCH:-8}
GLOBAL_BATCH=${GLOBAL_BATCH:-512}

cd "$(dirname "$0")/.."
# resume when a checkpoint exists (a missing --load directory is an error, not a fresh start)
TP_ARGS=(--tensor-model-parallel-size "$TP_SIZE")
if [ "$TP_SIZE" -gt 1 ] && [ "$SEQUENCE_PARALLEL" = "1" ]; then TP_ARGS+=(--sequence-parallel); fi
LOAD_ARGS=()
if [ -f "$CHECKPOINT_PATH/latest_checkpointed_iteration.txt" ]; then LOAD_ARGS=(--load "$CHECKPOINT_PATH"); fi
CMD=(torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE"
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
  pretrain_bert.py
  --num-layers 48 --hidden-size 1024 --num-attention-heads 16
  --seq-length 128 --max-position-embeddings 512
  "${TP_ARGS[@]}" --pipeline-model-parallel-size "$PP" --chimera-pipes "$CHIMERA_PIPES"
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
  --train-iters 100000 --lr 1e-4 --min-lr 1e-5 --lr-decay-style linear --lr-warmup-fraction 0.01
  --weight-decay 0.01 --clip-grad 1.0 --bf16
  --data-path "$DATA_PATH" --split 949,50,1
  --tokenizer-type BertWordPieceLowerCase --vocab-file "$VOCAB_FILE"
  --save "$CHECKPOINT_PATH" "${LOAD_ARGS[@]}" --save-interval 1000
  --log-interval 10 --eval-interval 1000 --eval-iters 10
  --tensorboard-dir "$TENSORBOARD_DIR" --log-throughput)

if [ "${DRY_RUN:-0}" = "1" ]; then printf '%q ' "${CMD[@]}"; echo; exit 0; fi
exec "${CMD[@]}"
