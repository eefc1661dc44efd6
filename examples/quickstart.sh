#!/usr/bin/env bash
# Quickstart: from a fresh clone, on a CPU machine, train a small GPT-2 with Chimera (4 pipeline stages,
# 2 pipes) on Shakespeare, with evaluation, TensorBoard logs, a checkpoint and a schedule plot, and
# end with a short sample of what the model writes.
#
#   bash examples/quickstart.sh              # a few minutes on 2 cores
#   QUICKSTART_SHORT=1 bash examples/quickstart.sh   # the CI form: smaller vocabulary, fewer iterations
#
# Re-running reuses the corpus, tokenizer and preprocessed data, and resumes from the checkpoint.
# Variables: OUT_DIR (default outputs/quickstart), DATA_DIR (default data), TRAIN_ITERS, NPROC (default 4),
# PROMPT and SAMPLE_TOKENS (the closing sample; default "ROMEO:" and 40).
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '\n==> %s\n' "$*"; }

SHORT=${QUICKSTART_SHORT:-0}
DATA_DIR=${DATA_DIR:-data}
OUT_DIR=${OUT_DIR:-outputs/quickstart}
NPROC=${NPROC:-4}
if [ "$SHORT" = "1" ]; then
  VOCAB=${VOCAB:-1000}; TRAIN_ITERS=${TRAIN_ITERS:-8}; EVAL_INTERVAL=4; SAVE_INTERVAL=4; HIDDEN=64
else
  VOCAB=${VOCAB:-4000}; TRAIN_ITERS=${TRAIN_ITERS:-60}; EVAL_INTERVAL=20; SAVE_INTERVAL=30; HIDDEN=128
fi
TOKENIZER_PREFIX=$DATA_DIR/spm_$VOCAB
DATA_PREFIX=$DATA_DIR/shakespeare_spm${VOCAB}
CHECKPOINTS=$OUT_DIR/checkpoints
TENSORBOARD=$OUT_DIR/tensorboard
PLOT=$OUT_DIR/chimera_schedule.png

step "install (.venv, torch==2.13.0 first)"
bash tools/install.sh
PY=.venv/bin/python
export OMP_NUM_THREADS=1
mkdir -p "$DATA_DIR" "$OUT_DIR"

step "corpus: Shakespeare (public domain) -> $DATA_DIR/shakespeare.jsonl"
if [ -s "$DATA_DIR/shakespeare.jsonl" ]; then echo "reusing $DATA_DIR/shakespeare.jsonl"
else $PY tools/get_corpus.py --output "$DATA_DIR/shakespeare.jsonl"; fi

step "tokenizer: SentencePiece BPE, vocabulary $VOCAB -> $TOKENIZER_PREFIX.model"
if [ -s "$TOKENIZER_PREFIX.model" ]; then echo "reusing $TOKENIZER_PREFIX.model"
else $PY tools/train_tokenizer.py --input "$DATA_DIR/shakespeare.jsonl" --model-prefix "$TOKENIZER_PREFIX" \
       --vocab-size "$VOCAB" --model-type bpe --input-sentence-size 200000; fi

step "preprocess: Megatron .bin/.idx -> ${DATA_PREFIX}_text_document"
if [ -s "${DATA_PREFIX}_text_document.idx" ]; then echo "reusing ${DATA_PREFIX}_text_document.{bin,idx}"
else $PY tools/preprocess_data.py --input "$DATA_DIR/shakespeare.jsonl" --output-prefix "$DATA_PREFIX" \
       --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_PREFIX.model" \
       --append-eod --workers 2 --log-interval 500; fi

LOAD_ARGS=()
if [ -f "$CHECKPOINTS/latest_checkpointed_iteration.txt" ]; then
  LOAD_ARGS=(--load "$CHECKPOINTS"); TRAIN_ITERS=$(( $(cat "$CHECKPOINTS/latest_checkpointed_iteration.txt") + TRAIN_ITERS ))
  echo "resuming from $CHECKPOINTS (iteration $(cat "$CHECKPOINTS/latest_checkpointed_iteration.txt")) to $TRAIN_ITERS"
fi

step "train: torchrun --nproc-per-node $NPROC pretrain_gpt2.py, Chimera D=4, 2 pipes, $TRAIN_ITERS iterations"
.venv/bin/torchrun --nproc-per-node "$NPROC" --master-port "${MASTER_PORT:-29517}" pretrain_gpt2.py \
  --num-layers 8 --hidden-size "$HIDDEN" --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 \
  --pipeline-model-parallel-size 4 --chimera-pipes 2 \
  --micro-batch-size 2 --global-batch-size 16 \
  --train-iters "$TRAIN_ITERS" --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-fraction 0.1 \
  --weight-decay 0.01 --clip-grad 1.0 --hidden-dropout 0.0 --attention-dropout 0.0 \
  --data-path "${DATA_PREFIX}_text_document" --split 969,30,1 \
  --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER_PREFIX.model" \
  --log-interval 2 --eval-interval "$EVAL_INTERVAL" --eval-iters 2 \
  --save "$CHECKPOINTS" --save-interval "$SAVE_INTERVAL" "${LOAD_ARGS[@]}" \
  --tensorboard-dir "$TENSORBOARD" --log-throughput

step "schedule plot: Chimera D=4, 2 pipes, N=8 (backward = 2 x forward)"
$PY tools/plot_schedule.py --pipeline-schedule chimera --pipeline-model-parallel-size 4 \
  --num-microbatches 8 --chimera-pipes 2 --forward-cost 1 --backward-cost 2 --out "$PLOT"

step "sample: tools/generate_text.py, one process, from the checkpoint just written"
$PY tools/generate_text.py --load "$CHECKPOINTS" --prompt "${PROMPT:-ROMEO:}" \
  --max-new-tokens "${SAMPLE_TOKENS:-40}" --temperature 0.8 --top-k 40 --seed 1234 --device cpu

step "done"
cat <<MSG
  TensorBoard logs : $TENSORBOARD      (open with: .venv/bin/tensorboard --logdir $TENSORBOARD)
  Checkpoint       : $CHECKPOINTS      (iteration $(cat "$CHECKPOINTS/latest_checkpointed_iteration.txt" 2>/dev/null || echo none))
  Schedule plot    : $PLOT
  More samples     : $PY tools/generate_text.py --load $CHECKPOINTS --prompt "JULIET:" --max-new-tokens 60
  Perplexity       : $PY tools/evaluate.py --load $CHECKPOINTS --data-path ${DATA_PREFIX}_text_document --max-tokens 20000
  About the sample : a few CPU minutes of a 8-layer model give word salad with Shakespeare's shape;
                     coherent text needs far more tokens and steps (a GPU run).
  About the bubble : the measured bubble exceeds the predicted one on CPU: the prediction counts only
                     compute, while each action here also pays Python and gloo host overhead.
MSG
