"""The training entry point under torchrun: two CPU processes (gloo), the same command as for N GPUs, and the
same arithmetic as one process reading the same windows."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny_corpus import VOCAB, prepare_corpus

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def _run_train(out: Path, processes: int, overrides: list[str]) -> subprocess.CompletedProcess:
    """`creditlab train --preset tiny` in `processes` processes (torchrun for more than one), records under out."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}", "--standalone"]
                if processes > 1 else [sys.executable])
    cmd = launcher + ["-m", "creditlab.cli", "train", "--preset", "tiny", "--set", f"train.out_dir={out}", "--json"]
    for item in overrides:
        cmd += ["--set", item]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow  # two processes, each compiling: the long tests
@pytest.mark.parametrize("source", ["exact", "learned"])
def test_torchrun_two_processes_train(tmp_path, source):
    out = _run_train(tmp_path, 2, ["model.vocab_size=97", "train.updates=3", "train.warmup=0", "credit.teacher_every=2",
                                   f"credit.source={source}"])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["updates"] == 3 and result["final_loss"] < result["first_loss"]
    records = list(tmp_path.iterdir())
    assert len(records) == 1  # only rank 0 writes a record
    rows = (records[0] / "rows.jsonl").read_text().splitlines()
    assert len(rows) == 3 and json.loads(rows[0])["tokens"] == 2 * 8 * 2 * 64  # both ranks' tokens counted


def _final_model(tmp_path: Path, name: str, processes: int, overrides: list[str]) -> dict[str, torch.Tensor]:
    """Train in `processes` processes; return the model state of the run's final checkpoint."""
    out = tmp_path / name
    _run_train(out, processes, overrides)
    (record,) = out.iterdir()
    (checkpoint,) = record.glob("checkpoint_*.pt")
    return torch.load(checkpoint, weights_only=True)["model"]


def _largest_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-300)).item() for k in b)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["exact", "zero"])
def test_two_processes_equal_one_with_the_doubled_micro_batch(tmp_path, source):
    """Data parallelism changes nothing but where the work runs: two ranks of micro-batch 2 read the windows one
    process of micro-batch 4 reads, and after three updates in float64 the models agree to rounding. One process
    of micro-batch 2 (half the data) is the control that shows the comparison can fail."""
    data_dir = tmp_path / "data"
    prepare_corpus(tmp_path / "corpus", data_dir)
    common = [f"data.dir={data_dir}", "data.source=shards", f"model.vocab_size={VOCAB}", "model.seq_len=16",
              "train.dtype=float64", "train.updates=3", "train.warmup=0", "train.checkpoint_every=3", "train.grad_accum=2",
              f"credit.source={source}"]
    two = _final_model(tmp_path, "two", 2, common + ["train.micro_batch=2"])
    one = _final_model(tmp_path, "one", 1, common + ["train.micro_batch=4"])
    half = _final_model(tmp_path, "half", 1, common + ["train.micro_batch=2"])
    assert _largest_relative_difference(two, one) <= 1e-10
    assert _largest_relative_difference(half, one) > 1e-3
