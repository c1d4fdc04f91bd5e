"""benchmarks/admitted_study.sh on the CPU: admission, screen, a comparison of every seed in one folder, one
FINAL_HELDOUT read of all its final models, and what comes back; a second call changes nothing. And
benchmarks/study.sh's last call, which starts no folder it cannot finish."""

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
# as the gate-width study keeps its disk: one checkpoint a running arm, none once finished
checkpoint_every = 10
keep_checkpoints = 1
drop_finished_checkpoints = true

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
    kept = list((tmp_path / "state" / "study" / "all").glob("*/*.pt"))  # the final models the read needed, alone
    assert kept and all(p.name == "model.pt" for p in kept)
    # a second call finds everything done: no second read (the ledger would refuse it), the same result back
    again = _call(tmp_path)
    assert again.returncode == 0, again.stderr
    assert json.loads((out / "heldout.json").read_text()) == heldout
    assert "heldout exit" not in again.stdout


def _study(tmp_path: Path, seconds: int, whole: bool) -> str:
    """benchmarks/study.sh with seed1 finished (in two pieces, 200 + 250 s) and seed9 begun but unfinished."""
    state, data = tmp_path / "state", tmp_path / "data"
    for name, finished in (("seed1", True), ("seed9", False)):
        (state / name).mkdir(parents=True, exist_ok=True)
        (state / name / "experiment.toml").write_text("")
        if finished:
            (state / name / "compare.json").write_text("{}")
    (state / "durations.txt").write_text("seed1 200\nseed9 9999\nseed1 250\n")
    data.mkdir(exist_ok=True)
    (data / "manifest.json").write_text("{}")  # prepared already: the script prepares nothing
    before = (state / "log.txt").read_text() if (state / "log.txt").exists() else ""
    env = os.environ | {"PYTHONPATH": str(ROOT), "STUDY_WHOLE": "1" if whole else "0"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "study.sh"), str(tmp_path / "missing.toml"), str(state),
                           str(data), str(tmp_path / "out"), str(seconds), "seed1:--seeds 1", "seed2:--seeds 2"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return (state / "log.txt").read_text()[len(before):]  # this call's lines (the log is appended to)


def test_a_last_call_starts_no_folder_it_cannot_finish(tmp_path):
    """With STUDY_WHOLE=1 a new folder starts only if the time left covers the longest finished one (its pieces
    summed: 450 s, not its longest piece); without it, the folder starts, to be resumed by the next call."""
    log = _study(tmp_path, 400, whole=True)  # 355 s left for seed2 after the margin: under 450
    assert "not started: seed2 (a finished folder took 450 s; 355 s left)" in log
    assert not (tmp_path / "state" / "seed2").exists() and (tmp_path / "out" / "seed1.tar.xz").exists()
    log = _study(tmp_path, 400, whole=False)
    assert "not started" not in log and "--seeds 2" in log  # begun (it fails at once: no experiment file)
