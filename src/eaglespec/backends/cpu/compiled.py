"""`--compile`: the fast path's decoder layers compiled by torch.compile (inductor), for decode steps.

A one-token step of a small model runs ~1,000 small operations besides its matrix products (norms, RoPE, casts,
residual adds, cache writes), each paying the dispatcher's and OpenMP's fixed cost: ~20% of a bfloat16 step of
SmolLM2-135M on 2 cores (docs/cpu.md, "--compile"). Inductor fuses them into a few C++ loops
per layer and, with `freezing`, packs the weights for oneDNN itself and folds the residual adds into the products.

What is compiled is `layers.decoder_layer`, the same function the eager path runs, over all layers. Each layer's
cache is passed as its own tensor: given one 4-d cache, the in-place write of a layer's rows became a copy of the
whole cache per layer (functionalization), ten times slower than eager, and per-layer views of it cost ~1 ms of
guards a call (below); a custom op hiding the write cost ~90 us of Python per call.

Three graphs, by the number of tokens n of a decode step (`graph_kind`): n = 1 (plain decoding), 2 <= n <=
SMALL_TREE (small draft trees) and larger trees. Their matrix products:
- bfloat16 weights on a CPU with AVX-512 BF16 or AVX2 + FMA: eaglespec's own kernel (`bf16gemm`, an operator the
  graphs call), which reads each weight once per call and multiplies with bfloat16 dot products or float32 FMAs on
  widened weights; rows cost little until ~6 with AVX-512, ~2 with AVX2.
- elsewhere on a CPU (float32, other CPUs): the first two graphs are compiled with max-autotune, where inductor's
  own C++ GEMM kernels (its CPP template) beat oneDNN's packed products on 1-4 rows (oneDNN pays ~13 us a call
  and streams these layer shapes at 17-22 GB/s); for 8 rows and more they lost to oneDNN (kernels tuned for 2
  rows took 38 ms at 8 against 21), so larger trees keep oneDNN's products.

Measured (SmolLM2-135M, bfloat16, a 2-core AMD EPYC Zen 4, 2026-11-24, `benchmarks/microbench/forward_cost.py
--compile`): with autotuned C++ GEMM / oneDNN products a one-token step 13.0 ms, 2-4 tree tokens 14.3-14.5 ms, 8
tokens ~21, 16 tokens 26.6; with the kernel, per-layer caches and the C++ wrapper 11.8, 12.3-12.8 ms up to 6 tokens,
15.3 at 8, 20.4 at 16.

The graphs are called from C++ (inductor's `cpp_wrapper`) without per-call size assertions, and the KV cache is
one tensor per layer (FastTarget._grow): dynamo's guards over views of one cache tensor cost ~1 ms a call.

Where the products are that kernel, the graphs also attend through eaglespec's decode-step attention
(`attention.write_and_attend_tree`, csrc/common/tree_attention.h) and round bfloat16 work where eager does
(`compile_settings`): every row of a verify pass then has the bits of the plain step that would compute it, so
greedy speculative decoding equals plain decoding in bfloat16, as in eager steps through the same kernels.

The draft head's decoder-layer step is compiled the same way when the target is (`compile_head_step`, two or three
graphs: one row, several rows); a bfloat16 head's products (step, fusion, draft LM head) then use the kernel too.
Before the kernel (Zen 4, 2026-11-24): a draft round of the EAGLE-3 head on a 4-token tree went from 3.83 to 3.42 ms
a step. A head step gets its past keys as contiguous [Hkv, S, hd]: the [1, Hkv, S, hd] views left by a rollback made
dynamo recompile every round (guards on strides).

Costs: compiling a target takes ~1-4 minutes on 2 cores (three graphs, done by `warm_up`; inductor's on-disk cache
makes later processes faster; prompt prefills stay eager); it needs a C++ compiler; the layers hold their weights
twice (the model's and the packed copy; peak RSS +0.5 GB for SmolLM2-135M). Off by default: the kernels also run in
eager decode steps, and compiling adds the fusion of what lies between them. Quantized targets are not compiled,
nor, where the kernels do not run, the row-by-row steps of `--exact` (`CONFLICT`).
"""

from __future__ import annotations

import itertools
import time
from contextlib import contextmanager
from functools import partial

import torch
from torch import Tensor, nn

from ...errors import EagleSpecError
from ...platform import cpu_compiler_available

RECOMPILE_LIMIT = 64  # graphs of DecodeStack.forward per process: three per compiled target
GRAPH_KINDS = ("one", "small", "large")
SERIAL_LOOP_ELEMENTS = 16384  # per thread, before inductor splits a fused loop over threads (compile_settings)
SMALL_TREE = 4  # decode steps of 2..SMALL_TREE tokens get their own graph (see graph_kind)
CONFLICT = ("--compile needs the model's own weights (not --quantize), and to stay exact eaglespec's kernels (bfloat16 "
            "on a CPU with AVX-512 BF16 or AVX2 + FMA); elsewhere add --no-exact to compile, or drop --compile")


def check_available(device: torch.device) -> None:
    """Raise a clear error where torch.compile's backend cannot build kernels."""
    if device.type == "cpu":
        if not cpu_compiler_available():
            raise EagleSpecError("--compile needs a C++ compiler for torch.compile's CPU backend: install one "
                                 "(e.g. `apt install g++`) or run without --compile")


def linear_module(weight: Tensor, bias: Tensor | None = None) -> nn.Linear:
    """A frozen `nn.Linear` around `weight` [N, K] (inductor's freezing packs module parameters, not free tensors)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return linear


class _LayerModule(nn.Module):
    """A `fastpath._Layer` whose products are `nn.Linear` modules, registered so the compiled graph owns them."""

    def __init__(self, layer):
        super().__init__()
        self.qkv, self.o, self.gate_up, self.down = layer.qkv, layer.o, layer.gate_up, layer.down
        self.register_buffer("input_norm", layer.input_norm)
        self.register_buffer("post_norm", layer.post_norm)


class DecodeStack(nn.Module):
    """All decoder layers of one decode step: x [n, d] -> (x [n, d], the inputs of `feature_layers`)."""

    def __init__(self, layers: list, heads: tuple[int, int, int], eps: float, attention_dtype: torch.dtype,
                 feature_layers: tuple[int, ...], tree_kernel: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(_LayerModule(layer) for layer in layers)
        self.heads, self.eps, self.attention_dtype = heads, eps, attention_dtype
        self.feature_layers = tuple(feature_layers)
        self.tree_kernel = tree_kernel  # attention through eaglespec's kernel (attention.write_and_attend_tree)
        self.owner = new_owner()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, keys: list[Tensor], values: list[Tensor], c: int,
                mask: Tensor | None, kind: str, owner: str) -> tuple[Tensor, list[Tensor]]:
        """keys, values: per layer [Hkv, capacity, hd] (FastTarget's cache, written in place; keys [Hkv, hd, capacity]
        with `tree_kernel`); mask: [1, 1, n, c + n] bool, or with `tree_kernel` the step rows' [n, n] part; None for
        one token. `kind` (`graph_kind`)
        and `owner` (this module's `owner`) only key the graph: dynamo guards on them, so each kind of step of each
        target gets its own compiled graph (`compile_stack` drops the guards on the module itself)."""
        from ...targets.layers import decoder_layer, write_and_attend
        from .attention import write_and_attend_tree

        if kind not in GRAPH_KINDS or owner != self.owner:  # (read here so that dynamo guards on them)
            raise ValueError(f"graph kind {kind} of {owner} called on {self.owner}")
        saved = []
        for i, layer in enumerate(self.layers):
            if i in self.feature_layers:
                saved.append(x)
            if self.tree_kernel:
                attend = partial(write_and_attend_tree, keys=keys[i], values=values[i], c=c, step_mask=mask)
            else:
                attend = partial(write_and_attend, keys=keys[i], values=values[i], c=c, mask=mask)
            x = decoder_layer(layer, x, cos, sin, self.heads, self.eps, self.attention_dtype, attend)
        return x, saved


@contextmanager
def compile_settings(autotune: bool, eager_roundings: bool = False):
    """The dynamo / inductor settings of every compiled call here (see `compile_stack`); `autotune`: let inductor's
    C++ GEMM kernels compete with oneDNN's products (max-autotune); `eager_roundings`: see below (the target's
    graphs; a draft head's step need not match anything bit for bit).

    `cpp_wrapper`: the graph's calls (fused loops, attention, the products) are made from C++, not from a Python
    function, and the per-call size/alignment assertions are dropped: a one-token step of a 30-layer model spent
    ~0.75 ms in that Python (`## Call CompiledFxGraph` self time; ~0.38 ms with both changes; 2 cores, 2026-11-24).

    `eager_roundings` (inductor's `emulate_precision_casts`): fused bfloat16 work is rounded to bfloat16 wherever
    eager rounds it (after the residual adds, RoPE, ...). Without it inductor kept some intermediates in float32, and
    not in the same places in the one-token graph as in the tree graphs, so a verified row differed from the plain
    step in its last bits and greedy bfloat16 outputs drifted from plain decoding (1-3 of 8 MT-bench answers
    identical; tests/test_tree_attention.py).

    `cpp.min_chunk_size` (SERIAL_LOOP_ELEMENTS): a fused loop runs on several threads only with that many elements
    per thread. Inductor's default (512) split the norms, RoPE and SiLU loops of every step whose token count is
    symbolic (the tree graphs) over both threads: an OpenMP parallel region ~5 times a layer for a few thousand
    elements. A 2-token verify pass of SmolLM2-135M under torch.profiler (a 2-vCPU AMD EPYC Zen 3, 2026-11-26):
    `## Call CompiledFxGraph` self time 2.61 -> 2.35 ms a step (the one-token graph: 1.62-1.67)."""
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), torch._inductor.config.patch(
            freezing=True, max_autotune=autotune, max_autotune_gemm_backends="CPP,ATEN" if autotune else "ATEN",
            cpp_wrapper=True, size_asserts=False, alignment_asserts=False, scalar_asserts=False,
            emulate_precision_casts=eager_roundings, **{"cpp.min_chunk_size": SERIAL_LOOP_ELEMENTS}):
        yield


RECOMPILE_STANCE = "fail_on_recompile"


def call_compiled(compiled, settings, *args):
    """`compiled(*args)`, where dynamo has to compile (a first call, a shape or kind not seen yet) inside
    `settings()` (a `compile_settings` context), which the compiler reads. Entering those settings costs ~80 us a
    call (torch's config patching; a draft round makes three compiled calls), so a call first runs under the
    "fail_on_recompile" stance (~8 us): a call whose graph exists runs as it is; one that would compile raises
    before anything runs, and runs again, compiling, inside the settings."""
    try:
        with torch.compiler.set_stance(RECOMPILE_STANCE):
            return compiled(*args)
    except RuntimeError as error:
        if RECOMPILE_STANCE not in str(error):
            raise
    with settings():
        return compiled(*args)


_OWNERS = itertools.count()


def new_owner() -> str:
    """A name no other compiled module of this process has (ids of dead objects are reused; this is not)."""
    return f"compiled-{next(_OWNERS)}"


def without_module_guards(guard_entries) -> list[bool]:
    """`guard_filter_fn` for torch.compile: check no attribute of the compiled nn.Module before a call (its weights
    are frozen into the graph and never change). Each DecodeStack / HeadStep passes its `owner` as an argument
    instead, which dynamo guards on, so another target's module never runs this one's graph."""
    return torch.compiler.skip_guard_on_all_nn_modules_unsafe(guard_entries)


def graph_kind(n: int) -> str:
    """Which compiled graph runs a decode step of `n` tokens: "one" (plain decoding), "small" (trees of up to
    SMALL_TREE tokens) or "large"."""
    return "one" if n == 1 else "small" if n <= SMALL_TREE else "large"


def compile_stack(layers: list, heads: tuple[int, int, int], eps: float, attention_dtype: torch.dtype,
                  feature_layers: tuple[int, ...], device: torch.device, autotune: bool = True,
                  tree_kernel: bool = False, eager_roundings: bool = True):
    """The compiled `DecodeStack` (compiles lazily, on its first calls; see `FastTarget.warm_up`). `autotune`: on a
    CPU, let inductor's C++ GEMM kernels compete for the products of one-token and small-tree steps (pointless
    where the layers' products are eaglespec's own kernel, `bf16gemm`). `tree_kernel`: attention through eaglespec's
    kernel (`DecodeStack`); `eager_roundings`: see `compile_settings` (off only to measure what it costs)."""
    # Without guards on the module (its ~700 attributes and buffers: ~0.25 ms a call); `owner` keys its graphs.
    module = DecodeStack(layers, heads, eps, attention_dtype, feature_layers, tree_kernel)
    stack = torch.compile(module, dynamic=True, options={"guard_filter_fn": without_module_guards})
    autotune_kinds = ("one", "small") if device.type == "cpu" and autotune else ()

    def run(x: Tensor, *args):
        kind = graph_kind(x.shape[0])
        # Read while compiling (`call_compiled`): freezing (weights as constants, packed by inductor; as a
        # torch.compile option it was not applied, torch 2.13), room for more than 4 targets per process (each adds
        # three graphs to DecodeStack.forward's cache; past the limit it would run eagerly), and, for steps of a
        # few rows on a CPU, inductor's own C++ GEMM kernels where they time faster than oneDNN's (max-autotune;
        # from ~8 rows oneDNN wins: 4.7x faster at 8 rows on 2 cores, 2026-11-24).
        settings = partial(compile_settings, autotune=kind in autotune_kinds, eager_roundings=eager_roundings)
        return call_compiled(stack, settings, x, *args, kind, module.owner)

    return run


class HeadStep(nn.Module):
    """One draft-head step as a pure function of its past keys and values, for torch.compile."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head
        self.owner = new_owner()

    def forward(self, hidden: Tensor, token_embeds: Tensor, positions: Tensor, past_keys: Tensor,
                past_values: Tensor, mask: Tensor, owner: str) -> tuple[Tensor, Tensor, Tensor]:
        """hidden, token_embeds [T, d]; past_keys/values [Hkv, S, hd] (contiguous: strides and a leading size-1
        dimension would be guarded on, one recompile per round); mask [T, S + T]; owner: this module's `owner`.
        Returns the output [T, d] and the keys and values with this step's rows appended [Hkv, S + T, hd]."""
        from ...heads.layer import KVCache

        if owner != self.owner:  # (read here so that dynamo guards on it: see DecodeStack.forward)
            raise ValueError(f"head step of {owner} called on {self.owner}")
        cache = KVCache(num_layers=1)
        cache.keys[0], cache.values[0] = past_keys[None], past_values[None]
        out = self.head.step(hidden, token_embeds, positions, cache, mask)
        return out, cache.keys[0][0], cache.values[0][0]


def compile_head_step(head: nn.Module, device: torch.device):
    """`head.step` with the decoder layer compiled (CPU: max-autotune, as for small target steps). Same call as
    `DraftHead.step`; the first step of a generation (an empty head cache, the whole prompt) runs eagerly."""
    module = HeadStep(head)
    step = torch.compile(module, dynamic=True, options={"guard_filter_fn": without_module_guards})
    autotune = device.type == "cpu"

    def run(hidden: Tensor, token_embeds: Tensor, positions: Tensor, cache, mask: Tensor) -> Tensor:
        if cache.keys[0] is None:
            return head.step(hidden, token_embeds, positions, cache, mask)
        # Drafting runs in inference mode, but an EAGLE-1 head's hidden rows are the target's features indexed
        # outside it (normal tensors): dynamo guards on that too, and recompiled for them (two more graphs).
        hidden, token_embeds = (t if t.is_inference() else t.clone() for t in (hidden, token_embeds))
        # (after a rollback the cache is a view of its longer self: contiguous() copies it once a round)
        past_keys, past_values = (t[0].contiguous() for t in (cache.keys[0], cache.values[0]))
        out, keys, values = call_compiled(step, partial(compile_settings, autotune), hidden, token_embeds,
                                          positions, past_keys, past_values, mask, module.owner)
        cache.keys[0], cache.values[0] = keys[None], values[None]
        return out

    return run


@torch.inference_mode()  # as drafting runs: grad mode is guarded on
def warm_up_head_step(run, head: nn.Module) -> None:
    """Compile the head step's graphs now, on a throwaway cache: one row and several rows, each at two cache
    lengths (dynamo makes a size symbolic once it has seen it change)."""
    from tqdm.auto import tqdm

    weight = next(head.parameters())
    x = torch.zeros(4, head.config.hidden_size, dtype=weight.dtype, device=weight.device)
    cache = head.new_cache()
    for n in tqdm((3, 1, 1, 2, 3), desc="torch.compile (draft head steps)", unit="step", leave=False):
        c = len(cache)  # 0 first: an eager step that fills the cache
        mask = torch.ones(n, c + n, dtype=torch.bool, device=x.device)
        mask[:, c:] = torch.ones(n, n, dtype=torch.bool, device=x.device).tril_()
        run(x[:n], x[:n], torch.arange(c, c + n, device=x.device), cache, mask)
        cache.commit()


def warm_up(target) -> float:
    """Run the decode shapes once so compilation happens now, not inside a timed step; the cache is left empty.
    Returns the seconds it took."""
    from tqdm.auto import tqdm

    start = time.perf_counter()
    target.reset()
    tokens = torch.zeros(3, dtype=torch.long)
    with tqdm(total=3, desc="torch.compile (decode steps)", unit="graph", leave=False) as bar:
        target.forward(tokens)  # prompt prefill: eager
        target.commit()
        for n in (1, 2, 2 * SMALL_TREE):  # the graphs of graph_kind; n is dynamic in the last two
            target.forward(torch.zeros(n, dtype=torch.long), tree_mask=torch.ones(n, n, dtype=torch.bool).tril_())
            target.commit()
            bar.update()
    target.reset()
    return time.perf_counter() - start
