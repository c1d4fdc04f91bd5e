"""`creditlab compare`: the competence test. Arms trained from the same start on the same data, evaluated on DEV.

For every seed, every arm starts from the same initialization and reads the same TRAIN windows in the same
order (both follow train.seed), all in one process. The arms are interleaved: all resident, one update of each
per round in rotated order, so the clock's drift falls on all alike. `intermittent` runs after them, alone,
with the updates that the reference arm's GPU-seconds buy at native's speed, both measured side by side. Each arm-seed is a run record
(`DIR/<arm>-seed<seed>/`: config, rows, eval rows, result, model); `compare.json` holds every number, and
compare_report.py writes `report.md` with the tables and figures from the folder.

GPU-seconds are synchronized wall time of the updates (forward, backward, teacher fitting, optimizer step;
not evaluation, not the alignment pass). The first update of each kind also pays for compilation, so an arm's
`gpu_seconds` is its steady cost: per kind of update, the median seconds times the count. The raw sum is
kept beside it (`measured_seconds`).
"""

from __future__ import annotations

import gc
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from creditlab import config as config_mod
from creditlab import runtime as rt
from creditlab.arms import ArmSpec, arm_config
from creditlab.arms_runner import keep_compiled_side_by_side, run_rounds
from creditlab.evaluate import Evaluator
from creditlab.protocol.records import append_jsonl, read_json, read_jsonl, write_once
from creditlab.train import Trainer, row_dict

FORMAT = "creditlab-compare/1"


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
    """The numbers of one arm-seed run, from its rows and eval rows."""
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


@dataclass
class CompareRun:
    preset: str
    overrides: list[str]
    specs: list[ArmSpec]
    seeds: list[int]
    out: Path
    progress: bool = True
    runs: dict = field(default_factory=dict)  # label -> {seed: summary}
    intermittent: dict = field(default_factory=dict)  # seed -> derivation

    def ordered(self) -> list[ArmSpec]:
        return [s for s in self.specs if not s.arm.budgeted] + [s for s in self.specs if s.arm.budgeted]

    def check(self, base: config_mod.Config) -> None:
        """Refuse, before anything runs, what cannot be compared."""
        if rt.launched_processes() > 1:  # before any process group is joined
            raise config_mod.ConfigError("compare runs in one process (its arms share a GPU's clock); "
                                         "run it without torchrun")
        labels = [s.label for s in self.specs]
        for spec in self.specs:
            for seed in self.seeds:
                arm_config(self.preset, self.overrides, spec, seed)  # every arm's config must be valid
        if any(s.arm.budgeted for s in self.specs):
            ref = base.compare.reference
            if ref == "native" or any(s.label == ref and s.arm.budgeted for s in self.specs):
                raise config_mod.ConfigError(f"compare.reference={ref!r}: intermittent is given the GPU-seconds of "
                                             "an arm that is not native backprop, e.g. compare.reference=learned")
            missing = [name for name in ("native", ref) if name not in labels]
            if missing:
                raise config_mod.ConfigError(
                    f"intermittent needs the arms native (its speed) and compare.reference={ref!r} (whose "
                    f"GPU-seconds it gets) in --arms; missing: {', '.join(missing)}")
        if base.train.eval_tokens < 1:
            raise config_mod.ConfigError("compare evaluates on DEV: train.eval_tokens must be > 0")

    def run(self) -> dict:
        """Train every arm at every seed; write and return compare.json's content."""
        from tqdm import tqdm

        base = config_mod.load(self.preset, self.overrides)
        self.check(base)
        runtime = rt.resolve(base.train)
        peak = rt.measure_matmul_tflops(runtime)
        self.out.mkdir(parents=True, exist_ok=False)
        write_once(self.out / "env.json", {**rt.environment(runtime), "matmul_tflops": peak})
        planned = sum(arm_config(self.preset, self.overrides, s, seed).train.updates
                      for s in self.specs for seed in self.seeds)
        show = self.progress and sys.stderr.isatty()
        bar = tqdm(total=planned, desc="compare", unit="update", dynamic_ncols=True, disable=not show)
        say = bar.write if show else (lambda line: print(line, flush=True))
        start = time.time()
        for seed in self.seeds:
            fixed = [s for s in self.ordered() if not s.arm.budgeted]
            self.run_interleaved([ArmRun.build(self, s, arm_config(self.preset, self.overrides, s, seed), seed,
                                               runtime, peak) for s in fixed], bar, say)
            for spec in (s for s in self.ordered() if s.arm.budgeted):  # after their reference: alone
                updates = self.intermittent_updates(spec, seed, base)
                bar.total += updates - base.train.updates
                say(f"{spec.label} seed {seed}: {self.intermittent[seed]['derivation']}")
                if runtime.compile:
                    torch._dynamo.reset()
                arm = ArmRun.build(self, spec, arm_config(self.preset, self.overrides, spec, seed, updates), seed,
                                   runtime, peak)
                self.run_interleaved([arm], bar, say)
        bar.close()
        result = self.result(base, time.time() - start)
        write_once(self.out / "compare.json", result)
        return result

    def run_interleaved(self, arms: list["ArmRun"], bar, say) -> None:
        """All arms resident; each round runs one update of every unfinished arm, the order rotated each round
        (arms_runner.py, as the screen and the arms benchmark run theirs)."""
        if arms and arms[0].trainer.runtime.compile:
            keep_compiled_side_by_side()
        for arm in arms:
            arm.trainer.evaluate(arm.evaluator, arm.on_eval, say)
        by_label = {arm.spec.label: arm for arm in arms}
        rounds = max(a.cfg.train.updates for a in arms)
        every = max(1, rounds // 20)

        def step(at) -> bool:
            arm = by_label[at.arm]
            arm.step(bar, say)
            return not arm.done  # a finished arm leaves the rounds

        def after_round(r: int) -> None:
            if (r + 1) % every == 0 or r == rounds - 1:
                say(f"round {r + 1}/{rounds}: " + ", ".join(
                    f"{a.spec.label} loss {a.rows[-1]['loss']:.3f} {a.rows[-1]['seconds']:.3f} s" for a in arms))

        run_rounds(list(by_label), rounds, step, after_round=after_round)
        for arm in arms:
            self.runs.setdefault(arm.spec.label, {})[arm.seed] = arm.finish()

    def intermittent_updates(self, spec: ArmSpec, seed: int, base: config_mod.Config) -> int:
        ref = base.compare.reference
        ref_run, native = self.runs[ref][seed], self.runs["native"][seed]
        native_s = native["median_seconds_by_kind"]["native"]
        updates = max(1, math.floor(ref_run["gpu_seconds"] / native_s))
        cfg = arm_config(self.preset, self.overrides, spec, seed, updates).train
        self.intermittent[seed] = {
            "reference": ref, "reference_gpu_seconds": ref_run["gpu_seconds"],
            "reference_updates": ref_run["updates"], "reference_kinds": ref_run["kinds"],
            "reference_median_seconds_by_kind": ref_run["median_seconds_by_kind"],
            "native_median_seconds": native_s, "updates": updates,
            "derivation": (
                f"{ref} spent {ref_run['gpu_seconds']:.3f} GPU-s over {ref_run['updates']} updates ("
                + ", ".join(f"{n} {k} x {ref_run['median_seconds_by_kind'][k]:.4f} s"
                            for k, n in ref_run["kinds"].items())
                + f"); native's median update took {native_s:.4f} s in this process; intermittent gets "
                  f"floor({ref_run['gpu_seconds']:.3f} / {native_s:.4f}) = {updates} native updates, its schedule "
                  f"(warmup {cfg.warmup}, cooldown over the last {cfg.cooldown_frac:g} of them) laid over those "
                  f"{updates}, so its learning rate reaches zero at its own last update"),
        }
        return updates

    def result(self, base: config_mod.Config, seconds: float) -> dict:
        return {
            "format": FORMAT, "preset": self.preset, "overrides": self.overrides, "seeds": self.seeds,
            "arms": [{"label": s.label, "arm": s.arm.name, "about": s.arm.about, "overrides": list(s.overrides)}
                     for s in self.specs],
            "tokens_per_update": base.train.micro_batch * base.train.grad_accum * base.model.seq_len,
            "eval": {"split": "dev", "tokens": base.train.eval_tokens, "every": base.train.eval_every},
            "runs": {label: {str(seed): s for seed, s in by_seed.items()} for label, by_seed in self.runs.items()},
            "intermittent": {str(seed): d for seed, d in self.intermittent.items()},
            "summary": summarize(self.runs),
            "wall_seconds": seconds,
        }


class ArmRun:
    """One arm at one seed in a comparison: its trainer, evaluator and record folder."""

    def __init__(self, spec: ArmSpec, cfg: config_mod.Config, seed: int, folder: Path, trainer: Trainer,
                 evaluator: Evaluator):
        self.spec, self.cfg, self.seed, self.folder = spec, cfg, seed, folder
        self.trainer, self.evaluator = trainer, evaluator
        self.rows: list[dict] = []
        self.evals: list[dict] = []
        self.resident = 0  # bytes this arm keeps allocated between updates (CUDA)

    @classmethod
    def build(cls, compare: "CompareRun", spec: ArmSpec, cfg: config_mod.Config, seed: int, runtime,
              peak) -> "ArmRun":
        folder = compare.out / f"{spec.label.replace('@', '+').replace('=', '-')}-seed{seed}"
        folder.mkdir()
        write_once(folder / "config.json", cfg.to_dict())
        write_once(folder / "arm.json", {"label": spec.label, "arm": spec.arm.name, "about": spec.arm.about,
                                         "overrides": list(spec.overrides), "seed": seed})
        before = torch.cuda.memory_allocated(runtime.device) if runtime.is_cuda else 0
        trainer = Trainer(cfg, runtime, peak_tflops=peak)
        evaluator = Evaluator(cfg, runtime, purpose=f"compare {compare.out.name}: arm {spec.label}, seed {seed}, "
                                                    f"dev loss every {cfg.train.eval_every or cfg.train.updates} "
                                                    "updates")
        arm = cls(spec, cfg, seed, folder, trainer, evaluator)
        if runtime.is_cuda:
            arm.resident = torch.cuda.memory_allocated(runtime.device) - before
        return arm

    @property
    def done(self) -> bool:
        return self.trainer.update_index >= self.cfg.train.updates

    def on_eval(self, row) -> None:
        self.evals.append(row.to_dict())
        append_jsonl(self.folder / "eval.jsonl", self.evals[-1])

    def step(self, bar, say) -> None:
        runtime = self.trainer.runtime
        before = torch.cuda.memory_allocated(runtime.device) if runtime.is_cuda else 0
        row = self.trainer.advance(self.evaluator, self.on_eval, self.cfg.compare.align_every,
                                   last=self.trainer.update_index == self.cfg.train.updates - 1, say=say)
        if runtime.is_cuda:  # the peak as if this arm ran alone: other arms' resident bytes taken off
            row.peak_allocated_mib -= (before - self.resident) / 2**20
            row.peak_reserved_mib = None  # one pool for all arms: not an arm's own figure
            self.resident += torch.cuda.memory_allocated(runtime.device) - before
        self.rows.append(row_dict(row))
        append_jsonl(self.folder / "rows.jsonl", self.rows[-1])
        every = self.cfg.train.checkpoint_every
        if every and self.trainer.update_index % every == 0:  # model states for `creditlab ceiling --run`
            self.trainer.save_checkpoint(self.folder / f"checkpoint_{self.trainer.update_index:06d}.pt")
        bar.update(1)

    def finish(self) -> dict:
        self.trainer.save_model(self.folder / "model.pt")
        summary = arm_summary(self.rows, self.evals) | {"record": self.folder.name}
        write_once(self.folder / "result.json", summary)
        is_cuda = self.trainer.runtime.is_cuda
        self.trainer = self.evaluator = None
        gc.collect()
        if is_cuda:
            torch.cuda.empty_cache()
        return summary


def _stats(values: list[float]) -> dict:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return {"mean": None, "spread": None, "std": None, "values": []}
    return {"mean": statistics.fmean(values), "spread": max(values) - min(values) if len(values) > 1 else None,
            "std": statistics.stdev(values) if len(values) > 1 else None, "values": values}


def gap_closed(l_zero: float | None, l_arm: float | None, l_native: float | None) -> float | None:
    """(L_zero - L_arm) / (L_zero - L_native): 0 = no better than injecting nothing, 1 = native."""
    if None in (l_zero, l_arm, l_native) or l_zero == l_native:
        return None
    return (l_zero - l_arm) / (l_zero - l_native)


def summarize(runs: dict) -> dict:
    """Per arm over seeds: mean and spread (max - min) of the final DEV loss and the rest; gap closed per seed."""
    out = {}
    for label, by_seed in runs.items():
        seeds = sorted(by_seed)
        gaps = [gap_closed(runs.get("zero", {}).get(s, {}).get("dev_loss"), by_seed[s]["dev_loss"],
                           runs.get("native", {}).get(s, {}).get("dev_loss")) for s in seeds]
        out[label] = {key: _stats([by_seed[s][key] for s in seeds])
                      for key in ("dev_loss", "dev_bits_per_byte", "train_loss_last10pct", "seconds_per_update",
                                  "gpu_seconds", "peak_allocated_mib", "updates")}
        out[label]["gap_closed"] = _stats(gaps)
        out[label]["by_seed"] = {str(s): by_seed[s]["dev_loss"] for s in seeds
                                 if by_seed[s]["dev_loss"] is not None and math.isfinite(by_seed[s]["dev_loss"])}
    return out


def verdicts(result: dict) -> list[str]:
    """Plain sentences: each arm against native at equal updates, and intermittent against its reference at
    equal GPU-seconds. A gap is called a difference only when it exceeds the seed spread of both arms."""
    summary, lines = result["summary"], []

    def judge(a: str, b: str, what: str) -> str:
        la, lb = summary[a]["dev_loss"], summary[b]["dev_loss"]
        diff = la["mean"] - lb["mean"]
        spread = max(la["spread"] or 0.0, lb["spread"] or 0.0)
        head = f"{a} vs {b} ({what}): DEV loss {la['mean']:.4f} vs {lb['mean']:.4f}, {diff:+.4f}"
        if min(len(la["values"]), len(lb["values"])) < 2:
            return head + "; one seed, so no seed spread: not assessable as a difference"
        if abs(diff) <= spread:
            head += f"; within the seed spread ({spread:.4f}): no difference"
        else:
            head += f"; beyond the seed spread ({spread:.4f}): {a} is {'worse' if diff > 0 else 'better'}"
        return head + _paired(a, b)

    def _paired(a: str, b: str) -> str:
        # Arms of one seed share the initialization and the data order, so the per-seed difference removes the
        # seed's own variation, which the unpaired spread above keeps in.
        pa, pb = summary[a].get("by_seed", {}), summary[b].get("by_seed", {})
        seeds = sorted(set(pa) & set(pb))
        if len(seeds) < 2:
            return ""
        d = [pa[s] - pb[s] for s in seeds]
        sign = ("better in every seed" if max(d) < 0 else "worse in every seed" if min(d) > 0
                else "the sign differs between seeds")
        return (f"; paired by seed ({len(seeds)}): {' / '.join(f'{x:+.4f}' for x in d)} (mean {sum(d) / len(d):+.4f}), "
                f"{a} {sign}")

    if "native" in summary:
        for label in summary:
            if label != "native" and not label.startswith("intermittent"):
                lines.append(judge(label, "native", "equal updates"))
    if "zero" in summary:  # the floor every source must beat
        for label in summary:
            if label not in ("native", "zero") and not label.startswith(("intermittent", "oracle")):
                lines.append(judge(label, "zero", "equal updates"))
    ref = result.get("intermittent", {})
    if ref:
        reference = next(iter(ref.values()))["reference"]
        for label in summary:
            if label.startswith("intermittent") and reference in summary:
                lines.append(judge(reference, label, "equal GPU-seconds"))
    return lines


def merge(folders: list[Path], out: Path) -> dict:
    """One comparison from several compare folders of the same settings run at different seeds (in separate
    processes: within a seed the arms still shared one process). A seed may have run a subset of the arms; an
    arm with one seed has no spread. The records stay where they are; the merged compare.json names them."""
    results = [read_json(Path(f) / "compare.json") for f in folders]
    first = results[0]
    def experiment(r: dict) -> dict:  # what must agree: the settings less the cosmetic overrides
        overrides = [o for o in r["overrides"] if o.partition("=")[0].strip() not in config_mod.COSMETIC_KEYS]
        return {"preset": r["preset"], "overrides": overrides, "tokens_per_update": r["tokens_per_update"],
                "eval": r["eval"]}

    for f, r in zip(folders, results):
        for key, value in experiment(r).items():
            if value != experiment(first)[key]:
                raise config_mod.ConfigError(f"{f}: its {key} differs from {folders[0]}'s; only runs of one "
                                             "comparison at other seeds can be merged")
    runs: dict = {}
    intermittent: dict = {}
    for f, r in zip(folders, results):
        for label, by_seed in r["runs"].items():
            for seed, summary in by_seed.items():
                if seed in runs.get(label, {}):
                    raise config_mod.ConfigError(f"{f}: arm {label} seed {seed} is in two of the folders")
                runs.setdefault(label, {})[seed] = summary | {"record": str(Path(f) / summary["record"])}
        intermittent.update(r["intermittent"])
    out.mkdir(parents=True, exist_ok=False)
    arms = {a["label"]: a for r in results for a in r["arms"]}  # a seed may have run a subset of the arms
    runs = {label: runs[label] for label in arms if label in runs}  # the arms' order, not the records' keys
    merged = first | {"seeds": sorted({int(s) for by_seed in runs.values() for s in by_seed}), "runs": runs,
                      "arms": list(arms.values()),
                      "intermittent": intermittent, "summary": summarize(runs),
                      "merged_from": [str(f) for f in folders],
                      "wall_seconds": sum(r["wall_seconds"] for r in results)}
    write_once(out / "compare.json", merged)
    return merged


def record_dirs(out: Path, result: dict) -> list[Path]:
    """The arm-seed record folders of a comparison (its own, or those a merged one names)."""
    if "merged_from" in result:
        return [Path(s["record"]) for by_seed in result["runs"].values() for s in by_seed.values()]
    return sorted(p for p in out.iterdir() if _is_record(p))


def _is_record(folder: Path) -> bool:
    return (folder / "arm.json").exists()


def missing_records(folders: list[Path]) -> list[Path]:
    """The arm-seed record folders that are not there (a seed kept only as its compare.json): their numbers
    are in the comparison, their rows and eval rows are not."""
    return [folder for folder in folders if not _is_record(folder)]


def load_runs(folders: list[Path]) -> dict:
    """Rows and eval rows of arm-seed record folders, by arm label and seed (for figures); missing_records are
    left out."""
    found = {}
    for folder in filter(_is_record, folders):
        arm = read_json(folder / "arm.json")
        rows = read_jsonl(folder / "rows.jsonl") if (folder / "rows.jsonl").exists() else []
        evals = read_jsonl(folder / "eval.jsonl") if (folder / "eval.jsonl").exists() else []
        found.setdefault(arm["label"], {})[arm["seed"]] = {"rows": rows, "evals": evals}
    return found
