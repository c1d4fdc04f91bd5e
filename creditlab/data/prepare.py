"""`prepare`: source -> documents -> splits -> tokenizer (TRAIN only) -> shards + manifest; and `info`.

Layout of a prepared folder:
    manifest.json            what was asked, what was made: per-file SHA256 and counts, tokenizer, licences;
                             a pure function of the request and the source's documents: no times or durations
                             (a local path appears only where the source spec names one: dir:PATH)
    prepare.json             when, how long, how fast and where this preparation ran: never hashed or frozen
    tokenizer.json | gpt2.tiktoken
    documents.jsonl          one line per document: id, split, tokens, bytes (the audit trail of the split)
    {split}_{index:06d}.bin  token shards; every document is preceded by the separator (as in modded-nanogpt)
    ledger.jsonl             appended by DEV/FINAL_HELDOUT reads (see ledger.py); never written here
    .verified.json           the shard hash cache of readers (see integrity.py); never written here

The manifest is written last, so a folder without one is not prepared, whatever else it holds.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import platform
import shlex
import shutil
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from creditlab.data import tokenizer as tokenizers
from creditlab.data.documents import Document
from creditlab.data.shards import HEADER_BYTES, MAX_VOCAB, ShardError, file_sha256, read_header, write_shard
from creditlab.data.sources import DEFAULT_SOURCE, Source, open_source
from creditlab.data.splits import DEFAULT_FRACTIONS, SPLITS, check_fractions, split_of
from creditlab.protocol.records import read_json

MANIFEST = "manifest.json"
DOCUMENTS = "documents.jsonl"
NO_ORIGIN = "(none)"  # the origin of a document id without a `/`
RUN_RECORD = "prepare.json"
RUN_FORMAT = "creditlab-prepare-run/1"
DEFAULT_TOKENIZER_SAMPLE_MB = 64  # bounds BPE training time; pack:prose (~15 MB) still trains on all of TRAIN
ENCODE_BATCH_BYTES = 8 << 20  # text per encode_batch call: enough for every thread, small enough to bound memory
DEFAULT_OUT = "data/prose"
DEFAULT_SHARD_TOKENS = 100_000_000  # the modded-nanogpt shard size
FORMAT = "creditlab-shards/1"


class PrepareError(RuntimeError):
    pass


class NotPreparedError(FileNotFoundError):
    pass


def prepare_command(source: str, out: str | Path, *flags: str) -> str:
    """A `creditlab data prepare` line to copy and paste: every argument quoted for the shell. Suggestions never
    carry --force: they prepare into a folder that holds nothing yet, and the user points data.dir at it."""
    return " ".join(shlex.quote(str(a)) for a in ("creditlab", "data", "prepare", "--source", source, "--out", out,
                                                    *flags))


def recorded_source(data_dir: str | Path) -> str | None:
    """The source a prepared folder was made from, as its manifest or its run record names it (None: neither
    readable)."""
    for name in (MANIFEST, RUN_RECORD):
        try:
            source = json.loads((Path(data_dir) / name).read_text()).get("source")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(source, str) and source:
            return source
    return None


def fresh_folder(data_dir: str | Path, suffix: str) -> str:
    """A folder beside data_dir that holds nothing yet, for data prepared again or anew."""
    base = str(data_dir).rstrip("/") or "data"
    candidate, k = f"{base}-{suffix}", 2
    while Path(candidate).exists():
        candidate, k = f"{base}-{suffix}{k}", k + 1
    return candidate


def prepare_again(data_dir: str | Path, why: str = "again") -> str:
    """How to prepare the data of data_dir again without touching it: its own source into a new folder."""
    source = recorded_source(data_dir)
    other = fresh_folder(data_dir, why)
    if source is None:
        return (f"prepare it again from its source into a new folder (`creditlab data prepare --source SOURCE --out "
                f"{shlex.quote(other)}`) and run with `--set data.dir={shlex.quote(other)}`")
    return (f"prepare it again into a new folder: `{prepare_command(source, other)}`, then run with "
            f"`--set data.dir={shlex.quote(other)}`")


def load_manifest(data_dir: str | Path) -> dict:
    if not str(data_dir).strip():
        raise NotPreparedError("data.dir is empty; name the folder `creditlab data prepare --out` wrote, e.g. "
                               "--set data.dir=data/prose")
    path = Path(data_dir) / MANIFEST
    if Path(data_dir).is_file():
        raise NotPreparedError(f"{data_dir} is a file, not a prepared data folder; give the folder `creditlab data "
                               f"prepare --out` wrote (data.dir)")
    if not path.exists():
        raise NotPreparedError(f"no prepared data in {data_dir} ({MANIFEST} is missing); run "
                               f"`{prepare_command(DEFAULT_SOURCE, data_dir)}`")
    manifest = read_json(path, ShardError, prepare_again(data_dir))
    tokenizer = manifest.get("tokenizer", {}) if isinstance(manifest, dict) else {}
    file = Path(data_dir) / str(tokenizer.get("file", "tokenizer.json"))
    if tokenizer.get("sha256") and file.exists() and file_sha256(file) != tokenizer["sha256"]:
        raise ShardError(f"the tokenizer in {data_dir} ({file.name}) is not the one its {MANIFEST} lists (SHA256 "
                         f"{file_sha256(file)[:16]}, listed {tokenizer['sha256'][:16]}): the folder mixes two "
                         f"preparations; {prepare_again(data_dir)}")
    return manifest


def manifest_sha256(data_dir: str | Path) -> str:
    return file_sha256(Path(data_dir) / MANIFEST)


def info(data_dir: str | Path) -> dict:
    """A summary of a prepared folder: per-split tokens, documents and files; composition by origin; tokenizer;
    source; licences."""
    m = load_manifest(data_dir)
    return {
        "splits": {name: {"tokens": s["tokens"], "documents": s["documents"],
                          "files": [f["name"] for f in s["files"]]} for name, s in m["splits"].items()},
        "composition": composition(data_dir),
        "tokenizer": {k: m["tokenizer"][k] for k in ("kind", "vocab_size", "sha256")},
        "source": m["source"],
        "licences": m["licences"],
        "manifest_sha256": manifest_sha256(data_dir),
    }


def origin_of(doc_id: str) -> str:
    """The first `/`-separated component of a document id (`shakespeare/hamlet` -> `shakespeare`): its pack part,
    author or top folder. An id without `/` (a file at the top of a dir: source, a jsonl record) has none."""
    head, sep, _ = doc_id.partition("/")
    return head if sep else NO_ORIGIN


def composition(data_dir: str | Path) -> dict[str, dict[str, dict]]:
    """split -> origin -> {tokens, documents, bytes, share of the split's tokens}, largest first (documents.jsonl)."""
    path = Path(data_dir) / DOCUMENTS
    if not path.exists():
        return {}  # `data info --verify` reports it missing
    per_split: dict[str, dict[str, dict]] = {s: {} for s in SPLITS}
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            doc = json.loads(line)
            row = per_split[doc["split"]].setdefault(origin_of(doc["id"]), {"tokens": 0, "documents": 0, "bytes": 0})
            row["tokens"] += doc["tokens"]
            row["documents"] += 1
            row["bytes"] += doc["bytes"]
    out = {}
    for split, origins in per_split.items():
        total = sum(r["tokens"] for r in origins.values())
        ranked = sorted(origins.items(), key=lambda kv: (-kv[1]["tokens"], kv[0]))
        out[split] = {name: r | {"share": round(r["tokens"] / total, 6) if total else 0.0} for name, r in ranked}
    return out


def _size_problem(path: Path, tokens: int) -> str | None:
    """Why a shard's file size is not the manifest's (a 1024-byte header + 2 bytes per token), or None."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path}: missing"
    expected = HEADER_BYTES + 2 * tokens
    if size != expected:
        return (f"{path}: {size:,} bytes, but the manifest's {tokens:,} tokens make {expected:,} "
                f"({HEADER_BYTES}-byte header + 2 bytes per token)")
    return None


def size_problems(data_dir: str | Path) -> list[str]:
    """Each listed shard's size against the manifest (no hashing: cheap enough for every `data info`)."""
    m = load_manifest(data_dir)
    found = (_size_problem(Path(data_dir) / f["name"], f["tokens"]) for s in m["splits"].values() for f in s["files"])
    return [p for p in found if p is not None]


def verify(data_dir: str | Path) -> list[str]:
    """Problems found checking sizes and re-hashing every file the manifest lists, never from a cache (an
    empty list: all files are as prepared)."""
    data_dir = Path(data_dir)
    m = load_manifest(data_dir)
    listed = [(f["name"], f["sha256"], f["tokens"]) for s in m["splits"].values() for f in s["files"]]
    listed += [(m["tokenizer"]["file"], m["tokenizer"]["sha256"], None), (DOCUMENTS, m["documents_sha256"], None)]
    problems = []
    for name, expected, tokens in listed:
        path = data_dir / name
        if not path.exists():
            problems.append(f"{path}: missing")
            continue
        if tokens is not None:
            problem = _size_problem(path, tokens)
            if problem is None:
                try:
                    read_header(path)
                except ValueError as e:
                    problem = str(e)
            if problem is not None:
                problems.append(problem)
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


def _scan(docs: Iterable[Document], fractions: Sequence[float],
          dropped: dict) -> Iterator[tuple[Document, str, int]]:
    """Documents with their split and UTF-8 size, without empty texts and exact duplicates (the first copy is kept)."""
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
        raw = doc.text.encode("utf-8")
        digest = hashlib.sha256(raw).digest()
        if digest in seen_texts:  # a duplicate in two splits would leak TRAIN text into DEV
            dropped["duplicate"] += 1
            continue
        seen_texts.add(digest)
        yield doc, split_of(doc.split_key, fractions), len(raw)


class _Sample:
    """The tokenizer's sample: TRAIN documents in order of sha256(id), up to the first that reaches the budget.

    The order is a property of each document alone, so the sample does not depend on the source's order, and
    a max-heap on the digest keeps only documents that can still be in it: memory is bounded by the sample,
    not by the corpus. A budget of None takes every TRAIN document.
    """

    RULE = ("TRAIN documents in ascending order of sha256(id), up to and including the first whose bytes reach "
            "the budget (all TRAIN documents when the budget is null)")

    def __init__(self, budget_bytes: int | None):
        self.budget = budget_bytes
        self._heap: list[tuple[int, int, str]] = []  # (-digest as an integer, bytes, id): the largest digest on top
        self._bytes = 0
        self.train_documents = self.train_bytes = 0

    def add(self, doc_id: str, n_bytes: int) -> None:
        self.train_documents += 1
        self.train_bytes += n_bytes
        if self.budget is None:
            return
        key = -int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest(), "big")
        heapq.heappush(self._heap, (key, n_bytes, doc_id))
        self._bytes += n_bytes
        # The largest digest is not needed when the smaller ones already reach the budget without it.
        while self._bytes - self._heap[0][1] >= self.budget:
            self._bytes -= heapq.heappop(self._heap)[1]

    def ids(self) -> set[str] | None:
        """The sampled ids (membership only), or None for all TRAIN documents."""
        return None if self.budget is None else {doc_id for _, _, doc_id in self._heap}

    def record(self) -> dict:
        taken = (self.train_documents, self.train_bytes) if self.budget is None else (len(self._heap), self._bytes)
        return {"rule": self.RULE, "budget_bytes": self.budget, "documents": taken[0], "bytes": taken[1],
                "train_documents": self.train_documents, "train_bytes": self.train_bytes}


@dataclass
class _Census:
    """What one pass over the source found: documents and bytes per split, drops, and the tokenizer's sample."""

    documents: dict[str, int]
    bytes: dict[str, int]
    dropped: dict[str, int]
    sample: _Sample


def _census(src: Source, fractions: Sequence[float], sample_bytes: int | None, progress: bool) -> _Census:
    census = _Census({s: 0 for s in SPLITS}, {s: 0 for s in SPLITS}, {}, _Sample(sample_bytes))
    scanned = _scan(src.documents(), fractions, census.dropped)
    for doc, split, n_bytes in _progress(scanned, src.count, "reading", progress):
        census.documents[split] += 1
        census.bytes[split] += n_bytes
        if split == "train":
            census.sample.add(doc.id, n_bytes)
    return census


def _check_not_empty(census: _Census, fractions: Sequence[float], source: str) -> None:
    """An empty corpus, or a split that was given a share but got no document, is refused before any work."""
    total = sum(census.documents.values())
    if total == 0:
        dropped = census.dropped
        raise PrepareError(f"{source} has no documents with text ({dropped['empty']} empty and "
                           f"{dropped['duplicate']} duplicate documents dropped); nothing to prepare")
    empty = [s for s, f in zip(SPLITS, fractions) if f > 0 and census.documents[s] == 0]
    if empty:
        shares = "/".join(f"{f:g}" for f in fractions)
        raise PrepareError(f"split {', '.join(empty)} got none of the {total} documents of {source} (split "
                           f"fractions {shares}); add documents, or give that split no share with --splits "
                           "(e.g. --splits 100/0/0)")


def _byte_batches(items: Iterable[tuple[Document, str, int]], limit: int) -> Iterator[list]:
    """Consecutive documents in batches of about `limit` bytes of text (a longer document is a batch alone)."""
    batch, size = [], 0
    for item in items:
        batch.append(item)
        size += item[2]
        if size >= limit:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _progress(iterable, total: int | None, desc: str, enabled: bool):
    if not enabled:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit="doc", file=sys.stderr)


def _encode(src: Source, fractions: Sequence[float], tok: tokenizers.Tokenizer, writers: dict[str, _SplitWriter],
            documents_file: Path, total_bytes: int, progress: bool) -> None:
    """Encode every kept document into its split's writer and its line into documents.jsonl.

    The tokenizer's batch encoder runs on many threads over one batch, so batches are large (by bytes: a
    batch of a few long documents is as much work as one of many short ones); one batch at a time keeps
    memory bounded whatever the corpus size.
    """
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total_bytes, desc="encoding", unit="B", unit_scale=True, file=sys.stderr)
    with open(documents_file, "w", encoding="utf-8") as lines:
        for batch in _byte_batches(_scan(src.documents(), fractions, {}), ENCODE_BATCH_BYTES):
            for (doc, split, n_bytes), ids in zip(batch, tok.encode_batch([d.text for d, _, _ in batch])):
                writers[split].add(ids, n_bytes)
                lines.write(json.dumps({"id": doc.id, "split": split, "tokens": len(ids) + 1, "bytes": n_bytes}) + "\n")
            if bar is not None:
                bar.update(sum(n for _, _, n in batch))
    if bar is not None:
        bar.close()


def prepare(source: str = DEFAULT_SOURCE, out_dir: str | Path = DEFAULT_OUT, vocab_size: int | None = None,
            tokenizer: str = "bpe", text_field: str = "text", fractions: Sequence[float] = DEFAULT_FRACTIONS,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, force: bool = False, cache: Path | None = None,
            progress: bool = True, log: Callable[[str], None] = print,
            tokenizer_sample_mb: float = DEFAULT_TOKENIZER_SAMPLE_MB) -> dict:
    """Prepare `source` into `out_dir` and return `info(out_dir)`.

    vocab_size counts the separator; None means the tokenizer's default (bpe 12,289; gpt2 50,257). The BPE is
    trained on a sample of TRAIN of `tokenizer_sample_mb` MB (0: all of TRAIN); every document is encoded. An
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
    if not tokenizer_sample_mb >= 0:
        raise PrepareError(f"tokenizer_sample_mb must be >= 0 (0: train on all of TRAIN), got {tokenizer_sample_mb}")
    fractions = check_fractions(fractions)
    out = Path(out_dir)
    # The sample applies to a trained tokenizer only: gpt2's request does not depend on it.
    sample_mb = tokenizer_sample_mb if tokenizer == "bpe" else None
    request = {"source": source, "tokenizer": tokenizer, "vocab_size": vocab_size, "text_field": text_field,
               "split_fractions": dict(zip(SPLITS, fractions)), "shard_tokens": shard_tokens,
               "tokenizer_sample_mb": sample_mb}

    if _already_prepared(out, request, force, log):
        return info(out)

    clock = _Clock()
    src = open_source(source, text_field=text_field, cache=cache, log=log)
    sample_bytes = round(sample_mb * 1e6) if sample_mb else None
    census = _census(src, fractions, sample_bytes, progress)
    _check_not_empty(census, fractions, source)
    clock.lap("read")
    if tokenizer == "bpe":
        tok = _train_bpe(src, census, fractions, vocab_size, progress, log)
    else:
        tok = tokenizers.gpt2(cache, log)
    clock.lap("tokenizer")

    staging = out / ".staging"
    if staging.exists():
        shutil.rmtree(staging)  # left over from an interrupted run
    staging.mkdir(parents=True)
    writers = {s: _SplitWriter(staging, s, tok.vocab_size, shard_tokens, tok.separator) for s in SPLITS}
    text_bytes = sum(census.bytes.values())
    _encode(src, fractions, tok, writers, staging / DOCUMENTS, text_bytes, progress)
    for w in writers.values():
        w.close()
    clock.lap("encode")
    changed = [s for s, w in writers.items() if (w.documents, w.bytes) != (census.documents[s], census.bytes[s])]
    if changed:
        raise PrepareError(f"{source} yielded different documents on a second reading (split {', '.join(changed)}); "
                           "is it being written to? Prepare again when it is stable")
    tok_record = tok.save(staging)
    if tok.kind == "gpt2":
        tok_record["origin"] = tokenizers.GPT2_ORIGIN
    else:
        tok_record["origin"] = f"byte-level BPE trained on a sample of the TRAIN documents of {source}"
        tok_record["sample"] = census.sample.record()

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
        "dropped_documents": census.dropped,
    }
    _install(staging, out, manifest)
    total = sum(s["tokens"] for s in manifest["splits"].values())
    encode_s = clock.laps["encode"]
    speed = text_bytes / 1e6 / max(encode_s, 1e-9)
    _write_run_record(out, {
        "format": RUN_FORMAT, "manifest_sha256": manifest_sha256(out),
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "out": str(out.resolve()), "source": source, "cache": str(cache) if cache is not None else None,
        "seconds": clock.laps | {"total": round(clock.total(), 3)},
        "text_bytes": text_bytes, "tokens": total, "encode_mb_per_s": round(speed, 2),
        "encode_batch_bytes": ENCODE_BATCH_BYTES, "cpus": os.cpu_count(), "versions": _versions(),
    })
    # Whole documents of very different lengths: the token shares can differ a lot from the document fractions.
    shares = ", ".join(f"{name} {s['tokens'] / max(total, 1):.1%}" for name, s in manifest["splits"].items())
    log(f"token shares: {shares} (split fractions {'/'.join(f'{f:g}' for f in fractions)} apply to documents)")
    log(f"encoded {text_bytes / 1e6:,.1f} MB of text in {encode_s:.1f} s: {speed:,.1f} MB/s")
    log(f"prepared {out}: {total:,} tokens in {clock.total():.1f} s, tokenizer {tok.kind} "
        f"vocab {tok.vocab_size} sha256 {tok.sha256[:16]}")
    return info(out)


def _already_prepared(out: Path, request: dict, force: bool, log: Callable[[str], None]) -> bool:
    """True when `out` holds this very request (nothing to do); refuses a different one unless `force`."""
    if not (out / MANIFEST).exists():
        return False
    old = load_manifest(out).get("request", {})
    if old == request and not force:
        log(f"{out} is already prepared from {request['source']} ({request['tokenizer']}, vocab "
            f"{request['vocab_size']}); nothing to do (pass --force to prepare it again)")
        return True
    if not force:
        diff = {k: (old.get(k), v) for k, v in request.items() if old.get(k) != v}
        raise PrepareError(f"{out} already holds data prepared differently "
                           f"({', '.join(f'{k}: {a!r} -> {b!r}' for k, (a, b) in diff.items())}); "
                           "pass --force to replace it, or choose another --out")
    return False


def _train_bpe(src: Source, census: _Census, fractions: Sequence[float], vocab_size: int, progress: bool,
               log: Callable[[str], None]) -> tokenizers.Tokenizer:
    """A byte-level BPE trained on the census's sample of TRAIN, read from the source once more."""
    sample = census.sample.record()
    log(f"training a byte-level BPE of {vocab_size} ids on {sample['documents']:,} of the "
        f"{sample['train_documents']:,} TRAIN documents of {src.spec} ({sample['bytes'] / 1e6:.1f} of "
        f"{sample['train_bytes'] / 1e6:.1f} MB)")
    wanted = census.sample.ids()
    texts = (doc.text for doc, split, _ in _scan(src.documents(), fractions, {})
             if split == "train" and (wanted is None or doc.id in wanted))
    tok = tokenizers.train_bpe(texts, vocab_size, progress=progress)
    if tok.vocab_size < vocab_size:
        log(f"warning: the TRAIN text supports only {tok.vocab_size} ids, fewer than the {vocab_size} asked; "
            f"the tokenizer has vocab_size {tok.vocab_size}")
    return tok


class _Clock:
    """Seconds per phase of a preparation (for prepare.json, never the manifest)."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round(now - self.last, 3)
        self.last = now

    def total(self) -> float:
        return time.perf_counter() - self.start


def _versions() -> dict[str, str | None]:
    """Versions of what shapes the bytes (a different tokenizers library could train another BPE)."""
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("tokenizers", "tiktoken", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _write_run_record(out: Path, record: dict) -> None:
    tmp = out / (RUN_RECORD + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, out / RUN_RECORD)


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
