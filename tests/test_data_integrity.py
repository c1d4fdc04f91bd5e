"""Prepared data, deterministic and verified end to end: identical bytes from two preparations, the tokenizer's
fixed sample, encoding speed, shard hashes checked on every read, vocabulary and size checks, composition."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from creditlab import cli, config as config_mod
from creditlab.data import (PrepareError, ShardError, ShardLoader, load_manifest, make_loader, read_shard,
                            read_split, write_shard)
from creditlab.data import cli as data_cli
from creditlab.data import integrity
from creditlab.data.ledger import entries
from creditlab.data.prepare import (MANIFEST, NO_ORIGIN, RUN_RECORD, _byte_batches, _Sample, manifest_sha256,
                                    origin_of)
from creditlab.data.splits import split_of
from creditlab.data.tokenizer import Tokenizer
from tiny_corpus import VOCAB, private_copy, quiet_prepare, write_corpus


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


def test_another_process_with_another_hash_seed_and_thread_count_prepares_the_same_bytes(corpus, tmp_path) -> None:
    # str hashes (set and dict layouts) change with PYTHONHASHSEED; the BPE trainer's pool with RAYON_NUM_THREADS.
    here = tmp_path / "here"
    quiet_prepare(f"dir:{corpus}", here)
    there = tmp_path / "there"
    script = ("import sys; sys.path.insert(0, 'tests'); from pathlib import Path; "
              f"from tiny_corpus import quiet_prepare; quiet_prepare({f'dir:{corpus}'!r}, Path({str(there)!r}))")
    env = {**os.environ, "PYTHONHASHSEED": "12345", "RAYON_NUM_THREADS": "3"}
    subprocess.run([sys.executable, "-c", script], env=env, cwd=Path(__file__).resolve().parents[1], check=True)
    assert manifest_sha256(there) == manifest_sha256(here)
    assert file_bytes(there).keys() == file_bytes(here).keys()
    assert all(file_bytes(there)[n] == data for n, data in file_bytes(here).items() if n != RUN_RECORD)


# --- the tokenizer's fixed sample -----------------------------------------------------------------------

def expected_sample(corpus: Path, budget: int) -> list[str]:
    """The rule, written out: TRAIN ids by sha256(id), up to the first whose bytes reach the budget."""
    train = sorted((hashlib.sha256(p.name.encode()).digest(), p.name, len(p.read_bytes()))
                   for p in corpus.glob("*.txt") if split_of(p.name) == "train")
    taken, total = [], 0
    for _, name, size in train:
        if total >= budget:
            break
        taken.append(name)
        total += size
    return taken


def test_tokenizer_trains_on_the_sample_and_every_document_is_encoded(tmp_path) -> None:
    root = tmp_path / "src"
    texts = write_corpus(root, n=100)
    sample = expected_sample(root, 20_000)
    assert 5 < len(sample) < 60  # a real sample: neither one document nor all of TRAIN
    marker = "qqqxxzzqqq"
    outside = [i for i in texts if split_of(i) == "train" and i not in sample]
    for i in outside:
        (root / i).write_text((marker + " ") * 50 + texts[i])
    out = tmp_path / "out"
    quiet_prepare(f"dir:{root}", out, tokenizer_sample_mb=0.02)
    m = load_manifest(out)
    assert m["request"]["tokenizer_sample_mb"] == 0.02
    record = m["tokenizer"]["sample"]
    assert record["budget_bytes"] == 20_000 and record["documents"] == len(sample)
    assert record["bytes"] == sum(len((root / i).read_bytes()) for i in sample)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    assert not any("qqq" in token for token in vocab)  # the marker is only outside the sample
    assert m["splits"]["train"]["documents"] == sum(split_of(i) == "train" for i in texts)  # all encoded
    whole = tmp_path / "whole"
    quiet_prepare(f"dir:{root}", whole, tokenizer_sample_mb=0)  # control: all of TRAIN sees the marker
    assert any("qqq" in token for token in json.loads((whole / "tokenizer.json").read_text())["model"]["vocab"])
    assert load_manifest(whole)["tokenizer"]["sample"]["documents"] == record["train_documents"]
    with pytest.raises(PrepareError, match=r"tokenizer_sample_mb: 0\.02 -> 0\.05"):
        quiet_prepare(f"dir:{root}", out, tokenizer_sample_mb=0.05)


def test_the_sample_is_the_same_whatever_the_order_of_the_documents() -> None:
    rng = random.Random(4)
    docs = [(f"d{i}", rng.randint(1, 100)) for i in range(300)]
    by_digest = sorted(docs, key=lambda d: hashlib.sha256(d[0].encode()).digest())
    for budget in (1, 500, 5_000, 10**9):
        prefix, total = set(), 0
        for doc_id, size in by_digest:
            if total >= budget:
                break
            prefix.add(doc_id)
            total += size
        for order in (docs, docs[::-1], rng.sample(docs, len(docs))):
            sample = _Sample(budget)
            for doc_id, size in order:
                sample.add(doc_id, size)
            assert sample.ids() == prefix and sample.record()["bytes"] == total


# --- encoding: large batches, speed reported -------------------------------------------------------------

def test_encoding_runs_in_few_large_batches_and_reports_its_speed(tmp_path, monkeypatch) -> None:
    root = tmp_path / "src"
    root.mkdir()
    for i in range(400):  # many short documents: a batch by count would be far too small for the threads
        (root / f"n{i:03d}.txt").write_text(f"Note {i}: the {i % 17} cats sat on {i % 5} mats. " * 3)
    calls = []
    original = Tokenizer.encode_batch

    def spy(self, texts):
        calls.append(len(texts))
        return original(self, texts)

    monkeypatch.setattr(Tokenizer, "encode_batch", spy)
    lines = []
    quiet_prepare(f"dir:{root}", tmp_path / "out", log=lines.append)
    assert calls == [400]  # ~60 KB of text: one batch, all of it in one multi-threaded call
    assert any(re.search(r"encoded [\d.]+ MB of text in [\d.]+ s: [\d,.]+ MB/s", line) for line in lines)
    assert [len(b) for b in _byte_batches([(None, "train", n) for n in (5, 5, 20, 1, 1, 1, 9)], 10)] == [2, 1, 4]


# --- empty corpora and splits, skipped files ------------------------------------------------------------

def test_an_empty_corpus_is_refused(tmp_path, capsys) -> None:
    root = tmp_path / "src"
    root.mkdir()
    (root / "a.txt").write_text("   \n")
    (root / "b.txt").write_text((root / "a.txt").read_text())
    with pytest.raises(PrepareError, match=r"has no documents with text \(2 empty and 0 duplicate"):
        quiet_prepare(f"dir:{root}", tmp_path / "out")
    assert not (tmp_path / "out" / MANIFEST).exists()
    assert data_cli.main(["data", "prepare", "--source", f"dir:{root}", "--out", str(tmp_path / "out"),
                          "--vocab-size", "300", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("creditlab: error: ") and "no documents with text" in err and err.count("\n") == 1


def test_a_split_with_a_share_but_no_document_is_refused(tmp_path) -> None:
    root = tmp_path / "src"
    write_corpus(root, n=40)  # 38 train, 2 dev, no final_heldout
    with pytest.raises(PrepareError, match=r"split final_heldout got none of the 40 documents.*--splits"):
        quiet_prepare(f"dir:{root}", tmp_path / "out")
    quiet_prepare(f"dir:{root}", tmp_path / "out", fractions=(0.9, 0.1, 0.0))  # asked for: allowed
    assert load_manifest(tmp_path / "out")["splits"]["final_heldout"]["documents"] == 0


def test_dir_source_names_the_files_it_skips_once(tmp_path) -> None:
    root = tmp_path / "src"
    write_corpus(root, n=100)
    for i in range(7):
        (root / f"bin{i}.txt").write_bytes(b"\xff\xfe\x00 not utf-8")
    lines = []
    quiet_prepare(f"dir:{root}", tmp_path / "out", log=lines.append)
    skipped = [line for line in lines if "not UTF-8" in line]
    assert skipped == [f"dir:{root}: skipped 7 files that are not UTF-8 text: bin0.txt, bin1.txt, bin2.txt, "
                       "bin3.txt, bin4.txt and 2 more"]


# --- shard hashes checked on every read, with a cache -----------------------------------------------------

@pytest.fixture(scope="module")
def prepared_once(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "data"
    quiet_prepare(f"dir:{corpus}", out)
    return out


@pytest.fixture
def prepared(prepared_once, tmp_path) -> Path:
    return private_copy(prepared_once, tmp_path)


def age(folder: Path, seconds: float = 3600) -> None:
    """Date every file back: the cache trusts only files not modified in the last few seconds."""
    then = time.time_ns() - int(seconds * 1e9)
    for p in folder.iterdir():
        os.utime(p, ns=(then, then))


def flip_last_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))


def count_hashes(monkeypatch) -> list[str]:
    hashed = []
    original = integrity.file_sha256

    def spy(path, *args, **kwargs):
        hashed.append(Path(path).name)
        return original(path, *args, **kwargs)

    monkeypatch.setattr(integrity, "file_sha256", spy)
    return hashed


def test_an_edited_shard_is_refused_on_read_naming_it(prepared) -> None:
    shard = prepared / load_manifest(prepared)["splits"]["train"]["files"][1]["name"]
    flip_last_byte(shard)  # same size, valid header: only its hash tells
    with pytest.raises(ShardError, match=rf"{re.escape(str(shard))} has SHA256 .*the manifest lists .*prepare it again into a new folder"):
        ShardLoader(prepared, "train", 2, 16)
    with pytest.raises(ShardError, match="train_000001.bin"):
        read_split(prepared, "train", purpose=None)
    dev = prepared / load_manifest(prepared)["splits"]["dev"]["files"][0]["name"]
    flip_last_byte(dev)
    with pytest.raises(ShardError, match="dev_000000.bin"):
        read_split(prepared, "dev", purpose="dev loss")
    assert entries(prepared) == []  # a refused read is not a read: the ledger does not record it
    shard.unlink()
    with pytest.raises(ShardError, match=rf"{re.escape(str(shard))} is missing"):
        read_split(prepared, "train", purpose=None)


def test_the_hash_cache_spares_a_second_run_and_misses_an_edit(prepared, monkeypatch) -> None:
    age(prepared)
    hashed = count_hashes(monkeypatch)
    train = [f["name"] for f in load_manifest(prepared)["splits"]["train"]["files"]]
    read_split(prepared, "train", purpose=None)
    assert sorted(hashed) == sorted(train) and (prepared / integrity.CACHE).exists()
    hashed.clear()
    ShardLoader(prepared, "train", 2, 16)  # a second run: nothing re-hashed
    assert hashed == []
    flip_last_byte(prepared / train[0])  # its mtime moves: hashed again, and refused
    with pytest.raises(ShardError, match=train[0]):
        read_split(prepared, "train", purpose=None)
    assert hashed == [train[0]]


def test_fresh_files_are_not_cached_so_an_edit_in_the_same_tick_is_seen(prepared, monkeypatch) -> None:
    hashed = count_hashes(monkeypatch)
    shard = prepared / load_manifest(prepared)["splits"]["dev"]["files"][0]["name"]
    now = time.time_ns()
    os.utime(shard, ns=(now, now))
    read_split(prepared, "dev", purpose="first")
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1
    shard.write_bytes(bytes(raw))
    os.utime(shard, ns=(now, now))  # an edit that kept size and mtime
    with pytest.raises(ShardError, match=shard.name):
        read_split(prepared, "dev", purpose="second")
    assert hashed.count(shard.name) == 2


def test_a_read_only_data_folder_reads_without_a_cache(prepared, monkeypatch) -> None:
    age(prepared)

    def refuse(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(integrity.os, "replace", refuse)
    hashed = count_hashes(monkeypatch)
    shards = len(load_manifest(prepared)["splits"]["train"]["files"])
    for _ in range(2):
        assert len(read_split(prepared, "train", purpose=None)) == shards
    assert len(hashed) == 2 * shards  # every read hashes
    assert not list(prepared.glob(".verified*"))  # and leaves nothing behind


def test_a_damaged_cache_is_ignored(prepared) -> None:
    age(prepared)
    (prepared / integrity.CACHE).write_text("{not json")
    read_split(prepared, "train", purpose=None)
    assert json.loads((prepared / integrity.CACHE).read_text())["format"] == integrity.CACHE_FORMAT


# --- token ids against the model's vocabulary ------------------------------------------------------------

def test_an_id_beyond_the_vocabulary_names_the_shard_and_its_offset(prepared) -> None:
    m = load_manifest(prepared)
    entry = m["splits"]["train"]["files"][1]
    shard = prepared / entry["name"]
    tokens = np.array(read_shard(shard), dtype=np.int64)
    tokens[1234] = 4000  # shards made for another vocabulary, with a manifest that agrees with them
    entry["sha256"] = write_shard(shard, tokens, vocab_size=65536)
    (prepared / MANIFEST).write_text(json.dumps(m, indent=2) + "\n")
    cfg = config_mod.load("tiny", ["data.source=shards", f"data.dir={prepared}", "model.seq_len=16",
                                   f"model.vocab_size={VOCAB}"])
    with pytest.raises(ShardError, match=rf"{re.escape(str(shard))}: token 1,234 \(byte 3,492\) is id 4000, "
                                         rf"outside the model's vocabulary of {VOCAB} ids"):
        make_loader(cfg, "train")
    make_loader(cfg, "dev", purpose="dev loss")  # the other splits are fine
    # The first shard whose ids reach a smaller vocabulary, at the first such id.
    first = prepared / m["splits"]["dev"]["files"][0]["name"]
    offset = int(np.argmax(np.asarray(read_shard(first)) >= 100))
    with pytest.raises(ShardError, match=rf"{re.escape(str(first))}: token {offset:,} "):
        ShardLoader(prepared, "dev", 2, 16, purpose="x", vocab_size=100)


# --- data info: sizes always, hashes with --verify -------------------------------------------------------

def test_info_checks_every_shard_size_without_verify(prepared, capsys) -> None:
    assert data_cli.main(["data", "info", str(prepared)]) == 0
    assert "sizes: every shard's size matches the manifest" in capsys.readouterr().out
    shard = prepared / load_manifest(prepared)["splits"]["train"]["files"][2]["name"]
    shard.write_bytes(shard.read_bytes()[:-2])  # one token short, header untouched
    assert data_cli.main(["data", "info", str(prepared)]) == 1
    out = capsys.readouterr().out
    assert f"{shard}: 9,022 bytes, but the manifest's 4,000 tokens make 9,024" in out and "sizes: FAILED" in out
    assert data_cli.main(["data", "info", str(prepared), "--json"]) == 1
    check = json.loads(capsys.readouterr().out)["size_check"]
    assert check["ok"] is False and len(check["problems"]) == 1
    assert data_cli.main(["data", "info", str(prepared), "--verify"]) == 1  # --verify sees it too
    assert f"{shard}: 9,022 bytes" in capsys.readouterr().out


def test_verify_rehashes_what_the_cache_would_trust(prepared, capsys) -> None:
    age(prepared)
    read_split(prepared, "train", purpose=None)  # caches every train shard
    shard = prepared / load_manifest(prepared)["splits"]["train"]["files"][0]["name"]
    stat = shard.stat()
    flip_last_byte(shard)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # an edit that forged the old mtime back
    read_split(prepared, "train", purpose=None)  # the cache's documented blind spot
    assert data_cli.main(["data", "info", str(prepared)]) == 0  # sizes are fine
    capsys.readouterr()
    assert data_cli.main(["data", "info", str(prepared), "--verify"]) == 1
    assert f"{shard}: SHA256" in capsys.readouterr().out


# --- composition by origin -------------------------------------------------------------------------------

def test_origin_is_the_first_component_of_the_id() -> None:
    assert origin_of("shakespeare/hamlet") == "shakespeare"
    assert origin_of("python3.11-doc/library/os.html#2") == "python3.11-doc"
    assert origin_of("doc001.txt") == NO_ORIGIN


def test_info_gives_tokens_and_documents_by_origin_per_split(tmp_path, capsys) -> None:
    root = tmp_path / "src"
    write_corpus(root / "alpha", n=60, seed=0)
    write_corpus(root / "python3.11-doc" / "library", n=40, seed=1)
    write_corpus(root, n=5, seed=2)  # top-level files: no origin
    out = tmp_path / "out"
    summary = quiet_prepare(f"dir:{root}", out)
    docs = [json.loads(line) for line in (out / "documents.jsonl").read_text().splitlines()]
    for split, origins in summary["composition"].items():
        assert sum(r["tokens"] for r in origins.values()) == summary["splits"][split]["tokens"]
        assert sum(r["documents"] for r in origins.values()) == summary["splits"][split]["documents"]
        assert sum(r["share"] for r in origins.values()) == pytest.approx(1, abs=1e-5)
        tokens = [r["tokens"] for r in origins.values()]
        assert tokens == sorted(tokens, reverse=True)
        for name, r in origins.items():
            mine = [d for d in docs if d["split"] == split and origin_of(d["id"]) == name]
            assert (r["tokens"], r["documents"], r["bytes"]) == (sum(d["tokens"] for d in mine), len(mine),
                                                                 sum(d["bytes"] for d in mine))
    assert set(summary["composition"]["train"]) == {"alpha", "python3.11-doc", NO_ORIGIN}
    assert data_cli.main(["data", "info", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["composition"] == summary["composition"]
    assert data_cli.main(["data", "info", str(out)]) == 0
    table = capsys.readouterr().out
    alpha = summary["composition"]["train"]["alpha"]
    assert re.search(rf"\n  alpha +{alpha['tokens']:,} +{alpha['share']:.1%} +{alpha['documents']:,}\n", table)


def test_the_table_sums_the_smallest_origins_in_one_row() -> None:
    origins = {f"o{i:02d}": {"tokens": 100 - i, "documents": 1, "bytes": 1, "share": (100 - i) / 5000}
               for i in range(20)}
    lines = data_cli.format_composition({"train": origins}, shown=5)
    assert len([line for line in lines if line.startswith("  ")]) == 5
    rest = sum(100 - i for i in range(4, 20))
    assert re.search(rf"\(16 more origins\) +{rest:,} +{rest / 5000:.1%} +16$", lines[-1])


def test_train_on_an_edited_shard_stops_with_one_line(prepared, tmp_path, capsys) -> None:
    shard = prepared / load_manifest(prepared)["splits"]["train"]["files"][0]["name"]
    flip_last_byte(shard)
    code = cli.main(["train", "--preset", "tiny", "--no-record", "--no-progress", "--set", "data.source=shards",
                     "--set", f"data.dir={prepared}", "--set", f"model.vocab_size={VOCAB}", "--set", "model.seq_len=16",
                     "--set", f"train.out_dir={tmp_path / 'runs'}"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("creditlab: error: shards differ from the manifest") and shard.name in last
