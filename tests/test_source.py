"""One copy of the weights: a fast target releases the transformers model's layer matrices once it holds its own
copy, and they come back from the checkpoint, bit for bit, whenever something else runs the model."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from conftest import make_model
from tiny_hub import write_tiny_model

from eaglespec.drafters.autotree import _fingerprint
from eaglespec.errors import EagleSpecError
from eaglespec.models import load_target
from eaglespec.platform import evict_mapped_pages
from eaglespec.targets import source
from eaglespec.targets.fast import FastTarget, make_target
from eaglespec.targets.hf import TargetModel


def layer_matrices(model) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.dim() == 2 and ".layers." in name}


def greedy(target: TargetModel, prompt: list[int], n: int) -> list[int]:
    target.reset()
    tokens = torch.tensor(prompt)
    out = []
    for _ in range(n):
        logits = target.forward(tokens).logits[-1]
        target.commit()
        tokens = logits.argmax().view(1)
        out.append(int(tokens))
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("source") / "qwen2", "qwen2")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_fast_target_releases_the_layer_matrices_and_they_come_back_exact(folder, dtype):
    model, _ = load_target(str(folder), dtype=dtype, one_copy=True)
    originals = {name: p.detach().clone() for name, p in layer_matrices(model).items()}
    key_before = _fingerprint(model, layer_matrices=False)
    fast = make_target(model)
    assert isinstance(fast, FastTarget)
    matrices = layer_matrices(model)
    assert source.released_bytes(model) == sum(p.numel() * p.element_size() for p in matrices.values()) > 0
    assert all(p.untyped_storage().nbytes() <= 4 for p in matrices.values())  # one shared zero
    assert _fingerprint(model, layer_matrices=False) == key_before  # the tree calibration's key is unchanged
    prompt = [5, 9, 13, 2, 7]
    fast_tokens = greedy(fast, prompt, 8)

    generic = TargetModel(model)  # its forward runs the transformers layers: they come back first
    generic_tokens = greedy(generic, prompt, 8)
    assert source.released_bytes(model) == 0
    for name, p in layer_matrices(model).items():
        assert torch.equal(p, originals[name]), name
    fresh, _ = load_target(str(folder), dtype=dtype)
    assert generic_tokens == greedy(TargetModel(fresh), prompt, 8)
    if dtype == "float32":  # same arithmetic on both paths only where no bfloat16 rounding differs
        assert fast_tokens == generic_tokens

    # a second target with the same plan shares the built copy (the restore kept the weights' identity) and
    # releases the originals again
    again = make_target(model)
    assert again.layers is fast.layers
    assert source.released_bytes(model) > 0
    assert greedy(again, prompt, 8) == fast_tokens


def test_a_model_changed_after_loading_loaded_without_one_copy_or_built_in_memory_keeps_its_weights(folder):
    model, _ = load_target(str(folder), dtype="float32", one_copy=True)
    with torch.no_grad():
        next(iter(layer_matrices(model).values())).mul_(1.0)  # changed in place (same values, new version)
    make_target(model)
    assert source.released_bytes(model) > 0  # the other matrices still match their stored copies
    changed = next(iter(layer_matrices(model).values()))
    assert changed.untyped_storage().nbytes() == changed.numel() * changed.element_size()

    by_default, _ = load_target(str(folder), dtype="float32")  # (one_copy is the caller's choice)
    make_target(by_default)
    assert source.released_bytes(by_default) == 0

    in_memory = make_model("qwen2").eval()
    make_target(in_memory)
    assert source.released_bytes(in_memory) == 0
    assert all(p.untyped_storage().nbytes() > 4 for p in layer_matrices(in_memory).values())


def test_a_checkpoint_changed_since_loading_is_a_clear_error(tmp_path):
    folder = write_tiny_model(tmp_path / "m", "llama")
    model, _ = load_target(str(folder), dtype="float32", one_copy=True)
    make_target(model)
    assert source.released_bytes(model) > 0
    weights = next(folder.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # as if rewritten since
    with pytest.raises(EagleSpecError, match="changed or went away"):
        TargetModel(model).forward(torch.tensor([3, 4, 5]))


def mapping_rss_kb(address: int) -> int:
    """Resident kB of the mapping of /proc/self/smaps that holds `address`."""
    inside = False
    with open("/proc/self/smaps", encoding="utf-8") as f:
        for line in f:
            first = line.split()[0]
            if "-" in first and ":" not in first:
                start, end = (int(v, 16) for v in first.split("-"))
                inside = start <= address < end
            elif inside and first == "Rss:":
                return int(line.split()[1])
    raise AssertionError("no mapping holds the address")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page eviction is Linux-only (a no-op elsewhere)")
def test_mapped_pages_leave_the_resident_set_and_read_back_the_same(tmp_path):
    page = os.sysconf("SC_PAGE_SIZE")
    path = tmp_path / "weights.bin"
    data = torch.randint(0, 256, (64 * page,), dtype=torch.uint8)
    path.write_bytes(data.numpy().tobytes())
    mapped = torch.from_file(str(path), shared=False, size=64 * page, dtype=torch.uint8)  # private, as torch loads
    assert int(mapped.sum()) == int(data.sum())  # every page touched: resident
    before = mapping_rss_kb(mapped.data_ptr())
    assert before >= 64 * page // 1024
    # a private mapping only where the caller vouches that the bytes equal the file's; never another file's
    assert evict_mapped_pages(mapped.data_ptr(), 64 * page, [path]) == 0
    assert evict_mapped_pages(mapped.data_ptr(), 64 * page, [tmp_path / "other.bin"], equal_to_file=True) == 0
    # whole pages inside the range only: from the middle of page 0 to the middle of page 60 -> pages 1-59
    evicted = evict_mapped_pages(mapped.data_ptr() + page // 2, 60 * page, [path], equal_to_file=True)
    assert evicted == 59 * page
    assert mapping_rss_kb(mapped.data_ptr()) <= before - 59 * page // 1024
    assert torch.equal(mapped, data)  # read back from the file

    anonymous = data.clone()
    assert evict_mapped_pages(anonymous.data_ptr(), anonymous.numel(), [path], equal_to_file=True) == 0
    assert torch.equal(anonymous, data)

