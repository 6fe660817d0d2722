"""Exact blocks read from a GGUF file's Q4_K, Q6_K and Q5_0 tensors: llama.cpp's Q4_K_M models (the Qwen2.5-Coder
pair) run those matrices through `q4.Q4Linear` (Q4_K) and `q6.Q6Linear` (Q6_K, Q5_0) as they are in the file.

A Q4_K super-block covers 256 consecutive input channels of a row: d and dmin (float16), eight 6-bit scales sc and
mins mn, and 256 4-bit q. Weight k of sub-block j (32 consecutive channels) is (d sc_j) q_k - (dmin mn_j), gguf's
and llama.cpp's float32 dequantization. That is `q4.Blocks`' d q + m per 32 channels with d = d sc_j and
m = -(dmin mn_j) in float32, both exact (11 x 6 significant bits), so `SuperBlocks.weight()` rebuilds gguf's
dequantized weight bit for bit. `Q4Linear` packs them as they are and reads 18.5 bytes per 32 weights (the file:
18; bfloat16: 64), multiplying d sc_j and dmin mn_j out in float32 as it goes.

eaglespec caches these models in bfloat16 (eaglespec.models), which rounds the dequantized weights; a matrix read
from the file has the weights before that rounding. A matrix is read from the file only where its weights, rounded
to the model's dtype, are the model's parameter bit for bit (so it is that parameter, not a changed or re-laid-out
one: llama.cpp permutes a Llama model's q and k rows, and those stay on the bfloat16 kernel). Q6_K and Q5_0 matrices
are read the same way as 6-bit codes (`q6_k_codes`, `q5_0_codes`); Q8_0, Q5_K and the other block types stay on the
bfloat16 kernel, and so does a fused group (q/k/v, gate/up) whose matrices have different block types.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from .q4 import SuperBlocks
from .q6 import Codes

SUPER = 256  # weights per Q4_K super-block
SUPER_BYTES = 144  # d, dmin (2 + 2 bytes), 12 bytes of packed scales and mins, 128 bytes of q
Q6_K_BYTES = 210  # per 256 weights: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d (float16)
Q5_0_BYTES = 22  # per 32 weights: d (float16), 32 high bits, 16 bytes of low nibbles
# a decoder-layer matrix's transformers name -> its GGUF name (llama.cpp's Llama-family tensor names)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.weight$")
_GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
               "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def gguf_name(name: str) -> str | None:
    """llama.cpp's name of a decoder-layer matrix (`model.layers.3.mlp.up_proj.weight` -> `blk.3.ffn_up.weight`),
    or None for any other parameter."""
    match = _LAYER.search(name)
    if match is None or match.group(3) not in _GGUF_NAMES:
        return None
    return f"blk.{match.group(1)}.{_GGUF_NAMES[match.group(3)]}.weight"


def q4_k_blocks(raw: np.ndarray, n: int, k: int) -> SuperBlocks:
    """The exact blocks of a Q4_K matrix [n, k]: `raw` its bytes, [n, k / 256 * 144] uint8 (row-major super-blocks)."""
    from gguf.quants import Q4_K

    if k % SUPER or raw.shape != (n, k // SUPER * SUPER_BYTES) or raw.dtype != np.uint8:
        raise ValueError(f"not a Q4_K matrix [{n}, {k}]: {raw.shape} {raw.dtype}")
    sb = np.ascontiguousarray(raw).reshape(-1, SUPER_BYTES)  # [S, 144], S = n k / 256
    d = sb[:, 0:2].view(np.float16).reshape(n, k // SUPER)  # [N, K/256]
    dmin = sb[:, 2:4].view(np.float16).reshape(n, k // SUPER)
    sc, mn = Q4_K.get_scale_min(sb[:, 4:16])  # [S, 8] each, 6-bit
    qs = sb[:, 16:].reshape(-1, 4, 1, 32)  # 4 pairs of sub-blocks: low nibbles first, then high
    q = ((qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)).reshape(n, k)
    def blocks(values: np.ndarray) -> torch.Tensor:  # [S, 8] -> [N, K/32] uint8
        return torch.from_numpy(np.ascontiguousarray(values.astype(np.uint8).reshape(n, -1)))

    return SuperBlocks(torch.from_numpy(np.ascontiguousarray(d)), torch.from_numpy(np.ascontiguousarray(dmin)),
                       blocks(sc), blocks(mn), torch.from_numpy(q))


def q6_k_codes(raw: np.ndarray, n: int, k: int) -> Codes:
    """The exact 6-bit codes of a Q6_K matrix [n, k]: `raw` its bytes, [n, k / 256 * 210] uint8. A weight is
    (d sc) (q - 32) with sc the signed byte of its 16 channels (gguf's float32 dequantization, bit for bit)."""
    if k % SUPER or raw.shape != (n, k // SUPER * Q6_K_BYTES) or raw.dtype != np.uint8:
        raise ValueError(f"not a Q6_K matrix [{n}, {k}]: {raw.shape} {raw.dtype}")
    sb = np.ascontiguousarray(raw).reshape(-1, Q6_K_BYTES)  # [S, 210], S = n k / 256
    ql, qh = sb[:, :128], sb[:, 128:192]
    sc = sb[:, 192:208].view(np.int8).astype(np.float32)  # [S, 16]
    d = sb[:, 208:210].view(np.float16).astype(np.float32)  # [S, 1]
    # each half of 128 weights: 64 low-nibble bytes (weights l and l + 64 of byte l < 32, l + 32 and l + 96 of l >= 32)
    # and 32 bytes of four 2-bit high parts (weights l, l + 32, l + 64, l + 96 of byte l)
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(0x03)
    q = low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << np.uint8(4))  # [S, 8, 32] in [0, 63]
    scale = (d * sc).reshape(n, k // 16)  # exact: 11 x 7 significant bits
    return Codes(torch.from_numpy(np.ascontiguousarray(scale)), torch.from_numpy(np.ascontiguousarray(q.reshape(n, k))))


def q5_0_codes(raw: np.ndarray, n: int, k: int) -> Codes:
    """The exact codes of a Q5_0 matrix [n, k]: `raw` its bytes, [n, k / 32 * 22] uint8. A weight is d (q5 - 16),
    the code q5 + 16 under d for both of its 16-channel halves (gguf's float32 dequantization, bit for bit)."""
    if k % 32 or raw.shape != (n, k // 32 * Q5_0_BYTES) or raw.dtype != np.uint8:
        raise ValueError(f"not a Q5_0 matrix [{n}, {k}]: {raw.shape} {raw.dtype}")
    blocks = np.ascontiguousarray(raw).reshape(-1, Q5_0_BYTES)  # [B, 22], B = n k / 32
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)  # [B, 1]
    bits = blocks[:, 2:6].copy().view(np.uint32)  # [B, 1]
    high = ((bits >> np.arange(32, dtype=np.uint32).reshape(1, 32)) & np.uint32(1)).astype(np.uint8)  # [B, 32]
    low = (blocks[:, 6:].reshape(-1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)) & np.uint8(0x0F)
    q = (low.reshape(-1, 32) | (high << np.uint8(4))) + np.uint8(16)  # [B, 32] in [16, 47]
    scale = np.repeat(d, 2, axis=1).reshape(n, k // 16)
    return Codes(torch.from_numpy(np.ascontiguousarray(scale)), torch.from_numpy(np.ascontiguousarray(q.reshape(n, k))))


@dataclass(frozen=True)
class TensorInfo:
    """Where a tensor's bytes are in a GGUF file."""

    kind: int  # its GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the innermost (contiguous) size first
    offset: int  # of its first byte in the file


# byte sizes of the fixed-size GGUF metadata value types (gguf.GGUFValueType: 8 is a string, 9 an array)
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def tensor_index(path: str | Path) -> dict[str, TensorInfo]:
    """The tensors of a GGUF file (version 2 or 3, little-endian): name -> kind, shape and offset.

    Reads the header and skips the metadata values. gguf's GGUFReader parses every value instead (a Qwen2 file's
    151,936 tokenizer strings: 10-20 s on a 2-core VM), and its tensor list is all this needs."""
    from gguf import GGUF_DEFAULT_ALIGNMENT

    with open(path, "rb") as f:
        def read(fmt: str):
            size = struct.calcsize("<" + fmt)
            data = f.read(size)
            if len(data) != size:
                raise ValueError(f"{path}: truncated GGUF header")
            return struct.unpack("<" + fmt, data)

        def skip(kind: int, count: int = 1) -> None:
            if kind in _SCALAR_BYTES:
                f.seek(_SCALAR_BYTES[kind] * count, 1)
            elif kind == _STRING:
                for _ in range(count):
                    f.seek(read("Q")[0], 1)
            elif kind == _ARRAY:
                for _ in range(count):
                    item, n = read("IQ")
                    skip(item, n)
            else:
                raise ValueError(f"{path}: unknown GGUF value type {kind}")

        magic, version = f.read(4), read("I")[0]
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path}: not a little-endian GGUF file of version 2 or 3")
        n_tensors, n_values = read("QQ")
        alignment = GGUF_DEFAULT_ALIGNMENT
        for _ in range(n_values):
            key = f.read(read("Q")[0])
            kind = read("I")[0]
            if key == b"general.alignment" and kind == 4:  # uint32
                alignment = read("I")[0]
            else:
                skip(kind)
        infos = []
        for _ in range(n_tensors):
            name = f.read(read("Q")[0]).decode()
            dims = read("I")[0]
            shape = read("Q" * dims)
            kind, offset = read("IQ")
            infos.append((name, kind, shape, offset))
        start = -(-f.tell() // alignment) * alignment  # the tensor data begins at the next multiple of alignment
    return {name: TensorInfo(kind, tuple(shape), start + offset) for name, kind, shape, offset in infos}


class GGUFSource:
    """A model's Q4_K (as `q4.SuperBlocks`), Q6_K and Q5_0 (as `q6.Codes`) layer matrices, read from the GGUF file its
    checkpoint was converted from (the file is read only when a matrix is first asked for). `blocks` answers like
    `q4.Float32Source.blocks`."""

    def __init__(self, model: nn.Module, path: str | Path):
        self.path = Path(path)
        self.paths = [self.path]  # the files blocks come from
        self.names = {id(p): name for name, p in model.named_parameters()}
        self._tensors: dict | None = None

    def tensors(self) -> dict[str, TensorInfo]:
        """The file's Q4_K, Q6_K and Q5_0 tensors, read once; none where the file is gone or unreadable since the model
        was converted from it (its matrices then stay on the bfloat16 kernel)."""
        if self._tensors is None:
            from gguf import GGMLQuantizationType

            try:
                index = tensor_index(self.path)
            except (OSError, ValueError):
                index = {}
            kinds = {GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q5_0}
            self._tensors = {name: info for name, info in index.items() if info.kind in kinds}
        return self._tensors

    def get(self, parameter: Tensor) -> SuperBlocks | Codes | None:
        """The exact blocks or codes of this parameter [N, K], or None: not a decoder-layer matrix, not one of these
        types in the file, or not the file's weights rounded to the parameter's dtype."""
        from gguf import GGMLQuantizationType

        name = gguf_name(self.names.get(id(parameter), ""))
        if name is None or parameter.dim() != 2:
            return None
        info = self.tensors().get(name)
        n, k = parameter.shape
        if info is None or info.shape != (k, n):  # (GGUF shapes list the inner size first)
            return None
        read, unit, size = {GGMLQuantizationType.Q4_K: (q4_k_blocks, SUPER, SUPER_BYTES),
                            GGMLQuantizationType.Q6_K: (q6_k_codes, SUPER, Q6_K_BYTES),
                            GGMLQuantizationType.Q5_0: (q5_0_codes, 32, Q5_0_BYTES)}[info.kind]
        if k % unit or self.path.stat().st_size < info.offset + n * k // unit * size:
            return None
        raw = np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(n, k // unit * size))
        found = read(raw, n, k)
        if not torch.equal(found.weight().to(parameter.dtype), parameter.detach().cpu()):
            return None
        return found

    def _kinds(self, parameters: tuple[Tensor, ...]) -> set[int | None]:
        """The block types of these parameters in the file (None: not there)."""
        infos = self.tensors()
        return {getattr(infos.get(gguf_name(self.names.get(id(p), "")) or ""), "kind", None) for p in parameters}

    def may_have(self, *parameters: Tensor) -> bool:
        """Whether these parameters are matrices of the file, all of one block type (cheap: the index only;
        `blocks` checks)."""
        kinds = self._kinds(parameters)
        return bool(parameters) and len(kinds) == 1 and None not in kinds

    def blocks(self, *parameters: Tensor) -> SuperBlocks | Codes | None:
        """The blocks of these parameters stacked along N (a fused q/k/v), or None where any has none or their block
        types differ (a Q6_K v beside a Q4_K q and k: the group stays on the bfloat16 kernel)."""
        if not self.may_have(*parameters):
            return None
        found = []
        for parameter in parameters:
            blocks = self.get(parameter)
            if blocks is None:
                return None
            found.append(blocks)
        return found[0].cat(found)
