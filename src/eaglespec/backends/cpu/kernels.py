"""eaglespec's own few-row bfloat16 products (csrc/common/bf16_gemm.h, with the micro-kernels of
csrc/avx512/bf16_gemm.h for CPUs with AVX-512 BF16 and csrc/avx2/bf16_gemm.h for CPUs with AVX2 + FMA), which every
bfloat16 decode step on such a CPU runs (eager or compiled), and the other CPU kernels built with them (`ISAS` below).

A decode step or a draft-tree verification multiplies 1-16 rows by each weight matrix. oneDNN's packed bfloat16
products cost ~13 us a call and stream these shapes at 17-22 GB/s, and inductor's C++ GEMM kernels compute in
float32 FMAs (4.7x slower than oneDNN at 8 rows on a 2-core AMD EPYC Zen 5; docs/cpu.md). This kernel reads
the packed weight once per call and multiplies with vdpbf16ps: all matrix products of a SmolLM2-135M step (2 cores,
called from Python, `benchmarks/microbench/bf16_gemm_cost.py`) take ~10-10.6 ms for 1-6 rows and 11.7 ms for 8,
against 13.4-15.5 ms with oneDNN (same machine). Calls of 7-64 rows run several register tiles over each weight
block while it is in L1 and prefetch the next, so the weights still stream once (Zen 5: 16 rows 7.31 -> 5.56 ms
against 3.81 for one row; `benchmarks/microbench/kernel_ab.py`). Each row gets the same bits whatever the number of
rows in the call.

Two multiply loops: vdpbf16ps, or float32 FMAs on weights widened from bfloat16 (`variant()` measures which is
faster once per machine and caches the choice; $EAGLESPEC_BF16_KERNEL=dpbf16|fma forces one, eaglespec.envs). On a
2-vCPU Intel Emerald Rapids VM vdpbf16ps issued at half the FMA rate, and the FMA loop did 12 rows' arithmetic 1.4x
faster (`benchmarks/microbench/kernel_variants.py`).

On a CPU with AMX (Intel Xeons from Sapphire Rapids on) the AMX build runs: the AVX-512 build with the 4-bit block
and 6-bit code products through AMX tiles, whose rows ride along with one row's weight unpacking (csrc/amx/).

The C++ sources are compiled on first use with torch's extension builder (g++, one translation unit a build: 15-40 s
on 2 cores; cached under ~/.cache/torch_extensions) and register `torch.ops.eaglespec.bf16_linear`, an operator
torch.compile keeps as one call in its graphs (`register_fake` below gives it shapes).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ... import envs
from ...errors import EagleSpecError

CSRC = Path(__file__).parent / "csrc"


@dataclass(frozen=True)
class Isa:
    """One build of the kernels: the CPU flags it needs, its sources (every file it compiles: the one translation
    unit, kernels.cpp, first, then the headers it includes) and compiler flags."""

    name: str
    cpu_flags: frozenset[str]
    sources: tuple[Path, ...]
    flags: tuple[str, ...]
    variants: tuple[str, ...]  # the multiply loops of its bf16_linear (VARIANTS' names)

    @property
    def has_q4(self) -> bool:
        """Whether this build has the 4-bit block product (torch.ops.eaglespec.q4_linear, eaglespec.backends.cpu.q4)."""
        return CSRC / self.name / "q4_gemm.h" in self.sources

    @property
    def has_q6(self) -> bool:
        """Whether this build has the 6-bit code product (torch.ops.eaglespec.q6_linear, eaglespec.backends.cpu.q6)."""
        return CSRC / self.name / "q6_gemm.h" in self.sources


# The bfloat16 products, the decode-step attention, the KV-cache commit of an accepted path, the verified rows'
# argmax, the draft's top-k and greedy decoding's screened LM head, built as one extension per instruction set.
# csrc/common/ holds every operator's host code once (argument checks, dispatch over rows and threads, registration;
# ops.h: the schemas), which calls the build's micro-kernels as isa::; csrc/avx512/ (AVX-512 with BF16 and VNNI) and
# csrc/avx2/ (AVX2 + FMA: most x86 CPUs of the last ten years, AMD Zen 1-3 and Intel's client cores among them) hold
# only the vector micro-kernels, and each build is one translation unit (its kernels.cpp), so torch's headers are
# parsed once a build. The AVX2 micro-kernels work on 8-lane vectors; its bfloat16 product is the FMA loop only (no
# bfloat16 dot-product instruction), with the same bits as the AVX-512 build's FMA loop, and the greedy screen
# multiplies bytes with vpmaddubsw instead of VNNI. The 4-bit block product (eaglespec.backends.cpu.q4) and the 6-bit
# code product (eaglespec.backends.cpu.q6) have micro-kernels in both folders: float32 FMAs on AVX2, vdpbf16ps on
# AVX-512 BF16. The AVX-512 build requires and
# passes the AVX2 + FMA + F16C flags too (GCC's -mavx512f does not imply -mf16c).
COMMON_SOURCES = tuple(CSRC / "common" / f"{name}.h" for name in (
    "shared", "ops", "bf16_gemm", "tree_attention", "commit_rows", "argmax_rows", "topk_rows", "screened_argmax",
    "q4_gemm", "q6_gemm", "decoder_stack"))
# in each ISA's folder
MICRO_KERNELS = ("bf16_gemm", "tree_attention", "activation", "argmax_rows", "topk_rows", "screened_argmax", "q4_gemm",
                 "q6_gemm")


def _sources(folder: str) -> tuple[Path, ...]:
    """A build's files: its translation unit, the host code and its micro-kernels."""
    return ((CSRC / folder / "kernels.cpp",) + COMMON_SOURCES
            + tuple(CSRC / folder / f"{name}.h" for name in MICRO_KERNELS))


# The AMX build: the AVX-512 build with the 4-bit block and 6-bit code products through AMX tiles (csrc/amx/:
# a verify pass's rows ride along with one row's weight unpacking, where vdpbf16ps is slow for the memory, as on
# Intel Xeons with AMX). Its sums differ from the AVX-512 build's in the last bits, as the AVX2 build's do.
AMX_SOURCES = ((CSRC / "amx" / "kernels.cpp",) + COMMON_SOURCES
               + tuple(CSRC / "amx" / f"{name}.h" for name in ("tiles", "q4_gemm", "q6_gemm"))
               + tuple(CSRC / "avx512" / f"{name}.h" for name in MICRO_KERNELS))
AVX512_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx512vnni",
                "-mfma", "-mf16c", "-fopenmp")
AVX512_CPU = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx2", "fma", "f16c"})

ISAS = {  # in order of preference
    "amx": Isa("amx", AVX512_CPU | {"amx_tile", "amx_bf16"}, AMX_SOURCES,
               AVX512_FLAGS + ("-mamx-tile", "-mamx-bf16"), ("dpbf16", "fma")),
    "avx512": Isa("avx512", AVX512_CPU, _sources("avx512"), AVX512_FLAGS, ("dpbf16", "fma")),
    "avx2": Isa("avx2", frozenset({"avx2", "fma", "f16c"}), _sources("avx2"),
                ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"), ("fma",)),
}
ISA_ENV = envs.KERNEL_ISA  # avx2 forces the AVX2 build on an AVX-512 CPU (to test or compare it)
ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA, SYS_ARCH_PRCTL = 0x1023, 18, 158  # Linux x86-64


@functools.cache
def amx_tiles_granted() -> bool:
    """Whether Linux lets this process use AMX tiles: it must ask once (arch_prctl ARCH_REQ_XCOMP_PERM); a kernel
    before 5.16, or a VM that does not pass the state through, says no."""
    import ctypes
    import platform

    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def _runs(build: Isa, flags: set[str]) -> bool:
    return build.cpu_flags <= flags and (build.name != "amx" or amx_tiles_granted())


@functools.cache
def isa() -> Isa | None:
    """The kernels' build for this CPU: AMX where it has AMX-BF16 (and the AVX-512 build's flags) and Linux grants
    the tiles, else AVX-512 where it has AVX-512 BF16 and VNNI, else AVX2 + FMA, else None ($EAGLESPEC_KERNEL_ISA
    picks another build where it would run: avx512 on an AMX CPU, avx2 on either)."""
    from ...platform import cpu_flags

    flags = cpu_flags()
    forced = envs.kernel_isa()
    if forced != "auto":
        if forced not in ISAS:
            raise EagleSpecError(f"{ISA_ENV}={forced!r} is not a kernel build; use auto, {', '.join(ISAS)}")
        return ISAS[forced] if _runs(ISAS[forced], flags) else None
    return next((build for build in ISAS.values() if _runs(build, flags)), None)


def cpu_supported() -> bool:
    """True on a CPU one of the kernels' builds runs on (AVX-512 BF16 + VNNI, or AVX2 + FMA)."""
    return isa() is not None


def can_build() -> bool:
    """True where torch's extension builder can compile the kernel: a C++ compiler and ninja (a dependency)."""
    from torch.utils.cpp_extension import is_ninja_available

    from ...platform import cpu_compiler_available

    return cpu_compiler_available() and is_ninja_available()


def available(dtype: torch.dtype, device: torch.device | str) -> bool:
    """True where `--compile` uses this kernel: bfloat16 weights on a CPU with AVX-512 BF16 or AVX2, and `can_build`
    (set EAGLESPEC_BF16_GEMM=0 to use oneDNN / inductor's products instead)."""
    return (dtype == torch.bfloat16 and torch.device(device).type == "cpu" and cpu_supported() and can_build()
            and envs.bf16_gemm_enabled())


STALE_LOCK_S = 600  # a build takes 15-40 s on 2 cores: a lock this old was left by a build that was killed


def clear_stale_build_lock(name: str, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove the lock file of torch's extension build `name` where it is older than `max_age_s`: a build that was
    interrupted (Ctrl-C, a killed process) leaves it behind, and every later process would then wait for it forever.
    Returns whether a lock was removed."""
    try:
        from torch.utils.cpp_extension import _get_build_directory  # (where torch's build keeps its lock file)

        lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    except (ImportError, OSError):
        return False
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:  # no lock: nothing to do
        return False
    if age < max_age_s:
        return False  # (another process may be building right now)
    print(f"eaglespec: removing a kernel build lock left {age / 60:.0f} min ago by an interrupted build ({lock})",
          file=sys.stderr)
    lock.unlink(missing_ok=True)
    return True


@functools.cache
def load() -> None:
    """Build (first time only) and load the kernels; registers torch.ops.eaglespec.bf16_*, tree_attention,
    commit_rows, argmax_rows, topk_rows, screened_argmax, int8_linear and q4_*."""
    from torch.utils.cpp_extension import load as build

    build_isa = isa()
    if build_isa is None:
        raise EagleSpecError("eaglespec's bfloat16 kernel needs a CPU with AVX-512 BF16 or AVX2 + FMA")
    print(f"eaglespec: loading its bfloat16 kernel ({build_isa.name}; built on first use, ~15-40 s)", file=sys.stderr,
          flush=True)
    name = "eaglespec_kernels" if build_isa.name == "avx512" else f"eaglespec_kernels_{build_isa.name}"
    clear_stale_build_lock(name)
    try:
        # (only the translation unit is compiled; torch's ninja build tracks the headers it includes)
        units = [str(source) for source in build_isa.sources if source.suffix == ".cpp"]
        build(name, units, extra_cflags=list(build_isa.flags),
              extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except (RuntimeError, OSError) as error:
        raise EagleSpecError(f"could not build eaglespec's bfloat16 kernel ({error}); set EAGLESPEC_BF16_GEMM=0 "
                             "to run without it") from error

    @torch.library.register_fake("eaglespec::bf16_linear")
    def _(x: Tensor, packed: Tensor, n: int, bias: Tensor | None, variant: int) -> Tensor:
        return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("eaglespec::int8_linear")
    def _(x: Tensor, packed: Tensor, scale: Tensor, n: int, bias: Tensor | None) -> Tensor:
        return x.new_empty(x.shape[0], n, dtype=torch.float32)

    if build_isa.has_q4:  # csrc/common/q4_gemm.h (eaglespec.backends.cpu.q4)
        @torch.library.register_fake("eaglespec::q4_linear")
        def _(x: Tensor, packed: Tensor, n: int, bias: Tensor | None) -> Tensor:
            return x.new_empty(x.shape[0], n)

        @torch.library.register_fake("eaglespec::q4_q8_linear")
        def _(x: Tensor, packed: Tensor, n: int, bias: Tensor | None) -> Tensor:
            return x.new_empty(x.shape[0], n)

    if build_isa.has_q6:  # csrc/common/q6_gemm.h (eaglespec.backends.cpu.q6)
        @torch.library.register_fake("eaglespec::q6_linear")
        def _(x: Tensor, packed: Tensor, n: int, bias: Tensor | None) -> Tensor:
            return x.new_empty(x.shape[0], n)

        @torch.library.register_fake("eaglespec::q6_q8_linear")
        def _(x: Tensor, packed: Tensor, n: int, bias: Tensor | None) -> Tensor:
            return x.new_empty(x.shape[0], n)

    @torch.library.register_fake("eaglespec::tree_attention")
    def _(q: Tensor, keys: Tensor, values: Tensor, step_mask: Tensor | None) -> Tensor:
        return q.new_empty(q.shape)


# The kernel's two ways to multiply (the `variant` argument of bf16_linear): vdpbf16ps, or float32 FMAs on weights
# widened from bfloat16. vdpbf16ps does twice the work per instruction; where it issues at half the FMA rate (Intel
# Sapphire / Emerald Rapids) both give the same arithmetic rate and the FMA loop runs faster (fewer dependent
# uops), so calls of 8-16 rows, which are bound by arithmetic there, cost less.
VARIANTS = {"dpbf16": 0, "fma": 1}
VARIANT_ENV = envs.BF16_KERNEL
MIN_GAIN = 1.1  # the FMA loop is chosen only where it is at least this much faster: a stable choice


def _time_variants(threads: int) -> dict[str, float]:
    """Median ms of a 12-row product of a 1536 x 576 weight (in L2, bound by arithmetic) for each variant."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(1536, 576, generator=generator).bfloat16()
    x = torch.randn(12, 576, generator=generator).bfloat16()
    packed_weight = torch.ops.eaglespec.bf16_pack(weight)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(9):
            for name, code in VARIANTS.items():
                start = time.perf_counter()
                for _ in range(10):
                    torch.ops.eaglespec.bf16_linear(x, packed_weight, 1536, None, code)
                times[name].append((time.perf_counter() - start) * 100)  # ms per call
    finally:
        torch.set_num_threads(previous)
    return {name: statistics.median(values) for name, values in times.items()}


@functools.cache
def variant() -> str:
    """The multiply loop for this machine: $EAGLESPEC_BF16_KERNEL (dpbf16 or fma) if set, else measured once per CPU
    model and instruction set (~50 ms, with this process's threads) and cached under ~/.cache/eaglespec/kernels, so
    that every run on a machine uses the same loop (the two give different bits; each is row-invariant). The AVX2
    build has the FMA loop only."""
    from ...platform import cache_root, cpu_flags, cpu_model

    build = isa()
    loops = build.variants if build is not None else tuple(VARIANTS)
    forced = envs.bf16_kernel_loop()
    if forced != "auto":
        if forced not in VARIANTS:
            raise EagleSpecError(f"{VARIANT_ENV}={forced!r} is not a kernel variant; use auto, dpbf16 or fma")
        if forced not in loops:
            raise EagleSpecError(f"{VARIANT_ENV}={forced}: the {build.name} build of the kernel has only the "
                                 f"{' and '.join(loops)} loop; unset it or use auto")
        return forced
    if len(loops) == 1:
        return loops[0]
    load()
    threads = torch.get_num_threads()
    machine = f"{cpu_model()}|{' '.join(sorted(cpu_flags()))}|{source_digest()}"
    path = cache_root() / "kernels" / f"{hashlib.sha1(machine.encode()).hexdigest()[:20]}.json"
    try:
        chosen = json.loads(path.read_text())["variant"]
        if chosen in VARIANTS:
            return chosen
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        pass  # not measured yet on this machine (or an unreadable file): measure
    ms = _time_variants(threads)
    chosen = "fma" if ms["dpbf16"] > MIN_GAIN * ms["fma"] else "dpbf16"
    try:  # written whole, then renamed: processes measuring at once all end up with the one choice that landed
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"variant": chosen, "ms_per_call": ms, "cpu": cpu_model(), "threads": threads}))
        os.replace(partial, path)
        landed = json.loads(path.read_text())["variant"]
        chosen = landed if landed in VARIANTS else chosen
    except (OSError, json.JSONDecodeError, KeyError) as error:  # a read-only cache: measured again next time
        print(f"eaglespec: could not cache the kernel choice in {path} ({error})", file=sys.stderr)
    return chosen


def source_digest() -> str:
    """A short digest of the kernels' code for this CPU, comments and blank space aside: part of the keys of cached
    measurements and of training-feature stores (hours of compute), which an edited comment then keeps."""
    build = isa()
    sources = build.sources if build is not None else ()
    return hashlib.sha1("\0".join(code_only(source.read_text()) for source in sources).encode()).hexdigest()[:12]


# a C++ comment, or a string or character literal (matched so that a "//" inside one is not taken for a comment)
_COMMENT_OR_LITERAL = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'", re.S)


def code_only(text: str) -> str:
    """C++ source without its comments, blank lines and runs of blanks (line breaks kept: they end preprocessor
    lines)."""
    text = _COMMENT_OR_LITERAL.sub(lambda m: " " if m.group(0)[0] == "/" else m.group(0), text)
    return "\n".join(" ".join(line.split()) for line in text.splitlines() if line.strip())


def loaded() -> bool:
    """Whether this process has loaded the kernels (a `--compile` bfloat16 target or head did)."""
    return load.cache_info().currsize > 0


def argmax_rows(logits: Tensor) -> Tensor:
    """[N, V] logits -> [N] int64, torch.argmax(-1)'s answer (first index of the maximum), through
    csrc/common/argmax_rows.h where the kernels are loaded (a few us a row against ~0.1-0.2 ms for torch on
    bfloat16)."""
    if (logits.dim() == 2 and logits.device.type == "cpu" and logits.dtype in (torch.bfloat16, torch.float32)
            and loaded()):
        return torch.ops.eaglespec.argmax_rows(logits)
    return logits.argmax(-1)


TOPK_MAX = 64  # csrc/common/topk_rows.h's largest k


def topk_rows(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(values, indices) of the k largest entries of each row of [N, V] (or [V]) float32 scores, values descending
    and equal values by ascending index, through csrc/common/topk_rows.h (~1-2 us a row of 8192 against ~24 us for
    torch.topk); torch.topk where that does not apply. Load the kernels first (`load`)."""
    if (scores.dtype == torch.float32 and scores.device.type == "cpu" and scores.dim() in (1, 2)
            and 1 <= k <= min(TOPK_MAX, scores.shape[-1])):
        if scores.dim() == 2:
            return torch.ops.eaglespec.topk_rows(scores, k)
        values, indices = torch.ops.eaglespec.topk_rows(scores[None], k)
        return values[0], indices[0]
    return torch.topk(scores, k, dim=-1)


INT8_LANES, INT8_BLOCK = 16, 32  # csrc/common/screened_argmax.h: columns per packed group, input channels per block


def int8_rows(weight: Tensor, chunk: int = 4096) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """An int8 copy of a [N, K] weight for csrc/common/screened_argmax.h's integer products, one scale per row: (packed
    [ceil(N/16), K32/4, 16, 4] uint8 holding q + 128, scale, b1, b2 [ceil(N/16) * 16] float32). b1 and b2 bound how far
    the int8 products can be from float32 ones (the kernel's comment has the derivation)."""
    w = weight.detach()
    n, k = w.shape
    u = 2.0 ** -24
    gamma = k * u / (1 - k * u)  # float32 rounding of a K-term sum, relative to the sum of magnitudes
    n_pad, k_pad = n + (-n % INT8_LANES), k + (-k % INT8_BLOCK)
    packed = torch.full((n_pad, k_pad), 128, dtype=torch.uint8)  # q + 128 (padding: q = 0)
    scale, b1, b2 = (torch.zeros(n_pad, dtype=torch.float32) for _ in range(3))
    for start in range(0, n, chunk):  # (float64 copies of a few thousand rows at a time)
        rows = w[start : start + chunk].double()  # [c, K], exact
        end = start + rows.shape[0]
        peak = rows.abs().amax(dim=1)  # [c]
        s = (peak / 127).float()  # [c] float32
        q = torch.where(s[:, None] > 0, torch.round(rows / s.double().clamp_min(1e-30)[:, None]), 0.0)
        q = q.clamp(-127, 127)
        err = (rows - q * s.double()[:, None]).abs().amax(dim=1)  # [c]: max |w - s q|, exact in float64
        packed[start:end, :k] = (q + 128).to(torch.uint8)
        scale[start:end] = s
        # |x|_1 times: the weights' quantization error, both float32 sums' rounding, a margin for the rest
        b1[start:end] = (1.01 * (err + 3 * gamma * peak) + 1e-5 * peak).float() * (1 + 1e-6)
        # sum_b sx_b times: the input's quantization error (sx_b / 2 a channel) against the block's sum |s q|
        block_q = torch.nn.functional.pad(q.abs(), (0, k_pad - k)).view(-1, k_pad // INT8_BLOCK, INT8_BLOCK)
        b2[start:end] = (1.01 * s.double() * block_q.sum(-1).amax(-1) / 2).float() * (1 + 1e-6)
    # 16 columns x 4 consecutive k per 64 bytes (one vpdpbusd operand)
    packed = packed.view(-1, INT8_LANES, k_pad // 4, 4).transpose(1, 2).contiguous()
    return packed, scale, b1, b2


class GreedyHead:
    """Greedy decoding's token for each row of x [M, K] under a bfloat16 LM head W [N, K] (no bias), reading an int8
    copy of W (half the bytes) and scoring exactly only the tokens it cannot rule out: csrc/common/screened_argmax.h
    has the bound that makes the answer the argmax of the exact float32 logits, ties to the lowest id. Holds the int8
    copy (N K bytes) and a reference to W. Integer products through AVX-512 VNNI, or vpmaddubsw in the AVX2 build
    (csrc/avx2/screened_argmax.h: the same exact integer sums, so the same bound and answer)."""

    def __init__(self, weight: Tensor):
        load()
        self.weight = weight.detach().to(torch.bfloat16).contiguous()  # [N, K]
        self.packed, self.scale, self.b1, self.b2 = int8_rows(self.weight)

    def __call__(self, x: Tensor) -> Tensor | None:
        """[M, K] -> [M] int64 token ids, or None where an input row is not finite (compute the logits then)."""
        best = torch.ops.eaglespec.screened_argmax(x.reshape(-1, x.shape[-1]).contiguous(), self.packed,
                                                   self.scale, self.b1, self.b2, self.weight)
        return None if bool((best < 0).any()) else best


class Int8Linear(nn.Module):
    """y = x W^T (+ b) from an int8 copy of W (one scale per row) and x quantized per block of 32 channels, through
    AVX-512 VNNI (csrc/common/screened_argmax.h; vpmaddubsw in the AVX2 build): half the bytes of bfloat16, approximate.
    For a draft head only, whose errors can cost acceptance but never change what the target accepts.
    x [..., K] -> [..., N] in x's dtype."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        super().__init__()
        load()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        packed_weight, scale, _, _ = int8_rows(weight)
        self.register_buffer("packed", packed_weight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, K]
        y = torch.ops.eaglespec.int8_linear(rows, self.packed, self.scale, self.out_features, self.bias)  # [M, N] f32
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)


class Bf16Linear(nn.Module):
    """y = x W^T (+ b) through the kernel, W packed once (as much memory as W). x [..., K] -> [..., N] bfloat16."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        super().__init__()
        load()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.variant = VARIANTS[variant()]
        self.register_buffer("packed", torch.ops.eaglespec.bf16_pack(weight.detach().to(torch.bfloat16).contiguous()))
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, K]
        y = torch.ops.eaglespec.bf16_linear(rows, self.packed, self.out_features, self.bias,
                                            self.variant)  # [M, N]
        return y.view(*x.shape[:-1], self.out_features)


def with_kernel(module: nn.Module) -> nn.Module:
    """A copy of `module` whose bfloat16 CPU `nn.Linear` layers run through the kernel (the draft heads under
    `--compile`: their layer step, EAGLE-3's fusion and draft LM head)."""
    from .packed import replace_linears

    return replace_linears(module, lambda linear: Bf16Linear(linear.weight, linear.bias)
                           if available(linear.weight.dtype, linear.weight.device) else None)


DRAFT_INT8_ENV = envs.DRAFT_INT8


def draft_int8() -> bool:
    """Whether drafts run int8 arithmetic where it is faster: draft heads that run on the kernels score their draft
    vocabulary through an int8 copy of its LM-head rows (`Int8Linear`), and draft models' 4-bit and 6-bit block
    products take int8 inputs (eaglespec.api); on unless $EAGLESPEC_DRAFT_INT8 is 0. Drafting only: the target's
    arithmetic is its own, so the output is the same. (A head's layer stays bfloat16: its products are too small
    to gain.)"""
    return envs.draft_int8()


DRAFT_Q4_ENV = envs.DRAFT_Q4


def draft_q4() -> bool:
    """Whether draft models (`sps`, `staged`) read their layers and LM head as 4-bit blocks (`FastTarget`'s
    `requantize`); on unless $EAGLESPEC_DRAFT_Q4 is 0. Drafting only, as `draft_int8`."""
    return envs.draft_q4()
