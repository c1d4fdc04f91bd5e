"""The fault table (docs/faults.md), one test per row: what the user sees, the exit code, what is kept.

User errors end in one line on stderr and exit 2; a run's own failure (divergence) in one line and exit 1;
an internal error keeps its traceback."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from creditlab import cli
from creditlab.experiments.report import load_run
from creditlab.train import Trainer
from tiny_corpus import VOCAB, prepare_corpus

TINY = ["--preset", "tiny", "--no-progress", "--set", "train.eval_tokens=0", "--set", "train.warmup=0"]


def train(tmp_path, *sets, vocab=97, updates=5, out=None):
    argv = ["train", *TINY, "--set", f"model.vocab_size={vocab}", "--set", f"train.updates={updates}",
            "--set", f"train.out_dir={out or tmp_path / 'runs'}"]
    for s in sets:
        argv += ["--set", s]
    return cli.main(argv)


def the_record(runs: Path) -> Path:
    (record,) = [p for p in Path(runs).iterdir() if "-train-" in p.name]
    return record


def one_error_line(capsys, fragment: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "nothing on stderr"
    last = err[-1]
    assert last.startswith("creditlab: error: ") and fragment in last, last
    assert not any("Traceback" in line for line in err)
    return last


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prepared")
    return prepare_corpus(root / "corpus", root / "data")


def died_at(tmp_path, monkeypatch, update: int, *sets, updates=5, out=None):
    """A run that dies (an internal error) when it reaches update index `update`: its record as left."""
    original = Trainer.train_update

    def dying(self, *a, **kw):
        if self.update_index == update:
            raise RuntimeError("killed")
        return original(self, *a, **kw)

    monkeypatch.setattr(Trainer, "train_update", dying)
    with pytest.raises(RuntimeError, match="killed"):
        train(tmp_path, "train.checkpoint_every=2", *sets, updates=updates, out=out)
    monkeypatch.setattr(Trainer, "train_update", original)
    return the_record(out or tmp_path / "runs")


def cli_report(record: Path) -> str:
    """`creditlab report RUN`; the text of the report it wrote."""
    assert cli.main(["report", str(record)]) == 0
    return max(record.glob("report*.md"), key=lambda p: p.stat().st_mtime_ns).read_text()


def rows(record: Path) -> list[dict]:
    return [json.loads(line) for line in (record / "rows.jsonl").read_text().splitlines()]


# --- user errors: one line, exit 2 --------------------------------------------------------------------------

def test_unknown_data_source(tmp_path, capsys):
    assert train(tmp_path, "data.source=bogus") == 2
    one_error_line(capsys, "data.source must be synthetic|shards, got 'bogus'")
    assert not (tmp_path / "runs").exists()


def test_unknown_credit_source(tmp_path, capsys):
    assert train(tmp_path, "credit.source=bogus") == 2
    one_error_line(capsys, "unknown credit source 'bogus'")


def test_missing_data_folder(tmp_path, capsys):
    assert train(tmp_path, "data.source=shards", f"data.dir={tmp_path / 'nowhere'}") == 2
    one_error_line(capsys, "creditlab data prepare")
    assert not (tmp_path / "runs").exists()


def test_vocab_mismatch(tmp_path, prepared, capsys):
    assert train(tmp_path, "data.source=shards", f"data.dir={prepared}") == 2
    one_error_line(capsys, f"model.vocab_size is 97 but the data in {prepared}")


def test_truncated_shard(tmp_path, prepared, capsys):
    data = tmp_path / "data"
    shutil.copytree(prepared, data)
    shard = sorted(data.glob("train_*.bin"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    assert train(tmp_path, "data.source=shards", f"data.dir={data}", vocab=VOCAB) == 2
    one_error_line(capsys, shard.name)


def test_read_only_output_folder(tmp_path, monkeypatch, capsys):
    out = tmp_path / "readonly"
    real_mkdir = Path.mkdir

    def mkdir(self, *a, **kw):  # the refusal a read-only file system gives (chmod binds no root user)
        if str(self).startswith(str(out)):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *a, **kw)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    assert train(tmp_path, out=out) == 2
    one_error_line(capsys, "the file system is read-only")
    assert not out.exists()


def test_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    real_save, calls = torch.save, []

    def save(obj, path, *a, **kw):  # the second checkpoint meets a full disk half-way through its bytes
        calls.append(path)
        if len(calls) == 2:
            Path(path).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(obj, path, *a, **kw)

    monkeypatch.setattr(torch, "save", save)
    assert train(tmp_path, "train.checkpoint_every=2") == 2
    one_error_line(capsys, "the disk is full")
    record = the_record(tmp_path / "runs")
    assert not list(record.glob("*.tmp"))
    assert [p.name for p in record.glob("checkpoint_*.pt")] == ["checkpoint_000002.pt"]
    assert torch.load(record / "checkpoint_000002.pt", weights_only=True)["update"] == 2
    assert json.loads((record / "failure.json").read_text())["reason"] == "OSError"


@pytest.mark.parametrize("command", [["check"], ["compare", "--arms", "native", "--out", "x"]])
def test_bad_seeds(command, capsys):
    assert cli.main([*command, "--seeds", "a,b"]) == 2
    one_error_line(capsys, "--seeds 'a,b': give comma-separated integers")


def test_debug_shows_the_traceback(tmp_path):
    from creditlab.config import ConfigError

    with pytest.raises(ConfigError, match="data.source"):
        cli.main(["--debug", "train", *TINY, "--set", "data.source=bogus", "--no-record"])
    proc = subprocess.run([sys.executable, "-m", "creditlab.cli", "train", "--set", "data.source=bogus",
                           "--no-record"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("creditlab: error: invalid config")


# --- internal errors and failed runs ------------------------------------------------------------------------

def test_internal_error_before_the_first_update(tmp_path, monkeypatch):
    record = died_at(tmp_path, monkeypatch, 0)  # the error propagates: its traceback, exit 1 from the process
    failure = json.loads((record / "failure.json").read_text())
    assert failure["status"] == "failed" and failure["stage"] == "start" and failure["updates_done"] == 0
    assert "RuntimeError: killed" in failure["traceback"]
    run = load_run(record)
    assert run["rows"] == [] and "failed before its first update" in cli_report(record)


def test_internal_error_exit_status_of_the_process(tmp_path):
    code = ("import sys; from creditlab import cli; from creditlab.train import Trainer\n"
            "def boom(self, *a, **k): raise RuntimeError('boom')\n"
            "Trainer.train_update = boom\n"
            f"sys.exit(cli.main(['train', '--preset', 'tiny', '--set', 'train.eval_tokens=0', '--set', "
            f"'train.out_dir={tmp_path}']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "RuntimeError: boom" in proc.stderr


def diverge(monkeypatch, update: int, how: str) -> list[str]:
    """From update index `update` on, a NaN loss, or an infinite gradient in the first parameter; returns
    [that parameter's name] once it is known."""
    original, hit = Trainer.forward_backward, []

    def forward_backward(self, inputs, targets, credit, scale):
        loss = original(self, inputs, targets, credit, scale)
        if self.update_index == update:
            if how == "loss":
                return loss * math.nan
            name, param = next(iter(self.model.named_parameters()))
            param.grad.view(-1)[0] = math.inf
            hit[:] = [name]
        return loss

    monkeypatch.setattr(Trainer, "forward_backward", forward_backward)
    return hit


def test_non_finite_loss_stops_the_run(tmp_path, monkeypatch, capsys):
    diverge(monkeypatch, 2, "loss")
    assert train(tmp_path, "train.checkpoint_every=4") == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("creditlab: error: diverged: non-finite loss nan at update 3, micro-batch 1")
    record = the_record(tmp_path / "runs")
    failure = json.loads((record / "failure.json").read_text())
    assert failure["reason"] == "diverged" and failure["update_index"] == 2 and failure["micro_batch"] == 0
    assert [r["update"] for r in rows(record)] == [0, 1] and not (record / "result.json").exists()
    assert not list(record.glob("checkpoint_*.pt"))  # the update after it (the fourth) was never checkpointed
    assert "Status: **failed**" in cli_report(record)


def test_non_finite_gradient_names_the_parameter(tmp_path, monkeypatch, capsys):
    hit = diverge(monkeypatch, 1, "grad")
    assert train(tmp_path) == 1
    (name,) = hit
    failure = json.loads((the_record(tmp_path / "runs") / "failure.json").read_text())
    assert failure["first_nonfinite_grad"] == name and failure["micro_batch"] is None  # every loss was finite
    assert f"non-finite gradient of {name} at update 2;" in capsys.readouterr().err


def test_stalled_loss_warns(tmp_path, capsys):
    lrs = [f"train.{k}=0" for k in ("lr_muon", "lr_embed", "lr_head", "lr_scalar")]
    assert train(tmp_path, "train.stall_updates=3", *lrs) == 0
    assert "warning: loss 4.5747 has stayed near chance ln(V) = 4.575 for 3 updates" in capsys.readouterr().out
    record = the_record(tmp_path / "runs")
    (warning,) = [json.loads(x) for x in (record / "warnings.jsonl").read_text().splitlines()]
    assert warning["update"] == 2 and "near chance" in (record / "report.md").read_text()


# --- resume ---------------------------------------------------------------------------------------------------

def test_resume_refuses_another_config(tmp_path, monkeypatch, capsys):
    record = died_at(tmp_path, monkeypatch, 3)
    config = json.loads((record / "config.json").read_text())
    config["train"]["lr_muon"] = 0.5
    (record / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(record)]) == 2
    one_error_line(capsys, "train.lr_muon: 0.02 != 0.5")


def test_resume_from_another_working_directory(tmp_path, prepared, monkeypatch):
    work = tmp_path / "work"
    shutil.copytree(prepared, work / "data")
    monkeypatch.chdir(work)  # relative data.dir and train.out_dir, as a user types them
    record = died_at(tmp_path, monkeypatch, 3, "data.source=shards", "data.dir=data", f"model.vocab_size={VOCAB}",
                     out="runs")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert cli.main(["train", "--resume", str(work / "runs" / record.name)]) == 0
    assert [r["update"] for r in rows(work / "runs" / record.name)] == [0, 1, 2, 2, 3, 4]


def test_resume_repairs_a_half_written_row(tmp_path, monkeypatch, capsys):
    record = died_at(tmp_path, monkeypatch, 3)
    with open(record / "rows.jsonl", "a") as f:
        f.write('{"update": 3, "kind": "nat')
    assert cli.main(["train", "--resume", str(record)]) == 0
    assert "repaired rows.jsonl: removed a half-written last line (26 bytes)" in capsys.readouterr().err
    assert [r["update"] for r in rows(record)] == [0, 1, 2, 2, 3, 4]
    assert "half-written" in (record / "warnings.jsonl").read_text()


def test_resume_falls_back_to_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    record = died_at(tmp_path, monkeypatch, 5, updates=7)
    newest = record / "checkpoint_000004.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # the newest checkpoint, cut short
    assert cli.main(["train", "--resume", str(record)]) == 0
    assert "checkpoint_000004.pt cannot be read" in capsys.readouterr().err
    assert [r["update"] for r in rows(record)][5:] == [2, 3, 4, 5, 6]  # from update 2 again
    assert torch.load(newest, weights_only=True)["update"] == 4  # rewritten whole


def test_resume_refuses_a_damaged_row_before_its_first_update(tmp_path, monkeypatch, capsys):
    record = died_at(tmp_path, monkeypatch, 3)
    lines = (record / "rows.jsonl").read_text().splitlines(keepends=True)
    lines[1] = lines[1][:20] + "\n"  # a line in the middle cut short: no repair can tell what it said
    (record / "rows.jsonl").write_text("".join(lines))
    before = {p.name: p.read_bytes() for p in record.iterdir()}
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(record)]) == 2
    one_error_line(capsys, "rows.jsonl:2: not a JSON line")
    assert {p.name: p.read_bytes() for p in record.iterdir()} == before  # no update ran, no checkpoint pruned


def test_resume_refuses_a_damaged_config_and_no_record(tmp_path, monkeypatch, capsys):
    record = died_at(tmp_path, monkeypatch, 3)
    assert cli.main(["train", "--resume", str(record), "--no-record"]) == 2
    one_error_line(capsys, "drop --no-record")
    text = (record / "config.json").read_text()
    (record / "config.json").write_text(text[:len(text) // 2])
    assert cli.main(["train", "--resume", str(record)]) == 2
    one_error_line(capsys, "config.json is not readable JSON")


def test_a_second_process_is_refused_and_a_stale_lock_taken_over(tmp_path, monkeypatch, capsys):
    import socket

    record = died_at(tmp_path, monkeypatch, 3)
    (record / "lock").write_text(f"{socket.gethostname()} {os.getpid()}\n")  # a living process holds it
    capsys.readouterr()
    assert cli.main(["train", "--resume", str(record)]) == 2
    one_error_line(capsys, f"is in use by process {os.getpid()}")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (record / "lock").write_text(f"{socket.gethostname()} {dead.pid}\n")  # left by a process that died
    assert cli.main(["train", "--resume", str(record)]) == 0
    assert not (record / "lock").exists()


@pytest.mark.parametrize("keep, kept", [(2, [5, 6]), (0, [1, 2, 3, 4, 5, 6])])
def test_only_the_newest_checkpoints_are_kept(tmp_path, keep, kept):
    assert train(tmp_path, "train.checkpoint_every=1", f"train.keep_checkpoints={keep}", updates=6) == 0
    names = sorted(p.name for p in the_record(tmp_path / "runs").glob("checkpoint_*.pt"))
    assert names == [f"checkpoint_{u:06d}.pt" for u in kept]


def test_a_finished_run_drops_its_checkpoints_only_when_asked(tmp_path):
    assert train(tmp_path / "a", "train.checkpoint_every=2", "train.drop_finished_checkpoints=true", updates=4) == 0
    record = the_record(tmp_path / "a" / "runs")
    assert (record / "model.pt").exists() and (record / "result.json").exists()
    assert not list(record.glob("checkpoint_*.pt"))
    assert train(tmp_path / "b", "train.checkpoint_every=2", updates=4) == 0
    assert [p.name for p in sorted(the_record(tmp_path / "b" / "runs").glob("checkpoint_*.pt"))] == [
        "checkpoint_000002.pt", "checkpoint_000004.pt"]


# --- records ---------------------------------------------------------------------------------------------------

def test_records_are_strict_json_with_one_mode(tmp_path):
    old = os.umask(0o077)  # the mode must not depend on the umask
    try:
        assert train(tmp_path, "credit.source=learned", "credit.teacher_every=2", "train.checkpoint_every=2",
                     "train.eval_tokens=4096") == 0
    finally:
        os.umask(old)
    record = the_record(tmp_path / "runs")

    def refuse(constant):
        raise ValueError(f"bare {constant} in a record")

    for path in record.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path.name
        if path.suffix == ".json":
            json.loads(path.read_text(), parse_constant=refuse)
        elif path.suffix == ".jsonl":
            for line in path.read_text().splitlines():
                json.loads(line, parse_constant=refuse)
    assert rows(record)[0]["fit"]["fit_error"] is None  # 0/0 at the first teacher update, written as null
    from creditlab.protocol.records import dumps

    assert dumps({"a": [math.inf, {"b": -math.inf, "c": math.nan}]}) == '{"a": [null, {"b": null, "c": null}]}'


def test_report_of_a_run_that_has_one(tmp_path):
    assert train(tmp_path) == 0
    record = the_record(tmp_path / "runs")
    before = (record / "report.md").read_bytes()
    assert cli.main(["report", str(record)]) == 0
    assert (record / "report.md").read_bytes() == before and (record / "report-2.md").exists()
    assert (record / "report-2.png").exists()


def test_report_of_a_folder_that_is_no_record(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == 2
    one_error_line(capsys, f"{tmp_path} has no rows.jsonl: not a run record")


def test_every_row_of_the_fault_table_is_a_test():
    import re
    from pathlib import Path

    from tests import test_compare, test_credit, test_user_mistakes  # faults tested beside their behaviour

    page = (Path(__file__).resolve().parents[1] / "docs" / "faults.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| ") and not line.startswith("| case |")]
    named = [re.search(r"\| `(test_\w+)` \|$", row) for row in rows]
    assert rows and all(named), [row for row, name in zip(rows, named) if not name]  # every row names a test
    found = {**vars(test_compare), **vars(test_credit), **vars(test_user_mistakes), **globals()}
    missing = [m.group(1) for m in named if not callable(found.get(m.group(1)))]
    assert not missing, missing


def test_a_second_report_into_one_folder_is_written_beside_the_first(tmp_path, capsys):
    assert train(tmp_path) == 0
    record = the_record(tmp_path / "runs")
    out = tmp_path / "reports"
    assert cli.main(["report", str(record), "--out", str(out)]) == 0
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(first) == {"report.md", "report.png"}
    assert cli.main(["report", str(record), str(record), "--out", str(out)]) == 0
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name in first} == first  # nothing written over
    assert {p.name for p in out.iterdir()} == {"report.md", "report.png", "report-2.md", "report-2.png"}


def test_report_of_a_killed_run_leaves_out_its_half_written_row_and_names_a_damaged_file(tmp_path, monkeypatch,
                                                                                        capsys):
    record = died_at(tmp_path, monkeypatch, 3)
    with open(record / "rows.jsonl", "a") as f:
        f.write('{"update": 3, "kind": "nat')  # what a process killed while appending leaves
    assert "Status: **failed**" in cli_report(record)
    text = (record / "env.json").read_text()
    (record / "env.json").write_text(text[:10])
    capsys.readouterr()
    assert cli.main(["report", str(record)]) == 2
    one_error_line(capsys, "env.json is not readable JSON")


@pytest.mark.parametrize("argv", [["train", "--preset", "tiny", "--set", "train.out_dir=FILE/runs"],
                                  ["compare", "--arms", "native", "--out", "FILE/cmp"],
                                  ["data", "prepare", "--source", "pack:prose", "--out", "FILE/data"]])
def test_a_file_where_a_folder_must_be(tmp_path, argv, capsys):
    (tmp_path / "file").write_text("x")
    argv = [a.replace("FILE", str(tmp_path / "file")) for a in argv]
    assert cli.main(argv) == 2
    one_error_line(capsys, "not a folder")
    assert (tmp_path / "file").read_text() == "x"


def test_compare_refuses_what_it_would_ignore(tmp_path, capsys):
    for argv, fragment in ((["--merge", "a", "b", "--arms", "native"], "drop --arms"),
                           (["--merge", "a", "b", "--set", "train.updates=2"], "drop --set"),
                           (["--arms", "native", "--seeds", ""], "--seeds ''")):
        assert cli.main(["compare", *argv, "--out", str(tmp_path / "cmp")]) == 2
        one_error_line(capsys, fragment)
    assert not (tmp_path / "cmp").exists()


def test_command_line_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["check", "--seed", "abc"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invalid int value: 'abc'" in err[0] and "creditlab check --help" in err[0], err
    assert cli.main(["demo", "--updates", "0"]) == 2
    one_error_line(capsys, "--updates 0")


def test_ceiling_takes_the_newest_readable_checkpoint_and_refuses_what_is_not_one(tmp_path, monkeypatch, capsys):
    from creditlab.experiments import ceiling

    record = died_at(tmp_path, monkeypatch, 5, updates=7)
    newest = record / "checkpoint_000004.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    assert cli.main(["ceiling", "--run", str(record), "--batches", "2", "--sketch", "none", "--json",
                     "--out", str(tmp_path / "ceiling")]) == 0
    out = capsys.readouterr()
    assert "checkpoint_000004.pt cannot be read" in out.err
    assert json.loads(out.out.splitlines()[-1])["state"]["loaded"] == "checkpoint_000002.pt"
    assert cli.main(["ceiling", "--run", str(record / "config.json"), "--out", str(tmp_path / "c2")]) == 2
    one_error_line(capsys, "give a run folder or one of its checkpoint_*.pt files")
    (tmp_path / "file").write_text("x")
    monkeypatch.setattr(ceiling, "measure", lambda args: pytest.fail("measured before its --out was checked"))
    assert cli.main(["ceiling", "--updates", "0", "--out", str(tmp_path / "file")]) == 2
    one_error_line(capsys, "a file is in the way")


def test_damaged_manifests_and_a_heldout_read_of_no_tokens_are_refused(tmp_path, prepared, capsys):
    data = tmp_path / "data"
    shutil.copytree(prepared, data)
    text = (data / "manifest.json").read_text()
    (data / "manifest.json").write_text(text[:50])
    assert cli.main(["data", "info", str(data)]) == 2
    one_error_line(capsys, "manifest.json is not readable JSON")
    assert cli.main(["train", *TINY, "--no-record", "--set", "data.source=shards", "--set", f"data.dir={data}"]) == 2
    one_error_line(capsys, "prepare it again into a new folder")
    assert cli.main(["train", *TINY, "--no-record", "--set", "data.source=shards",
                     "--set", f"data.dir={data / 'manifest.json'}"]) == 2
    one_error_line(capsys, "is a file, not a prepared data folder")
    for tokens in ("0", "-5"):  # refused before the admission's one read is looked up, let alone spent
        assert cli.main(["heldout", str(tmp_path), "--admission", "none", "--tokens", tokens]) == 2
        one_error_line(capsys, f"--tokens {tokens}: give a positive count")
