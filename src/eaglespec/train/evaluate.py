"""Held-out evaluation: top-1 accuracy of the draft at steps 1..k, each step feeding back the head's own output
(as a depth-k draft chain does at inference), against the target's own greedy next token."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..heads import DraftHead
from ..targets.hf import TargetEnds, TargetModel
from .losses import next_embeds, shift_left, step_mask


@torch.no_grad()
def draft_accuracy(head: DraftHead, target: TargetModel | TargetEnds, source, indices: list[int], steps: int,
                   batch_size: int = 4) -> dict:
    """{"acc": [top-1 accuracy at step 1..k], "tokens": assistant predictions counted at step 1}.

    Step j's prediction at slot t is compared with the target's argmax at position t+1+j over the full target
    vocabulary (a token outside an EAGLE-3 draft vocabulary counts as a miss)."""
    was_training = head.training
    head.eval()
    hits = [0] * steps
    counts = [0] * steps
    for s in range(0, len(indices), batch_size):
        batch = source.batch(indices[s : s + batch_size]).to(target.device)
        outs = head.unroll(head.lift(batch.features.float()), next_embeds(target.embed_tokens, batch), steps)
        for j, out in enumerate(outs):
            valid = step_mask(batch, j)  # [B, T]
            if not valid.any():
                continue
            want = target.logits_from_last(shift_left(batch.last, 1 + j)[valid]).argmax(-1)  # [N]
            got = head.to_target_ids(head.logits(out[valid], target.lm_head).argmax(-1))  # [N]
            hits[j] += int((got == want).sum())
            counts[j] += int(valid.sum())
    head.train(was_training)
    return {"acc": [h / c if c else 0.0 for h, c in zip(hits, counts)], "tokens": counts[0]}


def format_accuracy(result: dict) -> str:
    return " ".join(f"acc@{j + 1}={a:.3f}" for j, a in enumerate(result["acc"])) + f" ({result['tokens']} tokens)"


def log_jsonl(path: str | Path, record: dict) -> None:
    with Path(path).open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
