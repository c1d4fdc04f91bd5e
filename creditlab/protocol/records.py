"""Run records: append-only folders, atomic writes, JSON lines.

A record is never overwritten: `new_record_dir` refuses an existing folder, `write_once` refuses an existing
file, and rows are appended one line at a time with a flush and fsync, so a run that dies leaves every row
it finished readable. The exceptions are derived or bulky files a writer replaces whole (`atomic_save`:
checkpoints, which a run also prunes to its newest `train.keep_checkpoints`), and a half-written last line,
which `repair_jsonl` cuts off before a resumed run appends.

Every JSON text is strict: a non-finite float is written as null (`strict`), and the encoder runs with
allow_nan=False so that anything else that would produce NaN or Infinity fails when written, not when read.
Every record file gets mode RECORD_MODE (0o644: readable by everyone, writable by the owner) whatever the
umask, so a record copied or shared reads the same for everyone.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import secrets
import socket
import tempfile
import time
from pathlib import Path


class RecordError(ValueError):
    """A record's file that is not what it must be (cut short, edited, not a record's file): the user's to
    repair or replace, said in one line."""


class RecordExists(RecordError, FileExistsError):
    """A record's file written a second time: records are append-only."""


# A full disk, or a folder that cannot be written: the user's to fix, whatever the code was writing.
STORAGE_ERRNOS = {errno.ENOSPC: "the disk is full; free space there or choose another folder",
                  errno.EDQUOT: "the disk quota is exhausted; free space there or choose another folder",
                  errno.EROFS: "the file system is read-only; choose a writable folder",
                  errno.EACCES: "permission denied; make it writable or choose another folder",
                  errno.EPERM: "permission denied; make it writable or choose another folder",
                  errno.ENOTDIR: "a part of that path is a file, not a folder; choose a folder",
                  errno.EEXIST: "a file is in the way of a folder to be made there; choose another folder",
                  errno.ENAMETOOLONG: "a name in that path is too long for the file system; choose a shorter one"}


def new_run_id(kind: str) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{kind}-{secrets.token_hex(3)}"


def new_record_dir(root: str | os.PathLike, kind: str) -> Path:
    path = Path(root) / new_run_id(kind)
    make_folder(path, "train.out_dir")
    return path


def make_folder(path: str | os.PathLike, setting: str, exist_ok: bool = False) -> Path:
    """mkdir -p of an output folder; a folder that cannot be made (a pseudo file system, a missing device, a name
    too long, a file in the way) is the user's to fix: one line naming it and the `setting` that moves it."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=exist_ok)
    except FileExistsError:
        if not exist_ok and path.is_dir():
            raise
        raise RecordError(f"cannot create {path}: a file is in the way; choose another folder ({setting})") from None
    except OSError as exc:
        reason = STORAGE_ERRNOS.get(exc.errno) or f"{(exc.strerror or type(exc).__name__).lower()}; choose a folder " \
            "that can be made there"
        raise RecordError(f"cannot create {path}: {reason} ({setting})") from None
    return path


RECORD_MODE = 0o644


def strict(value):
    """`value` with every non-finite float replaced by None: JSON has no NaN or Infinity."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def dumps(value, **kw) -> str:
    """The one JSON encoder of records (see the module docstring)."""
    return json.dumps(strict(value), allow_nan=False, sort_keys=True, default=str, **kw)


def _atomic_write(path: Path, text: str | bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, RECORD_MODE)  # mkstemp creates 0o600
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
        raise RecordExists(f"{path} exists and records are append-only; write a new record instead")
    text = content if isinstance(content, str) else dumps(content, indent=2) + "\n"
    _atomic_write(path, text)
    return path


def write_bytes_once(path: str | os.PathLike, data: bytes) -> Path:
    """Write bytes atomically (creating parent folders); refuse if the file already exists."""
    path = Path(path)
    if path.exists():
        raise RecordExists(f"{path} exists and records are append-only; write a new record instead")
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
    line = dumps(row) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, RECORD_MODE)
    with os.fdopen(fd, "a") as f:
        os.fchmod(fd, RECORD_MODE)  # os.open's mode passes through the umask
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def atomic_save(path: str | os.PathLike, write) -> Path:
    """Replace `path` whole by what `write(tmp_path)` writes, or leave it as it was: the bytes go to a temporary
    file beside it, which becomes `path` by one rename and is removed if anything fails (a full disk)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:  # on disk before the rename, so a crash leaves the old file or the new one
            os.fsync(f.fileno())
        os.chmod(tmp, RECORD_MODE)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def repair_jsonl(path: str | os.PathLike) -> int:
    """Cut off a half-written last line (a run killed while appending); returns the bytes removed. Only the
    last line can be half-written (rows are appended one at a time); a bad line before it stays an error."""
    path = Path(path)
    data = path.read_bytes() if path.exists() else b""
    start = data.rstrip(b"\n").rfind(b"\n") + 1  # where the last line begins
    last = data[start:]
    try:
        if last.strip():
            json.loads(last)
    except (json.JSONDecodeError, UnicodeDecodeError):
        with open(path, "r+b") as f:
            f.truncate(start)
            f.flush()
            os.fsync(f.fileno())
        return len(last)
    if data and not data.endswith(b"\n"):  # a whole row whose newline was lost: the next row needs its own line
        with open(path, "ab") as f:
            f.write(b"\n")
    return 0


class Locked(Exception):
    """Another living process holds the record."""


class RecordLock:
    """One process per record: a `lock` file holding the owner's host and pid, created exclusively. A lock
    left by a process that no longer exists (on this host) is taken over."""

    def __init__(self, folder: str | os.PathLike):
        self.path = Path(folder) / "lock"
        self.held = False

    def acquire(self) -> "RecordLock":
        me = f"{socket.gethostname()} {os.getpid()}\n"
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, RECORD_MODE)
            except FileExistsError:
                owner = self.owner()
                if owner is not None and _alive(*owner):
                    raise Locked(f"{self.path.parent} is in use by process {owner[1]} on {owner[0]}; wait for it "
                                 f"to end or stop it (a lock left by a dead process is taken over)") from None
                self.path.unlink(missing_ok=True)  # stale: its process is gone; one retry
                continue
            with os.fdopen(fd, "w") as f:
                f.write(me)
            self.held = True
            return self
        raise Locked(f"{self.path.parent} is being taken by another process; try again")

    def owner(self) -> tuple[str, int] | None:
        try:
            host, pid = self.path.read_text().split()
            return host, int(pid)
        except (OSError, ValueError):
            return None  # unreadable or half-written: treated as stale

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()


def _alive(host: str, pid: int) -> bool:
    if host != socket.gethostname():
        return True  # another machine's process cannot be checked from here: assume it lives
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return pid != 0


def read_json(path: str | os.PathLike, error: type[Exception] = RecordError,
              remedy: str = "it was cut short or edited; restore it from a copy, or start a new record"):
    """A JSON file of a record (or of prepared data, or an admission): one that does not parse raises `error`
    in one line naming the file, what is wrong and `remedy`."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        reason = f"{exc.msg} at line {exc.lineno}" if isinstance(exc, json.JSONDecodeError) else "not text"
        raise error(f"{path} is not readable JSON ({reason}): {remedy}") from None


def read_jsonl(path: str | os.PathLike, partial_last: bool = False) -> list[dict]:
    """A record's JSON lines. A line that does not parse is a RecordError naming it, except, with
    `partial_last`, a last line with no newline: what a process killed while appending leaves, left out by a
    reader that only looks (a resumed run cuts it off first, `repair_jsonl`)."""
    rows = []
    with open(path) as f:
        lines = f.readlines()
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                if partial_last and number == len(lines) and not line.endswith("\n"):
                    break
                raise RecordError(f"{path}:{number}: not a JSON line ({exc.msg}); each line is one JSON object: "
                                  f"repair or remove that line, or start a new record") from None
    return rows
