"""The data-parallel benchmark end to end on the CPU: two gloo processes stand in for two GPUs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark_scripts import load


def test_summary_leaves_out_each_kinds_compiling_update_and_scales_against_one_process():
    ddp = load("ddp")
    rows = [{"kind": k, "seconds": s, "tokens_per_s": 100 / s, "peak_allocated_mib": 10.0, "loss": 5.0 - i}
            for i, (k, s) in enumerate([("teacher", 9.0), ("synthetic", 8.0), ("synthetic", 1.0),
                                        ("synthetic", 3.0), ("teacher", 2.0)])]
    summary = ddp.summarize({"name": "two", "gpus": 2, "exit": 0, "rows": rows}, window=4)
    assert summary["synthetic"]["s_per_update"] == 2.0 and summary["synthetic"]["updates_in_median"] == 2
    assert summary["teacher"]["s_per_update"] == 2.0 and summary["teacher"]["updates_in_median"] == 1
    native = {"name": "one", "gpus": 1, "exit": 0, "native": {"s_per_update": 1.0, "tokens_per_s": 100.0,
                                                               "peak_allocated_mib": 0, "updates_in_median": 3}}
    two = {"name": "two", "gpus": 2, "exit": 0, "native": {"s_per_update": 1.1, "tokens_per_s": 180.0,
                                                            "peak_allocated_mib": 5.0, "updates_in_median": 3}}
    text = ddp.table([two, native])
    assert "| two | 2 | native | 1.1000 | 180 | 0.900 |" in text  # 180 / (2 * 100)


@pytest.mark.slow
def test_the_script_runs_its_three_runs_on_two_cpu_processes(tmp_path, monkeypatch):
    ddp = load("ddp")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(sys, "argv", ["ddp.py", "--out", str(tmp_path), "--preset", "tiny", "--updates", "3",
                                      "--window", "2", "--set", "model.vocab_size=97", "--set", "train.warmup=0"])
    ddp.main()
    result = json.loads((tmp_path / "ddp.json").read_text())
    assert [r["exit"] for r in result["runs"]] == [0, 0, 0], [r["log_tail"] for r in result["runs"]]
    assert [len(r["rows"]) for r in result["runs"]] == [3, 3, 3]
    learned = result["runs"][0]["rows"]
    assert [r["kind"] for r in learned] == ["teacher", "synthetic", "synthetic"]
    assert learned[1]["tokens"] == 2 * result["runs"][2]["rows"][1]["tokens"]  # both ranks' tokens counted
    assert "| single_native | 1 | native |" in (tmp_path / "ddp.md").read_text()


@pytest.mark.slow
def test_a_run_past_its_time_is_stopped_with_all_its_processes(tmp_path, monkeypatch):
    """A timed-out run must not leave workers behind to run on into the next run's timings."""
    ddp = load("ddp")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run = ddp.run_training("slow", 2, "tiny", ["model.vocab_size=97", "train.updates=100000"], tmp_path, 8.0)
    assert run["exit"] == "timeout"
    survivors = subprocess.run(["pgrep", "-f", f"train.out_dir={tmp_path}"], capture_output=True, text=True)
    assert survivors.stdout.strip() == "", survivors.stdout


def test_step_lines_of_a_train_log_become_rows():
    """plot.py reads a run's times from its log where the script could not read its rows (ddp_seed.md)."""
    log = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "ddp_seed_learned.log"
    rows = load("plot").step_lines(log)
    assert [r["update"] for r in rows] == list(range(8))
    assert [r["kind"] for r in rows] == ["teacher", "synthetic", "synthetic", "synthetic", "teacher", "synthetic",
                                         "synthetic", "synthetic"]
    assert rows[2]["seconds"] == 0.321 and rows[4]["seconds"] == 0.382
