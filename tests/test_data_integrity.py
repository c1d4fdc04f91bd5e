"""Prepared data, deterministic and verified end to end: identical bytes from two preparations, the tokenizer's
fixed sample, encoding speed, shard hashes checked on every read, vocabulary and size checks, composition."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from creditlab.data import load_manifest
from creditlab.data.prepare import MANIFEST, RUN_RECORD, manifest_sha256
from tiny_corpus import quiet_prepare, write_corpus


def file_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    write_corpus(root, n=100)
    return root


# --- deterministic preparation --------------------------------------------------------------------------

def test_two_preparations_are_byte_identical_manifest_included(corpus, tmp_path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    quiet_prepare(f"dir:{corpus}", a)
    time.sleep(1.01 - time.time() % 1)  # the second one starts in another second: a timestamp would differ
    quiet_prepare(f"dir:{corpus}", b)
    assert manifest_sha256(a) == manifest_sha256(b)
    hashed = {name: data for name, data in file_bytes(a).items() if name != RUN_RECORD}
    assert hashed == {name: data for name, data in file_bytes(b).items() if name != RUN_RECORD}
    assert {MANIFEST, "tokenizer.json", "documents.jsonl"} <= set(hashed)
    assert any(name.startswith("train_") for name in hashed)
    # Times, speed and paths are kept, beside the manifest and outside it.
    run_a, run_b = (json.loads((d / RUN_RECORD).read_text()) for d in (a, b))
    assert run_a["created_utc"] != run_b["created_utc"] and run_a["out"] == str(a.resolve())
    assert run_a["manifest_sha256"] == manifest_sha256(a) and run_a["encode_mb_per_s"] > 0
    assert RUN_RECORD not in (a / MANIFEST).read_text() and str(a) not in (a / MANIFEST).read_text()
