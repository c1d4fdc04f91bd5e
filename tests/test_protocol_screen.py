"""The resource screen on the CPU: records, identical initialization and inputs (and that their checks catch a
difference), an injected out-of-memory error, the cap, admitted screens with one verdict and one repair, arms
interleaved, CPU screens exploratory, killed screens and their retries.

The synthetic arm runs the `zero` source here (a stand-in that needs nothing fitted); the runner takes any source
that omits the 16 products."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from creditlab import cli, config
from creditlab.protocol import admission as adm
from creditlab.protocol import screen as scr
from creditlab.protocol.records import read_jsonl

UPDATES = 4
SMALL = ["credit.source=zero", f"screen.updates={UPDATES}", "train.micro_batch=2",
         "train.grad_accum=2", "model.seq_len=32", "train.warmup=0"]


def cfg_for(tmp_path, *overrides):
    return config.load("tiny", [f"train.out_dir={tmp_path / 'runs'}", *SMALL, *overrides])


def screen(cfg, **kw):
    kw.setdefault("log", io.StringIO())
    return scr.run_screen(cfg, **kw)


# Rounds of the interleaved arms: (arm, update) in the order they run, the order rotated each round.
INTERLEAVED = [("native", 0), ("synthetic", 0), ("synthetic", 1), ("native", 1),
               ("native", 2), ("synthetic", 2), ("synthetic", 3), ("native", 3)]


@pytest.fixture
def decisive(monkeypatch):
    """Let this CPU decide, as a GPU does: for the tests of what a final verdict records."""
    monkeypatch.setattr(scr, "cannot_decide", lambda runtime: None)


def tree(root: Path) -> Path:
    for rel in ("creditlab/__init__.py", "creditlab/model.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(f"# {rel}\n")
    return root


# ---- pure pieces -------------------------------------------------------------------------------------------

def test_state_and_token_hashes_see_one_element():
    a = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.zeros(())}
    b = {k: v.clone() for k, v in a.items()}
    assert scr.state_sha256(a) == scr.state_sha256(b)
    b["w"][1, 2] += 1e-6
    assert scr.state_sha256(a) != scr.state_sha256(b)
    assert scr.state_sha256(a) != scr.state_sha256({"w": a["w"].double(), "b": a["b"]})  # dtype counts
    t = torch.randint(0, 100, (2, 9))
    u = t.clone()
    assert scr.tokens_sha256(t) == scr.tokens_sha256(u)
    u[0, 0] += 1
    assert scr.tokens_sha256(t) != scr.tokens_sha256(u)


@pytest.mark.parametrize("ref,other,complete,match,first", [
    (["a", "b", "c"], ["a", "b", "c"], True, True, None),
    (["a", "b", "c"], ["a", "x", "c"], True, False, 1),
    (["a", "b", "c"], ["a", "b"], True, False, 2),  # both complete: equally many
    (["a", "b", "c"], ["a", "b"], False, True, None),  # stopped early: equal over what both read
    (["a", "b", "c"], ["b"], False, False, 0),
])
def test_compare_sequences(ref, other, complete, match, first):
    out = scr.compare_sequences(ref, other, complete)
    assert out["match"] is match and out["first_difference"] == first


def test_arm_configs_and_the_candidate_source():
    cfg = config.load("tiny")
    assert scr.synthetic_source_of(cfg) == "learned"  # the presets say exact: the screen's candidate is learned
    assert scr.synthetic_source_of(config.load("tiny", ["credit.source=zero"])) == "zero"
    native, synthetic = (scr.arm_config(cfg, arm, "learned") for arm in scr.ARMS)
    assert native.credit.source == "exact" and synthetic.credit.source == "learned"
    assert synthetic.credit.schedule == "never"  # synthetic at every update: the screen times the synthetic step
    for c in (native, synthetic):
        assert c.train.seed == cfg.train.seed == 42261 and c.train.updates == cfg.screen.updates
    assert native.train == synthetic.train and native.model == synthetic.model  # same optimizers, same model


def test_preflight_refuses_what_cannot_be_a_synthetic_arm(tmp_path):
    cfg = cfg_for(tmp_path)
    with pytest.raises(scr.ScreenRefused, match="omits"):
        screen(cfg, synthetic_source="exact")
    with pytest.raises(scr.ScreenRefused, match="unknown credit source"):
        screen(cfg, synthetic_source="nope")
    with pytest.raises(scr.ScreenRefused, match="--repair"):
        screen(cfg, repair="no admission to repair")
    assert not (tmp_path / "runs").exists()  # refused before any record


def test_a_screen_under_torchrun_is_refused_before_any_record(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(scr.ScreenRefused, match="without torchrun"):
        screen(cfg_for(tmp_path))
    assert not (tmp_path / "runs").exists()


# ---- a whole screen ----------------------------------------------------------------------------------------

def test_exploratory_screen_writes_a_complete_record(tmp_path):
    cfg = cfg_for(tmp_path, "screen.cycle_gate=100", "screen.memory_cap_mib=4000")
    out = screen(cfg)
    r, rec = out.result, out.record_dir
    assert out.exit_code == 0 and r["measured"] == "pass" and r["verdict"] is None and out.verdict is None
    assert r["mode"] == "exploratory" and r["admission"] is None and r["stand_in"] is True and r["final"] is False
    assert r["schedule"] == "interleaved"
    for name in ("config.json", "arms.json", "env.json", "admission.json", "rows.jsonl", "result.json", "report.md",
                 "sources.json"):
        assert (rec / name).exists(), name
    assert not (rec / "traceback.txt").exists()
    assert json.loads((rec / "config.json").read_text()) == cfg.to_dict()
    env = json.loads((rec / "env.json").read_text())
    assert {"torch", "git_sha", "device", "admission", "prelaunch", "memory_cap"} <= set(env)
    assert env["prelaunch"] is None and env["memory_cap"]["applied"] is False  # CPU
    # The package sources as they were, copied into the record.
    copied = json.loads((rec / "sources.json").read_text())["files"]
    assert copied and all((rec / "source" / f["path"]).exists() for f in copied)
    assert any(f["path"] == "creditlab/protocol/screen.py" for f in copied)
    # Rows: one per update and arm, interleaved, with the micro-batch hashes of that update.
    rows = read_jsonl(rec / "rows.jsonl")
    assert [(x["arm"], x["update"]) for x in rows] == INTERLEAVED
    assert [(x["round"], x["position"]) for x in rows] == [(u, p) for u in range(UPDATES) for p in (0, 1)]
    assert all(x["kind"] == ("native" if x["arm"] == "native" else "synthetic") for x in rows)
    assert all(len(x["inputs_sha256"]) == 2 and x["seconds"] > 0 and x["peak_allocated_mib"] is None for x in rows)
    by_arm = {a: [h for x in rows if x["arm"] == a for h in x["inputs_sha256"]] for a in scr.ARMS}
    assert by_arm["native"] == by_arm["synthetic"] and len(set(by_arm["native"])) == 2 * UPDATES
    # Identical initialization and inputs, recorded per arm.
    assert r["identical_init"]["match"] and r["identical_inputs"]["match"]
    assert r["arms"]["native"]["init_sha256"] == r["arms"]["synthetic"]["init_sha256"] == r["identical_init"]["sha256"]
    assert r["arms"]["native"]["inputs"]["sha256"] == by_arm["native"]
    # Same start, same data: the first update's loss is the same in both arms.
    assert rows[0]["loss"] == pytest.approx(rows[1]["loss"], rel=1e-6)
    # Gates on the CPU: the peak gate is not applicable.
    assert r["gates"]["peak"]["outcome"] == "n/a" and r["gates"]["ratio"]["outcome"] == "pass"
    assert r["arms"]["synthetic"][f"median_last{UPDATES}_s"] > 0
    report = (rec / "report.md").read_text()
    assert "Exploratory screen" in report and "**Exploratory, no verdict.** Measured: pass." in report
    assert "**Verdict" not in report and "| native | exact | 4/4 |" in report and "interleaved" in report
    assert "Stand-in synthetic source `zero`" in report


def test_the_ratio_per_round_is_recorded_beside_the_verdict(tmp_path):
    """Synthetic over native seconds in the same round, from the third round on, with its interval: in the result
    and the report, as information; the verdict's ratio stays the ratio of last-window medians."""
    from creditlab.experiments.arms_runner import round_ratio

    out = screen(cfg_for(tmp_path, "screen.updates=6", "screen.cycle_gate=100"))
    rows = read_jsonl(out.record_dir / "rows.jsonl")
    seconds = {a: [x["seconds"] for x in rows if x["arm"] == a] for a in scr.ARMS}
    median, low, high, rounds = round_ratio(seconds["synthetic"], seconds["native"])
    assert out.result["ratio_per_round"] == {"median": median, "low": low, "high": high, "rounds": rounds}
    assert rounds == 4 and low <= median <= high
    last = f"median_last{out.result['window']}_s"
    assert out.result["ratio"] == pytest.approx(out.result["arms"]["synthetic"][last]
                                                / out.result["arms"]["native"][last])
    assert f"median {median:.4f}, 95% interval {low:.4f} .. {high:.4f}" in (out.record_dir / "report.md").read_text()
    few = screen(cfg_for(tmp_path))  # four updates: two rounds after the first two, too few for a median
    assert few.result["ratio_per_round"] is None
    assert "Synthetic/native per round" not in (few.record_dir / "report.md").read_text()


def test_timing_miss_and_cap_miss_exit_codes(tmp_path):
    out = screen(cfg_for(tmp_path, "screen.cycle_gate=0.25"))
    assert (out.measured, out.exit_code) == ("timing_miss", 4)
    assert out.result["decided_by"]["name"] == "ratio"
    now = {"t": 0.0}

    def jump(arm, update, micro):  # the device is held 10 s by the time native update 2 ends
        if (arm, update, micro) == ("native", 1, 0):
            now["t"] = 10.0

    out = screen(cfg_for(tmp_path, "screen.cap_gpu_s=5"), hooks=scr.Hooks(micro_batch=jump, clock=lambda: now["t"]))
    assert (out.measured, out.exit_code) == ("cap_miss", 5)
    rows = read_jsonl(out.record_dir / "rows.jsonl")
    assert [(x["arm"], x["update"]) for x in rows] == INTERLEAVED[:4]  # stopped at the cap
    assert out.result["cap_hit"] is True and out.result["gates"]["ratio"]["outcome"] == "not measured"
    assert out.result["occupied_s"] == 10.0 and out.result["decided_by"]["measured"] == 10.0
    out = screen(cfg_for(tmp_path, "screen.cap_gpu_s=0"))  # over the cap before the first update
    assert (out.measured, out.exit_code) == ("cap_miss", 5) and read_jsonl(out.record_dir / "rows.jsonl") == []


def test_injected_out_of_memory_is_a_recorded_capacity_miss(tmp_path):
    def fault(arm, update, micro):
        if arm == "synthetic" and update == 2 and micro == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 128.00 MiB (injected)")

    out = screen(cfg_for(tmp_path), hooks=scr.Hooks(micro_batch=fault))
    r, rec = out.result, out.record_dir
    assert (out.measured, out.exit_code) == ("capacity_miss", 3)
    assert r["decided_by"]["name"] == "oom" and r["decided_by"]["measured"] == "synthetic"
    # Every row measured before it is there (the rounds before it, and native's update 3, first in round 3);
    # the screen stops at the error.
    rows = read_jsonl(rec / "rows.jsonl")
    assert [(x["arm"], x["update"]) for x in rows] == INTERLEAVED[:5]
    oom = r["arms"]["synthetic"]["oom"]
    assert oom["update"] == 2 and oom["micro_batch"] == 1 and oom["type"] == "OutOfMemoryError"
    assert "Tried to allocate 128.00 MiB (injected)" in oom["message"]
    assert oom["allocator"] is None  # CPU
    snapshot = json.loads((rec / oom["snapshot"]).read_text())
    assert snapshot["available"] is False and "CUDA" in snapshot["why"]
    tb = (rec / "traceback.txt").read_text()
    assert "OutOfMemoryError" in tb and "in fault" in tb and "train_update" in tb
    assert r["identical_inputs"]["match"] and r["identical_inputs"]["compared"] == 5
    report = (rec / "report.md").read_text()
    assert "capacity miss measured" in report and "Out of memory in the synthetic arm at update 3" in report


def test_a_different_initialization_is_caught(tmp_path):
    def perturb(arm, model):
        if arm == "synthetic":
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] += 1e-3

    out = screen(cfg_for(tmp_path), hooks=scr.Hooks(model=perturb))
    assert out.exit_code == 6 and out.verdict is None
    assert "identical initialization violated" in out.result["invalid"]
    assert (out.record_dir / "traceback.txt").exists()
    assert read_jsonl(out.record_dir / "rows.jsonl") == []  # both arms are built before the first round
    assert "No verdict: invalid screen" in (out.record_dir / "report.md").read_text()


def test_different_inputs_are_caught(tmp_path):
    def shift(arm, loader):
        if arm == "synthetic":
            loader.position += 1  # one micro-batch ahead of the native arm
        return loader

    out = screen(cfg_for(tmp_path), hooks=scr.Hooks(loader=shift))
    assert out.exit_code == 6 and "identical inputs violated: synthetic micro-batch 0" in out.result["invalid"]
    rows = read_jsonl(out.record_dir / "rows.jsonl")
    assert {x["arm"] for x in rows} == {"native"}


def test_an_error_is_recorded_not_lost(tmp_path):
    def fail(arm, update, micro):
        if arm == "native" and update == 1:
            raise FloatingPointError("loss is nan")

    out = screen(cfg_for(tmp_path), hooks=scr.Hooks(micro_batch=fail))
    assert out.exit_code == 1 and out.verdict is None and "loss is nan" in out.result["error"]
    rows = read_jsonl(out.record_dir / "rows.jsonl")
    assert [(x["arm"], x["update"]) for x in rows] == INTERLEAVED[:3]  # all it measured before the error
    assert "FloatingPointError" in (out.record_dir / "traceback.txt").read_text()


# ---- under an admission ------------------------------------------------------------------------------------

def test_admitted_screen_one_verdict_one_repair(tmp_path, decisive):
    root = tree(tmp_path / "repo")
    cfg = cfg_for(tmp_path, "screen.cycle_gate=0.25")  # a timing miss, deterministically
    a, _ = adm.admit(cfg, root=root)
    runs = tmp_path / "runs"
    first, v = scr.admitted_screen(a.id, runs, root=root, log=io.StringIO())
    assert v.summary().startswith("3/3 frozen files match")
    assert first.verdict == "timing_miss" and first.result["mode"] == "admitted" and first.result["admission"] == a.id
    assert json.loads((first.record_dir / "config.json").read_text()) == cfg.to_dict()
    # The admission keeps hashes only; the record holds the files the verification matched, byte for byte.
    assert sorted(p.name for p in a.dir.iterdir() if not p.name.startswith(".")) == [
        adm.ADMISSION_FILE, adm.CONFIG_PATH, adm.SCREENS, adm.VERDICTS]
    assert (first.record_dir / "frozen" / "creditlab" / "model.py").read_text() == "# creditlab/model.py\n"
    assert (first.record_dir / "frozen" / "config.json").read_text() == a.config_text
    listed = json.loads((first.record_dir / "sources.json").read_text())["files"]
    assert {f["path"]: f["sha256"] for f in listed} == {f.path: f.sha256 for f in a.files}
    assert "3/3 frozen files match" in (first.record_dir / "report.md").read_text()
    assert [x["record_dir"] for x in adm.verdicts(a)] == [str(first.record_dir)]

    with pytest.raises(adm.AdmissionConsumed, match=str(first.record_dir)):
        scr.admitted_screen(a.id, runs, root=root, log=io.StringIO())
    second, _ = scr.admitted_screen(a.id, runs, root=root, repair="native optimizer misconfigured",
                                    log=io.StringIO())
    assert second.result["repair"] == "native optimizer misconfigured"
    assert "one repair screen" in (second.record_dir / "report.md").read_text()
    assert [x["repair"] for x in adm.verdicts(a)] == [None, "native optimizer misconfigured"]
    with pytest.raises(adm.AdmissionConsumed, match="one repair was used"):
        scr.admitted_screen(a.id, runs, root=root, repair="again", log=io.StringIO())
    assert len(adm.verdicts(a)) == 2
    assert [x["status"] for x in adm.attempts(a)] == ["timing_miss", "timing_miss"]
    assert [x["retry_of"] for x in adm.verdicts(a)] == [[], []]  # neither retried a screen without a verdict


def test_an_admitted_screen_on_prepared_shards_records_them_by_hash(tmp_path, decisive):
    """The admission keeps the shards' hashes, not copies: the record lists them uncopied, and the screen reads
    the very shards the admission hashed."""
    from tests.tiny_corpus import VOCAB, prepare_corpus

    data = prepare_corpus(tmp_path / "corpus", tmp_path / "prepared")
    root = tree(tmp_path / "repo")
    cfg = cfg_for(tmp_path, "data.source=shards", f"data.dir={data}", f"model.vocab_size={VOCAB}",
                  "screen.cycle_gate=0.25")
    a, _ = adm.admit(cfg, root=root)
    shards = [f for f in a.files if f.role == "data_shard"]
    assert shards, "the admission froze no shard"
    outcome, verification = scr.admitted_screen(a.id, tmp_path / "runs", root=root, log=io.StringIO())
    assert outcome.verdict == "timing_miss"
    listed = {f["path"]: f for f in json.loads((outcome.record_dir / "sources.json").read_text())["files"]}
    for shard in shards:
        assert listed[shard.path] == {"path": shard.path, "role": "data_shard", "sha256": shard.sha256,
                                      "copied": False}
        assert not (outcome.record_dir / "frozen" / shard.path).exists()
    assert (outcome.record_dir / "frozen" / "data" / "manifest.json").exists()


def test_admitted_screen_refuses_a_changed_file(tmp_path):
    root = tree(tmp_path / "repo")
    a, _ = adm.admit(cfg_for(tmp_path), root=root)
    (root / "creditlab" / "model.py").write_text("# changed\n")
    with pytest.raises(adm.AdmissionMismatch, match=r"2/3 frozen files.*creditlab/model.py \(changed"):
        scr.admitted_screen(a.id, tmp_path / "runs", root=root, log=io.StringIO())
    assert adm.verdicts(a) == [] and adm.screens(a) == []


def test_cli_screen_json(tmp_path, capsys):
    code = cli.main(["screen", "--preset", "tiny", "--json", "--set", f"train.out_dir={tmp_path / 'runs'}",
                     *[x for s in SMALL for x in ("--set", s)], "--set", "screen.cycle_gate=100"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["verdict"] is None and out["measured"] == "pass" and out["admission"] is None
    assert "no admission" in out["exploratory"]
    assert set(out) >= {"verdict", "ratio", "arms", "gates", "record_dir", "admission"}
    assert set(out["arms"]) == {"native", "synthetic"}
    for a in out["arms"].values():
        assert a["updates"] == UPDATES and a["peak_mib"] is None and a[f"median_last{UPDATES}_s"] > 0
    assert isinstance(out["ratio"], float) and Path(out["record_dir"]).is_dir()


# ---- arms interleaved --------------------------------------------------------------------------------------

def _busy_from_half(updates: int, grad_accum: int, delay: float):
    """A host that turns busy halfway through the screen: every micro-batch read after the first half of all
    reads (both arms) is slowed by `delay` seconds."""
    reads = {"n": 0}
    half = updates * grad_accum  # of 2 * updates * grad_accum reads in all

    def hook(arm, update, micro):
        reads["n"] += 1
        if reads["n"] > half:
            time.sleep(delay)
    return hook


def _sequential(arms, rounds, step, *, stop=None, after_round=None):
    """The old schedule: each arm's updates back to back (the control of the test below)."""
    from creditlab.experiments.arms_runner import Step
    for arm in arms:
        for r in range(rounds):
            if stop is not None and stop():
                return
            step(Step(r, 0, arm))


def test_a_host_turning_busy_slows_both_interleaved_arms_alike(tmp_path, monkeypatch):
    cfg = cfg_for(tmp_path, "screen.cycle_gate=100")
    out = screen(cfg, hooks=scr.Hooks(micro_batch=_busy_from_half(UPDATES, 2, 0.15)))
    assert 0.6 < out.result["ratio"] < 1.6, out.result["ratio"]  # the last windows of both arms are busy
    # Control: the same busy host with the arms one after the other lands on the synthetic arm alone, the
    # failure the interleaving exists to prevent (same config, `pass` once and `timing_miss` seven times).
    monkeypatch.setattr(scr, "run_rounds", _sequential)
    control = screen(cfg, hooks=scr.Hooks(micro_batch=_busy_from_half(UPDATES, 2, 0.15)))
    assert control.result["ratio"] > 1.8, control.result["ratio"]


def test_the_screen_and_the_benchmark_share_one_runner():
    from benchmark_scripts import load
    from creditlab.experiments import arms_runner

    bench = load("arms")
    assert scr.run_rounds is arms_runner.run_rounds and bench.run_rounds is arms_runner.run_rounds
    assert bench.rotation is arms_runner.rotation and bench.OwnMemory is arms_runner.OwnMemory


# ---- a screen on the CPU is exploratory ---------------------------------------------------------------------

def test_an_admitted_screen_on_the_cpu_records_no_verdict(tmp_path):
    root = tree(tmp_path / "repo")
    a, _ = adm.admit(cfg_for(tmp_path, "screen.cycle_gate=0.25"), root=root)
    runs = tmp_path / "runs"
    log = io.StringIO()
    first, _ = scr.admitted_screen(a.id, runs, root=root, log=log)
    r = first.result
    assert r["mode"] == "exploratory" and r["final"] is False and r["admission"] == a.id
    assert first.verdict is None and r["verdict"] is None and first.measured == "timing_miss"
    assert first.exit_code == 4  # the code of what it measured
    assert "CPU" in r["exploratory"] and "Exploratory, no verdict" in log.getvalue()
    report = (first.record_dir / "report.md").read_text()
    assert "Exploratory screen under admission" in report and "**Verdict" not in report
    assert adm.verdicts(a) == []  # nothing final under the admission
    again, _ = scr.admitted_screen(a.id, runs, root=root, log=io.StringIO())  # not consumed
    assert [x["status"] for x in adm.attempts(a)] == ["exploratory", "exploratory"]
    assert again.result["retry_of"] == []  # an exploratory screen is not a failed attempt


def test_the_cli_marks_a_cpu_screen_under_an_admission_exploratory(tmp_path, capsys):
    root = tree(tmp_path / "repo")
    a, _ = adm.admit(cfg_for(tmp_path, "screen.cycle_gate=100"), root=root)
    outcome, _ = scr.admitted_screen(a.id, tmp_path / "runs", root=root, log=io.StringIO())
    assert outcome.exit_code == 0 and outcome.verdict is None and outcome.measured == "pass"
    assert "exploratory, pass measured, no verdict" in (outcome.record_dir / "report.md").read_text()


# ---- a screen killed before its verdict, and its retry ------------------------------------------------------

def test_an_interrupted_screen_makes_the_next_one_a_retry(tmp_path, decisive):
    root = tree(tmp_path / "repo")
    a, _ = adm.admit(cfg_for(tmp_path, "screen.cycle_gate=0.25"), root=root)
    runs = tmp_path / "runs"

    def interrupt(arm, update, micro):
        if (arm, update) == ("synthetic", 1):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        scr.admitted_screen(a.id, runs, root=root, hooks=scr.Hooks(micro_batch=interrupt), log=io.StringIO())
    (interrupted,) = adm.attempts(a)
    assert interrupted["status"] == "interrupted" and adm.verdicts(a) == []
    retry, _ = scr.admitted_screen(a.id, runs, root=root, log=io.StringIO())
    assert [x["record_dir"] for x in retry.result["retry_of"]] == [interrupted["record_dir"]]
    assert adm.verdicts(a)[0]["retry_of"] == [interrupted["record_dir"]]
    assert f"retry of `{interrupted['record_dir']}`" in (retry.record_dir / "report.md").read_text()


KILLED = """
import io, os, sys
from creditlab.protocol import screen as scr
scr.cannot_decide = lambda runtime: None  # as on a GPU

def kill(arm, update, micro):
    if (arm, update) == ("synthetic", 1):
        os._exit(137)  # no handler runs: as SIGKILL, or the machine going away

scr.admitted_screen(sys.argv[1], sys.argv[2], root=sys.argv[3], hooks=scr.Hooks(micro_batch=kill),
                    log=io.StringIO())
"""


@pytest.mark.slow  # a process killed and a second one run
def test_a_killed_screen_leaves_a_record_and_the_next_is_its_retry(tmp_path, decisive):
    root = tree(tmp_path / "repo")
    a, _ = adm.admit(cfg_for(tmp_path, "screen.cycle_gate=0.25"), root=root)
    runs = tmp_path / "runs"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(scr.__file__).parents[2]),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", KILLED, a.id, str(runs), str(root)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 137, done.stderr
    (killed,) = adm.attempts(a)
    assert killed["status"] == "unfinished" and adm.verdicts(a) == []
    record = Path(killed["record_dir"])
    assert (record / "config.json").exists() and not (record / "result.json").exists()  # started, not finished
    assert [(x["arm"], x["update"]) for x in read_jsonl(record / "rows.jsonl")] == INTERLEAVED[:2]
    assert [x["record_dir"] for x in adm.may_screen(a)["retry_of"]] == [str(record)]

    retry, _ = scr.admitted_screen(a.id, runs, root=root, log=io.StringIO())
    assert retry.verdict == "timing_miss"
    (verdict,) = adm.verdicts(a)
    assert verdict["retry_of"] == [str(record)] and verdict["record_dir"] == str(retry.record_dir)
    assert retry.result["retry_of"][0]["status"] == "unfinished"
    assert "started, not finished" in (retry.record_dir / "report.md").read_text()
    # A verdict settles it: the one repair after it retries nothing.
    repair, _ = scr.admitted_screen(a.id, runs, root=root, repair="a fix", log=io.StringIO())
    assert repair.result["retry_of"] == [] and adm.verdicts(a)[1]["retry_of"] == []
