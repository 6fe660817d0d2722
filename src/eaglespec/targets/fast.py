"""A lean target forward for Llama-style models (Llama, Qwen2): same interface as `TargetModel`, faster steps.

Why it is faster than calling the transformers model: a pre-allocated KV cache with in-place commit of the
accepted path (no concatenation or gathering of whole caches per step), fused QKV and gate/up matrices (3 matmuls
fewer per layer), RoPE tables computed once, a boolean mask built once per step, and little Python per layer.
Weights are read from the transformers model (nothing is copied from its source); with `quantize` the linear
layers are kept as int8 / int4 weight-only matrices (`eaglespec.backends.cpu.quant`). Once a layer's fused copy is
built, the model's original matrices of that layer are released where they can be read back from its checkpoint
(`targets.source`), so one copy of the weights stays in memory. It is checked token for token
against the generic `TargetModel` path in tests/test_fastpath.py.

Float32 weights (and bfloat16 ones on a CPU with native bfloat16 arithmetic) are pre-packed for oneDNN
(`eaglespec.backends.cpu.packed`): on a CPU a product of 2-16 rows then costs about what one row costs, instead of twice
as much, which is what makes verifying a draft tree cheap.

Row-invariant decode steps. Speculative decoding is lossless only if a token's logits in a multi-token verify pass
equal those of a one-token step. By default on a CPU every decode step is row-invariant:
- bfloat16 weights on a CPU with AVX-512 BF16 or AVX2 + FMA (`kernels`): the products, the decode-step attention
  (`backends.cpu.attention.write_and_attend_tree`: each query row attends over the cached prefix and then its own path
  of tree rows, in sequence order) and the greedy LM head are eaglespec's C++ kernels (eaglespec.backends.cpu.kernels),
  each of which gives a row the same bits whatever else is in the call; the remaining operations of a step (norms, RoPE,
  SiLU, residual adds) work on each row alone. There the whole step's layers are one call into the kernels
  (`backends.cpu.stack`, C++: no torch operator between the products), which is also the fastest path those CPUs
  have: as fast as the layers compiled by torch.compile, without compiling. (`$EAGLESPEC_STACK=0` runs the layers in
  Python instead, with the same guarantees; `--compile` then compiles them.)
- elsewhere (float32, or no C++ compiler): `make_target` sets `row_invariant`: packed products too wide to be
  row-invariant are split into input chunks (`packed.pack_row_invariant`) and each query row gets its own attention
  call over exactly the keys it may see, laid out as the one-token step that computes it sees them. Quantized
  targets (`eaglespec.backends.cpu.quant`) always attend this way. `exact=False` (`--no-exact`) keeps one batched
  attention call instead: faster there, but a verified row can then differ from a one-token step in its last bits (~4e-5
  of a logit on SmolLM2-135M in float32), which a near-tie can turn into another token.
Prompt prefills attend through the kernel too where it runs, so a prompt row's bits do not depend on how the
prompt was cut: a prompt read in pieces (`spec.batch`'s chunked prefill, or `MAX_STEP_ROWS` here) leaves the same
cache as one call. Elsewhere the prefill is one batched call (and is then never cut).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backends.cpu.apply import check_activations, check_quantize, plan_target
from ..errors import EagleSpecError
from . import source
from .cache_rows import CacheRows
from .hf import TargetModel, TargetOutput
from .layers import Linear, decoder_layer, rms_norm, write_and_attend
from .traffic import tensor_bytes

SUPPORTED = ("llama", "qwen2")
# a longer prompt is read in pieces of this many rows where that gives the same bits (the kernels' attention): the
# attention's per-row paths and the step mask grow with the square of a call's rows
MAX_STEP_ROWS = 512
_BUILT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (weights state, {plan: built weights})


def _weights_state(model) -> tuple | None:
    """Each parameter's storage and in-place version counter: changes when a weight is modified or replaced.
    None where versions are not tracked (inference tensors), and then nothing is shared."""
    try:
        return source.weights_state(model)
    except RuntimeError:
        return None


def supports(model) -> bool:
    """True when `model` is a plain Llama-style decoder this fast path reproduces exactly."""
    c = model.config.get_text_config(decoder=True)
    rope = getattr(c, "rope_parameters", None) or {}
    layer_types = getattr(c, "layer_types", None) or []
    return (
        c.model_type in SUPPORTED
        and rope.get("rope_type", "default") == "default"
        and getattr(c, "hidden_act", "silu") == "silu"
        and not getattr(c, "mlp_bias", False)
        and "sliding_attention" not in layer_types
        and getattr(model.get_decoder(), "layers", None) is not None
    )


@dataclass
class _Layer:
    input_norm: Tensor  # [d]
    qkv: Linear  # d -> (H + 2 Hkv) hd
    o: Linear  # H hd -> d
    post_norm: Tensor  # [d]
    gate_up: Linear  # d -> 2 I
    down: Linear  # I -> d


class FastTarget(TargetModel):
    """`TargetModel` with its own forward for Llama-style models. Construct through `make_target`."""

    def __init__(self, model, feature_kind: str | None = "final", initial_capacity: int = 1024,
                 quantize: str | None = None, pack: bool | None = None, row_invariant: bool | None = None,
                 attention_dtype: torch.dtype | None = None, compile: bool = False, kernels: bool | None = None,
                 activations: str | None = None, requantize: bool = False):
        """`quantize`: None (the model's own weights), "int8" or "int4" weight-only (see eaglespec.backends.cpu.quant).
        `pack`: weights pre-packed for oneDNN (eaglespec.backends.cpu.packed); None = wherever available.
        `row_invariant`: decode steps attend row by row (module docstring); None = when quantized.
        `attention_dtype`: of the attention arithmetic and of the KV cache (but see `cache_dtype` below); None =
        float32 for a half-precision target on a CPU, the model's dtype elsewhere.
        `compile`: decode steps run the layers through torch.compile (eaglespec.backends.cpu.compiled); call `warm_up()`
        to compile before timing anything. Not where the layers run as the kernels' decoder stack (as fast, no
        compiling): there only a draft head's steps are compiled (backends.cpu.apply.eagle_drafter).
        `kernels`: products, decode-step attention and greedy LM head through eaglespec's CPU kernels (bfloat16
        weights on a CPU with AVX-512 BF16 or AVX2 + FMA, `bf16gemm.available`), eager or compiled; every row then
        gets the same bits whatever else is in the step, so verify passes are exact. None = wherever available.
        `activations`: "bfloat16" (None) or "int8": the layers' 4-bit and 6-bit block products (a GGUF model's
        weights) quantize their inputs to int8 per block of 32 and multiply in integers, as llama.cpp does
        (backends.cpu.apply.check_activations); other products keep bfloat16 inputs. "auto" (an `Engine`'s
        default): int8 where those products run and it measured faster. `self.activations` is what runs.
        `requantize` (a draft model's target only): where the kernels' 4-bit products run, every layer matrix and the
        LM head's logits as 4-bit blocks, the GGUF file's own Q4_K where it has them, else rounded to Q4_1
        (backends.cpu.q4.round_blocks): another model, read in about 4.5 bits a weight instead of 6.5 (Q6_K, Q5_0) to
        16 (bfloat16), for drafts the target verifies (their bits only change what is proposed); greedy steps take
        the argmax of those logits. `self.requantized` is whether it runs."""
        super().__init__(model, feature_kind)
        c = self.config
        self.n_heads = c.num_attention_heads
        self.n_kv = getattr(c, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // self.n_heads
        self.eps = float(c.rms_norm_eps)
        # what the products, the decode-step attention and the LM head run on: the CPU backend decides (its apply.py)
        self.kernels = plan_target(self.dtype, self.device, self.head_dim, quantize, pack, row_invariant,
                                   attention_dtype, compile, kernels, activations, requantize)
        k = self.kernels
        self.quantize, self.compiled, self.bf16_gemm, self.pack = k.quantize, k.compiled, k.bf16_gemm, k.pack
        self.row_invariant, self.attention_dtype = k.row_invariant, k.attention_dtype
        self.requantized = k.requantize
        self.attention_kernel, self.tree_kernel = k.attention_kernel, k.tree_kernel
        self.cache_dtype, self.keys_transposed = k.cache_dtype, k.keys_transposed
        # The fused and packed weights, built once per model, plan and state of its weights: targets built from one
        # model with the same plan (the bench's methods, engines sharing a model) share them instead of holding a
        # copy each (read-only). A weight changed in place or replaced since gives the model a new state.
        state = _weights_state(model)
        key = (*k.weights_key(), self.dtype, str(self.device), source.gguf_file(model))  # (Q4_K blocks: kquant)
        built = _BUILT.get(model)
        if built is None or built[0] != state or state is None:
            built = (state, {})
            if state is not None:
                _BUILT[model] = built  # (a changed model's older copies go)
        if key not in built[1]:
            source.restore(model)  # (matrices an earlier plan's build released come back first)
            logits_head, greedy_head = k.lm_head(self.lm_head)  # greedy steps' token without every logit
            if logits_head is not self.lm_head:  # (copied: the original is read back from the file where used)
                source.evict(model, self.lm_head.weight)
            k.open_q4_source(model)
            layers = []
            for layer in self.decoder.layers:  # each layer's originals go once its own copy is built
                layers.append(self._fuse(layer))
                source.release(model, layer)
            k.close_q4_source()
            built[1][key] = (layers, logits_head, greedy_head, k.q4_matrices, k.q6_matrices)
        else:  # built before: originals brought back since (for the generic path, say) go again
            for layer in self.decoder.layers:
                source.release(model, layer)
        self.layers, self.logits_head, self.greedy_head, self.q4_matrices, self.q6_matrices = built[1][key]
        k.q4_matrices, k.q6_matrices = self.q4_matrices, self.q6_matrices  # layer matrices read as exact blocks, codes
        self.activations = "int8" if k.int8_inputs and self.q4_matrices + self.q6_matrices else "bfloat16"
        if activations == "int8" and not self.q4_matrices + self.q6_matrices:
            raise EagleSpecError("--activations int8 applies to weights stored as 4-bit blocks or 6-bit codes (a "
                                 "GGUF model's Q4_K, Q4_1, Q6_K, Q5_0 matrices); this model has none: drop it")
        self.final_norm = self.decoder.norm.weight.detach()
        self._weight_bytes: int | None = None  # weight_bytes(), counted once
        heads = (self.n_heads, self.n_kv, self.head_dim)
        self.kernel_stack = k.kernel_stack(self.layers, heads, self.eps)  # every layer in one kernel call, or None
        self.stack = None  # the compiled layers (decode steps), with --compile where the kernel stack does not run
        self.compiled_steps = 0  # forwards that ran through it
        if self.compiled and self.kernel_stack is None:  # (graphs of the layers in Python: no faster than the stack)
            features = self.eagle3_layers() if self.feature_kind == "eagle3" else ()
            self.stack = k.compile_stack(self.layers, (self.n_heads, self.n_kv, self.head_dim), self.eps, features,
                                         self.device)
        rope = getattr(c, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        self.capacity = 0
        self._grow(min(initial_capacity, self.max_context))

    def _fuse(self, layer) -> _Layer:
        a, m = layer.self_attn, layer.mlp
        bias = None
        if a.q_proj.bias is not None:
            bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
        return _Layer(
            input_norm=layer.input_layernorm.weight.detach(),
            qkv=self.kernels.layer_linear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), bias,
                                   (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)),
            o=self.kernels.layer_linear(a.o_proj.weight, None, (a.o_proj.weight,)),
            post_norm=layer.post_attention_layernorm.weight.detach(),
            gate_up=self.kernels.layer_linear(torch.cat([m.gate_proj.weight, m.up_proj.weight]), None,
                                       (m.gate_proj.weight, m.up_proj.weight)),
            down=self.kernels.layer_linear(m.down_proj.weight, None, (m.down_proj.weight,)),
        )

    def hardware_class(self) -> str:
        return self.kernels.hardware_class(self.device)

    def sibling(self, initial_capacity: int = 1024) -> "FastTarget":
        """`TargetModel.sibling`: the same plan (and so the same shared weights), eager steps (a batch's steps do
        not run through the compiled stack), its own KV cache of `initial_capacity` rows."""
        return FastTarget(self.model, self.feature_kind, initial_capacity, quantize=self.quantize, pack=self.pack,
                          row_invariant=self.row_invariant, attention_dtype=self.attention_dtype,
                          kernels=self.bf16_gemm, activations=self.activations, requantize=self.requantized)

    def backend_signature(self) -> str:
        return self.kernels.signature()

    def weight_bytes(self) -> int:
        """`TargetModel.weight_bytes` of the weights this plan runs (packed, quantized or 4-bit blocks): the distinct
        tensors its layers, final norm and LM head hold."""
        if self._weight_bytes is None:
            self._weight_bytes = tensor_bytes(self.layers, self.final_norm, self.logits_head)
        return self._weight_bytes

    # ---- static cache --------------------------------------------------------------------------------
    def _grow(self, capacity: int) -> None:
        """(Re)allocate the cache: per layer, [kv_heads, capacity, head_dim] keys and values (`cache_dtype`; keys
        [kv_heads, head_dim, capacity] with `keys_transposed`).

        One tensor per layer, each its own storage: the compiled layers write them in place, and views of one
        [layers, ...] tensor made dynamo check every pair of layers' written slices for overlap before each call
        (3,800 Python guards for 30 layers, ~1 ms a step; a write into a slice of the 4-d tensor itself became a
        copy of all of it per layer)."""
        def grown(old: Tensor | None, transposed: bool = False) -> Tensor:
            shape = (self.n_kv, self.head_dim, capacity) if transposed else (self.n_kv, capacity, self.head_dim)
            new = torch.zeros(shape, dtype=self.cache_dtype, device=self.device)
            if old is not None:
                (new[..., : self.capacity] if transposed else new[:, : self.capacity]).copy_(old)
            return new

        none = [None] * len(self.layers)  # nothing to copy on the first allocation
        self.layer_keys = [grown(old, self.keys_transposed) for old in (self.layer_keys if self.capacity else none)]
        self.layer_values = [grown(old) for old in (self.layer_values if self.capacity else none)]
        self.capacity = capacity
        positions = torch.arange(capacity, dtype=torch.float32)
        angles = positions[:, None] * self.inv_freq[None]  # [capacity, hd/2]
        emb = torch.cat([angles, angles], dim=-1)
        self.cos = emb.cos().to(self.dtype).to(self.device)  # [capacity, hd]
        self.sin = emb.sin().to(self.dtype).to(self.device)

    @property
    def keys(self) -> Tensor:
        """A copy of the key cache, [layers, kv_heads, capacity, head_dim] (for inspection)."""
        keys = torch.stack(self.layer_keys)
        return keys.transpose(2, 3).contiguous() if self.keys_transposed else keys

    @property
    def values(self) -> Tensor:
        """A copy of the value cache, [layers, kv_heads, capacity, head_dim] (for inspection)."""
        return torch.stack(self.layer_values)

    def reset(self) -> None:
        self.cache_len = 0
        self._pending = 0

    def warm_up(self) -> float:
        """With `compile`: compile the decode steps now (tens of seconds; empties the cache). Returns seconds."""
        return self.kernels.warm_up(self)

    @torch.inference_mode()
    def commit(self, keep: Tensor | None = None) -> None:
        n, c = self._pending, self.cache_len
        if n == 0:
            return
        if keep is None:
            self.cache_len += n
        else:
            kept = keep.tolist()
            m = len(kept)
            start = 0  # the leading kept rows already in place (a plain step, the first nodes of a path) stay
            while start < m and kept[start] == start:
                start += 1
            if start < m and self.keys_transposed:  # the kernel's layout: one call for every layer
                self.kernels.commit_rows(self.layer_keys, self.layer_values, c, kept)
            elif start < m:
                rows = c + keep[start:].to(self.device)
                for cache in (*self.layer_keys, *self.layer_values):
                    cache[:, c + start : c + m] = cache[:, rows]  # gather first (a copy), then write
            self.cache_len += m
        self._pending = 0

    def cached_rows(self, length: int) -> CacheRows:
        """Copies of the first `length` committed rows of every layer's cache."""
        if not 0 < length <= self.cache_len:
            raise ValueError(f"cannot copy {length} rows of a cache of {self.cache_len} committed rows")
        return self._cache_rows().prefix(length).clone()

    def _cache_rows(self) -> CacheRows:
        """Every layer's whole cache (views: capacity rows)."""
        return CacheRows(self.layer_keys, self.layer_values, self.keys_transposed)

    @torch.inference_mode()
    def load_rows(self, rows: CacheRows) -> None:
        """Make the cache hold exactly the rows given (`cached_rows` of a target of the same model and plan): a
        prompt's prefix read before, whose rows this target would compute with the same bits."""
        if self._pending:
            raise RuntimeError("commit() the previous forward before loading rows")
        if rows.keys_transposed != self.keys_transposed:
            raise ValueError("rows from a cache of another key layout: load rows from a target of the same plan")
        length = rows.length
        if length > self.capacity:
            self._grow(max(min(self.max_context, 2 * self.capacity), length))
        held = self._cache_rows().prefix(length)
        for cache, stored in zip((*held.keys, *held.values), (*rows.keys, *rows.values)):
            cache.copy_(stored)
        self.cache_len = length

    def truncate(self, length: int) -> None:
        """Keep only the first `length` committed rows (a draft model dropping the drafted tokens the target
        rejected). Nothing is cleared: attention reads rows [0, cache_len + n) only, and the next forward writes
        its rows from `length` on."""
        if self._pending:
            raise RuntimeError("commit() the previous forward before truncating the cache")
        if not 0 <= length <= self.cache_len:
            raise ValueError(f"cannot truncate a cache of {self.cache_len} committed rows to {length}")
        self.cache_len = length

    # ---- forward -------------------------------------------------------------------------------------
    @staticmethod
    def _visible_rows(tree_mask: Tensor, c: int) -> list[int | Tensor]:
        """Per query row r of a decode step over c cached rows (all of which every row sees): the end c + L of the
        cache slice [0, c + L) it sees when its visible step rows are the first L (an int), else those step rows,
        ascending (a LongTensor [L]: its ancestors and itself). tree_mask: [n, n] bool."""
        n = tree_mask.shape[0]
        counts = tree_mask.sum(dim=1)  # [n]
        first = torch.arange(n, device=tree_mask.device)[None] < counts[:, None]  # [n, n]: the first L rows
        leading = (tree_mask == first).all(dim=1).tolist()
        paths = tree_mask.nonzero()[:, 1].split(counts.tolist())  # per row, its visible step rows ascending
        return [c + path.numel() if lead else path for lead, path in zip(leading, paths)]

    def _write_and_attend_rows(self, layer: int, rows: list[int | Tensor], q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        c, n = self.cache_len, q.shape[1]
        self.layer_keys[layer][:, c : c + n] = k
        self.layer_values[layer][:, c : c + n] = v
        return self._attend_rows(layer, q, k, v, rows)

    def _attend_rows(self, layer: int, q: Tensor, k: Tensor, v: Tensor, rows: list[int | Tensor]) -> Tensor:
        """One attention call per query row over exactly its visible keys, laid out as a one-token step sees them:
        the cached prefix, then its path in sequence order. q: [H, n, hd]; k, v: [Hkv, n, hd] this step's rotated
        keys and values, already written to cache rows c..c+n-1. Returns [H, n, hd].

        A row whose path is not the first rows of the step gets its path copied into cache rows c..c+L-1 (a few
        rows; the prefix is never copied) and attends to the slice [0, c + L); those rows are restored after."""
        keys, values = self.layer_keys[layer], self.layer_values[layer]  # [Hkv, capacity, hd]
        c, gqa = self.cache_len, self.n_heads != self.n_kv
        out: list[Tensor | None] = [None] * len(rows)

        def attend(r: int, end: int) -> None:
            out[r] = F.scaled_dot_product_attention(q[None, :, r : r + 1], keys[None, :, :end], values[None, :, :end],
                                                    enable_gqa=gqa)[0]  # [H, 1, hd]

        branched = []
        for r, seen in enumerate(rows):  # slices first, while rows c..c+n-1 hold this step's keys in order
            if isinstance(seen, int):
                attend(r, seen)
            else:
                branched.append(r)
        for r in branched:
            path = rows[r]
            keys[:, c : c + path.numel()] = k[:, path]
            values[:, c : c + path.numel()] = v[:, path]
            attend(r, c + path.numel())
        if branched:  # restore the step rows the paths overwrote
            end = max(rows[r].numel() for r in branched)
            keys[:, c : c + end] = k[:, :end]
            values[:, c : c + end] = v[:, :end]
        return torch.cat(out, dim=1)  # [H, n, hd]

    @torch.inference_mode()
    def forward(self, tokens: Tensor, positions: Tensor | None = None, tree_mask: Tensor | None = None,
                logits_rows: Tensor | slice | None = None, greedy: bool = False) -> TargetOutput:
        """`TargetModel.forward`; `greedy`: where the target has a `greedy_head` (the bfloat16 kernels), return the
        greedy token of each row (`TargetOutput.greedy_tokens`) instead of the logits."""
        tokens = tokens.to(self.device)
        n, c = tokens.numel(), self.cache_len
        if self.tree_kernel and tree_mask is None and n > MAX_STEP_ROWS and logits_rows in (None, slice(-1, None)):
            if self._pending:
                raise RuntimeError("commit() the previous forward before running another one")
            positions = torch.arange(c, c + n) if positions is None else positions
            return self._forward_pieces(tokens, positions.to(self.device), logits_rows, greedy)
        positions = self.make_room(n, positions)
        step_rows = torch.ones(n, n, dtype=torch.bool, device=self.device).tril_() if tree_mask is None \
            else tree_mask.to(self.device)  # [n, n]: the step rows each row sees (the cached ones it sees all)
        # Row-invariant steps: for each query row, the end of the cache slice it sees, or its path of step rows.
        rows = None
        # every step (prompt prefills too) attends through the kernel beside its products, and row-invariant tree
        # steps where it builds; elsewhere prompt prefills keep one batched call (nothing is compared with them)
        exact_kernel = (self.row_invariant and self.attention_kernel and tree_mask is not None) or self.tree_kernel
        if exact_kernel and not self.keys_transposed:  # row_invariant was set after construction
            self.kernels.load()
            self.layer_keys = [keys.transpose(1, 2).contiguous() for keys in self.layer_keys]  # the kernel's layout
            self.keys_transposed = True
        if self.row_invariant and tree_mask is not None and not exact_kernel:
            rows = [c + 1] if n == 1 else self._visible_rows(step_rows, c)
        compiled_step = self.stack is not None and rows is None and c > 0  # decode steps; prompt prefills stay eager
        mask = None  # [1, 1, n, c + n]: the whole mask, where attention takes one (a one-token step sees every row)
        if n > 1 and not exact_kernel:
            allowed = torch.ones(n, c + n, dtype=torch.bool, device=self.device)
            allowed[:, c:] = step_rows
            mask = allowed[None, None]
        cos, sin = self.cos[positions][None], self.sin[positions][None]  # [1, n, hd]
        heads = (self.n_heads, self.n_kv, self.head_dim)

        x = self.embed_tokens(tokens)  # [n, d]
        feature_layers = self.eagle3_layers() if self.feature_kind == "eagle3" else ()
        step_mask = None  # the kernel's [n, n] mask of step rows (contiguous: the compiled graph reads it raw)
        if n > 1 and (self.tree_kernel or exact_kernel):
            step_mask = step_rows.contiguous()
        if self.kernel_stack is not None and exact_kernel and not compiled_step:
            # every layer in one call into the kernels (backends.cpu.stack); causal steps need no mask
            x, saved = self.kernel_stack(x, self.cos[positions], self.sin[positions], [self.layer_keys],
                                         [self.layer_values], [c], [n], [step_mask if tree_mask is not None else None],
                                         feature_layers)
        elif compiled_step:
            x, saved = self.stack(x, cos, sin, self.layer_keys, self.layer_values, c,
                                  step_mask if self.tree_kernel else mask)
            self.compiled_steps += 1
        else:
            saved = []
            for i, layer in enumerate(self.layers):
                if i in feature_layers:
                    saved.append(x)
                if exact_kernel:  # row-invariant decode steps through the kernel
                    attend = partial(self.kernels.attend_tree, keys=self.layer_keys[i], values=self.layer_values[i],
                                     c=c, step_mask=step_mask)
                elif rows is None:
                    attend = partial(write_and_attend, keys=self.layer_keys[i], values=self.layer_values[i], c=c,
                                     mask=mask, keys_transposed=self.keys_transposed)
                else:
                    attend = partial(self._write_and_attend_rows, i, rows)
                x = decoder_layer(layer, x, cos, sin, heads, self.eps, self.attention_dtype, attend)
        self._pending = n

        last = rms_norm(x, self.final_norm, self.eps)  # [n, d]
        rows = last if logits_rows is None else last[logits_rows]
        logits, best = self.heads(rows, greedy) if rows.shape[0] else (None, None)
        return TargetOutput(logits=logits, features=self.features_of(last, saved), greedy_tokens=best,
                            argmax_rows=self.kernels.argmax_rows, last=last)

    @torch.inference_mode()
    def features_for_batch(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                           compute_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """`TargetModel.features_for_batch` through this fast path (`eaglespec train head --feature-path fast`): each
        sequence is read as a prompt, in pieces of MAX_STEP_ROWS rows, on a sibling's own KV cache (this target's
        cache is untouched), so its rows are bit for bit those a draft head reads when drafting from this target.
        No logits are computed. Returns (last [B, T, d], features [B, T, F]) in the target's dtype; padding rows
        are zero."""
        if compute_dtype not in (None, self.dtype):
            raise EagleSpecError(f"the fast path computes features in {self.dtype}, as it decodes; it takes no "
                                 f"compute dtype ({compute_dtype})")
        b, t = input_ids.shape
        if t > self.max_context:
            raise EagleSpecError(f"training sequence of {t} tokens exceeds the context of {self.max_context}")
        lengths = [t] * b if attention_mask is None else attention_mask.sum(1).tolist()
        reader = self.sibling(initial_capacity=max(1, t))
        last = torch.zeros(b, t, self.hidden_size, dtype=self.dtype)
        features = None
        for row, n in enumerate(lengths):
            reader.reset()
            for start in range(0, int(n), MAX_STEP_ROWS):
                end = min(int(n), start + MAX_STEP_ROWS)
                out = reader.forward(input_ids[row, start:end], logits_rows=slice(0, 0))  # features, no logits
                reader.commit()
                if features is None:
                    features = torch.zeros(b, t, out.features.shape[-1], dtype=self.dtype)
                last[row, start:end] = out.last.cpu()
                features[row, start:end] = out.features.cpu()
        if features is None:  # (every sequence empty)
            features = last if self.feature_kind == "final" else torch.zeros(b, t, self.feature_size, dtype=self.dtype)
        return last, features

    def heads(self, rows: Tensor, greedy: bool) -> tuple[Tensor | None, Tensor | None]:
        """The LM heads of a step's final rows [R, d]: (logits [R, vocab] or None, greedy tokens [R] or None). A
        greedy step takes the greedy head's tokens where the target has one (the bfloat16 kernels: the argmax of
        the exact logits without all of them), else the logits."""
        best = self.greedy_head(rows) if greedy and self.greedy_head is not None else None  # [R] or None
        logits = self.logits_head(rows) if best is None else None  # [R, vocab] (TargetOutput.logits: float32)
        return logits, best

    def features_of(self, last: Tensor, saved: list[Tensor]) -> Tensor | None:
        """The features a draft head reads: last [n, d] the final-norm rows, saved the inputs of the layers in
        `eagle3_layers()` (in layer order). Returns [n, d], [n, 3d] or None (feature_kind)."""
        if self.feature_kind == "final":
            return last
        if self.feature_kind == "eagle3":
            layers = self.eagle3_layers()
            by_layer = dict(zip(sorted(set(layers)), saved))
            return torch.cat([by_layer[i] for i in layers], dim=-1)  # [n, 3d]
        return None

    def make_room(self, n: int, positions: Tensor | None) -> Tensor:
        """Before a step of `n` rows at `positions` (None: the next n), with the previous step committed: check
        the positions fit the model's context and grow the cache to hold the rows. Returns the positions [n] on the
        target's device."""
        if self._pending:
            raise RuntimeError("commit() the previous forward before running another one")
        c = self.cache_len
        positions = (torch.arange(c, c + n) if positions is None else positions).to(self.device)
        top = int(positions.max())
        if top >= self.max_context:
            raise EagleSpecError(f"sequence reaches position {top}, beyond the model's context of {self.max_context}")
        if c + n > self.capacity or top >= self.capacity:
            # Rows, not positions: a tree near the end of the context may need more rows than positions.
            self._grow(max(min(self.max_context, 2 * self.capacity), c + n, top + 1))
        return positions

    def _forward_pieces(self, tokens: Tensor, positions: Tensor, logits_rows: slice | None,
                        greedy: bool) -> TargetOutput:
        """A long prompt's forward as pieces of MAX_STEP_ROWS rows, each committed but the last (as `forward`
        leaves it): the same bits as one call wherever the kernels attend (module docstring)."""
        outs = []
        for start in range(0, tokens.numel(), MAX_STEP_ROWS):
            if outs:
                self.commit()
            piece = slice(start, start + MAX_STEP_ROWS)
            outs.append(self.forward(tokens[piece], positions[piece], None, logits_rows=logits_rows, greedy=greedy))
        return TargetOutput.join(outs, heads="all" if logits_rows is None else "last")  # else: the last row's head


def make_target(model, feature_kind: str | None = "final", backend: str = "auto",
                quantize: str | None = None, exact: bool | None = None, compile: bool = False,
                activations: str | None = None, requantize: bool = False) -> TargetModel:
    """`backend`: "auto" (fast path when the architecture is supported), "fast" (required) or "hf".
    `quantize` ("int8" / "int4" weight-only, CPU) needs the fast path.
    `exact`: every verified row bit-identical to the one-token step that would compute it, so greedy speculative
    output equals plain decoding's (fast path only). On a CPU the fast path is exact through eaglespec's kernels
    where they run (bfloat16 on AVX-512 BF16 or AVX2 + FMA: no cost) and otherwise attends row by row (slower); None
    (the default) = exact wherever the fast path runs on a CPU; False = batched attention, as on a GPU.
    `compile`: decode steps through torch.compile (fast path only; compiles here, tens of seconds).
    `activations`: "bfloat16" (None), "int8" (fast path only) or "auto" (FastTarget's; bfloat16 where it does not
    run). `requantize`: a draft model's layers and LM head as 4-bit blocks (FastTarget; fast path only, nothing
    elsewhere)."""
    if backend not in ("auto", "fast", "hf"):
        raise EagleSpecError(f"unknown backend '{backend}'; use auto, fast or hf")
    quantize = check_quantize(quantize)
    activations = check_activations(activations)
    options = ([f"--quantize {quantize}"] * bool(quantize) + ["--exact"] * bool(exact) + ["--compile"] * compile
               + ["--activations int8"] * (activations == "int8"))
    fast = backend == "fast" or (backend == "auto" and supports(model))
    if options and (backend == "hf" or not supports(model)):
        verb = "needs" if len(options) == 1 else "need"
        raise EagleSpecError(f"{' and '.join(options)} {verb} the fast path (Llama / Qwen2 models, --backend "
                             f"auto or fast); this is '{model.config.model_type}' with backend {backend}")
    if not fast:
        return TargetModel(model, feature_kind)
    if not supports(model):
        raise EagleSpecError(f"the fast path supports {', '.join(SUPPORTED)} models with default RoPE; "
                             f"this is '{model.config.model_type}': use --backend hf")
    if exact is None:
        exact = next(model.parameters()).device.type == "cpu"
    target = FastTarget(model, feature_kind, quantize=quantize, row_invariant=True if exact else None,
                        compile=compile, activations=activations, requantize=requantize)
    target.warm_up()  # compiles now (with --compile), not inside a timed step
    return target
