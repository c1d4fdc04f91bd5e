"""Prepared folders end to end on a small synthetic corpus: prepare/info, splits, ledger, loader, make_loader, CLI."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import numpy as np
import pytest
import torch

from creditlab import config as config_mod
from creditlab.data import (LedgerError, NotPreparedError, PrepareError, ShardLoader, SyntheticLoader,
                            VocabMismatchError, info, load_manifest, make_loader, prepare, read_split, verify)
from creditlab.data import cli as data_cli
from creditlab.data.ledger import LEDGER, entries, split_tokens
from creditlab.data.splits import SPLITS, split_of
from creditlab.data.tokenizer import load as load_tokenizer
from tiny_corpus import VOCAB, private_copy, quiet_prepare, write_corpus

SEQ = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("corpus")
    return root, write_corpus(root)


@pytest.fixture(scope="module")
def prepared_once(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "data"
    quiet_prepare(f"dir:{corpus[0]}", out)
    return out


@pytest.fixture
def prepared(prepared_once, tmp_path) -> Path:
    return private_copy(prepared_once, tmp_path)


def stream(data_dir: Path, split: str) -> np.ndarray:
    return np.concatenate([s.astype(np.int64) for s in split_tokens(data_dir, split)])


# --- prepare, splits, info ------------------------------------------------------------------------------

def test_splits_are_disjoint_deterministic_and_hold_exactly_their_documents(prepared, corpus) -> None:
    _, texts = corpus
    m = load_manifest(prepared)
    docs = [json.loads(line) for line in (prepared / "documents.jsonl").read_text().splitlines()]
    by_split = {s: [d["id"] for d in docs if d["split"] == s] for s in SPLITS}
    assert sum(map(len, by_split.values())) == len(texts) == len({d["id"] for d in docs})
    assert all(len(by_split[s]) > 0 for s in SPLITS)
    for s in SPLITS:
        assert all(split_of(i) == s for i in by_split[s])
        assert m["splits"][s]["documents"] == len(by_split[s])
        # The split's stream is exactly its documents, each preceded by the separator, in source order.
        tok = load_tokenizer(prepared, m["tokenizer"])
        decoded = tok.decode(stream(prepared, s).tolist())
        assert decoded == "".join("<|endoftext|>" + texts[i] for i in by_split[s])
        assert m["splits"][s]["tokens"] == sum(d["tokens"] for d in docs if d["split"] == s)
        assert m["splits"][s]["bytes"] == sum(len(texts[i].encode()) for i in by_split[s])
    assert len(m["splits"]["train"]["files"]) > 1
    assert verify(prepared) == []


def test_prepare_is_reproducible_byte_for_byte(prepared_once, corpus, tmp_path) -> None:
    again = tmp_path / "again"
    quiet_prepare(f"dir:{corpus[0]}", again)
    a, b = load_manifest(prepared_once), load_manifest(again)
    assert a["tokenizer"]["sha256"] == b["tokenizer"]["sha256"]
    assert a["splits"] == b["splits"] and a["documents_sha256"] == b["documents_sha256"]


def test_tokenizer_is_trained_on_train_documents_only(tmp_path) -> None:
    # A word that occurs only in held-out documents must not become a BPE token.
    root = tmp_path / "src"
    texts = write_corpus(root, n=160)
    heldout = [i for i in texts if split_of(i) != "train"]
    marker = "qqqxxzzqqq"
    for i in heldout:
        (root / i).write_text((marker + " ") * 200 + texts[i])
    quiet_prepare(f"dir:{root}", tmp_path / "out")
    vocab = json.loads((tmp_path / "out" / "tokenizer.json").read_text())["model"]["vocab"]
    assert not any("qqq" in token or "xxzz" in token for token in vocab)
    quiet_prepare(f"dir:{root}", tmp_path / "out2", fractions=(1.0, 0.0, 0.0))  # control: now it is TRAIN text
    vocab2 = json.loads((tmp_path / "out2" / "tokenizer.json").read_text())["model"]["vocab"]
    assert any("qqq" in token for token in vocab2)


def test_duplicate_and_empty_documents_are_dropped(tmp_path) -> None:
    root = tmp_path / "src"
    write_corpus(root, n=80)  # the fewest of these files that give every split a document
    (root / "copy.txt").write_text((root / "doc005.txt").read_text())
    (root / "empty.txt").write_text("  \n")
    quiet_prepare(f"dir:{root}", tmp_path / "out")
    m = load_manifest(tmp_path / "out")
    assert m["dropped_documents"] == {"empty": 1, "duplicate": 1}
    assert sum(s["documents"] for s in m["splits"].values()) == 80


def test_info_json_shape(prepared) -> None:
    summary = info(prepared)
    assert set(summary) >= {"splits", "tokenizer", "source", "licences"}
    assert set(summary["splits"]) == {"train", "dev", "final_heldout"}
    for s in summary["splits"].values():
        assert set(s) == {"tokens", "documents", "files"}
        assert isinstance(s["tokens"], int) and isinstance(s["documents"], int) and s["tokens"] > 0
        assert all(isinstance(f, str) and (prepared / f).exists() for f in s["files"])
    assert summary["tokenizer"]["kind"] == "bpe" and summary["tokenizer"]["vocab_size"] == VOCAB
    assert len(summary["tokenizer"]["sha256"]) == 64
    assert summary["source"].startswith("dir:") and isinstance(summary["licences"], list)


def test_cli_info_json_and_table(prepared, capsys) -> None:
    assert data_cli.main(["data", "info", str(prepared), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed.pop("size_check") == {"ok": True, "problems": []}
    assert printed == info(prepared)
    assert data_cli.main(["data", "info", str(prepared)]) == 0
    table = capsys.readouterr().out
    for s in SPLITS:
        assert f"{info(prepared)['splits'][s]['tokens']:,}" in table and s in table


def test_cli_info_verify_catches_a_changed_shard(prepared, capsys) -> None:
    shard = prepared / info(prepared)["splits"]["dev"]["files"][0]
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 1
    shard.write_bytes(bytes(raw))
    assert data_cli.main(["data", "info", str(prepared), "--verify"]) == 1
    assert f"{shard}: SHA256" in capsys.readouterr().out


def test_cli_errors_are_clear(tmp_path, capsys) -> None:
    assert data_cli.main(["data", "prepare", "--source", "gopher:x", "--out", str(tmp_path / "o")]) == 2
    assert "valid forms: pack:NAME" in capsys.readouterr().err
    assert data_cli.main(["data", "info", str(tmp_path / "nothing")]) == 2
    assert "creditlab data prepare" in capsys.readouterr().err


def test_prepare_is_idempotent_and_refuses_a_different_request(prepared, corpus) -> None:
    before = (prepared / "manifest.json").read_bytes()
    quiet_prepare(f"dir:{corpus[0]}", prepared)  # same request: reported, not redone
    assert (prepared / "manifest.json").read_bytes() == before
    with pytest.raises(PrepareError, match=r"vocab_size: 300 -> 320.*--force"):
        quiet_prepare(f"dir:{corpus[0]}", prepared, vocab_size=320)
    read_split(prepared, "dev", purpose="before re-prepare")
    old_files = set(info(prepared)["splits"]["train"]["files"])
    quiet_prepare(f"dir:{corpus[0]}", prepared, vocab_size=320, shard_tokens=100_000, force=True)
    assert info(prepared)["tokenizer"]["vocab_size"] == 320
    assert not any((prepared / f).exists() for f in old_files - set(info(prepared)["splits"]["train"]["files"]))
    assert len(entries(prepared)) == 1  # the ledger is history: never removed
    assert verify(prepared) == []


# --- access ledger --------------------------------------------------------------------------------------

def test_dev_reads_are_written_to_the_ledger(prepared) -> None:
    shards = read_split(prepared, "dev", purpose="dev loss at update 100", admission="abc123")
    [e] = entries(prepared)
    assert e["split"] == "dev" and e["purpose"] == "dev loss at update 100" and e["admission"] == "abc123"
    assert e["tokens"] == sum(s.size for s in shards) == info(prepared)["splits"]["dev"]["tokens"]
    assert e["utc"].endswith("+00:00")
    read_split(prepared, "train", purpose="training")  # TRAIN needs no ledger
    assert len(entries(prepared)) == 1
    with pytest.raises(LedgerError, match="purpose"):
        read_split(prepared, "dev", purpose=" ")


def test_final_heldout_needs_the_flag_and_is_read_once_per_admission(prepared) -> None:
    with pytest.raises(LedgerError, match="allow_final_heldout"):
        read_split(prepared, "final_heldout", purpose="final eval", admission="adm1")
    assert entries(prepared) == []
    read_split(prepared, "final_heldout", purpose="final eval", admission="adm1", allow_final_heldout=True)
    with pytest.raises(LedgerError, match=r"already read under admission 'adm1'.*once per admission"):
        read_split(prepared, "final_heldout", purpose="again", admission="adm1", allow_final_heldout=True)
    read_split(prepared, "final_heldout", purpose="final eval", admission="adm2", allow_final_heldout=True)
    with pytest.raises(LedgerError, match="only under an admission"):
        read_split(prepared, "final_heldout", purpose="no admission", allow_final_heldout=True)
    assert [(e["admission"], e["purpose"]) for e in entries(prepared)] == [("adm1", "final eval"), ("adm2", "final eval")]


def test_final_heldout_ranks_of_one_evaluation_read_once_each(prepared) -> None:
    for rank in (0, 1):
        read_split(prepared, "final_heldout", "ddp eval", "adm", allow_final_heldout=True, rank=rank, world_size=2)
    with pytest.raises(LedgerError):
        read_split(prepared, "final_heldout", "ddp eval", "adm", allow_final_heldout=True, rank=0, world_size=2)
    with pytest.raises(LedgerError):  # another world size under the same admission is a second evaluation
        read_split(prepared, "final_heldout", "solo", "adm", allow_final_heldout=True, rank=1, world_size=4)


def _dev_reads(data_dir: str, n: int) -> None:
    for i in range(n):
        read_split(data_dir, "dev", purpose=f"concurrent read {i} " + "x" * 2000)


def test_concurrent_ledger_appends_stay_whole_lines(prepared) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_dev_reads, args=(str(prepared), 15)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    assert all(p.exitcode == 0 for p in procs)
    lines = (prepared / LEDGER).read_text().splitlines()
    assert len(lines) == 60 and all(json.loads(line)["split"] == "dev" for line in lines)


# --- loader ---------------------------------------------------------------------------------------------

def test_loader_batches_are_windows_of_the_split_stream(prepared) -> None:
    loader = ShardLoader(prepared, "train", micro_batch=4, seq_len=SEQ, seed=7)
    full = stream(prepared, "train")
    batch = loader.next()
    assert batch.shape == (4, SEQ + 1) and batch.dtype == torch.int64 and loader.position == 1
    assert int(batch.max()) < VOCAB
    # Every (T+1)-token slice of the stream, by content -> its start offset.
    where = {w.tobytes(): s for s, w in enumerate(np.lib.stride_tricks.sliding_window_view(full, SEQ + 1))}
    starts = []
    for _ in range(loader.steps_per_epoch - 1):
        for row in loader.next().numpy():
            assert row.tobytes() in where  # a contiguous slice of the stream, across shard boundaries too
            starts.append(where[row.tobytes()])
    assert len(set(starts)) == len(starts)  # a permutation within the epoch: no window served twice
    assert len({s % SEQ for s in starts}) == 1  # one cut per epoch: windows at stride T from one shift
    assert any(s // 4000 != (s + SEQ) // 4000 for s in starts)  # some windows straddle two shards


def test_loader_resumed_at_position_p_yields_the_uninterrupted_batches(prepared) -> None:
    a = ShardLoader(prepared, "train", micro_batch=3, seq_len=SEQ, seed=11)
    # Run past an epoch boundary so resumption also covers the next epoch's permutation.
    n = a.steps_per_epoch + 5
    uninterrupted = [a.next() for _ in range(n)]
    for p in (0, 1, a.steps_per_epoch - 1, a.steps_per_epoch + 2):
        b = ShardLoader(prepared, "train", micro_batch=3, seq_len=SEQ, seed=11, position=p)
        for k in range(p, n):
            assert torch.equal(b.next(), uninterrupted[k])
    c = ShardLoader(prepared, "train", micro_batch=3, seq_len=SEQ, seed=11)
    c.load_state_dict(a.state_dict() | {"position": 4})
    assert torch.equal(c.next(), uninterrupted[4])
    other = ShardLoader(prepared, "train", micro_batch=3, seq_len=SEQ, seed=12)
    assert not torch.equal(other.batch_at(0), uninterrupted[0])
    assert not torch.equal(uninterrupted[a.steps_per_epoch], uninterrupted[0])


def test_loader_state_of_a_different_stream_is_refused(prepared) -> None:
    a = ShardLoader(prepared, "train", micro_batch=3, seq_len=SEQ, seed=11)
    b = ShardLoader(prepared, "train", micro_batch=3, seq_len=SEQ + 1, seed=11)
    with pytest.raises(ValueError, match="seq_len: saved 16, now 17"):
        b.load_state_dict(a.state_dict())


def test_ddp_ranks_take_disjoint_parts_of_each_global_step(prepared) -> None:
    B, W = 2, 3
    ranks = [ShardLoader(prepared, "train", B, SEQ, seed=5, rank=r, world_size=W) for r in range(W)]
    single = ShardLoader(prepared, "train", B * W, SEQ, seed=5)
    for p in range(0, 2 * ranks[0].steps_per_epoch, 3):
        parts = [r.batch_at(p) for r in ranks]
        # Together the ranks take exactly the windows of one global batch, each rank its own slice.
        assert torch.equal(torch.cat(parts), single.batch_at(p))
        rows = {tuple(row.tolist()) for part in parts for row in part}
        assert len(rows) == B * W
    with pytest.raises(ValueError, match="rank 3"):
        ShardLoader(prepared, "train", B, SEQ, rank=3, world_size=3)


def test_loader_on_dev_goes_through_the_ledger(prepared) -> None:
    loader = ShardLoader(prepared, "dev", 2, SEQ, seed=1, purpose="dev loss", admission="adm")
    loader.next()
    [e] = entries(prepared)
    assert (e["split"], e["purpose"], e["admission"]) == ("dev", "dev loss", "adm")
    with pytest.raises(LedgerError):
        ShardLoader(prepared, "final_heldout", 2, SEQ, seed=1, purpose="peek")
    ShardLoader(prepared, "train", 2, SEQ, seed=1)
    assert len(entries(prepared)) == 1


def test_loader_on_a_split_too_small_is_a_clear_error(prepared) -> None:
    tokens = info(prepared)["splits"]["dev"]["tokens"]
    with pytest.raises(ValueError, match=rf"split 'dev' has {tokens:,} tokens, too few"):
        ShardLoader(prepared, "dev", 1, tokens, purpose="x")


# --- make_loader ----------------------------------------------------------------------------------------

def test_make_loader_synthetic_keeps_the_synthetic_stream() -> None:
    cfg = config_mod.load("tiny")
    loader = make_loader(cfg)
    assert isinstance(loader, SyntheticLoader)
    ref = SyntheticLoader(cfg.model.vocab_size, cfg.train.micro_batch, cfg.model.seq_len, cfg.train.seed)
    assert torch.equal(loader.next(), ref.next())
    dev = make_loader(cfg, "dev")
    assert not torch.equal(dev.batch_at(dev.position), ref.batch_at(0))


def test_make_loader_shards_checks_the_vocabulary(prepared) -> None:
    cfg = config_mod.load("tiny", ["data.source=shards", f"data.dir={prepared}", f"model.seq_len={SEQ}",
                                   "model.vocab_size=320"])
    with pytest.raises(VocabMismatchError) as err:
        make_loader(cfg)
    message = str(err.value)
    assert "model.vocab_size is 320" in message and "prepared with a bpe tokenizer of 300 ids" in message
    assert "--set model.vocab_size=300" in message
    assert f"--out {prepared}-v320 --vocab-size 320" in message and f"--set data.dir={prepared}-v320" in message
    cfg.model.vocab_size = 257  # the tiny preset's: too small for a byte-level BPE, so only one fix is offered
    with pytest.raises(VocabMismatchError, match=r"--set model\.vocab_size=300.*at least 258 ids"):
        make_loader(cfg)
    cfg.model.vocab_size = VOCAB
    loader = make_loader(cfg, "train", rank=1, world_size=2)
    assert isinstance(loader, ShardLoader) and loader.next().shape == (cfg.train.micro_batch, SEQ + 1)
    with pytest.raises(LedgerError, match="needs a purpose"):
        make_loader(cfg, "dev")
    make_loader(cfg, "dev", purpose="dev loss")
    assert [e["purpose"] for e in entries(prepared)] == ["dev loss"]


def test_make_loader_errors_name_the_fix(tmp_path) -> None:
    cfg = config_mod.load("tiny", ["data.source=shards", f"data.dir={tmp_path / 'missing'}"])
    with pytest.raises(NotPreparedError, match="creditlab data prepare"):
        make_loader(cfg)
    cfg.data.source = "fineweb"
    with pytest.raises(ValueError, match="valid: synthetic, shards"):
        make_loader(cfg)
