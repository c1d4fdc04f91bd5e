"""Run records: append-only folders, atomic writes, JSON lines.

A record is never overwritten: `new_record_dir` refuses an existing folder, `write_once` refuses an existing
file, and rows are appended one line at a time with a flush and fsync, so a run that dies leaves every row
it finished readable.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import tempfile
import time
from pathlib import Path


def new_run_id(kind: str) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{kind}-{secrets.token_hex(3)}"


def new_record_dir(root: str | os.PathLike, kind: str) -> Path:
    path = Path(root) / new_run_id(kind)
    path.mkdir(parents=True, exist_ok=False)
    return path


def _atomic_write(path: Path, text: str | bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)  # fails if `path` exists: records are never overwritten
    finally:
        os.unlink(tmp)


def write_once(path: str | os.PathLike, content: str | dict | list) -> Path:
    """Write a file atomically; refuse if it already exists."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists and records are append-only; write a new record instead")
    text = content if isinstance(content, str) else json.dumps(content, indent=2, sort_keys=True, default=str) + "\n"
    _atomic_write(path, text)
    return path


def write_bytes_once(path: str | os.PathLike, data: bytes) -> Path:
    """Write bytes atomically (creating parent folders); refuse if the file already exists."""
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path} exists and records are append-only; write a new record instead")
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, data)
    return path


def copy_once(src: str | os.PathLike, dst: str | os.PathLike) -> str:
    """Copy a file's bytes into a record (never over an existing file); returns the SHA256 of what was copied."""
    data = Path(src).read_bytes()
    write_bytes_once(dst, data)
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def canonical_json(value) -> str:
    """The one text of a JSON value that hashes are taken over: sorted keys, no whitespace."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def append_jsonl(path: str | os.PathLike, row: dict) -> None:
    """Append one JSON line durably."""
    line = json.dumps(row, sort_keys=True, default=str) + "\n"
    with open(path, "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
    return rows
