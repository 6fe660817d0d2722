"""Packaging: a wheel of the project holds every kernel source (eaglespec.backends.cpu.kernels compiles them on first
use, so an installed package without them cannot build its kernels) and the shipped heads, and a package installed from
it (not editable) builds its kernels and multiplies with them. The wheel is built without the network (no build
isolation), so these tests need setuptools in the test environment (the `test` extra brings it)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from eaglespec.backends.cpu import kernels as bf16gemm

ROOT = Path(__file__).resolve().parents[1]
SOURCE_PACKAGE = ROOT / "src" / "eaglespec"
KERNEL_SUFFIXES = (".cpp", ".h", ".hpp")


def wheel_tools_missing() -> str | None:
    """Why a wheel of the project cannot be built offline in this environment, or None where it can."""
    if importlib.util.find_spec("setuptools") is None:
        return "setuptools is not installed: pip install -e '.[test]' (or pip install setuptools) to build a wheel"
    # setuptools >= 70.1 carries bdist_wheel itself; older ones need the wheel package
    if importlib.util.find_spec("setuptools.command.bdist_wheel") is None and importlib.util.find_spec("wheel") is None:
        return "this setuptools has no bdist_wheel and the wheel package is not installed"
    return None


def run(command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run a command; on failure, assert with the end of its output (the reason is there)."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel of this checkout (built once for the module)."""
    reason = wheel_tools_missing()
    if reason:
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("wheel")
    # setuptools builds in the checkout's build/ and puts every file it finds there into the wheel, also ones an
    # earlier build left: an empty build folder elsewhere (read from $DIST_EXTRA_CONFIG) keeps the check honest
    config = out / "build.cfg"
    config.write_text(f"[build]\nbuild_base = {out / 'build'}\n")
    run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "--disable-pip-version-check",
         "-w", str(out)], timeout=600, cwd=ROOT, env=dict(os.environ, DIST_EXTRA_CONFIG=str(config)))
    wheels = sorted(out.glob("eaglespec-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def in_wheel(path: Path, package: Path) -> str:
    """The archive name of a file of `package` (the eaglespec folder it lies in) inside a wheel."""
    return f"eaglespec/{path.relative_to(package).as_posix()}"


def test_the_wheel_holds_every_kernel_source_and_the_shipped_heads_and_ngrams(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    # every source of every build (as bf16gemm will look for them), and every kernel file in the checkout's csrc/
    # (a header or a new build's sources, at any depth)
    expected = {in_wheel(source, SOURCE_PACKAGE) for build in bf16gemm.ISAS.values()
                for source in build.sources}
    assert any("/avx2/" in name for name in expected)  # (sources one folder down: a csrc/*.cpp glob misses them)
    expected |= {in_wheel(path, SOURCE_PACKAGE) for path in (SOURCE_PACKAGE / "backends" / "cpu" / "csrc").rglob("*")
                 if path.is_file() and path.suffix in KERNEL_SUFFIXES}
    heads = {in_wheel(path, SOURCE_PACKAGE) for path in (SOURCE_PACKAGE / "shipped_heads").rglob("*")
             if path.is_file() and "__pycache__" not in path.parts}
    ngrams = {in_wheel(path, SOURCE_PACKAGE) for path in (SOURCE_PACKAGE / "shipped_ngrams").iterdir()
              if path.is_file()}
    assert any(name.endswith(".safetensors") for name in heads)
    assert any(name.endswith(".safetensors") for name in ngrams)
    missing = sorted((expected | heads | ngrams) - names)
    assert not missing, f"{wheel.name} lacks {missing}"


# Run in a fresh interpreter over the installed copy: it must be the one imported, and it must build and load the
# kernels from its own csrc/ (TORCH_EXTENSIONS_DIR is empty, so nothing built earlier is reused).
INSTALLED_CHECK = """
import sys
from pathlib import Path

import torch

import eaglespec
from eaglespec.backends.cpu import kernels as bf16gemm
from eaglespec.backends.cpu import q4

site = Path(sys.argv[1]).resolve()
assert Path(eaglespec.__file__).resolve().is_relative_to(site), eaglespec.__file__
assert bf16gemm.CSRC.resolve().is_relative_to(site), bf16gemm.CSRC
bf16gemm.load()
generator = torch.Generator().manual_seed(0)
weight = torch.randn(100, 72, generator=generator).bfloat16()
x = torch.randn(3, 72, generator=generator).bfloat16()
bias = torch.randn(100, generator=generator)
y = torch.ops.eaglespec.bf16_linear(x, torch.ops.eaglespec.bf16_pack(weight), 100, bias, bf16gemm.VARIANTS["fma"])
reference = x.float() @ weight.float().T + bias  # float32; the kernel rounds its float32 sums once to bfloat16
assert y.dtype == torch.bfloat16 and y.shape == (3, 100)
torch.testing.assert_close(y.float(), reference, atol=1e-2, rtol=1e-2)
if q4.available():  # the 4-bit product (csrc/common/q4_gemm.h) is in the build too
    q = torch.randint(0, 16, (40, 64), dtype=torch.uint8, generator=generator)
    blocks = q4.Blocks(torch.rand(40, 2, generator=generator).half(), -torch.rand(40, 2, generator=generator).half(), q)
    assert torch.equal(torch.ops.eaglespec.q4_unpack(q4.q4_pack(blocks), 40, 64), blocks.weight())
print("installed kernels ok:", bf16gemm.isa().name)
"""


@pytest.mark.kernel_build
@pytest.mark.skipif(not bf16gemm.cpu_supported(), reason="this CPU has neither AVX-512 BF16 nor AVX2 + FMA")
@pytest.mark.skipif(not bf16gemm.can_build(), reason="building the kernels needs a C++ compiler and ninja")
def test_an_installed_wheel_builds_and_runs_its_kernels(wheel: Path, tmp_path: Path) -> None:
    """pip install --target of the wheel, then a fresh interpreter that imports it from there, compiles the kernels
    from the installed sources (1-2 minutes on 2 cores) and checks a product against float32."""
    site = tmp_path / "site"
    run([sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "--target", str(site),
         str(wheel)], timeout=600)
    extensions = tmp_path / "torch_extensions"
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(extensions),
               PYTHONPATH=os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    result = run([sys.executable, "-c", INSTALLED_CHECK, str(site)], timeout=1200, cwd=tmp_path, env=env)
    assert "installed kernels ok" in result.stdout
    assert list(extensions.rglob("*.so")), "no extension was built under TORCH_EXTENSIONS_DIR"
