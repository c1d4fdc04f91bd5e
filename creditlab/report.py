"""Reports of training runs: a markdown summary and a figure, from a run's record folder alone.

`creditlab report RUN [RUN ...]` draws every run given on the same axes (loss per update, seconds per update,
and the predictor's fit on teacher updates when there is one), so arms can be compared at a glance; with one
run it also writes `report.md` and `report.png` into that run's folder (once: records are append-only).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from creditlab.credit import SOURCES, source_class
from creditlab.protocol.records import read_jsonl, write_once


def load_run(folder: str | Path) -> dict:
    folder = Path(folder)
    if not (folder / "rows.jsonl").exists():
        raise FileNotFoundError(f"{folder} has no rows.jsonl: not a run record (see runs/<id>/)")
    from creditlab.train import latest_rows

    run = {"dir": folder, "rows": latest_rows(read_jsonl(folder / "rows.jsonl"))}
    for name in ("config", "env", "result"):
        path = folder / f"{name}.json"
        run[name] = json.loads(path.read_text()) if path.exists() else None
    return run


def label(run: dict) -> str:
    cfg = run["config"] or {}
    credit = cfg.get("credit", {})
    source = credit.get("source", "?")
    if source in SOURCES and source_class(source).fits:
        schedule = credit.get("schedule", "fixed")
        source += f", teacher 1/{credit.get('teacher_every')}" if schedule == "fixed" else f", schedule {schedule}"
    return f"{run['dir'].name} ({source})"


def summary_markdown(run: dict) -> str:
    rows = run["rows"]
    window = rows[-min(6, len(rows)):]
    cfg, env = run["config"] or {}, run["env"] or {}
    lines = [f"# Run {run['dir'].name}", "",
             f"Credit source `{cfg.get('credit', {}).get('source')}`; model {cfg.get('model', {}).get('layers')} "
             f"layers x width {cfg.get('model', {}).get('width')}; micro {cfg.get('train', {}).get('micro_batch')} x "
             f"T {cfg.get('model', {}).get('seq_len')} x GA {cfg.get('train', {}).get('grad_accum')}; data "
             f"`{cfg.get('data', {}).get('source')}`; device {env.get('device')} ({env.get('gpu', 'cpu')}), torch "
             f"{env.get('torch')}, git {env.get('git_sha')}.", "",
             "| quantity | value |", "|---|---|",
             f"| updates | {len(rows)} |",
             f"| loss first -> last | {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f} |",
             f"| median s/update (last {len(window)}) | {statistics.median(r['seconds'] for r in window):.4f} |",
             f"| median tokens/s (last {len(window)}) | {statistics.median(r['tokens_per_s'] for r in window):,.0f} |"]
    peaks = [r["peak_allocated_mib"] for r in rows if r.get("peak_allocated_mib") is not None]
    if peaks:
        lines.append(f"| peak allocated MiB | {max(peaks):,.0f} |")
    fits = [r for r in rows if r.get("fit")]
    if fits:
        last = fits[-1]["fit"]
        lines += [f"| teacher updates | {len(fits)} |",
                  f"| predictor fit, last teacher update | normalized error {last['fit_error']:.3f}, "
                  f"cosine {last['fit_cosine']:.3f} |"]
    lines += ["", "![loss, time and fit](report.png)", ""]
    return "\n".join(lines)


def figure(runs: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_fit = any(r.get("fit") for run in runs for r in run["rows"])
    fig, axes = plt.subplots(1, 3 if has_fit else 2, figsize=(15 if has_fit else 10, 3.8))
    for run in runs:
        rows = run["rows"]
        x = [r["update"] + 1 for r in rows]
        line, = axes[0].plot(x, [r["loss"] for r in rows], label=label(run))
        teacher = [(r["update"] + 1, r["loss"]) for r in rows if r.get("kind") == "teacher"]
        if teacher:
            axes[0].plot(*zip(*teacher), "o", ms=3, color=line.get_color())
        axes[1].plot(x[1:], [r["seconds"] for r in rows[1:]], color=line.get_color())
        if has_fit:
            fits = [(r["update"] + 1, r["fit"]["fit_error"], r["fit"]["fit_cosine"]) for r in rows if r.get("fit")]
            if fits:
                u, err, cos = zip(*fits)
                axes[2].plot(u, err, "o-", ms=3, color=line.get_color(), label="normalized error")
                axes[2].plot(u, cos, "s--", ms=3, color=line.get_color(), alpha=0.6, label="cosine")
    axes[0].set(xlabel="update", ylabel="train loss (nats)", title="loss (dots: exact teacher updates)")
    axes[0].legend(fontsize=7)
    axes[1].set(xlabel="update", ylabel="s/update", title="synchronized wall time (first update omitted)")
    if has_fit:
        axes[2].set(xlabel="update", title="predictor fit to the true corrections", ylim=(-0.05, 1.2))
        axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(folders: list[str | Path], out: str | Path | None = None) -> list[Path]:
    """Write the figure (and, for one run, its markdown summary); return the paths written."""
    runs = [load_run(f) for f in folders]
    if len(runs) == 1 and out is None:
        folder = runs[0]["dir"]
        png = folder / "report.png"
        if png.exists() or (folder / "report.md").exists():
            raise FileExistsError(f"{folder} already has a report; records are append-only (use --out DIR)")
        figure(runs, png)
        return [png, write_once(folder / "report.md", summary_markdown(runs[0]))]
    out = Path(out or ".")
    out.mkdir(parents=True, exist_ok=True)
    paths = [figure(runs, out / "report.png")]
    paths.append(write_once(out / "report.md", "\n\n".join(summary_markdown(r) for r in runs)))
    return paths


def add_commands(sub, config_args) -> None:
    p = sub.add_parser("report", help="markdown summary and figure of one or more training runs")
    p.add_argument("runs", nargs="+", help="run record folders (runs/<id>)")
    p.add_argument("--out", default=None, help="folder for a comparison of several runs (default: .)")
    p.set_defaults(func=lambda args: _cmd(args))


def _cmd(args) -> int:
    for path in report(args.runs, args.out):
        print(path)
    return 0
