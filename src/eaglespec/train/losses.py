"""Training objectives of EAGLE-1 (feature regression + soft cross-entropy; optionally over k unrolled steps) and
EAGLE-3 (training-time test over k unrolled steps, weighted 0.8^j, against the target distribution restricted to the
draft vocabulary).

Slot conventions (see `DraftHead.unroll`): step j of slot t predicts token x_{t+2+j}; the target's matching
distribution is its logits at position t+1+j and the true next feature is f_{t+1+j}.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..heads import DraftHead
from ..targets.hf import TargetEnds, TargetModel
from .features import Batch

STEP_DECAY = 0.8


def shift_left(x: Tensor, k: int) -> Tensor:
    """x[:, k:] padded at the end with zeros / False to the same length: [B, T, ...] -> [B, T, ...]."""
    if k == 0:
        return x
    pad = torch.zeros((x.shape[0], k, *x.shape[2:]), dtype=x.dtype, device=x.device)
    return torch.cat([x[:, k:], pad], dim=1)


def step_mask(batch: Batch, step: int) -> Tensor:
    """[B, T] bool: slots whose step-`step` prediction (token x_{t+2+step}) exists and is an assistant token."""
    return shift_left(batch.loss_mask & batch.attention_mask, 2 + step)


def soft_cross_entropy(logits: Tensor, target_probs: Tensor) -> Tensor:
    """Mean over rows of -sum p * log softmax(logits): logits, target_probs [N, V]."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    return -(target_probs * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean()


@dataclass
class LossParts:
    total: Tensor
    parts: dict[str, float]  # for logging
    tokens: int  # predictions the loss covered (step 0)


def next_embeds(embed: nn.Module, batch: Batch) -> Tensor:
    """Embedding of x_{t+1} at slot t: [B, T, d] (zeros past the end)."""
    return shift_left(embed(batch.input_ids).float(), 1) * shift_left(batch.attention_mask, 1)[..., None]


def eagle1_loss(head: DraftHead, target: TargetModel | TargetEnds, batch: Batch, noise: float,
                generator: torch.Generator,
                feature_weight: float = 1.0, ce_weight: float = 0.1, model: nn.Module | None = None,
                steps: int = 1) -> LossParts:
    """SmoothL1(predicted f_{t+1}, true f_{t+1}) + ce_weight * soft CE(target p_{t+1}, head's p) on assistant slots.
    U(-noise, noise) is added to the input features. `model` is `head` as wrapped for distributed training. A head
    with a draft vocabulary (`set_draft_vocab`) is scored over it, against the target renormalised over it.

    `steps` > 1 adds EAGLE-3's training-time test to this objective: step j feeds back the head's own predicted
    feature of step j-1 (what a depth-j draft node reads) and is scored the same way against f_{t+1+j} and
    p_{t+1+j}, weighted 0.8^j. steps = 1 is the EAGLE-1 paper's loss."""
    features = batch.features.float()
    if noise:
        u = torch.rand(features.shape, generator=generator).to(features.device)
        features = features + (u * 2 - 1) * noise
    outs = (model or head)(features, next_embeds(target.embed_tokens, batch), steps)  # steps x [B, T, d]
    vocab_ids = getattr(head, "vocab_ids", None)
    total = features.new_zeros(())
    parts: dict[str, float] = {}
    for j, out in enumerate(outs):
        valid = step_mask(batch, j)  # [B, T]
        pred = out[valid]  # [N, d]
        true_next = shift_left(batch.last, 1 + j)[valid].float()  # [N, d]
        with torch.no_grad():
            p = torch.softmax(target.logits_from_last(true_next, vocab_ids), dim=-1)  # [N, Vd]
        reg = F.smooth_l1_loss(pred.float(), true_next) if pred.shape[0] else pred.sum() * 0.0
        ce = soft_cross_entropy(head.logits(pred, target.lm_head), p)
        total = total + STEP_DECAY**j * (feature_weight * reg + ce_weight * ce)
        suffix = str(j) if j else ""
        parts[f"regression{suffix}"], parts[f"soft_ce{suffix}"] = float(reg.detach()), float(ce.detach())
    return LossParts(total, parts, int(step_mask(batch, 0).sum()))


def eagle3_loss(head: DraftHead, target: TargetModel | TargetEnds, batch: Batch, steps: int,
                model: nn.Module | None = None) -> LossParts:
    """Training-time test: sum_j 0.8^j * soft CE(target distribution over the draft vocabulary, head's step-j
    distribution), step j feeding back the head's own step j-1 output."""
    draft_ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size, device=batch.input_ids.device))
    outs = (model or head)(batch.features.float(), next_embeds(target.embed_tokens, batch), steps)
    # Step j of slot t is scored against the target's distribution at position t+1+j: every step reads the same
    # per-position distributions, shifted, so they are computed once, at the positions s whose next token x_{s+1}
    # is an answer token (every step's valid slots land there).
    with torch.no_grad():
        needed = shift_left(batch.loss_mask & batch.attention_mask, 1)  # [B, T]
        probs = batch.last.new_zeros((*needed.shape, draft_ids.numel()))  # [B, T, Vd]
        probs[needed] = torch.softmax(target.logits_from_last(batch.last[needed], draft_ids), dim=-1)
    total = batch.features.new_zeros(())
    parts: dict[str, float] = {}
    for j, out in enumerate(outs):
        valid = step_mask(batch, j)
        p = shift_left(probs, 1 + j)[valid]  # [N, Vd]
        ce = soft_cross_entropy(head.logits(out[valid], target.lm_head), p)  # [N, Vd] vs [N, Vd]
        total = total + STEP_DECAY**j * ce
        parts[f"ce{j}"] = float(ce.detach())
    return LossParts(total, parts, int(step_mask(batch, 0).sum()))
