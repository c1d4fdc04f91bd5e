"""`creditlab compare`: the competence test. Arms trained from the same start on the same data, evaluated on DEV.

For every seed, every arm starts from the same initialization and reads the same TRAIN windows in the same
order (both follow train.seed), all in one process, one arm after the other; `intermittent` runs last, with the
updates that the reference arm's GPU-seconds buy at native's measured speed. Each arm-seed is a run record
(`DIR/<arm>-seed<seed>/`: config, rows, eval rows, result, model); `compare.json` holds every number, and
compare_report.py writes `report.md` with the tables and figures from the folder.

GPU-seconds are synchronized wall time of the updates (forward, backward, teacher fitting, optimizer step;
not evaluation, not the alignment pass). The first update of each kind also pays for compilation, so an arm's
`gpu_seconds` is its steady cost: per kind of update, the median seconds times the count. The raw sum is
kept beside it (`measured_seconds`).
"""

from __future__ import annotations

import gc
import json
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
from creditlab.evaluate import Evaluator
from creditlab.protocol.records import append_jsonl, read_jsonl, write_once
from creditlab.train import Trainer, UpdateRow, row_dict

FORMAT = "creditlab-compare/1"


def kind_medians(rows: list[dict]) -> dict[str, float]:
    kinds = sorted({r["kind"] for r in rows})
    return {k: statistics.median(r["seconds"] for r in rows if r["kind"] == k) for k in kinds}


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
        from tqdm import tqdm

        base = config_mod.load(self.preset, self.overrides)
        self.check(base)
        runtime = rt.resolve(base.train)
        if runtime.world_size > 1:
            raise config_mod.ConfigError("compare runs in one process (its arms share a GPU's clock); "
                                         "run it without torchrun")
        peak = rt.measure_matmul_tflops(runtime)
        self.out.mkdir(parents=True, exist_ok=False)
        write_once(self.out / "env.json", {**rt.environment(runtime), "matmul_tflops": peak})
        planned = sum(arm_config(self.preset, self.overrides, s, seed).train.updates
                      for s in self.specs for seed in self.seeds)
        bar = tqdm(total=planned, desc="compare", unit="update", dynamic_ncols=True,
                   disable=not (self.progress and sys.stderr.isatty()))
        start = time.time()
        for seed in self.seeds:
            for spec in self.ordered():
                updates = self.intermittent_updates(spec, seed, base) if spec.arm.budgeted else None
                cfg = arm_config(self.preset, self.overrides, spec, seed, updates)
                if updates is not None:
                    bar.total += updates - base.train.updates
                    bar.refresh()
                bar.set_description(f"compare {spec.label} seed {seed}")
                self.runs.setdefault(spec.label, {})[seed] = self.run_arm(spec, cfg, seed, runtime, peak, bar)
        bar.close()
        result = self.result(base, time.time() - start)
        write_once(self.out / "compare.json", result)
        return result

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

    def run_arm(self, spec: ArmSpec, cfg: config_mod.Config, seed: int, runtime, peak, bar) -> dict:
        folder = self.out / f"{spec.label.replace('@', '+').replace('=', '-')}-seed{seed}"
        folder.mkdir()
        write_once(folder / "config.json", cfg.to_dict())
        write_once(folder / "arm.json", {"label": spec.label, "arm": spec.arm.name, "about": spec.arm.about,
                                         "overrides": list(spec.overrides), "seed": seed})
        if runtime.compile:
            torch._dynamo.reset()  # a fresh compiler per arm: its per-function cache would fill up otherwise
        trainer = Trainer(cfg, runtime, peak_tflops=peak)
        evaluator = Evaluator(cfg, runtime, purpose=f"compare {self.out.name}: arm {spec.label}, seed {seed}, dev "
                                                    f"loss every {cfg.train.eval_every or cfg.train.updates} updates")
        rows, evals = [], []

        def on_row(row: UpdateRow):
            rows.append(row_dict(row))
            append_jsonl(folder / "rows.jsonl", rows[-1])

        def on_eval(row):
            evals.append(row.to_dict())
            append_jsonl(folder / "eval.jsonl", evals[-1])

        trainer.run(progress=self.progress, on_row=on_row, evaluator=evaluator, on_eval=on_eval,
                    align_every=cfg.compare.align_every, bar=bar)
        trainer.save_model(folder / "model.pt")
        summary = arm_summary(rows, evals) | {"record": folder.name}
        write_once(folder / "result.json", summary)
        del trainer, evaluator
        gc.collect()
        if runtime.is_cuda:
            torch.cuda.empty_cache()
        return summary

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
    return out


def verdicts(result: dict) -> list[str]:
    """Plain sentences: each arm against native at equal updates, and intermittent against its reference at
    equal GPU-seconds. A gap is called a difference only when it exceeds the seed spread of both arms."""
    summary, lines = result["summary"], []
    seeds = len(result["seeds"])

    def judge(a: str, b: str, what: str) -> str:
        la, lb = summary[a]["dev_loss"], summary[b]["dev_loss"]
        diff = la["mean"] - lb["mean"]
        spread = max(la["spread"] or 0.0, lb["spread"] or 0.0)
        head = f"{a} vs {b} ({what}): DEV loss {la['mean']:.4f} vs {lb['mean']:.4f}, {diff:+.4f}"
        if seeds < 2:
            return head + "; one seed, so no seed spread: not assessable as a difference"
        if abs(diff) <= spread:
            return head + f"; within the seed spread ({spread:.4f}): no difference"
        return head + f"; beyond the seed spread ({spread:.4f}): {a} is {'worse' if diff > 0 else 'better'}"

    if "native" in summary:
        for label in summary:
            if label != "native" and not label.startswith("intermittent"):
                lines.append(judge(label, "native", "equal updates"))
    ref = result.get("intermittent", {})
    if ref:
        reference = next(iter(ref.values()))["reference"]
        for label in summary:
            if label.startswith("intermittent") and reference in summary:
                lines.append(judge(reference, label, "equal GPU-seconds"))
    return lines


def load_runs(out: Path) -> dict:
    """Rows and eval rows of every arm-seed record in a compare folder (for figures)."""
    found = {}
    for folder in sorted(p for p in out.iterdir() if (p / "arm.json").exists()):
        arm = json.loads((folder / "arm.json").read_text())
        rows = read_jsonl(folder / "rows.jsonl") if (folder / "rows.jsonl").exists() else []
        evals = read_jsonl(folder / "eval.jsonl") if (folder / "eval.jsonl").exists() else []
        found.setdefault(arm["label"], {})[arm["seed"]] = {"rows": rows, "evals": evals}
    return found
