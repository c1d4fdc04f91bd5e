"""The report of a compare folder: `report.md` with its tables and four PNG figures, from the records alone.

Figures: DEV loss against updates and against GPU-seconds (mean over seeds, band from the lowest to the highest
seed); the fitted sources' fit to the true corrections on teacher updates; gradient alignment per trunk parameter
group on the measured (non-teacher) updates.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from creditlab.compare import load_runs, missing_records, record_dirs, steady_seconds, verdicts
from creditlab.protocol.records import write_once

FIGURES = ("dev_vs_updates.png", "dev_vs_gpu_seconds.png", "fit_quality.png", "alignment.png")
ALIGN_GROUPS = ("trunk", "attn.qkv", "mlp.fc", "attn.proj", "mlp.proj", "attn.gate", "embed", "value_embeds",
                "scalars")


def _fmt(stats: dict, digits: int = 4) -> str:
    if stats["mean"] is None:
        return "–"
    text = f"{stats['mean']:.{digits}f}"
    return text + (f" ± {stats['spread']:.{digits}f}" if stats["spread"] is not None else "")


def table(result: dict) -> list[str]:
    lines = ["| arm | updates | DEV loss | bits/byte | gap closed | s/update | GPU-s | peak MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for label, s in result["summary"].items():
        peak = s["peak_allocated_mib"]["mean"]
        lines.append(f"| {label} | {s['updates']['mean']:.0f} | {_fmt(s['dev_loss'])} | "
                     f"{_fmt(s['dev_bits_per_byte'])} | {_fmt(s['gap_closed'], 3)} | "
                     f"{s['seconds_per_update']['mean']:.4f} | {s['gpu_seconds']['mean']:.1f} | "
                     + ("–" if peak is None else f"{peak:,.0f}") + " |")
    return lines


def markdown(result: dict) -> str:
    seeds = result["seeds"]
    lines = [f"# Competence comparison ({result['preset']})", "",
             f"Arms {', '.join(a['label'] for a in result['arms'])}; seeds {', '.join(map(str, seeds))}; "
             f"{result['tokens_per_update']:,} tokens per update; DEV loss on a fixed subset of "
             f"{result['eval']['tokens']:,} tokens" + (f" every {result['eval']['every']} updates"
                                                      if result['eval']['every'] else "") + ".",
             f"Overrides: {' '.join(result['overrides']) or 'none'}."] + (
                [f"Merged from {', '.join(result['merged_from'])}: each seed ran in its own process, the arms of a "
                 "seed together in one."] if "merged_from" in result else []) + ["",
             "Final DEV loss is mean ± spread (highest minus lowest seed)" + (
                 "; one seed: no spread" if len(seeds) < 2 else "") + ". Gap closed = (L_zero - L_arm) / "
             "(L_zero - L_native), per seed, then over seeds. GPU-s: per kind of update, the median seconds x "
             "the count (compilation excluded); s/update = GPU-s / updates.", ""]
    lines += table(result)
    lines += ["", "## What it says", ""] + [f"- {v}" for v in verdicts(result)]
    if result["intermittent"]:
        lines += ["", "## Intermittent's budget", ""]
        lines += [f"- seed {seed}: {d['derivation']}." for seed, d in result["intermittent"].items()]
    lines += ["", "## Figures", ""] + [f"![{name}]({name})" for name in FIGURES]
    return "\n".join(lines) + "\n"


def _band(ax, xs_by_seed, ys_by_seed, label, color):
    """Mean line over seeds with a min-max band, on the x of the first seed (seeds share eval points)."""
    n = min(len(y) for y in ys_by_seed)
    xs = [statistics.fmean(x[i] for x in xs_by_seed) for i in range(n)]
    cols = [[y[i] for y in ys_by_seed] for i in range(n)]
    ax.plot(xs, [statistics.fmean(c) for c in cols], label=label, color=color, lw=1.6)
    if len(ys_by_seed) > 1:
        ax.fill_between(xs, [min(c) for c in cols], [max(c) for c in cols], color=color, alpha=0.2, lw=0)


def figures(out: Path, result: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = load_runs(record_dirs(out, result))
    colors = {label: plt.cm.tab10(i % 10) for i, label in enumerate(runs)}

    for name, x_of in (("dev_vs_updates.png", "updates"), ("dev_vs_gpu_seconds.png", "gpu_seconds")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, by_seed in runs.items():
            xs, ys = [], []
            for run in by_seed.values():
                if not run["evals"]:
                    continue
                cum = [0.0] + steady_seconds(run["rows"])
                xs.append([e["update"] if x_of == "updates" else cum[min(e["update"], len(cum) - 1)]
                           for e in run["evals"]])
                ys.append([e["loss"] for e in run["evals"]])
            if ys:
                _band(ax, xs, ys, label, colors[label])
        ax.set_xlabel("updates" if x_of == "updates" else "GPU-seconds (steady, per-kind medians)")
        ax.set_ylabel("DEV loss (nats/token)")
        ax.set_title(f"DEV loss against {'updates' if x_of == 'updates' else 'GPU-seconds'}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=120)
        plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, by_seed in runs.items():
        for i, run in enumerate(by_seed.values()):
            fits = [(r["update"] + 1, r["fit"]) for r in run["rows"] if r.get("fit")]
            if not fits:
                continue
            for ax, key in zip(axes, ("fit_cosine", "fit_error")):
                ax.plot([u for u, _ in fits], [f[key] for _, f in fits], color=colors[label], lw=1,
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
        for label, by_seed in runs.items():
            for i, run in enumerate(by_seed.values()):
                pts = [(r["update"] + 1, r["align"][group]["cosine"]) for r in run["rows"]
                       if r.get("align") and r["kind"] != "teacher" and group in r["align"]]
                if pts:
                    ax.plot(*zip(*pts), color=colors[label], lw=1, marker=".", ms=3,
                            label=label if i == 0 else None)
        ax.set_title(group, fontsize=10)
        ax.axhline(1.0, color="gray", lw=0.5)
        ax.grid(alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    fig.suptitle("gradient alignment: cosine with the exact gradient of the same batch (non-teacher updates)")
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    fig.savefig(out / "alignment.png", dpi=120)
    plt.close(fig)


def write_report(out: Path, result: dict) -> Path:
    figures(out, result)
    text = markdown(result)
    missing = missing_records(record_dirs(out, result))
    if missing:
        text += (f"\nThe figures leave out {len(missing)} arm-seed records that were not found (their numbers are in "
                 f"the tables): {', '.join(str(f) for f in missing)}.\n")
    return write_once(out / "report.md", text)
