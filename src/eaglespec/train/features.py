"""Target features for training: computed online for every batch, or once into shards on disk (`--cache-features`).

Both sources answer `batch(indices)` with a right-padded `Batch`. A cache holds, per token, the target's post-norm
last hidden state (the LM head's input: regression target of EAGLE-1 and source of the target distribution) and,
for EAGLE-3, the fused low/mid/high features; it keeps one store per data file.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
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
        return Batch(ids, loss, attn, last, features)


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
        self.target = target
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

    def build(self, bar: tqdm, batch_size: int = 8) -> None:
        """Compute the missing shards; a shard file appears only when complete, so an interrupted build resumes."""
        todo = self._todo()
        if not todo:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "meta.json").write_text(json.dumps(
            {"fingerprint": self.fingerprint, "examples": len(self.examples),
             "feature_kind": self.target.feature_kind, "dtype": str(self.dtype),
             "computed_in": str(self.compute_dtype or self.target.dtype)}) + "\n")
        for k in todo:
            idx = list(range(k * self.SHARD_EXAMPLES, min((k + 1) * self.SHARD_EXAMPLES, len(self.examples))))
            # Sort by length inside the shard so batches pad little; rows are stored back in example order.
            order = sorted(idx, key=lambda i: self.examples[i].input_ids.numel())
            last_rows: dict[int, Tensor] = {}
            feat_rows: dict[int, Tensor] = {}
            for s in range(0, len(order), batch_size):
                chunk = order[s : s + batch_size]
                ids, _, attn = pad_examples([self.examples[i] for i in chunk])
                last, features = self.target.features_for_batch(ids, attn.long(), self.compute_dtype)
                for row, i in enumerate(chunk):
                    n = self.examples[i].input_ids.numel()
                    last_rows[i] = last[row, :n].to("cpu", self.dtype)
                    if self.want_fused:
                        feat_rows[i] = features[row, :n].to("cpu", self.dtype)
                bar.update(len(chunk))
            tensors = {"last": torch.cat([last_rows[i] for i in idx])}  # [tokens, d]
            if self.want_fused:
                tensors["features"] = torch.cat([feat_rows[i] for i in idx])  # [tokens, 3d]
            tmp = self._shard_path(k).with_suffix(".tmp")
            save_file(tensors, str(tmp))
            tmp.rename(self._shard_path(k))

    def load(self) -> None:
        if not self.examples:
            return
        lasts, feats = [], []
        for k in range(self._n_shards()):
            try:
                shard = load_file(str(self._shard_path(k)))
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(
                    f"feature shard '{self._shard_path(k)}' is missing or corrupt ({exc}); delete it to rebuild"
                ) from exc
            lasts.append(shard["last"])
            if self.want_fused:
                feats.append(shard["features"])
        self.last = torch.cat(lasts)  # [all tokens, d]
        self.features = torch.cat(feats) if feats else None  # [all tokens, 3d] or None (EAGLE-1: = last)
        lengths = torch.tensor([ex.input_ids.numel() for ex in self.examples])
        if self.last.shape[0] != int(lengths.sum()):
            raise CheckpointError(f"feature cache '{self.folder}' does not match its data; delete it to rebuild")
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])

    def rows(self, i: int) -> tuple[Tensor, Tensor]:
        """Example i's cached rows: last [n, d] and the head's input features [n, F]."""
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        src = self.features if self.features is not None else self.last
        return self.last[lo:hi], src[lo:hi]


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
                store.build(bar, batch_size)
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
