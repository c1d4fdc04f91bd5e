"""Exact and near-duplicate removal over documents in a fixed order: the earlier copy is kept.

Exact: SHA256 of the text lowercased with its whitespace collapsed. Near: MinHash over word 5-shingles with
LSH banding, confirmed by the exact Jaccard similarity of the two shingle sets (>= 0.8 drops the later
document). Every hash is computed from the text alone (blake2b of each word, then fixed integer arithmetic
in numpy), so the same documents in the same order always give the same result; Python's `hash()` is
salted per process and is never used.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

SHINGLE = 5
PERMUTATIONS = 64
BANDS = 16  # 16 bands of 4 rows: a pair at Jaccard 0.8 shares a band with probability 0.9998
THRESHOLD = 0.8
_PRIME = np.uint64((1 << 31) - 1)  # a * x + b stays below 2^63 for 31-bit a, b, x: no overflow
_WORD = re.compile(r"\w+")


def _permutations() -> tuple[np.ndarray, np.ndarray]:
    # Fixed coefficients derived from their index, not from a random generator whose stream could change.
    raw = [int.from_bytes(hashlib.blake2b(f"minhash-{i}".encode(), digest_size=8).digest(), "big")
           for i in range(2 * PERMUTATIONS)]
    coeffs = np.array([r % (int(_PRIME) - 1) + 1 for r in raw], dtype=np.uint64)
    return coeffs[:PERMUTATIONS], coeffs[PERMUTATIONS:]


_A, _B = _permutations()


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


class _WordHashes:
    """blake2b of each distinct word, computed once (the memo's order never matters)."""

    def __init__(self) -> None:
        self.memo: dict[str, int] = {}

    def __call__(self, words: list[str]) -> np.ndarray:
        memo = self.memo
        out = np.empty(len(words), dtype=np.uint64)
        for i, w in enumerate(words):
            h = memo.get(w)
            if h is None:
                h = memo[w] = int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "big")
            out[i] = h
        return out


def shingles(text: str, word_hashes: _WordHashes) -> np.ndarray:
    """The distinct word 5-shingles of `text` as sorted 31-bit integers."""
    words = _WORD.findall(text.lower())
    if len(words) < SHINGLE:
        return np.zeros(0, dtype=np.uint64)
    h = word_hashes(words)
    n = len(words) - SHINGLE + 1
    acc = np.zeros(n, dtype=np.uint64)
    with np.errstate(over="ignore"):  # arithmetic mod 2^64 is the point
        for j in range(SHINGLE):
            acc = acc * np.uint64(1_000_003) + h[j:j + n]
    return np.unique((acc ^ (acc >> np.uint64(29))) & _PRIME)


def signature(sh: np.ndarray) -> np.ndarray:
    sig = np.full(PERMUTATIONS, _PRIME, dtype=np.uint64)
    for start in range(0, sh.size, 1 << 14):  # bounded memory for very long documents
        part = sh[start:start + (1 << 14)]
        sig = np.minimum(sig, ((_A[:, None] * part[None, :] + _B[:, None]) % _PRIME).min(axis=1))
    return sig


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    inter = np.intersect1d(a, b, assume_unique=True).size
    return inter / max(a.size + b.size - inter, 1)


@dataclass
class DedupResult:
    keep: list[bool]
    exact: int = 0
    exact_bytes: int = 0
    near: int = 0
    near_bytes: int = 0
    near_of: dict[int, int] = field(default_factory=dict)  # dropped index -> the kept index it copies


def dedup(texts: Sequence[str]) -> DedupResult:
    """Which of `texts` to keep: the first of each exact or near-duplicate family, in the given order."""
    result = DedupResult(keep=[True] * len(texts))
    seen: set[bytes] = set()
    buckets: dict[bytes, list[int]] = {}
    kept_shingles: dict[int, np.ndarray] = {}
    word_hashes = _WordHashes()
    rows = PERMUTATIONS // BANDS
    for i, text in enumerate(texts):
        n_bytes = len(text.encode("utf-8"))
        digest = hashlib.sha256(normalize(text).encode("utf-8")).digest()
        if digest in seen:
            result.keep[i] = False
            result.exact += 1
            result.exact_bytes += n_bytes
            continue
        seen.add(digest)
        sh = shingles(text, word_hashes)
        if sh.size == 0:
            continue
        sig = signature(sh)
        sh = sh.astype(np.uint32)  # 31-bit values: half the memory for the sets kept for comparison
        keys = [bytes([band]) + sig[band * rows:(band + 1) * rows].tobytes() for band in range(BANDS)]
        candidates = sorted({j for k in keys for j in buckets.get(k, ())})
        match = next((j for j in candidates if jaccard(sh, kept_shingles[j]) >= THRESHOLD), None)
        if match is not None:
            result.keep[i] = False
            result.near += 1
            result.near_bytes += n_bytes
            result.near_of[i] = match
            continue
        kept_shingles[i] = sh
        for k in keys:
            buckets.setdefault(k, []).append(i)
    return result
