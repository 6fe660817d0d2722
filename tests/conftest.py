"""Tiny random target models (Llama, Qwen2, Gemma3 configs) in float32, and a tiny tokenizer stand-in."""

from __future__ import annotations

import os

import pytest
import torch

from eaglespec import envs

VOCAB = 96

# Where make_model puts the tiny models: the CPU, or a GPU with EAGLESPEC_TEST_DEVICE=cuda (README, "On a
# GPU": the device-independent modules then run there; modules that test CPU kernels take make_cpu_model).
DEVICE = torch.device(envs.test_device())

# Tiny models gain nothing from threads, and several test processes may share few cores.
torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """Converted models and tree calibrations go to a temporary cache, unless EAGLESPEC_CACHE names one."""
    if not os.environ.get("EAGLESPEC_CACHE"):
        os.environ["EAGLESPEC_CACHE"] = str(tmp_path_factory.mktemp("eaglespec-cache"))
    yield


class TinyTokenizer:
    """Enough of a tokenizer for the decoding loop: token i decodes to a short word."""

    eos_token_id = None
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [(int(w) if w.isdigit() else sum(map(ord, w))) % VOCAB for w in text.split()]}


def make_model(arch: str, seed: int = 0, vocab: int = VOCAB, layers: int = 4, device: torch.device | str | None = None,
               **extra):
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    common.update(extra)
    if arch == "llama":
        config, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    elif arch == "gemma3":
        common.setdefault("sliding_window", 8)  # short, so sliding-window masking is exercised
        config = transformers.Gemma3TextConfig(head_dim=16, layer_types=None, sliding_window_pattern=2, **common)
        cls = transformers.Gemma3ForCausalLM
    else:
        raise ValueError(arch)
    model = cls(config).eval().requires_grad_(False)
    # Sharpen the output distribution so greedy continuations are not all the same token.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    return model.to(DEVICE if device is None else device)


@pytest.fixture(params=["llama", "qwen2", "gemma3"])
def tiny(request):
    return make_model(request.param), TinyTokenizer()


def make_cpu_model(arch: str, **kwargs):
    """make_model on the CPU whatever EAGLESPEC_TEST_DEVICE says: for the modules that test CPU kernels."""
    return make_model(arch, device="cpu", **kwargs)
