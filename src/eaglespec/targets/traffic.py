"""Bytes of weights a forward reads, for the memory-traffic statistics (`GenerationStats.traffic`).

A forward of a memory-bound model reads each of its weights once, so its weight traffic is the size of what it
runs: the distinct tensors reachable from its products (plain tensors, modules, the backends' packed, quantized or
4-bit-block weights held in dataclasses, lists, partials and closures). Counted as stored, once per tensor.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import torch
from torch import nn


def tensor_bytes(*roots: object) -> int:
    """Bytes of the distinct tensors reachable from `roots`."""
    total, seen, stack = 0, set(), list(roots)
    while stack:
        obj = stack.pop()
        if obj is None or isinstance(obj, (int, float, str, bool, torch.dtype, torch.device)) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, nn.Module):  # parameters, buffers, submodules and what a backend swapped in
            stack.extend(vars(obj).values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, functools.partial):
            stack.extend([obj.func, *obj.args, *obj.keywords.values()])
        elif isinstance(obj, types.FunctionType):
            stack.extend(cell.cell_contents for cell in obj.__closure__ or ())
        elif dataclasses.is_dataclass(obj) or type(obj).__module__.startswith("eaglespec."):
            stack.extend(vars(obj).values() if hasattr(obj, "__dict__") else
                         (getattr(obj, f.name) for f in dataclasses.fields(obj)))
    return total
