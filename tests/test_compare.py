"""The competence test: DEV evaluation, compare of arms, intermittent's budget, alignment, oracle, heldout."""

from __future__ import annotations

import json
import math

import pytest
import torch

from creditlab import cli, config
from creditlab.compare import CompareRun, gap_closed
from creditlab.arms import parse_arms
from creditlab.data.ledger import entries
from creditlab.evaluate import Evaluator
from creditlab.model import GPT
from creditlab import runtime as rt
from creditlab.train import Trainer
from tests.test_train import ListLoader, randomize
from tests.tiny_corpus import VOCAB, prepare_corpus

CPU = ["train.device=cpu", "train.compile=off"]
SMALL = [f"model.vocab_size={VOCAB}", "model.seq_len=32", "model.layers=2", "model.value_embeds=1",
         "train.micro_batch=4", "train.grad_accum=2", "train.warmup=0"] + CPU


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
                                         "compare.align_every=4"]
    argv = ["compare", "--preset", "tiny", "--arms", "native,zero,learned,intermittent", "--seeds", "1,2",
            "--out", str(out), "--no-progress"] + [a for o in overrides for a in ("--set", o)]
    assert cli.main(argv) == 0
    result = json.loads((out / "compare.json").read_text())
    assert set(result["summary"]) == {"native", "zero", "learned", "intermittent"}
    for name in ("report.md", "dev_vs_updates.png", "dev_vs_gpu_seconds.png", "fit_quality.png", "alignment.png"):
        assert (out / name).stat().st_size > 0
    s = result["summary"]
    assert s["native"]["gap_closed"]["values"] == [1.0, 1.0] and s["zero"]["gap_closed"]["values"] == [0.0, 0.0]
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
    learned_aligned = [json.loads(line) for line in (out / "learned-seed1" / "rows.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in learned_aligned if r["align"]] == ["synthetic", "synthetic"]
    purposes = [e["purpose"] for e in entries(corpus) if e["split"] == "dev"]
    assert sum("compare cmp: arm learned" in p for p in purposes) == 2  # one DEV read per arm and seed
    assert "beyond the seed spread" in (out / "report.md").read_text() or \
        "within the seed spread" in (out / "report.md").read_text()


def test_gap_closed_arithmetic():
    assert gap_closed(5.0, 5.0, 4.0) == 0.0 and gap_closed(5.0, 4.0, 4.0) == 1.0
    assert gap_closed(5.0, 4.5, 4.0) == pytest.approx(0.5) and gap_closed(5.0, 5.5, 4.0) == pytest.approx(-0.5)
    assert gap_closed(None, 4.5, 4.0) is None and gap_closed(4.0, 4.5, 4.0) is None


def test_intermittent_budget_arithmetic(tmp_path):
    run = CompareRun("tiny", SMALL, parse_arms("native,learned,intermittent"), [7], tmp_path / "x")
    run.runs = {"native": {7: {"median_seconds_by_kind": {"native": 0.3}}},
                "learned": {7: {"gpu_seconds": 10.0, "updates": 32, "kinds": {"teacher": 8, "synthetic": 24},
                                "median_seconds_by_kind": {"teacher": 0.35, "synthetic": 0.3}}}}
    base = config.load("tiny", SMALL)
    assert run.intermittent_updates(parse_arms("intermittent")[0], 7, base) == 33  # floor(10.0 / 0.3)
    d = run.intermittent[7]
    assert "floor(10.000 / 0.3000) = 33" in d["derivation"] and "8 teacher x 0.3500 s" in d["derivation"]


@pytest.mark.parametrize("argv, message", [
    (["--arms", "native,learned", "--seeds", "a,b"], "--seeds"),
    (["--arms", "native,telepathy"], "unknown arm"),
    (["--arms", "learned,intermittent"], "intermittent needs the arms native"),
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


def test_merge_joins_seeds_run_in_separate_processes(corpus, tmp_path, capsys):
    sets = SMALL + shards(corpus) + ["train.updates=3", "train.eval_tokens=128"]
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
    assert "leave out 2 arm-seed records that were not found" in report and "zero-seed2" in report
    assert (tmp_path / "numbers_only" / "dev_vs_updates.png").exists()
    # The same seed twice is refused.
    assert cli.main(["compare", "--merge", str(tmp_path / "s1"), str(tmp_path / "s1"),
                     "--out", str(tmp_path / "again")]) == 2
    assert "in two of the folders" in capsys.readouterr().err


def test_steady_seconds_leave_out_each_kinds_first_update():
    from creditlab.compare import kind_medians
    rows = [{"kind": "teacher", "seconds": 40.0}, {"kind": "synthetic", "seconds": 15.0}] + \
        [{"kind": k, "seconds": s} for k, s in [("synthetic", 0.04), ("synthetic", 0.05), ("teacher", 0.06),
                                                 ("teacher", 0.07)]]
    assert kind_medians(rows) == {"synthetic": 0.045, "teacher": 0.065}  # compilation (40 s, 15 s) left out
    assert kind_medians(rows[:3]) == {"teacher": 40.0, "synthetic": pytest.approx(7.52)}  # too few to leave out


def test_a_gap_is_judged_against_the_spread_only_with_two_seeds_of_both_arms():
    from creditlab.compare import summarize, verdicts
    runs = {"native": {1: {"dev_loss": 2.80}, 2: {"dev_loss": 2.76}},
            "zero": {1: {"dev_loss": 3.27}, 2: {"dev_loss": 3.34}},
            "learned": {1: {"dev_loss": 2.79}, 2: {"dev_loss": 2.80}},
            "dfa": {1: {"dev_loss": 3.29}}}
    for by_seed in runs.values():
        for s in by_seed.values():
            s.update({k: 0.0 for k in ("dev_bits_per_byte", "train_loss_last10pct", "seconds_per_update",
                                       "gpu_seconds", "peak_allocated_mib", "updates")})
    lines = verdicts({"summary": summarize(runs), "intermittent": {}})
    said = {tuple(line.split(" (")[0].split(" vs ")): line for line in lines}
    assert "beyond the seed spread" in said["zero", "native"] and "zero is worse" in said["zero", "native"]
    assert "within the seed spread (0.0400)" in said["learned", "native"]
    assert "learned is better" in said["learned", "zero"]
    assert "not assessable" in said["dfa", "native"] and "not assessable" in said["dfa", "zero"]
    # paired by seed: the per-seed differences, and whether their sign holds in every seed
    assert said["learned", "zero"].endswith("paired by seed (2): -0.4800 / -0.5400 (mean -0.5100), learned better in "
                                            "every seed")
    assert said["learned", "native"].endswith("-0.0100 / +0.0400 (mean +0.0150), learned the sign differs between seeds")
    assert said["zero", "native"].endswith("zero worse in every seed")
    assert "paired" not in said["dfa", "zero"]


def _fake_compare(folder, seed: int, overrides: list[str]):
    """A compare folder's compare.json with one arm at one seed: what merge reads."""
    numbers = {k: 1.0 for k in ("dev_loss", "dev_bits_per_byte", "train_loss_last10pct", "seconds_per_update",
                                "gpu_seconds", "peak_allocated_mib", "updates")}
    folder.mkdir()
    (folder / "compare.json").write_text(json.dumps({
        "preset": "tiny", "overrides": overrides, "tokens_per_update": 8, "eval": {"tokens": 8, "every": 0},
        "seeds": [seed], "arms": [{"label": "zero"}], "intermittent": {}, "wall_seconds": 1.0,
        "runs": {"zero": {str(seed): numbers | {"record": f"zero-seed{seed}"}}}}))
    return folder


def test_merge_ignores_cosmetic_overrides_and_refuses_the_rest(tmp_path):
    from creditlab.compare import merge

    a = _fake_compare(tmp_path / "a", 1, ["train.updates=3"])
    b = _fake_compare(tmp_path / "b", 2, ["train.updates=3", "train.keep_checkpoints=0", "train.log_every=5"])
    assert merge([a, b], tmp_path / "ab")["seeds"] == [1, 2]
    c = _fake_compare(tmp_path / "c", 3, ["train.updates=4"])
    with pytest.raises(config.ConfigError, match="its overrides differ"):
        merge([a, c], tmp_path / "ac")
