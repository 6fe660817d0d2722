"""Which build of eaglespec's CPU kernels a CPU gets (eaglespec.bf16gemm.isa) and the dtype `auto` picks with it.
CPU flags are faked, so these run on any machine."""

import pytest
import torch

from eaglespec import bf16gemm, models, q4
from eaglespec.errors import EagleSpecError

AVX512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
AVX2 = {"avx", "avx2", "fma", "f16c"}


@pytest.fixture
def flags(monkeypatch):
    """Set the CPU flags eaglespec reads (and forget the cached build choice before and after)."""
    def set_flags(value: set[str]) -> None:
        monkeypatch.setattr(models, "cpu_flags", lambda: set(value))
        bf16gemm.isa.cache_clear()

    monkeypatch.delenv(bf16gemm.ISA_ENV, raising=False)
    yield set_flags
    bf16gemm.isa.cache_clear()


def test_the_widest_build_the_cpu_runs(flags):
    flags(AVX512)
    assert bf16gemm.isa().name == "avx512" and bf16gemm.isa().variants == ("dpbf16", "fma")
    flags(AVX2)
    assert bf16gemm.isa().name == "avx2" and bf16gemm.isa().variants == ("fma",)
    assert bf16gemm.cpu_supported()
    flags({"sse4_2", "avx"})  # no FMA: no build
    assert bf16gemm.isa() is None and not bf16gemm.cpu_supported()
    assert not bf16gemm.available(torch.bfloat16, "cpu")
    with pytest.raises(EagleSpecError, match="AVX-512 BF16 or AVX2"):
        bf16gemm.load.__wrapped__()


def test_the_avx2_build_can_be_forced_but_not_a_missing_one(flags, monkeypatch):
    monkeypatch.setenv(bf16gemm.ISA_ENV, "avx2")
    flags(AVX512)
    assert bf16gemm.isa().name == "avx2"  # to test or compare it on an AVX-512 machine
    monkeypatch.setenv(bf16gemm.ISA_ENV, "avx512")
    flags(AVX2)
    assert bf16gemm.isa() is None  # the CPU cannot run it
    monkeypatch.setenv(bf16gemm.ISA_ENV, "sse")
    flags(AVX2)
    with pytest.raises(EagleSpecError, match="use auto, avx512, avx2"):
        bf16gemm.isa()


def test_builds_share_the_schemas_and_packing():
    """Every build compiles csrc/ops.cpp (the schemas, the weight packing), the ISA-neutral commit and its own
    version of every operator; both compile the AVX2 4-bit block product (eaglespec.q4), which an AVX-512 CPU runs
    too, so the AVX-512 build also requires and passes the flags it needs."""
    avx2 = bf16gemm.ISAS["avx2"]
    for build in bf16gemm.ISAS.values():
        names = [source.name for source in build.sources]
        assert names[0] == "ops.cpp" and "commit_rows.cpp" in names and all(s.is_file() for s in build.sources)
        assert sorted(names) == sorted(["ops.cpp", "commit_rows.cpp", "bf16_gemm.cpp", "tree_attention.cpp",
                                        "argmax_rows.cpp", "topk_rows.cpp", "screened_argmax.cpp", "q4_gemm.cpp"])
        assert build.has_q4 and bf16gemm.Q4_SOURCE in build.sources
        # the CPU flags and compiler flags the AVX2 source needs (-mavx512f implies -mavx2, not -mf16c)
        assert avx2.cpu_flags <= build.cpu_flags and set(avx2.flags) - {"-mavx2"} <= set(build.flags)


def test_both_builds_have_the_4bit_product(flags, monkeypatch):
    """eaglespec.q4 runs wherever a build of the kernels does (AVX-512 CPUs included), unless turned off."""
    monkeypatch.delenv(q4.ENV, raising=False)
    for cpu in (AVX512, AVX2):
        flags(cpu)
        assert bf16gemm.isa().has_q4 and q4.available()
    flags({"sse4_2", "avx"})
    assert not q4.available()
    flags(AVX512)
    monkeypatch.setenv(q4.ENV, "0")
    assert not q4.available()


def test_auto_dtype_is_bfloat16_where_the_kernels_run(monkeypatch):
    """On a CPU without native bfloat16, `auto` is bfloat16 where the kernels run (AVX2: they read bfloat16 weights
    and multiply in float32), float32 otherwise; native bfloat16 CPUs always get bfloat16."""
    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(bf16gemm, "available", lambda dtype, device: True)
    assert models.parse_dtype("auto", "cpu") == torch.bfloat16
    assert models.parse_dtype("float32", "cpu") == torch.float32  # explicit choices stay
    monkeypatch.setattr(bf16gemm, "available", lambda dtype, device: False)
    assert models.parse_dtype("auto", "cpu") == torch.float32
    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: True)
    assert models.parse_dtype("auto", "cpu") == torch.bfloat16
