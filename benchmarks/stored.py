"""A stored result read by its path: the file where it is on disk, else its copy in an archive (`*.tar.xz`) of a
folder above it within benchmarks/, such as `results/raw.tar.xz`; `tar -xJf ARCHIVE` in that folder puts the
files back at their paths."""

from __future__ import annotations

import functools
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def _members(archive: Path) -> dict[str, bytes]:
    """Every file of an archive by its name in the archive (read once: an xz archive is read from its start)."""
    with tarfile.open(archive, "r:xz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar if m.isfile()}


def packed(path: Path) -> tuple[Path, str] | None:
    """The archive that holds `path` and its name there, or None."""
    path = Path(path).resolve()
    if HERE not in path.parents:
        return None
    for folder in path.parents:
        name = path.relative_to(folder).as_posix()
        for archive in sorted(folder.glob("*.tar.xz")):
            if name in _members(archive):
                return archive, name
        if folder == HERE:
            return None
    return None


def read_stored(path: Path) -> str:
    """The text of a stored result, from disk or from the archive that holds it."""
    path = Path(path)
    if path.exists():
        return path.read_text()
    found = packed(path)
    if found is None:
        raise FileNotFoundError(f"{path}: not on disk and in no archive (*.tar.xz) of a folder above it")
    archive, name = found
    return _members(archive)[name].decode()


def is_stored(path: Path) -> bool:
    """Whether `path` is on disk or in an archive of a folder above it."""
    return Path(path).exists() or packed(path) is not None
