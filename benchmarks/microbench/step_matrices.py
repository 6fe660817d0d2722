"""The layer matrices of one SmolLM2-135M decode step as the compiled fast path multiplies them (per layer: fused
QKV, O, fused gate/up, down), read back as float32 from the default model's converted GGUF folder. Shared by
q4_cost.py and q4_ab.py."""

from pathlib import Path

import torch
from safetensors import safe_open

from eaglespec.models import load_target


def step_matrices() -> list[torch.Tensor]:
    """[N, K] float32 weights, 4 per layer, in layer order."""
    model, _ = load_target("smollm2-135m", "float32")
    checkpoint = safe_open(str(Path(model.name_or_path) / "model.safetensors"), framework="pt")
    matrices = []
    for layer in range(model.config.num_hidden_layers):
        def weight(name: str) -> torch.Tensor:
            return checkpoint.get_tensor(f"model.layers.{layer}.{name}.weight")
        matrices += [torch.cat([weight("self_attn.q_proj"), weight("self_attn.k_proj"), weight("self_attn.v_proj")]),
                     weight("self_attn.o_proj"), torch.cat([weight("mlp.gate_proj"), weight("mlp.up_proj")]),
                     weight("mlp.down_proj")]
    return matrices
