"""Admission: freezing sources, config and data manifest by hash with the git commit; verification that names
what changed and the commit to see it at; the id rule; one verdict per admission with one repair."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from creditlab import cli, config
from creditlab.data import load_manifest
from creditlab.protocol import admission as adm
from creditlab.protocol.records import canonical_json
from tiny_corpus import quiet_prepare, write_corpus


def make_tree(root: Path) -> Path:
    """A stand-in package tree: what an admission freezes is every creditlab/**/*.py under root."""
    for rel, text in {"creditlab/__init__.py": "", "creditlab/model.py": "WIDTH = 512\n",
                      "creditlab/credit/sources.py": "SOURCES = ('exact',)\n",
                      "creditlab/__pycache__/model.cpython-311.py": "not a source\n",
                      "creditlab/notes.txt": "not python\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.fixture
def tree(tmp_path):
    return make_tree(tmp_path / "repo")


def git(root: Path, *args: str) -> str:
    identity = ["-c", "user.name=creditlab", "-c", "user.email=creditlab@localhost"]
    return subprocess.run(["git", "-C", str(root), *identity, *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def committed(root: Path) -> str:
    """root made a git checkout with every file committed; returns the commit."""
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "tree")
    return git(root, "rev-parse", "HEAD")


def cfg_for(tmp_path, *overrides):
    return config.load("tiny", [f"train.out_dir={tmp_path / 'runs'}", *overrides])


def test_admission_freezes_sources_config_and_says_no_manifest_applies(tmp_path, tree):
    cfg = cfg_for(tmp_path)
    a, created = adm.admit(cfg, root=tree, preset="tiny")
    assert created
    listed = {f.path: f.role for f in a.files}
    assert listed == {"creditlab/__init__.py": "source", "creditlab/model.py": "source",
                      "creditlab/credit/sources.py": "source", "config.json": "config"}
    assert a.dir == tmp_path / "runs" / "admissions" / a.id
    assert a.meta["data"]["applies"] is False and "synthetic" in a.meta["data"]["why"]
    # Every file's SHA256; only the config is kept in the admission (an admitted run reads it from there).
    assert sorted(p.name for p in a.dir.iterdir()) == [adm.ADMISSION_FILE, adm.CONFIG_PATH]
    assert {f.path: f.sha256 for f in a.files}["creditlab/model.py"] == hashlib.sha256(b"WIDTH = 512\n").hexdigest()
    config_entry = next(f for f in a.files if f.role == "config")
    assert a.config_path == a.dir / adm.CONFIG_PATH
    assert hashlib.sha256(a.config_path.read_bytes()).hexdigest() == config_entry.sha256
    assert a.meta["format"] == adm.FORMAT and a.meta["git_sha"] is None  # the tree is no git checkout
    assert a.config_text == cfg.to_json() + "\n" and a.config().to_dict() == cfg.to_dict()
    # The id is the SHA256 of the canonical list.
    listing = sorted(({"path": f.path, "role": f.role, "sha256": f.sha256} for f in a.files), key=lambda d: d["path"])
    assert a.id == hashlib.sha256(canonical_json(listing).encode()).hexdigest()


def test_same_inputs_same_admission_and_any_change_a_new_one(tmp_path, tree):
    a, _ = adm.admit(cfg_for(tmp_path), root=tree)
    again, created = adm.admit(cfg_for(tmp_path), root=tree)
    assert not created and again.id == a.id
    other_cfg, _ = adm.admit(cfg_for(tmp_path, "screen.updates=11"), root=tree)
    assert other_cfg.id != a.id
    (tree / "creditlab" / "model.py").write_text("WIDTH = 256\n")
    other_src, _ = adm.admit(cfg_for(tmp_path), root=tree)
    assert other_src.id not in (a.id, other_cfg.id)


def test_verification_passes_then_names_every_mismatch(tmp_path, tree):
    a, _ = adm.admit(cfg_for(tmp_path), root=tree)
    v = adm.verify(a, tree)
    assert v.ok and v.summary().startswith("4/4 frozen files match")
    cfg, _ = adm.verified_config(a, tree)
    assert cfg.to_dict() == cfg_for(tmp_path).to_dict()

    (tree / "creditlab" / "model.py").write_text("WIDTH = 1024\n")  # changed live file
    (tree / "creditlab" / "credit" / "sources.py").unlink()  # missing live file
    (tree / "creditlab" / "extra.py").write_text("x = 1\n")  # added since admission
    v = adm.verify(a, tree)
    status = {c.path: c.status for c in v.checks}
    assert status == {"creditlab/__init__.py": "match", "creditlab/model.py": "changed",
                      "creditlab/credit/sources.py": "missing", "config.json": "match",
                      "creditlab/extra.py": "added"}
    assert not v.ok and v.summary().startswith("2/4 frozen files match")
    for name in ("creditlab/model.py (changed since admission)", "creditlab/credit/sources.py (missing)",
                 "creditlab/extra.py (added since admission)"):
        assert name in v.summary()
    with pytest.raises(adm.AdmissionMismatch, match="creditlab/model.py"):
        adm.verified_config(a, tree)


def test_the_admission_records_its_commit_and_a_source_mismatch_names_it(tmp_path, tree):
    sha = committed(tree)
    a, _ = adm.admit(cfg_for(tmp_path), root=tree)
    assert (a.commit, a.meta["git_dirty"], a.meta["git_sources_changed"]) == (sha, False, [])
    assert adm.verify(a, tree).ok
    (tree / "creditlab" / "model.py").write_text("WIDTH = 1024\n")
    v = adm.verify(a, tree)
    assert not v.ok and v.commit == sha
    assert v.summary().endswith(f"refusing to run: creditlab/model.py (changed since admission); the admission "
                                f"froze them at commit {sha[:12]}: `git checkout {sha[:12]}` to see them, or "
                                "admit again")
    # The commit shows the frozen file: its bytes there hash to the listed SHA256.
    at_commit = subprocess.run(["git", "-C", str(tree), "show", f"{sha[:12]}:creditlab/model.py"],
                               check=True, capture_output=True).stdout
    assert hashlib.sha256(at_commit).hexdigest() == {f.path: f.sha256 for f in a.files}["creditlab/model.py"]
    # A source uncommitted at admission is named: the commit does not show it as it was frozen.
    (tree / "creditlab" / "credit" / "sources.py").write_text("SOURCES = ('exact', 'zero')\n")
    b, _ = adm.admit(cfg_for(tmp_path), root=tree)
    assert b.meta["git_dirty"] is True
    assert b.meta["git_sources_changed"] == ["creditlab/credit/sources.py", "creditlab/model.py"]
    (tree / "creditlab" / "model.py").write_text("WIDTH = 512\n")
    with pytest.raises(adm.AdmissionMismatch, match=rf"commit {sha[:12]}.*at admission 2 source file\(s\) differed "
                                                    r"from that commit: creditlab/credit/sources.py"):
        adm.verified_config(b, tree)


def test_an_altered_admitted_config_is_a_mismatch(tmp_path, tree):
    a, _ = adm.admit(cfg_for(tmp_path), root=tree)
    a.config_path.write_text(cfg_for(tmp_path, "screen.updates=3").to_json() + "\n")
    v = adm.verify(a, tree)
    assert {c.path: c.status for c in v.checks}["config.json"] == "changed"  # the admitted config is what would run
    assert "git checkout" not in v.summary()  # the config is the admission's own, not the checkout's
    with pytest.raises(adm.AdmissionMismatch, match=r"config.json \(changed since admission\)"):
        adm.verified_config(a, tree)
    a.config_path.unlink()
    assert {c.path: c.status for c in adm.verify(a, tree).checks}["config.json"] == "missing"


def test_an_admission_with_copies_verifies_against_its_list_and_reads_only_its_config(tmp_path, tree):
    """An admission made when admissions held files/, a copy of every frozen file but the shards."""
    a, _ = adm.admit(cfg_for(tmp_path), root=tree)
    copies = a.dir / adm.LEGACY_FILES
    for f in a.files:
        if f.role == "source":
            (copies / f.path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(tree / f.path, copies / f.path)
    shutil.move(a.dir / adm.CONFIG_PATH, copies / adm.CONFIG_PATH)
    old = adm.load(a.dir)
    assert old.config_path == copies / adm.CONFIG_PATH
    cfg, v = adm.verified_config(old, tree)
    assert v.ok and cfg.to_dict() == cfg_for(tmp_path).to_dict()
    (copies / "creditlab" / "model.py").write_text("WIDTH = 1\n")  # a copy is not read
    (copies / "creditlab" / "credit" / "sources.py").unlink()
    assert adm.verify(old, tree).ok
    (tree / "creditlab" / "model.py").write_text("WIDTH = 1\n")  # the live file is
    assert {c.path: c.status for c in adm.verify(old, tree).checks}["creditlab/model.py"] == "changed"
    (copies / adm.CONFIG_PATH).write_text(cfg_for(tmp_path, "screen.updates=3").to_json() + "\n")
    assert {c.path: c.status for c in adm.verify(old, tree).checks}["config.json"] == "changed"


def test_an_altered_admission_listing_is_refused(tmp_path, tree):
    a, _ = adm.admit(cfg_for(tmp_path), root=tree)
    meta = json.loads((a.dir / adm.ADMISSION_FILE).read_text())
    meta["files"][0]["sha256"] = "0" * 64
    (a.dir / adm.ADMISSION_FILE).write_text(json.dumps(meta))
    with pytest.raises(adm.AdmissionError, match="altered"):
        adm.load(a.dir)
    (a.dir / adm.ADMISSION_FILE).write_text(json.dumps(meta)[:40])  # cut short
    with pytest.raises(adm.AdmissionError, match="admission.json is not readable JSON .*admit again"):
        adm.load(a.dir)


def test_data_manifest_is_frozen_when_data_are_prepared(tmp_path, tree):
    data = tmp_path / "prepared"
    data.mkdir()
    (data / "manifest.json").write_text('{"splits": {}, "tokenizer": {"vocab_size": 12289}}\n')
    cfg = cfg_for(tmp_path, "data.source=shards", f"data.dir={data}")
    a, _ = adm.admit(cfg, root=tree)
    entry = next(f for f in a.files if f.role == "data_manifest")
    assert entry.path == adm.MANIFEST_PATH and a.meta["data"]["applies"] is True
    assert adm.verify(a, tree).summary().startswith("5/5 frozen files match")
    (data / "manifest.json").write_text('{"splits": {"train": 1}}\n')
    with pytest.raises(adm.AdmissionMismatch, match=r"data/manifest.json \(changed since admission\)"):
        adm.verified_config(a, tree)
    with pytest.raises(adm.AdmissionError, match="does not exist"):
        adm.admit(cfg_for(tmp_path, "data.source=shards", f"data.dir={tmp_path / 'nowhere'}"), root=tree)


def test_find_by_folder_id_or_prefix(tmp_path, tree):
    a, _ = adm.admit(cfg_for(tmp_path), root=tree)
    runs = tmp_path / "runs"
    assert adm.find(str(a.dir), runs).id == a.id
    assert adm.find(a.id, runs).id == a.id
    assert adm.find(a.id[:10], runs).id == a.id
    with pytest.raises(adm.AdmissionError, match="no admission"):
        adm.find("f" * 12 if not a.id.startswith("f") else "0" * 12, runs)
    with pytest.raises(adm.AdmissionError, match="at least 8 hex"):
        adm.find("abc", runs)


def test_one_verdict_per_admission_and_one_repair(tmp_path, tree):
    a, _ = adm.admit(cfg_for(tmp_path), root=tree)
    assert adm.may_screen(a)["repair"] is None
    with pytest.raises(adm.AdmissionError, match="nothing to repair"):
        adm.may_screen(a, repair="a fix")
    adm.record_screen(a, {"record_dir": "runs/first", "time": "t0", "repair": None})
    adm.record_verdict(a, {"verdict": "timing_miss", "record_dir": "runs/first", "time": "t1", "repair": None})
    with pytest.raises(adm.AdmissionConsumed, match="already has a verdict: timing_miss recorded in runs/first"):
        adm.may_screen(a)
    with pytest.raises(adm.AdmissionError, match="needs a reason"):
        adm.may_screen(a, repair="  ")
    allowed = adm.may_screen(a, repair="native arm used the wrong optimizer")
    assert allowed["repair"] == "native arm used the wrong optimizer" and len(allowed["earlier_verdicts"]) == 1
    adm.record_verdict(a, {"verdict": "pass", "record_dir": "runs/second", "time": "t2",
                           "repair": "native arm used the wrong optimizer"})
    with pytest.raises(adm.AdmissionConsumed, match="one repair was used.*runs/second"):
        adm.may_screen(a, repair="another fix")
    with pytest.raises(adm.AdmissionConsumed):
        adm.may_screen(a)
    # Admitting the same inputs again finds the same, consumed admission.
    again, created = adm.admit(cfg_for(tmp_path), root=tree)
    assert not created and len(adm.verdicts(again)) == 2


def test_screens_without_a_verdict_are_listed_for_the_next_record(tmp_path, tree):
    a, _ = adm.admit(cfg_for(tmp_path), root=tree)
    adm.record_screen(a, {"record_dir": "runs/crashed", "time": "t0", "repair": None})
    assert adm.may_screen(a)["unfinished_screens"] == ["runs/crashed"]


def test_exclusive_holds_the_admission(tmp_path, tree):
    a, _ = adm.admit(cfg_for(tmp_path), root=tree)
    with adm.exclusive(a):
        with pytest.raises(adm.AdmissionError, match="another screen is running"):
            with adm.exclusive(a):
                pass
    with adm.exclusive(a):  # released
        pass


def test_cli_admit_json_and_refusal_on_an_altered_config(tmp_path, capsys):
    out = tmp_path / "runs"
    assert cli.main(["admit", "--preset", "tiny", "--set", f"train.out_dir={out}", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed) == {"admission", "files", "created", "verdict", "cosmetic_differences"}
    assert printed["created"] is True and printed["verdict"] is None and printed["cosmetic_differences"] == {}
    a = adm.load(out / "admissions" / printed["admission"])
    n_sources = len(adm.source_paths(adm.package_root()))
    assert printed["files"] == len(a.files) and n_sources + 1 <= printed["files"] <= n_sources + 3
    assert a.commit == adm.git_state(adm.package_root())["git_sha"]  # the package's own commit, or None
    assert not (a.dir / adm.LEGACY_FILES).exists()  # no copy of the package
    a.config_path.write_text(a.config_text.replace('"updates"', '"updates" ', 1))
    code = cli.main(["screen", "--admission", printed["admission"][:12], "--out-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert "refused" in err and "config.json (changed since admission)" in err
    assert not [p for p in out.iterdir() if "-screen-" in p.name]  # refused before any record
    # A config given alongside an admission is refused: an admitted screen runs the admitted config.
    assert cli.main(["screen", "--admission", printed["admission"], "--out-dir", str(out),
                     "--set", "screen.updates=2"]) == 2
    assert "admitted config" in capsys.readouterr().err


def test_an_edited_shard_is_refused_though_the_manifest_is_untouched(tmp_path, tree):
    data = tmp_path / "prepared"
    write_corpus(tmp_path / "corpus", n=100)
    quiet_prepare(f"dir:{tmp_path / 'corpus'}", data)
    cfg = cfg_for(tmp_path, "data.source=shards", f"data.dir={data}")
    a, _ = adm.admit(cfg, root=tree)
    listed = [f for s in load_manifest(data)["splits"].values() for f in s["files"]]
    frozen = {f.path: (f.role, f.sha256) for f in a.files if f.role == "data_shard"}
    assert frozen == {f"data/{f['name']}": ("data_shard", f["sha256"]) for f in listed}
    assert a.meta["counts"]["data_shard"] == len(listed) > 3
    assert sorted(p.name for p in a.dir.iterdir()) == [adm.ADMISSION_FILE, adm.CONFIG_PATH]  # the rest by hash
    assert adm.verify(a, tree).ok
    shard = listed[0]["name"]
    raw = bytearray((data / shard).read_bytes())
    raw[-1] ^= 1
    (data / shard).write_bytes(bytes(raw))
    with pytest.raises(adm.AdmissionMismatch, match=rf"data/{shard} \(changed since admission\)"):
        adm.verified_config(a, tree)
    # Data that already differ from their manifest are not admitted at all.
    with pytest.raises(adm.AdmissionError, match=rf"do not match its manifest \({data / shard} has SHA256"):
        adm.admit(cfg_for(tmp_path, "data.source=shards", f"data.dir={data}", "screen.updates=7"), root=tree)
    (data / shard).unlink()
    assert {c.path: c.status for c in adm.verify(a, tree).checks}[f"data/{shard}"] == "missing"


# ---- one experiment, one admission ------------------------------------------------------------------------

def test_cosmetic_keys_are_valid_config_keys():
    assert set(adm.COSMETIC_KEYS) <= set(config.valid_keys())
    assert {"train.log_every", "train.out_dir"} <= set(adm.COSMETIC_KEYS)


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return f"{value}x"


def test_every_key_but_the_cosmetic_ones_makes_another_experiment():
    files = [adm.FrozenFile("creditlab/model.py", "source", "0" * 64),
             adm.FrozenFile("config.json", "config", "1" * 64)]
    base = config.load("tiny").to_dict()
    key = adm.experiment_key(files, base)
    for name in config.valid_keys():
        section, _, field = name.partition(".")
        other = json.loads(json.dumps(base))
        other[section][field] = _changed(other[section][field])
        same = adm.experiment_key(files, other) == key
        assert same == (name in adm.COSMETIC_KEYS), name
    # The frozen files count too (the config's own hash does not: its content is compared without cosmetic keys).
    changed = [adm.FrozenFile("creditlab/model.py", "source", "2" * 64), files[1]]
    assert adm.experiment_key(changed, base) != key
    assert adm.experiment_key([files[0], adm.FrozenFile("config.json", "config", "3" * 64)], base) == key


def test_admitting_an_experiment_again_with_cosmetic_changes_names_the_first(tmp_path, tree):
    base = tmp_path / "store"
    first, created = adm.admit(cfg_for(tmp_path), out_dir=base, root=tree)
    assert created and first.meta["experiment"] == adm.experiment_of(first)
    adm.record_verdict(first, {"verdict": "timing_miss", "record_dir": "runs/first", "time": "t", "repair": None})
    again, created = adm.admit(cfg_for(tmp_path, "train.log_every=3", f"train.out_dir={tmp_path / 'elsewhere'}"),
                               out_dir=base, root=tree)
    assert not created and again.id == first.id
    assert again.cosmetic_differences == {"train.log_every": [10, 3],
                                          "train.out_dir": [str(tmp_path / "runs"), str(tmp_path / "elsewhere")]}
    assert adm.verdicts(again)[0]["verdict"] == "timing_miss"
    assert [p.name for p in (base / adm.ADMISSIONS).iterdir()] == [first.id]  # no second admission
    # The admitted config is what runs: the earlier one's, cosmetic keys and all.
    assert again.config().train.log_every == 10
    # A key that changes the arms is another experiment.
    other, created = adm.admit(cfg_for(tmp_path, "train.lr_muon=0.03"), out_dir=base, root=tree)
    assert created and other.id != first.id and other.cosmetic_differences == {}


def test_cli_admit_names_the_earlier_admission_and_its_verdict(tmp_path, capsys):
    store = tmp_path / "store"
    args = ["admit", "--preset", "tiny", "--out-dir", str(store), "--json"]
    assert cli.main([*args, "--set", "train.log_every=10"]) == 0
    first = json.loads(capsys.readouterr().out)
    adm.record_verdict(adm.find(first["admission"], store),
                       {"verdict": "pass", "record_dir": "runs/x", "time": "t", "repair": None})
    assert cli.main([*args, "--set", "train.log_every=1"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["admission"] == first["admission"] and again["created"] is False
    assert again["verdict"] == "pass" and again["cosmetic_differences"] == {"train.log_every": [10, 1]}
    assert cli.main(args[:-1] + ["--set", "train.log_every=2"]) == 0
    printed = capsys.readouterr().out
    assert "the same experiment as this earlier admission" in printed and "already has a verdict: pass" in printed
