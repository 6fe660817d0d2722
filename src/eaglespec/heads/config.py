"""Draft-head configuration, stored as the `config.json` of the published EAGLE / EAGLE-3 layouts.

The JSON is a one-layer Llama decoder config of the target's dimensions (what vLLM and SGLang read), plus
`bias` (EAGLE-1 fc bias), `draft_vocab_size` (EAGLE-3) and an `eaglespec` block describing the target the head
was made for, used to refuse a head that does not fit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import CheckpointError
from .layer import LayerShape

KINDS = ("eagle1", "eagle3")
ARCHITECTURES = {"eagle1": "LlamaForCausalLM", "eagle3": "LlamaForCausalLMEagle3"}


@dataclass
class HeadConfig:
    kind: str
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    bias: bool = True  # EAGLE-1 fc bias
    attention_bias: bool = False
    draft_vocab_size: int | None = None  # EAGLE-3 reduced vocabulary
    target: dict[str, Any] = field(default_factory=dict)  # model_type, num_hidden_layers, hidden_size, vocab_size, name

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise CheckpointError(f"unknown head kind '{self.kind}' (expected one of {KINDS})")

    def layer_shape(self) -> LayerShape:
        return LayerShape(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            hidden_act=self.hidden_act, attention_bias=self.attention_bias,
            attn_input_size=2 * self.hidden_size if self.kind == "eagle3" else None,
        )

    @classmethod
    def for_target(cls, target, kind: str, name: str = "", **overrides: Any) -> "HeadConfig":
        """A head config with the dimensions of `target` (a TargetModel)."""
        c = target.config
        heads = c.num_attention_heads
        rope = getattr(c, "rope_parameters", None) or {}
        values: dict[str, Any] = dict(
            kind=kind, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_attention_heads=heads, num_key_value_heads=getattr(c, "num_key_value_heads", heads) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, vocab_size=target.vocab_size,
            rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
            hidden_act=getattr(c, "hidden_act", None) or getattr(c, "hidden_activation", "silu"),
            max_position_embeddings=target.max_context,
            target=dict(name=name, model_type=target.model_type, num_hidden_layers=target.num_layers,
                        hidden_size=c.hidden_size, vocab_size=target.vocab_size),
        )
        values.update(overrides)
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.kind]],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "tie_word_embeddings": False,
        }
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "vocab_size", "rms_norm_eps", "rope_theta", "hidden_act", "max_position_embeddings",
                    "bias", "attention_bias"):
            out[key] = d[key]
        if self.kind == "eagle3":
            out["draft_vocab_size"] = self.draft_vocab_size
        out["eaglespec"] = {"kind": self.kind, "target": self.target}
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "HeadConfig":
        """Read our own config.json or an official EAGLE / EAGLE-3 one."""
        ours = d.get("eaglespec", {})
        archs = " ".join(d.get("architectures") or [])
        kind = ours.get("kind") or ("eagle3" if "draft_vocab_size" in d or "Eagle3" in archs else "eagle1")
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
            return cls(
                kind=kind, hidden_size=hidden, intermediate_size=int(d["intermediate_size"]),
                num_attention_heads=heads, num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads), vocab_size=int(d["vocab_size"]),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(d.get("rope_theta") or rope.get("rope_theta", 10000.0)),
                hidden_act=d.get("hidden_act", "silu"),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                bias=bool(d.get("bias", True)), attention_bias=bool(d.get("attention_bias", False)),
                draft_vocab_size=d.get("draft_vocab_size"), target=ours.get("target", {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"head config.json is missing or has a bad field: {exc}") from exc
