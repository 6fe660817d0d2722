#!/bin/bash
# A/B: the commit before the layout change against it, default settings, same prompts, one process each, alternated
set -e
ARGS="bench --dataset mt-bench --turns 1 --limit 8 --max-new-tokens 128 --methods vanilla,eagle2 --threads 2 --repeats 1 --warmup 1 --no-progress"
run() { # $1 = src dir, $2 = out
  (cd /tmp && PYTHONPATH=$1 /work/venv/bin/python -c 'import sys; from eaglespec.cli import main; sys.argv[0]="eaglespec"; sys.exit(main())' $ARGS --out $2 > $2.log 2>&1)
}
for round in 1 2; do
  run /work/ab-old/src /work/ab/old-$round
  run /work/main/src /work/ab/new-$round
done
