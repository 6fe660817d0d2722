"""Target features for training: computed online for every batch, or once into shards on disk (`--cache-features`).

Both sources answer `batch(indices)` with a right-padded `Batch`. A cache holds, per token, the target's post-norm
last hidden state (the LM head's input: regression target of EAGLE-1 and source of the target distribution) and,
for EAGLE-3, the fused low/mid/high features.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from ..errors import CheckpointError
from ..target import TargetModel
from .data import Example


@dataclass
class Batch:
    input_ids: Tensor  # [B, T] long, right padded with 0
    loss_mask: Tensor  # [B, T] bool: assistant tokens (False on padding)
    attention_mask: Tensor  # [B, T] bool: real tokens
    last: Tensor  # [B, T, d] target post-norm last hidden
    features: Tensor  # [B, T, F] the head's input features (F = d for EAGLE-1, 3d for EAGLE-3)

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(*(getattr(self, k).to(device) for k in ("input_ids", "loss_mask", "attention_mask", "last", "features")))


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

    def __init__(self, target: TargetModel, examples: list[Example]):
        self.target = target
        self.examples = examples

    def lengths(self) -> list[int]:
        return [ex.input_ids.numel() for ex in self.examples]

    def batch(self, indices: list[int]) -> Batch:
        ids, loss, attn = pad_examples([self.examples[i] for i in indices])
        last, features = self.target.features_for_batch(ids, attn.long())
        return Batch(ids, loss, attn, last, features)


def dataset_fingerprint(examples: list[Example], model_name: str) -> str:
    h = hashlib.sha256(f"{model_name}|{len(examples)}".encode())
    for ex in examples:
        h.update(ex.input_ids.numpy().tobytes())
        h.update(ex.loss_mask.numpy().tobytes())
    return h.hexdigest()[:16]


def cache_size_bytes(examples: list[Example], target: TargetModel, dtype: torch.dtype = torch.bfloat16) -> int:
    tokens = sum(ex.input_ids.numel() for ex in examples)
    per_token = target.hidden_size + (target.feature_size if target.feature_kind == "eagle3" else 0)
    return tokens * per_token * torch.finfo(dtype).bits // 8 + tokens * 9


class CachedFeatures:
    """Features computed once into `folder` (safetensors shards + meta.json), then served from memory.

    A cache built for EAGLE-3 (fused features + last hidden) also serves EAGLE-1, which needs only the last
    hidden state; the reverse is refused."""

    SHARD_EXAMPLES = 256

    def __init__(self, target: TargetModel, examples: list[Example], folder: str | Path, model_name: str,
                 batch_size: int = 8, dtype: torch.dtype = torch.bfloat16, progress: bool = True):
        self.examples = examples
        self.folder = Path(folder)
        self.fingerprint = dataset_fingerprint(examples, model_name)
        self.want_fused = target.feature_kind == "eagle3"
        meta_path = self.folder / "meta.json"
        if meta_path.is_file():
            meta = json.loads(meta_path.read_text())
            if meta.get("fingerprint") != self.fingerprint:
                raise CheckpointError(
                    f"feature cache '{self.folder}' was made for other data or another model; use a new folder")
            if self.want_fused and meta.get("feature_kind") != "eagle3":
                raise CheckpointError(f"feature cache '{self.folder}' holds EAGLE-1 features only; use a new folder")
        self._build(target, batch_size, dtype, progress)
        self._load()

    def _shard_path(self, k: int) -> Path:
        return self.folder / f"shard-{k:05d}.safetensors"

    def _build(self, target: TargetModel, batch_size: int, dtype: torch.dtype, progress: bool) -> None:
        from tqdm import tqdm

        n_shards = (len(self.examples) + self.SHARD_EXAMPLES - 1) // self.SHARD_EXAMPLES
        todo = [k for k in range(n_shards) if not self._shard_path(k).is_file()]
        if not todo:
            return
        size = cache_size_bytes(self.examples, target, dtype)
        print(f"feature cache: {len(self.examples)} conversations, about {size / 2**20:.0f} MiB on disk "
              f"in {self.folder}", file=sys.stderr)
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "meta.json").write_text(json.dumps(
            {"fingerprint": self.fingerprint, "examples": len(self.examples), "feature_kind": target.feature_kind,
             "dtype": str(dtype)}) + "\n")
        bar = tqdm(total=sum(min(self.SHARD_EXAMPLES, len(self.examples) - k * self.SHARD_EXAMPLES) for k in todo),
                   desc="target features", unit="conv", disable=not progress)
        eagle3 = target.feature_kind == "eagle3"
        for k in todo:
            idx = list(range(k * self.SHARD_EXAMPLES, min((k + 1) * self.SHARD_EXAMPLES, len(self.examples))))
            # Sort by length inside the shard so batches pad little; rows are stored back in example order.
            order = sorted(idx, key=lambda i: self.examples[i].input_ids.numel())
            last_rows: dict[int, Tensor] = {}
            feat_rows: dict[int, Tensor] = {}
            for s in range(0, len(order), batch_size):
                chunk = order[s : s + batch_size]
                ids, _, attn = pad_examples([self.examples[i] for i in chunk])
                last, features = target.features_for_batch(ids, attn.long())
                for row, i in enumerate(chunk):
                    n = self.examples[i].input_ids.numel()
                    last_rows[i] = last[row, :n].to("cpu", dtype)
                    if eagle3:
                        feat_rows[i] = features[row, :n].to("cpu", dtype)
                bar.update(len(chunk))
            tensors = {"last": torch.cat([last_rows[i] for i in idx])}  # [tokens, d]
            if eagle3:
                tensors["features"] = torch.cat([feat_rows[i] for i in idx])  # [tokens, 3d]
            tmp = self._shard_path(k).with_suffix(".tmp")
            save_file(tensors, str(tmp))
            tmp.rename(self._shard_path(k))  # a shard appears only when complete: an interrupted build resumes
        bar.close()

    def _load(self) -> None:
        lasts, feats = [], []
        k = 0
        while self._shard_path(k).is_file():
            try:
                shard = load_file(str(self._shard_path(k)))
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"feature shard '{self._shard_path(k)}' is corrupt ({exc}); delete it to rebuild") from exc
            lasts.append(shard["last"])
            if self.want_fused:
                feats.append(shard["features"])
            k += 1
        self.last = torch.cat(lasts)  # [all tokens, d]
        self.features = torch.cat(feats) if feats else None  # [all tokens, 3d] or None (EAGLE-1: = last)
        lengths = torch.tensor(self.lengths())
        if self.last.shape[0] != int(lengths.sum()):
            raise CheckpointError(f"feature cache '{self.folder}' does not match the data; delete it to rebuild")
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])

    def lengths(self) -> list[int]:
        return [ex.input_ids.numel() for ex in self.examples]

    def batch(self, indices: list[int]) -> Batch:
        ids, loss, attn = pad_examples([self.examples[i] for i in indices])
        b, t = ids.shape
        src = self.features if self.features is not None else self.last
        last = torch.zeros(b, t, self.last.shape[1])
        features = torch.zeros(b, t, src.shape[1])
        for row, i in enumerate(indices):
            lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
            last[row, : hi - lo] = self.last[lo:hi].float()
            features[row, : hi - lo] = src[lo:hi].float()
        return Batch(ids, loss, attn, last, features)
