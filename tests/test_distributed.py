"""The training entry point under torchrun: two CPU processes (gloo), the same command as for N GPUs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("source", ["exact", "learned"])
def test_torchrun_two_processes_train(tmp_path, source):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "-m", "creditlab.cli", "train", "--preset", "tiny",
           "--set", "model.vocab_size=97", "--set", "train.updates=3", "--set", "credit.teacher_every=2",
           "--set", f"credit.source={source}", "--set", f"train.out_dir={tmp_path}", "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["updates"] == 3 and result["final_loss"] < result["first_loss"]
    records = list(tmp_path.iterdir())
    assert len(records) == 1  # only rank 0 writes a record
    rows = (records[0] / "rows.jsonl").read_text().splitlines()
    assert len(rows) == 3 and json.loads(rows[0])["tokens"] == 2 * 8 * 2 * 64  # both ranks' tokens counted
