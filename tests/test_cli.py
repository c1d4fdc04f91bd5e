"""The command line: a tiny training run end to end, its record, and config errors as exit status 2."""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys

import pytest

from creditlab import cli, config

TRAIN = ["train", "--preset", "tiny", "--set", "train.updates=3", "--set", "train.warmup=0", "--set", "model.vocab_size=97",
         "--set", "train.device=cpu"]


def test_train_tiny_without_record(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--preset", "tiny", "--set", "train.updates=3", "--set", "train.warmup=0", "--set", "model.vocab_size=97",
                     "--no-record"]) == 0
    out = capsys.readouterr().out
    assert "done: loss" in out and "over 3 updates" in out
    assert list(tmp_path.iterdir()) == []  # --no-record: no runs/ folder


def test_train_json_result(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(TRAIN + ["--no-record", "--json", "--no-progress"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result["updates"] == 3
    assert result["first_loss"] == pytest.approx(math.log(97), rel=1e-5)  # zero head: ln V at the first update
    assert math.isfinite(result["final_loss"])
    assert result["median_last3_s"] > 0
    assert result["peak_allocated_mib"] is None  # CPU
    assert sum(line.startswith("update ") for line in out) >= 1  # --no-progress prints plain update lines


def test_train_writes_a_record(tmp_path, capsys):
    runs = tmp_path / "runs"
    assert cli.main(TRAIN + ["--set", f"train.out_dir={runs}", "--no-progress"]) == 0
    (record,) = list(runs.iterdir())
    assert {p.name for p in record.iterdir()} >= {"config.json", "env.json", "rows.jsonl", "result.json"}
    cfg = config.Config.from_dict(json.loads((record / "config.json").read_text()))
    assert cfg == config.load("tiny", ["train.updates=3", "train.warmup=0", "model.vocab_size=97", "train.device=cpu",
                                       f"train.out_dir={runs}"])
    rows = [json.loads(line) for line in (record / "rows.jsonl").read_text().splitlines() if line.strip()]
    assert [r["update"] for r in rows] == [0, 1, 2]
    result = json.loads((record / "result.json").read_text())
    assert result["updates"] == 3 and result["final_loss"] == rows[-1]["loss"]
    assert "torch" in json.loads((record / "env.json").read_text())
    assert f"record: {record}" in capsys.readouterr().err


def test_print_config_lists_every_section_and_value():
    buf = io.StringIO()
    cli.print_config(config.load("tiny", ["model.vocab_size=97"]), stream=buf)
    text = buf.getvalue()
    assert text.startswith("resolved config:")
    for section in ("[model]", "[data]", "[credit]", "[train]", "[screen]"):
        assert section in text
    assert "vocab_size=97" in text and "layers=4" in text


def test_print_config_follows_the_current_stderr():
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        cli.print_config(config.load("tiny"))
    assert "resolved config:" in buf.getvalue()


def test_unknown_set_key_exits_2_and_lists_valid_keys(capsys):
    assert cli.main(["train", "--preset", "tiny", "--set", "model.depth=3", "--no-record"]) == 2
    out, err = capsys.readouterr()
    assert "model.depth" in err
    for key in ("model.layers", "model.width", "model.heads", "model.mlp_hidden", "model.vocab_size"):
        assert key in err
    assert "done" not in out


def test_unknown_section_exits_2_and_lists_every_key(capsys):
    assert cli.main(["flops", "--set", "optim.lr=1"]) == 2
    err = capsys.readouterr().err
    for key in config.valid_keys():
        assert key in err


@pytest.mark.parametrize("argv, fragment", [
    (["train", "--set", "model.layers=abc", "--no-record"], "'abc' is not a valid int"),
    (["train", "--set", "model.width=66", "--set", "model.heads=4", "--no-record"], "divisible"),
    (["train", "--preset", "huge", "--no-record"], "unknown preset"),
    (["flops", "--set", "model.layers"], "section.key=value"),
    (["train", "--set", "credit.source=fdfb", "--no-record"], "unknown credit source 'fdfb'; valid: exact, "),
    (["train", "--set", "credit.schedule=sometimes", "--no-record"], "unknown schedule 'sometimes'; valid: fixed"),
    (["train", "--set", "credit.schedule=warmup:x", "--no-record"], "arguments must be integers"),
    (["train", "--set", "credit.source=zero", "--set", "credit.schedule=adaptive", "--no-record"], "fits nothing"),
])
def test_config_errors_exit_2_with_the_reason(argv, fragment, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("creditlab: ") and fragment in err


def test_argument_errors_exit_2():
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--bogus-flag"])
    assert exc.value.code == 2


def test_python_dash_m_creditlab_is_the_command_and_a_closed_pipe_is_no_traceback():
    """`python -m creditlab` runs the CLI; a reader that stops early (`| head -1`) ends it quietly."""
    proc = subprocess.Popen([sys.executable, "-m", "creditlab", "flops", "--preset", "seed"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
    first = proc.stdout.read(10)  # the first bytes, then the reader goes
    proc.stdout.close()
    stderr = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert first.startswith(b"nominal")
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr
    assert proc.returncode in (0, 1)


def test_unknown_key_exit_status_of_the_process():
    proc = subprocess.run([sys.executable, "-m", "creditlab.cli", "train", "--set", "train.nope=1", "--no-record"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "train.micro_batch" in proc.stderr and "train.updates" in proc.stderr
    assert "Traceback" not in proc.stderr
