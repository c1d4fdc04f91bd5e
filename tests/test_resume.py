"""A run that dies resumes from its newest checkpoint and ends where an uninterrupted run ends."""

import json
import shutil

import pytest
import torch

from creditlab import cli

ARGS = ["train", "--preset", "tiny", "--set", "model.vocab_size=97", "--set", "train.updates=5", "--set", "train.warmup=0",
        "--set", "train.checkpoint_every=2", "--set", "credit.source=learned", "--set", "credit.teacher_every=2"]


def _run(tmp_path, name):
    assert cli.main(ARGS + ["--set", f"train.out_dir={tmp_path / name}"]) == 0
    (record,) = (tmp_path / name).iterdir()
    return record


def _rows(record):
    return [json.loads(line) for line in (record / "rows.jsonl").read_text().splitlines()]


def test_resume_continues_exactly(tmp_path):
    full = _run(tmp_path, "full")
    assert sorted(p.name for p in full.glob("checkpoint_*.pt")) == ["checkpoint_000002.pt", "checkpoint_000004.pt"]
    # What a run that died during update 4 leaves: config, env, three rows, the checkpoint after update 2.
    died = tmp_path / "died" / full.name
    died.mkdir(parents=True)
    for name in ("config.json", "env.json", "checkpoint_000002.pt"):
        shutil.copy(full / name, died / name)
    (died / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows(full)[:3]))

    assert cli.main(["train", "--resume", str(died)]) == 0
    rows = _rows(died)
    assert [r["update"] for r in rows] == [0, 1, 2, 2, 3, 4]  # update 3 (index 2) re-done, both rows kept
    expected = {r["update"]: r["loss"] for r in _rows(full)}
    assert {r["update"]: r["loss"] for r in rows[3:]} == {u: expected[u] for u in (2, 3, 4)}
    result, full_result = (json.loads((d / "result.json").read_text()) for d in (died, full))
    assert result["updates"] == 5 and result["final_loss"] == full_result["final_loss"]
    final = torch.load(died / "checkpoint_000004.pt", weights_only=True)["model"]
    reference = torch.load(full / "checkpoint_000004.pt", weights_only=True)["model"]
    for key, value in reference.items():
        assert torch.equal(final[key], value), key


def test_resume_refuses_what_it_cannot_continue(tmp_path):
    full = _run(tmp_path, "full")
    assert cli.main(["train", "--resume", str(full)]) == 2  # finished: result.json exists
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((full / "config.json").read_text())
    assert cli.main(["train", "--resume", str(bare)]) == 2  # no checkpoint
    with pytest.raises(SystemExit):
        cli.main(["train", "--resume"])
