"""Shard hashes checked before use, with a cache so that a second run does not re-hash every shard.

Every read of a split (training, evaluation, screens) and every admission check compares each shard's SHA256
with the one the manifest lists. Digests are cached in `<data_dir>/.verified.json`, keyed by file name, size
and mtime_ns: a shard rewritten since it was hashed has another mtime or size, and is hashed again. Two
digests are never cached: of a file modified in the last few seconds (mtimes advance in coarse ticks, so an
edit in the same tick could keep the mtime: git's "racily clean" problem), and of a file that changed while
it was hashed. The cache is replaced atomically (a private temporary file, then a rename); where the folder
cannot be written, nothing is cached and every read hashes. `creditlab data info --verify` never uses it.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

from creditlab.data.shards import ShardError, file_sha256

CACHE = ".verified.json"
CACHE_FORMAT = "creditlab-verified/1"
RACY_NS = 3_000_000_000  # a digest is cached only for a file last modified at least this long before hashing


class DigestCache:
    """SHA256s of the files of one folder, remembered by (name, size, mtime_ns) across processes."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._entries = self._load()
        self._changed = False
        self.hashed: list[str] = []  # names hashed by this instance (not answered from the cache)

    def _load(self) -> dict[str, dict]:
        try:
            data = json.loads((self.directory / CACHE).read_text())
        except (OSError, ValueError):
            return {}  # no cache, or a damaged one: hash everything again
        if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or not isinstance(data.get("files"), dict):
            return {}
        return data["files"]

    def sha256(self, name: str) -> str:
        """The SHA256 of directory/name; raises FileNotFoundError if it is missing."""
        path = self.directory / name
        before = os.stat(path)
        key = {"size": before.st_size, "mtime_ns": before.st_mtime_ns}
        entry = self._entries.get(name)
        if isinstance(entry, dict) and all(entry.get(k) == v for k, v in key.items()) \
                and isinstance(entry.get("sha256"), str):
            return entry["sha256"]
        started = time.time_ns()
        digest = file_sha256(path)
        self.hashed.append(name)
        after = os.stat(path)
        unchanged = (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
        if unchanged and before.st_mtime_ns <= started - RACY_NS:
            self._entries[name] = key | {"sha256": digest}
            self._changed = True
        return digest

    def save(self) -> None:
        """Write the cache if it learnt anything; a folder that cannot be written keeps no cache."""
        if not self._changed:
            return
        self._changed = False
        tmp = self.directory / f"{CACHE}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
        try:
            tmp.write_text(json.dumps({"format": CACHE_FORMAT, "files": self._entries}, indent=1, sort_keys=True)
                           + "\n")
            os.replace(tmp, self.directory / CACHE)
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass


def shard_problems(data_dir: str | os.PathLike, files: list[dict], cache: DigestCache | None = None) -> list[str]:
    """One line per listed shard ({name, sha256}) that is missing or whose SHA256 is not the listed one."""
    cache = cache if cache is not None else DigestCache(data_dir)
    problems = []
    try:
        for f in files:
            path = Path(data_dir) / f["name"]
            try:
                digest = cache.sha256(f["name"])
            except FileNotFoundError:
                problems.append(f"{path} is missing")
                continue
            if digest != f["sha256"]:
                problems.append(f"{path} has SHA256 {digest[:16]}…, the manifest lists {f['sha256'][:16]}…")
    finally:
        cache.save()
    return problems


def check_shards(data_dir: str | os.PathLike, files: list[dict], source: str | None = None) -> None:
    """Raise ShardError, naming every bad shard, unless each listed shard has the manifest's SHA256."""
    problems = shard_problems(data_dir, files)
    if problems:
        from creditlab.data.prepare import prepare_again

        raise ShardError(f"shards differ from the manifest of {data_dir}: {'; '.join(problems)}; restore them, "
                         f"or {prepare_again(data_dir)}")
