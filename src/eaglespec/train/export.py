"""`eaglespec export`: convert a head between our layout and the layout the EAGLE / EAGLE-3 authors publish.

Both use the same weight names (`fc.*`, `layers.0.*` or `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`). They differ
in the files: ours is config.json (with an `eaglespec` block naming the target) + model.safetensors; the official
checkpoints ship a plain decoder config.json and usually pytorch_model.bin. Import reads either (via `load_head`).

`--to vllm` writes an EAGLE-3 head as vLLM's `speculative_config={"method": "eagle3", "model": DIR}` reads it: the
official config plus `eagle_config` (which target hidden states feed the head: index k = transformers'
`hidden_states[k]`, the input of layer k); the weights as in the official layout (vLLM maps with `d2t` and skips
`t2d`, which is kept so that the folder imports back).
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


LAYOUTS = ("official", "eaglespec", "vllm")


def eagle3_feature_layers(num_layers: int) -> list[int]:
    """The target hidden states an EAGLE-3 head reads (indices into transformers' `hidden_states`): low, middle,
    high, as eaglespec.targets.hf.TargetModel.eagle3_layers picks them."""
    return [min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)]


def vllm_config(head: DraftHead, dtype: torch.dtype) -> dict:
    """vLLM's config.json for an EAGLE-3 head (LlamaForCausalLMEagle3 with `eagle_config`)."""
    layers = head.config.target.get("num_hidden_layers")
    if not layers:
        raise EagleSpecError("export --to vllm: the head does not record its target's layer count; import it with "
                             "--to eaglespec --model NAME first")
    config = official_config(head, dtype)
    config["bias"] = False  # the EAGLE-3 fc has none
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": eagle3_feature_layers(int(layers)),
                              "use_aux_hidden_state": True}
    return config


def export_head(src: str | Path, dst: str | Path, layout: str = "official", weights: str = "safetensors",
                model: str | None = None, dtype: str | None = None) -> Path:
    """Convert the head in `src` to `layout` ("official", "eaglespec" or "vllm") in `dst`; returns `dst`."""
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
    if layout not in LAYOUTS:
        raise EagleSpecError(f"unknown layout '{layout}' (use {', '.join(LAYOUTS)})")
    if layout == "vllm":
        if head.config.kind != "eagle3":
            raise EagleSpecError("export --to vllm takes an EAGLE-3 head (this one is EAGLE-1)")
        if weights != "safetensors":
            raise EagleSpecError("export --to vllm writes safetensors: drop --weights bin")
        config = vllm_config(head, out_dtype)
        dst.mkdir(parents=True, exist_ok=True)
        save_file(_state(head, out_dtype), str(dst / "model.safetensors"), metadata={"format": "pt"})
        (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return dst
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
