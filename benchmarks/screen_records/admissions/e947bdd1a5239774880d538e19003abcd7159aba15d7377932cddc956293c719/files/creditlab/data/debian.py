"""Pinned Debian packages: fetched with `apt-get download PKG=VERSION`, read in pure Python (no dpkg).

A .deb is an `ar` archive whose `data.tar.xz` holds the installed files. Debian archive files are immutable
once published, so package, version, file name and SHA256 pin the bytes exactly, as the PyPI artifacts of
artifacts.py do. A cached file whose hash matches is never fetched again; a download lands in a temporary
folder inside the cache and is moved under its final name only after its hash is checked, so an interrupted
fetch leaves nothing that looks complete.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from creditlab.data.artifacts import ArtifactError, cache_dir, cached
from creditlab.data.shards import file_sha256

AR_MAGIC = b"!<arch>\n"


@dataclass(frozen=True)
class Deb:
    package: str
    version: str
    filename: str  # as apt-get download names it (an epoch's ':' becomes '%3a')
    sha256: str  # the SHA256 field of `apt-cache show PKG=VERSION`
    size: int  # bytes of the .deb, for the progress bar
    licence: str  # short name(s), read once from the package's /usr/share/doc/PKG/copyright

    @property
    def requirement(self) -> str:
        return f"{self.package}={self.version}"


def _ar_members(fh: BinaryIO, name: str) -> Iterator[tuple[str, int]]:
    """(member name, size) of each `ar` member, leaving `fh` at the member's data."""
    if fh.read(8) != AR_MAGIC:
        raise ArtifactError(f"{name}: not a .deb (no ar header)")
    while True:
        header = fh.read(60)
        if not header:
            return
        if len(header) < 60 or header[58:60] != b"`\n":
            raise ArtifactError(f"{name}: truncated or corrupt ar header")
        member = header[:16].decode("ascii").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        start = fh.tell()
        yield member, size
        fh.seek(start + size + (size & 1))  # members are padded to an even offset


class _Window:
    """A read-only view of `size` bytes of `fh` from its current position (tarfile streams from it)."""

    def __init__(self, fh: BinaryIO, size: int):
        self.fh, self.left = fh, size

    def read(self, n: int = -1) -> bytes:
        n = self.left if n is None or n < 0 else min(n, self.left)
        data = self.fh.read(n)
        self.left -= len(data)
        return data


def deb_files(path: Path) -> Iterator[tuple[str, bytes]]:
    """(path without the leading './', bytes) of every regular file in the package, in archive order."""
    with open(path, "rb") as fh:
        for member, size in _ar_members(fh, path.name):
            if not member.startswith("data.tar"):
                continue
            if member != "data.tar.xz":
                raise ArtifactError(f"{path.name}: {member} is not supported; only data.tar.xz is read "
                                    "(Debian bookworm packages use xz)")
            # Stream mode: xz cannot seek cheaply, and members are read once in order anyway.
            with tarfile.open(fileobj=_Window(fh, size), mode="r|xz") as tar:
                for info in tar:
                    if info.isfile():
                        yield info.name.removeprefix("./"), tar.extractfile(info).read()
            return
    raise ArtifactError(f"{path.name}: no data.tar member; not a binary package")


def _apt_knows(deb: Deb) -> bool:
    done = subprocess.run(["apt-cache", "show", "--no-all-versions", deb.requirement],
                          capture_output=True, text=True)
    return done.returncode == 0 and f"SHA256: {deb.sha256}" in done.stdout


def fetch_deb(deb: Deb, cache: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """The local path of `deb`, downloading it into the cache only when it is not already there."""
    cache = cache if cache is not None else cache_dir()
    path = cache / deb.filename
    if cached(path, deb.sha256, log):
        return path
    if shutil.which("apt-get") is None:
        raise ArtifactError(f"{deb.requirement}: apt-get is not installed here; place {deb.filename} "
                            f"(SHA256 {deb.sha256}) in {cache} by hand, or carry the extracted-text cache")
    if not _apt_knows(deb):
        raise ArtifactError(f"apt does not know {deb.requirement}: run `apt-get update` with Debian bookworm "
                            "main in the apt sources, then prepare again")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        done = subprocess.run(["apt-get", "download", "-q", deb.requirement], cwd=tmp,
                              capture_output=True, text=True)
        got = Path(tmp) / deb.filename
        if done.returncode != 0 or not got.exists():
            raise ArtifactError(f"could not fetch {deb.requirement} with apt-get download (exit "
                                f"{done.returncode}): {(done.stderr or done.stdout).strip()[-800:]}")
        digest = file_sha256(got)
        if digest != deb.sha256:
            raise ArtifactError(f"{deb.filename}: SHA256 {digest} differs from the pinned {deb.sha256}; "
                                "refusing to use it")
        os.replace(got, path)
    return path
