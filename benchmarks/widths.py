"""Cost against width: the arms benchmark at the seed model's widths, each arm's ratio to native beside its
FLOP-proportional ideal, and the narrowest width where the seed's optimistic gate holds.

    python3 benchmarks/widths.py run OUT [--updates 16] [--widths 512,1024] [--arms zero,learned]
                                          (any CUDA machine; one process per width, resumable: --widths splits
                                           the run; each arm compiles for about 30 s before its updates; Ctrl-C
                                           keeps the rounds every arm of the width finished)
    python3 benchmarks/widths.py summarize OUT              (any machine: OUT/widths.md and OUT/widths.png)
    python3 benchmarks/widths.py project OUT --compare COMPARE.json --width W [--md FILE]
                                          (any machine: which arms of a comparison could pay at width W)

`run` calls benchmarks/arms.py once per width (presets `seed`, `seed-w1024`, `seed-w1536`, `seed-w2048`: depth 8,
heads = width / 128, the same 524,288 tokens an update, micro-batches as config.seed_at_width says), into
OUT/w<width>/ (that process's output in its log.txt), skipping a width whose arms.json is there already.
`summarize` reads them. Six arms a width: native, zero, learned with one teacher in four (the cycle; its synthetic
updates and its teachers are read apart, each against native's update of the same round), the rank-16 sketch with
the subspace refresh, fp8 and dropbp.

The ideal of an arm is what its update would cost if time were proportional to the nominal FLOPs of
`creditlab flops` at that width, with f the omitted products' share of an update's FLOPs: zero and the learned
synthetic update 1 - f (the predictor's own FLOPs left out), the teacher 1 (its fit left out), one teacher in four
(the cycle) 1 - 3f/4, the rank-16 sketch 1 - f + its own FLOPs (refresh amortized), fp8 1 - f/2 (its products at
twice bf16's rate), dropbp 1 - f in expectation. The gate: the cycle at most 0.93 (DESIGN's one-teacher-in-four
gate on the cycle's mean time).

`project` carries a comparison's learning to another width. Per seed, an arm's speedup times its cost per update
is the share of native's updates at which native reaches the arm's DEV loss (a count of updates: no device in
it). Over the width's measured cost of the arm, that is the speedup it would have there if it learned as it did
in the comparison: the seeds' t-interval of that share over the cost's interval, ends against ends. An arm is
ruled out at that width where even the upper end is under 1. The assumption (that the share carries over to the
wider model) is what a comparison at that width tests.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from creditlab import config as config_mod  # noqa: E402
from creditlab.credit.schedules import Fixed, parse as parse_schedule  # noqa: E402
from creditlab.experiments.arms import parse_arm  # noqa: E402
from creditlab.experiments.arms_runner import signals_handled, steady_ratio  # noqa: E402
from creditlab.experiments.verdict import by_seed, interval  # noqa: E402
from creditlab.flops import flop_budget, sketch_cost  # noqa: E402

WIDTHS = (512, *config_mod.SEED_WIDTHS)
ARMS = {  # label: arm spec of benchmarks/arms.py
    "zero": "zero",
    "cycle (one teacher in four)": "learned",
    "sketch16": "sketch@credit.sketch_rank=16@credit.sketch=subspace",
    "fp8": "fp8",
    "dropbp": "dropbp",
}
NAMES = {("learned" if spec == "learned" else label): label for label, spec in ARMS.items()}  # `run --arms`: the
# labels, the cycle by its arm
# Read from the cycle's own rounds, by the kind of update each ran (against native's update of the same round):
# one arm compiled and resident where three would be. At width 2,048 an arm's parameters, gradients and optimizer
# state come to about 8 GiB (529M parameters; an estimate, not measured), so eight arms side by side and a
# micro-batch's activations would be near or over an 80 GB card; six fit on one (peaks in widths/w2048/arms.md).
KINDS = {"learned (synthetic)": "synthetic", "teacher": "teacher"}
LABELS = ("zero", *KINDS, *(label for label in ARMS if label != "zero"))  # the table's rows, in order
CYCLE_GATE = 0.93


def preset(width: int) -> str:
    return "seed" if width == 512 else f"seed-w{width}"


def ideals(width: int) -> dict[str, float]:
    cfg = config_mod.load(preset(width))
    budget = flop_budget(cfg.model)
    f = budget.omitted_fraction
    tokens_micro = cfg.train.micro_batch * cfg.model.seq_len
    sketch = sketch_cost(cfg.model, 16, "subspace", cfg.credit.sketch_every, tokens_micro,
                         tokens_micro * cfg.train.grad_accum)
    return {"zero": 1 - f, "learned (synthetic)": 1 - f, "teacher": 1.0, "cycle (one teacher in four)": 1 - 0.75 * f,
            "sketch16": 1 - f + sketch.amortized_per_token / budget.total_per_token, "fp8": 1 - f / 2,
            "dropbp": 1 - f}


def run(out: Path, updates: int, widths: tuple[int, ...] = WIDTHS, labels: tuple[str, ...] = tuple(ARMS)) -> int:
    for width in widths:
        folder = out / f"w{width}"
        if (folder / "arms.json").exists():
            print(f"w{width}: done already", flush=True)
            continue
        arms = ",".join(["native", *(ARMS[label] for label in labels)])
        cmd = [sys.executable, str(Path(__file__).with_name("arms.py")), "--out", str(folder), "--preset",
               preset(width), "--updates", str(updates), "--arms", arms]
        code = run_logged(cmd, folder / "log.txt")
        if code != 0:
            print(f"w{width}: arms.py exited {code} (its output: {folder / 'log.txt'})", file=sys.stderr)
            return code
    return summarize(out)


def run_logged(cmd: list[str], log: Path) -> int:
    """Run `cmd`, its output shown as it comes and appended to `log` (a width run again after a failure adds to
    the log of the one that failed, under its own command line), so that the page keeps what each process said."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as kept:
        header = "$ " + " ".join(cmd) + "\n"
        sys.stdout.write(header)
        kept.write(header)
        # Ctrl-C reaches the child too (one process group): it keeps the rounds every arm finished and ends, and
        # this process, Ctrl-C noted and nothing more (set once the child has started, which so keeps its own),
        # shows and logs all it says until then.
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as proc, \
                signals_handled(lambda signum, frame: None, (signal.SIGINT,)):
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                kept.write(line)
                kept.flush()
        return proc.returncode


def cycle_bound(parts: dict[str, dict], end: str) -> float | None:
    """One end of the cycle's bounds from its parts' intervals (one teacher, three synthetic updates, both at that
    end: wider than a joint interval would be); None without both parts."""
    if set(parts) != {"teacher", "synthetic"}:
        return None
    return (parts["teacher"][end] + 3 * parts["synthetic"][end]) / 4


def ratios(arms_json: dict) -> dict[str, dict]:
    """Per arm label: the ratio to native (where the arm runs one kind of update, the per-round median with its
    95% interval over the rounds from the third in which neither it nor native compiled, its refresh counted; the
    cycle's mean time over native's median for the cycle)."""
    by_spec = {r["arm"]: r for r in arms_json["results"]}
    native = by_spec["native"]
    out = {}
    for label, spec in ARMS.items():
        r = by_spec.get(spec)
        if r is None:
            continue
        if "cycle_s" in r:
            parts = {}
            for kind_label, kind in KINDS.items():  # the steady rounds in which it ran this kind
                got = steady_ratio(r["rows"], native["rows"], where=lambda row: row["kind"] == kind)
                if got is not None:
                    out[kind_label] = parts[kind] = {"ratio": got[0], "low": got[1], "high": got[2],
                                                     "rounds": got[3]}
            out[label] = {"ratio": r["cycle_s"] / native["median_last6_s"], "low": cycle_bound(parts, "low"),
                          "high": cycle_bound(parts, "high")}
            continue
        share = r.get("refresh_share_s") or 0.0
        got = steady_ratio([row | {"seconds": row["seconds"] + share} for row in r["rows"]], native["rows"])
        if got is not None:
            out[label] = {"ratio": got[0], "low": got[1], "high": got[2], "rounds": got[3]}
    return out


CYCLE = "cycle (one teacher in four)"


def _cell(r: dict) -> str:
    interval = f" [{r['low']:.3f}, {r['high']:.3f}]" if r.get("low") is not None else ""
    return f"{r['ratio']:.3f}{interval}"


def gate_status(cycle: dict) -> str:
    """"holds" where the cycle's upper bound is under the gate, "misses" where its lower bound is over it, "at the
    gate" where they straddle it; without bounds, its point decides."""
    low, high = (cycle["low"], cycle["high"]) if cycle.get("low") is not None else (cycle["ratio"],) * 2
    return "holds" if high <= CYCLE_GATE else "misses" if low > CYCLE_GATE else "at the gate"


def summarize(out: Path) -> int:
    found = {w: json.loads((out / f"w{w}" / "arms.json").read_text()) for w in WIDTHS
             if (out / f"w{w}" / "arms.json").exists()}
    if not found:
        print(f"no OUT/w<width>/arms.json under {out}: run `python3 benchmarks/widths.py run {out}` first",
              file=sys.stderr)
        return 2
    table = {w: ratios(d) for w, d in found.items()}
    ideal = {w: ideals(w) for w in found}
    device = {w: d["meta"]["env"].get("gpu") or "?" for w, d in found.items()}
    devices = sorted(set(device.values()))
    mixed = len(devices) > 1
    gate = {w: gate_status(table[w][CYCLE]) for w in found if CYCLE in table[w]}
    passing = [w for w in gate if gate[w] == "holds"]
    # the narrowest passing width is known only where every narrower width was measured too
    unmeasured = [w for w in WIDTHS if w not in found and (not passing or w < min(passing))]
    first = min(passing) if passing and not unmeasured else None

    def at(status: str, skip=()) -> str:
        return " and ".join(f"{w:,} ({_cell(table[w][CYCLE])}{', ' + device[w] if mixed else ''})"
                            for w in gate if gate[w] == status and w not in skip)

    if first:
        holds = f"holds first at width {first:,} ({_cell(table[first][CYCLE])})" + (
            f", and at {at('holds', skip=(first,))}" if len(passing) > 1 else "")
    else:
        holds = f"holds at width {at('holds')}" if passing else "holds clearly at none of the widths measured"
    verdict = (f"The gate (one teacher in four, the cycle at most {CYCLE_GATE} of native's update) {holds}"
               + "".join(f"; {what} at {at(status)}" for status, what in (
                   ("at the gate", "the cycle's bounds straddle it"), ("misses", "it misses")) if at(status))
               + (f" (not yet measured: width {', '.join(f'{w:,}' for w in unmeasured)})" if unmeasured else "")
               + ".")
    lines = [f"# Cost against width ({', '.join(devices)})", "", f"**{verdict}**", ""]
    if mixed:  # a ratio is compared across widths only where one kind of card measured them all
        by = ", ".join(f"width {w:,}: {device[w]}" for w in found)
        lines += [f"**The widths were measured on different devices ({by}): compare a ratio across widths only "
                  "among those of one device.**", ""]
    lines += ["Each cell: the arm's ratio to native per round (95% interval), then its FLOP-proportional ideal.", "",
             "| arm | " + " | ".join(f"width {w:,}" + (f" ({device[w]})" if mixed else "") for w in found) + " |",
             "|---" * (len(found) + 1) + "|"]
    shape = {w: config_mod.load(preset(w)).train for w in found}
    lines.append("| micro-batch x accumulation (windows of 2,048) | "
                 + " | ".join(f"{shape[w].micro_batch} x {shape[w].grad_accum}" for w in found) + " |")
    lines.append("| native, s an update (last-six median) | " + " | ".join(
        f"{next(r['median_last6_s'] for r in found[w]['results'] if r['arm'] == 'native'):.3f}" for w in found) + " |")
    for label in LABELS:
        cells = []
        for w in found:
            r = table[w].get(label)
            if r is None:
                cells.append("-")
                continue
            cells.append(f"{_cell(r)}; ideal {ideal[w][label]:.3f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "The cycle's bounds: its parts' intervals, both at their low ends and both at their high ends "
              "(one teacher and three synthetic updates); the gate holds where the upper bound is under it, misses "
              "where the lower bound is over it, and is at the gate where they straddle it."]
    stopped = {w: d["meta"]["stopped"] for w, d in found.items() if d["meta"].get("stopped")}
    lines += [f"Width {w:,} was stopped by {s['signal']} after {s['full_rounds']} of {found[w]['meta']['updates']} "
              f"rounds: its ratios read those (remove its folder to measure it again)." for w, s in stopped.items()]
    left_out = {w: [label for label, spec in ARMS.items() if spec not in {r["arm"] for r in d["results"]}]
                for w, d in found.items()}
    lines += [f"Width {w:,} ran without {', '.join(labels)} (`run --arms`): those cells are empty."
              for w, labels in left_out.items() if labels]
    uncounted = [w for w, d in found.items() if any("graphs_compiled" not in row for r in d["results"]
                                                    for row in r["rows"])]
    if uncounted:  # records made before compiled graphs were counted per update: no round could be left out
        lines += ["", f"Recorded before each update counted the graphs it compiled (width "
                  f"{', '.join(f'{w:,}' for w in uncounted)}): those ratios read every round from the third, "
                  "compiling or not."]
    (out / "widths.md").write_text("\n".join(lines) + "\n")
    (out / "widths.json").write_text(json.dumps({"ratios": table, "ideals": ideal, "devices": devices,
                                                 "gate": gate, "gate_first_width": first,
                                                 "unmeasured": unmeasured}, indent=2))
    figure(out / "widths.png", table, ideal, tuple(uncounted), device)
    print("\n".join(lines))
    return 0


def width_cost(arm: str, costs: dict[str, dict]) -> dict | None:
    """An arm of a comparison, its cost per update at a width: the measured ratio of its family (a floor with one
    exact update in n composed from zero's, its exact updates at native's cost); None for native and arms not
    measured."""
    try:
        spec = parse_arm(arm)
    except config_mod.ConfigError:
        return None
    name, own = spec.arm.name, dict(item.split("=", 1) for item in spec.extra)
    if name == "zero" and "credit.schedule" in own:  # a floor: one exact update in n
        try:
            schedule = parse_schedule(own["credit.schedule"], 0)
        except ValueError:
            return None
        zero, n = costs.get("zero"), getattr(schedule, "period", 0)
        if zero is None or type(schedule) is not Fixed or n < 1:
            return None
        return {end: ((n - 1) * zero[end] + 1) / n for end in ("ratio", "low", "high")}
    label = {"zero": "zero", "learned": CYCLE, "sketch": "sketch16", "fp8": "fp8", "dropbp": "dropbp"}.get(name)
    if name == "sketch" and (own.get("credit.sketch_rank"), own.get("credit.sketch")) != ("16", "subspace"):
        label = None  # the width benchmark measured the rank-16 sketch with the subspace refresh only
    return costs.get(label) if label else None


def project(compare: dict, costs: dict[str, dict]) -> list[dict]:
    """Per arm of `compare` with a speedup and a cost at the width: the share of native's updates that reaches its
    loss (t-interval over seeds; an upper bound where a seed ended above native's cheapest budget), the projected
    speedup's ends, and whether the arm is ruled out there."""
    rows = []
    for arm, summary in compare["summary"].items():
        cost = width_cost(arm, costs)
        speed = summary.get("speedup") or {}
        per_seed = speed.get("per_seed") or {}
        study_cost = by_seed({key: run["seconds_per_update"] / compare["runs"]["native"][key]["seconds_per_update"]
                              for key, run in compare["runs"].get(arm, {}).items()
                              if key in compare["runs"].get("native", {})})
        shares = [v["value"] * study_cost[int(seed)] for seed, v in per_seed.items()
                  if v.get("value") is not None and int(seed) in study_cost]
        if cost is None or len(shares) < 2:
            continue
        share = interval(shares)
        upper_only = any(v.get("bound") == "below" for v in per_seed.values())
        low, high = share.low / cost["high"], share.high / cost["low"]
        rows.append({"arm": arm, "share": share.to_dict(), "share_upper_only": upper_only, "cost": cost,
                     "projected": {"ratio": share.mean / cost["ratio"], "low": None if upper_only else low,
                                   "high": high},
                     "ruled_out": high < 1.0})
    return rows


def projection_md(rows: list[dict], width: int, source: str, devices: list[str]) -> str:
    lines = [f"# Which arms could pay at width {width:,}", "",
             f"From {source} (its learning) and the width benchmark's costs at {width:,} ({', '.join(devices)}). "
             "An arm is ruled out where its projected speedup's upper end is under 1.", "",
             "| arm | share of native's updates reaching its loss | cost at the width | projected speedup | "
             "at this width |", "|---|---|---|---|---|"]
    for r in rows:
        share, proj = r["share"], r["projected"]
        share_txt = (f"< {share['high']:.3f}" if r["share_upper_only"]
                     else f"{share['mean']:.3f} [{share['low']:.3f}, {share['high']:.3f}]")
        proj_txt = (f"< {proj['high']:.3f}" if proj["low"] is None
                    else f"{proj['ratio']:.3f} [{proj['low']:.3f}, {proj['high']:.3f}]")
        lines.append(f"| {r['arm']} | {share_txt} | {_cell(r['cost'])} | {proj_txt} | "
                     f"{'ruled out' if r['ruled_out'] else 'kept'} |")
    return "\n".join(lines) + "\n"


MARKERS = "os^D"  # one a device


def figure(path: Path, table: dict, ideal: dict, uncounted: tuple[int, ...] = (), device: dict | None = None,
           top: float = 1.12) -> None:
    """Each arm's ratio against width (error bars: its interval), dashed its ideal; a point from a record without
    compile counts hollow, one above `top` drawn at the edge with its value written beside it. Widths measured on
    different devices get a marker each, and a line joins only the widths of one device."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = list(table)
    device = device or {w: "" for w in widths}
    marker = {d: MARKERS[k % len(MARKERS)] for k, d in enumerate(dict.fromkeys(device[w] for w in widths))}
    fig, ax = plt.subplots(figsize=(10, 5))
    for i, label in enumerate(LABELS):
        xs = [w for w in widths if label in table[w]]
        if not xs:
            continue
        color = f"C{i}"
        cells = [table[w][label] for w in xs]
        ys = [min(c["ratio"], top) for c in cells]
        named = False  # the arm's first line carries its label, whichever device drew it
        for card in marker:  # one line a device: a ratio is not read across devices
            on = [(w, y) for w, y in zip(xs, ys) if device[w] == card]
            if on:
                ax.plot(*zip(*on), "-", color=color, label=None if named else label)
                named = True
        for w, c, y in zip(xs, cells, ys):
            if c.get("low") is not None and c["ratio"] <= top:
                # the cycle's point (its mean time) can sit just outside its parts' bounds: no negative bar
                spread = [[max(0.0, y - c["low"])], [max(0.0, min(c["high"], top) - y)]]
                ax.errorbar(w, y, yerr=spread, color=color, capsize=3)
            ax.plot(w, y, marker[device[w]], color=color, mfc="white" if w in uncounted else color)
            if c["ratio"] > top:
                ax.annotate(f"{c['ratio']:.2f} (off scale)", (w, y), textcoords="offset points", xytext=(-8, -12),
                            ha="right", fontsize=7, color=color)
        ax.plot(xs, [ideal[w][label] for w in xs], "--", color=color, alpha=0.6)
    ax.axhline(CYCLE_GATE, color="k", lw=0.8, ls=":", label=f"gate for the cycle ({CYCLE_GATE})")
    if uncounted:
        ax.plot([], [], "o", color="gray", mfc="white", label="hollow: compiling rounds not recorded")
    if len(marker) > 1:
        for card, m in marker.items():
            ax.plot([], [], m, color="gray", label=card)
    ax.set_ylim(top=top + 0.01)
    ax.set_xlabel("width (depth 8, heads = width / 128)")
    ax.set_ylabel("time per update / native's (dashed: FLOP-proportional)")
    ax.set_xticks(widths)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def project_command(out: Path, compare_path: Path, width: int, md: Path | None) -> int:
    widths_json, arms_json = out / "widths.json", out / f"w{width}" / "arms.json"
    if not widths_json.exists() or not arms_json.exists():
        print(f"widths.py: no width {width} measured under {out}: run `python3 benchmarks/widths.py run {out} "
              f"--widths {width}` and `python3 benchmarks/widths.py summarize {out}` first", file=sys.stderr)
        return 2
    try:
        compare = json.loads(compare_path.read_text())
        compare["summary"], compare["runs"]
    except (OSError, ValueError, KeyError, TypeError):
        print(f"widths.py: {compare_path} is not a comparison's compare.json: name the one that "
              "`creditlab compare` or `compare --merge` wrote", file=sys.stderr)
        return 2
    costs = json.loads(widths_json.read_text())["ratios"].get(str(width), {})
    device = json.loads(arms_json.read_text())["meta"]["env"].get("gpu") or "?"
    text = projection_md(project(compare, costs), width, str(compare_path), [device])
    if md:
        md.write_text(text)
    print(text, end="")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="the arms benchmark at every width, one process each, then the summary")
    r.add_argument("out", type=Path)
    r.add_argument("--updates", type=int, default=16)
    r.add_argument("--widths", default=",".join(map(str, WIDTHS)),
                   help=f"comma-separated widths among {', '.join(map(str, WIDTHS))} (default all)")
    r.add_argument("--arms", default=",".join(NAMES), help="comma-separated arms beside native among "
                   f"{', '.join(NAMES)} (default all; fewer where device time is short: the summary says which "
                   "a width left out)")
    s = sub.add_parser("summarize", help="the table and figure of what ran")
    s.add_argument("out", type=Path)
    p = sub.add_parser("project", help="which arms of a comparison could pay at a measured width")
    p.add_argument("out", type=Path)
    p.add_argument("--compare", type=Path, required=True, help="a comparison's compare.json")
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--md", type=Path, help="also write the table there")
    args = ap.parse_args()
    if args.what == "summarize":
        return summarize(args.out)
    if args.what == "project":
        return project_command(args.out, args.compare, args.width, args.md)
    try:
        widths = tuple(int(w) for w in args.widths.split(","))
    except ValueError:
        widths = ()
    if not widths or set(widths) - set(WIDTHS):
        print(f"widths.py: --widths {args.widths!r}: give widths among {','.join(map(str, WIDTHS))}, "
              "e.g. --widths 512,1024", file=sys.stderr)
        return 2
    names = tuple(a for a in args.arms.split(",") if a)
    if not names or set(names) - set(NAMES):
        print(f"widths.py: --arms {args.arms!r}: give arms among {','.join(NAMES)}, e.g. --arms zero,learned",
              file=sys.stderr)
        return 2
    return run(args.out, args.updates, widths, tuple(NAMES[name] for name in names))


if __name__ == "__main__":
    raise SystemExit(main())
