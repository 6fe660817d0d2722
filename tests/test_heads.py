"""Head checkpoints: save/load round trip, official key names, and clear errors for bad files."""

import json

import pytest
import torch
from conftest import make_cpu_model, make_model
from safetensors.torch import load_file, save_file

from eaglespec.errors import CheckpointError, EagleSpecError, HeadMismatchError
from eaglespec.heads import (
    HeadConfig,
    build_head,
    check_head_fits,
    load_head,
    save_draft_vocab,
    save_head,
)
from eaglespec.heads.layer import KVCache
from eaglespec.targets.hf import TargetModel

EAGLE1_KEYS = {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
               "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
               "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
               "layers.0.post_attention_layernorm.weight"}
EAGLE3_KEYS = {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
               "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
               "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "midlayer.hidden_norm.weight",
               "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight", "norm.weight",
               "lm_head.weight", "d2t", "t2d"}


@pytest.fixture(scope="module")
def target():
    """On the CPU: these tests are about checkpoint files (the GPU run covers drafting with heads elsewhere)."""
    return TargetModel(make_cpu_model("llama"))


def make_head(target, kind):
    torch.manual_seed(0)
    head = build_head(HeadConfig.for_target(target, kind, name="tiny", draft_vocab_size=40)).eval()
    if kind == "eagle3":
        head.set_vocab(torch.arange(0, 80, 2))
    return head


def head_outputs(head, target):
    hidden = torch.randn(5, target.hidden_size, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([1, 2, 3, 4, 5])
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    out = head.step(head.lift(torch.cat([hidden] * (3 if head.config.kind == "eagle3" else 1), -1)),
                    target.embed_tokens(ids), torch.arange(5), KVCache(), mask)
    return head.logits(out, target.lm_head)


@pytest.mark.parametrize("kind, keys", [("eagle1", EAGLE1_KEYS), ("eagle3", EAGLE3_KEYS)])
def test_round_trip_official_layout(tmp_path, target, kind, keys):
    head = make_head(target, kind)
    folder = save_head(head, tmp_path / kind)
    assert set(load_file(str(folder / "model.safetensors"))) == keys
    config = json.loads((folder / "config.json").read_text())
    assert config["hidden_size"] == target.hidden_size and config["num_hidden_layers"] == 1
    assert ("draft_vocab_size" in config) == (kind == "eagle3")
    loaded = load_head(folder)
    with torch.no_grad():
        assert torch.equal(head_outputs(head, target), head_outputs(loaded, target))
    if kind == "eagle3":
        assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
        draft_ids = torch.arange(40)
        assert torch.equal(loaded.to_target_ids(draft_ids), torch.arange(0, 80, 2))
    check_head_fits(loaded, target)


def test_official_checkpoint_with_embedding_and_bin_weights(tmp_path, target):
    """Official EAGLE-1 folders may ship `embed_tokens.weight` and a pytorch_model.bin: both load."""
    head = make_head(target, "eagle1")
    folder = tmp_path / "official"
    folder.mkdir()
    config = head.config.to_json()
    del config["eaglespec"]
    (folder / "config.json").write_text(json.dumps(config))
    state = dict(head.state_dict(), **{"embed_tokens.weight": torch.zeros(96, target.hidden_size)})
    torch.save(state, folder / "pytorch_model.bin")
    loaded = load_head(folder)
    assert loaded.config.kind == "eagle1"
    with torch.no_grad():
        assert torch.equal(head_outputs(head, target), head_outputs(loaded, target))


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_head(tmp_path)


def test_missing_weights(tmp_path, target):
    folder = save_head(make_head(target, "eagle1"), tmp_path / "h")
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no head weights"):
        load_head(folder)


def test_wrong_shapes_and_missing_keys(tmp_path, target):
    folder = save_head(make_head(target, "eagle1"), tmp_path / "h")
    state = load_file(str(folder / "model.safetensors"))
    state["fc.weight"] = torch.zeros(3, 3)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="fc.weight"):
        load_head(folder)
    del state["fc.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing"):
        load_head(folder)


def test_nan_weights_are_corrupt(tmp_path, target):
    folder = save_head(make_head(target, "eagle1"), tmp_path / "h")
    state = load_file(str(folder / "model.safetensors"))
    state["fc.weight"][0, 0] = float("nan")
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="NaN"):
        load_head(folder)


def test_bad_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_head(tmp_path)


def test_mismatch_names_the_difference(target):
    other = TargetModel(make_model("qwen2", layers=3))
    head = make_head(other, "eagle1")
    with pytest.raises(HeadMismatchError, match="architecture qwen2.*3 target layers"):
        check_head_fits(head, target)


def test_bfloat16_save_halves_the_size(tmp_path, target):
    head = make_head(target, "eagle1")
    a = save_head(head, tmp_path / "f32") / "model.safetensors"
    b = save_head(head, tmp_path / "bf16", dtype=torch.bfloat16) / "model.safetensors"
    assert b.stat().st_size < 0.6 * a.stat().st_size
    assert load_head(b.parent).fc.weight.dtype == torch.float32


def test_eagle1_draft_vocabulary_subset(tmp_path, target):
    head = make_head(target, "eagle1")
    full = head_outputs(head, target)  # [5, V]
    ranked = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(3))
    save_head(head, tmp_path / "h")
    save_draft_vocab(tmp_path / "h", ranked, default_size=30)
    sub = load_head(tmp_path / "h")
    ids = torch.sort(ranked[:30]).values
    assert sub.draft_vocab_size == 30 and torch.equal(sub.vocab_ids, ids)
    logits = head_outputs(sub, target)  # [5, 30]: the same scores, restricted
    assert torch.allclose(logits, full[:, ids], atol=1e-5)
    assert torch.equal(sub.to_target_ids(logits.argmax(-1)), ids[logits.argmax(-1)])
    assert load_head(tmp_path / "h", draft_vocab=0).draft_vocab_size == target.vocab_size
    assert load_head(tmp_path / "h", draft_vocab=50).draft_vocab_size == 50
    assert load_head(tmp_path / "h", draft_vocab=10_000).vocab_ids is None  # >= the vocabulary: all of it
    save_draft_vocab(save_head(head, tmp_path / "short"), ranked[:40], default_size=30)
    with pytest.raises(EagleSpecError, match="larger than"):
        load_head(tmp_path / "short", draft_vocab=50)
    (tmp_path / "h" / "draft_vocab.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="draft_vocab"):
        load_head(tmp_path / "h")
    save_head(make_head(target, "eagle3"), tmp_path / "h3")
    with pytest.raises(EagleSpecError, match="EAGLE-1"):
        load_head(tmp_path / "h3", draft_vocab=20)
    with pytest.raises(EagleSpecError, match="no draft_vocab"):
        load_head(save_head(make_head(target, "eagle1"), tmp_path / "plain"), draft_vocab=20)


def test_eagle1_subset_drafting_is_lossless():
    from conftest import TinyTokenizer

    from eaglespec import Engine, TreeSettings

    model = make_model("llama")
    t = TargetModel(model)
    head = make_head(t, "eagle1")
    head.set_draft_vocab(torch.arange(0, 96, 3))
    prompt = [5, 17, 33, 2, 9, 40]
    vanilla = Engine.from_model(model, TinyTokenizer(), method="vanilla").generate(prompt, max_new_tokens=24).tokens
    spec = Engine.from_model(model, TinyTokenizer(), head=head, tree=TreeSettings(total_tokens=10, depth=4, top_k=3))
    result = spec.generate(prompt, max_new_tokens=24)
    assert result.tokens == vanilla
    assert result.stats.target_forwards > 0
