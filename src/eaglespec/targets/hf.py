"""Target adapter: the only module that touches transformers internals.

`TargetModel` runs a transformers causal LM over (tokens, position ids, tree attention mask) on top of its KV
cache of the committed prefix, returns logits and the features a draft head reads, and commits the accepted
path (keeps those KV rows, drops the rest). It uses only public model entry points (`get_decoder()`,
`lm_head`, a custom 4D attention mask, explicit `position_ids`, a `DynamicCache`) plus the cache layers'
key/value tensors for the commit.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor

from ..errors import EagleSpecError

FEATURE_KINDS = ("final", "eagle3")


def _argmax_rows(logits: Tensor) -> Tensor:
    return logits.argmax(-1)


class TargetOutput:
    """A forward's next-token logits at every input position and the features a draft head reads."""

    def __init__(self, logits: Tensor | None, features: Tensor | None, greedy_tokens: Tensor | None = None,
                 argmax_rows: Callable[[Tensor], Tensor] | None = None, last: Tensor | None = None):
        self.head_logits = logits  # [n, vocab] as the LM head gave them (bfloat16 for a bfloat16 model)
        self.features = features  # [n, F]: "final": post-norm last hidden (F=d); "eagle3": 3 layers fused (F=3d)
        # [n] int64: the greedy token of each row, where a `forward(..., greedy=True)` computed it instead of the
        # logits (FastTarget.greedy_head); then head_logits is None
        self.greedy_tokens = greedy_tokens
        # [n, vocab] -> [n]: torch.argmax(-1)'s answer (first index of the maximum), the target's fastest way
        self.argmax_rows = argmax_rows or _argmax_rows
        self.last = last  # [n, d]: the post-norm last hidden rows (the LM head's input), where the target keeps them
        self._logits: Tensor | None = None

    @property
    def logits(self) -> Tensor:
        """[n, vocab] float32, converted on first use: greedy decoding reads `head_logits` (an argmax; the same
        answer), which saves a bfloat16 step a float32 copy of its rows x 49152 logits."""
        if self.head_logits is None:
            raise RuntimeError("this forward computed greedy tokens only (greedy=True): run it with greedy=False "
                               "for logits")
        if self._logits is None:
            self._logits = self.head_logits.float()
        return self._logits

    def greedy(self) -> list[int]:
        """The greedy (argmax) token of every row."""
        if self.greedy_tokens is not None:
            return self.greedy_tokens.tolist()
        return self.argmax_rows(self.head_logits).tolist()

    @classmethod
    def join(cls, pieces: list["TargetOutput"], heads: str = "all") -> "TargetOutput":
        """One output for an input read as consecutive pieces (`pieces`: their forwards' outputs, in order): the
        features of every row, and the logits or greedy tokens of every row (`heads="all"`) or of the last
        piece's rows only (`heads="last"`: earlier pieces may have computed none)."""
        end = pieces[-1]
        features = None if end.features is None else torch.cat([p.features for p in pieces])  # [sum n, F]
        last = None if any(p.last is None for p in pieces) else torch.cat([p.last for p in pieces])  # [sum n, d]
        if heads == "last":
            return cls(end.head_logits, features, end.greedy_tokens, end.argmax_rows, last)
        logits = None if end.head_logits is None else torch.cat([p.head_logits for p in pieces])
        best = None if end.greedy_tokens is None else torch.cat([p.greedy_tokens for p in pieces])
        return cls(logits, features, best, end.argmax_rows, last)


class TargetEnds:
    """A target's two ends without its decoder: the input embedding and the LM head. Training reads nothing else of
    the target once its features are cached, so the decoder layers (most of its memory) can go."""

    def __init__(self, embed_tokens: torch.nn.Module, lm_head: torch.nn.Module, softcap: float | None = None):
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.softcap = softcap
        self.device = lm_head.weight.device
        self.dtype = lm_head.weight.dtype

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def in_float32(self, stored: Callable[[torch.nn.Parameter], Tensor | None] | None = None) -> "TargetEnds":
        """These ends with float32 copies of the embedding and the LM head (themselves where float32 already), for
        training's inputs and labels when the target runs in bfloat16. `stored(weight)`: that matrix as the
        checkpoint holds it, in float32, or None (e.g. `targets.source.stored_copy`: a float32 checkpoint's own
        values, not their bfloat16 rounding); without it, or where it gives None, the weights upcast. A tied LM head
        stays tied to the embedding."""
        if self.dtype == torch.float32:
            return self
        weights: dict[int, torch.nn.Parameter] = {}  # id of a bfloat16 matrix -> its float32 copy

        def float32(module: torch.nn.Module) -> torch.nn.Module:
            key = id(module.weight)
            if key not in weights:  # (a tied LM head finds the embedding's)
                saved = None if stored is None else stored(module.weight)
                weights[key] = torch.nn.Parameter(saved if saved is not None else module.weight.detach().float(),
                                                  requires_grad=False)  # [V, d]
            # a copy of the module with the float32 matrix in place of its own (the memo hands it to deepcopy, so
            # the bfloat16 matrix is not copied first), its other tensors (a bias, a scale) in float32
            return copy.deepcopy(module, {key: weights[key]}).float()

        return TargetEnds(float32(self.embed_tokens), float32(self.lm_head), self.softcap)

    def logits_from_last(self, last: Tensor, vocab_ids: Tensor | None = None) -> Tensor:
        """The target's logits [..., V] (float32, soft-capped like its forward) from post-norm hidden states
        [..., d]; with `vocab_ids` [Vd] only those columns [..., Vd] (a reduced draft vocabulary)."""
        last = last.to(self.dtype)
        if vocab_ids is None:
            logits = self.lm_head(last).float()
        else:
            weight = self.lm_head.weight[vocab_ids.to(self.device)]  # [Vd, d]
            bias = None if self.lm_head.bias is None else self.lm_head.bias[vocab_ids.to(self.device)]
            logits = torch.nn.functional.linear(last, weight, bias).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class TargetModel:
    """A causal LM with a tree-aware KV cache. One sequence at a time (batch size 1)."""

    quantize: str | None = None  # weight-only quantization of the linear layers (FastTarget only)
    activations: str = "bfloat16"  # what GGUF block products multiply with ("int8": FastTarget only)
    requantized: bool = False  # a draft model's weights rounded to 4-bit blocks (FastTarget only)

    def __init__(self, model, feature_kind: str | None = "final"):
        if feature_kind not in (None, *FEATURE_KINDS):
            raise ValueError(f"feature_kind must be one of {FEATURE_KINDS} or None")
        self.model = model
        self.config = model.config.get_text_config(decoder=True)
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.embed_tokens = model.get_input_embeddings()
        self.feature_kind = feature_kind
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        layer_types = getattr(self.config, "layer_types", None) or []
        window = getattr(self.config, "sliding_window", None)
        # Models with sliding-window layers (Gemma 3, some Qwen2) get one mask per layer type.
        self.sliding_window: int | None = window if window and "sliding_attention" in layer_types else None
        self.softcap: float | None = getattr(self.config, "final_logit_softcapping", None)
        self.reset()

    # ---- what runs it ------------------------------------------------------------------------------
    def hardware_class(self) -> str:
        """The key of the per-machine tree defaults (drafters.autotree.DEFAULT_TREES)."""
        return "gpu" if self.device.type == "cuda" else "cpu"

    def backend_signature(self) -> str:
        """What the costs of this target's steps depend on beyond its weights and shape (a cache key)."""
        return "transformers"

    def weight_bytes(self) -> int:
        """Bytes of the weights one forward reads, as stored: every parameter but the input embedding, of which a
        forward reads only its tokens' rows (unless the LM head is the same tensor)."""
        embedding = self.embed_tokens.weight
        tied = getattr(self.lm_head, "weight", None) is embedding
        return sum(p.numel() * p.element_size() for p in self.model.parameters() if tied or p is not embedding)

    def sibling(self) -> "TargetModel":
        """Another target of the same model and settings with its own, empty KV cache (the weights are shared):
        the slots of a batch (eaglespec.targets.pool)."""
        return TargetModel(self.model, self.feature_kind)

    # ---- shape facts -------------------------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    @property
    def model_type(self) -> str:
        return self.config.model_type

    def eagle3_layers(self) -> tuple[int, int, int]:
        """Indices into HF `hidden_states` (= inputs of these layers): low, middle, high."""
        n = self.num_layers
        return (min(2, n - 1), n // 2, max(n - 3, 0))

    @property
    def feature_size(self) -> int:
        return self.hidden_size * (3 if self.feature_kind == "eagle3" else 1)

    # ---- cache ---------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the committed prefix (start a new sequence)."""
        from transformers import DynamicCache

        # No config on purpose: every layer keeps all its rows, and sliding windows are applied by our mask,
        # so a commit is a plain gather on every layer.
        self.cache = DynamicCache()
        self.cache_len = 0  # committed rows
        self._pending = 0  # rows appended by the last forward, not yet committed

    def commit(self, keep: Tensor | None = None) -> None:
        """Keep the KV rows of nodes `keep` ([m] indices into the last forward's inputs, ascending order of
        depth) and drop the other rows of that forward. `None` keeps them all (prefill, plain steps)."""
        n = self._pending
        if n == 0:
            return
        if keep is None or (keep.numel() == n and bool((keep.cpu() == torch.arange(n)).all())):
            self.cache_len += n
            self._pending = 0
            return
        rows = torch.cat([torch.arange(self.cache_len), self.cache_len + keep.cpu()]).to(self.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(-2, rows)  # [1, kv_heads, cache_len + m, head_dim]
            layer.values = layer.values.index_select(-2, rows)
        self.cache_len += keep.numel()
        self._pending = 0

    # ---- forward -------------------------------------------------------------------------------------
    def _attention_mask(self, positions: Tensor, tree_mask: Tensor | None):
        """Additive float mask [1, 1, n, cache_len + n] (0 = attend, dtype-min = blocked), or a dict per layer
        type for models with sliding-window layers."""
        n = positions.numel()
        if tree_mask is None:  # plain causal block
            tree_mask = torch.ones(n, n, dtype=torch.bool, device=self.device).tril_()
        allowed = torch.cat([torch.ones(n, self.cache_len, dtype=torch.bool, device=self.device), tree_mask], dim=1)
        blocked_value = torch.finfo(self.dtype).min

        def additive(ok: Tensor) -> Tensor:
            mask = torch.zeros(ok.shape, dtype=self.dtype, device=self.device)
            return mask.masked_fill_(~ok, blocked_value)[None, None]

        if self.sliding_window is None:
            return additive(allowed)
        key_positions = torch.cat([torch.arange(self.cache_len, device=self.device), positions])
        in_window = (positions[:, None] - key_positions[None, :]) < self.sliding_window
        return {"full_attention": additive(allowed), "sliding_attention": additive(allowed & in_window)}

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        tree_mask: Tensor | None = None,
        logits_rows: Tensor | slice | None = None,
        greedy: bool = False,
    ) -> TargetOutput:
        """Run the target on `tokens` [n] at `positions` [n] (default: consecutive after the prefix), where
        `tree_mask` [n, n] bool says which of these tokens each one sees (default: causal). Every input also
        sees the whole committed prefix. Call `commit` before the next forward. `logits_rows`: the rows to compute
        logits for (default all). `greedy`: the caller needs only each row's argmax (`TargetOutput.greedy`); a
        target may then skip the logits (FastTarget does with the bfloat16 kernels; this one computes them)."""
        if self._pending:
            raise RuntimeError("commit() the previous forward before running another one")
        tokens = tokens.to(self.device)
        n = tokens.numel()
        if positions is None:
            positions = torch.arange(self.cache_len, self.cache_len + n, device=self.device)
        positions = positions.to(self.device)
        if int(positions.max()) >= self.max_context:
            raise EagleSpecError(
                f"sequence reaches position {int(positions.max())}, beyond the model's context of {self.max_context}"
            )
        mask = self._attention_mask(positions, None if tree_mask is None else tree_mask.to(self.device))
        want_layers = self.feature_kind == "eagle3"
        out = self.decoder(
            input_ids=tokens[None],
            position_ids=positions[None],
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=want_layers,
        )
        self._pending = n
        last = out.last_hidden_state[0]  # [n, d], after the final norm
        rows = last if logits_rows is None else last[logits_rows]
        logits = self.lm_head(rows).float()  # [rows, vocab]
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.feature_kind == "final":
            features = last
        elif want_layers:
            features = torch.cat([out.hidden_states[i][0] for i in self.eagle3_layers()], dim=-1)  # [n, 3d]
        else:
            features = None
        return TargetOutput(logits=logits, features=features)

    # ---- training ------------------------------------------------------------------------------------
    @torch.no_grad()
    def features_for_batch(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                           compute_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """Whole right-padded sequences, no KV cache (for training a head): input_ids, attention_mask [B, T].
        Returns (last [B, T, d]: post-norm last hidden, the LM head's input; features [B, T, F] of this adapter's
        feature_kind), in the model's dtype. `compute_dtype` (e.g. bfloat16 for a float32 model) runs the matrix
        products in that dtype under autocast, keeping the weights as they are. Leaves the generation cache
        untouched."""
        if input_ids.shape[1] > self.max_context:
            raise EagleSpecError(
                f"training sequence of {input_ids.shape[1]} tokens exceeds the context of {self.max_context}")
        want_layers = self.feature_kind == "eagle3"
        autocast = compute_dtype is not None and compute_dtype != self.dtype
        with torch.autocast(self.device.type, dtype=compute_dtype, enabled=autocast):
            out = self.decoder(
                input_ids=input_ids.to(self.device),
                attention_mask=None if attention_mask is None else attention_mask.to(self.device),
                use_cache=False,
                output_hidden_states=want_layers,
            )
        last = out.last_hidden_state.to(self.dtype)  # [B, T, d]
        if want_layers:
            features = torch.cat([out.hidden_states[i] for i in self.eagle3_layers()], dim=-1)  # [B, T, 3d]
            features = features.to(self.dtype)
        else:
            features = last
        return last, features

    def logits_from_last(self, last: Tensor, vocab_ids: Tensor | None = None) -> Tensor:
        """The target's logits [..., V] (float32, soft-capped like `forward`) from post-norm hidden states [..., d];
        with `vocab_ids` [Vd] only those columns [..., Vd] (a reduced draft vocabulary)."""
        return self.ends().logits_from_last(last, vocab_ids)

    def ends(self) -> "TargetEnds":
        """The input embedding and the LM head alone (they share this target's tensors)."""
        return TargetEnds(self.embed_tokens, self.lm_head, self.softcap)
