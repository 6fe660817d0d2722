"""How far int8 inputs (`--activations int8`) move a GGUF target from its bfloat16-input arithmetic: the same model
(Qwen2.5-Coder-1.5B by default) as two fast targets in one process, plain greedy decoding of each prompt with each,
then both targets' logits teacher-forced over the bfloat16 target's answer.

    python benchmarks/microbench/activation_fidelity.py [--model qwen2.5-coder-1.5b] [--dataset humaneval]
        [--limit 8] [--max-new-tokens 128] [--threads 2]

Prints per prompt whether the two greedy answers are the same tokens (else where they first differ), and over every
answer position: how often the two targets' argmax agree, the mean and largest KL(bfloat16 || int8) of their
next-token distributions, and the mean of the bfloat16 target's top-1 probability where the argmax differ (near
ties). Not a timing: run it beside nothing else only for its wall time.
"""

import argparse

import torch
from tqdm import tqdm

from eaglespec.api import Engine
from eaglespec.bench.datasets import load_questions, select
from eaglespec.models import load_target

p = argparse.ArgumentParser()
p.add_argument("--model", default="qwen2.5-coder-1.5b")
p.add_argument("--dataset", default="humaneval")
p.add_argument("--limit", type=int, default=8)
p.add_argument("--max-new-tokens", type=int, default=128)
p.add_argument("--threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.threads)
model, tokenizer = load_target(args.model, dtype="bfloat16", one_copy=True)
engines = {a: Engine.from_model(model, tokenizer, method="vanilla", activations=a) for a in ("bfloat16", "int8")}
questions = select(load_questions(args.dataset), limit=args.limit)
same, agree, positions, kls, near_ties = 0, 0, 0, [], []
for q in tqdm(questions, desc="prompts"):
    prompt = engines["bfloat16"].encode([{"role": "user", "content": q.turns[0]}])
    answers = {a: e.generate(prompt, max_new_tokens=args.max_new_tokens).tokens for a, e in engines.items()}
    first = next((i for i, (x, y) in enumerate(zip(*answers.values())) if x != y), None)
    same += answers["bfloat16"] == answers["int8"]
    print(f"{q.question_id}: {'same answer' if answers['bfloat16'] == answers['int8'] else f'first differs at {first}'}"
          f" ({len(answers['bfloat16'])} tokens)")
    sequence = torch.tensor(prompt + answers["bfloat16"])
    logits = {}
    for a, engine in engines.items():
        engine.target.reset()
        logits[a] = engine.target.forward(sequence).logits[len(prompt) - 1 : -1].float()  # [answer, vocab]
        engine.target.reset()
    logp = {a: torch.log_softmax(v, dim=-1) for a, v in logits.items()}
    kl = (logp["bfloat16"].exp() * (logp["bfloat16"] - logp["int8"])).sum(-1)  # [answer]
    top = {a: v.argmax(-1) for a, v in logits.items()}
    differ = top["bfloat16"] != top["int8"]
    agree += int((~differ).sum())
    positions += len(differ)
    kls.append(kl)
    near_ties += logp["bfloat16"].exp().max(-1).values[differ].tolist()
kl = torch.cat(kls)
print(f"{args.model}, {args.dataset} x {len(questions)}, {args.max_new_tokens} new tokens: the same greedy answer "
      f"{same}/{len(questions)}; argmax agree at {agree}/{positions} answer positions ({agree / positions:.2%}); "
      f"KL(bfloat16 || int8) mean {kl.mean():.2e}, max {kl.max():.2e}; where the argmax differ, the bfloat16 "
      f"target's top-1 probability {sum(near_ties) / max(1, len(near_ties)):.2f} on average")
