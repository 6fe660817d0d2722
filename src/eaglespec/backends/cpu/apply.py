"""The one place the CPU backend is applied to a target and to a drafter.

`plan_target` decides what a fast-path target's products, decode-step attention and LM head run on (eaglespec's
C++ kernels, oneDNN-packed products, weight-only quantization, torch.compile, or plain torch) and builds them;
`eagle_drafter` does the same for an EAGLE head. The algorithm (eaglespec.spec, eaglespec.drafters) never looks
behind these choices: it sees `Linear` callables, a head `step`, a `topk` and an `argmax_rows`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...drafters.base import TreeSettings
from ...drafters.eagle import EagleDrafter
from ...drafters.lookup import Stage2
from ...errors import EagleSpecError
from ...heads.base import DraftHead
from ...targets import source
from . import attention, compiled, kernels, kquant, packcache, packed, q4, q6, stack
from .quant import check_mode
from .quant import quantize as quantize_linear

Linear = Callable[[Tensor], Tensor]


@dataclass
class TargetKernels:
    """What a `FastTarget` (eaglespec.targets.fast) runs on, decided once by `plan_target`."""

    quantize: str | None  # "int8" / "int4" weight-only products (eaglespec.backends.cpu.quant), or None
    compiled: bool  # decode steps through torch.compile (eaglespec.backends.cpu.compiled)
    bf16_gemm: bool  # products and LM head through eaglespec's bfloat16 (and exact 4-bit) kernels
    pack: bool  # products pre-packed for oneDNN (eaglespec.backends.cpu.packed)
    row_invariant: bool  # decode steps attend row by row where the kernel does not (targets.fast's docstring)
    attention_dtype: torch.dtype  # of the attention arithmetic
    attention_kernel: bool  # eaglespec's decode-step attention builds for this head size
    tree_kernel: bool  # every decode step attends through it, beside the kernels' products
    cache_dtype: torch.dtype  # of the KV cache
    keys_transposed: bool  # the kernel's key layout, [kv_heads, head_dim, capacity]
    int8_inputs: bool = False  # the 4-bit and 6-bit block products quantize their inputs to int8 (`ACTIVATIONS`)
    q4_matrices: int = 0  # layer matrices read as exact 4-bit blocks
    q6_matrices: int = 0  # layer matrices read as exact 6-bit codes
    # a draft model's target: every layer matrix and the LM head's logits as 4-bit blocks, the file's own Q4_K / Q4_1
    # where it has them, else rounded to Q4_1 (q4.round_blocks); only where the 4-bit products run (`plan_target`)
    requantize: bool = False
    q4_source: q4.FirstSource | None = field(default=None, repr=False)
    pack_cache: packcache.PackCache | None = field(default=None, repr=False)  # their packing from earlier processes

    @property
    def argmax_rows(self) -> Callable[[Tensor], Tensor]:
        """[n, vocab] -> [n] int64, torch.argmax(-1)'s answer, through the kernel where it is loaded."""
        return kernels.argmax_rows

    def hardware_class(self, device: torch.device) -> str:
        """The key of the per-machine tree defaults (drafters.autotree.DEFAULT_TREES): "gpu", or this CPU's kernel
        build ("amx", "avx512", "avx2"), else "cpu"."""
        if device.type == "cuda":
            return "gpu"
        build = kernels.isa()
        return build.name if build is not None else "cpu"

    def weights_key(self) -> tuple:
        """What the fused, packed weights built for a target depend on besides the model: targets of one model with
        the same key can share them."""
        return (self.quantize, self.compiled, self.bf16_gemm, self.pack, self.row_invariant,
                kernels.variant() if self.bf16_gemm else None, self.bf16_gemm and q4.available(), self.int8_inputs,
                self.requantize)

    def signature(self) -> str:
        """What the costs of this target's steps depend on beyond its weights and shape (a cache key)."""
        return "|".join([
            str(self.quantize), str(self.pack), str(self.row_invariant), str(self.compiled),
            kernels.variant() if self.bf16_gemm else "-",
            kernels.isa().name if self.attention_kernel else "-",
            # the kernels' sources: a change to a product or the attention changes the costs measured
            kernels.source_digest() if self.bf16_gemm else "-",
            f"q4x{self.q4_matrices}", f"q6x{self.q6_matrices}", *(["int8-inputs"] if self.int8_inputs else []),
            *(["requantized"] if self.requantize else []),
        ])

    # the kernel's decode-step attention and cache commit (keys_transposed layout)
    attend_tree = staticmethod(attention.write_and_attend_tree)
    attend_tree_batch = staticmethod(attention.write_and_attend_batch)  # several sequences' steps in one call
    commit_rows = staticmethod(attention.commit_rows)

    def warm_up(self, target) -> float:
        """With `compiled`: compile the target's decode steps now (tens of seconds), where it has compiled layers
        (not where its layers run as the kernels' decoder stack). Returns seconds."""
        return compiled.warm_up(target) if self.compiled and target.stack is not None else 0.0

    def load(self) -> None:
        """Build and load the C++ kernels now where they are used (not in the middle of the first generation)."""
        if self.bf16_gemm or self.attention_kernel:
            kernels.load()

    def linear(self, weight: Tensor, bias: Tensor | None = None) -> Linear:
        """A product of the LM head or of an eager layer outside the kernels."""
        if self.quantize:
            return quantize_linear(weight, bias, self.quantize)
        if self.pack:  # row-invariant steps: products too wide to be row-invariant are split (packed.py)
            return packed.pack_row_invariant(weight, bias) if self.row_invariant else packed.pack(weight, bias)
        return partial(F.linear, weight=weight.detach().contiguous(), bias=None if bias is None else bias.detach())

    def layer_linear(self, weight: Tensor, bias: Tensor | None = None, parameters: tuple[Tensor, ...] = ()) -> Linear:
        """A decoder layer's product: exact 4-bit blocks where the float32 checkpoint has that form (GGUF Q4_1) or the
        model's GGUF file holds the matrix as Q4_K, exact 6-bit codes where the file holds it as Q6_K or Q5_0 (on CPUs
        running the kernels; `parameters` are the model's weights stacked in `weight`), else the bfloat16 kernel, else
        (compiled) a plain nn.Linear that inductor packs itself, else `linear`. A fused group whose matrices the file
        stores in several block types (a Q6_K v beside Q4_K q and k) becomes one product per run of one type
        (`q4.SplitLinear`). With `requantize`, `_rounded`'s 4-bit blocks instead."""
        if self.requantize and self.q4_source is not None and weight.shape[-1] % q4.BLOCK == 0:
            return self._rounded(weight, bias, parameters)
        if self.q4_source is not None and len(parameters) > 1 and not self.q4_source.may_have(*parameters):
            split = self._split_linear(weight, bias, parameters)
            if split is not None:
                return split
        if self.q4_source is not None and parameters and self.q4_source.may_have(*parameters):
            cache = self.pack_cache
            key = cache.key(parameters) if cache is not None else ""
            known, packed = cache.get(key) if cache is not None else (False, None)
            linear = None
            if packed is not None:  # packed by an earlier process
                linear = _from_packed(packed, tuple(weight.shape), bias, self.int8_inputs)
                known = linear is not None  # a packing of another shape: not this matrix's, pack it again
            if linear is None and not known:
                blocks = self.q4_source.blocks(*parameters)
                if isinstance(blocks, q6.Codes):
                    linear = q6.Q6Linear(blocks, bias, self.int8_inputs) if q6.available() else None
                else:
                    linear = None if blocks is None else q4.Q4Linear(blocks, bias, self.int8_inputs)
                if cache is not None:
                    cache.put(key, None if linear is None else linear.packed)
            if linear is not None:
                if isinstance(linear, q6.Q6Linear):
                    self.q6_matrices += 1
                else:
                    self.q4_matrices += 1
                return linear
        if self.bf16_gemm:
            return kernels.Bf16Linear(weight, bias)
        return compiled.linear_module(weight, bias) if self.compiled else self.linear(weight, bias)

    def _rounded(self, weight: Tensor, bias: Tensor | None, parameters: tuple[Tensor, ...]) -> q4.Q4Linear:
        """A `requantize` target's layer matrix as one 4-bit product: the source's exact blocks where it holds the
        whole group as 4-bit blocks (a GGUF file's Q4_K), else `weight` rounded by `q4.round_blocks` (packing cached
        beside the exact ones', under its own key)."""
        exact = self.q4_source.blocks(*parameters) if parameters and self.q4_source.may_have(*parameters) else None
        self.q4_matrices += 1
        if isinstance(exact, (q4.Blocks, q4.SuperBlocks)):
            return q4.Q4Linear(exact, bias, self.int8_inputs)
        cache = self.pack_cache
        key = "rounded|" + cache.key(parameters) if cache is not None and parameters else ""
        packed = cache.get(key)[1] if key else None
        linear = None if packed is None else _from_packed(packed, tuple(weight.shape), bias, self.int8_inputs)
        if linear is None:
            linear = q4.Q4Linear(q4.round_blocks(weight), bias, self.int8_inputs)
            if key:
                cache.put(key, linear.packed)
        return linear

    def _split_linear(self, weight: Tensor, bias: Tensor | None,
                      parameters: tuple[Tensor, ...]) -> q4.SplitLinear | None:
        """`layer_linear` of each longest run of `parameters` a block source may hold whole (weight [N, K] and bias
        split by rows alike), or None where that leaves every run on the bfloat16 kernel."""
        runs, start = [], 0
        while start < len(parameters):
            end = len(parameters)
            while end > start + 1 and not self.q4_source.may_have(*parameters[start:end]):
                end -= 1
            runs.append(parameters[start:end])
            start = end
        if not any(self.q4_source.may_have(*run) for run in runs):
            return None
        parts, row = [], 0
        for run in runs:
            rows = slice(row, row + sum(p.shape[0] for p in run))
            parts.append(self.layer_linear(weight[rows], None if bias is None else bias[rows], run))
            row = rows.stop
        if all(isinstance(part, kernels.Bf16Linear) for part in parts):
            return None
        return q4.SplitLinear(parts)

    def lm_head(self, head: nn.Module) -> tuple[Linear, kernels.GreedyHead | None]:
        """(the logits product, the greedy head or None): with the kernels, greedy steps find their token without
        computing every logit (kernels.GreedyHead). With `requantize`, the logits from the head rounded to 4-bit
        blocks and no greedy head: a quarter of bfloat16's bytes, fewer than the greedy head's int8 screen reads (the
        0.5B's head: 6.7 ms for every logit against 8.4 for the screened token, AMX VM)."""
        if self.bf16_gemm:
            if self.requantize and head.weight.shape[-1] % q4.BLOCK == 0:
                return q4.Q4Linear(q4.round_blocks(head.weight), head.bias, self.int8_inputs), None
            greedy = None
            if head.bias is None and bool(head.weight.isfinite().all()):
                greedy = kernels.GreedyHead(head.weight)
            return kernels.Bf16Linear(head.weight, head.bias), greedy
        return (self.linear(head.weight, head.bias) if self.quantize or self.pack else head), None

    def open_q4_source(self, model) -> None:
        """Find the exact 4-bit blocks of `model`'s float32 checkpoint, or of the GGUF file it was converted from,
        while its layers are fused (`close_q4_source` after)."""
        self.q4_source = None
        if self.bf16_gemm and q4.available():
            gguf = source.gguf_file(model)
            self.q4_source = q4.FirstSource(q4.Float32Source(model),
                                            *([kquant.GGUFSource(model, gguf)] if gguf is not None else []))
            self.pack_cache = packcache.PackCache.of(model, self.q4_source.paths)

    def close_q4_source(self) -> None:
        if self.pack_cache is not None:
            self.pack_cache.save()
        self.q4_source = self.pack_cache = None

    def kernel_stack(self, layers: list, heads: tuple[int, int, int], eps: float) -> stack.KernelStack | None:
        """The layers as one call into the kernels (eaglespec.backends.cpu.stack) where every step attends through
        the kernel and every product runs on it; None elsewhere (the layers then run in Python)."""
        return stack.KernelStack.of(layers, heads, eps) if self.tree_kernel else None

    def compile_stack(self, layers: list, heads: tuple[int, int, int], eps: float, features: tuple[int, ...],
                      device: torch.device):
        return compiled.compile_stack(layers, heads, eps, self.attention_dtype, features, device,
                                      autotune=not self.bf16_gemm, tree_kernel=self.tree_kernel)


def _from_packed(packed: Tensor, shape: tuple[int, int], bias: Tensor | None, int8_inputs: bool) -> Linear | None:
    """The product of a cached packing of an [N, K] matrix (its layout told by its last size), or None where the
    tensor is no packing of that shape."""
    n, k = shape
    groups = -(-n // q4.COLUMNS)
    layouts = {q4.HALF_BYTES: (k // q4.BLOCK, q4.Q4Linear),
               q4.SUPER_BYTES: (k // (q4.BLOCK * q4.SUPER_BLOCKS), q4.Q4Linear),
               q6.PACKED_BYTES: (k // q6.BLOCK, q6.Q6Linear)}
    if packed.dim() != 3 or packed.dtype != torch.uint8 or packed.shape[-1] not in layouts:
        return None
    blocks, kind = layouts[packed.shape[-1]]
    if tuple(packed.shape[:2]) != (groups, blocks) or not packed.is_contiguous():
        return None
    return kind.from_packed(packed, shape, bias, int8_inputs)


ACTIVATIONS = ("auto", "bfloat16", "int8")  # what the 4-bit and 6-bit block products multiply the weights with


def check_activations(activations: str | None) -> str:
    """A valid `activations` choice ("bfloat16" for None), or a clear error. "bfloat16": the 4-bit and 6-bit block
    products (GGUF weights) multiply the exact weights with the bfloat16 activations. "int8": they quantize each
    row's inputs to 8-bit integers per block of 32 and multiply in integers, as llama.cpp does for the same file:
    another arithmetic for the model, decoded exactly (speculative decoding stays plain decoding of the same target,
    both running it). "auto" (the engine's default): int8 where those products run and it measured faster, the
    kernels' AVX-512 and AVX2 builds (`wants_int8_inputs`), else bfloat16."""
    activations = activations or "bfloat16"
    if activations not in ACTIVATIONS:
        raise EagleSpecError(f"unknown activations {activations!r}; use {', '.join(ACTIVATIONS)}")
    return activations


def wants_int8_inputs(activations: str, bf16_gemm: bool) -> bool:
    """Whether a target's block products take int8 inputs: asked for ("int8"), or "auto" where they run on the
    kernels and measured faster: the AVX-512 and AVX2 builds (the AMX build would multiply int8 inputs on AVX-512
    VNNI, not on its tiles, which make its bfloat16 rows cheap)."""
    if activations == "int8":
        return True
    return activations == "auto" and bf16_gemm and q4.available() and kernels.isa().name != "amx"


def check_quantize(mode: str | None, device: torch.device | str = "cpu") -> str | None:
    """A valid --quantize mode (None for none), or a clear error."""
    return check_mode(mode, device)


def plan_target(dtype: torch.dtype, device: torch.device, head_dim: int, quantize: str | None = None,
                pack: bool | None = None, row_invariant: bool | None = None,
                attention_dtype: torch.dtype | None = None, compile: bool = False,
                use_kernels: bool | None = None, activations: str | None = None,
                requantize: bool = False) -> TargetKernels:
    """Decide what a fast-path target with weights of `dtype` on `device` runs on; the arguments are FastTarget's
    (None = wherever available). `requantize` takes effect where the kernels' 4-bit products run."""
    quantize = check_mode(quantize, device)
    activations = check_activations(activations)
    can_kernel = quantize is None and kernels.available(dtype, device)
    if use_kernels and not can_kernel:
        raise EagleSpecError("eaglespec's kernels need bfloat16 weights on a CPU with AVX-512 BF16 or AVX2 + FMA, "
                             "a C++ compiler, and no --quantize")
    bf16_gemm = can_kernel if use_kernels is None else bool(use_kernels)
    int8_inputs = wants_int8_inputs(activations, bf16_gemm)
    if activations == "int8" and not (bf16_gemm and q4.available()):
        raise EagleSpecError("--activations int8 needs eaglespec's 4-bit block products: bfloat16 weights from a GGUF "
                             "file on a CPU with AVX-512 or AVX2 + FMA, a C++ compiler, no --quantize and "
                             "EAGLESPEC_Q4 not 0")
    if compile:
        # compiled graphs are row-invariant only with the kernels (they attend through the kernel too); the eager
        # row-by-row attention of quantized / row_invariant targets has no compiled form
        if quantize or (row_invariant and not bf16_gemm):
            raise EagleSpecError(compiled.CONFLICT)
        compiled.check_available(device)
    can_pack = quantize is None and packed.available(dtype, device)
    if pack and not can_pack:
        raise EagleSpecError("pack=True needs float32 weights (or bfloat16 on a CPU with native bfloat16) on a CPU "
                             "with oneDNN, and no --quantize")
    # (the kernels' steps are row-invariant by construction, whatever this says)
    invariant = quantize is not None if row_invariant is None else bool(row_invariant)
    # Half-precision targets on a CPU keep the KV cache and attend in float32: torch's CPU attention on bfloat16
    # costs 100-270 us per one-query call over 200-600 keys against 13-33 us in float32 (2 cores), which made
    # attention a third of a bfloat16 decode step. Keys and values are rounded to the model dtype first (as the
    # model computes them), so the cache holds the same values; only the attention arithmetic is wider.
    half = dtype in (torch.bfloat16, torch.float16)
    attention_dtype = attention_dtype or (torch.float32 if half and device.type == "cpu" else dtype)
    # eaglespec's row-invariant decode-step attention (`attention.write_and_attend_tree`) where it builds: every decode
    # step's attention beside the kernels' products (eager or compiled), and row-invariant steps (float32 --exact,
    # quantized targets) instead of one attention call per row
    attention_kernel = (attention_dtype == torch.float32 and head_dim % 16 == 0 and head_dim <= 256
                        and kernels.available(torch.bfloat16, device))
    tree_kernel = attention_kernel and bf16_gemm
    if row_invariant is None and bf16_gemm and not attention_kernel:
        invariant = True  # the kernel's products beside torch's attention (a head size it lacks): attend row by
        # row, or a verify pass's batched attention would round rows differently from one-token steps
    # A bfloat16 target's keys and values are bfloat16 values (rounded as the model computes them, in the compiled
    # graphs too). Where every decode step attends through the kernel, which widens them itself, the cache keeps
    # them in bfloat16: the same numbers in half the bytes, to read and to keep in the CPU's caches between steps.
    # Prefills and other attention calls widen the slice they read (`write_and_attend`).
    kernel_steps = tree_kernel or (attention_kernel and invariant)
    cache_dtype = dtype if kernel_steps and dtype == torch.bfloat16 else attention_dtype
    plan = TargetKernels(quantize=quantize, compiled=bool(compile), bf16_gemm=bf16_gemm,
                         pack=can_pack if pack is None else bool(pack), row_invariant=invariant,
                         attention_dtype=attention_dtype, attention_kernel=attention_kernel, tree_kernel=tree_kernel,
                         cache_dtype=cache_dtype, keys_transposed=kernel_steps, int8_inputs=int8_inputs,
                         requantize=bool(requantize) and bf16_gemm and q4.available())
    if kernel_steps:
        kernels.load()
    return plan


def eagle_drafter(head: DraftHead, embed_tokens: nn.Module, lm_head: nn.Module, mode: str = "dynamic",
                  settings: TreeSettings | None = None, compile: bool = False, use_kernels: bool = False,
                  target_logits: Linear | None = None, stage2: Stage2 | None = None,
                  extend: int = 0, dynamic: bool = False) -> EagleDrafter:
    """An `EagleDrafter` whose head runs on this backend: its linear layers packed for oneDNN on a CPU (a copy; the
    caller's head is left as it is), or with `use_kernels` (the target runs on them) through eaglespec's bfloat16
    kernel where it applies, and there the draft vocabulary's LM-head rows through an int8 copy unless
    EAGLESPEC_DRAFT_INT8=0 (kernels.Int8Linear: 8192 rows of SmolLM2's LM head 0.25 -> 0.17 ms a call; the drafts
    may differ a little, the accepted output cannot). `compile`: the head's decoder-layer steps through
    torch.compile (compiles here). `target_logits`: the target's packed LM head, which an EAGLE-1 head drafting over
    the full vocabulary shares instead of packing a second copy. `stage2`, `extend`, `dynamic`: as for
    `EagleDrafter`."""
    weight = next(head.parameters())
    kernel = (use_kernels or compile) and kernels.available(weight.dtype, weight.device)
    int8 = kernel and kernels.draft_int8()
    run = kernels.with_kernel(head) if kernel else packed.pack_linears(head)
    if int8 and isinstance(getattr(run, "lm_head", None), kernels.Bf16Linear):  # EAGLE-3's own LM head
        run.lm_head = kernels.Int8Linear(head.lm_head.weight, head.lm_head.bias)
    if hasattr(run, "pack_rows"):  # EAGLE-1: how to pack the target LM head's rows of the draft vocabulary
        if kernel:
            run.pack_rows = kernels.Int8Linear if int8 else kernels.Bf16Linear
        elif packed.available(weight.dtype, weight.device):
            run.pack_rows = packed.pack
    step = run.step
    if compile:
        step_head = run if kernel else head  # (inductor packs plain nn.Linear layers itself)
        step = compiled.compile_head_step(step_head, weight.device)
        compiled.warm_up_head_step(step, step_head)
    # the k best children of a node: eaglespec's top-k where the head runs through its kernels (the same children,
    # up to the order of equal scores), else torch's
    topk = kernels.topk_rows if kernel else None
    drafter = EagleDrafter(run, embed_tokens, lm_head, mode, settings, step=step, topk=topk, stage2=stage2,
                           extend=extend, dynamic=dynamic)
    if target_logits is not None and not kernel and hasattr(run, "share_packed_lm_head"):
        run.share_packed_lm_head(lm_head.weight, target_logits)
    return drafter
