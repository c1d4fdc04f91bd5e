"""Data building blocks: shard format, tokenizers, hash splits, sources and pinned artifacts (no downloads)."""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from creditlab.data import artifacts, tokenizer as tokenizers
from creditlab.data.documents import Document
from creditlab.data.shards import HEADER_BYTES, MAGIC, ShardError, read_header, read_shard, write_shard
from creditlab.data.sources import SourceError, open_source
from creditlab.data.splits import SPLITS, parse_fractions, split_of

TRAIN_TEXTS = [
    "The quick brown fox jumps over the lazy dog. " * 20,
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 10,
    "def f(x):\n    return x * 2  # twice\n\n\n" * 10,
    "Naïve café façade — Ünïcödé text, 中文字符, and numbers 12345 67890.\t\r\n" * 10,
]


@functools.lru_cache(maxsize=None)
def small_bpe() -> tokenizers.Tokenizer:
    return tokenizers.train_bpe(TRAIN_TEXTS, vocab_size=400, progress=False)


# --- tokenizer ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", TRAIN_TEXTS + [
    "", " ", "\n\n\n", "emoji never seen in training: 🎉🦀", "  leading and trailing spaces  ",
    "a literal <|endoftext|> inside a document", "\x00\x01 control bytes \x7f",
])
def test_bpe_round_trip(text: str) -> None:
    tok = small_bpe()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.separator not in ids  # text, even text spelling the separator, never yields the separator
    assert all(0 <= i < tok.separator for i in ids)


@settings(max_examples=150, deadline=None)
@given(st.text())
def test_bpe_round_trip_any_text(text: str) -> None:
    tok = small_bpe()
    assert tok.decode(tok.encode(text)) == text


def test_bpe_vocab_counts_separator_last_and_training_is_deterministic() -> None:
    a = small_bpe()
    b = tokenizers.train_bpe(TRAIN_TEXTS, vocab_size=400, progress=False)
    assert a.vocab_size == 400 and a.separator == 399
    assert a.sha256 == b.sha256
    assert a.decode(a.encode("x") + [a.separator] + a.encode("y")) == "x<|endoftext|>y"


_TRAIN_AND_PRINT_SHA = """
import sys
sys.path.insert(0, "tests")
from test_data import TRAIN_TEXTS
from creditlab.data.tokenizer import train_bpe
texts = [t.replace("fox", f"fox{i % 7}") for i in range(40) for t in TRAIN_TEXTS]
print(train_bpe(texts, vocab_size=600, progress=False).sha256)
"""


def test_bpe_training_is_the_same_on_one_thread_and_on_several() -> None:
    # The trainer counts pairs on a rayon thread pool, sized once per process: one process per pool size.
    digests = set()
    for threads in ("1", "4"):
        env = {**os.environ, "RAYON_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "true"}
        done = subprocess.run([sys.executable, "-c", _TRAIN_AND_PRINT_SHA], capture_output=True, text=True,
                              env=env, cwd=Path(__file__).resolve().parents[1], check=True)
        digests.add(done.stdout.strip())
    assert len(digests) == 1 and len(digests.pop()) == 64


def test_bpe_vocab_too_small_is_refused() -> None:
    with pytest.raises(tokenizers.TokenizerError, match="vocab_size >= 258"):
        tokenizers.train_bpe(TRAIN_TEXTS, vocab_size=200, progress=False)


def test_saved_tokenizer_loads_and_checks_its_hash(tmp_path) -> None:
    tok = small_bpe()
    record = tok.save(tmp_path)
    again = tokenizers.load(tmp_path, record)
    assert again.encode(TRAIN_TEXTS[1]) == tok.encode(TRAIN_TEXTS[1]) and again.sha256 == tok.sha256
    (tmp_path / record["file"]).write_text((tmp_path / record["file"]).read_text().replace('"fox"', '"f0x"', 1) + " ")
    with pytest.raises(tokenizers.TokenizerError, match="SHA256"):
        tokenizers.load(tmp_path, record)


def test_gpt2_style_tiktoken_file_parses_offline() -> None:
    # A miniature .tiktoken file: the 256 bytes, then merges " t", "he", " the".
    lines = [base64.b64encode(bytes([b])) + b" " + str(b).encode() for b in range(256)]
    for rank, token in enumerate([b" t", b"he", b" the"], start=256):
        lines.append(base64.b64encode(token) + b" " + str(rank).encode())
    tok = tokenizers._load_gpt2(b"\n".join(lines) + b"\n")
    assert tok.kind == "gpt2" and tok.vocab_size == 260 and tok.separator == 259
    ids = tok.encode("he said the <|endoftext|> end")
    assert 258 in ids and tok.separator not in ids
    assert tok.decode(ids) == "he said the <|endoftext|> end"


# --- shards ---------------------------------------------------------------------------------------------

def test_shard_round_trip(tmp_path) -> None:
    tokens = np.array([0, 1, 65535, 12288, 7], dtype=np.int64)
    digest = write_shard(tmp_path / "a.bin", tokens, vocab_size=65536)
    assert digest == hashlib.sha256((tmp_path / "a.bin").read_bytes()).hexdigest()
    header = np.fromfile(tmp_path / "a.bin", dtype="<i4", count=256)
    assert list(header[:3]) == [MAGIC, 1, 5] and not header[3:].any()
    assert (tmp_path / "a.bin").stat().st_size == HEADER_BYTES + 2 * 5
    assert read_shard(tmp_path / "a.bin").tolist() == tokens.tolist()


def test_bad_magic_is_a_clear_error_naming_the_file(tmp_path) -> None:
    path = tmp_path / "train_000000.bin"
    write_shard(path, np.arange(10), vocab_size=100)
    raw = bytearray(path.read_bytes())
    raw[0:4] = (12345).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match=r"train_000000\.bin: bad magic number 12345"):
        read_shard(path)


def test_truncated_shard_is_a_clear_error_naming_the_file(tmp_path) -> None:
    path = tmp_path / "dev_000003.bin"
    write_shard(path, np.arange(100), vocab_size=100)
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(ShardError, match=r"dev_000003\.bin: truncated: header says 100 tokens"):
        read_shard(path)
    path.write_bytes(b"\x00" * 100)
    with pytest.raises(ShardError, match=r"dev_000003\.bin: truncated: 100 bytes is shorter than the 1024-byte header"):
        read_header(path)


def test_trailing_bytes_and_wrong_version_are_errors(tmp_path) -> None:
    path = tmp_path / "x.bin"
    write_shard(path, np.arange(4), vocab_size=10)
    path.write_bytes(path.read_bytes() + b"\x00\x00")
    with pytest.raises(ShardError, match="trailing data"):
        read_shard(path)
    write_shard(path, np.arange(4), vocab_size=10)
    raw = bytearray(path.read_bytes())
    raw[4:8] = (2).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match="unsupported shard version 2"):
        read_shard(path)


def test_writer_refuses_vocab_beyond_uint16_and_out_of_range_ids(tmp_path) -> None:
    with pytest.raises(ShardError, match="uint16"):
        write_shard(tmp_path / "big.bin", np.arange(3), vocab_size=65537)
    with pytest.raises(ShardError, match=r"\[0, 50\)"):
        write_shard(tmp_path / "bad.bin", np.array([1, 50]), vocab_size=50)
    assert not (tmp_path / "bad.bin").exists()


# --- splits ---------------------------------------------------------------------------------------------

def test_split_of_is_a_fixed_function_of_the_key() -> None:
    # Pinned: a change to the split rule would silently move documents between TRAIN and held-out splits.
    assert [split_of(f"doc{i}") for i in range(4)] == ["final_heldout", "train", "train", "train"]
    assert split_of("milton/poems") == "train"
    keys = [f"key-{i}" for i in range(20_000)]
    counts = {s: sum(split_of(k) == s for k in keys) for s in SPLITS}
    assert abs(counts["train"] / 20_000 - 0.90) < 0.01
    assert abs(counts["dev"] / 20_000 - 0.05) < 0.006 and abs(counts["final_heldout"] / 20_000 - 0.05) < 0.006
    assert all(split_of(k, (0.5, 0.5, 0.0)) != "final_heldout" for k in keys[:2000])


def test_parse_fractions() -> None:
    assert parse_fractions("90/5/5") == pytest.approx((0.9, 0.05, 0.05))
    assert parse_fractions("0.8,0.1,0.1") == pytest.approx((0.8, 0.1, 0.1))
    with pytest.raises(ValueError):
        parse_fractions("90/10")
    with pytest.raises(ValueError):
        parse_fractions("a/b/c")
    with pytest.raises(ValueError, match="sums to 150: give percentages summing to 100"):
        parse_fractions("50/50/50")  # refused, not renormalized to a third each
    assert parse_fractions("1/0/0") == (1.0, 0.0, 0.0)  # fractions summing to 1


def test_document_group_is_the_split_key() -> None:
    assert Document("a", "x", group="g").split_key == "g"
    assert Document("a", "x").split_key == "a"


# --- sources --------------------------------------------------------------------------------------------

def test_unknown_source_scheme_lists_the_valid_ones() -> None:
    with pytest.raises(SourceError, match=r"pack:NAME.*dir:PATH.*jsonl:PATH.*parquet:PATH.*hf:NAME"):
        open_source("ftp:somewhere")
    with pytest.raises(SourceError, match="valid packs: prose"):
        open_source("pack:poetry")


def test_dir_source_one_document_per_file_with_globs(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("beta")
    (tmp_path / "sub" / "c.py").write_text("print('gamma')")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "d.txt").write_text("hidden")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00binary")
    docs = list(open_source(f"dir:{tmp_path}", log=lambda _: None).documents())
    assert [(d.id, d.text) for d in docs] == [("a.txt", "alpha"), ("sub/b.txt", "beta")]
    docs = list(open_source(f"dir:{tmp_path}::**/*.py,*.txt", log=lambda _: None).documents())
    assert [d.id for d in docs] == ["a.txt", "sub/c.py"]


def test_jsonl_source_ids_and_text_field(tmp_path) -> None:
    lines = [{"id": "x1", "body": "first"}, {"body": "second"}]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n\n")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"body": "third"}) + "\n")
    docs = list(open_source(f"jsonl:{tmp_path}", text_field="body").documents())
    assert [(d.id, d.text) for d in docs] == [("x1", "first"), ("a.jsonl:2", "second"), ("b.jsonl.gz:1", "third")]
    with pytest.raises(SourceError, match=r"a\.jsonl:1: no field 'text' \(fields: id, body\)"):
        list(open_source(f"jsonl:{tmp_path / 'a.jsonl'}").documents())


def test_parquet_source(tmp_path) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        with pytest.raises(SourceError, match="pip install pyarrow"):
            open_source(f"parquet:{tmp_path}")
        return
    pq.write_table(pa.table({"text": ["one", "two"], "id": ["a", "b"]}), tmp_path / "t.parquet")
    docs = list(open_source(f"parquet:{tmp_path}").documents())
    assert [(d.id, d.text) for d in docs] == [("a", "one"), ("b", "two")]


def test_hf_source_from_a_local_dataset(tmp_path) -> None:
    datasets = pytest.importorskip("datasets", reason="`datasets` is not installed; hf: sources are optional")
    datasets.Dataset.from_dict({"text": ["uno", "dos"]}).save_to_disk(str(tmp_path / "ds"))
    docs = list(open_source(f"hf:{tmp_path / 'ds'}").documents())
    assert [d.text for d in docs] == ["uno", "dos"] and docs[0].id.endswith("/train/0")


# --- pinned artifacts -----------------------------------------------------------------------------------

def test_cached_artifact_is_never_fetched_again(tmp_path, monkeypatch) -> None:
    (tmp_path / "pkg-1.0.tar.gz").write_bytes(b"payload")
    art = artifacts.Artifact("pkg==1.0", "pkg-1.0.tar.gz", hashlib.sha256(b"payload").hexdigest())

    def no_network(*args, **kwargs):
        raise AssertionError("pip was called for a cached artifact")

    monkeypatch.setattr(subprocess, "run", no_network)
    monkeypatch.setenv(artifacts.CACHE_ENV, str(tmp_path))
    assert artifacts.fetch(art, log=lambda _: None) == tmp_path / "pkg-1.0.tar.gz"


def test_artifact_with_a_wrong_hash_is_refused(tmp_path, monkeypatch) -> None:
    art = artifacts.Artifact("pkg==1.0", "pkg-1.0.tar.gz", "0" * 64)

    def fake_pip(cmd, **kwargs):  # "downloads" a file whose bytes are not the pinned ones
        dest = cmd[cmd.index("--dest") + 1]
        with open(f"{dest}/pkg-1.0.tar.gz", "wb") as f:
            f.write(b"tampered")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    with pytest.raises(artifacts.ArtifactError, match="differs from the pinned"):
        artifacts.fetch(art, cache=tmp_path, log=lambda _: None)
    assert not (tmp_path / "pkg-1.0.tar.gz").exists()


def test_failed_download_says_how_to_place_the_file_by_hand(tmp_path, monkeypatch) -> None:
    art = artifacts.Artifact("pkg==1.0", "pkg-1.0.tar.gz", "0" * 64)
    monkeypatch.setattr(subprocess, "run",
                        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "No matching distribution"))
    with pytest.raises(artifacts.ArtifactError, match=r"(?s)No matching distribution.*by hand"):
        artifacts.fetch(art, cache=tmp_path, log=lambda _: None)


def test_default_cache_dir_and_override(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(artifacts.CACHE_ENV, raising=False)
    assert artifacts.cache_dir().parts[-3:] == (".cache", "creditlab", "packs")
    monkeypatch.setenv(artifacts.CACHE_ENV, str(tmp_path))
    assert artifacts.cache_dir() == tmp_path


def test_random_corpus_round_trips_through_a_shard(tmp_path) -> None:
    tok = small_bpe()
    rng = random.Random(3)
    text = "".join(rng.choice("abc de\nfg") for _ in range(2000))
    write_shard(tmp_path / "t.bin", np.array(tok.encode(text)), tok.vocab_size)
    assert tok.decode(read_shard(tmp_path / "t.bin").tolist()) == text
