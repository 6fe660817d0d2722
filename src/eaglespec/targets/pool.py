"""A pool of KV-cache slots over one target model, and the batched forward that verifies many sequences' draft
trees in one pass over the weights.

Each slot is a sibling target (`TargetModel.sibling`): the same model and weights, its own KV cache, allocated when
the pool is made (a fast-path slot starts with room for `initial_capacity` rows and doubles only when a sequence
outgrows it). A sequence takes a slot when it joins the batch and gives it back when it finishes or is cancelled;
the slot's rows are then free for the next sequence at once (nothing is copied or cleared).

`forward` runs one step of every given slot. Where each row's result does not depend on the other rows of a
product (the fast path on eaglespec's CPU kernels, whose products, decode-step attention and greedy LM head give a
row the same bits whatever else is in the call), all slots' rows go through every layer together: the products
read each weight once for the whole batch, which is what makes batching pay on a memory-bound model, and each
sequence attends over its own cache. A row then has exactly the bits of the batch-1 step that would compute it, so
greedy output does not depend on the batch's composition. On a GPU the rows go together too, without that
guarantee (its libraries choose kernels by the shape of the whole product). Elsewhere (float32 or quantized CPU
targets, the generic transformers path) each slot runs its own forward: exact, but without shared weight reads.

A slot's step may be a piece of its prompt (`spec.batch`'s chunked prefill): on the kernels a prompt row's bits do
not depend on how the prompt was cut (targets.fast), so pieces ride in the batched forward beside the other slots'
draft trees. `chunked_prefill` says whether the pool's targets allow that.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor

from ..errors import EagleSpecError
from .fast import FastTarget
from .hf import TargetModel, TargetOutput
from .layers import decoder_layer, rms_norm, write_and_attend


class SlotStep(NamedTuple):
    """One slot's part of a batched forward: `tokens` [n] at `positions` [n] with `tree_mask` [n, n] (None:
    causal), on top of the slot's committed rows; LM heads of `logits_rows` only (a prompt piece needs its last row's
    at most). (A plain tuple of the first four does as well.)"""

    slot: int
    tokens: Tensor
    positions: Tensor | None = None
    tree_mask: Tensor | None = None
    logits_rows: slice | None = None  # the rows whose LM head the step needs (None: every row)


class TargetPool:
    """`slots` sibling targets of `target`'s model (see the module docstring)."""

    def __init__(self, target: TargetModel, slots: int):
        if slots < 1:
            raise EagleSpecError(f"a batch needs at least one slot, got {slots}")
        self.target = target
        self.targets: list[TargetModel] = [target.sibling() for _ in range(slots)]
        self.free: list[int] = list(range(slots - 1, -1, -1))  # a stack: the lowest slot is taken first
        lead = self.targets[0]
        # rows of several slots in one pass: where every row's bits are its own (module docstring)
        self.together = isinstance(lead, FastTarget) and (lead.tree_kernel or lead.device.type == "cuda")
        # a prompt may be read in pieces, each riding in a batched forward, with the bits of reading it whole
        self.chunked_prefill = isinstance(lead, FastTarget) and lead.tree_kernel
        self.forwards = 0  # batched forwards so far
        self.rows = 0  # rows they verified

    @property
    def size(self) -> int:
        return len(self.targets)

    @property
    def in_use(self) -> int:
        return self.size - len(self.free)

    def acquire(self) -> int:
        """A free slot (its cache empty); raise when all are taken."""
        if not self.free:
            raise EagleSpecError(f"all {self.size} slots of the batch are in use")
        slot = self.free.pop()
        self.targets[slot].reset()
        return slot

    def release(self, slot: int) -> None:
        """Give a slot back: its rows are free at once."""
        if slot in self.free or not 0 <= slot < self.size:
            raise ValueError(f"slot {slot} is not in use")
        self.targets[slot].reset()
        self.free.append(slot)

    def __getitem__(self, slot: int) -> TargetModel:
        return self.targets[slot]

    @torch.inference_mode()
    def forward(self, steps: list[SlotStep | tuple], greedy: bool | list[bool] = False) -> list[TargetOutput]:
        """One step of each slot in `steps` (each slot at most once; a prompt, a piece of one, or a draft tree over
        committed rows); returns their outputs in order. `greedy`: for all slots or one flag per slot
        (`TargetModel.forward`'s: a greedy slot's tokens come from the greedy head where the target has one, as its
        batch-1 greedy step's do). Commit each slot's rows (`self[slot].commit(keep)`) before its next forward."""
        steps = [SlotStep(*s) for s in steps]
        if len({s.slot for s in steps}) != len(steps):
            raise ValueError("a slot can take part in a batched forward only once")
        flags = list(greedy) if isinstance(greedy, (list, tuple)) else [greedy] * len(steps)
        if len(flags) != len(steps):
            raise ValueError(f"got {len(flags)} greedy flags for {len(steps)} slots")
        self.forwards += 1
        self.rows += sum(s.tokens.numel() for s in steps)
        if not self.together or len(steps) == 1:
            return [self.targets[s.slot].forward(s.tokens, s.positions, s.tree_mask, s.logits_rows, greedy=g)
                    for s, g in zip(steps, flags)]
        return _forward_together([self.targets[s.slot] for s in steps], steps, flags)


def _forward_together(targets: list[FastTarget], steps: list[SlotStep], greedy: list[bool]) -> list[TargetOutput]:
    """FastTarget.forward's step for several slots at once: the rows of all of them through each layer's products
    together, each slot's rows attending over its own cache (as its batch-1 step would)."""
    lead = targets[0]
    kernel = all(t.tree_kernel for t in targets)  # every slot's attention in one kernel call per layer
    tokens, cos, sin, attends, sizes, masks = [], [], [], [], [], []
    for t, s in zip(targets, steps):
        c, n = t.cache_len, s.tokens.numel()
        positions = t.make_room(n, s.positions)  # [n]
        step_rows = None
        if n > 1:
            step_rows = (torch.ones(n, n, dtype=torch.bool).tril_() if s.tree_mask is None else s.tree_mask)
            step_rows = step_rows.to(t.device).contiguous()  # [n, n]: the step rows each row sees
        masks.append(step_rows)
        if not kernel:  # one attention call per slot over its cache (a GPU)
            mask = None
            if step_rows is not None:
                mask = torch.ones(n, c + n, dtype=torch.bool, device=t.device)
                mask[:, c:] = step_rows
                mask = mask[None, None]
            attends.append(partial(_attend_torch, t, c=c, mask=mask))
        tokens.append(s.tokens.to(t.device))
        cos.append(t.cos[positions])
        sin.append(t.sin[positions])
        sizes.append(n)
    x = lead.embed_tokens(torch.cat(tokens))  # [N, d], N = all slots' rows
    cos_all, sin_all = torch.cat(cos)[None], torch.cat(sin)[None]  # [1, N, hd]
    heads = (lead.n_heads, lead.n_kv, lead.head_dim)
    feature_layers = lead.eagle3_layers() if lead.feature_kind == "eagle3" else ()
    saved = []
    cached = [t.cache_len for t in targets]
    if kernel and lead.kernel_stack is not None:  # every layer in one call into the kernels (backends.cpu.stack)
        x, saved = lead.kernel_stack(x, cos_all[0], sin_all[0], [t.layer_keys for t in targets],
                                     [t.layer_values for t in targets], cached, sizes, masks, feature_layers)
    else:
        for i, layer in enumerate(lead.layers):
            if i in feature_layers:
                saved.append(x)

            def attend(q: Tensor, k: Tensor, v: Tensor, layer_index: int = i) -> Tensor:
                # q [H, N, hd], k, v [Hkv, N, hd] -> [H, N, hd]: each slot's rows over its own cache
                if kernel:
                    return lead.kernels.attend_tree_batch(q, k, v, [t.layer_keys[layer_index] for t in targets],
                                                          [t.layer_values[layer_index] for t in targets], cached,
                                                          sizes, masks)
                out, start = [], 0
                for run, n in zip(attends, sizes):
                    rows = slice(start, start + n)
                    out.append(run(layer_index, q[:, rows], k[:, rows], v[:, rows]))
                    start += n
                return torch.cat(out, dim=1)

            x = decoder_layer(layer, x, cos_all, sin_all, heads, lead.eps, lead.attention_dtype, attend)
    last = rms_norm(x, lead.final_norm, lead.eps)  # [N, d]
    features = lead.features_of(last, saved)  # [N, F] or None

    # The LM heads of the rows each slot needs, greedy slots' through the greedy head (the argmax of the exact
    # logits, as their batch-1 steps get it: the argmax of the bfloat16 logits can differ), the others' logits.
    head_rows, start = [], 0  # per slot, its rows of [N] that need a head
    for s, n in zip(steps, sizes):
        head_rows.append(range(start, start + n)[s.logits_rows if s.logits_rows is not None else slice(None)])
        start += n
    found: dict[bool, tuple[Tensor | None, Tensor | None]] = {}  # greedy or not -> (logits, tokens) of its rows
    for kind in set(greedy):
        rows = [i for r, g in zip(head_rows, greedy) if g == kind for i in r]
        wanted = last if len(rows) == last.shape[0] else last[torch.tensor(rows, device=last.device)]  # [R, d]
        found[kind] = lead.heads(wanted, kind)
    outputs, start, taken = [], 0, {kind: 0 for kind in found}
    for t, n, g, rows in zip(targets, sizes, greedy, head_rows):
        logits, best = found[g]
        picked = slice(taken[g], taken[g] + len(rows))
        taken[g] += len(rows)
        t._pending = n
        outputs.append(TargetOutput(logits=None if logits is None else logits[picked],
                                    features=None if features is None else features[start : start + n],
                                    greedy_tokens=None if best is None else best[picked],
                                    argmax_rows=t.kernels.argmax_rows))
        start += n
    return outputs


def _attend_torch(t: FastTarget, layer: int, q: Tensor, k: Tensor, v: Tensor, c: int,
                  mask: Tensor | None) -> Tensor:
    return write_and_attend(q, k, v, keys=t.layer_keys[layer], values=t.layer_values[layer], c=c, mask=mask,
                            keys_transposed=t.keys_transposed)
