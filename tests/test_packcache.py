"""The exact 4-bit packing kept on disk (eaglespec.backends.cpu.packcache): a later build of the same model reads it
back instead of finding the blocks again (the same packed tensors, the same logits), and everything that could make
it stale is a miss: a changed weight (that matrix alone), a touched source file (whose old packing is then removed),
an unreadable cache file."""

import os

import pytest
import torch
from conftest import make_cpu_model
from safetensors.torch import save_file
from test_fastpath import PROMPT
from test_kquant import needs_kernel, q4_k_model  # noqa: F401 (a fixture)

from eaglespec.backends.cpu import kquant, packcache, q4
from eaglespec.targets import source
from eaglespec.targets.fast import FastTarget

pytestmark = needs_kernel


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """An empty eaglespec cache, and a count of the matrices whose blocks are looked for in the GGUF file."""
    monkeypatch.setenv("EAGLESPEC_CACHE", str(tmp_path))
    calls = []
    original = kquant.GGUFSource.blocks
    monkeypatch.setattr(kquant.GGUFSource, "blocks", lambda self, *p: calls.append(1) or original(self, *p))
    return tmp_path / "packed", calls


def build(model, path, change: bool = False) -> FastTarget:
    """A FastTarget of a fresh copy of `model` (nothing shared in memory with earlier builds), noted as converted
    from the GGUF file `path`; `change`: one weight of the last down_proj changed."""
    copy = make_cpu_model("qwen2", layers=2, hidden_size=256, intermediate_size=512).to(torch.bfloat16)
    copy.load_state_dict(model.state_dict())
    if change:
        with torch.no_grad():
            copy.model.layers[1].mlp.down_proj.weight[0, 0] += 1
    source.note_gguf(copy, path)
    return FastTarget(copy, "final")


def products(target: FastTarget) -> list:
    return [m for layer in target.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]


def test_a_later_build_reads_the_packing_back(q4_k_model, cache):  # noqa: F811
    model, path = q4_k_model
    folder, calls = cache
    first = build(model, path)
    assert first.q4_matrices == 8 and len(calls) == 8 and len(list(folder.glob("*.safetensors"))) == 1
    second = build(model, path)
    assert second.q4_matrices == 8 and len(calls) == 8  # nothing looked for again
    for a, b in zip(products(first), products(second)):
        assert isinstance(b, q4.Q4Linear) and torch.equal(a.packed, b.packed)
        assert (a.out_features, a.in_features) == (b.out_features, b.in_features)
    outs = [t.forward(PROMPT) for t in (first, second)]
    assert torch.equal(outs[0].logits, outs[1].logits)


def test_a_changed_weight_misses_for_its_matrix_only(q4_k_model, cache):  # noqa: F811
    model, path = q4_k_model
    _, calls = cache
    build(model, path)
    calls.clear()
    changed = build(model, path, change=True)
    assert len(calls) == 1 and changed.q4_matrices == 7  # (the changed matrix is not Q4_K's any more)
    assert not isinstance(changed.layers[1].down, q4.Q4Linear)
    calls.clear()
    assert build(model, path, change=True).q4_matrices == 7 and calls == []  # (its answer is kept too)


def test_a_touched_source_or_an_unreadable_cache_file_is_a_miss(q4_k_model, cache):  # noqa: F811
    model, path = q4_k_model
    folder, calls = cache
    build(model, path)
    (file,) = folder.glob("*.safetensors")
    file.write_bytes(b"not a safetensors file")
    calls.clear()
    assert build(model, path).q4_matrices == 8 and len(calls) == 8  # found again, and written again
    calls.clear()
    assert build(model, path).q4_matrices == 8 and calls == []
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    try:
        other = folder / "other-model.safetensors"  # another model's packing stays
        save_file({"m0": torch.zeros(1)}, str(other), metadata={"matrices": "{}", "sources": '["/elsewhere.gguf"]'})
        assert build(model, path).q4_matrices == 8 and len(calls) == 8
        (newer,) = [f for f in folder.glob("*.safetensors") if f != other]  # the stale packing was removed
        assert newer != file and other.is_file()
    finally:
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_cached_packing_of_another_shape_is_packed_again(q4_k_model, cache):  # noqa: F811
    model, path = q4_k_model
    folder, calls = cache
    target = build(model, path)
    stored = packcache.PackCache(model, [path])
    assert len(stored.entries) == 8
    key = next(iter(stored.entries))
    stored.entries[key] = torch.zeros(1, 1, 640, dtype=torch.uint8)  # a packing, but of no matrix of this model
    stored.changed = True
    stored.save()
    calls.clear()
    again = build(model, path)
    assert again.q4_matrices == 8 and len(calls) == 1  # that matrix alone was found and packed again
    outs = [t.forward(PROMPT) for t in (target, again)]
    assert torch.equal(outs[0].logits, outs[1].logits)
