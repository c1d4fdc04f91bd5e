"""FINAL_HELDOUT reads need an existing admission, checked before anything else is read."""

from __future__ import annotations

import json

import pytest

from creditlab import config
from creditlab.protocol import admission as adm
from creditlab.protocol import heldout as ho


def finished_run(tmp_path):
    """A folder that looks finished (config.json and model.pt): the refusals below come before either is read."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(config.load("tiny").to_dict()))
    (run / "model.pt").write_bytes(b"not read")
    return run


@pytest.mark.parametrize("ref", [None, "", "   "])
def test_no_admission_no_read(tmp_path, ref):
    with pytest.raises(ho.HeldoutRefused, match="only under an existing admission"):
        ho.heldout(finished_run(tmp_path), ref, tmp_path)


def test_an_admission_that_does_not_exist_is_refused_first(tmp_path):
    with pytest.raises(ho.HeldoutRefused, match="existing admission: no admission '0000000000000000'"):
        ho.heldout(tmp_path / "no-such-run", "0" * 16, tmp_path)  # refused for the admission, not the run
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "notes.json").write_text("{}")
    with pytest.raises(ho.HeldoutRefused, match="existing admission"):
        ho.require_admission(str(fake), tmp_path)  # a folder without admission.json is not one


def test_an_altered_admission_record_is_refused(tmp_path):
    a, _ = adm.admit(config.load("tiny", [f"train.out_dir={tmp_path}"]))
    assert ho.require_admission(a.id, tmp_path).id == a.id  # an intact admission of this package is accepted
    meta = json.loads((a.dir / adm.ADMISSION_FILE).read_text())
    meta["files"][0]["sha256"] = "0" * 64
    (a.dir / adm.ADMISSION_FILE).write_text(json.dumps(meta))
    with pytest.raises(ho.HeldoutRefused, match="altered"):
        ho.heldout(finished_run(tmp_path), a.id, tmp_path)


def test_a_heldout_read_under_torchrun_is_refused_before_the_admission_is_read(tmp_path, monkeypatch):
    a, _ = adm.admit(config.load("tiny", [f"train.out_dir={tmp_path}"]))
    monkeypatch.setenv("WORLD_SIZE", "2")  # every rank would read the split and append to its ledger
    with pytest.raises(ho.HeldoutRefused, match="without torchrun"):
        ho.heldout(finished_run(tmp_path), a.id, tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(Exception) as one_process:  # past the refusal: the fake model file is read and fails
        ho.heldout(finished_run(tmp_path), a.id, tmp_path)
    assert "torchrun" not in str(one_process.value)


def test_a_changed_source_is_refused_naming_the_commit_it_was_admitted_at(tmp_path, monkeypatch):
    import subprocess

    root = tmp_path / "repo"
    (root / "creditlab").mkdir(parents=True)
    (root / "creditlab" / "model.py").write_text("WIDTH = 512\n")

    def git(*args):
        return subprocess.run(["git", "-C", str(root), "-c", "user.name=creditlab",
                               "-c", "user.email=creditlab@localhost", *args],
                              check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "tree")
    sha = git("rev-parse", "HEAD")
    monkeypatch.setattr(adm, "package_root", lambda: root)  # the package a read verifies is this tree
    a, _ = adm.admit(config.load("tiny", [f"train.out_dir={tmp_path}"]))
    assert a.commit == sha and ho.require_admission(a.id, tmp_path).id == a.id
    (root / "creditlab" / "model.py").write_text("WIDTH = 256\n")
    with pytest.raises(ho.HeldoutRefused, match=rf"creditlab/model.py \(changed since admission\); the admission "
                                                rf"froze them at commit {sha[:12]}: `git checkout {sha[:12]}`"):
        ho.heldout(finished_run(tmp_path), a.id, tmp_path)
