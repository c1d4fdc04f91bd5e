"""Run records: append-only folders, atomic writes, JSON lines.

A record is never overwritten: `new_record_dir` refuses an existing folder, `write_once` refuses an existing
file, and rows are appended one line at a time with a flush and fsync, so a run that dies leaves every row
it finished readable.
"""

from __future__ import annotations

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


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
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
