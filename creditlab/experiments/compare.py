"""`creditlab compare`: the competence test and its verdict. Arms from one start on one data order, judged by the
GPU-seconds native backprop needs to reach the same DEV loss.

For every seed (and every repeat of it, `--repeat`), every arm starts from the same initialization and reads the
same TRAIN windows in the same order (both follow train.seed), all in one process, interleaved: all resident,
one update of each per round in rotated order, so the clock's drift falls on all alike. Beside the listed arms
a comparison runs what judging them needs (arms.resolve_arms):

* **native budgets** (compare.native_budgets): native backprop at several fractions of train.updates, each with
  its learning rate fully decayed within its own budget. Their (GPU-seconds, DEV loss) points are native's
  curve, from which each arm's speedup is read (verdict.py). The shorter budgets continue the longest one's run
  after the last update at which their learning rates equal its (their own cooldown starts there) instead of
  repeating the updates before it: the same computation, so the same numbers as separate runs on the CPU
  (tested), fewer updates.
* **fair floors** (compare.floors): each arm with exact updates is judged against `zero` under the same
  schedule, so that what prediction adds is not confounded with the exact updates it gets.

`intermittent` (native given the reference arm's GPU-seconds) runs after the others, alone, and is one more
point on native's curve. Each arm run is a record (`DIR/<arm>-seed<key>/`: config, rows, eval rows, result,
model); `compare.json` holds every number, compare_report.py writes `report.md` and the figures from the folder.

GPU-seconds are synchronized wall time of the updates (forward, backward, teacher fitting, a sketch's refresh,
the optimizer step; not evaluation, not the alignment pass), counted for every update of every kind: per kind,
the median seconds times the count, the kind's first update (which compiles) left out of its median. Kinds are
what the rows say (native, synthetic, teacher, refresh): an update that does more work than the others of its
kind is recorded as a kind of its own, so no work hides inside another kind's median.

A comparison survives interruption: every arm's state is saved at evaluation points (or every
train.checkpoint_every updates);
Ctrl-C or SIGTERM ends the round, saves every arm where it stands and says how to go on; `compare --resume DIR`
continues from there and ends with the numbers of an uninterrupted run (tested on the CPU).
"""

from __future__ import annotations

import copy
import gc
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from creditlab import config as config_mod
from creditlab.experiments import verdict as vd
from creditlab.experiments.arms import ArmSpec, Role, arm_config, parse_arms, resolve_arms
from creditlab.experiments.experiment import Experiment
from creditlab.protocol.records import append_jsonl, make_folder, read_json, read_jsonl, repair_jsonl, write_once

FORMAT = "creditlab-compare/2"


class Interrupted(Exception):
    """The comparison stopped on a signal, every arm saved where it stood; the message says what was kept and
    how to go on."""


# ---- costs ------------------------------------------------------------------------------------------------

def kind_medians(rows: list[dict]) -> dict[str, float]:
    """Median seconds per kind of update. A kind's first update pays for its compilation: it is left out when
    the kind has three updates or more (with fewer, a short run's figures are dominated by it, and say so)."""
    out = {}
    for kind in sorted({r["kind"] for r in rows}):
        seconds = [r["seconds"] for r in rows if r["kind"] == kind]
        out[kind] = statistics.median(seconds[1:] if len(seconds) >= 3 else seconds)
    return out


def steady_seconds(rows: list[dict]) -> list[float]:
    """Cumulative steady GPU-seconds after each update: each update counted at its kind's median."""
    medians = kind_medians(rows)
    out, total = [], 0.0
    for r in rows:
        total += medians[r["kind"]]
        out.append(total)
    return out


def arm_summary(rows: list[dict], evals: list[dict]) -> dict:
    """The numbers of one arm run, from its rows and eval rows."""
    medians = kind_medians(rows)
    counts = {k: sum(r["kind"] == k for r in rows) for k in medians}
    gpu_s = sum(medians[k] * counts[k] for k in medians)
    fits = [r["fit"] for r in rows if r.get("fit")]
    aligned = [r for r in rows if r.get("align")]
    peaks = [r["peak_allocated_mib"] for r in rows if r.get("peak_allocated_mib") is not None]
    tail = rows[-max(1, len(rows) // 10):]
    last = evals[-1] if evals else {}
    return {
        "updates": len(rows), "kinds": counts, "median_seconds_by_kind": medians,
        "gpu_seconds": gpu_s, "measured_seconds": sum(r["seconds"] for r in rows),
        "seconds_per_update": gpu_s / len(rows),
        "train_loss_last10pct": statistics.fmean(r["loss"] for r in tail),
        "dev_loss": last.get("loss"), "dev_bits_per_byte": last.get("bits_per_byte"),
        "dev_tokens": last.get("tokens"),
        "peak_allocated_mib": max(peaks) if peaks else None,
        "final_fit": ({"fit_error": fits[-1]["fit_error"], "fit_cosine": fits[-1]["fit_cosine"]} if fits else None),
        "final_alignment": aligned[-1]["align"] if aligned else None,
    }


def latest_by_update(rows: list[dict]) -> list[dict]:
    """One row per update, the last written: a resumed arm appends the updates (and evaluations) it re-does."""
    by_update = {r["update"]: r for r in rows}
    return [by_update[u] for u in sorted(by_update)]


def fork_point(budget: config_mod.Config, trunk: config_mod.Config) -> int:
    """The number of updates a native budget shares with a longer one: its learning rate equals the longer
    run's at every update before that (they part where its own cooldown starts). 0 where anything else differs."""
    from creditlab.optim import lr_scale
    from creditlab.train import config_diff

    differ = [d for d in config_diff(budget.to_dict(), trunk.to_dict()) if not d.startswith("train.updates:")]
    if differ or budget.train.updates >= trunk.train.updates:
        return 0
    b, t = budget.train, trunk.train
    for u in range(b.updates):
        if lr_scale(u, b.updates, b.warmup, b.cooldown_frac) != lr_scale(u, t.updates, t.warmup, t.cooldown_frac):
            return u
    return 0


# ---- one arm run ------------------------------------------------------------------------------------------

class ArmRun:
    """One arm at one run of a seed: its trainer, evaluator and record folder."""

    def __init__(self, spec: ArmSpec, cfg: config_mod.Config, key: str, folder: Path, trainer, evaluator, tracker):
        self.spec, self.cfg, self.key, self.folder = spec, cfg, key, folder
        self.trainer, self.evaluator, self.tracker = trainer, evaluator, tracker
        self.rows: list[dict] = []
        self.evals: list[dict] = []
        self.resident = 0  # bytes this arm keeps allocated between updates (CUDA)
        self.extra: dict = {}  # what arm.json adds (an intermittent's budget, a fork's origin)

    @classmethod
    def open(cls, compare: "CompareRun", spec: ArmSpec, cfg: config_mod.Config, key: str, runtime, peak,
             extra: dict | None = None) -> "ArmRun":
        """The arm's record folder (made, or found on a resume) and a trainer for it, from its newest readable
        checkpoint where there is one."""
        import torch

        from creditlab.evaluate import Evaluator
        from creditlab.experiments.tracking import tracker
        from creditlab.train import Trainer

        folder = compare.out / record_name(spec.label, key)
        folder.mkdir(exist_ok=True)
        _write_or_match(folder / "config.json", cfg.to_dict())
        _write_or_match(folder / "arm.json", {"label": spec.label, "arm": spec.arm.name, "about": spec.arm.about,
                                              "overrides": list(spec.overrides), "seed": vd.seed_of(key),
                                              "run": key} | (extra or {}))
        before = torch.cuda.memory_allocated(runtime.device) if runtime.is_cuda else 0
        trainer = Trainer(cfg, runtime, peak_tflops=peak)
        every = cfg.train.eval_every or cfg.train.updates
        evaluator = Evaluator(cfg, runtime, purpose=f"compare {compare.out.name}: arm {spec.label}, run {key}, dev "
                                                    f"loss every {every} updates")
        arm = cls(spec, cfg, key, folder, trainer, evaluator,
                  tracker(compare.experiment.wandb, compare.out.name, f"{spec.label} {key}", cfg.to_dict(),
                          str(compare.out)))
        arm.extra = extra or {}
        if runtime.is_cuda:
            arm.resident = torch.cuda.memory_allocated(runtime.device) - before
        return arm

    def restore(self, say) -> bool:
        """Continue from the newest readable checkpoint of the folder, if any: its rows and eval rows up to it
        are the arm's; those written after it are re-done. False where there is none."""
        from creditlab.train import checkpoints, newest_readable_checkpoint

        found = checkpoints(self.folder)
        if not found:
            return False
        state = newest_readable_checkpoint(found, self.cfg.to_dict(), say=say)
        self.trainer.load_checkpoint(state)
        done = self.trainer.update_index
        self.rows = [r for r in self._read("rows.jsonl") if r["update"] < done]
        self.evals = [e for e in self._read("eval.jsonl") if e["update"] <= done]
        if len(self.rows) != done:
            raise config_mod.UserError(f"{self.folder} has a checkpoint at update {done} but rows for "
                                       f"{len(self.rows)} updates: its record is damaged; start a new comparison")
        return True

    def _read(self, name: str) -> list[dict]:
        path = self.folder / name
        if not path.exists():
            return []
        repair_jsonl(path)
        return latest_by_update(read_jsonl(path))

    def fork(self, trunk: "ArmRun", at: int) -> None:
        """Take over the trunk's state after `at` updates (a native budget sharing its first `at` updates), with
        the trunk's rows and evaluations of those updates as its own."""
        self.trainer.load_state(copy.deepcopy(trunk.trainer.state_dict()))
        assert self.trainer.update_index == at
        for row in trunk.rows[:at]:
            self._row(dict(row))
        for row in trunk.evals:
            if row["update"] <= at:
                self._eval(dict(row))

    @property
    def done(self) -> bool:
        return self.trainer.update_index >= self.cfg.train.updates

    def _row(self, row: dict) -> None:
        self.rows.append(row)
        append_jsonl(self.folder / "rows.jsonl", row)
        self.tracker.row(row)

    def _eval(self, row: dict) -> None:
        self.evals.append(row)
        append_jsonl(self.folder / "eval.jsonl", row)
        self.tracker.eval(row)

    def on_eval(self, row) -> None:
        self._eval(row.to_dict())

    def evaluate_start(self, say) -> None:
        if self.trainer.update_index == 0 and not self.evals:
            self.trainer.evaluate(self.evaluator, self.on_eval, say)

    def step(self, say) -> None:
        import torch

        from creditlab.train import row_dict

        runtime = self.trainer.runtime
        before = torch.cuda.memory_allocated(runtime.device) if runtime.is_cuda else 0
        row = self.trainer.advance(self.evaluator, self.on_eval, self.cfg.compare.align_every,
                                   last=self.trainer.update_index == self.cfg.train.updates - 1, say=say)
        if runtime.is_cuda:  # the peak as if this arm ran alone: other arms' resident bytes taken off
            row.peak_allocated_mib -= (before - self.resident) / 2**20
            row.peak_reserved_mib = None  # one pool for all arms: not an arm's own figure
            self.resident += torch.cuda.memory_allocated(runtime.device) - before
        self._row(row_dict(row))
        every = self.cfg.train.checkpoint_every
        if every and self.trainer.update_index % every == 0:  # model states for `creditlab ceiling --run`
            self.checkpoint()

    def checkpoint(self) -> None:
        path = self.folder / f"checkpoint_{self.trainer.update_index:06d}.pt"
        if not path.exists():
            self.trainer.save_checkpoint(path)

    def finish(self) -> dict:
        import torch

        from creditlab.train import drop_finished_checkpoints

        self.trainer.save_model(self.folder / "model.pt")
        summary = arm_summary(self.rows, self.evals) | {"record": self.folder.name} | self.extra
        write_once(self.folder / "result.json", summary)
        drop_finished_checkpoints(self.folder, self.cfg)
        self.tracker.finish()
        is_cuda = self.trainer.runtime.is_cuda
        self.trainer = self.evaluator = None
        gc.collect()
        if is_cuda:
            torch.cuda.empty_cache()
        return summary


def _write_or_match(path: Path, content: dict) -> None:
    """Write a record's file once; on a resume it must hold what this run would write."""
    if not path.exists():
        write_once(path, content)
        return
    if read_json(path) != _normalized(content):
        raise config_mod.UserError(f"{path} holds another arm than this comparison would run there (the code or "
                                   f"the experiment changed since it started); resume it with the commit it "
                                   f"was started with (its env.json names it), or start a new comparison")


def _normalized(content: dict) -> dict:
    import json

    from creditlab.protocol.records import dumps
    return json.loads(dumps(content))


def record_name(label: str, key: str) -> str:
    return f"{label.replace('@', '+').replace('=', '-')}-seed{key}"


# ---- the comparison ---------------------------------------------------------------------------------------

@dataclass
class CompareRun:
    experiment: Experiment
    out: Path
    progress: bool = True
    fork_budgets: bool = True  # off: every native budget runs from the start (the tests' control of the fork)
    specs: list[ArmSpec] = field(default_factory=list)
    roles: dict[str, Role] = field(default_factory=dict)
    runs: dict = field(default_factory=dict)  # label -> {run key: summary}
    intermittent: dict = field(default_factory=dict)  # run key -> derivation
    stop: object = None  # the StopRequest of a running comparison: its signal asks it to stop after a round

    def __post_init__(self):
        exp = self.experiment
        self.base = config_mod.load(exp.preset, exp.overrides)
        listed = parse_arms(",".join(exp.arms))
        budgets = config_mod.parse_budgets(self.base.compare.native_budgets)
        if budgets and "native" not in [s.label for s in listed]:
            listed.insert(0, parse_arms("native")[0])  # the budgets' curve is read against native
        self.specs, self.roles = resolve_arms(listed, exp.preset, exp.overrides, self.base.compare.floors, budgets)

    # -- what runs ------------------------------------------------------------------------------------------

    def keys(self) -> list[str]:
        return [vd.run_key(seed, r) for seed in self.experiment.seeds for r in range(1, self.experiment.repeat + 1)]

    def config_of(self, spec: ArmSpec, key: str, updates: int | None = None) -> config_mod.Config:
        return arm_config(self.experiment.preset, self.experiment.overrides, spec, vd.seed_of(key), updates)

    def plan(self) -> dict:
        return {"format": FORMAT, "arms": [self.arm_entry(s) for s in self.specs], "runs": self.keys()}

    def arm_entry(self, spec: ArmSpec) -> dict:
        return {"label": spec.label, "arm": spec.arm.name, "about": spec.arm.about, "overrides": list(spec.overrides),
                "role": self.roles[spec.label].to_dict()}

    def check(self) -> None:
        """Refuse, before anything runs, what cannot be compared."""
        from creditlab import runtime as rt

        self.experiment.check()
        if rt.launched_processes() > 1:  # before any process group is joined
            raise config_mod.ConfigError("compare runs in one process (its arms share a GPU's clock); "
                                         "run it without torchrun")
        labels = [s.label for s in self.specs]
        for spec in self.specs:  # every arm's config must be valid; a problem names the arm
            role = self.roles[spec.label]
            what = {"budget": "a native budget, compare.native_budgets", "floor": "a fair floor, compare.floors"}
            try:
                self.config_of(spec, self.keys()[0])
            except config_mod.ConfigError as exc:
                added = f" ({what[role.added]})" if role.added else ""
                raise config_mod.ConfigError(f"arm {spec.label}{added}: {exc}") from None
        if any(s.arm.budgeted for s in self.specs):
            ref = self.base.compare.reference
            if ref == "native" or any(s.label == ref and s.arm.budgeted for s in self.specs):
                raise config_mod.ConfigError(f"compare.reference={ref!r}: intermittent is given the GPU-seconds of "
                                             "an arm that is not native backprop, e.g. compare.reference=learned")
            missing = [name for name in ("native", ref) if name not in labels]
            if missing:
                raise config_mod.ConfigError(
                    f"intermittent needs the arms native (its speed) and compare.reference={ref!r} (whose "
                    f"GPU-seconds it gets) in --arms; missing: {', '.join(missing)}")
        if self.base.train.eval_tokens < 1:
            raise config_mod.ConfigError("compare evaluates on DEV: train.eval_tokens must be > 0")
        if self.experiment.wandb is not None:
            from creditlab.experiments.tracking import require_wandb
            require_wandb()

    # -- starting and resuming ------------------------------------------------------------------------------

    def start(self) -> None:
        """Make the comparison's folder and write what it will run (the experiment, its plan)."""
        make_folder(self.out, "--out")
        write_once(self.out / "experiment.toml", self.experiment.to_toml())
        write_once(self.out / "plan.json", self.plan())

    @classmethod
    def resume(cls, out: Path, progress: bool = True) -> "CompareRun":
        from creditlab.experiments import experiment as experiment_mod

        if not (out / "experiment.toml").exists():
            raise config_mod.UserError(f"{out} holds no comparison to resume (no experiment.toml); start one with "
                                       f"creditlab compare ... --out {out}")
        if (out / "compare.json").exists():
            raise config_mod.UserError(f"{out}'s comparison has finished; its report is {out / 'report.md'} "
                                       f"(creditlab compare --report {out} writes it again)")
        exp = experiment_mod.load(out / "experiment.toml")
        run = cls(exp, out, progress=progress)
        if read_json(out / "plan.json") != _normalized(run.plan()):
            raise config_mod.UserError(f"{out}/plan.json differs from what its experiment.toml resolves to now (the "
                                       f"code changed since it started); resume it with the commit it was started "
                                       f"with (its env.json names it)")
        return run

    # -- running --------------------------------------------------------------------------------------------

    def run(self) -> dict:
        """Train every arm at every run of every seed (skipping what a resumed comparison finished); write and
        return compare.json's content."""
        from tqdm import tqdm

        from creditlab import runtime as rt
        from creditlab.experiments.arms_runner import StopRequest

        self.check()
        runtime = rt.resolve(self.base.train)
        peak = rt.measure_matmul_tflops(runtime)
        env = {**rt.environment(runtime), "matmul_tflops": peak}
        if (self.out / "env.json").exists():
            append_jsonl(self.out / "resumed.jsonl", env | {"time": time.time()})
        else:
            write_once(self.out / "env.json", env)
        show = self.progress and sys.stderr.isatty()
        bar = tqdm(total=self.planned_updates(), desc="compare", unit="update", dynamic_ncols=True,
                   disable=not show)
        say = bar.write if show else (lambda line: print(line, flush=True))
        start = time.time()
        try:
            with StopRequest(self._announce_stop) as self.stop:
                for key in self.keys():
                    self.run_group(key, runtime, peak, bar, say)
        finally:
            bar.close()
        result = self.result(time.time() - start)
        write_once(self.out / "compare.json", result)
        return result

    @staticmethod
    def _announce_stop(name: str) -> None:  # a second signal stops at once (the last saved states are kept)
        print(f"\ncompare: {name}: stopping after this round, every arm saved where it stands "
              f"(again to stop at once)", file=sys.stderr, flush=True)

    def planned_updates(self) -> int:
        return sum(self.config_of(s, key).train.updates for s in self.specs for key in self.keys())

    def run_group(self, key: str, runtime, peak, bar, say) -> None:
        """Every arm of one run of a seed: the fixed arms interleaved, then intermittent alone."""
        fixed = [s for s in self.specs if not s.arm.budgeted]
        self.run_arms(fixed, key, runtime, peak, bar, say)
        for spec in (s for s in self.specs if s.arm.budgeted):  # after their reference: alone
            extra = self.intermittent_budget(spec, key)
            say(f"{spec.label} run {key}: {extra['derivation']}")
            self.run_arms([spec], key, runtime, peak, bar, say, updates=extra["updates"], extra=extra)

    def run_arms(self, specs: list[ArmSpec], key: str, runtime, peak, bar, say, updates: int | None = None,
                 extra: dict | None = None) -> None:
        """Arms resident together; each round runs one update of every arm at that round's update, in rotated
        order (arms_runner.rotation, as the screen and the arms benchmark run theirs)."""
        from creditlab.experiments.arms_runner import keep_compiled_side_by_side, rotation

        configs = {s.label: self.config_of(s, key, updates) for s in specs}
        todo = [s for s in specs if not (self.out / record_name(s.label, key) / "result.json").exists()]
        for spec in specs:
            if spec not in todo:
                self.runs.setdefault(spec.label, {})[key] = read_json(
                    self.out / record_name(spec.label, key) / "result.json")
                bar.update(configs[spec.label].train.updates)
        if not todo:
            return
        if runtime.compile:
            keep_compiled_side_by_side()
        forks = self.forks([s for s in specs if s in todo], configs)
        active: dict[str, ArmRun] = {}
        pending: dict[str, tuple[int, ArmSpec, dict]] = {}
        from creditlab.train import checkpoints

        for spec in todo:
            own = extra
            if spec.label in forks:
                trunk_label, at = forks[spec.label]
                own = {"forked_from": {"label": trunk_label, "updates": at}}
                if not checkpoints(self.out / record_name(spec.label, key)):  # made when its trunk gets there
                    pending[spec.label] = (at, spec, own)
                    continue
            arm = ArmRun.open(self, spec, configs[spec.label], key, runtime, peak, own)
            if arm.restore(say):
                say(f"{spec.label} run {key}: resumed at update {arm.trainer.update_index}")
            active[spec.label] = arm
        for arm in active.values():
            bar.update(arm.trainer.update_index)
            arm.evaluate_start(say)
        order = [s.label for s in todo]
        rounds = max(c.train.updates for c in configs.values())
        first = min(a.trainer.update_index for a in active.values())
        every = self.checkpoint_every()
        report_every = max(1, rounds // 20)
        for r in range(first, rounds):
            for label, (at, spec, own) in list(pending.items()):
                trunk = active.get(forks[label][0])
                if trunk is not None and trunk.trainer.update_index == at == r:
                    arm = ArmRun.open(self, spec, configs[label], key, runtime, peak, own)
                    arm.fork(trunk, at)
                    bar.update(at)
                    active[label] = arm
                    del pending[label]
            for label in rotation(order, r):
                arm = active.get(label)
                if arm is None or arm.trainer.update_index != r:
                    continue
                arm.step(say)
                bar.update(1)
                if arm.done:
                    self.runs.setdefault(label, {})[key] = arm.finish()
                    del active[label]
            if (r + 1) % report_every == 0 or r == rounds - 1:
                say(f"round {r + 1}/{rounds} (run {key}): " + ", ".join(
                    f"{a.spec.label} loss {a.rows[-1]['loss']:.3f} {a.rows[-1]['seconds']:.3f} s"
                    for a in active.values() if a.rows))
            if every and (r + 1) % every == 0:
                for arm in active.values():
                    if arm.trainer.update_index == r + 1:
                        arm.checkpoint()
            if self.stop is not None and self.stop.signal is not None:
                for arm in active.values():
                    arm.checkpoint()
                raise Interrupted(self.stop.signal)
        if pending:
            raise RuntimeError(f"native budgets never forked: {', '.join(pending)}")

    def checkpoint_every(self) -> int:
        return self.base.train.checkpoint_every or self.base.train.eval_every

    def forks(self, specs: list[ArmSpec], configs: dict) -> dict[str, tuple[str, int]]:
        """label -> (trunk label, shared updates) for the native budgets that continue the longest one's run."""
        if not self.fork_budgets:
            return {}
        budgets = [s for s in specs if self.roles[s.label].budget is not None]
        if len(budgets) < 2:
            return {}
        trunk = max(budgets, key=lambda s: configs[s.label].train.updates)
        out = {}
        for spec in budgets:
            if spec is not trunk:
                at = fork_point(configs[spec.label], configs[trunk.label])
                if at > 0:
                    out[spec.label] = (trunk.label, at)
        return out

    def intermittent_budget(self, spec: ArmSpec, key: str) -> dict:
        """The updates intermittent gets at this run: the reference's GPU-seconds at native's median update, its
        schedule laid over them. Read back from its record on a resume."""
        folder = self.out / record_name(spec.label, key)
        if (folder / "arm.json").exists():
            return {k: v for k, v in read_json(folder / "arm.json").items() if k in ("updates", "derivation",
                                                                                       "budget_from")}
        ref = self.base.compare.reference
        ref_run, native = self.runs[ref][key], self.runs["native"][key]
        native_s = native["median_seconds_by_kind"]["native"]
        updates = max(1, math.floor(ref_run["gpu_seconds"] / native_s))
        cfg = self.config_of(spec, key, updates).train
        derivation = (
            f"{ref} spent {ref_run['gpu_seconds']:.3f} GPU-s over {ref_run['updates']} updates ("
            + ", ".join(f"{n} {k} x {ref_run['median_seconds_by_kind'][k]:.4f} s" for k, n in ref_run["kinds"].items())
            + f"); native's median update took {native_s:.4f} s in this process; intermittent gets "
              f"floor({ref_run['gpu_seconds']:.3f} / {native_s:.4f}) = {updates} native updates, its schedule "
              f"(warmup {cfg.warmup}, cooldown over the last {cfg.cooldown_frac:g} of them) laid over those "
              f"{updates}, so its learning rate reaches zero at its own last update")
        self.intermittent[key] = {"reference": ref, "reference_gpu_seconds": ref_run["gpu_seconds"],
                                  "native_median_seconds": native_s, "updates": updates, "derivation": derivation}
        return {"updates": updates, "derivation": derivation, "budget_from": self.intermittent[key]}

    # -- the result -----------------------------------------------------------------------------------------

    def result(self, seconds: float) -> dict:
        env = read_json(self.out / "env.json")
        for key in self.keys():  # a resumed comparison: intermittent's derivation from its record
            for spec in self.specs:
                if spec.arm.budgeted and key not in self.intermittent:
                    summary = self.runs.get(spec.label, {}).get(key, {})
                    if "budget_from" in summary:
                        self.intermittent[key] = summary["budget_from"]
        result = {
            "format": FORMAT, "preset": self.experiment.preset, "overrides": self.experiment.overrides,
            "seeds": self.experiment.seeds, "repeat": self.experiment.repeat, "runs_keys": self.keys(),
            "arms": [self.arm_entry(s) for s in self.specs],
            "tokens_per_update": self.base.train.micro_batch * self.base.train.grad_accum * self.base.model.seq_len,
            "eval": {"split": "dev", "tokens": self.base.train.eval_tokens, "every": self.base.train.eval_every},
            "device": env.get("gpu") or env.get("device"), "timing_on_cpu": not env.get("gpu"),
            "runs": {label: dict(by_key) for label, by_key in self.runs.items()},
            "intermittent": self.intermittent, "wall_seconds": seconds,
        }
        return judged(result)


# ---- the verdict over runs --------------------------------------------------------------------------------

def _values(runs: dict, label: str, field: str) -> dict[str, float | None]:
    return {key: s.get(field) for key, s in runs.get(label, {}).items()}


def native_curves(result: dict) -> dict[str, vd.NativeCurve]:
    """Per run key: native's curve from every native budget of that run (and intermittent, another budget)."""
    budget_labels = [a["label"] for a in result["arms"]
                     if a["role"]["budget"] is not None or a["arm"] == "intermittent"]
    curves = {}
    for key in result["runs_keys"]:
        points = [(result["runs"][label][key]["gpu_seconds"], result["runs"][label][key]["dev_loss"])
                  for label in budget_labels if key in result["runs"].get(label, {})]
        if points:
            curves[key] = vd.NativeCurve(points)
    return curves


def judged(result: dict) -> dict:
    """compare.json's content with `summary` (per arm, every paired quantity with its interval over seeds, the
    speedup and its verdict) and `native_curve` (per run) added."""
    runs, arms = result["runs"], {a["label"]: a for a in result["arms"]}
    curves = native_curves(result)
    native_loss = _values(runs, "native", "dev_loss")
    native_spu = _values(runs, "native", "seconds_per_update")
    zero_loss = _values(runs, "zero", "dev_loss")
    summary = {}
    for label in [a["label"] for a in result["arms"] if a["label"] in runs]:
        by_key, role = runs[label], arms[label]["role"]
        loss = _values(runs, label, "dev_loss")
        per = {}
        per["dev_loss"] = loss
        per["vs_native"] = {k: _minus(loss.get(k), native_loss.get(k)) for k in by_key}
        per["cost_vs_native"] = {k: _ratio(by_key[k]["seconds_per_update"], native_spu.get(k)) for k in by_key}
        per["gap_closed_zero"] = {k: gap_closed(zero_loss.get(k), loss.get(k), native_loss.get(k)) for k in by_key}
        floor = role["floor"] if role["floor"] in runs else None
        floor_loss = _values(runs, floor, "dev_loss") if floor else {}
        per["prediction_adds"] = {k: _minus(floor_loss.get(k), loss.get(k)) for k in by_key} if floor else {}
        per["gap_closed_floor"] = ({k: gap_closed(floor_loss.get(k), loss.get(k), native_loss.get(k)) for k in by_key}
                                   if floor else {})
        speedups = {k: vd.speedup(curves[k], loss.get(k), by_key[k]["gpu_seconds"]) if k in curves
                    else vd.Speedup(None) for k in by_key}
        seeds_speedup = _speedups_by_seed(speedups)
        interval, word = vd.speedup_verdict(list(seeds_speedup.values()))
        why = None
        if result.get("timing_on_cpu"):
            word, why = None, "timings on a CPU are noisy: no verdict"
        elif interval.low is None:
            why = "fewer than two seeds: no interval"
        s = {name: vd.interval(vd.by_seed(values).values()).to_dict() for name, values in per.items()}
        for name in ("dev_bits_per_byte", "gpu_seconds", "seconds_per_update", "updates", "peak_allocated_mib",
                     "train_loss_last10pct"):
            s[name] = vd.interval(vd.by_seed(_values(runs, label, name)).values()).to_dict()
        s.update(role=role, floor=floor, runs=len(by_key),
                 equal_updates=all(by_key[k]["updates"] == runs.get("native", {}).get(k, {}).get("updates")
                                   for k in by_key),
                 speedup={"per_run": {k: v.to_dict() for k, v in speedups.items()},
                          "per_seed": {str(seed): v.to_dict() for seed, v in seeds_speedup.items()},
                          "interval": interval.to_dict(), "verdict": word, "why": why},
                 noise={"dev_loss": vd.noise(loss), "vs_native": vd.noise(per["vs_native"])},
                 by_run={k: loss[k] for k in by_key})
        summary[label] = s
    return result | {"summary": summary, "native_curve": {k: c.to_dict() for k, c in curves.items()},
                     "statistics": vd.METHOD}


def _speedups_by_seed(speedups: dict[str, vd.Speedup]) -> dict[int, vd.Speedup]:
    """The runs of one seed averaged into it; a seed whose runs are bounded keeps the bound only where every
    bounded run is bounded the same way."""
    grouped: dict[int, list[vd.Speedup]] = {}
    for key, s in speedups.items():
        if s.value is not None:
            grouped.setdefault(vd.seed_of(key), []).append(s)
    out = {}
    for seed, values in sorted(grouped.items()):
        bounds = {s.bound for s in values} - {None}
        if len(bounds) > 1:
            out[seed] = vd.Speedup(None)
        else:
            out[seed] = vd.Speedup(statistics.fmean(s.value for s in values), next(iter(bounds), None))
    return out


def _minus(a, b):
    return None if a is None or b is None else a - b


def _ratio(a, b):
    return None if a is None or not b else a / b


def gap_closed(l_zero: float | None, l_arm: float | None, l_native: float | None) -> float | None:
    """(L_floor - L_arm) / (L_floor - L_native): 0 = no better than its floor, 1 = native."""
    if None in (l_zero, l_arm, l_native) or l_zero == l_native:
        return None
    return (l_zero - l_arm) / (l_zero - l_native)


def speedup_text(speed: dict, digits: int = 3) -> str:
    """A summary's speedup in words: its interval over seeds; where every seed's arm lies outside native's
    budgets, only the bound that holds in every seed ("< x": worse than native's cheapest budget)."""
    seeds = list(speed["per_seed"].values())
    bounds = [v["bound"] for v in seeds if v["value"] is not None]
    d = speed["interval"]
    if bounds and all(b == "below" for b in bounds):
        return (f"< {max(v['value'] for v in seeds if v['value'] is not None):.{digits}f} (in every seed worse than "
                f"native's cheapest budget)")
    if bounds and all(b == "above" for b in bounds):
        return (f"> {min(v['value'] for v in seeds if v['value'] is not None):.{digits}f} (in every seed better "
                f"than native's dearest budget)")
    text = vd.Interval(d["mean"], d["low"], d["high"], d["n"], tuple(d["values"])).text(digits)
    outside = sum(b is not None for b in bounds)
    return text + (f" ({outside} of {len(bounds)} seeds outside native's budgets, entered as their bounds)"
                   if outside else "")


def verdicts(result: dict) -> list[str]:
    """One sentence per listed arm: what it costs, where it ends, what prediction adds over its floor, and
    whether it pays, each difference with its interval over seeds."""
    lines = []
    seeds = len(result["seeds"])
    for label in [a["label"] for a in result["arms"] if a["label"] in result["summary"]]:
        s = result["summary"][label]
        role = s["role"]
        if label == "native" or role["added"] is not None:
            continue
        iv = lambda d, digits=4, signed=True: vd.Interval(d["mean"], d["low"], d["high"], d["n"],  # noqa: E731
                                                           tuple(d["values"])).text(digits, signed)
        parts = [f"{label}: DEV loss {iv(s['vs_native'])} vs native"
                 + (" at equal updates" if s["equal_updates"] else f" ({s['updates']['mean']:.0f} updates against "
                                                                     f"native's)")]
        if s["floor"]:
            parts.append(f"adds {iv(s['prediction_adds'])} nats over its floor {s['floor']}")
        speed = s["speedup"]
        parts.append(f"speedup {speedup_text(speed)}: " + (speed["verdict"] or speed["why"] or ""))
        lines.append("; ".join(parts))
    if seeds < 2:
        lines.append("one seed: no interval, so no difference is called a difference")
    return lines


# ---- merging, partial reports and what a stopped comparison kept ------------------------------------------

def merge(folders: list[Path], out: Path) -> dict:
    """One comparison from several compare folders of the same experiment run at other seeds (in separate
    processes: within a run of a seed the arms still shared one process)."""
    results = []
    for f in folders:
        r = read_json(Path(f) / "compare.json")
        if r.get("format") != FORMAT:
            env = read_json(Path(f) / "env.json") if (Path(f) / "env.json").exists() else {}
            raise config_mod.UserError(f"{f}/compare.json is of format {r.get('format')!r}, not {FORMAT}: merge it "
                                       f"with the code that wrote it (git checkout {env.get('git_sha') or '...'})")
        results.append(r)
    first = results[0]

    def settings(r: dict) -> dict:  # what must agree: the resolved config less its cosmetic keys
        cfg = config_mod.load(r["preset"], r["overrides"]).to_dict()
        return {f"{section}.{k}": v for section, values in cfg.items() for k, v in values.items()
                if f"{section}.{k}" not in config_mod.COSMETIC_KEYS}

    for f, r in zip(folders, results):
        differ = sorted(k for k, v in settings(r).items() if settings(first).get(k) != v)
        if differ:
            raise config_mod.ConfigError(f"{f}: its settings differ from {folders[0]}'s ({', '.join(differ)}); "
                                         "only runs of one comparison at other seeds can be merged")
    runs: dict = {}
    intermittent: dict = {}
    for f, r in zip(folders, results):
        for label, by_key in r["runs"].items():
            for key, summary in by_key.items():
                if key in runs.get(label, {}):
                    raise config_mod.ConfigError(f"{f}: arm {label} run {key} is in two of the folders")
                runs.setdefault(label, {})[key] = summary | {"record": str(Path(f) / summary["record"])}
        intermittent.update(r["intermittent"])
    devices = sorted({str(r.get("device")) for r in results})
    if len(devices) > 1:
        raise config_mod.UserError(f"the folders ran on different devices ({', '.join(devices)}): their GPU-seconds "
                                   f"and speedups cannot be pooled; merge the folders of one device")
    out.mkdir(parents=True, exist_ok=False)
    arms = {a["label"]: a for r in results for a in r["arms"]}  # a run may have had a subset of the arms
    runs = {label: runs[label] for label in arms if label in runs}  # the arms' order, not the records' keys
    keys = sorted({k for by_key in runs.values() for k in by_key}, key=lambda k: (vd.seed_of(k), k))
    merged = {key: value for key, value in first.items() if key not in ("summary", "native_curve")} | {
        "seeds": sorted({vd.seed_of(k) for k in keys}), "runs_keys": keys, "runs": runs,
        "arms": list(arms.values()), "intermittent": intermittent, "merged_from": [str(f) for f in folders],
        "timing_on_cpu": any(r.get("timing_on_cpu") for r in results),
        "wall_seconds": sum(r["wall_seconds"] for r in results)}
    merged = judged(merged)
    write_once(out / "compare.json", merged)
    return merged


def partial_result(out: Path) -> dict:
    """compare.json's content from whatever arm runs of an unfinished (or finished) comparison have finished."""
    from creditlab.experiments import experiment as experiment_mod

    run = CompareRun(experiment_mod.load(out / "experiment.toml"), out, progress=False)
    for key in run.keys():
        for spec in run.specs:
            path = out / record_name(spec.label, key) / "result.json"
            if path.exists():
                run.runs.setdefault(spec.label, {})[key] = read_json(path)
    if not run.runs:
        raise config_mod.UserError(f"{out}: no arm run has finished yet, so there is nothing to report; "
                                   f"go on with creditlab compare --resume {out}")
    result = run.result(0.0)
    unfinished = [record_name(s.label, k) for k in run.keys() for s in run.specs
                  if not (out / record_name(s.label, k) / "result.json").exists()]
    return result | {"partial": True, "unfinished": unfinished}


def kept(out: Path) -> str:
    """What an interrupted comparison keeps, in one clause: finished arm runs, and where the others stand."""
    from creditlab.train import checkpoints

    finished, standing, again = 0, [], 0
    for folder in sorted(p for p in out.iterdir() if (p / "arm.json").exists()):
        if (folder / "result.json").exists():
            finished += 1
        elif checkpoints(folder):
            standing.append(int(checkpoints(folder)[-1].stem.rpartition("_")[2]))
        else:
            again += 1
    parts = [f"{finished} finished arm run{'s' if finished != 1 else ''}"]
    if standing:
        at = sorted(set(standing))
        where = f"update {at[0]}" if len(at) == 1 else f"updates {at[0]}-{at[-1]}"
        parts.append(f"{len(standing)} unfinished saved at {where}")
    if again:
        parts.append(f"{again} to run again from {'its' if again == 1 else 'their'} start")
    return ", ".join(parts)


def record_dirs(out: Path, result: dict) -> list[Path]:
    """The arm run record folders of a comparison (its own, or those a merged one names)."""
    if "merged_from" in result:
        return [Path(s["record"]) for by_key in result["runs"].values() for s in by_key.values()]
    return sorted(p for p in out.iterdir() if _is_record(p))


def _is_record(folder: Path) -> bool:
    return (folder / "arm.json").exists()


def missing_records(folders: list[Path]) -> list[Path]:
    """The record folders that are not there (a run kept as its compare.json only): their numbers are in the
    comparison, their rows and eval rows are not."""
    return [folder for folder in folders if not _is_record(folder)]


def load_runs(folders: list[Path]) -> dict:
    """Rows and eval rows of arm run record folders, by arm label and run key (for figures); missing_records
    are left out. A resumed arm's re-done rows replace the ones they re-did."""
    found = {}
    for folder in filter(_is_record, folders):
        arm = read_json(folder / "arm.json")
        rows = read_jsonl(folder / "rows.jsonl", partial_last=True) if (folder / "rows.jsonl").exists() else []
        evals = read_jsonl(folder / "eval.jsonl", partial_last=True) if (folder / "eval.jsonl").exists() else []
        key = arm.get("run", str(arm["seed"]))
        found.setdefault(arm["label"], {})[key] = {"rows": latest_by_update(rows), "evals": latest_by_update(evals)}
    return found
