"""The model registry: names, local folders, GGUF files, and the errors for what is missing."""

import json

import pytest
import torch
from tiny_hub import write_tiny_model

from eaglespec import models, platform
from eaglespec.errors import EagleSpecError, MissingPackageError


def test_missing_package_gives_the_pip_command(monkeypatch):
    spec = models.ModelSpec(name="ghost", description="", module="no_such_package_xyz", gguf_file="g.gguf",
                            pip_command="pip install --no-deps no-such-package==1.0")
    monkeypatch.setitem(models.REGISTRY, "ghost", spec)
    with pytest.raises(MissingPackageError, match=r"pip install --no-deps no-such-package==1.0"):
        models.load_target("ghost")


def test_devices_are_checked_before_loading():

    assert platform.parse_device("cpu") == torch.device("cpu")
    assert platform.parse_device("auto") == torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    for bad, message in [("tpu", "unknown device 'tpu'"), ("mps", "not supported"), ("cuda:9", "CUDA GPU")]:
        with pytest.raises(EagleSpecError, match=message):
            platform.parse_device(bad)
    if torch.cuda.is_available():
        assert platform.parse_device("cuda").type == "cuda"
    else:  # a CPU-only torch: the message says how to get a GPU build
        with pytest.raises(EagleSpecError, match="install a CUDA build of torch"):
            platform.parse_device("cuda")


def test_unknown_name_lists_known_models():
    with pytest.raises(EagleSpecError, match="smollm2-135m"):
        models.resolve_model("definitely-not-a-model")


@pytest.mark.real_model
def test_default_model_resolves_to_its_gguf_file():
    folder, gguf = models.resolve_model(models.DEFAULT_MODEL)
    assert gguf == "SmolLM2-135M-Instruct.Q4_1.gguf" and (folder / gguf).is_file()
    assert models.resolve_model(str(folder / gguf)) == (folder, gguf)  # a GGUF file path works too


def test_local_transformers_folder_loads(tmp_path):
    folder = write_tiny_model(tmp_path / "tiny")
    assert models.resolve_model(str(folder)) == (folder, None)
    model, tokenizer = models.load_target(str(folder))
    assert model.config.model_type == "llama" and not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert tokenizer.eos_token == "</s>"


def test_folder_without_config_or_single_gguf(tmp_path):
    with pytest.raises(EagleSpecError, match="no config.json"):
        models.resolve_model(str(tmp_path))


def test_unknown_dtype():
    with pytest.raises(EagleSpecError, match="dtype"):
        platform.parse_dtype("float8")


def test_dtype_auto_follows_the_hardware(monkeypatch):

    from eaglespec.platform import cpu_has_native_bf16, parse_dtype
    from eaglespec.train.trainer import auto_mixed_precision

    assert parse_dtype("auto", "cuda:0") == torch.bfloat16
    assert parse_dtype("auto") == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)
    assert parse_dtype("auto", bf16_kernels=True) == torch.bfloat16  # wherever eaglespec's bfloat16 kernels run
    assert parse_dtype("bf16") == torch.bfloat16
    with pytest.raises(EagleSpecError, match="auto, float32"):
        parse_dtype("float8")
    # A GPU without native bfloat16 (before Ampere) gets float16; one with it, bfloat16.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for native, expected in ((False, torch.float16), (True, torch.bfloat16)):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, n=native: n)
        assert parse_dtype("auto", "cuda:0") == expected
        assert auto_mixed_precision() == ("bf16" if native else "fp16")  # train head's --mixed-precision auto
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert auto_mixed_precision() == "no" and parse_dtype("auto", "cuda:0") == torch.bfloat16


def test_shipped_heads_follow_the_registry_preference():
    default = models.shipped_head_dir("smollm2-135m")
    assert default is not None and default.name == "smollm2-135m-eagle1"  # the better-drafting head comes first
    assert models.shipped_head_dir("smollm2-135m", "eagle3").name == "smollm2-135m-eagle3"
    assert models.shipped_head_dir("smollm2-135m", "medusa") is None
    assert models.shipped_head_dir("no-such-model") is None


def test_the_1_5b_ships_an_eagle3_head_for_its_own_shapes():
    """The 1.5B's head ships in the package (no model download needed to check it): EAGLE-3, a 8192-token draft
    vocabulary and an MLP of 2048 recorded in its config, for the target's width and vocabulary, in tens of MB."""
    from eaglespec.heads.checkpoint import load_head

    folder = models.shipped_head_dir("qwen2.5-coder-1.5b")
    assert folder is not None and folder == models.shipped_head_dir("qwen2.5-coder-1.5b", "eagle3")
    assert models.shipped_head_dir("qwen2.5-coder-0.5b") is None  # (the 0.5B drafts; it has no head)
    config = json.loads((folder / "config.json").read_text())
    assert config["eaglespec"]["target"]["name"] == "qwen2.5-coder-1.5b" and config["eaglespec"]["kind"] == "eagle3"
    assert (config["hidden_size"], config["vocab_size"]) == (1536, 151936)
    assert (config["draft_vocab_size"], config["intermediate_size"]) == (8192, 2048)
    assert 10 * 2**20 < (folder / "model.safetensors").stat().st_size < 80 * 2**20
    head = load_head(folder, dtype=torch.bfloat16)
    assert sum(p.numel() for p in head.parameters()) < 40_000_000
