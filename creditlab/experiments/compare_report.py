"""The report of a compare folder: `report.md`, led by the verdict table, and four figures, from the records alone.

Figures: each arm's DEV loss minus native's at equal updates over training (mean over seeds, band the 95%
interval); native's DEV loss against GPU-seconds over its budgets with each arm's point and interval (the verdict
figure); the fitted sources' fit to the true corrections on teacher updates; gradient alignment per trunk
parameter group on the measured (non-teacher) updates.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from creditlab.experiments import verdict as vd
from creditlab.experiments.compare import load_runs, missing_records, record_dirs, speedup_text, verdicts
from creditlab.protocol.records import write_once

FIGURES = ("verdict.png", "dev_minus_native.png", "fit_quality.png", "alignment.png")
ALIGN_GROUPS = ("trunk", "attn.qkv", "mlp.fc", "attn.proj", "mlp.proj", "attn.gate", "embed", "value_embeds",
                "scalars")


def _iv(d: dict, digits: int = 4, signed: bool = False) -> str:
    return vd.Interval(d["mean"], d["low"], d["high"], d["n"], tuple(d["values"])).text(digits, signed)


def _listed(result: dict) -> list[str]:
    """The arms a reader came for first: listed ones, then the floors, then native's other budgets."""
    order = {None: 0, "floor": 1, "budget": 2}
    labels = [a["label"] for a in result["arms"] if a["label"] in result["summary"]]  # records sort their keys
    return sorted(labels, key=lambda label: (order[result["summary"][label]["role"]["added"]], labels.index(label)))


def table(result: dict) -> list[str]:
    """The verdict table: one row per arm."""
    lines = ["| arm | cost per update vs native | updates | DEV loss | vs native | prediction adds (vs its floor) "
             "| gap closed (vs its floor) | speedup [95% CI] | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    intermittent = {a["label"] for a in result["arms"] if a["arm"] == "intermittent"}
    for label in _listed(result):
        s = result["summary"][label]
        role = s["role"]
        name = label + {"floor": " (floor)", "budget": " (native budget)"}.get(role["added"], "")
        speed = s["speedup"]
        speed_text = speedup_text(speed)
        on_curve = role["budget"] is not None or label in intermittent
        verdict = "– (on native's curve)" if on_curve else (speed["verdict"] or f"– ({speed['why']})")
        updates = f"{s['updates']['mean']:.0f}"
        lines.append(
            f"| {name} | {_iv(s['cost_vs_native'], 3)} | {updates} | {_iv(s['dev_loss'])} | "
            f"{_iv(s['vs_native'], 4, True) if label != 'native' else '–'} | "
            f"{_iv(s['prediction_adds'], 4, True) if s['floor'] else '–'} | "
            f"{_iv(s['gap_closed_floor'], 3) if s['floor'] else '–'} | {speed_text} | {verdict} |")
    return lines


def markdown(result: dict) -> str:
    seeds, keys = result["seeds"], result["runs_keys"]
    repeats = len(keys) > len(seeds)
    budgets = [label for label in _listed(result) if result["summary"][label]["role"]["budget"] is not None]
    listed = ", ".join(a["label"] for a in result["arms"] if a["role"]["added"] is None)
    lines = [f"# Comparison ({result['preset']}): the verdict", "",
             f"Device: {result['device']}. Arms {listed}; "
             f"seeds {', '.join(map(str, seeds))}" + (f", runs {', '.join(keys)}" if repeats else "")
             + f"; {result['tokens_per_update']:,} tokens per update; DEV loss on a fixed subset of "
             f"{result['eval']['tokens']:,} tokens" + (f" every {result['eval']['every']} updates"
                                                      if result['eval']['every'] else "") + ".",
             f"Overrides: {' '.join(result['overrides']) or 'none'}."]
    if "merged_from" in result:
        lines.append(f"Merged from {', '.join(result['merged_from'])}: each ran in its own process, the arms of a "
                     "run together in one.")
    if result.get("partial"):
        lines.append(f"**Partial**: {len(result['unfinished'])} arm runs had not finished and are left out "
                     f"({', '.join(result['unfinished'])}).")
    if result.get("timing_on_cpu"):
        lines += ["", "**Timed on a CPU**: GPU-seconds, costs and speedups are noisy there, so no verdict word is "
                      "given; run it on a GPU for the verdict."]
    lines += ["", "## Verdict", ""] + table(result) + [
        "", "Each number is the mean over seeds of a per-seed value (arms of a seed share initialization and data "
            "order; repeats of a seed are averaged into it first) with its two-sided 95% Student-t interval in "
            "brackets. *Cost per update*: the arm's GPU-seconds per update over native's, every update of every "
            "kind counted (kinds' medians x counts, the first update of each kind, which compiles, left out of its "
            "median). *vs native*: DEV loss minus native's (negative is better). *Prediction adds*: the DEV loss "
            "of the arm's fair floor (`zero` with the same exact updates) minus the arm's. *Gap closed*: (L_floor "
            "- L_arm) / (L_floor - L_native). *Speedup*: the GPU-seconds native needs to reach the arm's DEV loss "
            "(read off its budgets' curve, isotonic and piecewise linear in log GPU-seconds) over the arm's; > 1 "
            "pays. A seed where the arm's loss lies outside native's budgets enters as a bound (`below`: the arm "
            "is worse than native's cheapest budget). The verdict word comes from the interval alone: `pays` "
            "when it lies above 1, `does not pay` when below, else `cannot tell`.",
        "", "## What it says", ""] + [f"- {line}" for line in verdicts(result)]
    lines += ["", "## Native's budgets (native's curve)", "",
              "| budget | updates | " + " | ".join(f"run {k}: GPU-s, DEV loss" for k in keys) + " |",
              "|---|---|" + "---|" * len(keys)]
    for label in budgets + [a["label"] for a in result["arms"] if a["arm"] == "intermittent"]:
        s, runs = result["summary"].get(label), result["runs"].get(label, {})
        if s is None:
            continue
        cells = [f"{runs[k]['gpu_seconds']:.1f} s, {runs[k]['dev_loss']:.4f}" if k in runs else "–" for k in keys]
        fraction = s["role"]["budget"]
        lines.append(f"| {label} ({'x' + format(fraction, 'g') if fraction is not None else 'intermittent'}) | "
                     f"{s['updates']['mean']:.0f} | " + " | ".join(cells) + " |")
    forked = {label: r["forked_from"] for label, by_key in result["runs"].items() for r in by_key.values()
              if r.get("forked_from")}
    if forked:
        lines += ["", "Shorter budgets continued the longest one's run after the last update at which their learning "
                      "rates still equal its (their cooldown starts there): "
                  + "; ".join(f"{label} from {f['label']} after {f['updates']} updates" for label, f in forked.items())
                  + "."]
    lines += ["", "## Floors and the plain zero", "", "| arm | floor | gap closed vs plain zero |", "|---|---|---|"]
    for label in _listed(result):
        s = result["summary"][label]
        if s["role"]["added"] is None and label != "native":
            lines.append(f"| {label} | {s['floor'] or '–'} ({s['role']['floor_note']}) | "
                         f"{_iv(s['gap_closed_zero'], 3)} |")
    if repeats:
        lines += ["", "## Run-to-run noise against seed-to-seed spread", "",
                  "Standard deviations: run-to-run pooled over the seeds run more than once (same seed, so the "
                  "same initialization and data order: only the device's nondeterminism differs), seed-to-seed "
                  "over the seeds' means.", "",
                  "| arm | DEV loss: run-to-run | seed-to-seed | vs native: run-to-run | seed-to-seed |",
                  "|---|---|---|---|---|"]
        fmt = lambda v: "–" if v is None else f"{v:.4f}"  # noqa: E731
        for label in _listed(result):
            n = result["summary"][label]["noise"]
            lines.append(f"| {label} | {fmt(n['dev_loss']['run_to_run_sd'])} | {fmt(n['dev_loss']['seed_to_seed_sd'])}"
                         f" | {fmt(n['vs_native']['run_to_run_sd'])} | {fmt(n['vs_native']['seed_to_seed_sd'])} |")
    lines += ["", "## Costs", "", "| arm | run | updates by kind (count x median s) | GPU-s | measured s | peak MiB |",
              "|---|---|---|---|---|---|"]
    for label in _listed(result):
        for key, r in result["runs"][label].items():
            kinds = ", ".join(f"{n} {k} x {r['median_seconds_by_kind'][k]:.4f}" for k, n in r["kinds"].items())
            peak = "–" if r.get("peak_allocated_mib") is None else f"{r['peak_allocated_mib']:,.0f}"
            lines.append(f"| {label} | {key} | {kinds} | {r['gpu_seconds']:.2f} | {r['measured_seconds']:.2f} | "
                         f"{peak} |")
    if result["intermittent"]:
        lines += ["", "## Intermittent's budget", ""]
        lines += [f"- run {key}: {d['derivation']}." for key, d in result["intermittent"].items()]
    lines += ["", "## Figures", ""] + [f"![{name}]({name})" for name in FIGURES]
    return "\n".join(lines) + "\n"


# ---- figures ----------------------------------------------------------------------------------------------

def _band(ax, xs, per_seed: list[list[float]], label, color):
    """Mean over seeds with the 95% interval as a band (where there are two seeds or more)."""
    ivs = [vd.interval(col) for col in zip(*per_seed)]
    ax.plot(xs, [iv.mean for iv in ivs], label=label, color=color, lw=1.6)
    if all(iv.low is not None for iv in ivs):
        ax.fill_between(xs, [iv.low for iv in ivs], [iv.high for iv in ivs], color=color, alpha=0.2, lw=0)


def figure_dev_minus_native(ax, result: dict, runs: dict, colors: dict, zoom: bool = False) -> None:
    """Each arm's DEV loss minus native's at equal updates; `zoom`: the last 40% of training only, where the
    learning rate decays and the arms' final differences form (a spike early on sets no scale there)."""
    native = runs.get("native", {})
    total = max((e["update"] for run in native.values() for e in run["evals"]), default=0)
    start = 0.6 * total if zoom else 0
    for label, by_key in runs.items():
        s = result["summary"].get(label)
        if label == "native" or s is None or s["role"]["added"] == "budget" or not s["equal_updates"]:
            continue
        per_seed: dict[int, list[list[float]]] = {}
        xs = None
        for key, run in by_key.items():
            if key not in native:
                continue
            theirs = {e["update"]: e["loss"] for e in native[key]["evals"]}
            points = [(e["update"], e["loss"] - theirs[e["update"]]) for e in run["evals"]
                      if e["update"] in theirs and e["update"] >= start]
            if not points:
                continue
            xs = xs or [u for u, _ in points]
            per_seed.setdefault(vd.seed_of(key), []).append([d for _, d in points][:len(xs)])
        if not per_seed or xs is None:
            continue
        n = min(len(v) for runs_ in per_seed.values() for v in runs_)
        seeds = [[statistics.fmean(col) for col in zip(*[v[:n] for v in runs_])] for runs_ in per_seed.values()]
        _band(ax, xs[:n], seeds, label, colors[label])
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set_xlabel("updates")
    ax.set_ylabel("DEV loss minus native's (nats/token)")
    ax.set_title("the last 40% of training" if zoom else "DEV loss against native's at equal updates (mean over "
                 "seeds, 95% band)", fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def figure_verdict(ax, result: dict, colors: dict) -> None:
    curves = result["native_curve"]
    for key, c in curves.items():
        ax.plot(c["gpu_seconds"], c["dev_loss"], color="gray", lw=0.8, alpha=0.7, marker="o", ms=3,
                label="native's budgets (one line per run)" if key == next(iter(curves)) else None)
    losses = [l for c in curves.values() for l in c["dev_loss"]]
    for label, s in result["summary"].items():
        if s["role"]["added"] == "budget" or label == "native" or s["dev_loss"]["mean"] is None:
            continue
        g, l = s["gpu_seconds"], s["dev_loss"]
        yerr = None if l["low"] is None else [[l["mean"] - l["low"]], [l["high"] - l["mean"]]]
        text = speedup_text(s["speedup"], 2).replace(" (in every seed worse than native's cheapest budget)", "")
        ax.errorbar([g["mean"]], [l["mean"]], yerr=yerr, fmt="o", color=colors[label], capsize=3,
                    label=f"{label}: speedup {text}")
        losses += [l["mean"]] + ([l["low"], l["high"]] if l["low"] is not None else [])
    if losses:
        lo, hi = min(losses), max(losses)
        pad = 0.1 * (hi - lo or 0.05)
        ax.set_ylim(lo - pad, hi + pad)
    ax.set_xlabel("GPU-seconds (every update of every kind; an arm's point at its mean over seeds)")
    ax.set_ylabel("final DEV loss (nats/token; bars: 95% interval)")
    ax.set_title("the verdict: each arm against native's loss-vs-GPU-seconds curve", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)


def figures(out: Path, result: dict, records_from: Path | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = load_runs(record_dirs(records_from or out, result))
    labels = [a["label"] for a in result["arms"]]
    colors = {label: plt.cm.tab10(i % 10) for i, label in enumerate(labels)}

    fig, ax = plt.subplots(figsize=(8, 5))
    figure_verdict(ax, result, colors)
    fig.tight_layout()
    fig.savefig(out / "verdict.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    figure_dev_minus_native(axes[0], result, runs, colors)
    figure_dev_minus_native(axes[1], result, runs, colors, zoom=True)
    fig.tight_layout()
    fig.savefig(out / "dev_minus_native.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, by_key in runs.items():
        for i, run in enumerate(by_key.values()):
            fits = [(r["update"] + 1, r["fit"]) for r in run["rows"] if r.get("fit")]
            if not fits:
                continue
            for ax, key in zip(axes, ("fit_cosine", "fit_error")):
                ax.plot([u for u, _ in fits], [f[key] for _, f in fits], color=colors.get(label, "gray"), lw=1,
                        label=label if i == 0 else None)
    for ax, title in zip(axes, ("cosine with the true corrections", "normalized squared error")):
        ax.set_title(f"fit on teacher updates: {title}", fontsize=10)
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "fit_quality.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(3, 3, figsize=(12, 9), sharex=True)
    for ax, group in zip(axes.flat, ALIGN_GROUPS):
        for label, by_key in runs.items():
            if result["summary"].get(label, {}).get("role", {}).get("added") == "budget":
                continue
            for i, run in enumerate(by_key.values()):
                pts = [(r["update"] + 1, r["align"][group]["cosine"]) for r in run["rows"]
                       if r.get("align") and r["kind"] != "teacher" and group in r["align"]]
                if pts:
                    ax.plot(*zip(*pts), color=colors.get(label, "gray"), lw=1, marker=".", ms=3,
                            label=label if i == 0 else None)
        ax.set_title(group, fontsize=10)
        ax.axhline(1.0, color="gray", lw=0.5)
        ax.grid(alpha=0.3)
    handles, names = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, loc="lower center", ncol=min(len(names), 5), fontsize=8)
    fig.suptitle("gradient alignment: cosine with the exact gradient of the same batch (non-teacher updates)")
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    fig.savefig(out / "alignment.png", dpi=120)
    plt.close(fig)


def write_report(out: Path, result: dict, records_from: Path | None = None) -> Path:
    figures(out, result, records_from)
    text = markdown(result)
    missing = missing_records(record_dirs(records_from or out, result))
    if missing:
        text += (f"\nThe figures leave out {len(missing)} arm run records that were not found (their numbers are in "
                 f"the tables): {', '.join(str(f) for f in missing)}.\n")
    return write_once(out / "report.md", text)


__all__ = ["write_report", "table", "markdown", "figures", "FIGURES"]
