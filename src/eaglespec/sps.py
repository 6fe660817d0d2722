"""Classic speculative sampling (SpS) with a smaller draft model that shares the target's tokenizer.

The draft model proposes a greedy chain of `depth` tokens; the target verifies it like any other draft tree.
The draft model keeps its own KV cache of the committed sequence across rounds: its cache never holds
speculative rows, because each drafted token is run on top of the committed prefix and thrown away again.
The next round first reads the newly committed tokens (accepted drafts + the target's bonus token) in one
forward, whose last row also proposes the first draft token, so accepted drafts are simply recomputed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .drafters import Drafter, TreeSettings
from .target import TargetModel
from .tree import DraftTree, chain

_EMPTY = torch.zeros(0, dtype=torch.long)


class DraftModelDrafter(Drafter):
    """Greedy chain drafts from a small causal LM (`draft_hf_model`, a transformers model in eval mode)."""

    name = "sps"
    needs_features = False

    def __init__(self, draft_hf_model, settings: TreeSettings | None = None):
        self.settings = settings or TreeSettings()
        self.model = TargetModel(draft_hf_model, feature_kind=None)
        self.reset()

    @property
    def length(self) -> int:
        return min(self.settings.depth, self.settings.total_tokens - 1)

    def reset(self) -> None:
        self.model.reset()
        self.seen: list[int] = []  # tokens whose KV rows are committed in the draft model's cache

    def _sync(self, tokens: list[int]) -> int:
        """Make the cache a prefix of `tokens` minus its last token (so that one is always run, giving logits);
        return how many leading tokens the cache already covers."""
        common = 0
        limit = min(len(self.seen), len(tokens) - 1)
        while common < limit and self.seen[common] == tokens[common]:
            common += 1
        if common < len(self.seen):  # the committed sequence changed under us (new request): start over
            self.reset()
            common = 0
        return common

    @torch.inference_mode()
    def draft(self, tokens: Tensor, new_features: Tensor | None) -> DraftTree:
        ids = tokens.tolist()
        root = ids[-1]
        room = self.model.max_context - len(ids)  # draft positions still inside the draft model's context
        length = min(self.length, room)
        if length < 1:
            return DraftTree.root_only(root)
        start = self._sync(ids)
        out = self.model.forward(torch.tensor(ids[start:]))  # catch up on the committed tokens, root included
        self.model.commit()
        self.seen = list(ids)
        proposal = [int(out.logits[-1].argmax())]
        while len(proposal) < length:
            # Run every drafted token so far on top of the committed prefix, read the next one, drop the rows.
            out = self.model.forward(torch.tensor(proposal), logits_rows=slice(-1, None))
            self.model.commit(_EMPTY)
            proposal.append(int(out.logits[-1].argmax()))
        return chain([root] + proposal)
