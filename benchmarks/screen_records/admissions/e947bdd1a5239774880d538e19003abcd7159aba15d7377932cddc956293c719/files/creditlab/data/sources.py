"""Source specs -> documents. A spec is `scheme:argument`:

    pack:NAME                 a built-in pack (pack:prose, the default; pack:docs, Debian documentation prose)
    dir:PATH[::GLOBS]         local files, one document per file; GLOBS is a comma-separated list of globs
                              relative to PATH, default `**/*.txt` (code is opt-in: `dir:src::**/*.py`);
                              hidden folders (.git, .venv) are skipped; the id is the relative path
    jsonl:PATH                a .jsonl(.gz) file, or a folder of them; one document per line
    parquet:PATH              a .parquet file, or a folder of them (needs pyarrow); one document per row
    hf:NAME[::SPLIT]          a `datasets` dataset (a hub name or a folder from save_to_disk), split `train`

For jsonl/parquet/hf the text is in field `text_field` (default `text`); the id is the record's `id` field
when it has one, else its file and line/row. `documents()` may be called more than once (prepare reads a
source twice: once to train the tokenizer, once to encode), and yields the same documents each time.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

from creditlab.data.documents import Document
from creditlab.data import docs_pack, packs

# pack:prose (packs.py), and pack:docs: Debian documentation prose with pack:prose's texts (docs_pack.py)
PACKS = {"prose": packs.prose, "docs": docs_pack.build}

SCHEMES = ("pack", "dir", "jsonl", "parquet", "hf")
DEFAULT_SOURCE = "pack:prose"
DEFAULT_DIR_GLOB = "**/*.txt"
_UNSPECIFIED = "unspecified: the user supplied these files and is responsible for their licence"


class SourceError(ValueError):
    pass


@dataclass
class Source:
    spec: str
    documents: Callable[[], Iterable[Document]]
    licences: list[dict]
    artifacts: list[dict] = field(default_factory=list)
    count: int | None = None  # number of documents when known up front (for progress bars)


def open_source(spec: str, text_field: str = "text", cache: Path | None = None,
                log: Callable[[str], None] = print) -> Source:
    scheme, sep, arg = spec.partition(":")
    if not sep or scheme not in SCHEMES or not arg:
        raise SourceError(f"unknown source {spec!r}; valid forms: pack:NAME (packs: {', '.join(PACKS)}), "
                          "dir:PATH[::GLOBS], jsonl:PATH, parquet:PATH, hf:NAME[::SPLIT]")
    if scheme == "pack":
        if arg not in PACKS:
            raise SourceError(f"unknown pack {arg!r}; valid packs: {', '.join(PACKS)}")
        pack = PACKS[arg](cache=cache, log=log)
        docs = pack.documents
        return Source(spec, lambda: iter(docs), pack.licences, pack.artifacts, len(docs))
    if scheme == "dir":
        path, _, globs = arg.partition("::")
        return _dir_source(spec, Path(path), [g for g in (globs or DEFAULT_DIR_GLOB).split(",") if g], log)
    if scheme == "jsonl":
        files = _files(Path(arg), (".jsonl", ".jsonl.gz"), spec)
        return Source(spec, lambda: _jsonl_documents(files, Path(arg), text_field), _user_licence(spec))
    if scheme == "parquet":
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise SourceError("parquet sources need pyarrow: pip install pyarrow") from None
        files = _files(Path(arg), (".parquet",), spec)
        return Source(spec, lambda: _parquet_documents(files, Path(arg), text_field), _user_licence(spec))
    return _hf_source(spec, arg, text_field)


def _user_licence(spec: str) -> list[dict]:
    return [{"name": spec, "licence": _UNSPECIFIED}]


def _files(path: Path, suffixes: tuple[str, ...], spec: str) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise SourceError(f"{spec}: {path} does not exist")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(suffixes))
    if not files:
        raise SourceError(f"{spec}: no {'/'.join(suffixes)} files under {path}")
    return files


def _dir_source(spec: str, root: Path, globs: list[str], log: Callable[[str], None]) -> Source:
    if not root.is_dir():
        raise SourceError(f"{spec}: {root} is not a folder")
    files = sorted({p for g in globs for p in root.glob(g)
                    if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)})
    if not files:
        raise SourceError(f"{spec}: no files match {','.join(globs)} under {root}")

    reported = False  # prepare reads a source more than once: say what was skipped the first time only

    def documents() -> Iterator[Document]:
        nonlocal reported
        skipped = []
        for p in files:
            rel = p.relative_to(root).as_posix()
            try:
                text = p.read_bytes().decode("utf-8")
            except UnicodeDecodeError:
                skipped.append(rel)  # binary or non-UTF-8 files are not text documents
                continue
            yield Document(rel, text)
        if skipped and not reported:
            reported = True
            plural = "s" if len(skipped) != 1 else ""
            log(f"{spec}: skipped {len(skipped)} file{plural} that are not UTF-8 text: {_first(skipped)}")

    return Source(spec, documents, _user_licence(spec), count=len(files))


def _first(names: list[str], shown: int = 5) -> str:
    """'a, b, c' or 'a, b, c, d, e and 7 more'."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _record_id(record: dict, fallback: str) -> str:
    rid = record.get("id")
    return str(rid) if rid is not None and not isinstance(rid, (dict, list)) else fallback


def _text_of(record: dict, text_field: str, where: str) -> str:
    if text_field not in record:
        raise SourceError(f"{where}: no field {text_field!r} (fields: {', '.join(map(str, record))}); "
                          "choose the text field with --text-field")
    text = record[text_field]
    if not isinstance(text, str):
        raise SourceError(f"{where}: field {text_field!r} is {type(text).__name__}, not text")
    return text


def _jsonl_documents(files: list[Path], root: Path, text_field: str) -> Iterator[Document]:
    for f in files:
        name = f.name if root.is_file() else f.relative_to(root).as_posix()
        opener = gzip.open if f.name.endswith(".gz") else open
        with opener(f, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                where = f"{f}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SourceError(f"{where}: not valid JSON ({e.msg})") from None
                if not isinstance(record, dict):
                    raise SourceError(f"{where}: expected a JSON object per line")
                yield Document(_record_id(record, f"{name}:{lineno}"), _text_of(record, text_field, where))


def _parquet_documents(files: list[Path], root: Path, text_field: str) -> Iterator[Document]:
    import pyarrow.parquet as pq

    for f in files:
        name = f.name if root.is_file() else f.relative_to(root).as_posix()
        pf = pq.ParquetFile(f)
        columns = pf.schema_arrow.names
        if text_field not in columns:
            raise SourceError(f"{f}: no column {text_field!r} (columns: {', '.join(columns)}); "
                              "choose the text field with --text-field")
        wanted = [text_field] + (["id"] if "id" in columns else [])
        row = 0
        for batch in pf.iter_batches(columns=wanted):
            for record in batch.to_pylist():
                yield Document(_record_id(record, f"{name}:{row}"), _text_of(record, text_field, f"{f}: row {row}"))
                row += 1


def _hf_source(spec: str, arg: str, text_field: str) -> Source:
    try:
        import datasets
    except ImportError:
        raise SourceError("hf: sources need the `datasets` package: pip install datasets") from None
    name, _, split = arg.partition("::")
    split = split or "train"
    if Path(name).is_dir():
        ds = datasets.load_from_disk(name)
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise SourceError(f"{spec}: no split {split!r}; splits: {', '.join(ds)}")
            ds = ds[split]
    else:
        ds = datasets.load_dataset(name, split=split)
    if text_field not in ds.column_names:
        raise SourceError(f"{spec}: no column {text_field!r} (columns: {', '.join(ds.column_names)}); "
                          "choose the text field with --text-field")

    def documents() -> Iterator[Document]:
        for i, record in enumerate(ds):
            yield Document(_record_id(record, f"{name}/{split}/{i}"), _text_of(record, text_field, f"{spec}: row {i}"))

    licence = (getattr(ds.info, "license", "") or _UNSPECIFIED)
    return Source(spec, documents, [{"name": spec, "licence": licence}], count=len(ds))
