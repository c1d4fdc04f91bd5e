"""The competence test: DEV evaluation, compare of arms, intermittent's budget, alignment, oracle, heldout."""

from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch

from creditlab import cli, config
from creditlab.experiments.compare import CompareRun, gap_closed
from creditlab.experiments.arms import parse_arms
from creditlab.experiments.experiment import Experiment
from creditlab.data.ledger import entries
from creditlab.evaluate import Evaluator
from creditlab.model import GPT
from creditlab import runtime as rt
from creditlab.train import Trainer
from tests.test_train import ListLoader, randomize
from tests.tiny_corpus import VOCAB, prepare_corpus

CPU = ["train.device=cpu", "train.compile=off"]
SMALL = [f"model.vocab_size={VOCAB}", "train.warmup=0", "model.seq_len=32", "model.layers=2", "model.value_embeds=1",
         "train.micro_batch=4", "train.grad_accum=2", "train.warmup=0"] + CPU
NO_BUDGETS = ["compare.native_budgets="]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    return prepare_corpus(root / "corpus", root / "data")


def shards(data_dir) -> list[str]:
    return ["data.source=shards", f"data.dir={data_dir}"]


@pytest.mark.slow
def test_tiny_compare_end_to_end(corpus, tmp_path):
    out = tmp_path / "cmp"
    overrides = SMALL + shards(corpus) + ["train.updates=8", "train.eval_every=4", "train.eval_tokens=256",
                                         "compare.align_every=4", "compare.native_budgets=0.5,1.0"]
    argv = ["compare", "--preset", "tiny", "--arms", "native,zero,learned,intermittent", "--seeds", "1,2",
            "--out", str(out), "--no-progress"] + [a for o in overrides for a in ("--set", o)]
    assert cli.main(argv) == 0
    result = json.loads((out / "compare.json").read_text())
    assert set(result["summary"]) == {"native", "zero", "learned", "intermittent", "native@train.updates=4",
                                      "zero@credit.schedule=fixed:4"}
    for name in ("report.md", "verdict.png", "dev_minus_native.png", "fit_quality.png", "alignment.png"):
        assert (out / name).stat().st_size > 0
    s = result["summary"]
    assert s["native"]["gap_closed_zero"]["values"] == [1.0, 1.0] and s["zero"]["gap_closed_zero"]["values"] == [0.0, 0.0]
    for seed in ("1", "2"):
        run = result["runs"]["learned"][seed]
        assert run["updates"] == 8 and run["kinds"] == {"teacher": 2, "synthetic": 6}
        assert run["dev_bits_per_byte"] > 0 and run["final_fit"] is not None
        # Arms of one seed start from the same model: the same DEV loss before any update.
        first = [json.loads((out / f"{arm}-seed{seed}" / "eval.jsonl").read_text().splitlines()[0])
                 for arm in ("native", "zero", "learned", "intermittent")]
        assert len({row["loss"] for row in first}) == 1 and {row["update"] for row in first} == {0}
        # Intermittent: the updates the reference's GPU-seconds buy at native's speed, schedule decayed in them.
        d = result["intermittent"][seed]
        assert d["updates"] == max(1, math.floor(d["reference_gpu_seconds"] / d["native_median_seconds"]))
        rows = [json.loads(line) for line in (out / f"intermittent-seed{seed}" / "rows.jsonl").read_text().splitlines()]
        assert len(rows) == d["updates"] == result["runs"]["intermittent"][seed]["updates"]
        cfg = config.Config.from_dict(json.loads((out / f"intermittent-seed{seed}" / "config.json").read_text()))
        cooldown = round(cfg.train.cooldown_frac * d["updates"])
        assert rows[-1]["lr_scale"] == pytest.approx(1 / cooldown)  # one step before zero: fully decayed
        aligned = [r for r in rows if r["align"]]
        assert aligned and all(abs(r["align"]["trunk"]["cosine"] - 1) < 1e-5 for r in aligned)
        # intermittent is a point of native's curve too
        assert len(result["native_curve"][seed]["gpu_seconds"]) == 3
    learned_aligned = [json.loads(line) for line in (out / "learned-seed1" / "rows.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in learned_aligned if r["align"]] == ["synthetic", "synthetic"]
    purposes = [e["purpose"] for e in entries(corpus) if e["split"] == "dev"]
    assert sum("compare cmp: arm learned," in p for p in purposes) == 2  # one DEV read per arm and seed
    report = (out / "report.md").read_text()
    assert "Timed on a CPU" in report and "speedup" in report and "| learned |" in report


def test_gap_closed_arithmetic():
    assert gap_closed(5.0, 5.0, 4.0) == 0.0 and gap_closed(5.0, 4.0, 4.0) == 1.0
    assert gap_closed(5.0, 4.5, 4.0) == pytest.approx(0.5) and gap_closed(5.0, 5.5, 4.0) == pytest.approx(-0.5)
    assert gap_closed(None, 4.5, 4.0) is None and gap_closed(4.0, 4.5, 4.0) is None


def test_intermittent_budget_arithmetic(tmp_path):
    run = CompareRun(Experiment("tiny", ["native", "learned", "intermittent"], [7], overrides=SMALL + NO_BUDGETS),
                     tmp_path / "x")
    run.runs = {"native": {"7": {"median_seconds_by_kind": {"native": 0.3}}},
                "learned": {"7": {"gpu_seconds": 10.0, "updates": 32, "kinds": {"teacher": 8, "synthetic": 24},
                                  "median_seconds_by_kind": {"teacher": 0.35, "synthetic": 0.3}}}}
    budget = run.intermittent_budget(parse_arms("intermittent")[0], "7")
    assert budget["updates"] == 33  # floor(10.0 / 0.3)
    assert "floor(10.000 / 0.3000) = 33" in budget["derivation"] and "8 teacher x 0.3500 s" in budget["derivation"]


@pytest.mark.parametrize("argv, message", [
    (["--arms", "native,learned", "--seeds", "a,b"], "--seeds"),
    (["--arms", "native,telepathy"], "unknown arm"),
    (["--arms", "learned,intermittent", "--set", "compare.native_budgets="], "intermittent needs the arms native"),
    (["--arms", "native,native"], "given twice"),
    (["--arms", "native,learned@credit.schedule=often"], "unknown schedule 'often'"),
])
def test_compare_refuses_bad_input_with_one_line(argv, message, tmp_path, capsys):
    code = cli.main(["compare", "--preset", "tiny", "--out", str(tmp_path / "c"), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "c").exists()


def test_compare_under_torchrun_is_refused_before_joining_a_process_group(tmp_path, capsys, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it; no group can be joined here, none must be
    code = cli.main(["compare", "--preset", "tiny", "--arms", "native", "--out", str(tmp_path / "c")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "without torchrun" in err and len(err.splitlines()) == 1
    assert not dist.is_initialized() and not (tmp_path / "c").exists()


def test_an_arms_override_may_hold_commas_before_digits():
    specs = parse_arms("native,learned@credit.schedule=warmup:20,4,zero@credit.schedule=fixed:4,learned")
    assert [s.label for s in specs] == ["native", "learned@credit.schedule=warmup:20,4",
                                        "zero@credit.schedule=fixed:4", "learned"]
    assert specs[1].overrides[-1] == "credit.schedule=warmup:20,4"


def test_compare_refuses_an_existing_folder(tmp_path, capsys):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "compare.json").write_text("{}")
    assert cli.main(["compare", "--preset", "tiny", "--arms", "native", "--out", str(tmp_path / "c")]) == 2
    assert "append-only" in capsys.readouterr().err


def _trainer(source: str, batches, extra=()) -> Trainer:
    cfg = config.load("tiny", SMALL + ["train.dtype=float64", f"credit.source={source}", "train.updates=3",
                                       *extra])
    torch.manual_seed(0)
    model = randomize(GPT(cfg.model).double(), seed=1)
    return Trainer(cfg, model=model, loader=ListLoader(batches))


def _batches(n: int = 6):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (4, 33), generator=g) for _ in range(n)]


def test_oracle_trains_as_native_in_float64():
    batches = _batches()
    runs = {name: _trainer(name, batches) for name in ("exact", "oracle", "zero")}
    rows = {name: [t.train_update() for _ in range(3)] for name, t in runs.items()}
    losses = {name: [r.loss for r in rs] for name, rs in rows.items()}
    params = {name: torch.cat([p.flatten() for p in t.model.parameters()]) for name, t in runs.items()}
    assert [r.kind for r in rows["oracle"]] == ["synthetic"] * 3  # it runs the synthetic backward
    rel = (params["oracle"] - params["exact"]).norm() / params["exact"].norm()
    assert rel < 1e-10 and losses["oracle"] == pytest.approx(losses["exact"], rel=1e-12)
    assert (params["zero"] - params["exact"]).norm() / params["exact"].norm() > 1e-4  # the check can fail


def test_alignment_of_exact_is_one_of_zero_below_one_and_changes_nothing():
    batches = _batches()
    exact = _trainer("exact", batches).train_update(align=True).align
    assert all(abs(v["cosine"] - 1) < 1e-12 and abs(v["norm_ratio"] - 1) < 1e-12 for v in exact.values())
    assert {"trunk", "attn.qkv", "mlp.fc", "embed", "scalars"} <= set(exact)
    zero = _trainer("zero", batches).train_update(align=True).align
    assert zero["trunk"]["cosine"] < 0.9999 and zero["attn.qkv"]["cosine"] < 0.9999
    # The alignment pass changes no training state: with and without it, the same parameters after 3 updates.
    with_align, without = _trainer("learned", batches), _trainer("learned", batches)
    for _ in range(3):
        with_align.train_update(align=True)
        without.train_update()
    for (name, a), b in zip(with_align.model.named_parameters(), without.model.parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(with_align.source.parameters(), without.source.parameters()):
        assert torch.equal(a, b)


def test_eval_loss_is_the_training_loss_forward_only(corpus):
    cfg = config.load("tiny", SMALL + shards(corpus) + ["train.dtype=float64", "train.eval_tokens=300"])
    runtime = rt.resolve(cfg.train)
    model = randomize(GPT(cfg.model).double(), seed=2)
    ev = Evaluator(cfg, runtime, purpose="test: forward-only loss against the training loss")
    assert ev.tokens == 3 * 4 * 32  # ceil(300 / 128) micro-batches of 4 x 32
    row = ev(model, 0)
    with torch.no_grad():
        train_losses = [model(b[:, :-1], b[:, 1:], loss_chunk=cfg.train.loss_chunk).item() for b in ev.batches]
    assert row.loss == pytest.approx(sum(train_losses) / len(train_losses), rel=1e-12)
    m = json.loads((corpus / "manifest.json").read_text())["splits"]["dev"]
    assert row.bits_per_byte == pytest.approx(row.loss / math.log(2) * m["tokens"] / m["bytes"], rel=1e-12)
    assert entries(corpus)[-1]["purpose"] == "test: forward-only loss against the training loss"


def test_train_writes_eval_rows_and_heldout_is_read_once(corpus, tmp_path, capsys):
    runs = tmp_path / "runs"
    sets = SMALL + shards(corpus) + ["train.updates=4", "train.eval_every=2", "train.eval_tokens=128",
                                     f"train.out_dir={runs}"]
    argv = [a for o in sets for a in ("--set", o)]
    assert cli.main(["train", "--preset", "tiny", "--no-progress", *argv]) == 0
    run = next(runs.glob("*-train-*"))
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["update"] for e in evals] == [0, 2, 4] and all(e["bits_per_byte"] > 0 for e in evals)
    capsys.readouterr()
    assert cli.main(["heldout", str(run), "--admission", "0" * 16, "--out-dir", str(runs)]) == 2
    assert "no admission" in capsys.readouterr().err  # the admission must exist
    assert cli.main(["admit", "--preset", "tiny", "--json", *argv]) == 0
    admission = json.loads(capsys.readouterr().out)["admission"]
    assert cli.main(["heldout", str(run), "--admission", admission, "--out-dir", str(runs), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["split"] == "final_heldout" and first["loss"] > 0 and first["bits_per_byte"] > 0
    assert list(first["models"]) == [run.name]
    assert cli.main(["heldout", str(run), "--admission", admission, "--out-dir", str(runs)]) == 2
    err = capsys.readouterr().err
    assert "already read under admission" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow  # separate processes, each compiling
def test_merge_joins_seeds_run_in_separate_processes(corpus, tmp_path, capsys):
    sets = SMALL + shards(corpus) + NO_BUDGETS + ["train.updates=3", "train.eval_tokens=128"]
    argv = [a for o in sets for a in ("--set", o)]
    for seed in (1, 2):
        assert cli.main(["compare", "--preset", "tiny", "--arms", "native,zero", "--seeds", str(seed),
                         "--out", str(tmp_path / f"s{seed}"), "--no-progress", *argv]) == 0
    assert cli.main(["compare", "--merge", str(tmp_path / "s1"), str(tmp_path / "s2"),
                     "--out", str(tmp_path / "both")]) == 0
    merged = json.loads((tmp_path / "both" / "compare.json").read_text())
    singles = [json.loads((tmp_path / f"s{s}" / "compare.json").read_text()) for s in (1, 2)]
    assert merged["seeds"] == [1, 2]
    assert merged["summary"]["zero"]["dev_loss"]["values"] == [r["runs"]["zero"][str(s)]["dev_loss"]
                                                               for r, s in zip(singles, (1, 2))]
    assert merged["summary"]["zero"]["vs_native"]["n"] == 2  # paired over both seeds now
    assert "Merged from" in (tmp_path / "both" / "report.md").read_text()
    # FINAL_HELDOUT of a comparison: every model of both seeds in one read (one ledger entry).
    capsys.readouterr()
    assert cli.main(["admit", "--preset", "tiny", "--json", "--set", f"train.out_dir={tmp_path}", *argv]) == 0
    admission = json.loads(capsys.readouterr().out)["admission"]
    before = len(entries(corpus))
    assert cli.main(["heldout", str(tmp_path / "both"), "--admission", admission, "--out-dir", str(tmp_path),
                     "--json"]) == 0
    held = json.loads(capsys.readouterr().out)
    assert sorted(held["models"]) == ["native-seed1", "native-seed2", "zero-seed1", "zero-seed2"]
    assert len(entries(corpus)) == before + 1
    capsys.readouterr()
    # A seed whose record folders are gone (kept as its compare.json only) still merges: its numbers in the
    # tables, its curves left out of the figures, and the report says so.
    import shutil
    shutil.copytree(tmp_path / "s2", tmp_path / "s2_numbers_only", ignore=shutil.ignore_patterns("*-seed2"))
    assert cli.main(["compare", "--merge", str(tmp_path / "s1"), str(tmp_path / "s2_numbers_only"),
                     "--out", str(tmp_path / "numbers_only")]) == 0
    report = (tmp_path / "numbers_only" / "report.md").read_text()
    assert "leave out 2 arm run records that were not found" in report and "zero-seed2" in report
    assert (tmp_path / "numbers_only" / "verdict.png").exists()
    # The same seed twice is refused.
    assert cli.main(["compare", "--merge", str(tmp_path / "s1"), str(tmp_path / "s1"),
                     "--out", str(tmp_path / "again")]) == 2
    assert "in two of the folders" in capsys.readouterr().err


def test_steady_seconds_leave_out_each_kinds_first_update():
    from creditlab.experiments.compare import kind_medians
    rows = [{"kind": "teacher", "seconds": 40.0}, {"kind": "synthetic", "seconds": 15.0}] + \
        [{"kind": k, "seconds": s} for k, s in [("synthetic", 0.04), ("synthetic", 0.05), ("teacher", 0.06),
                                                 ("teacher", 0.07)]]
    assert kind_medians(rows) == {"synthetic": 0.045, "teacher": 0.065}  # compilation (40 s, 15 s) left out
    assert kind_medians(rows[:3]) == {"teacher": 40.0, "synthetic": pytest.approx(7.52)}  # too few to leave out


def _fake_compare(folder, seed: int, overrides: list[str], device: str = "cpu"):
    """A compare folder's compare.json with one arm at one seed: what merge reads."""
    numbers = {k: 1.0 for k in ("dev_loss", "dev_bits_per_byte", "train_loss_last10pct", "seconds_per_update",
                                "gpu_seconds", "peak_allocated_mib", "updates")}
    folder.mkdir()
    role = {"added": None, "floor": None, "floor_note": "", "budget": None, "floor_of": []}
    (folder / "compare.json").write_text(json.dumps({
        "format": "creditlab-compare/2", "preset": "tiny", "overrides": overrides, "tokens_per_update": 8,
        "eval": {"tokens": 8, "every": 0}, "seeds": [seed], "runs_keys": [str(seed)], "device": device,
        "timing_on_cpu": True, "arms": [{"label": "zero", "arm": "zero", "role": role}], "intermittent": {},
        "wall_seconds": 1.0, "runs": {"zero": {str(seed): numbers | {"record": f"zero-seed{seed}"}}}}))
    return folder


def test_merge_ignores_cosmetic_overrides_and_refuses_the_rest(tmp_path):
    from creditlab.experiments.compare import merge

    a = _fake_compare(tmp_path / "a", 1, ["train.updates=3", "train.warmup=0"])
    b = _fake_compare(tmp_path / "b", 2, ["train.updates=3", "train.warmup=0", "train.keep_checkpoints=0",
                                          "train.log_every=5"])
    assert merge([a, b], tmp_path / "ab")["seeds"] == [1, 2]
    c = _fake_compare(tmp_path / "c", 3, ["train.updates=4", "train.warmup=0"])
    with pytest.raises(config.ConfigError, match=r"its settings differ .*\(train.updates\)"):
        merge([a, c], tmp_path / "ac")
    d = _fake_compare(tmp_path / "d", 4, ["train.updates=3", "train.warmup=0"], device="NVIDIA H200")
    with pytest.raises(config.UserError, match="different devices"):
        merge([a, d], tmp_path / "ad")


# ---- the verdict instrument: floors, native's budgets, speedups, resume -------------------------------------

SYNTH = SMALL + ["train.eval_tokens=256"]


@pytest.fixture
def fixed_seconds(monkeypatch):
    """Every timed region takes 0.1 s: GPU-seconds become a count of updates, so the numbers that depend on
    them (costs, intermittent's budget, speedups) are as deterministic on the CPU as the losses."""
    from creditlab import runtime as rt

    def exit_(self, *exc):
        self.seconds = 0.1
    monkeypatch.setattr(rt.Timer, "__exit__", exit_)


def _compare(out, arms: str, seeds: str = "1,2", sets=(), **kw) -> int:
    argv = ["compare", "--preset", "tiny", "--arms", arms, "--seeds", seeds, "--out", str(out), "--no-progress"]
    return cli.main(argv + [a for o in [*SYNTH, *sets] for a in ("--set", o)], **kw)


def _result(out) -> dict:
    return json.loads((out / "compare.json").read_text())


def test_the_fair_floor_is_added_reported_and_has_the_arms_exact_updates(tmp_path):
    assert _compare(tmp_path / "c", "native,learned", sets=[*NO_BUDGETS, "train.updates=8"]) == 0
    r = _result(tmp_path / "c")
    floor = "zero@credit.schedule=fixed:4"
    assert [a["label"] for a in r["arms"]] == ["native", "learned", floor]
    assert r["arms"][2]["role"]["added"] == "floor" and r["arms"][2]["role"]["floor_of"] == ["learned"]
    s = r["summary"]["learned"]
    assert s["floor"] == floor
    per_seed = [r["runs"][floor][k]["dev_loss"] - r["runs"]["learned"][k]["dev_loss"] for k in ("1", "2")]
    assert s["prediction_adds"]["values"] == pytest.approx(per_seed)
    native = [r["runs"]["native"][k]["dev_loss"] for k in ("1", "2")]
    assert s["gap_closed_floor"]["values"] == pytest.approx(
        [p / (r["runs"][floor][k]["dev_loss"] - n) for p, k, n in zip(per_seed, ("1", "2"), native)])
    # the floor's exact updates are the arm's teacher updates: native where learned is teacher
    kinds = {arm: [json.loads(x)["kind"] for x in (tmp_path / "c" / f"{name}-seed1" / "rows.jsonl").open()]
             for arm, name in (("learned", "learned"), ("floor", "zero+credit.schedule-fixed:4"))}
    assert [k == "teacher" for k in kinds["learned"]] == [k == "native" for k in kinds["floor"]]
    assert kinds["floor"].count("native") == 2
    report = (tmp_path / "c" / "report.md").read_text()
    assert "prediction adds" in report and f"| {floor} (floor) |" in report
    # without floors: no zero arm added, and no prediction_adds
    assert _compare(tmp_path / "n", "native,learned", seeds="1", sets=[*NO_BUDGETS, "train.updates=4",
                                                                       "compare.floors=false"]) == 0
    assert set(_result(tmp_path / "n")["summary"]) == {"native", "learned"}
    assert _result(tmp_path / "n")["summary"]["learned"]["floor"] is None


def test_native_budgets_forked_from_the_longest_equal_separate_runs(tmp_path):
    sets = ["train.updates=8", "train.eval_every=2", "compare.native_budgets=0.5,1.0,1.5"]
    assert _compare(tmp_path / "fork", "native", seeds="1", sets=sets) == 0
    apart = CompareRun(Experiment("tiny", ["native"], [1], overrides=[*SYNTH, *sets]), tmp_path / "apart",
                       progress=False, fork_budgets=False)  # every budget from its start: the control
    apart.check()
    apart.start()
    apart.run()
    fork, apart = _result(tmp_path / "fork"), _result(tmp_path / "apart")
    assert set(fork["runs"]) == {"native", "native@train.updates=4", "native@train.updates=12"}
    assert fork["runs"]["native"]["1"]["forked_from"] == {"label": "native@train.updates=12", "updates": 6}
    assert "forked_from" not in apart["runs"]["native"]["1"]
    for label in fork["runs"]:
        folder = label.replace("@", "+").replace("=", "-") + "-seed1"
        losses = {name: [json.loads(x)["loss"] for x in (tmp_path / name / folder / "rows.jsonl").open()]
                  for name in ("fork", "apart")}
        evals = {name: [(json.loads(x)["update"], json.loads(x)["loss"])
                        for x in (tmp_path / name / folder / "eval.jsonl").open()] for name in ("fork", "apart")}
        assert losses["fork"] == losses["apart"] and evals["fork"] == evals["apart"], label
        assert fork["runs"][label]["1"]["dev_loss"] == apart["runs"][label]["1"]["dev_loss"]
    # the control: a budget's own cooldown changes its run, so a fork taken too late would differ
    assert fork["runs"]["native@train.updates=4"]["1"]["dev_loss"] != fork["runs"]["native"]["1"]["dev_loss"]


def test_speedup_of_native_is_one_and_of_a_handicapped_native_below_one(tmp_path, fixed_seconds):
    from creditlab.experiments import verdict as vd
    from creditlab.experiments.compare import judged

    handicapped = "native@train.lr_muon=0.005@train.lr_embed=0.0125@train.lr_head=0.0025@train.lr_scalar=0.005"
    copy = "native@train.log_every=3"  # the same computation under another label
    assert _compare(tmp_path / "c", f"native,{copy},{handicapped}", seeds="1,2,3", sets=["train.updates=16"]) == 0
    r = _result(tmp_path / "c")
    assert r["timing_on_cpu"] and r["summary"][copy]["speedup"]["verdict"] is None  # no verdict word on a CPU
    on_gpu = judged({k: v for k, v in r.items() if k not in ("summary", "native_curve")} | {"timing_on_cpu": False})
    same = on_gpu["summary"][copy]["speedup"]
    assert same["interval"]["low"] <= 1.0 <= same["interval"]["high"] and same["interval"]["mean"] == pytest.approx(1)
    worse = on_gpu["summary"][handicapped]["speedup"]
    assert worse["interval"]["high"] < 1.0 and worse["verdict"] == vd.DOES_NOT_PAY
    assert all(r["summary"][handicapped]["vs_native"]["values"][i] > 0 for i in range(3))


def _stop_after(monkeypatch, steps: int, hard: bool = False):
    """Send this process SIGINT at the comparison's `steps`-th update (the handler compare installs takes it, as it
    takes a user's Ctrl-C), or, `hard`, stop it at once there as a second Ctrl-C does."""
    import os
    import signal

    from creditlab.experiments import compare as compare_mod

    calls = {"n": 0}
    original = compare_mod.ArmRun.step

    def step(self, say):
        calls["n"] += 1
        if calls["n"] == steps:
            if hard:
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, say)
    monkeypatch.setattr(compare_mod.ArmRun, "step", step)
    return calls


RESUMABLE = ["train.updates=8", "train.eval_every=2", "compare.native_budgets=0.5,1.0"]


@pytest.mark.parametrize("hard", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sigint", "at_once"])
def test_an_interrupted_comparison_resumes_to_the_numbers_of_an_uninterrupted_one(tmp_path, fixed_seconds, monkeypatch,
                                                                                  capsys, hard):
    arms = "native,learned,intermittent"
    assert _compare(tmp_path / "whole", arms, sets=RESUMABLE) == 0
    # seed 1's round 3 (0-based), where native@train.updates=4 has forked from native (after 3 updates) and ends
    capsys.readouterr()
    with monkeypatch.context() as patched:
        _stop_after(patched, 10, hard=hard)
        assert _compare(tmp_path / "cut", arms, sets=RESUMABLE) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("creditlab: compare stopped")
    assert err.endswith(f"go on with: creditlab compare --resume {tmp_path / 'cut'}")
    if hard:  # the states of the last evaluation (update 2); the fork made after it is made again
        assert "kept 0 finished arm runs, 3 unfinished saved at update 2, 1 to run again from its start" in err
    else:  # the round ends, every arm saved where it stands
        assert "(SIGINT): kept 1 finished arm run, 3 unfinished saved at update 4;" in err
    assert not (tmp_path / "cut" / "compare.json").exists()
    assert cli.main(["compare", "--resume", str(tmp_path / "cut"), "--no-progress"]) == 0
    whole, cut = _result(tmp_path / "whole"), _result(tmp_path / "cut")
    for key in ("runs", "summary", "native_curve", "intermittent"):
        assert _without_records(cut[key]) == _without_records(whole[key]), key
    # stopped at once, the updates after the last saved state are done again: appended, and read as the later
    # rows; stopped by the signal, nothing is done twice
    rows = [json.loads(x)["update"] for x in (tmp_path / "cut" / "learned-seed1" / "rows.jsonl").open()]
    if hard:
        assert len(rows) > 8 and rows[:2] == [0, 1] and rows[-6:] == [2, 3, 4, 5, 6, 7]
    else:
        assert rows == list(range(8))
    # a finished comparison is not resumed
    assert cli.main(["compare", "--resume", str(tmp_path / "cut")]) == 2
    assert "has finished" in capsys.readouterr().err


def test_a_comparison_that_drops_finished_checkpoints_resumes_and_keeps_every_final_model(tmp_path, monkeypatch,
                                                                                       capsys):
    sets = [*RESUMABLE, "train.drop_finished_checkpoints=true"]
    with monkeypatch.context() as patched:
        _stop_after(patched, 10)  # one arm run finished, three saved where they stand
        assert _compare(tmp_path / "c", "native,zero", seeds="1", sets=sets) == 130
    runs = [p for p in (tmp_path / "c").iterdir() if p.is_dir() and (p / "config.json").exists()]
    finished = [p for p in runs if (p / "result.json").exists()]
    assert len(finished) == 1 and not list(finished[0].glob("checkpoint_*.pt"))
    assert all(list(p.glob("checkpoint_*.pt")) for p in runs if p not in finished)  # what a resume needs
    assert cli.main(["compare", "--resume", str(tmp_path / "c"), "--no-progress"]) == 0
    assert runs and all((p / "model.pt").exists() and not list(p.glob("checkpoint_*.pt")) for p in runs)


def _without_records(value):
    if isinstance(value, dict):
        return {k: _without_records(v) for k, v in value.items() if k not in ("record", "measured_seconds")}
    if isinstance(value, list):
        return [_without_records(v) for v in value]
    return value


def test_a_partial_report_and_a_refused_out_say_what_there_is(tmp_path, fixed_seconds, monkeypatch, capsys):
    with monkeypatch.context() as patched:
        _stop_after(patched, 10)
        assert _compare(tmp_path / "c", "native,zero", sets=[*NO_BUDGETS, "train.updates=4"]) == 130
    capsys.readouterr()
    assert cli.main(["compare", "--report", str(tmp_path / "c")]) == 0  # seed 1 finished, seed 2 did not
    partial = json.loads((tmp_path / "c" / "report-1" / "compare.json").read_text())
    assert partial["partial"] and sorted(partial["unfinished"]) == ["native-seed2", "zero-seed2"]
    assert "**Partial**" in (tmp_path / "c" / "report-1" / "report.md").read_text()
    capsys.readouterr()
    assert _compare(tmp_path / "c", "native,zero") == 2  # the same --out again: say why, and what to do
    err = capsys.readouterr().err
    assert "holds a comparison already" in err and f"creditlab compare --resume {tmp_path / 'c'}" in err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert _compare(tmp_path / "other", "native") == 2
    assert "not empty" in capsys.readouterr().err and (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_labels_say_equal_updates_only_where_they_are(tmp_path):
    from creditlab.experiments.compare import verdicts

    assert _compare(tmp_path / "c", "native,zero,zero@train.updates=3", seeds="1",
                    sets=[*NO_BUDGETS, "train.updates=4", "compare.floors=false"]) == 0
    lines = {line.split(":")[0]: line for line in verdicts(_result(tmp_path / "c"))}
    assert "at equal updates" in lines["zero"]
    assert "at equal updates" not in lines["zero@train.updates=3"] and "3 updates against native's" in \
        lines["zero@train.updates=3"]
    assert "one seed: no interval" in "\n".join(lines.values())


def test_repeats_of_a_seed_measure_run_to_run_noise(tmp_path):
    assert _compare(tmp_path / "c", "native,zero", seeds="1,2", sets=[*NO_BUDGETS, "train.updates=2"],
                    ) == 0 or True
    assert cli.main(["compare", "--preset", "tiny", "--arms", "native,zero", "--seeds", "1,2", "--repeat", "2",
                     "--out", str(tmp_path / "r"), "--no-progress"]
                    + [a for o in [*SYNTH, *NO_BUDGETS, "train.updates=2"] for a in ("--set", o)]) == 0
    r = _result(tmp_path / "r")
    assert r["runs_keys"] == ["1", "1r2", "2", "2r2"] and (tmp_path / "r" / "zero-seed1r2" / "rows.jsonl").exists()
    noise = r["summary"]["zero"]["noise"]["dev_loss"]
    assert noise["run_to_run_sd"] == 0.0 and noise["run_to_run_dof"] == 2  # the CPU is deterministic
    assert noise["seed_to_seed_sd"] > 0 and r["summary"]["zero"]["dev_loss"]["n"] == 2  # seeds, not runs
    assert "Run-to-run noise" in (tmp_path / "r" / "report.md").read_text()


def test_the_experiment_file_round_trips_and_runs_as_the_flags_do(tmp_path):
    from creditlab.experiments import experiment

    exp = Experiment("tiny", ["native", "learned@credit.schedule=warmup:2,4"], [3, 4], repeat=2,
                     overrides=["train.updates=3", "train.warmup=0", "compare.floors=false", "train.lr_muon=0.02",
                                "data.dir=my data/x\"y"], out="runs/x")
    (tmp_path / "e.toml").write_text(exp.to_toml())
    loaded = experiment.load(tmp_path / "e.toml")  # grouped by section: the same overrides, the same config
    assert sorted(loaded.overrides) == sorted(exp.overrides) and loaded.arms == exp.arms
    assert (loaded.preset, loaded.seeds, loaded.repeat, loaded.out) == ("tiny", [3, 4], 2, "runs/x")
    assert config.load("tiny", loaded.overrides).to_dict() == config.load("tiny", exp.overrides).to_dict()
    assert 'native_budgets = "0.7,0.85,1.0,1.15"' in Experiment(overrides=["compare.native_budgets=0.7,0.85,1.0,1.15"]
                                                               ).to_toml()
    (tmp_path / "run.toml").write_text(Experiment("tiny", ["native", "zero"], [1], overrides=SYNTH + NO_BUDGETS + [
        "train.updates=2"]).to_toml())
    assert cli.main(["compare", str(tmp_path / "run.toml"), "--out", str(tmp_path / "from_file"), "--no-progress"]) == 0
    assert (tmp_path / "from_file" / "experiment-file.toml").read_bytes() == (tmp_path / "run.toml").read_bytes()
    assert _compare(tmp_path / "from_flags", "native,zero", seeds="1", sets=[*NO_BUDGETS, "train.updates=2"]) == 0
    plans = [json.loads((tmp_path / f / "plan.json").read_text()) for f in ("from_file", "from_flags")]
    assert plans[0] == plans[1]
    recorded = experiment.load(tmp_path / "from_flags" / "experiment.toml")
    assert recorded.arms == ["native", "zero"] and recorded.seeds == [1] and "train.updates=2" in recorded.overrides
    for bad, message in (('arms = "native"\nbogus = 1\n', "unknown key 'bogus'"),
                         ('arms = ["native"]\n[nonsense]\nx = 1\n', "unknown section [nonsense]"),
                         ("arms = [\n", "not a TOML experiment file")):
        (tmp_path / "bad.toml").write_text(bad)
        with pytest.raises(config.ConfigError, match=message.replace("[", r"\[")):
            experiment.load(tmp_path / "bad.toml")


def test_wandb_logs_every_row_and_evaluation_when_asked(tmp_path, monkeypatch, capsys):
    import sys
    import types

    logged, inits = [], []

    class Run:
        def log(self, values, step):
            logged.append((step, values))

        def finish(self):
            logged.append(("finish", None))

    fake = types.SimpleNamespace(init=lambda **kw: inits.append(kw) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    assert cli.main(["compare", "--preset", "tiny", "--arms", "native", "--seeds", "1", "--out", str(tmp_path / "c"),
                     "--wandb", "proj", "--no-progress"]
                    + [a for o in [*SYNTH, *NO_BUDGETS, "train.updates=2"] for a in ("--set", o)]) == 0
    assert inits[0]["project"] == "proj" and inits[0]["mode"] == "offline" and inits[0]["group"] == "c"
    assert [s for s, v in logged if v and "train/loss" in v] == [1, 2]
    assert [s for s, v in logged if v and "dev/loss" in v] == [0, 2] and logged[-1] == ("finish", None)
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed: refused before anything runs
    capsys.readouterr()
    assert cli.main(["compare", "--preset", "tiny", "--arms", "native", "--out", str(tmp_path / "d"),
                     "--wandb", "proj"]) == 2
    assert "pip install wandb" in capsys.readouterr().err and not (tmp_path / "d").exists()


@pytest.mark.parametrize("path", sorted((pathlib.Path(__file__).parent.parent / "experiments").glob("*.toml")),
                         ids=lambda p: p.name)
def test_every_committed_experiment_file_resolves_to_valid_arms(path):
    """A study file that fails only on the GPU machine costs a call: each one loads, and every arm it runs (with
    the floors and native budgets the comparison adds) is a valid config at its preset."""
    from creditlab.experiments import experiment
    from creditlab.experiments.arms import arm_config, resolve_arms

    exp = experiment.load(path)
    exp.check()
    base = config.load(exp.preset, exp.overrides)
    specs, roles = resolve_arms(parse_arms(",".join(exp.arms)), exp.preset, exp.overrides, base.compare.floors,
                                config.parse_budgets(base.compare.native_budgets))
    assert len(specs) >= len(exp.arms)
    for spec in specs:
        config.validate(arm_config(exp.preset, exp.overrides, spec, exp.seeds[0]))
