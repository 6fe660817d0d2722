"""Which build of eaglespec's CPU kernels a CPU gets (eaglespec.backends.cpu.kernels.isa) and the dtype `auto` picks
with it. CPU flags are faked, so these run on any machine."""

import os
import re
import sys
from pathlib import Path

import pytest
import torch

from eaglespec import platform
from eaglespec.backends.cpu import kernels as bf16gemm
from eaglespec.backends.cpu import q4
from eaglespec.errors import EagleSpecError

AVX512 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
AVX2 = {"avx", "avx2", "fma", "f16c"}
AMX = AVX512 | {"amx_tile", "amx_bf16", "amx_int8"}


@pytest.fixture
def flags(monkeypatch):
    """Set the CPU flags eaglespec reads (and forget the cached build choice before and after)."""
    def set_flags(value: set[str]) -> None:
        monkeypatch.setattr(platform, "cpu_flags", lambda: set(value))
        bf16gemm.isa.cache_clear()

    monkeypatch.delenv(bf16gemm.ISA_ENV, raising=False)
    monkeypatch.setattr(bf16gemm, "amx_tiles_granted", lambda: True)
    yield set_flags
    bf16gemm.isa.cache_clear()


def test_the_widest_build_the_cpu_runs(flags, monkeypatch):
    flags(AMX)
    assert bf16gemm.isa().name == "amx" and bf16gemm.isa().variants == ("dpbf16", "fma")
    monkeypatch.setattr(bf16gemm, "amx_tiles_granted", lambda: False)  # Linux did not grant the tiles
    flags(AMX)
    assert bf16gemm.isa().name == "avx512"
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
    flags(AMX)
    assert bf16gemm.isa().name == "avx512"  # on an AMX machine
    flags(AVX2)
    assert bf16gemm.isa() is None  # the CPU cannot run it
    monkeypatch.setenv(bf16gemm.ISA_ENV, "amx")
    flags(AVX512)
    assert bf16gemm.isa() is None
    monkeypatch.setenv(bf16gemm.ISA_ENV, "sse")
    flags(AVX2)
    with pytest.raises(EagleSpecError, match="use auto, amx, avx512, avx2"):
        bf16gemm.isa()


def included(source: Path) -> set[Path]:
    """A C++ source and every file it includes with quotes, at any depth."""
    files: set[Path] = set()
    todo = [source]
    while todo:
        path = todo.pop()
        if path not in files:
            files.add(path)
            todo += [Path(os.path.normpath(path.parent / name))
                     for name in re.findall(r'^#include "([^"]+)"', path.read_text(), re.MULTILINE)]
    return files


OPERATORS = ["bf16_gemm", "tree_attention", "argmax_rows", "topk_rows", "screened_argmax", "q4_gemm"]  # per ISA


def test_each_build_is_one_translation_unit_over_shared_host_code():
    """Every build compiles one translation unit (its folder's kernels.cpp: torch's headers parsed once), which
    includes the host code every build shares (csrc/common/: the schemas, the weight packing, checks, dispatch, the
    ISA-neutral commit) and its own micro-kernels of every operator; `sources` lists exactly the files it includes
    (their digest keys cached measurements, and the wheel must ship them), the 4-bit block product
    (eaglespec.backends.cpu.q4) included. The AVX-512 build requires and passes the AVX2 build's flags too."""
    avx2 = bf16gemm.ISAS["avx2"]
    for name, build in bf16gemm.ISAS.items():
        unit = bf16gemm.CSRC / name / "kernels.cpp"
        assert build.sources[0] == unit and [s for s in build.sources if s.suffix == ".cpp"] == [unit]
        assert len(set(build.sources)) == len(build.sources) and set(build.sources) == included(unit)
        for operator in OPERATORS:
            own = bf16gemm.CSRC / name / f"{operator}.h"  # (the AMX build: AVX-512's where it has none of its own)
            micro = own if name != "amx" or own.exists() else bf16gemm.CSRC / "avx512" / f"{operator}.h"
            assert {bf16gemm.CSRC / "common" / f"{operator}.h", micro} <= set(build.sources), (name, operator)
        assert {bf16gemm.CSRC / "common" / f"{shared}.h" for shared in ("ops", "commit_rows")} <= set(build.sources)
        assert build.has_q4
        # the CPU flags and compiler flags the AVX2 source needs (-mavx512f implies -mavx2, not -mf16c)
        assert avx2.cpu_flags <= build.cpu_flags and set(avx2.flags) - {"-mavx2"} <= set(build.flags)


def test_both_builds_have_the_4bit_product(flags, monkeypatch):
    """eaglespec.backends.cpu.q4 runs wherever a build of the kernels does (AVX-512 CPUs included), unless turned
    off."""
    monkeypatch.delenv(q4.ENV, raising=False)
    for cpu in (AMX, AVX512, AVX2):
        flags(cpu)
        assert bf16gemm.isa().has_q4 and q4.available()
    flags({"sse4_2", "avx"})
    assert not q4.available()
    flags(AVX512)
    monkeypatch.setenv(q4.ENV, "0")
    assert not q4.available()


def test_auto_dtype_is_bfloat16_where_the_kernels_run(monkeypatch):
    """On a CPU without native bfloat16, `auto` is bfloat16 where the kernels run (AVX2: they read bfloat16 weights
    and multiply in float32), float32 otherwise; native bfloat16 CPUs always get bfloat16. The engine asks the
    kernels (`bf16gemm.available`) and tells the platform's dtype choice."""
    monkeypatch.setattr(platform, "cpu_has_native_bf16", lambda: False)
    assert platform.parse_dtype("auto", "cpu", bf16_kernels=True) == torch.bfloat16
    assert platform.parse_dtype("float32", "cpu", bf16_kernels=True) == torch.float32  # explicit choices stay
    assert platform.parse_dtype("auto", "cpu", bf16_kernels=False) == torch.float32
    monkeypatch.setattr(platform, "cpu_has_native_bf16", lambda: True)
    assert platform.parse_dtype("auto", "cpu") == torch.bfloat16


def test_the_source_digest_reads_code_not_comments():
    """Cached measurements and training-feature stores are keyed by the kernels' code: a comment or blank edit keeps
    the key, a change to the code (or to a string literal holding "//") does not."""
    code = '#include <x>\nconst char* s = "a//b"; // note\n#define TWICE(x) \\\n  (2 * (x))\nint f() { return 1; }\n'
    edited = ('#include <x>   /* a new\n block comment */\n\nconst char* s = "a//b";   // other note\n'
              '#define TWICE(x) \\\n    (2 * (x))\n\nint f() { return 1; }  // why\n')
    assert bf16gemm.code_only(code) == bf16gemm.code_only(edited)
    assert bf16gemm.code_only(code) != bf16gemm.code_only(code.replace("return 1", "return 2"))
    assert bf16gemm.code_only(code) != bf16gemm.code_only(code.replace('"a//b"', '"a//c"'))
    assert bf16gemm.code_only(code) != bf16gemm.code_only(code.replace("\\\n  (2", "\n  (2"))  # ends the #define
    assert re.fullmatch(r"[0-9a-f]{12}", bf16gemm.source_digest())


def test_a_kernel_build_lock_left_by_a_killed_build_is_removed(tmp_path, monkeypatch, capsys):
    """An interrupted first build leaves torch's lock file behind and every later process would wait on it forever:
    an old lock goes (with a message), a recent one stays (a build may be running), no lock is no action."""
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = Path(_get_build_directory("eaglespec_lock_test", verbose=False)) / "lock"
    assert not bf16gemm.clear_stale_build_lock("eaglespec_lock_test")
    lock.touch()
    assert not bf16gemm.clear_stale_build_lock("eaglespec_lock_test") and lock.exists()
    old = lock.stat().st_mtime - bf16gemm.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert bf16gemm.clear_stale_build_lock("eaglespec_lock_test") and not lock.exists()
    assert "interrupted build" in capsys.readouterr().err


def test_amx_tiles_are_asked_of_linux_only(monkeypatch):
    """The AMX build runs only where Linux grants the process the tiles (arch_prctl); elsewhere nothing is asked and
    the answer is no, so the AVX-512 build runs."""
    monkeypatch.setattr(sys, "platform", "darwin")
    bf16gemm.amx_tiles_granted.cache_clear()
    try:
        assert bf16gemm.amx_tiles_granted() is False
    finally:
        bf16gemm.amx_tiles_granted.cache_clear()
