"""Target features for training: computed online for every batch, or once into shards on disk (`--cache-features`).

Both sources answer `batch(indices)` with a right-padded `Batch`. A cache holds, per token, the target's post-norm
last hidden state (the LM head's input: regression target of EAGLE-1 and source of the target distribution) and,
for EAGLE-3, the fused low/mid/high features; it keeps one store per data file.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file
from torch import Tensor

from ..errors import CheckpointError
from ..targets.hf import TargetModel
from .data import Example

if TYPE_CHECKING:
    from tqdm import tqdm


@dataclass
class Batch:
    input_ids: Tensor  # [B, T] long, right padded with 0
    loss_mask: Tensor  # [B, T] bool: assistant tokens (False on padding)
    attention_mask: Tensor  # [B, T] bool: real tokens
    last: Tensor  # [B, T, d] target post-norm last hidden
    features: Tensor  # [B, T, F] the head's input features (F = d for EAGLE-1, 3d for EAGLE-3)

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(*(getattr(self, k).to(device)
                       for k in ("input_ids", "loss_mask", "attention_mask", "last", "features")))


def pad_examples(examples: list[Example]) -> tuple[Tensor, Tensor, Tensor]:
    """input_ids, loss_mask, attention_mask: [B, T] right padded."""
    width = max(ex.input_ids.numel() for ex in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    loss = torch.zeros(len(examples), width, dtype=torch.bool)
    attn = torch.zeros(len(examples), width, dtype=torch.bool)
    for row, ex in enumerate(examples):
        n = ex.input_ids.numel()
        ids[row, :n] = ex.input_ids
        loss[row, :n] = ex.loss_mask
        attn[row, :n] = True
    return ids, loss, attn


class OnlineFeatures:
    """Runs the target on every batch (no disk; costs one target forward per example per epoch)."""

    def __init__(self, target: TargetModel, examples: list[Example], compute_dtype: torch.dtype | None = None):
        self.target = target
        self.examples = examples
        self.compute_dtype = compute_dtype

    def lengths(self) -> list[int]:
        return [ex.input_ids.numel() for ex in self.examples]

    def batch(self, indices: list[int]) -> Batch:
        ids, loss, attn = pad_examples([self.examples[i] for i in indices])
        last, features = self.target.features_for_batch(ids, attn.long(), self.compute_dtype)
        # float32, as a store serves them (the fast path and --feature-dtype bfloat16 compute them in bfloat16)
        return Batch(ids, loss, attn, last.float(), features.float())


def dataset_fingerprint(examples: list[Example], model_name: str, compute_dtype: torch.dtype | None = None) -> str:
    """Names a feature store: the model, the encoded examples and, when it is not the model's own, the dtype the
    features were computed in (bfloat16 features are not float32 ones)."""
    computed = "" if compute_dtype is None else f"|{compute_dtype}"
    h = hashlib.sha256(f"{model_name}{computed}|{len(examples)}".encode())
    for ex in examples:
        h.update(ex.input_ids.numpy().tobytes())
        h.update(ex.loss_mask.numpy().tobytes())
    return h.hexdigest()[:16]


def cache_size_bytes(examples: list[Example], target: TargetModel, dtype: torch.dtype = torch.bfloat16) -> int:
    tokens = sum(ex.input_ids.numel() for ex in examples)
    per_token = target.hidden_size + (target.feature_size if target.feature_kind == "eagle3" else 0)
    return tokens * per_token * torch.finfo(dtype).bits // 8 + tokens * 9


class FeatureStore:
    """The target features of one data file's examples: safetensors shards + meta.json in
    `ROOT/<fingerprint>-<kind>/`, then served from memory.

    One store per data file, named by the file's encoded tokens and the model, so that adding a file to `--data`
    computes only that file's features, and another split, batch order or data list reuses the shards. An EAGLE-3
    store (fused features + last hidden) also serves EAGLE-1, which needs only the last hidden state."""

    SHARD_EXAMPLES = 256

    def __init__(self, target: TargetModel, examples: list[Example], root: str | Path, model_name: str,
                 dtype: torch.dtype = torch.bfloat16, compute_dtype: torch.dtype | None = None):
        self.examples = examples
        self.feature_kind = target.feature_kind
        self.dtype = dtype  # what the shards store
        self.compute_dtype = None if compute_dtype == target.dtype else compute_dtype  # what the target computes in
        self.want_fused = target.feature_kind == "eagle3"
        self.fingerprint = dataset_fingerprint(examples, model_name, self.compute_dtype)
        self.folder = Path(root) / f"{self.fingerprint}-eagle3"
        # EAGLE-1 reads a complete EAGLE-3 store when there is one (its "last" rows are all it needs).
        if not self.want_fused and self._todo():
            self.folder = Path(root) / f"{self.fingerprint}-final"

    def _shard_path(self, k: int) -> Path:
        return self.folder / f"shard-{k:05d}.safetensors"

    def _n_shards(self) -> int:
        return (len(self.examples) + self.SHARD_EXAMPLES - 1) // self.SHARD_EXAMPLES

    def _todo(self) -> list[int]:
        return [k for k in range(self._n_shards()) if not self._shard_path(k).is_file()]

    def missing(self) -> list[Example]:
        """The examples whose shards are still to be computed."""
        return [ex for k in self._todo()
                for ex in self.examples[k * self.SHARD_EXAMPLES : (k + 1) * self.SHARD_EXAMPLES]]

    def build(self, target: TargetModel, bar: tqdm, batch_size: int = 8) -> None:
        """Compute the missing shards with `target` (the one the store was opened with); a shard file appears only
        when complete, so an interrupted build resumes."""
        todo = self._todo()
        if not todo:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "meta.json").write_text(json.dumps(
            {"fingerprint": self.fingerprint, "examples": len(self.examples),
             "feature_kind": self.feature_kind, "dtype": str(self.dtype),
             "computed_in": str(self.compute_dtype or target.dtype)}) + "\n")
        for k in todo:
            idx = list(range(k * self.SHARD_EXAMPLES, min((k + 1) * self.SHARD_EXAMPLES, len(self.examples))))
            # Rows go straight to their place in the shard's tensors (example order), so a shard is held once,
            # not once in pieces and again concatenated; batches run sorted by length so they pad little.
            lengths = {i: self.examples[i].input_ids.numel() for i in idx}
            start = dict(zip(idx, itertools.accumulate([lengths[i] for i in idx], initial=0)))
            tokens = sum(lengths.values())
            order = sorted(idx, key=lengths.__getitem__)
            tensors: dict[str, Tensor] = {}
            for s in range(0, len(order), batch_size):
                chunk = order[s : s + batch_size]
                ids, _, attn = pad_examples([self.examples[i] for i in chunk])
                last, features = target.features_for_batch(ids, attn.long(), self.compute_dtype)
                if not tensors:
                    tensors["last"] = torch.empty(tokens, last.shape[-1], dtype=self.dtype)  # [tokens, d]
                    if self.want_fused:
                        tensors["features"] = torch.empty(tokens, features.shape[-1], dtype=self.dtype)  # [tokens, 3d]
                for row, i in enumerate(chunk):
                    lo, hi = start[i], start[i] + lengths[i]
                    tensors["last"][lo:hi] = last[row, : lengths[i]]
                    if self.want_fused:
                        tensors["features"][lo:hi] = features[row, : lengths[i]]
                bar.update(len(chunk))
            tmp = self._shard_path(k).with_suffix(".tmp")
            save_file(tensors, str(tmp))
            tmp.rename(self._shard_path(k))

    def load(self) -> None:
        """Map the shards into memory (read-only pages of the files, not copies: the OS pages them in and out, so
        stores larger than the machine's memory train; a batch copies only its rows)."""
        if not self.examples:
            return
        self.shards: list[tuple[Tensor, Tensor | None]] = []  # per shard: last [tokens, d], features [tokens, 3d]
        self.offsets: list[Tensor] = []  # per shard: [examples + 1] row offsets of its examples
        for k in range(self._n_shards()):
            path = self._shard_path(k)
            try:
                tensors = map_safetensors(path)
                shard = (tensors["last"], tensors["features"] if self.want_fused else None)
            except (ValueError, KeyError, TypeError, OSError, RuntimeError) as exc:
                raise CheckpointError(f"feature shard '{path}' is missing or corrupt ({exc}); delete it to rebuild") \
                    from exc
            examples = self.examples[k * self.SHARD_EXAMPLES : (k + 1) * self.SHARD_EXAMPLES]
            lengths = torch.tensor([ex.input_ids.numel() for ex in examples])
            if any(t is not None and t.shape[0] != int(lengths.sum()) for t in shard):
                raise CheckpointError(f"feature cache '{self.folder}' does not match its data; delete it to rebuild")
            self.shards.append(shard)
            self.offsets.append(torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]))

    def rows(self, i: int) -> tuple[Tensor, Tensor]:
        """Example i's cached rows: last [n, d] and the head's input features [n, F]."""
        k, j = divmod(i, self.SHARD_EXAMPLES)
        last, features = self.shards[k]
        lo, hi = int(self.offsets[k][j]), int(self.offsets[k][j + 1])
        src = features if features is not None else last
        return last[lo:hi], src[lo:hi]


SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def map_safetensors(path: Path) -> dict[str, Tensor]:
    """The tensors of a safetensors file as views of its pages, mapped copy-on-write (`torch.from_file`): nothing is
    read until used, and what is read stays file-backed memory the OS can drop. The layout is the format's: an
    8-byte little-endian header length, a JSON header of dtype, shape and byte offsets, then the data."""
    size = path.stat().st_size
    raw = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)  # [size] bytes
    if size < 8:
        raise ValueError("shorter than a safetensors header")
    n = int.from_bytes(bytes(raw[:8].tolist()), "little")
    if 8 + n > size:
        raise ValueError("header runs past the end of the file")
    header = json.loads(bytes(raw[8 : 8 + n].tolist()))
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        if not 0 <= begin <= end <= size - 8 - n:
            raise ValueError(f"tensor '{name}' lies outside the file")
        tensors[name] = raw[8 + n + begin : 8 + n + end].view(dtype).view(info["shape"])
    return tensors


def open_feature_stores(target: TargetModel, files: list[list[Example]], root: str | Path, model_name: str,
                        batch_size: int = 8, dtype: torch.dtype = torch.bfloat16,
                        progress: bool = True, compute_dtype: torch.dtype | None = None) -> list[FeatureStore]:
    """One loaded store per data file (`files[f]` = that file's examples), computing missing shards first; the
    disk size of what will be written is printed before anything is."""
    from tqdm import tqdm

    stores = [FeatureStore(target, examples, root, model_name, dtype, compute_dtype) for examples in files]
    missing = [ex for s in stores for ex in s.missing()]
    if missing:
        size = cache_size_bytes(missing, target, dtype)
        print(f"feature cache: {len(missing)} conversations to compute, about {size / 2**20:.0f} MiB on disk in {root}",
              file=sys.stderr)
        with tqdm(total=len(missing), desc="target features", unit="conv", disable=not progress) as bar:
            for store in stores:
                store.build(target, bar, batch_size)
    for store in stores:
        store.load()
    return stores


class CachedFeatures:
    """Batches from feature stores: example i of this source is example `refs[i][1]` of store `refs[i][0]`."""

    def __init__(self, refs: list[tuple[FeatureStore, int]]):
        self.refs = refs
        self.examples = [store.examples[j] for store, j in refs]

    def lengths(self) -> list[int]:
        return [ex.input_ids.numel() for ex in self.examples]

    def batch(self, indices: list[int]) -> Batch:
        ids, loss, attn = pad_examples([self.examples[i] for i in indices])
        rows = [self.refs[i][0].rows(self.refs[i][1]) for i in indices]
        b, t = ids.shape
        last = torch.zeros(b, t, rows[0][0].shape[1])
        features = torch.zeros(b, t, rows[0][1].shape[1])
        for row, (l, f) in enumerate(rows):
            last[row, : l.shape[0]] = l.float()
            features[row, : f.shape[0]] = f.float()
        return Batch(ids, loss, attn, last, features)
