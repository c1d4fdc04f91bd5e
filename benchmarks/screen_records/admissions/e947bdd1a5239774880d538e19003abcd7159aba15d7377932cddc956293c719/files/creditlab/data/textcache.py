"""The extracted documents of one artifact, cached as `<cache>/text/<sha256[:16]>-v<version>[-<rules>].jsonl.xz`.

Extraction is the slow part of a pack (parsing a gigabyte of HTML); its result depends only on the artifact's
bytes and the extractor's version, so both name the file. The files are small enough to carry to a machine
without the artifacts or network access, where the pack is built from them alone. The first line holds the
extraction's figures; each further line one document. `text_sha256` hashes the document lines, so it names
the text that went into a pack whatever xz settings wrote the file.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
from pathlib import Path

from creditlab.data.documents import Document


def cache_path(cache: Path, artifact_sha256: str, version: int, rules: str = "") -> Path:
    """`rules` names what selects the artifact's files (a hash of them), so a changed selection is re-extracted."""
    tag = f"-{hashlib.sha256(rules.encode()).hexdigest()[:8]}" if rules else ""
    return cache / "text" / f"{artifact_sha256[:16]}-v{version}{tag}.jsonl.xz"


def _line(doc: Document) -> bytes:
    record = {"id": doc.id, "text": doc.text}
    if doc.group is not None:
        record["group"] = doc.group
    return (json.dumps(record, ensure_ascii=False, sort_keys=True) + "\n").encode("utf-8")


def write(path: Path, docs: list[Document], meta: dict) -> str:
    """Write `docs` with `meta` atomically (a crash leaves no file under the final name); their text SHA256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with lzma.open(tmp, "wb", preset=9) as fh:
        fh.write((json.dumps(meta, sort_keys=True) + "\n").encode("utf-8"))
        for doc in docs:
            line = _line(doc)
            digest.update(line)
            fh.write(line)
    os.replace(tmp, path)
    return digest.hexdigest()


def read(path: Path) -> tuple[list[Document], dict, str]:
    """(documents, meta, text SHA256) of a cached extraction."""
    digest = hashlib.sha256()
    docs = []
    with lzma.open(path, "rb") as fh:
        meta = json.loads(fh.readline())
        for line in fh:
            digest.update(line)
            r = json.loads(line)
            docs.append(Document(r["id"], r["text"], r.get("group")))
    return docs, meta, digest.hexdigest()
