"""The access ledger: the one door to DEV and FINAL_HELDOUT tokens.

Every DEV or FINAL_HELDOUT read appends one JSON line to `<data_dir>/ledger.jsonl` (UTC time, split, purpose,
tokens, admission id or null, rank/world size, manifest SHA256). FINAL_HELDOUT needs `allow_final_heldout=True`
and an admission id, and is read at most once per admission. The ranks of one
data-parallel evaluation are one read: each rank r of a world of size w may read once per admission, and a
later read under the same admission with another world size is refused too.

Appends are atomic on a local filesystem: one `write` of one line to a file opened in append mode, then flush
and fsync; the check-then-append of FINAL_HELDOUT runs under an exclusive lock on the ledger file.

Prepared data shared read-only (a common data folder, a read-only mount) keeps its ledger elsewhere: the
environment variable CREDITLAB_LEDGER names the ledger file to use instead (one file may serve several data
folders: each entry names its data's manifest SHA256). A read-only data folder without it is refused, saying so.
"""

from __future__ import annotations

import fcntl
import json
import os
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from creditlab.data.integrity import check_shards
from creditlab.data.prepare import load_manifest, manifest_sha256
from creditlab.data.shards import read_shard
from creditlab.data.splits import SPLITS

LEDGER = "ledger.jsonl"
LEDGER_ENV = "CREDITLAB_LEDGER"
GUARDED = ("dev", "final_heldout")


def ledger_path(data_dir: str | Path) -> Path:
    """Where the reads of data_dir are recorded: $CREDITLAB_LEDGER if set, else data_dir/ledger.jsonl."""
    moved = os.environ.get(LEDGER_ENV)
    return Path(moved).expanduser() if moved else Path(data_dir) / LEDGER


class LedgerError(PermissionError):
    pass


def split_tokens(data_dir: str | Path, split: str) -> list[np.ndarray]:
    """The memory-mapped shards of a split, each checked against the manifest's SHA256 first (see integrity.py).

    Private to this package: DEV/FINAL_HELDOUT go via read_split."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; splits: {', '.join(SPLITS)}")
    m = load_manifest(data_dir)
    check_shards(data_dir, m["splits"][split]["files"], m.get("source"))
    shards = []
    for f in m["splits"][split]["files"]:
        tokens = read_shard(Path(data_dir) / f["name"])
        if tokens.size != f["tokens"]:
            raise ValueError(f"{Path(data_dir) / f['name']}: {tokens.size} tokens, the manifest says {f['tokens']}")
        shards.append(tokens)
    return shards


def entries(data_dir: str | Path) -> list[dict]:
    """The ledger's entries for data_dir's data (a moved ledger may hold other data's entries too)."""
    path = ledger_path(data_dir)
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if os.environ.get(LEDGER_ENV):
        sha = manifest_sha256(data_dir)
        rows = [e for e in rows if e.get("manifest_sha256") == sha]
    return rows


def read_split(data_dir: str | Path, split: str, purpose: str | None, admission: str | None = None,
               allow_final_heldout: bool = False, rank: int = 0, world_size: int = 1) -> list[np.ndarray]:
    """The shards (read-only uint16 arrays) of `split`; DEV and FINAL_HELDOUT reads are written to the ledger.

    `purpose` says why (e.g. "dev loss every 100 updates"); it is recorded, so make it specific.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; splits: {', '.join(SPLITS)}")
    if split not in GUARDED:
        return split_tokens(data_dir, split)  # TRAIN needs no ledger
    if not purpose or not purpose.strip():
        raise LedgerError(f"a {split} read needs a purpose, recorded in the ledger "
                          "(e.g. purpose='dev loss every 100 updates')")
    if split == "final_heldout" and not allow_final_heldout:
        raise LedgerError("FINAL_HELDOUT is read only with an explicit allow_final_heldout=True "
                          "(at most once per admission)")
    if split == "final_heldout" and admission is None:
        raise LedgerError("FINAL_HELDOUT is read only under an admission: `creditlab admit`, then "
                          "`creditlab heldout RUN --admission ID`")
    shards = split_tokens(data_dir, split)
    entry = {
        "utc": datetime.now(timezone.utc).isoformat(timespec="microseconds"),
        "split": split,
        "purpose": purpose,
        "tokens": int(sum(s.size for s in shards)),
        "admission": admission,
        "rank": rank,
        "world_size": world_size,
        "manifest_sha256": manifest_sha256(data_dir),
    }
    line = (json.dumps(entry, sort_keys=True) + "\n").encode("utf-8")
    path = ledger_path(data_dir)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        where = f"{LEDGER_ENV}={path}" if os.environ.get(LEDGER_ENV) else f"the data folder {data_dir}"
        raise LedgerError(f"cannot write the access ledger ({path}: {(exc.strerror or str(exc)).lower()}): every "
                          f"{'/'.join(GUARDED).upper()} read is recorded, and {where} is not writable; keep the "
                          f"ledger elsewhere with export {LEDGER_ENV}=<a writable file>, e.g. "
                          f"export {LEDGER_ENV}=runs/ledger.jsonl") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if split == "final_heldout":
            _refuse_second_read(data_dir, admission, rank, world_size)
        os.write(fd, line)  # one write per line: lines of concurrent readers never interleave
        os.fsync(fd)
    finally:
        os.close(fd)  # also releases the lock
    return shards


def _refuse_second_read(data_dir: str | Path, admission: str | None, rank: int, world_size: int) -> None:
    key = admission if admission is not None else "none"
    for e in entries(data_dir):
        if e["split"] != "final_heldout" or (e["admission"] if e["admission"] is not None else "none") != key:
            continue
        if e.get("world_size", 1) != world_size or e.get("rank", 0) == rank:
            raise LedgerError(f"FINAL_HELDOUT was already read under admission {key!r} at {e['utc']} "
                              f"(purpose: {e['purpose']!r}); it is read at most once per admission. "
                              f"See {ledger_path(data_dir)}")
