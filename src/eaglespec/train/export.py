"""`eaglespec export`: convert a head between our layout and the layout the EAGLE / EAGLE-3 authors publish.

Both use the same weight names (`fc.*`, `layers.0.*` or `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`). They differ
in the files: ours is config.json (with an `eaglespec` block naming the target) + model.safetensors; the official
checkpoints ship a plain decoder config.json and usually pytorch_model.bin. Import reads either (via `load_head`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..errors import EagleSpecError, HeadMismatchError
from ..heads import (
    DraftHead,
    HeadConfig,
    load_head,
    read_draft_vocab,
    save_draft_vocab,
    save_head,
)
from ..platform import parse_dtype


def official_config(head: DraftHead, dtype: torch.dtype) -> dict:
    config = head.config.to_json()
    config.pop("eaglespec", None)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    return config


def _state(head: DraftHead, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()
            for k, v in head.state_dict().items()}


def attach_target(head: DraftHead, model: str) -> None:
    """Record which target an imported head belongs to (official configs do not say), refusing a misfit."""
    from ..models import load_target
    from ..targets.hf import TargetModel

    target = TargetModel(load_target(model)[0], feature_kind=None)
    if head.config.hidden_size != target.hidden_size or head.config.vocab_size != target.vocab_size:
        raise HeadMismatchError(
            f"the head (hidden {head.config.hidden_size}, vocabulary {head.config.vocab_size}) does not fit "
            f"'{model}' (hidden {target.hidden_size}, vocabulary {target.vocab_size})")
    head.config.target = HeadConfig.for_target(target, head.config.kind, name=model).target


def export_head(src: str | Path, dst: str | Path, layout: str = "official", weights: str = "safetensors",
                model: str | None = None, dtype: str | None = None) -> Path:
    """Convert the head in `src` to `layout` ("official" or "eaglespec") in `dst`; returns `dst`."""
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise EagleSpecError("export: source and destination are the same folder")
    weights_path = src / "model.safetensors"
    stored = None
    if weights_path.is_file():
        from safetensors import safe_open

        with safe_open(str(weights_path), "pt") as f:
            stored = next((f.get_slice(k).get_dtype() for k in f.keys() if k not in ("d2t", "t2d")), None)
    head = load_head(src)  # float32; raises CheckpointError on corrupt / mismatched files
    out_dtype = (parse_dtype(dtype) if dtype
                 else {"BF16": torch.bfloat16, "F16": torch.float16}.get(stored, torch.float32))
    if model:
        attach_target(head, model)
    if layout == "eaglespec":
        save_head(head, dst, dtype=out_dtype)
        _copy_ranking(src, dst)
        return dst
    if layout != "official":
        raise EagleSpecError(f"unknown layout '{layout}' (use official or eaglespec)")
    dst.mkdir(parents=True, exist_ok=True)
    state = _state(head, out_dtype)
    if weights == "bin":
        torch.save(state, dst / "pytorch_model.bin")
    else:
        save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(official_config(head, out_dtype), indent=2) + "\n")
    _copy_ranking(src, dst)
    return dst


def _copy_ranking(src: Path, dst: Path) -> None:
    """Keep an EAGLE-1 head's token ranking (a side file the official loaders ignore)."""
    ranking = read_draft_vocab(src)
    if ranking is not None:
        save_draft_vocab(dst, *ranking)
