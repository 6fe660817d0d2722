"""Helper, not a benchmark: builds eaglespec's C++ kernels as they are at a git revision, or in the working tree, under
an operator namespace of their own, so that two versions load side by side in one process (kernel_ab.py, q4_ab.py).

Accepted: the per-ISA layout, csrc/common/ (host code, ops.h with the schemas), csrc/avx512/ and csrc/avx2/ (the
micro-kernels) and one kernels.cpp per build, which lived in src/eaglespec/csrc/ from git e9119e2 until 823231a and
lives in src/eaglespec/backends/cpu/csrc/ since. Revisions of the older flat layout (src/eaglespec/csrc/bf16_gemm.cpp,
tree_attention.cpp, ops.cpp, ...) are refused.

The csrc folder is copied (`git cat-file` per file for a revision), and every `eaglespec` identifier in the copies
(TORCH_LIBRARY / TORCH_LIBRARY_IMPL / TORCH_LIBRARY_FRAGMENT, "eaglespec::op" strings, the C++ namespace) becomes the
given namespace, so neither copy registers the real torch.ops.eaglespec and the two extensions share no C++ symbol
names. The build is the ISA's kernels.cpp with the working tree's flags for that ISA (eaglespec.backends.cpu.kernels
.ISAS), cached under $TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions)/eaglespec_ab/ by a digest of the renamed
sources and the flags: a second run with the same sources loads without compiling.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from eaglespec.backends.cpu.kernels import Isa

ROOT = Path(__file__).resolve().parents[2]
# the per-ISA layout's csrc folders, newest first: since git 823231a; from e9119e2 until then
LAYOUTS = ("src/eaglespec/backends/cpu/csrc", "src/eaglespec/csrc")
FLAT = "src/eaglespec/csrc/bf16_gemm.cpp"  # a file of the older flat layout (before e9119e2)
IDENTIFIER = re.compile(r"(?<![A-Za-z0-9_])eaglespec(?![A-Za-z0-9_])")


# (hidden, MLP width, fused q/k/v width, vocabulary, layers) of the models whose step shapes the A/B scripts time
SHAPES = {"smollm2-135m": (576, 1536, 960, 49152, 30), "qwen2.5-coder-1.5b": (1536, 8960, 2048, 151936, 28),
          "qwen2.5-coder-0.5b": (896, 4864, 1152, 151936, 24)}

def _git(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, check=False)


def _layout_error(where: str, isa: Isa) -> SystemExit:
    return SystemExit(
        f"{where} does not have eaglespec's per-ISA kernel layout that these scripts build: <csrc>/common/ops.h and "
        f"<csrc>/{isa.name}/kernels.cpp, with <csrc> one of {', '.join(LAYOUTS)} (git e9119e2 or later). "
        f"Revisions of the older flat layout ({FLAT}, tree_attention.cpp, ops.cpp, csrc/avx2/q4_gemm.cpp) are not "
        "supported (compare two of them with the kernel_ab.py / q4_ab.py of a checkout from before e9119e2).")


def _revision_sources(rev: str, isa: Isa) -> tuple[str, dict[str, bytes]]:
    """(csrc folder, {path inside it: bytes}) of the kernels at `rev`."""
    commit = _git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if commit.returncode != 0:
        raise SystemExit(f"{rev!r} is not a git revision of {ROOT}")
    commit_id = commit.stdout.decode().strip()
    for folder in LAYOUTS:
        needed = (f"{folder}/common/ops.h", f"{folder}/{isa.name}/kernels.cpp")
        if all(_git("cat-file", "-e", f"{commit_id}:{path}").returncode == 0 for path in needed):
            break
    else:
        raise _layout_error(f"git revision {rev} ({commit_id[:7]})", isa)
    listed = _git("ls-tree", "-r", "-z", "--name-only", commit_id, "--", folder)
    files = {}
    for path in filter(None, listed.stdout.decode().split("\0")):
        if path.endswith((".h", ".cpp")):
            files[path[len(folder) + 1:]] = _git("cat-file", "blob", f"{commit_id}:{path}").stdout
    return folder, files


def _tree_sources(isa: Isa) -> tuple[str, dict[str, bytes]]:
    """(csrc folder, {path inside it: bytes}) of the kernels in the working tree (uncommitted changes included)."""
    for folder in LAYOUTS:
        base = ROOT / folder
        if (base / "common" / "ops.h").is_file() and (base / isa.name / "kernels.cpp").is_file():
            return folder, {path.relative_to(base).as_posix(): path.read_bytes()
                            for path in sorted(base.rglob("*")) if path.suffix in (".h", ".cpp")}
    raise _layout_error("the working tree", isa)


def build(rev: str | None, namespace: str, isa: Isa):
    """Build (or load from the cache) the kernels of git revision `rev` (None: the working tree) for `isa` under
    operator namespace `namespace`; returns (torch.ops.<namespace>, a line saying what was built)."""
    folder, files = _revision_sources(rev, isa) if rev is not None else _tree_sources(isa)
    renamed = {path: IDENTIFIER.sub(namespace, text.decode("utf-8")) for path, text in files.items()}
    registrations = sum(len(re.findall(rf"TORCH_LIBRARY\w*\(\s*{namespace}\s*,", text)) for text in renamed.values())
    if registrations == 0:
        raise SystemExit(f"{rev or 'the working tree'}: no TORCH_LIBRARY(eaglespec, ...) found in {folder}")
    digest = hashlib.sha1(repr((sorted(renamed.items()), isa.flags)).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions")) / "eaglespec_ab"
    home = cache / f"{namespace}-{isa.name}-{digest}"
    if not (home / "csrc" / isa.name / "kernels.cpp").is_file():
        cache.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f"{namespace}-", dir=cache))
        for path, text in renamed.items():
            (partial / "csrc" / path).parent.mkdir(parents=True, exist_ok=True)
            (partial / "csrc" / path).write_text(text, encoding="utf-8")
        (partial / "build").mkdir()
        try:
            partial.rename(home)
        except OSError:  # another process placed the same sources first
            shutil.rmtree(partial, ignore_errors=True)
    what = f"{rev or 'working tree'}: {folder}/{isa.name}/kernels.cpp as torch.ops.{namespace}"
    print(f"building or loading {what} ({home})", file=sys.stderr, flush=True)
    load(namespace, [str(home / "csrc" / isa.name / "kernels.cpp")], extra_cflags=list(isa.flags),
         extra_ldflags=["-fopenmp"], build_directory=str(home / "build"), is_python_module=False, verbose=False)
    return getattr(torch.ops, namespace), what


def operator_pair(against: str, op: str, isa: Isa, against_isa: Isa | None = None) -> dict:
    """{"this": the working tree's operator `op`, against: revision `against`'s}, each from its own build (`build`),
    the revision's for `against_isa` where given (another build of the kernels, e.g. the AVX-512 build against the
    AMX one on an AMX CPU), else for `isa`; exits with a message where a build lacks the operator."""
    ops = {}
    other = against_isa or isa
    label = against if other is isa else f"{against} {other.name}"
    for name, rev, namespace, build_isa in (("this", None, "eaglespec_ab_new", isa),
                                            (label, against, "eaglespec_ab_old", other)):
        library, what = build(rev, namespace, build_isa)
        if not hasattr(library, op):
            raise SystemExit(f"{what}: no {op} operator")
        ops[name] = getattr(library, op)
        print(f"{'this' if rev is None else 'against'}: {what}")
    return ops


def time_alternating(ops: dict, calls, rows: list[int], repeats: int) -> None:
    """For each number of rows, `calls(name, op, rows)` (one round: every product of a step through that build) timed
    `repeats` times per build, the builds alternating round by round after two warm-up rounds; prints the medians in
    milliseconds."""
    import statistics
    import time

    names = list(ops)
    for count in rows:
        times: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(repeats + 2):  # the first two rounds warm up
            for name in names if round_ % 2 else names[::-1]:
                start = time.perf_counter()
                calls(name, ops[name], count)
                if round_ >= 2:
                    times[name].append((time.perf_counter() - start) * 1e3)
        print(f"rows {count}: " + ", ".join(f"{name} {statistics.median(t):.2f}" for name, t in times.items()))
