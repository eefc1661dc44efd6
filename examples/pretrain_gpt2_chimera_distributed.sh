#!/usr/bin/env bash
# Multi-node Chimera pretraining of the paper's GPT-2 (64 layers, hidden 1280, 20 heads, seq 632).
# Run once per node with NODE_RANK set; DRY_RUN=1 prints the command instead of running it;
# TP_SIZE=T adds tensor (and sequence) parallelism, W = nodes x GPUs per node / (T x PP).
#   NNODES=64 NODE_RANK=0 GPUS_PER_NODE=8 MASTER_ADDR=node001 bash examples/pretrain_gpt2_chimera_distributed.sh
# Every setting below can be overridden from the environment, e.g. a tiny CPU run of two "nodes"
# on one machine (tests/functional/test_two_node_launch.py):
#   NNODES=2 NODE_RANK=0 GPUS_PER_NODE=2 PP=4 MASTER_ADDR=127.0.0.1 NUM_LAYERS=4 HIDDEN_SIZE=64 \
#   NUM_HEADS=4 SEQ_LENGTH=32 GLOBAL_BATCH=8 PRECISION= RECOMPUTE= MOCK_DATA=1 VOCAB_SIZE=500 \
#   TRAIN_ITERS=6 bash examples/pretrain_gpt2_chimera_distributed.sh     (and NODE_RANK=1)
set -euo pipefail

# ---- paths -------------------------------------------------------------------------------------
DATA_PATH=${DATA_PATH:-data/corpus_text_document}          # prefix of the .bin/.idx pair
TOKENIZER_MODEL=${TOKENIZER_MODEL:-data/tokenizer.model}    # SentencePiece model
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt2_64l_chimera}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-runs/gpt2_64l_chimera}
MOCK_DATA=${MOCK_DATA:-0}                                    # 1: synthetic data, no tokenizer
VOCAB_SIZE=${VOCAB_SIZE:-50257}                              # the vocabulary of MOCK_DATA=1

# ---- cluster -----------------------------------------------------------------------------------
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TORCHRUN=${TORCHRUN:-torchrun}                               # e.g. "python -m torch.distributed.run"

# ---- model and training ------------------------------------------------------------------------
NUM_LAYERS=${NUM_LAYERS:-64}
HIDDEN_SIZE=${HIDDEN_SIZE:-1280}
NUM_HEADS=${NUM_HEADS:-20}
SEQ_LENGTH=${SEQ_LENGTH:-632}
TRAIN_ITERS=${TRAIN_ITERS:-50000}
PRECISION=${PRECISION---bf16}                                # empty: fp32
RECOMPUTE=${RECOMPUTE---recompute-granularity full --recompute-method uniform --recompute-num-layers 1}
LOG_INTERVAL=${LOG_INTERVAL:-10}
EVAL_INTERVAL=${EVAL_INTERVAL:-1000}
EVAL_ITERS=${EVAL_ITERS:-10}
SAVE_INTERVAL=${SAVE_INTERVAL:-1000}
EXTRA_ARGS=${EXTRA_ARGS:-}                                   # more flags, appended last

# ---- parallelism (the paper's best GPT-2 setting on 512 GPUs: W=16, D=32, B=1) -------------------
PP=${PP:-32}
CHIMERA_PIPES=${CHIMERA_PIPES:-2}
# tensor parallelism inside a node (T ranks per stage; world = TP_SIZE x W x PP). With TP_SIZE > 1
# the residual stream is split along the sequence too unless SEQUENCE_PARALLEL=0.
TP_SIZE=${TP_SIZE:-1}
SEQUENCE_PARALLEL=${SEQUENCE_PARALLEL:-1}
MICRO_BATCH=${MICRO_BATCH:-1}
GLOBAL_BATCH=${GLOBAL_BATCH:-512}

cd "$(dirname "$0")/.."
# resume when a checkpoint exists (a missing --load directory is an error, not a fresh start)
TP_ARGS=(--tensor-model-parallel-size "$TP_SIZE")
if [ "$TP_SIZE" -gt 1 ] && [ "$SEQUENCE_PARALLEL" = "1" ]; then TP_ARGS+=(--sequence-parallel); fi
LOAD_ARGS=()
if [ -f "$CHECKPOINT_PATH/latest_checkpointed_iteration.txt" ]; then LOAD_ARGS=(--load "$CHECKPOINT_PATH"); fi
if [ "$MOCK_DATA" = "1" ]; then
  DATA_ARGS=(--mock-data --vocab-size "$VOCAB_SIZE")
else
  DATA_ARGS=(--data-path "$DATA_PATH" --split 969,30,1
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
fi
read -r -a TORCHRUN_CMD <<< "$TORCHRUN"
read -r -a PRECISION_ARGS <<< "$PRECISION"
read -r -a RECOMPUTE_ARGS <<< "$RECOMPUTE"
read -r -a EXTRA <<< "$EXTRA_ARGS"
CMD=("${TORCHRUN_CMD[@]}" --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE"
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
  pretrain_gpt2.py
  --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --num-attention-heads "$NUM_HEADS"
  --seq-length "$SEQ_LENGTH" --max-position-embeddings "$SEQ_LENGTH"
  "${TP_ARGS[@]}" --pipeline-model-parallel-size "$PP" --chimera-pipes "$CHIMERA_PIPES"
  --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH"
  --train-iters "$TRAIN_ITERS" --lr 1.5e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-fraction 0.01
  --weight-decay 0.01 --clip-grad 1.0 "${PRECISION_ARGS[@]}" "${RECOMPUTE_ARGS[@]}"
  "${DATA_ARGS[@]}"
  --save "$CHECKPOINT_PATH" "${LOAD_ARGS[@]}" --save-interval "$SAVE_INTERVAL"
  --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
  --tensorboard-dir "$TENSORBOARD_DIR" --log-throughput "${EXTRA[@]}")

if [ "${DRY_RUN:-0}" = "1" ]; then printf '%q ' "${CMD[@]}"; echo; exit 0; fi
exec "${CMD[@]}"
