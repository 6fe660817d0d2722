"""Save and load draft heads in the published EAGLE / EAGLE-3 layout (config.json + model.safetensors, official
key names), and refuse heads that do not fit a target."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..errors import CheckpointError, HeadMismatchError
from .base import DraftHead
from .config import HeadConfig
from .eagle1 import Eagle1Head
from .eagle3 import Eagle3Head

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# Keys that official checkpoints may carry but we take from the target instead (its frozen embedding).
TARGET_OWNED_KEYS = ("embed_tokens.weight",)


def build_head(config: HeadConfig) -> DraftHead:
    return Eagle3Head(config) if config.kind == "eagle3" else Eagle1Head(config)


def save_head(head: DraftHead, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors. `dtype` (e.g. bfloat16) casts float weights to save space."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for key, value in head.state_dict().items():
        value = value.detach().cpu()
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        state[key] = value.contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(head.config.to_json(), indent=2) + "\n")
    return folder


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                return load_file(str(path))
            return torch.load(path, map_location="cpu", weights_only=True)
        except (SafetensorError, RuntimeError, OSError, ValueError, EOFError) as exc:
            raise CheckpointError(f"head weights '{path}' are corrupt or unreadable ({exc}); re-export the head") from exc
    raise CheckpointError(f"no head weights in '{folder}' (expected one of {', '.join(WEIGHT_FILES)})")


def load_head(folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> DraftHead:
    """Load a head from our layout or an official EAGLE / EAGLE-3 checkpoint directory."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"'{folder}' is not a head directory: config.json is missing")
    try:
        config = HeadConfig.from_json(json.loads(config_path.read_text()))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"'{config_path}' is not valid JSON ({exc})") from exc
    state = {k: v for k, v in _read_weights(folder).items() if k not in TARGET_OWNED_KEYS}
    if config.kind == "eagle3" and "t2d" in state:
        config.vocab_size = state["t2d"].numel()  # official EAGLE-3 configs give the target vocab here too
    head = build_head(config)
    expected = head.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"head weights in '{folder}' do not match a {config.kind} head: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for key, value in state.items():
        if value.shape != expected[key].shape:
            raise CheckpointError(
                f"head weight '{key}' has shape {tuple(value.shape)}, config.json implies {tuple(expected[key].shape)}"
            )
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise CheckpointError(f"head weight '{key}' holds NaN or infinite values: the checkpoint is corrupt")
    head.load_state_dict(state)
    return head.to(device=device, dtype=dtype).eval().requires_grad_(False)


def check_head_fits(head: DraftHead, target, head_name: str = "the head") -> None:
    """Raise HeadMismatchError when `head` was made for another model than `target` (a TargetModel)."""
    c = head.config
    problems = []
    if c.hidden_size != target.hidden_size:
        problems.append(f"hidden size {c.hidden_size} vs the target's {target.hidden_size}")
    if c.vocab_size != target.vocab_size:
        problems.append(f"vocabulary {c.vocab_size} vs the target's {target.vocab_size}")
    made_for = c.target
    if made_for.get("model_type") and made_for["model_type"] != target.model_type:
        problems.append(f"architecture {made_for['model_type']} vs the target's {target.model_type}")
    if made_for.get("num_hidden_layers") and made_for["num_hidden_layers"] != target.num_layers:
        problems.append(f"{made_for['num_hidden_layers']} target layers vs the target's {target.num_layers}")
    if problems:
        raise HeadMismatchError(
            f"{head_name} does not fit this target model ({'; '.join(problems)}); "
            "use a head trained for this model (eaglespec train) or pass --method vanilla"
        )
