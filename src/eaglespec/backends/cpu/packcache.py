"""The exact 4-bit packing of a model's layer matrices, kept on disk per machine: a process pays for finding the
blocks (`q4.find_blocks` over a float32 checkpoint, or unpacking and checking a GGUF file's Q4_K tensors,
`kquant.GGUFSource`) and packing them once, and later processes read the packed tensors back.

What a matrix's packing depends on is all in its key: the parameters it is built from (their names, shapes and
bytes: a model changed in any weight misses), the files the blocks come from (each one's path, size and
modification time), and the code that finds and packs them (this module's, `q4`'s and `kquant`'s sources). Where a
source found no blocks, that answer is kept too (the matrix stays on the bfloat16 kernel without searching again).
Files live under `$EAGLESPEC_CACHE/packed/`, one per model and sources, written whole and renamed into place; a
missing, unreadable or foreign file is simply a miss. Writing one removes the files of the same source paths made
before (by other code, or before a source file changed): the disk holds one packing per model.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from torch import Tensor, nn

from ... import envs

NONE = "-"  # a matrix whose sources had no blocks


def _code_digest() -> str:
    from . import kquant, q4, q6

    return hashlib.sha1(b"".join(Path(m.__file__).read_bytes() for m in (kquant, q4, q6))
                        + Path(__file__).read_bytes()).hexdigest()[:12]


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


class PackCache:
    """The packed matrices of one model's layers for one set of block sources (`files`)."""

    def __init__(self, model: nn.Module, files: list[Path], folder: Path | None = None):
        self.names = {id(p): name for name, p in model.named_parameters()}
        key = hashlib.sha1("|".join([_code_digest(), *map(_stamp, files)]).encode()).hexdigest()[:20]
        self.sources = json.dumps(sorted(str(f.resolve()) for f in files))  # what older packings of it name
        self.path = (folder or envs.cache_dir() / "packed") / f"{key}.safetensors"
        self.entries: dict[str, Tensor | None] = {}  # matrix key -> packed tensor, or None (no blocks)
        self.changed = False
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(self.path), framework="pt") as f:
                index = json.loads((f.metadata() or {}).get("matrices", "{}"))
                self.entries = {k: None if name == NONE else f.get_tensor(name) for k, name in index.items()}
        except (OSError, ValueError, KeyError, AttributeError, RuntimeError, SafetensorError):
            # absent, broken or not ours: a miss
            self.entries = {}

    @classmethod
    def of(cls, model: nn.Module, files: list[Path]) -> "PackCache | None":
        """The cache of `model`'s packing from these source files, or None where there are none."""
        files = [Path(f) for f in files if Path(f).is_file()]
        return cls(model, files) if files else None

    def key(self, parameters: tuple[Tensor, ...]) -> str:
        """A matrix's key: its parameters' names, shapes, dtypes and bytes."""
        digest = hashlib.sha1()
        for p in parameters:
            data = p.detach().cpu().contiguous()
            digest.update(f"{self.names.get(id(p))}|{tuple(data.shape)}|{data.dtype}|".encode())
            if data.numel():
                digest.update(data.view(-1).view(torch.uint8).numpy().data)
        return digest.hexdigest()

    def get(self, key: str) -> tuple[bool, Tensor | None]:
        """(known, packed tensor or None where its sources had no blocks)."""
        return key in self.entries, self.entries.get(key)

    def put(self, key: str, packed: Tensor | None) -> None:
        self.entries[key] = packed
        self.changed = True

    def save(self) -> None:
        """Write the entries (new ones since loading included) where they were found, atomically; a cache that
        cannot be written is left out quietly (the packing is redone next time)."""
        if not self.changed:
            return
        from safetensors.torch import save_file

        tensors, names = {}, {}
        for key, packed in self.entries.items():
            names[key] = NONE if packed is None else f"m{len(tensors)}"
            if packed is not None:
                tensors[names[key]] = packed.contiguous()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
        except OSError:
            return
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"matrices": json.dumps(names), "sources": self.sources})
            os.replace(tmp, self.path)
        except OSError:
            Path(tmp).unlink(missing_ok=True)
            return
        self.changed = False
        self._remove_older()

    def _remove_older(self) -> None:
        """Delete the other packings of the same source paths (stale: other code or changed files)."""
        from safetensors import SafetensorError, safe_open

        for other in self.path.parent.glob("*.safetensors"):
            if other == self.path:
                continue
            try:
                with safe_open(str(other), framework="pt") as f:
                    stale = (f.metadata() or {}).get("sources") == self.sources
                if stale:
                    other.unlink()
            except (OSError, ValueError, SafetensorError):
                continue
