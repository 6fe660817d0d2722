"""One copy of a model's weights in memory.

A fast target (`targets.fast.FastTarget`) runs its own fused, packed copy of each decoder layer's matrices. The
transformers model it was built from keeps its originals, which the fast path never reads again: for
Qwen2.5-Coder-1.5B in bfloat16 that is 2.6 GB held twice. So once a layer is built, its original matrices are
released: each parameter keeps its shape and dtype but points at a single shared zero (`Tensor.expand`, no memory),
and the matrices come back from the checkpoint they were loaded from, bit for bit, before anything else reads them:
- any forward of a released layer (the generic target, transformers' `generate`, training's feature pass) restores
  the whole model first, through a forward pre-hook on each released layer;
- code that reads the weights directly (`FastTarget` building another plan) calls `restore` first.

Only models that `models.load_target` loaded from a safetensors checkpoint, and whose matrices are unchanged since,
are released (`track`); a model built in memory or changed after loading keeps its weights.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from ..errors import EagleSpecError
from ..platform import evict_mapped_pages


@dataclass
class _Source:
    files: list[Path]  # the checkpoint's safetensors files
    stamps: list[tuple[int, int]]  # their (size, modification time) when the model was loaded
    versions: dict[str, int]  # parameter name -> its in-place version right after loading
    released: dict[str, nn.Parameter] = field(default_factory=dict)  # name -> parameter now pointing at a zero
    hooks: list = field(default_factory=list)  # forward pre-hooks of the released layers
    # name -> (the storage we gave the parameter, the storage it was loaded into, its in-place version then), for
    # every parameter released once: the identity fast.py's cache of built weights keys on stays the loaded one
    # across release and restore, and a restored matrix still so is known to equal its stored copy
    origins: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    module_names: dict[int, str] | None = None  # id(module) -> its name in the model, once needed

    def origin(self, name: str, parameter: Tensor) -> int | None:
        """The storage `parameter` was loaded into if it is as we left it (released, or restored and unchanged)."""
        origin = self.origins.get(name)
        if origin is not None and parameter.data_ptr() == origin[0] and parameter._version == origin[2]:
            return origin[1]
        return None


_SOURCES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> _Source


def track(model: nn.Module, folder: Path) -> None:
    """Remember that `model` was just loaded from `folder`'s safetensors files (nothing when it has none)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if files:
        _SOURCES[model] = _Source(files, _stamps(files), {name: p._version for name, p in model.named_parameters()})


_GGUF_FILES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> the GGUF file it was converted from


def note_gguf(model: nn.Module, path: Path) -> None:
    """Remember that `model`'s checkpoint was converted from the GGUF file `path` (eaglespec.models): the CPU kernels
    read block-quantized matrices from it as they are there (eaglespec.backends.cpu.kquant)."""
    _GGUF_FILES[model] = Path(path)


def gguf_file(model: nn.Module) -> Path | None:
    """The GGUF file `model` was converted from, if it was loaded through `models.load_target` from one."""
    return _GGUF_FILES.get(model)


def _stamps(files: list[Path]) -> list[tuple[int, int]]:
    return [(path.stat().st_size, path.stat().st_mtime_ns) for path in files]


def weights_state(model: nn.Module) -> tuple[tuple[int, int], ...]:
    """Each parameter's (storage, in-place version), with the storage it was loaded into while released or restored
    unchanged: equal before and after a release, different once a weight is changed or replaced."""
    source = _SOURCES.get(model)
    state = []
    for name, p in model.named_parameters():
        origin = source.origin(name, p) if source is not None else None
        state.append((p.data_ptr() if origin is None else origin, p._version))
    return tuple(state)


def _stored_names(files: list[Path]) -> dict[str, Path]:
    from safetensors import safe_open

    names = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            names.update(dict.fromkeys(handle.keys(), path))
    return names


def release(model: nn.Module, layer: nn.Module) -> int:
    """Release the weight matrices (2-d parameters) of `layer`, a module of `model`, where `model` was loaded by
    `load_target` and they are unchanged and stored in its checkpoint under their names; returns the bytes freed.
    Every matrix is compared with its stored copy first, so what `restore` brings back is exactly what was there."""
    source = _SOURCES.get(model)
    if source is None:
        return 0
    if source.module_names is None:
        source.module_names = {id(m): name for name, m in model.named_modules()}
    prefix = source.module_names.get(id(layer))
    if prefix is None:
        return 0
    candidates = [(f"{prefix}.{local}" if prefix else local, p) for local, p in layer.named_parameters()]
    candidates = [(name, p) for name, p in candidates if p.dim() == 2 and name not in source.released]
    if not candidates:  # (all released already: a target built before, or one sharing its copy)
        return 0
    stored = _stored_names(source.files)
    freed = 0
    zero = torch.zeros((), dtype=next(layer.parameters()).dtype, device=next(layer.parameters()).device)
    for name, p in candidates:
        if name not in stored:
            continue
        loaded_at = source.origin(name, p)  # restored by us and unchanged since: equal to the stored copy
        if loaded_at is None:
            if not _matches_stored(source, name, p, stored):
                continue
            loaded_at = p.data_ptr()
        address, nbytes = p.data_ptr(), p.numel() * p.element_size()
        p.data = zero.expand(p.shape)  # [N, K], strides (0, 0): no memory
        # a matrix mapped from the checkpoint (safetensors loads lazily) frees no memory when its tensor goes, as the
        # file stays mapped: its pages leave the resident set instead
        evict_mapped_pages(address, nbytes, source.files, equal_to_file=True)
        freed += nbytes
        source.origins[name] = (p.data_ptr(), loaded_at, p._version)
        source.released[name] = p
    if freed:
        source.hooks.append(layer.register_forward_pre_hook(lambda module, args: restore(model)))
    return freed


def restore(model: nn.Module) -> None:
    """Read every released matrix of `model` back from its checkpoint (nothing to do when none is released)."""
    source = _SOURCES.get(model)
    if source is None or not source.released:
        return
    from safetensors import safe_open

    try:
        unchanged = _stamps(source.files) == source.stamps
    except OSError:
        unchanged = False
    if not unchanged:
        raise EagleSpecError(f"the checkpoint in {source.files[0].parent} changed or went away since the model was "
                             "loaded, so its released weights cannot be read back; load the model again")
    stored = _stored_names(source.files)
    for name, p in list(source.released.items()):
        with safe_open(str(stored[name]), framework="pt") as handle:
            saved = handle.get_tensor(name).to(dtype=p.dtype, device=p.device)  # [N, K]
        p.data = saved
        source.origins[name] = (p.data_ptr(), source.origins[name][1], p._version)
        del source.released[name]
    for hook in source.hooks:
        hook.remove()
    source.hooks.clear()


def evict(model: nn.Module, parameter: nn.Parameter) -> None:
    """Take `parameter`'s pages out of the resident set where it is mapped from `model`'s checkpoint and equal to its
    stored copy (a matrix a fast target has copied but that stays in use elsewhere, such as the LM head: its pages
    are read back from the file when used)."""
    source = _SOURCES.get(model)
    name = {id(p): name for name, p in model.named_parameters()}.get(id(parameter))
    if source is not None and name is not None and _matches_stored(source, name, parameter,
                                                                    _stored_names(source.files)):
        evict_mapped_pages(parameter.data_ptr(), parameter.numel() * parameter.element_size(), source.files,
                           equal_to_file=True)


def _matching_stored(source: _Source, name: str, parameter: Tensor, stored: dict[str, Path]) -> Tensor | None:
    """`parameter`'s stored copy (named `name` in the model, read from its file) where the parameter is unchanged
    since loading and equal to it; None otherwise."""
    if name not in stored or parameter._version != source.versions.get(name):
        return None
    from safetensors import safe_open

    with safe_open(str(stored[name]), framework="pt") as handle:
        saved = handle.get_tensor(name)
    equal = saved.shape == parameter.shape and torch.equal(saved.to(parameter.dtype), parameter.detach().cpu())
    return saved if equal else None


def _matches_stored(source: _Source, name: str, parameter: Tensor, stored: dict[str, Path]) -> bool:
    """Whether `parameter` (named `name` in the model) is unchanged since loading and equal to its stored copy."""
    return _matching_stored(source, name, parameter, stored) is not None


def stored_copy(model: nn.Module, parameter: nn.Parameter, dtype: torch.dtype = torch.float32) -> Tensor | None:
    """`parameter` of `model` as its checkpoint stores it, in `dtype` (on the parameter's device), where `model` was
    loaded by `load_target` with `one_copy` and the parameter is unchanged since; None otherwise. A model loaded in
    bfloat16 from a float32 checkpoint thus yields the float32 values, not their bfloat16 rounding."""
    source = _SOURCES.get(model)
    name = {id(p): name for name, p in model.named_parameters()}.get(id(parameter))
    if source is None or name is None:
        return None
    saved = _matching_stored(source, name, parameter, _stored_names(source.files))
    return None if saved is None else saved.to(dtype=dtype, device=parameter.device)


def released_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s matrices released now."""
    source = _SOURCES.get(model)
    if source is None:
        return 0
    return sum(p.numel() * p.element_size() for p in source.released.values())
