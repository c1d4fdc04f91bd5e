"""Reports of training runs: a markdown summary and a figure, from a run's record folder alone.

`creditlab report RUN [RUN ...]` draws every run given on the same axes (loss per update, seconds per update,
and the predictor's fit on teacher updates when there is one), so arms can be compared at a glance; with one
run it also writes `report.md` and `report.png` into that run's folder. A report is derived from the record
and the record is append-only, so a second report of the same run is written beside the first as
`report-2.md` and `report-2.png` (then -3, ...), never over it. A run with failure.json and no result.json is
reported as failed, with the reason; one that failed before its first update has no rows and only that.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from creditlab.config import UserError
from creditlab.credit import SOURCES, source_class
from creditlab.protocol.records import RECORD_MODE, read_json, read_jsonl, write_once


class NotARecord(UserError, FileNotFoundError):
    pass


def load_run(folder: str | Path) -> dict:
    folder = Path(folder)
    failures = sorted(folder.glob("failure*.json"), key=lambda p: (len(p.name), p.name))
    if not (folder / "rows.jsonl").exists() and not failures:
        raise NotARecord(f"{folder} has no rows.jsonl: not a run record (give a folder runs/<id>/)")
    from creditlab.train import latest_rows

    # A run killed while appending leaves a half-written last line; a report only looks, so it leaves it out.
    rows = latest_rows(read_jsonl(folder / "rows.jsonl", partial_last=True)) if (folder / "rows.jsonl").exists() \
        else []
    run = {"dir": folder, "rows": rows}
    for name in ("config", "env", "result"):
        path = folder / f"{name}.json"
        run[name] = read_json(path) if path.exists() else None
    # Failed: it stopped and has not finished since (a resumed run that finished has a result).
    run["failure"] = read_json(failures[-1]) if failures and run["result"] is None else None
    warnings = folder / "warnings.jsonl"
    run["warnings"] = read_jsonl(warnings, partial_last=True) if warnings.exists() else []
    return run


def status(run: dict) -> str:
    if run["failure"]:
        return "failed"
    if not run["rows"]:  # a finished run has rows: one without is no run to report, whatever else is there
        return "empty: it holds no update" + (" (rows.jsonl has none, though result.json is there: the record "
                                              "is damaged)" if run["result"] else "")
    return "finished" if run["result"] else "unfinished"


def label(run: dict) -> str:
    cfg = run["config"] or {}
    credit = cfg.get("credit", {})
    source = credit.get("source", "?")
    if source in SOURCES and source_class(source).fits:
        schedule = credit.get("schedule", "fixed")
        source += f", teacher 1/{credit.get('teacher_every')}" if schedule == "fixed" else f", schedule {schedule}"
    return f"{run['dir'].name} ({source})"


def summary_markdown(run: dict, figure_name: str = "report.png") -> str:
    rows = run["rows"]
    window = rows[-min(6, len(rows)):]
    cfg, env = run["config"] or {}, run["env"] or {}
    lines = [f"# Run {run['dir'].name}", "", f"Status: **{status(run)}**.", ""]
    if run["failure"]:
        f = run["failure"]
        lines.append(f"It failed {'before its first update' if f.get('stage') == 'start' else 'during training'}"
                     f" after {f.get('updates_done')} updates: {f.get('error')}")
        lines.append("")
    lines += [f"- warning: {w['warning']}" for w in run["warnings"]]
    lines += [""]
    if not rows:
        return "\n".join(lines)
    lines += [
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
                  f"| predictor fit, last teacher update | normalized error {_num(last['fit_error'])}, "
                  f"cosine {_num(last['fit_cosine'])} |"]
    lines += ["", f"![loss, time and fit]({figure_name})", ""]
    return "\n".join(lines)


def _num(value, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"  # null in the record: no value (e.g. 0/0)


def _nan(value) -> float:
    return math.nan if value is None else value  # a gap in the line


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
            fits = [(r["update"] + 1, _nan(r["fit"]["fit_error"]), _nan(r["fit"]["fit_cosine"])) for r in rows
                    if r.get("fit")]
            if fits:
                u, err, cos = zip(*fits)
                axes[2].plot(u, err, "o-", ms=3, color=line.get_color(), label="normalized error")
                axes[2].plot(u, cos, "s--", ms=3, color=line.get_color(), alpha=0.6, label="cosine")
    axes[0].set(xlabel="update", ylabel="train loss (nats)", title="loss (dots: exact teacher updates)")
    axes[0].legend(fontsize=7)
    axes[1].set(xlabel="update", ylabel="s/update", title="time per update (first update omitted)")
    if has_fit:
        axes[2].set(xlabel="update", title="predictor fit to the true corrections", ylim=(-0.05, 1.2))
        axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    path.chmod(RECORD_MODE)  # the mode of every record file
    return path


def report(folders: list[str | Path], out: str | Path | None = None) -> list[Path]:
    """Write the figure (and, for one run, its markdown summary); return the paths written."""
    runs = [load_run(f) for f in folders]
    one = len(runs) == 1 and out is None
    folder = runs[0]["dir"] if one else Path(out or ".")
    folder.mkdir(parents=True, exist_ok=True)
    stem = free_stem(folder)
    png, paths = folder / f"{stem}.png", []
    drawn = [r for r in runs if r["rows"]]
    if drawn:
        paths.append(figure(drawn, png))
    text = summary_markdown(runs[0], png.name) if one else "\n\n".join(summary_markdown(r) for r in runs)
    return paths + [write_once(folder / f"{stem}.md", text)]


def free_stem(folder: Path) -> str:
    """report, or report-2, -3, ...: the first name whose .md and .png are both free in `folder`, so that no report
    is written over an earlier one (a report is derived, but the record it sits in is append-only)."""
    n = 1
    stem = lambda n: "report" if n == 1 else f"report-{n}"  # noqa: E731
    while (folder / f"{stem(n)}.md").exists() or (folder / f"{stem(n)}.png").exists():
        n += 1
    return stem(n)


def add_commands(sub, config_args) -> None:
    p = sub.add_parser("report", help="markdown summary and figure of one or more training runs")
    p.add_argument("runs", nargs="+", help="run record folders (runs/<id>)")
    p.add_argument("--out", default=None, help="folder for a comparison of several runs (default: .)")
    p.set_defaults(func=lambda args: _cmd(args))


def _cmd(args) -> int:
    for path in report(args.runs, args.out):
        print(path)
    return 0
