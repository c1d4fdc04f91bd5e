"""benchmarks/admitted_study.sh on the CPU: admission, screen, a comparison of every seed in one folder, one
FINAL_HELDOUT read of all its final models, and what comes back; a second call changes nothing."""

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from tiny_corpus import VOCAB, prepare_corpus

ROOT = Path(__file__).resolve().parents[1]

EXPERIMENT = f"""
preset = "tiny"
arms = ["native", "zero"]
seeds = [1, 2]

[model]
vocab_size = {VOCAB}

[data]
source = "shards"
dir = "named by the script"

[train]
updates = 20
eval_every = 10
eval_tokens = 2048

[compare]
native_budgets = "0.7,1.0"
"""


def _call(tmp_path: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": str(ROOT), "CREDITLAB_LEDGER": str(tmp_path / "ledger")}
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "admitted_study.sh"), str(tmp_path / "exp.toml"),
                           str(tmp_path / "state"), str(tmp_path / "data"), str(tmp_path / "out"), "600"],
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_an_admitted_study_reads_the_held_out_split_once_for_every_final_model(tmp_path):
    prepare_corpus(tmp_path / "corpus", tmp_path / "data")
    (tmp_path / "exp.toml").write_text(EXPERIMENT)
    done = _call(tmp_path)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    admission = json.loads((out / "admit.json").read_text())["admission"]
    assert "screen" in (out / "screen.log").read_text()  # the screen ran under the admission (its record named)
    heldout = json.loads((out / "heldout.json").read_text())
    assert heldout["admission"] == admission
    # every final model of both seeds in the one read: the arms and native's shorter budget
    assert sorted(heldout["models"]) == sorted(f"{arm}-seed{s}" for s in (1, 2)
                                               for arm in ("native", "zero", "native+train.updates-14"))
    with tarfile.open(out / "all.tar.xz") as packed:
        names = packed.getnames()
    assert f"all/heldout-{admission[:16]}.json" in names and not any(n.endswith(".pt") for n in names)
    # a second call finds everything done: no second read (the ledger would refuse it), the same result back
    again = _call(tmp_path)
    assert again.returncode == 0, again.stderr
    assert json.loads((out / "heldout.json").read_text()) == heldout
    assert "heldout exit" not in again.stdout
