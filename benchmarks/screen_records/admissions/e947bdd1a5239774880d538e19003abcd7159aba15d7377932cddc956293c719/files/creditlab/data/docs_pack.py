"""pack:docs: English prose from Debian bookworm `main` documentation packages, plus pack:prose's texts.

For each pinned package (docs_pins.py): the files its `include` pattern selects are converted to blocks
(textify.py), filtered to English prose (prose.py), and cached as extracted text (textcache.py), so a
second build, or a build on a machine without the .debs, reads only the cache. Then, over all artifacts in
the table's order: exact and near duplicates are dropped (dedup.py, the earlier copy kept), and each page is
cut into chunks of at most 16 KiB (chunks.py), which are the pack's documents. A chunk's id is
`<package>/<path under the package's doc root>#<k>`, so its first `/` component names its origin.

Built from the .debs (about 940 MB from 95 packages), extraction takes about ten minutes on two cores; with
the extracted-text cache (about 45 MB of .jsonl.xz) no .deb is read, and a whole `data prepare` (pack,
BPE training, encoding) took 3.3 minutes on the same machine.
"""

from __future__ import annotations

import gzip
import hashlib
import re
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable

from creditlab.data import textcache
from creditlab.data.artifacts import cache_dir, fetch
from creditlab.data.chunks import MAX_CHUNK_BYTES, chunk_id, chunk_text
from creditlab.data.debian import deb_files, fetch_deb
from creditlab.data.dedup import dedup, normalize
from creditlab.data.docs_pins import SOURCES, DocSource
from creditlab.data.documents import Document
from creditlab.data.packs import PROSE_PARTS, Pack, _decode
from creditlab.data.prose import Tally, page_text
from creditlab.data.textify import CONVERTERS

EXTRACTOR_VERSION = 3  # bump when a converter or filter changes: cached extractions are then rebuilt

# Sphinx and friends: sources, indexes and search pages repeat or list what the pages say.
_FURNITURE = re.compile(r"/(?:_sources|_static|_modules|_images|_downloads|_sphinx_design_static)/"
                        r"|(?:^|/)(?:genindex[^/]*|search|py-modindex|modindex|np-modindex|searchindex)\.html$")
_LANGS = ("ar|bg|ca|cs|da|de|el|eo|es|et|eu|fa|fi|fr|gl|he|hi|hr|hu|id|it|ja|ko|lt|lv|nb|nl|nn|pl|pt|ro|ru|"
          "sk|sl|sr|sv|th|tr|uk|vi|zh")
# Translations: a translations/locale folder, a language folder (de/, pt-br/, zh_CN/), a language infix
# (page.de.html) or a localized man page folder (man/de/man1).
_TRANSLATION = re.compile(rf"/(?:translations|locale|l10n)/|/(?:{_LANGS})(?:[-_][A-Za-z]{{2,4}})?/"
                          rf"|\.(?:{_LANGS})(?:[-_][A-Za-z]{{2,4}})?\.html$|/man/(?!man)[^/]+/man")
_MAN = re.compile(r"/man/man[0-9n]/[^/]+\.[0-9n]\w*$")
_INFO = re.compile(r"\.info(?:-\d+)?$")


def file_format(path: str) -> str | None:
    """The converter for a package file (after removing .gz), or None when it is not a document."""
    if path.endswith((".html", ".htm", ".xhtml", ".html.en")):
        return "html"
    if _MAN.search(path):
        return "roff"
    if _INFO.search(path):
        return "info"
    if path.endswith(".pod"):
        return "pod"
    if path.endswith((".txt", ".rst")):
        return "text"
    return None


def _doc_id(source: DocSource, path: str) -> str:
    rel = path
    for root in source.roots:
        if path.startswith(root):
            rel = path[len(root):]
            break
    return f"{source.origin}/{rel}"


def extract(source: DocSource, deb_path: Path) -> tuple[list[Document], dict]:
    """The prose pages of one package, sorted by id, and the figures of what was read and dropped."""
    include = re.compile(source.include)
    exclude = re.compile(source.exclude) if source.exclude else None
    tally = Tally()
    docs: list[Document] = []
    read_files = read_bytes = 0
    for path, data in deb_files(deb_path):
        if not include.search(path) or (exclude and exclude.search(path)) or _FURNITURE.search(path):
            continue
        if path.endswith(".gz"):
            data, path = gzip.decompress(data), path[:-3]
        kind = file_format(path)
        if kind is None:
            continue
        if _TRANSLATION.search(path):
            tally.drop_page("translation", len(data))
            continue
        read_files += 1
        read_bytes += len(data)
        text = page_text(CONVERTERS[kind](_decode(data)), tally)
        if text:
            docs.append(Document(_doc_id(source, path), text))
    docs.sort(key=lambda d: d.id)
    meta = {"artifact": source.deb.requirement, "sha256": source.deb.sha256, "extractor_version": EXTRACTOR_VERSION,
            "files_read": read_files, "bytes_read": read_bytes, "pages": len(docs),
            "page_bytes": sum(len(d.text.encode()) for d in docs), "dropped": tally.as_dict()}
    return docs, meta


def _extract_to_cache(job: tuple) -> str:
    """Worker: extract one artifact into its text-cache file (runs in a separate process)."""
    kind, item, artifact_path, out = job
    if kind == "deb":
        docs, meta = extract(item, Path(artifact_path))
    else:  # a pack:prose part: its own extractor, no filtering (the texts are prose already)
        artifact, extractor = item
        docs = extractor(Path(artifact_path))
        meta = {"artifact": artifact.requirement, "sha256": artifact.sha256, "extractor_version": EXTRACTOR_VERSION,
                "pages": len(docs), "page_bytes": sum(len(d.text.encode()) for d in docs)}
    textcache.write(Path(out), docs, meta)
    return out


def _parts() -> list[dict]:
    """Every artifact of the pack, in dedup order: pack:prose's first, then the Debian packages."""
    parts = [{"kind": "prose", "item": (a, extract_fn), "sha256": a.sha256, "requirement": a.requirement,
              "file": a.filename, "name": name, "licence": licence, "size": a.size, "rules": ""}
             for a, extract_fn, name, licence in PROSE_PARTS]
    parts += [{"kind": "deb", "item": s, "sha256": s.deb.sha256, "requirement": s.deb.requirement,
               "file": s.deb.filename, "name": s.name, "licence": s.deb.licence, "size": s.deb.size,
               "rules": repr((s.include, s.exclude, s.roots))}
              for s in SOURCES]
    return parts


def _progress(total: int, desc: str, unit: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", file=sys.stderr, disable=None)


def ensure_text(cache: Path, log: Callable[[str], None], workers: int = 2) -> list[dict]:
    """Make sure every artifact has its text-cache file (fetching and extracting only the missing ones)."""
    parts = _parts()
    for p in parts:
        p["text_path"] = textcache.cache_path(cache, p["sha256"], EXTRACTOR_VERSION, p["rules"])
    missing = [p for p in parts if not p["text_path"].exists()]
    if not missing:
        return parts
    log(f"pack:docs: {len(missing)} of {len(parts)} artifacts have no extracted-text cache; fetching and extracting")
    bar = _progress(sum(p.get("size", 0) for p in missing if p["kind"] == "deb"), "fetching .debs", "B")
    jobs = []
    for p in missing:
        if p["kind"] == "deb":
            path = fetch_deb(p["item"].deb, cache, log)
            bar.update(p["size"])
        else:
            path = fetch(p["item"][0], cache, log)
        jobs.append((p["kind"], p["item"], str(path), str(p["text_path"])))
    bar.close()
    bar = _progress(len(jobs), "extracting", "artifact")
    # Largest first, so two workers finish together; the results do not depend on the order.
    jobs.sort(key=lambda j: -Path(j[2]).stat().st_size)
    if workers <= 1:
        for job in jobs:
            _extract_to_cache(job)
            bar.update(1)
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            for _ in pool.map(_extract_to_cache, jobs):
                bar.update(1)
    bar.close()
    return parts


def build(cache: Path | None = None, log: Callable[[str], None] = print, workers: int = 2,
          max_chunk_bytes: int = MAX_CHUNK_BYTES) -> Pack:
    cache = cache if cache is not None else cache_dir()
    parts = ensure_text(cache, log, workers)
    pages: list[Document] = []
    owner: list[int] = []  # the part each page came from
    for i, p in enumerate(parts):
        docs, meta, text_sha = textcache.read(p["text_path"])
        p.update(meta=meta, text_sha256=text_sha)
        pages.extend(docs)
        owner.extend([i] * len(docs))
    log(f"pack:docs: {len(pages):,} pages, {sum(len(d.text.encode()) for d in pages) / 1e6:.1f} MB; deduplicating")
    result = dedup([d.text for d in pages])

    figures = [Counter() for _ in parts]
    documents: list[Document] = []
    seen_chunks: set[bytes] = set()
    for index, (page, i, keep) in enumerate(zip(pages, owner, result.keep)):
        n_bytes = len(page.text.encode())
        if not keep:
            how = "near_duplicate" if index in result.near_of else "exact_duplicate"
            figures[i][how] += 1
            figures[i][how + "_bytes"] += n_bytes
            continue
        figures[i]["pages"] += 1
        for k, text in enumerate(chunk_text(page.text, max_chunk_bytes)):
            digest = hashlib.sha256(normalize(text).encode()).digest()
            if digest in seen_chunks:  # the same section in two pages (a licence, a shared introduction)
                figures[i]["duplicate_chunk"] += 1
                figures[i]["duplicate_chunk_bytes"] += len(text.encode())
                continue
            seen_chunks.add(digest)
            # Chunks of overlapping editions (pack:prose's Milton) keep their group, so stay in one split.
            documents.append(Document(chunk_id(page.id, k), text, page.group))
            figures[i]["chunks"] += 1
            figures[i]["bytes"] += len(text.encode())
    prefixes: list[set[str]] = [set() for _ in parts]
    for page, i in zip(pages, owner):
        prefixes[i].add(page.id.split("/")[0])
    licences, artifacts = [], []
    for p, fig, origins in zip(parts, figures, prefixes):
        licences.append({"name": p["name"], "licence": p["licence"], "artifact": p["requirement"],
                         "documents": fig["chunks"], "id_prefixes": sorted(origins)})
        # Pinned sizes only: an artifact file that is absent (an offline machine with the text cache) or present
        # must give the same manifest.
        artifacts.append({"requirement": p["requirement"], "file": p["file"], "bytes": p["size"],
                          "sha256": p["sha256"], "text_file": p["text_path"].name,
                          "text_file_bytes": p["text_path"].stat().st_size, "text_sha256": p["text_sha256"],
                          "extracted": {k: v for k, v in p["meta"].items() if k not in ("artifact", "sha256")},
                          "kept": dict(sorted(fig.items()))})
    total = sum(len(d.text.encode()) for d in documents)
    log(f"pack:docs: {len(documents):,} chunks, {total / 1e6:.1f} MB after dropping {result.exact} exact "
        f"({result.exact_bytes / 1e6:.1f} MB) and {result.near} near duplicates ({result.near_bytes / 1e6:.1f} MB)")
    return Pack(documents, licences, artifacts)
