"""Exact 4-bit block weights: products that read a model's weights in llama.cpp's Q4_1 form, losslessly.

Models that install here come as GGUF files, and eaglespec dequantizes them once into float32 (eaglespec.models). In a
Q4_1 tensor every block of 32 consecutive input channels of a row is d q + m with q in [0, 15] and d, m float16, so
the float32 weights carry 5 bits of information per weight while bfloat16 stores 16 and rounds them. `find_blocks`
recovers (d, m, q) from the float32 weights and checks that they rebuild every weight bit for bit; where they do,
`Q4Linear` multiplies through csrc/common/q4_gemm.h with the build's micro-kernels (csrc/avx2/q4_gemm.h: float32
FMAs; csrc/avx512/q4_gemm.h: vdpbf16ps on the q as bfloat16), which read 20 bytes per 32 weights (instead of 64 in
bfloat16) and sum each block as d sum(x q) + m sum(x), every product x q exact. Nothing is
approximated beyond float32 rounding: these products are those of the float32 model's weights (closer to it than
bfloat16 ones), with bfloat16 activations as in the bfloat16 kernel, and a row gets the same bits whatever else is in
the call.

A GGUF file's Q4_K matrices have the same form with d = d' sc and m = -(dmin mn) (d', dmin float16 per 256 weights,
sc and mn 6-bit integers); eaglespec.backends.cpu.kquant reads them from the file as `SuperBlocks`, packed as they are
in 18.5 bytes per 32 weights (the file's 18), the kernels multiplying d' sc and dmin mn out exactly in float32.

Used by bfloat16 fast targets wherever eaglespec's kernels run (`available`: every build has it; their sums differ
in the last bits, each row-invariant); $EAGLESPEC_Q4=0 turns it off (the layers then use the bfloat16 kernel).
Weights without either form (a model from safetensors, a Q8_0 tensor) stay on the bfloat16 kernel, layer matrix by
layer matrix; a GGUF file's Q6_K and Q5_0 tensors run as 6-bit codes (eaglespec.backends.cpu.q6).

A draft model's target may round its matrices to these blocks instead (`round_blocks`, `requantize` in
eaglespec.backends.cpu.apply): no longer the model's weights, but the target verifies every draft, so only which
tokens are proposed can change, and a forward reads about 4.5 bits a weight.

`int8_inputs` (`--activations int8`, and `auto`, the default, on the AVX-512 and AVX2 builds) multiplies the same
packing through q4_q8_linear instead: each row's inputs quantized to 8-bit integers per block of 32 (llama.cpp's
arithmetic), the block sums taken in integers (AVX-512 VNNI's vpdpbusd, AVX2's vpmaddubsw), the same bits on every
build (docs/cpu.md, "Int8 inputs"). That is the product of the exact weights with rounded inputs: another
arithmetic for the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ... import envs
from . import kernels

BLOCK = 32  # input channels per block
COLUMNS = 32  # output columns per packed group (csrc/common/q4_gemm.h, csrc/common/shared.h)
ENV = envs.Q4


def available() -> bool:
    """True where Q4Linear runs: this CPU loads a build of the kernels with the 4-bit product (every build has it)
    and $EAGLESPEC_Q4 is not 0."""
    build = kernels.isa()
    return build is not None and build.has_q4 and envs.q4_enabled()


@dataclass(frozen=True)
class Blocks:
    """W [N, K] = d q + m per block of 32 input channels, exactly (float32 arithmetic, one rounding). d and m are
    float16 (Q4_1, `find_blocks`) or float32 (Q4_K, eaglespec.backends.cpu.kquant: a float16 times a 6-bit integer)."""

    d: Tensor  # [N, K/32] float16 or float32
    m: Tensor  # [N, K/32] as d
    q: Tensor  # [N, K] uint8 in [0, 15]

    def weight(self) -> Tensor:
        """The float32 weights [N, K] they stand for (d q is exact in float32: at most 17 x 4 bits)."""
        n, k = self.q.shape
        q = self.q.view(n, k // BLOCK, BLOCK).float()  # [N, B, 32]
        return torch.addcmul(self.m.float()[..., None], self.d.float()[..., None], q).view(n, k)


SUPER_BLOCKS = 8  # blocks per Q4_K super-block (256 input channels)
HALF_BYTES = 640  # a packed Q4_1 group-block: float16 d and m of 32 columns, 512 bytes of q
SUPER_BYTES = 4736  # a packed Q4_K group-super-block: float16 d and dmin of 32 columns, 8 x (sc, mn, q)


@dataclass(frozen=True)
class SuperBlocks:
    """llama.cpp's Q4_K as it is stored: W [N, K] = (d sc) q - (dmin mn) per block of 32 input channels, with d and
    dmin float16 per super-block of 256 and sc, mn 6-bit integers per block. d sc and dmin mn are exact in float32
    (11 x 6 significant bits), so these are `Blocks` with float32 d = d sc and m = -(dmin mn)."""

    d: Tensor  # [N, K/256] float16
    dmin: Tensor  # [N, K/256] float16
    sc: Tensor  # [N, K/32] uint8 in [0, 63]
    mn: Tensor  # [N, K/32] uint8 in [0, 63]
    q: Tensor  # [N, K] uint8 in [0, 15]

    def blocks(self) -> Blocks:
        """The same weights with each block's d and m multiplied out (float32, exact)."""
        d = self.d.float().repeat_interleave(SUPER_BLOCKS, dim=1) * self.sc.float()  # [N, K/32]
        m = -(self.dmin.float().repeat_interleave(SUPER_BLOCKS, dim=1) * self.mn.float())
        return Blocks(d, m, self.q)

    def weight(self) -> Tensor:
        """The float32 weights [N, K] they stand for (gguf's dequantization, bit for bit)."""
        return self.blocks().weight()

    @staticmethod
    def cat(parts: list["SuperBlocks"]) -> "SuperBlocks":
        """Matrices stacked along N (a fused q/k/v)."""
        return SuperBlocks(*(torch.cat([getattr(p, f) for p in parts]) for f in ("d", "dmin", "sc", "mn", "q")))


def find_blocks(weight: Tensor) -> Blocks | None:
    """(d, m, q) with d q + m == weight for every element, bit for bit, or None where weight [N, K] (float32) does not
    have that form. m is each block's minimum (q = 0 occurs in every Q4_1 block); d is the float16 value nearest
    (max - min) / 15 or one of its two neighbours, the first that rebuilds the whole block."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK or weight.numel() == 0:
        return None
    n, k = weight.shape
    w = weight.detach().reshape(n, k // BLOCK, BLOCK)  # [N, B, 32]
    if not bool(w.isfinite().all()):
        return None
    low, high = w.amin(-1), w.amax(-1)  # [N, B]
    m16 = low.half()
    if not bool((m16.float() == low).all()):
        return None
    nearest = ((high - low) / 15).half().view(torch.int16).reshape(-1)  # [N B] as bits
    blocks, lows = w.reshape(-1, BLOCK), low.reshape(-1, 1)  # [N B, 32], [N B, 1]
    d_best = q_best = None  # [N B] float16, [N B, 32] uint8: the first try's for every block, then mended
    todo = None  # the blocks not rebuilt yet (None: all of them, the first try)
    for step in (0, 1, -1):  # each later try only on the blocks the earlier ones left
        bits, x, base = (nearest, blocks, lows) if todo is None else (nearest[todo], blocks[todo], lows[todo])
        candidate = (bits + step).clamp_min(0).view(torch.float16)  # [R] (d >= 0: the bits count up with it)
        d = candidate.float()[:, None]  # [R, 1]
        q = torch.where(d > 0, torch.round((x - base) / d.clamp_min(1e-30)), 0.0).clamp(0, 15)  # [R, 32]
        ok = ((d * q + base) == x).all(-1) & candidate.isfinite()  # [R]
        if todo is None:
            d_best, q_best, todo = candidate, q.to(torch.uint8), (~ok).nonzero()[:, 0]
        else:
            d_best[todo[ok]] = candidate[ok]
            q_best[todo[ok]] = q[ok].to(torch.uint8)
            todo = todo[~ok]
        if todo.numel() == 0:
            break
    if todo.numel():
        return None
    d_best = d_best.view(n, k // BLOCK)
    return Blocks(d_best, m16, q_best.reshape(n, k))


def round_blocks(weight: Tensor, rows: int = 8192) -> Blocks:
    """The Q4_1 blocks nearest weight [N, K] (K a multiple of 32, finite values), for a draft model's matrices
    (`requantize`): per block of 32 input channels m is the minimum and d the range over 15, both rounded to float16,
    and q = round((w - m) / d) clamped to [0, 15]. Approximate, unlike `find_blocks`: a weight moves by up to d / 2
    (plus m's float16 rounding). Rounded `rows` rows at a time, to bound the float32 temporaries."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"4-bit blocks need K divisible by {BLOCK}, not {k}")
    d = torch.empty(n, k // BLOCK, dtype=torch.float16)
    m = torch.empty_like(d)
    q = torch.empty(n, k, dtype=torch.uint8)
    for start in range(0, n, rows):
        w = weight[start : start + rows].detach().float().view(-1, k // BLOCK, BLOCK)  # [r, B, 32]
        low = w.amin(-1).half()  # [r, B]
        scale = ((w.amax(-1) - low.float()) / 15).half()  # [r, B]
        step = scale.float()[..., None]  # [r, B, 1]
        codes = torch.where(step > 0, torch.round((w - low.float()[..., None]) / step.clamp_min(1e-30)), 0.0)
        d[start : start + rows], m[start : start + rows] = scale, low
        q[start : start + rows] = codes.clamp(0, 15).to(torch.uint8).view(-1, k)
    return Blocks(d, m, q)


def _by_group(values: Tensor, groups: int) -> Tensor:
    """[Np, B] per-row values -> [G, B, 32 columns] as uint8 bytes [G, B, 32 * itemsize] (the packed order)."""
    blocks = values.shape[1]
    grouped = values.view(groups, COLUMNS, blocks).transpose(1, 2).contiguous()  # [G, B, 32]
    return grouped.view(torch.uint8).view(groups, blocks, -1)


def q4_pack(blocks: Blocks | SuperBlocks) -> Tensor:
    """csrc/common/shared.h's layouts (every build's micro-kernels read them), uint8:
    - `Blocks` (float16 d and m): [ceil(N/32), K/32, 640]; per group-block d (32 float16), m (32 float16), then the
      q as uint32 words [4 octets][32 columns] whose nibble i holds q[column][32 b + 8 octet + i];
    - `SuperBlocks` (Q4_K): [ceil(N/32), K/256, 4736]; per group-super-block d (32 float16), dmin (32 float16), then
      per block sc (32 uint8), mn (32 uint8) and the q as above."""
    if isinstance(blocks, Blocks) and (blocks.d.dtype != torch.float16 or blocks.m.dtype != torch.float16):
        raise ValueError(f"4-bit blocks pack with float16 d and m, not {blocks.d.dtype} and {blocks.m.dtype} "
                         "(Q4_K's float32 d and m pack as SuperBlocks)")
    n, k = blocks.q.shape
    pad = -n % COLUMNS
    groups, nblocks = (n + pad) // COLUMNS, k // BLOCK
    q = nn.functional.pad(blocks.q, (0, 0, 0, pad)).to(torch.int32)  # [Np, K]
    q = q.view(groups, COLUMNS, nblocks, 4, 8).permute(0, 2, 3, 1, 4)  # [G, B, octet, column, i]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    words = (q << shifts).sum(-1, dtype=torch.int64).to(torch.int32)  # [G, B, 4, 32] (as uint32 bits)
    words = words.contiguous().view(torch.uint8).view(groups, nblocks, -1)  # [G, B, 512]

    def padded(values: Tensor) -> Tensor:
        return _by_group(nn.functional.pad(values, (0, 0, 0, pad)), groups)

    if isinstance(blocks, Blocks):
        return torch.cat([padded(blocks.d), padded(blocks.m), words], dim=-1).contiguous()
    if k % (BLOCK * SUPER_BLOCKS):
        raise ValueError(f"Q4_K super-blocks need K divisible by 256, not {k}")
    records = torch.cat([padded(blocks.sc), padded(blocks.mn), words], dim=-1)  # [G, B, 576]
    supers = nblocks // SUPER_BLOCKS
    header = torch.cat([padded(blocks.d), padded(blocks.dmin)], dim=-1)  # [G, S, 128]
    return torch.cat([header, records.view(groups, supers, -1)], dim=-1).contiguous()  # [G, S, 4736]


class PackedLinear(nn.Module):
    """y = x W^T (+ b) through one of the kernels' operators on a packed weight (`op`: its name in
    torch.ops.eaglespec, taking (x [M, K] bfloat16, packed, N, bias); `int8_op`: the same product with the inputs
    quantized to 8-bit integers per block of 32, used where `int8_inputs`). x [..., K] -> [..., N] bfloat16."""

    op = ""
    int8_op = ""

    def __init__(self, packed: Tensor, shape: tuple[int, int], bias: Tensor | None = None,
                 int8_inputs: bool = False):
        super().__init__()
        kernels.load()
        self.out_features, self.in_features = shape
        self.int8_inputs = int8_inputs
        self.register_buffer("packed", packed)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    @classmethod
    def from_packed(cls, packed: Tensor, shape: tuple[int, int], bias: Tensor | None = None,
                    int8_inputs: bool = False) -> "PackedLinear":
        """A product of [N, K] = `shape` from its packed weight (e.g. read back by packcache)."""
        linear = cls.__new__(cls)
        PackedLinear.__init__(linear, packed, shape, bias, int8_inputs)
        return linear

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, K]
        op = getattr(torch.ops.eaglespec, self.int8_op if self.int8_inputs else self.op)
        y = op(rows, self.packed, self.out_features, self.bias)  # [M, N]
        return y.view(*x.shape[:-1], self.out_features)


class SplitLinear(nn.Module):
    """y = x W^T (+ b) with W's rows in runs, each run its own product (`parts`, in order), their outputs side by
    side: a fused q/k/v whose matrices a GGUF file stores in two block types (Q4_K q and k, a Q6_K v). The decoder
    stack runs the parts as one layer product (csrc/common/decoder_stack.h). x [..., K] -> [..., N] bfloat16."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


class Q4Linear(PackedLinear):
    """y = x W^T (+ b) with W read as exact 4-bit blocks (`find_blocks`, `kquant`). x [..., K] -> [..., N]
    bfloat16."""

    op = "q4_linear"
    int8_op = "q4_q8_linear"

    def __init__(self, blocks: Blocks | SuperBlocks, bias: Tensor | None = None, int8_inputs: bool = False):
        super().__init__(q4_pack(blocks), tuple(blocks.q.shape), bias, int8_inputs)


class Float32Source:
    """The float32 weights a model was loaded from, read back by parameter name from its folder's safetensors (a
    bfloat16 model has rounded them): the converted GGUF folders of eaglespec.models, or any float32 checkpoint."""

    def __init__(self, model: nn.Module):
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.files: list = []
        folder = Path(str(getattr(model, "name_or_path", "") or ""))
        self.paths = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []  # the files blocks come from
        if self.paths:
            from safetensors import safe_open

            self.files = [safe_open(str(path), framework="pt") for path in self.paths]

    def _float32_files(self, parameter: Tensor) -> tuple[str | None, list]:
        """(the parameter's name, the files that store it in float32; headers only)."""
        name = self.names.get(id(parameter))
        return name, [h for h in self.files if name is not None and name in h.keys()
                      and h.get_slice(name).get_dtype() == "F32"]

    def get(self, parameter: Tensor) -> Tensor | None:
        """The float32 tensor stored for this parameter, or None (not found, another dtype or shape)."""
        name, handles = self._float32_files(parameter)
        for handle in handles:
            tensor = handle.get_tensor(name)
            # (and the parameter is that tensor, rounded to its dtype: not a model changed after loading)
            if (tensor.dtype == torch.float32 and tensor.shape == parameter.shape
                    and torch.equal(tensor.to(parameter.dtype), parameter.detach().cpu())):
                return tensor
        return None

    def may_have(self, *parameters: Tensor) -> bool:
        """Whether every one of these parameters is stored in float32 (cheap: the files' headers; `blocks` checks)."""
        return bool(parameters) and all(self._float32_files(p)[1] for p in parameters)

    def blocks(self, *parameters: Tensor) -> Blocks | None:
        """`find_blocks` of these parameters' float32 weights stacked along N (a fused q/k/v), or None."""
        weights = [self.get(p) for p in parameters]
        if not self.files or any(w is None for w in weights):
            return None
        return find_blocks(torch.cat(weights))


class FirstSource:
    """The first of several block sources (`Float32Source`, `kquant.GGUFSource`) that has a matrix's blocks."""

    def __init__(self, *sources):
        self.sources = sources

    @property
    def paths(self) -> list[Path]:
        """Every file the sources read blocks from."""
        return [path for source in self.sources for path in source.paths]

    def may_have(self, *parameters: Tensor) -> bool:
        """Whether any source may have these parameters' blocks (cheap; `blocks` finds out)."""
        return any(source.may_have(*parameters) for source in self.sources)

    def blocks(self, *parameters: Tensor) -> Blocks | SuperBlocks | None:
        for source in self.sources:
            blocks = source.blocks(*parameters)
            if blocks is not None:
                return blocks
        return None
