"""`prepare`: source -> documents -> splits -> tokenizer (TRAIN only) -> shards + manifest; and `info`.

Layout of a prepared folder:
    manifest.json            what was asked, what was made: per-file SHA256 and counts, tokenizer, licences
    tokenizer.json | gpt2.tiktoken
    documents.jsonl          one line per document: id, split, tokens, bytes (the audit trail of the split)
    {split}_{index:06d}.bin  token shards; every document is preceded by the separator (as in modded-nanogpt)
    ledger.jsonl             appended by DEV/FINAL_HELDOUT reads (see ledger.py); never written here

The manifest is written last, so a folder without one is not prepared, whatever else it holds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from creditlab.data import tokenizer as tokenizers
from creditlab.data.documents import Document
from creditlab.data.shards import MAX_VOCAB, file_sha256, read_header, write_shard
from creditlab.data.sources import DEFAULT_SOURCE, open_source
from creditlab.data.splits import DEFAULT_FRACTIONS, SPLITS, check_fractions, split_of

MANIFEST = "manifest.json"
DOCUMENTS = "documents.jsonl"
DEFAULT_OUT = "data/prose"
DEFAULT_SHARD_TOKENS = 100_000_000  # the modded-nanogpt shard size
FORMAT = "creditlab-shards/1"


class PrepareError(RuntimeError):
    pass


class NotPreparedError(FileNotFoundError):
    pass


def load_manifest(data_dir: str | Path) -> dict:
    path = Path(data_dir) / MANIFEST
    if not path.exists():
        raise NotPreparedError(f"no prepared data in {data_dir} ({MANIFEST} is missing); run "
                               f"`creditlab data prepare --source {DEFAULT_SOURCE} --out {data_dir}`")
    return json.loads(path.read_text())


def manifest_sha256(data_dir: str | Path) -> str:
    return file_sha256(Path(data_dir) / MANIFEST)


def info(data_dir: str | Path) -> dict:
    """A summary of a prepared folder: per-split tokens, documents and files; tokenizer; source; licences."""
    m = load_manifest(data_dir)
    return {
        "splits": {name: {"tokens": s["tokens"], "documents": s["documents"],
                          "files": [f["name"] for f in s["files"]]} for name, s in m["splits"].items()},
        "tokenizer": {k: m["tokenizer"][k] for k in ("kind", "vocab_size", "sha256")},
        "source": m["source"],
        "licences": m["licences"],
        "manifest_sha256": manifest_sha256(data_dir),
    }


def verify(data_dir: str | Path) -> list[str]:
    """Problems found re-hashing every file the manifest lists (an empty list: all files are as prepared)."""
    data_dir = Path(data_dir)
    m = load_manifest(data_dir)
    listed = [(f["name"], f["sha256"]) for s in m["splits"].values() for f in s["files"]]
    listed += [(m["tokenizer"]["file"], m["tokenizer"]["sha256"]), (DOCUMENTS, m["documents_sha256"])]
    problems = []
    for name, expected in listed:
        path = data_dir / name
        if not path.exists():
            problems.append(f"{path}: missing")
            continue
        if name.endswith(".bin"):
            try:
                read_header(path)
            except ValueError as e:
                problems.append(str(e))
                continue
        digest = file_sha256(path)
        if digest != expected:
            problems.append(f"{path}: SHA256 {digest} differs from the manifest's {expected}")
    return problems


class _SplitWriter:
    """Cuts one split's token stream into shards of `shard_tokens` tokens (documents may straddle two)."""

    def __init__(self, directory: Path, split: str, vocab_size: int, shard_tokens: int, separator: int):
        self.directory, self.split, self.vocab_size = directory, split, vocab_size
        self.shard_tokens, self.separator = shard_tokens, separator
        self.pending: list[np.ndarray] = []
        self.pending_len = 0
        self.files: list[dict] = []
        self.documents = 0
        self.bytes = 0  # UTF-8 bytes of the documents' text: the denominator of bits per byte

    def add(self, ids: list[int], n_bytes: int) -> None:
        self.pending.append(np.asarray([self.separator] + ids, dtype=np.uint16))
        self.pending_len += len(ids) + 1
        self.documents += 1
        self.bytes += n_bytes
        while self.pending_len >= self.shard_tokens:
            stream = np.concatenate(self.pending)
            self._flush(stream[:self.shard_tokens])
            rest = stream[self.shard_tokens:]
            self.pending, self.pending_len = [rest], rest.size

    def close(self) -> None:
        if self.pending_len or not self.files:  # an empty split still gets one (empty) shard
            self._flush(np.concatenate(self.pending) if self.pending else np.zeros(0, np.uint16))
        self.pending, self.pending_len = [], 0

    def _flush(self, tokens: np.ndarray) -> None:
        name = f"{self.split}_{len(self.files):06d}.bin"
        digest = write_shard(self.directory / name, tokens, self.vocab_size)
        self.files.append({"name": name, "tokens": int(tokens.size),
                           "documents": int(np.count_nonzero(tokens == self.separator)), "sha256": digest})


def _scan(docs: Iterator[Document], fractions: Sequence[float], dropped: dict) -> Iterator[tuple[Document, str]]:
    """Documents with their split, without empty texts and exact duplicates (the first copy is kept)."""
    seen_ids: set[str] = set()
    seen_texts: set[bytes] = set()
    dropped.update(empty=0, duplicate=0)
    for doc in docs:
        if doc.id in seen_ids:
            raise PrepareError(f"duplicate document id {doc.id!r}: ids must be unique within a source")
        seen_ids.add(doc.id)
        if not doc.text.strip():
            dropped["empty"] += 1
            continue
        digest = hashlib.sha256(doc.text.encode("utf-8")).digest()
        if digest in seen_texts:  # a duplicate in two splits would leak TRAIN text into DEV
            dropped["duplicate"] += 1
            continue
        seen_texts.add(digest)
        yield doc, split_of(doc.split_key, fractions)


def _batches(items: Iterator, size: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _progress(iterable, total: int | None, desc: str, enabled: bool):
    if not enabled:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="doc", file=sys.stderr)


def prepare(source: str = DEFAULT_SOURCE, out_dir: str | Path = DEFAULT_OUT, vocab_size: int | None = None,
            tokenizer: str = "bpe", text_field: str = "text", fractions: Sequence[float] = DEFAULT_FRACTIONS,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, force: bool = False, cache: Path | None = None,
            progress: bool = True, log: Callable[[str], None] = print) -> dict:
    """Prepare `source` into `out_dir` and return `info(out_dir)`.

    vocab_size counts the separator; None means the tokenizer's default (bpe 12,289; gpt2 50,257). An
    existing preparation of the same request is reported, not redone; a different one needs `force`.
    """
    if tokenizer not in tokenizers.KINDS:
        raise PrepareError(f"unknown tokenizer {tokenizer!r}; choose one of: {', '.join(tokenizers.KINDS)}")
    vocab_size = vocab_size if vocab_size is not None else tokenizers.DEFAULT_VOCAB[tokenizer]
    if tokenizer == "gpt2" and vocab_size != tokenizers.DEFAULT_VOCAB["gpt2"]:
        raise PrepareError(f"the gpt2 tokenizer has vocab_size 50257 (50256 + separator), not {vocab_size}")
    if vocab_size > MAX_VOCAB:
        raise PrepareError(f"vocab_size {vocab_size} does not fit uint16 shards (must be <= {MAX_VOCAB})")
    if shard_tokens < 1:
        raise PrepareError("shard_tokens must be positive")
    fractions = check_fractions(fractions)
    out = Path(out_dir)
    request = {"source": source, "tokenizer": tokenizer, "vocab_size": vocab_size, "text_field": text_field,
               "split_fractions": dict(zip(SPLITS, fractions)), "shard_tokens": shard_tokens}

    if (out / MANIFEST).exists():
        old = load_manifest(out)
        if old.get("request") == request and not force:
            log(f"{out} is already prepared from {source} ({tokenizer}, vocab {vocab_size}); "
                "nothing to do (pass --force to prepare it again)")
            return info(out)
        if not force:
            diff = {k: (old.get("request", {}).get(k), v) for k, v in request.items()
                    if old.get("request", {}).get(k) != v}
            raise PrepareError(f"{out} already holds data prepared differently "
                               f"({', '.join(f'{k}: {a!r} -> {b!r}' for k, (a, b) in diff.items())}); "
                               "pass --force to replace it, or choose another --out")

    start = time.time()
    src = open_source(source, text_field=text_field, cache=cache, log=log)
    dropped: dict = {}

    if tokenizer == "bpe":
        log(f"training a byte-level BPE of {vocab_size} ids on the TRAIN documents of {source}")
        train_texts = (doc.text for doc, split in _scan(iter(src.documents()), fractions, dropped) if split == "train")
        tok = tokenizers.train_bpe(train_texts, vocab_size, progress=progress)
        if tok.vocab_size < vocab_size:
            log(f"warning: the TRAIN text supports only {tok.vocab_size} ids, fewer than the {vocab_size} asked; "
                f"the tokenizer has vocab_size {tok.vocab_size}")
    else:
        tok = tokenizers.gpt2(cache, log)

    staging = out / ".staging"
    if staging.exists():
        shutil.rmtree(staging)  # left over from an interrupted run
    staging.mkdir(parents=True)
    writers = {s: _SplitWriter(staging, s, tok.vocab_size, shard_tokens, tok.separator) for s in SPLITS}
    doc_lines = []
    scanned = _scan(iter(src.documents()), fractions, dropped)
    for batch in _batches(_progress(scanned, src.count, "encoding", progress), 256):
        for (doc, split), ids in zip(batch, tok.encode_batch([d.text for d, _ in batch])):
            n_bytes = len(doc.text.encode("utf-8"))
            writers[split].add(ids, n_bytes)
            line = {"id": doc.id, "split": split, "tokens": len(ids) + 1, "bytes": n_bytes}
            doc_lines.append(json.dumps(line) + "\n")
    for w in writers.values():
        w.close()
    (staging / DOCUMENTS).write_text("".join(doc_lines))
    tok_record = tok.save(staging)
    tok_record["origin"] = (tokenizers.GPT2_ORIGIN if tok.kind == "gpt2"
                            else f"byte-level BPE trained on the TRAIN documents of {source}")

    manifest = {
        "format": FORMAT,
        "request": request,
        "source": source,
        "licences": src.licences,
        "artifacts": src.artifacts,
        "tokenizer": tok_record,
        "split_fractions": request["split_fractions"],
        "split_rule": "sha256(document group or id), first 8 bytes as a fraction of 2^64, cut at the "
                      "cumulative fractions train/dev/final_heldout",
        "document_layout": "each document is preceded by the separator token",
        "splits": {s: {"tokens": sum(f["tokens"] for f in w.files), "documents": w.documents, "bytes": w.bytes,
                       "files": w.files}
                   for s, w in writers.items()},
        "documents_sha256": file_sha256(staging / DOCUMENTS),
        "dropped_documents": dropped,
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "prepare_seconds": round(time.time() - start, 2),
    }
    _install(staging, out, manifest)
    total = sum(s["tokens"] for s in manifest["splits"].values())
    # Whole documents of very different lengths: the token shares can differ a lot from the document fractions.
    shares = ", ".join(f"{name} {s['tokens'] / max(total, 1):.1%}" for name, s in manifest["splits"].items())
    log(f"token shares: {shares} (split fractions {'/'.join(f'{f:g}' for f in fractions)} apply to documents)")
    log(f"prepared {out}: {total:,} tokens in {time.time() - start:.1f} s, tokenizer {tok.kind} "
        f"vocab {tok.vocab_size} sha256 {tok.sha256[:16]}")
    return info(out)


def _install(staging: Path, out: Path, manifest: dict) -> None:
    """Move the staged files into `out`, replacing an earlier preparation's files (never the ledger)."""
    old_manifest = out / MANIFEST
    if old_manifest.exists():
        old = json.loads(old_manifest.read_text())
        os.remove(old_manifest)  # first, so a crash below leaves the folder visibly unprepared
        stale = [f["name"] for s in old["splits"].values() for f in s["files"]]
        stale += [old["tokenizer"]["file"], DOCUMENTS]
        for name in stale:
            (out / name).unlink(missing_ok=True)
    for path in sorted(staging.iterdir()):
        os.replace(path, out / path.name)
    staging.rmdir()
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out / MANIFEST)
