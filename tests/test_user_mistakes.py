"""The fault table's second part (docs/faults.md, "A user's mistakes"): settings that cannot work, folders that
cannot be made, a stop by the user, and the advice a refusal gives. Each ends in one line and exit 2 (130 for a
stop), with nothing lost; each suggested command that can run here is run."""

from __future__ import annotations

import errno
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from creditlab import cli, config
from creditlab.credit.registry import SOURCES, source_class
from creditlab.train import Trainer
from tiny_corpus import VOCAB, prepare_corpus, private_copy, write_corpus

TINY = ["--preset", "tiny", "--no-progress", "--set", "train.device=cpu", "--set", "train.eval_tokens=0",
        "--set", "train.warmup=0", "--set", "model.vocab_size=97"]


def refused(capsys, argv: list[str], fragment: str, code: int = 2) -> str:
    """Run the command line; it must end with `code` and one stderr line holding `fragment`, no traceback."""
    assert cli.main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert err and fragment in err[-1], err
    assert not any("Traceback" in line for line in err)
    return err[-1]


def train(*sets: str, out: Path) -> list[str]:
    argv = ["train", *TINY, "--set", f"train.out_dir={out}"]
    for s in sets:
        argv += ["--set", s]
    return argv


def suggested(line: str) -> list[list[str]]:
    """The commands a message suggests, each `...` span that starts with `creditlab`, split as a shell would."""
    return [shlex.split(c) for c in re.findall(r"`(creditlab [^`]*)`", line)]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("with space") / "my data"  # paths with spaces: suggestions must quote them
    return prepare_corpus(root.parent / "my corpus", root)


def test_a_seed_out_of_range_is_refused(tmp_path, capsys):
    refused(capsys, train("train.seed=99999999999999999999", out=tmp_path), "train.seed must lie in [0, 2**63)")
    refused(capsys, train("train.seed=-1", out=tmp_path), "train.seed must lie in [0, 2**63)")
    assert not (tmp_path / "runs").exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("source", ["learned", "typed", "dni"])
def test_a_rank_beyond_the_width_is_refused(tmp_path, capsys, source):
    line = refused(capsys, train(f"credit.source={source}", "credit.rank=100000", out=tmp_path), "credit.rank")
    assert "model.width" in line and "lower credit.rank" in line


def test_a_window_longer_than_a_split_is_one_line(tmp_path, prepared, capsys):
    data = private_copy(prepared, tmp_path)
    line = refused(capsys, train("data.source=shards", f"data.dir={data}", f"model.vocab_size={VOCAB}",
                                 "model.seq_len=100000", out=tmp_path / "runs"), "too few for one window")
    assert "lower model.seq_len to at most" in line
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())  # no record left


@pytest.mark.parametrize("where", ["long", "proc"])
def test_an_output_folder_that_cannot_be_made_is_the_users_to_fix(tmp_path, capsys, where):
    if where == "proc" and not Path("/proc/self").exists():
        pytest.skip("no /proc here")
    out = tmp_path / ("a" * 300) if where == "long" else Path("/proc/creditlab-runs")
    line = refused(capsys, train(out=out), "cannot create")
    assert "(train.out_dir)" in line
    assert ("too long" in line) if where == "long" else ("no such file or directory" in line)
    line = refused(capsys, ["compare", "--preset", "tiny", "--arms", "native", "--out", str(out / "cmp")],
                   "too long" if where == "long" else "no such file or directory")
    assert "--out" in line


def test_a_model_too_large_for_memory_is_refused_before_it_is_built(tmp_path, capsys, monkeypatch):
    from creditlab import runtime as rt
    from creditlab import train as train_mod
    from creditlab.model import GPT

    built = []

    def counted(*a, **kw):  # a model built anywhere but on the meta device (which allocates nothing)
        model = GPT(*a, **kw)
        built.extend(p.device for p in model.parameters() if p.device.type != "meta")
        return model

    monkeypatch.setattr(train_mod, "GPT", counted)
    line = refused(capsys, train("model.width=65536", out=tmp_path / "runs"), "this model does not fit")
    assert "(an estimate)" in line and "GiB free" in line and "lower model.width" in line
    assert not built, "the model was built before the refusal"
    # the estimate counts the very parameters the model has (the reference builds it)
    cfg = config.load("tiny", ["train.device=cpu"])
    params, _ = train_mod.memory_estimate(cfg, rt.resolve(cfg.train))
    assert params == sum(p.numel() for p in GPT(cfg.model).parameters())


def test_ctrl_c_during_train_says_what_it_kept_and_the_resume_it_names_finishes(tmp_path, capsys, monkeypatch):
    original = Trainer.train_update

    def interrupted(self, *a, **kw):
        if self.update_index == 3:
            raise KeyboardInterrupt
        return original(self, *a, **kw)

    monkeypatch.setattr(Trainer, "train_update", interrupted)
    line = refused(capsys, train("train.updates=5", "train.checkpoint_every=2", out=tmp_path / "runs"),
                   "train stopped: kept", code=130)
    assert "with its checkpoint at update 2" in line
    monkeypatch.setattr(Trainer, "train_update", original)
    (command,) = [shlex.split(c) for c in re.findall(r"go on with: (creditlab .*)$", line)]
    assert command[:3] == ["creditlab", "train", "--resume"]
    assert cli.main([*command[1:], "--no-progress"]) == 0
    rows = [json.loads(r) for r in (Path(command[3]) / "rows.jsonl").read_text().splitlines()]
    assert rows[-1]["update"] == 4 and {r["update"] for r in rows} == set(range(5))


def test_ctrl_c_during_data_prepare_leaves_the_folder_as_it_was(tmp_path, capsys, monkeypatch):
    prep = sys.modules["creditlab.data.prepare"]  # the module (the package exports its function by that name)

    write_corpus(tmp_path / "corpus", n=160)
    argv = ["data", "prepare", "--source", f"dir:{tmp_path / 'corpus'}", "--out", str(tmp_path / "data"),
            "--vocab-size", "280", "--no-progress"]
    original = prep._encode

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(prep, "_encode", interrupted)
    refused(capsys, argv, "data prepare stopped", code=130)
    assert not (tmp_path / "data" / "manifest.json").exists()
    monkeypatch.setattr(prep, "_encode", original)
    assert cli.main(argv) == 0  # the same command again, as the line says
    assert (tmp_path / "data" / "manifest.json").exists() and not (tmp_path / "data" / ".staging").exists()


def test_a_warmup_as_long_as_the_run_is_refused(tmp_path, capsys):
    line = refused(capsys, train("train.updates=10", "train.warmup=10", out=tmp_path),
                   "train.warmup (10) must be less than train.updates (10)")
    assert "lower train.warmup" in line  # the fix, named
    assert not any(tmp_path.iterdir())  # refused before any record was made


@pytest.mark.parametrize("source", [name for name in SOURCES
                                    if source_class(name).fits_with(config.load("tiny", [f"credit.source={name}"]))])
def test_a_fitted_source_that_would_never_fit_is_refused(tmp_path, capsys, source):
    line = refused(capsys, train(f"credit.source={source}", "credit.teacher_every=0", out=tmp_path),
                   "never fits")
    assert "credit.schedule=never" in line  # the way to ask for it unfitted on purpose, which is accepted
    config.load("tiny", [f"credit.source={source}", "credit.teacher_every=0", "credit.schedule=never"])


def test_an_arm_may_not_override_its_own_source(tmp_path, capsys):
    refused(capsys, ["compare", "--preset", "tiny", "--arms", "native,zero@credit.source=learned", "--out",
                     str(tmp_path / "c")], "may not change its credit source")
    assert not (tmp_path / "c").exists()


def test_split_fractions_must_sum_to_one_or_to_a_hundred(tmp_path, capsys):
    write_corpus(tmp_path / "corpus", n=10)
    refused(capsys, ["data", "prepare", "--source", f"dir:{tmp_path / 'corpus'}", "--out", str(tmp_path / "d"),
                     "--splits", "50/50/50"], "sums to 150")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("flag", [["--preset", "seed"], ["--set", "train.lr_muon=0.5"]])
def test_a_resume_refuses_preset_and_set_alike(tmp_path, capsys, flag):
    assert cli.main(train("train.updates=2", "train.checkpoint_every=1", out=tmp_path / "runs")) == 0
    (record,) = (tmp_path / "runs").iterdir()
    rows = (record / "rows.jsonl").read_bytes()
    refused(capsys, ["train", "--resume", str(record), *flag], f"drop {flag[0]}")
    assert (record / "rows.jsonl").read_bytes() == rows


def test_the_report_of_a_record_without_updates_says_so(tmp_path, capsys):
    assert cli.main(train("train.updates=2", out=tmp_path / "runs")) == 0
    (record,) = (tmp_path / "runs").iterdir()
    empty = tmp_path / "empty"
    empty.mkdir()
    for name in ("config.json", "env.json"):
        (empty / name).write_bytes((record / name).read_bytes())
    (empty / "rows.jsonl").write_text("")
    assert cli.main(["report", str(empty), "--out", str(tmp_path / "r")]) == 0
    assert "empty: it holds no update" in (tmp_path / "r" / "report.md").read_text()


def test_another_tokenizer_is_diagnosed_as_such_and_its_advice_overwrites_nothing(tmp_path, prepared, capsys):
    data = private_copy(prepared, tmp_path / "with space")
    tokenizer = json.loads((data / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["zzzz"] = VOCAB - 1  # another tokenizer in the folder than its manifest lists
    (data / "tokenizer.json").write_text(json.dumps(tokenizer))
    before = {p.name: p.read_bytes() for p in data.iterdir() if p.is_file() and p.name != "ledger.jsonl"}
    line = refused(capsys, train("data.source=shards", f"data.dir={data}", f"model.vocab_size={VOCAB}",
                                 out=tmp_path / "runs"), "is not the one its manifest.json lists")
    assert "vocab" not in line.split(":")[1]  # not called a vocabulary mismatch
    (command,) = suggested(line)
    assert "--force" not in command and command[command.index("--source") + 1] == f"dir:{prepared.parent / 'my corpus'}"
    assert cli.main([*command[1:], "--vocab-size", str(VOCAB), "--no-progress"]) == 0  # its own new folder
    assert {p.name: p.read_bytes() for p in data.iterdir() if p.name in before} == before


def test_a_vocabulary_mismatch_suggests_the_recorded_source_quoted_and_it_runs(tmp_path, prepared, capsys):
    data = private_copy(prepared, tmp_path / "with space")
    line = refused(capsys, train("data.source=shards", f"data.dir={data}", "model.vocab_size=280",
                                 out=tmp_path / "runs"), f"model.vocab_size is 280 but the data in {data}")
    assert f"--set model.vocab_size={VOCAB}" in line
    (command,) = suggested(line)
    assert command[command.index("--source") + 1] == f"dir:{prepared.parent / 'my corpus'}"  # not pack:prose
    assert "--force" not in command and not Path(command[command.index("--out") + 1]).exists()
    assert cli.main([*command[1:], "--no-progress"]) == 0
    new = re.search(r"--set data\.dir=('[^']*'|\S+)`", line).group(1)
    assert cli.main(train("data.source=shards", f"data.dir={shlex.split(new)[0]}", "model.vocab_size=280",
                          "train.updates=2", out=tmp_path / "runs")) == 0


def test_an_empty_data_dir_names_the_setting_not_an_empty_path(tmp_path, capsys):
    line = refused(capsys, train("data.source=shards", "data.dir=", out=tmp_path), "data.dir is empty")
    assert "  " not in line and "--set data.dir=data/prose" in line


def test_a_read_only_data_folder_is_trained_from_with_the_ledger_moved(tmp_path, prepared, capsys, monkeypatch):
    from creditlab.data import ledger

    data = private_copy(prepared, tmp_path)
    opened = os.open

    def read_only_data(path, *a, **kw):  # the data folder is read-only (as root, chmod would not stop a write)
        if Path(path).parent == data and len(a) and a[0] & os.O_WRONLY:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return opened(path, *a, **kw)

    monkeypatch.setattr(ledger.os, "open", read_only_data)
    argv = train("data.source=shards", f"data.dir={data}", f"model.vocab_size={VOCAB}", "train.updates=2",
                 "train.eval_tokens=256", out=tmp_path / "runs")
    line = refused(capsys, argv, "cannot write the access ledger")
    assert str(data) in line and "export CREDITLAB_LEDGER=" in line
    monkeypatch.setenv("CREDITLAB_LEDGER", str(tmp_path / "ledger.jsonl"))
    assert cli.main(argv) == 0
    reads = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert reads and {r["split"] for r in reads} == {"dev"} and not (data / "ledger.jsonl").exists()
    assert len(ledger.entries(data)) == len(reads)


def test_no_help_cites_a_document_that_is_not_in_the_repository():
    root = Path(__file__).resolve().parents[1]
    commands = sorted(cli.build_parser(None)._subparsers._group_actions[0].choices)  # noqa: SLF001
    for command in commands:
        parser = cli.build_parser(command)._subparsers._group_actions[0].choices[command]  # noqa: SLF001
        text = parser.format_help() + "".join(
            p.format_help() for a in parser._subparsers._group_actions for p in a.choices.values()  # noqa: SLF001
        ) if parser._subparsers else parser.format_help()  # noqa: SLF001
        for name in re.findall(r"\b([\w/.-]+\.md)\b", text):
            assert (root / name).exists(), f"creditlab {command} --help cites {name}"
        assert "DESIGN" not in text, f"creditlab {command} --help cites the design document"
    assert "ceiling" in commands and "data" in commands


def test_a_config_error_is_reported_before_training_imports():
    """Parsed and validated before torch is imported (which alone takes seconds on a loaded machine)."""
    code = ("import sys; from creditlab import cli; "
            "rc = cli.main(['train', '--preset', 'tiny', '--set', 'train.warmup=99']); "
            "print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["2", "False"], out.stderr
