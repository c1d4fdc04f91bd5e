"""Long works cut at paragraph boundaries into chunks of bounded size, before the split.

Splits are decided per document, so a 700 KB reference page would otherwise land whole in one split and
could be a large share of DEV on its own. 16 KiB (about 4,000 tokens, two 2,048-token contexts) keeps a
chunk long enough to hold whole sections and cross-paragraph context, and short enough that a split of 5%
gathers thousands of chunks from hundreds of works.
"""

from __future__ import annotations

import re

MAX_CHUNK_BYTES = 16 * 1024
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _pieces(paragraph: str, limit: int) -> list[str]:
    """A paragraph longer than `limit` bytes, cut between sentences (or, failing that, between words)."""
    out: list[str] = []
    current = ""
    for unit in _SENTENCE_END.split(paragraph):
        for word_run in ([unit] if len(unit.encode()) <= limit else unit.split(" ")):
            joined = f"{current} {word_run}" if current else word_run
            if len(joined.encode()) <= limit or not current:
                current = joined
            else:
                out.append(current)
                current = word_run
    if current:
        out.append(current)
    return out


def chunk_text(text: str, limit: int = MAX_CHUNK_BYTES) -> list[str]:
    """`text` (paragraphs separated by blank lines) as consecutive chunks of at most `limit` UTF-8 bytes.

    Only a single word longer than `limit` can exceed it; documentation has none.
    """
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for para in text.split("\n\n"):
        n = len(para.encode())
        parts = [para] if n <= limit else _pieces(para, limit)
        for part in parts:
            n = len(part.encode())
            if current and size + 2 + n > limit:
                chunks.append("\n\n".join(current))
                current, size = [], 0
            size += n + (2 if current else 0)
            current.append(part)
    if current:
        chunks.append("\n\n".join(current))
    return chunks


def chunk_id(doc_id: str, index: int) -> str:
    return f"{doc_id}#{index}"
