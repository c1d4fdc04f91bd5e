"""Data-parallel training on several GPUs of one host: the `creditlab train` entry point under torchrun (NCCL).

Runs the seed preset natively on one GPU, then natively and with learned credit (one teacher in four) on
`--gpus` GPUs, each rank with the preset's own micro-batch (so the global batch grows with the GPUs), and
writes one JSON with each run's rows and a markdown table: s/update (median of the last `--window` updates,
teacher and synthetic separately, a kind's first update left out as it compiles), tokens/s, scaling efficiency against the one-GPU run of the same process,
rank 0's peak memory, and the losses.

    python benchmarks/ddp.py --out OUT_DIR [--gpus 2] [--updates 8]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """Stop a run and every process it started. Killing the launcher alone would leave its workers running on
    the GPUs into the next run's timings; torchrun stops its workers on SIGTERM, and what is left of the
    run's process group is killed after the grace period."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_training(name: str, gpus: int, preset: str, overrides: list[str], out: Path, timeout_s: float) -> dict:
    """One `creditlab train` run on `gpus` GPUs; its rows (rank 0's record) and how it ended."""
    runs = out / "runs" / name
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={gpus}", "--standalone"]
                if gpus > 1 else [sys.executable])
    cmd = launcher + ["-m", "creditlab.cli", "train", "--preset", preset, "--no-progress", "--json",
                      "--set", f"train.out_dir={runs}"] + [a for o in overrides for a in ("--set", o)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(gpus))}
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    started = time.perf_counter()
    log = out / f"{name}.log"
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop(proc)
            code = "timeout"
    records = sorted(runs.glob("*/rows.jsonl")) if runs.exists() else []
    rows = [json.loads(line) for line in records[-1].read_text().splitlines()] if records else []
    print(f"[{name}] exit {code} after {time.perf_counter() - started:.0f} s, {len(rows)} updates", flush=True)
    return {"name": name, "gpus": gpus, "overrides": overrides, "exit": code, "rows": rows,
            "log_tail": log.read_text()[-2000:] if code != 0 else ""}


def summarize(run: dict, window: int) -> dict:
    """Medians of the last `window` updates of each kind (teacher and synthetic updates differ in cost), never
    counting a kind's first update, which compiles its graphs."""
    summary = {"name": run["name"], "gpus": run["gpus"], "exit": run["exit"], "updates": len(run["rows"])}
    for kind in sorted({r["kind"] for r in run["rows"]}):
        rows = [r for r in run["rows"] if r["kind"] == kind][1:][-window:]
        if not rows:
            continue
        summary[kind] = {"s_per_update": statistics.median(r["seconds"] for r in rows),
                         "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows),
                         "peak_allocated_mib": max(r["peak_allocated_mib"] or 0 for r in rows),
                         "updates_in_median": len(rows)}
    if run["rows"]:
        summary["first_loss"], summary["final_loss"] = run["rows"][0]["loss"], run["rows"][-1]["loss"]
    return summary


def table(summaries: list[dict]) -> str:
    single = next((s["native"]["tokens_per_s"] for s in summaries if s["gpus"] == 1 and "native" in s), None)
    lines = ["| run | GPUs | update kind | s/update | tokens/s | scaling efficiency | peak MiB (rank 0) | loss first -> last |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        kinds = [k for k in ("native", "synthetic", "teacher") if k in s] or ["-"]
        for kind in kinds:
            m = s.get(kind)
            if m is None:
                lines.append(f"| {s['name']} | {s['gpus']} | - | exit {s['exit']} | | | | |")
                continue
            eff = f"{m['tokens_per_s'] / (s['gpus'] * single):.3f}" if single and kind == "native" else ""
            loss = f"{s['first_loss']:.3f} -> {s['final_loss']:.3f}" if "final_loss" in s else ""
            peak = f"{m['peak_allocated_mib']:,.0f}" if m["peak_allocated_mib"] else "-"  # none on the CPU
            lines.append(f"| {s['name']} | {s['gpus']} | {kind} | {m['s_per_update']:.4f} | "
                         f"{m['tokens_per_s']:,.0f} | {eff} | {peak} | {loss} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--gpus", type=int, default=2, help="processes of the data-parallel runs (GPUs on CUDA)")
    ap.add_argument("--preset", default="seed")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override for every run")
    ap.add_argument("--updates", type=int, default=8)
    ap.add_argument("--window", type=int, default=4, help="medians over the last this many updates of a kind")
    ap.add_argument("--timeout", type=float, default=400.0,
                    help="seconds allowed to each run (compiling the learned arm's two graphs under DDP took ~2 min)")
    ap.add_argument("--runs", default="ddp_learned,ddp_native,single_native",
                    help="which runs, in this order: ddp_learned, ddp_native, single_native")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = [f"train.updates={args.updates}"] + args.set
    plans = {"ddp_learned": (args.gpus, base + ["credit.source=learned", "credit.teacher_every=4"]),
             "ddp_native": (args.gpus, base + ["credit.source=exact"]),
             "single_native": (1, base + ["credit.source=exact"])}
    unknown = [n for n in args.runs.split(",") if n not in plans]
    if unknown:
        raise SystemExit(f"unknown runs {unknown}; valid: {', '.join(plans)}")
    runs, summaries = [], []
    for name in args.runs.split(","):
        gpus, overrides = plans[name]
        runs.append(run_training(name, gpus, args.preset, overrides, out, args.timeout))
        summaries.append(summarize(runs[-1], args.window))
        result = {"gpus": args.gpus, "updates": args.updates, "window": args.window, "summaries": summaries,
                  "runs": runs}
        tmp = out / "ddp.json.tmp"  # rewritten after every run, so a run that dies leaves the earlier ones
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(out / "ddp.json")
    text = table(summaries)
    (out / "ddp.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
