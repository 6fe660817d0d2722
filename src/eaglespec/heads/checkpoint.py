"""Save and load draft heads in the published EAGLE / EAGLE-3 layout (config.json + model.safetensors, official
key names), and refuse heads that do not fit a target."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..errors import CheckpointError, EagleSpecError, HeadMismatchError
from .base import DraftHead
from .config import HeadConfig
from .eagle1 import Eagle1Head
from .eagle3 import Eagle3Head

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# EAGLE-1 heads may carry a frequency ranking of target tokens, so that drafting scores a subset of the
# vocabulary. A separate file, because the published EAGLE-1 layout has no such weight.
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
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
            raise CheckpointError(
                f"head weights '{path}' are corrupt or unreadable ({exc}); re-export the head") from exc
    raise CheckpointError(f"no head weights in '{folder}' (expected one of {', '.join(WEIGHT_FILES)})")


def save_draft_vocab(folder: str | Path, ranked_ids: torch.Tensor, default_size: int) -> Path:
    """Write an EAGLE-1 head's token ranking ([N] long, most frequent first) and the subset size used by default."""
    path = Path(folder) / DRAFT_VOCAB_FILE
    if not 0 < default_size <= ranked_ids.numel():
        raise ValueError(f"default draft vocabulary size {default_size} must be in 1..{ranked_ids.numel()}")
    save_file({"ranked_ids": ranked_ids.long().contiguous()}, str(path),
              metadata={"format": "pt", "default_size": str(default_size)})
    return path


def read_draft_vocab(folder: str | Path) -> tuple[torch.Tensor, int] | None:
    """(ranked ids [N], default size) of an EAGLE-1 head folder, or None when it has no ranking."""
    path = Path(folder) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            ranked = f.get_tensor("ranked_ids")
            default = int((f.metadata() or {}).get("default_size", ranked.numel()))
    except (SafetensorError, RuntimeError, OSError, ValueError, KeyError) as exc:
        raise CheckpointError(
            f"'{path}' is corrupt or unreadable ({exc}); delete it to draft over the full vocabulary") from exc
    if ranked.dim() != 1 or ranked.dtype != torch.long or not 0 < default <= ranked.numel():
        raise CheckpointError(
            f"'{path}' is malformed: expected 1-D int64 'ranked_ids' and 0 < default_size <= its length")
    return ranked, default


def apply_draft_vocab(head: DraftHead, folder: Path, size: int | None) -> None:
    """Restrict an EAGLE-1 head to its `size` most frequent tokens (None = the file's default, 0 = full)."""
    if head.config.kind != "eagle1":
        if size:
            raise EagleSpecError("--draft-vocab applies to EAGLE-1 heads; an EAGLE-3 head has its own fixed vocabulary")
        return
    ranking = read_draft_vocab(folder)
    if ranking is None:
        if size:
            raise EagleSpecError(f"the head in '{folder}' has no {DRAFT_VOCAB_FILE} token ranking; train it with "
                                 "`eaglespec train head` or pass --draft-vocab 0")
        return
    ranked, default = ranking
    n = default if size is None else size
    if n < 0:
        raise EagleSpecError(f"--draft-vocab must be 0 (full vocabulary) or a positive size, got {n}")
    if n == 0 or n >= head.config.vocab_size:
        head.set_draft_vocab(None)
        return
    if n > ranked.numel():
        raise EagleSpecError(f"--draft-vocab {n} is larger than the head's ranking of {ranked.numel()} tokens")
    if int(ranked.max()) >= head.config.vocab_size or int(ranked.min()) < 0:
        raise CheckpointError(f"'{folder / DRAFT_VOCAB_FILE}' holds token ids outside the vocabulary")
    head.set_draft_vocab(torch.sort(ranked[:n]).values)


def load_head(folder: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
              draft_vocab: int | None = None) -> DraftHead:
    """Load a head from our layout or an official EAGLE / EAGLE-3 checkpoint directory. `draft_vocab` (EAGLE-1):
    the size of the drafting vocabulary subset (None = the head's default, 0 = full vocabulary)."""
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
    head = head.to(device=device, dtype=dtype).eval().requires_grad_(False)
    apply_draft_vocab(head, folder, draft_vocab)
    return head


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
