"""A small corpus of pseudo-words and its prepared folder, for tests that need real shards."""

from __future__ import annotations

import random
from pathlib import Path

from creditlab.data import prepare

VOCAB = 300


def write_corpus(root: Path, n: int = 160, seed: int = 0) -> dict[str, str]:
    """`n` text files of pseudo-words; returns {document id: text}."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "an", "el", "or", "us", "be", "zo"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(200)]
    root.mkdir(parents=True, exist_ok=True)
    texts = {}
    for i in range(n):
        sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))).capitalize() + "."
                     for _ in range(rng.randint(10, 30))]
        texts[f"doc{i:03d}.txt"] = " ".join(sentences) + "\n"
        (root / f"doc{i:03d}.txt").write_text(texts[f"doc{i:03d}.txt"])
    return texts


def quiet_prepare(source: str, out: Path, **kw) -> dict:
    kw.setdefault("vocab_size", VOCAB)
    kw.setdefault("shard_tokens", 4000)  # several shards per split: loaders must cross shard boundaries
    kw.setdefault("log", lambda _: None)
    return prepare(source, out, progress=False, **kw)


def prepare_corpus(corpus_dir: Path, out: Path) -> Path:
    write_corpus(corpus_dir)
    quiet_prepare(f"dir:{corpus_dir}", out)
    return out


def private_copy(prepared: Path, tmp_path: Path) -> Path:
    """A copy of a prepared folder for one test, so its ledger writes and edits never reach another test."""
    import shutil

    out = tmp_path / "data"
    shutil.copytree(prepared, out)
    return out
