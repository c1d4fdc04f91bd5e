"""Side-by-side timing of training arms on one GPU: identical initialization, identical inputs, one process.

    python benchmarks/arms.py --out DIR --arms native,zero [--preset seed] [--updates 12] [--set k=v ...]

An arm is a label of the arm registry (creditlab/experiments/arms.py), as `creditlab compare` takes it: `native`, `zero`,
`learned` (one teacher update in four), `learned@credit.schedule=never` (synthetic updates alone),
`native@model.head=fp8`, `sketch@credit.sketch_rank=16`. Each arm starts from the same state-dict bytes and
reads the same micro-batches; per update it records synchronized wall time, loss and peak memory. Results go
to DIR/arms.json and DIR/arms.md (last-six medians, ratios against the first arm).

By default the arms are interleaved (creditlab/experiments/arms_runner.py, the runner the resource screen uses too): all
are built and compiled first, then each round runs one update of every arm, so the board's drift in clock and
temperature under its power limit falls on all arms alike (run back to back, the same arm's median moves by
5-10 ms between runs). `--schedule sequential` runs each arm's updates back to back, alone on the GPU, which
also gives each arm's own reserved memory.
"""

from __future__ import annotations

import argparse
import bisect
import copy
import gc
import hashlib
import io
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch._dynamo

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from creditlab import config as config_mod  # noqa: E402
from creditlab.experiments.arms import parse_arm, parse_arms  # noqa: E402
from creditlab import runtime as rt  # noqa: E402
# rotation is re-exported: the order of a round is the runner's, one rule for the screen and this benchmark
from creditlab.experiments.arms_runner import (OwnMemory, cuda_allocated, graphs_compiled, keep_compiled_side_by_side,  # noqa: E402,F401
                                   rotation, run_rounds, StopRequest, steady_ratio, warm_variants)
from creditlab.data import SyntheticLoader  # noqa: E402
from creditlab.train import Trainer, build_model, row_dict  # noqa: E402

SCHEDULES = {
    "interleaved": "arms interleaved (one update of each per round, order rotated each round), all resident; "
                   "peak allocated counts an arm's own bytes, reserved memory is shared",
    "sequential": "arms run one after another, each alone on the GPU",
}


def arm_names(text: str) -> list[str]:
    """The arms of --arms: labels of the arm registry (creditlab/experiments/arms.py), as `creditlab compare` takes them."""
    try:
        return [spec.label for spec in parse_arms(text)]
    except config_mod.ConfigError as exc:
        raise SystemExit(str(exc)) from None


def overrides_of(name: str) -> list[str]:
    """The config overrides of an arm label: its registry arm's, then its own (`name@section.key=value`)."""
    try:
        return list(parse_arm(name).overrides)
    except config_mod.ConfigError as exc:
        raise SystemExit(str(exc)) from None


def state_bytes_sha(model: torch.nn.Module) -> str:
    buf = io.BytesIO()
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, buf)
    return hashlib.sha256(buf.getvalue()).hexdigest()


DEVICE_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")


def _sweep(trace: dict) -> tuple[float, list[tuple[float, dict, str]]]:
    """The GPU's kernels, memsets and copies of a Chrome trace in time order: the union of their intervals (us)
    and each idle stretch between them as (its start in us, the event that ends it, the name of the work before)."""
    device = sorted((e for e in trace.get("traceEvents", []) if e.get("ph") == "X"
                     and e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    busy, end, last, idle = 0.0, float("-inf"), None, []
    for e in device:
        start, stop = e["ts"], e["ts"] + e.get("dur", 0)
        if last is not None and start > end:
            idle.append((end, e, last))
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end, last = stop, e.get("name", "?")
    return busy, idle


def gpu_busy_ms(trace: dict, gaps: int = 0) -> tuple[float, int, list[tuple[float, str, str]]]:
    """The union of the GPU's kernel, memset and memcpy intervals in a Chrome trace, in ms, the kernel count,
    and the `gaps` longest idle stretches (ms, the work before, the work after). Measured against the update's
    wall time, the rest of the update is idle GPU."""
    busy, idle = _sweep(trace)
    stretches = [((after["ts"] - start) / 1e3, before, after.get("name", "?")) for start, after, before in idle]
    kernels = sum(1 for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "kernel")
    return busy / 1e3, kernels, sorted(stretches, reverse=True)[:gaps]


GC_LABEL = "python garbage collection"


class CollectionsInTrace:
    """Marks each of Python's garbage collections as a host range in a profiler trace (`GC_LABEL`), so that an
    idle stretch of the GPU during one is charged to it."""

    def __enter__(self):
        self._open = None
        gc.callbacks.append(self._event)
        return self

    def _event(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._open = torch.autograd.profiler.record_function(GC_LABEL)
            self._open.__enter__()
        elif self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._event)


def _traced(trainer: Trainer, updates: int, activities, shapes: bool = False) -> tuple[object, float, dict]:
    """`updates` more updates under torch.profiler: the profiler, their wall seconds, and the Chrome trace
    (with each op's input shapes when `shapes`)."""
    import tempfile

    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=activities, record_shapes=shapes) as prof, CollectionsInTrace():
        start = time.perf_counter()
        for _ in range(updates):
            trainer.train_update()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace_path))
        trace = json.loads(trace_path.read_text())
    return prof, wall, trace


def _gaps(gaps) -> str:
    return "; ".join(f"{ms:.2f} ms after {a[:50]} before {b[:50]}" for ms, a, b in gaps)


HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function")


def _host_side(trace: dict):
    """A trace's launching runtime calls by correlation id, and a function giving the host events that overlap
    a time range [lo, hi] (us)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    host = sorted((e for e in events if e.get("cat") in HOST_CATEGORIES), key=lambda e: e["ts"])
    starts = [e["ts"] for e in host]

    def overlapping(lo: float, hi: float) -> list[dict]:
        # host events are short next to an update; look back far enough for the outermost ones
        first = bisect.bisect_left(starts, lo - 5e5)
        return [e for e in host[first:bisect.bisect_right(starts, hi)] if e["ts"] + e.get("dur", 0) > lo]

    return launches, overlapping


def _launched_in(trace: dict):
    """Each kernel, memset and copy of a trace with host ops, with the host ops of the launching thread open
    at its launch, outermost first (empty when its launch is not in the trace or lies outside every op)."""
    launches, overlapping = _host_side(trace)
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in DEVICE_CATEGORIES:
            continue
        launch = launches.get(e.get("args", {}).get("correlation"))
        around = [] if launch is None else sorted(
            (h for h in overlapping(launch["ts"], launch["ts"]) if h.get("tid") == launch.get("tid")
             and h.get("cat") not in ("cuda_runtime", "cuda_driver") and h["ts"] <= launch["ts"]),
            key=lambda h: (h["ts"], -h.get("dur", 0)))
        yield e, around


def launch_origins(trace: dict, updates: int, listed: int = 40) -> str:
    """Where the GPU's work is launched from: every kernel, memset and copy of a trace with host ops, grouped by
    the launching thread's outermost and innermost op around its launch (an autograd node, a compiled region,
    the optimizer's step, an eager op of the trainer), with launches and GPU ms per update, most launches first.
    Each launch ends one kernel and starts another, so a group of many short kernels costs its kernel
    boundaries as well as its GPU time."""
    groups: dict[tuple[str, str], list[float]] = {}
    for e, around in _launched_in(trace):
        key = (around[0]["name"], around[-1]["name"]) if around else ("?", "?")
        group = groups.setdefault(key, [0, 0.0])
        group[0] += 1
        group[1] += e.get("dur", 0) / 1e3
    total = sum(g[0] for g in groups.values())
    lines = [f"GPU work launched per update: {total / updates:,.1f} kernels, memsets and copies, "
             f"in {len(groups)} groups", "", "| launched in (outermost op) | innermost op | launches per update | "
             "GPU ms per update |", "|---|---|---|---|"]
    lines += [f"| {outer[:90]} | {inner[:90]} | {n / updates:,.1f} | {ms / updates:.3f} |" for (outer, inner), (n, ms)
              in sorted(groups.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))[:listed]]
    return "\n".join(lines) + "\n"


def _product_flop(op: str, dims: list) -> float | None:
    """2 M K N of one product from its op's recorded input shapes, None for an op or shape it does not know."""
    shapes = [d for d in dims if isinstance(d, list)]
    try:
        if op in ("aten::mm", "aten::_scaled_mm"):
            (m, k), (_, n) = shapes[0], shapes[1]
        elif op == "aten::addmm":
            (m, k), (_, n) = shapes[1], shapes[2]
        elif op == "aten::bmm":
            (b, m, k), (_, _, n) = shapes[0], shapes[1]
            return 2.0 * b * m * k * n
        elif op in ("creditlab::relu2_linear", "creditlab::relu2_linear_gluon"):  # x (M, K), w (N, K)
            (m, k), (n, _) = shapes[0], shapes[1]
        elif op in ("creditlab::relu2_dgrad", "creditlab::relu2_dgrad_gluon"):  # dy (M, K), w (K, N)
            (m, k), (_, n) = shapes[0], shapes[1]
        else:
            return None
    except (IndexError, TypeError, ValueError):
        return None
    return 2.0 * m * k * n


PRODUCT_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_mm", "creditlab::relu2_linear",
               "creditlab::relu2_linear_gluon", "creditlab::relu2_dgrad", "creditlab::relu2_dgrad_gluon")


def product_shapes(trace: dict, updates: int) -> str:
    """Every product of a trace recorded with shapes, grouped by its op and its operands' shapes, the groups with
    the most GPU time first: op calls and GPU ms per update, the kernels they ran and the rate, 2 M K N per call
    over those kernels' time. The rate says which of the step's products sit below what the card's tensor cores
    give."""
    groups: dict[tuple[str, str], dict] = {}
    for e, around in _launched_in(trace):
        op = next((h for h in reversed(around) if h["name"] in PRODUCT_OPS), None)
        if op is None:
            continue
        dims = op.get("args", {}).get("Input Dims", [])
        key = (op["name"], " x ".join(str(tuple(d)) for d in dims if isinstance(d, list) and d))
        group = groups.setdefault(key, {"flop": _product_flop(op["name"], dims), "calls": set(), "kernels": {}})
        group["calls"].add(id(op))
        name = e.get("name", "?")
        group["kernels"][name] = group["kernels"].get(name, 0.0) + e.get("dur", 0) / 1e3
    lines = ["| op | operand shapes | calls per update | GPU ms per update | us per call | TFLOP/s | kernels |",
             "|---|---|---|---|---|---|---|"]
    total = 0.0
    for (op, shapes), g in sorted(groups.items(), key=lambda kv: -sum(kv[1]["kernels"].values())):
        ms, calls = sum(g["kernels"].values()), len(g["calls"])
        total += ms
        rate = f"{g['flop'] * calls / (ms * 1e9):.0f}" if g["flop"] and ms else "-"
        kernels = "; ".join(f"{k[:60]} {v / updates:.2f}" for k, v in sorted(g["kernels"].items(), key=lambda kv: -kv[1]))
        lines.append(f"| {op} | {shapes} | {calls / updates:,.1f} | {ms / updates:.3f} | {ms * 1e3 / calls:.1f} | "
                     f"{rate} | {kernels} |")
    head = [f"Products: {total / updates:.1f} GPU ms per update in {len(groups)} (op, shapes) groups", ""]
    return "\n".join(head + lines) + "\n"


def idle_causes(trace: dict, updates: int, floor_ms: float = 0.05, listed: int = 12) -> str:
    """What the host did while the GPU idled, from a trace with host ops: each idle stretch of at least
    `floor_ms` ends with a kernel (or copy) that a runtime call on the host launched (matched by correlation
    id). Launched within the stretch, the GPU waited for the host: the stretch is charged to the longest runtime
    call of the launching thread between the stretch's start and the launch (a synchronization, an allocation,
    a garbage collection marked by CollectionsInTrace, or Python between launches when none stands out), and to
    that thread's outermost op around the launch. Launched before the stretch, the work waited on something else
    (another stream, the host's copy). Totals per cause, ms per update."""
    launches, overlapping = _host_side(trace)
    totals: dict[str, float] = {}
    rows = []
    for end, e, _ in _sweep(trace)[1]:
        gap = (e["ts"] - end) / 1e3
        if gap < floor_ms:
            continue
        launch = launches.get(e.get("args", {}).get("correlation"))
        if launch is None or launch["ts"] <= end:
            key = "queued before the stretch: waited on another stream or a copy"
        else:
            lo, hi = end, launch["ts"]
            thread = launch.get("tid")  # the thread that launched the work (the backward's is autograd's)
            calls = [h for h in overlapping(lo, hi) if h is not launch and h.get("tid") == thread
                     and (h.get("cat") in ("cuda_runtime", "cuda_driver") or h.get("name") == GC_LABEL)]
            inside = {id(h): min(h["ts"] + h.get("dur", 0), hi) - max(h["ts"], lo) for h in calls}
            longest = max(calls, key=lambda h: inside[id(h)], default=None)
            cause = (f"host in {longest['name']}" if longest is not None and inside[id(longest)] >= 0.5 * (hi - lo)
                     else "host between launches (Python, dispatch)")
            outer = [h for h in overlapping(hi, hi)
                     if h.get("tid") == thread and h.get("cat") not in ("cuda_runtime", "cuda_driver")]
            key = f"{cause}; launched in {min(outer, key=lambda h: h['ts'])['name'] if outer else '?'}"
        totals[key] = totals.get(key, 0.0) + gap
        rows.append((gap, e.get("name", "?"), key))
    lines = [f"idle stretches of {floor_ms} ms or more: {len(rows) / updates:.1f} per update, "
             f"{sum(r[0] for r in rows) / updates:.2f} ms per update", "", "| cause | ms per update |", "|---|---|"]
    lines += [f"| {k[:160]} | {v / updates:.2f} |" for k, v in sorted(totals.items(), key=lambda kv: -kv[1])]
    lines += ["", "longest:"] + [f"- {g:.3f} ms before {name[:60]}: {key[:160]}" for g, name, key in
                                 sorted(rows, reverse=True)[:listed]]
    return "\n".join(lines) + "\n"


def synchronizations(trainer: Trainer, path: Path) -> None:
    """One more update with CUDA's synchronization warnings on: every call that makes the host wait for the
    device, with where it came from (the innermost frames of the package), and the caching allocator's device
    allocations, frees and retries during that update."""
    import traceback
    import warnings

    before = torch.cuda.memory_stats()
    seen: dict[str, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("always")

        def note(message, category, filename, lineno, file=None, line=None):
            stack = [f for f in traceback.extract_stack()[:-1] if "creditlab" in f.filename or "arms" in f.filename]
            where = " < ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(stack[-4:]))
            key = f"{str(message).splitlines()[0][:80]} at {where or '?'}"
            seen[key] = seen.get(key, 0) + 1

        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_update()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    after = torch.cuda.memory_stats()
    stats = {k: after.get(k, 0) - before.get(k, 0) for k in
             ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")}
    lines = [f"synchronizing calls in one update: {sum(seen.values())}", ""]
    lines += [f"- {n} x {k}" for k, n in sorted(seen.items(), key=lambda kv: -kv[1])]
    lines += ["", "caching allocator during that update: " + ", ".join(f"{k} {v}" for k, v in stats.items())]
    path.write_text("\n".join(lines) + "\n")


def profile(trainer: Trainer, path: Path, updates: int = 2) -> None:
    """Kernel-level CUDA time of a few more updates, largest first, headed by how long the GPU was busy.

    The GPU's idle time is read first from a trace of GPU activity alone: recording every host-side op as well
    slows the host enough to starve the GPU, so that trace's idle stretches say more about the profiler than
    about the step."""
    from torch.profiler import ProfilerActivity

    _, wall, trace = _traced(trainer, updates, [ProfilerActivity.CUDA])
    gpu_busy, _, gpu_gaps = gpu_busy_ms(trace, gaps=6)
    prof, _, trace = _traced(trainer, updates, [ProfilerActivity.CPU, ProfilerActivity.CUDA], shapes=True)
    busy, kernels, gaps = gpu_busy_ms(trace, gaps=8)
    path.with_name(path.stem + "_idle.md").write_text(idle_causes(trace, updates))
    path.with_name(path.stem + "_launches.md").write_text(launch_origins(trace, updates))
    path.with_name(path.stem + "_products.md").write_text(product_shapes(trace, updates))
    synchronizations(trainer, path.with_name(path.stem + "_syncs.md"))
    head = (f"GPU busy (union of kernel, memset and memcpy intervals): {busy / updates:.1f} ms per update, "
            f"{kernels / updates:,.0f} kernels per update, over {updates} profiled updates\n"
            f"GPU activity alone traced: busy {gpu_busy / updates:.1f} of {wall * 1e3 / updates:.1f} ms wall per "
            f"update; longest idle stretches: {_gaps(gpu_gaps)}\n"
            f"with host ops traced too, longest idle stretches: {_gaps(gaps)}\n\n")
    path.write_text(head + prof.key_averages().table(sort_by="cuda_time_total", row_limit=150,
                                                     max_name_column_width=90))


def _where(frames: list[dict]) -> str:
    """The innermost creditlab or compiled-graph frames of an allocation's stack, shortened."""
    keep = [f for f in frames if "creditlab" in f["filename"] or "torchinductor" in f["filename"]
            or "autograd" in f["filename"]]
    return " < ".join(f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in keep[:3]) or "?"


def memory_at_peak(trainer: Trainer, path: Path) -> None:
    """Replays the allocator's events of one more update and writes what is live at its peak, by size.
    (Allocations older than the update, such as parameters and optimizer state, are not in the trace.)"""
    torch.cuda.memory._record_memory_history(max_entries=500_000)
    trainer.train_update()
    events = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    live, total, peak, peak_at = {}, 0, 0, 0
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])
        if total > peak:
            peak, peak_at = total, i
    live = {}
    for e in events[:peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    groups: dict[str, list[int]] = {}
    for e in live.values():
        groups.setdefault(_where(e.get("frames", [])), []).append(e["size"])
    lines = [f"peak of the update's own allocations: {peak / 2**20:,.0f} MiB at event {peak_at} of "
             f"{len(events)}; allocated there by: {_where(events[peak_at].get('frames', []))}", "",
             "| MiB | blocks | allocated at |", "|---|---|---|"]
    for where, sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:40]:
        lines.append(f"| {sum(sizes) / 2**20:,.0f} | {len(sizes)} | {where} |")
    path.write_text("\n".join(lines) + "\n")


def resident_parser(doc: str, arms: str, rounds: int) -> argparse.ArgumentParser:
    """The arguments of a benchmark over resident arms (host_lead.py); a script adds its own."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--arms", default=arms)
    ap.add_argument("--preset", default="seed")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    return ap


def parse_resident(ap: argparse.ArgumentParser) -> tuple[argparse.Namespace, list[str]]:
    """(args, arm names) of a resident_parser, the names checked and the rounds enough for a median after the
    first two (which compile and warm)."""
    args = ap.parse_args()
    if args.rounds < 5:
        ap.error("--rounds must be at least 5 (the first two are left out, and a median needs three)")
    names = args.arms.split(",")
    for name in names:
        overrides_of(name)  # fail on a misspelt arm before any GPU time is spent
    return args, names


def initial_state(base: config_mod.Config, runtime: rt.Runtime) -> dict:
    """The model state every arm starts from, kept on the host so that it is in no arm's memory figures."""
    return {k: v.detach().cpu().clone() for k, v in build_model(base, runtime).state_dict().items()}


def build_resident(names: list[str], base: config_mod.Config) -> tuple[rt.Runtime, dict]:
    """Every arm of `names` built from one initialization, all resident and compiled side by side (the arms of
    host_lead.py): (the runtime, {name: arm})."""
    runtime = rt.resolve(base.train)
    init_state = initial_state(base, runtime)
    keep_compiled_side_by_side()
    built = {}
    for name in names:
        print(f"== build {name}", flush=True)
        built[name] = build_arm(name, base, init_state)
    return runtime, built


def build_arm(name: str, base: config_mod.Config, init_state: dict) -> dict:
    """One arm's trainer, compiled and warmed (one forward and backward, no optimizer step, data rewound)."""
    cfg = copy.deepcopy(base)
    overrides = overrides_of(name)
    for item in overrides:
        key, _, value = item.partition("=")
        config_mod._assign(cfg, key, value)
    config_mod.validate(cfg)
    runtime = rt.resolve(cfg.train)
    model = build_model(cfg, runtime)
    model.load_state_dict(init_state)
    init_sha = state_bytes_sha(model)
    loader = SyntheticLoader(cfg.model.vocab_size, cfg.train.micro_batch, cfg.model.seq_len, cfg.train.seed)
    trainer = Trainer(cfg, runtime, model=model, loader=loader, peak_tflops=base_peak)
    # What one micro-batch's forward keeps for its backward (after compilation, on a second call).
    saved = []
    for _ in range(2):
        inputs, targets = trainer._batch()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        # the source's own context, as the trainer asks for it (a sketch takes its first basis here)
        credit = trainer.source.context(trainer, inputs, targets, "synthetic" if trainer.source.omits else "exact",
                                        1.0)
        with runtime.autocast():
            loss = trainer._forward(inputs, targets, credit=credit, loss_chunk=cfg.train.loss_chunk)
        torch.cuda.synchronize()
        saved.append((torch.cuda.memory_allocated() - before) / 2**20)
        loss.backward()
        trainer.optimizers.zero_grad()
        del loss
    warm_variants(trainer)  # dropbp's block variants, so that its timed updates time its step, not the compiler
    trainer.loader.load_state_dict({**trainer.loader.state_dict(), "position": 0})
    gc.collect()
    torch.cuda.synchronize()
    return {"name": name, "overrides": overrides, "init_sha256": init_sha, "trainer": trainer, "rows": [],
            "saved_by_forward_mib": saved[-1], "wall_s": 0.0}


class CollectorTime:
    """Host seconds spent in Python's garbage collections (through gc.callbacks), summed until taken."""

    def __init__(self):
        self.total, self._start = 0.0, None
        gc.callbacks.append(self._event)

    def _event(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.total += time.perf_counter() - self._start
            self._start = None

    def take(self) -> float:
        total, self.total = self.total, 0.0
        return total


def run_update(arm: dict, own: OwnMemory, collector: CollectorTime) -> None:
    """One timed update of an arm, its memory peak counted as if it ran alone (see OwnMemory), and the time
    Python's collector took during it."""
    collector.take()
    trainer = arm["trainer"]
    graphs = graphs_compiled()
    start = time.perf_counter()
    arm["rows"].append(own.update(arm["name"], trainer.train_update))
    arm["wall_s"] += time.perf_counter() - start
    arm.setdefault("gc_s", []).append(collector.take())
    arm.setdefault("graphs_compiled", []).append(graphs_compiled() - graphs)


def keep_full_rounds(arm: dict, rounds: int) -> None:
    """Drop an arm's updates after the first `rounds` (a run stopped mid-round: the arms that stepped in the
    unfinished round would otherwise have one row more than those that did not, and no ratio pairs them)."""
    for key in ("rows", "gc_s", "graphs_compiled"):
        del arm.setdefault(key, [])[rounds:]


def summarize_arm(arm: dict) -> dict:
    rows = arm["rows"]
    out = {"arm": arm["name"], "overrides": arm["overrides"], "init_sha256": arm["init_sha256"],
           "rows": [row_dict(r) | {"graphs_compiled": g} for r, g in zip(rows, arm["graphs_compiled"])],
           "wall_s": arm["wall_s"], "first_update_s": rows[0].seconds,
           "saved_by_forward_mib": arm["saved_by_forward_mib"]}
    window = rows[-6:]
    out["median_last6_s"] = statistics.median(r.seconds for r in window)
    out["median_last6_tokens_per_s"] = statistics.median(r.tokens_per_s for r in window)
    out["median_last6_mfu"] = statistics.median(r.mfu for r in window) if window[0].mfu is not None else None
    out["peak_allocated_mib"] = max(r.peak_allocated_mib for r in rows[1:] or rows)
    reserved = [r.peak_reserved_mib for r in rows[1:] or rows if r.peak_reserved_mib is not None]
    out["peak_reserved_mib"] = max(reserved) if reserved else None
    out["loss_last"] = rows[-1].loss
    # collections are rare and long: their mean over the updates after the first, not a median
    gc_s = arm.get("gc_s", [])[1:]
    out["gc_ms_per_update"] = 1e3 * sum(gc_s) / len(gc_s) if gc_s else None
    out["gc_ms_max"] = 1e3 * max(gc_s) if gc_s else None
    out.update(cycle_estimate(out["rows"]))
    out.update(refresh_estimate(arm["trainer"]))
    return out


def refresh_estimate(trainer: Trainer, times: int = 3) -> dict:
    """For a source that refreshes a basis every so many updates (the sketch): the refresh's own seconds, timed
    apart (a short run sees at most its first, which compiles), and its share per update. Its cost per update is
    then counted as `creditlab compare` counts it: the synthetic update plus the refresh at its share of the
    updates (compare records a refreshing update as a kind of its own, at its own median)."""
    source = trainer.source
    if not hasattr(source, "refresh") or not getattr(source, "every", 0) or getattr(source, "form", "") == "sampled":
        return {}
    seconds = []
    for _ in range(times):
        with rt.Timer(trainer.runtime) as timed:
            source.refresh(trainer.model, trainer.update_index)
        seconds.append(timed.seconds)
    refresh = statistics.median(seconds)
    return {"refresh_s": refresh, "refresh_every": source.every, "refresh_share_s": refresh / source.every}


def cycle_estimate(rows: list[dict]) -> dict:
    """For an arm that mixes teacher and synthetic updates (one teacher in K): the seconds of one cycle per
    update, (median teacher + (K - 1) median synthetic) / K, over the updates after the first cycle (the first
    teacher update compiles). Medians, as for every other arm: one slow update does not move the estimate."""
    kinds = [r["kind"] for r in rows]
    teacher_at = [i for i, kind in enumerate(kinds) if kind == "teacher"]
    if len(teacher_at) < 3 or "synthetic" not in kinds:
        return {}
    k = teacher_at[1] - teacher_at[0]
    later = rows[k:]
    teacher = statistics.median(r["seconds"] for r in later if r["kind"] == "teacher")
    synthetic = statistics.median(r["seconds"] for r in later if r["kind"] == "synthetic")
    return {"cycle_s": (teacher + (k - 1) * synthetic) / k, "cycle_every": k, "cycle_teacher_s": teacher,
            "cycle_synthetic_s": synthetic}


def diagnose(arm: dict, profile_to: Path | None, memory_to: Path | None) -> None:
    if profile_to is not None:
        profile(arm["trainer"], profile_to)
    if memory_to is not None:
        try:
            memory_at_peak(arm["trainer"], memory_to)
        except Exception as exc:  # noqa: BLE001 - a diagnostic must not lose the arm's timings
            memory_to.write_text(f"memory trace failed: {type(exc).__name__}: {exc}\n")


def release(arm: dict) -> None:
    arm.pop("trainer", None)
    gc.collect()
    torch.cuda.empty_cache()


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _tflops(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.0f} TFLOP/s"


def paired_ms(rows: list[dict], base_rows: list[dict], window: int = 6) -> tuple[float, float, float] | None:
    """Median, least and largest of the per-round differences rows - base_rows (ms) over the last `window`
    rounds: with the arms interleaved, round r of every arm ran within seconds of the others, so the difference
    carries less of the card's drift than the difference of two medians. None if the arms ran different rounds."""
    if len(rows) != len(base_rows) or len(rows) < window:
        return None
    diffs = [1e3 * (a["seconds"] - b["seconds"]) for a, b in zip(rows[-window:], base_rows[-window:])]
    return statistics.median(diffs), min(diffs), max(diffs)


def _with_refresh(r: dict) -> list[dict]:
    """An arm's rows with its refresh's share added to every update (as compare counts it), for the per-round
    columns; the rows themselves as they are for every other arm."""
    share = r.get("refresh_share_s")
    return r["rows"] if share is None else [row | {"seconds": row["seconds"] + share} for row in r["rows"]]


def updates_said(meta: dict) -> str:
    stopped = meta.get("stopped")
    if stopped:
        return (f"{stopped['full_rounds']} updates (stopped by {stopped['signal']} after {stopped['full_rounds']} of "
                f"{meta['updates']} rounds)")
    return f"{meta['updates']} updates"


def markdown(results: list[dict], meta: dict) -> str:
    base = results[0]["median_last6_s"]
    paired = meta["schedule"] == "interleaved"
    lines = [f"GPU: {meta['env'].get('gpu')}, torch {meta['env']['torch']}, CUDA {meta['env']['cuda']}, "
             f"driver {meta['env'].get('driver')}; bf16 matmul rate measured in this run: "
             f"{_tflops(meta['matmul_tflops'])}; {updates_said(meta)} per arm, last-six medians; "
             f"{SCHEDULES[meta['schedule']]}",
             "", "| arm | s/update | ratio vs " + results[0]["arm"] + " | tokens/s | MFU | peak alloc MiB | "
             "peak reserved MiB | first update s | last loss |" + (" paired ms vs " + results[0]["arm"] +
                                                                 " (median, range) | ratio per round, rounds 3 on, "
                                                                 "none compiling (median, 95% interval), rounds |" if paired else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if paired else "")]
    notes = []
    for r in results:
        mfu = f"{100 * r['median_last6_mfu']:.1f}%" if r["median_last6_mfu"] is not None else "-"
        seconds = r["median_last6_s"]
        tokens_per_s = r["median_last6_tokens_per_s"]
        if "cycle_s" in r:
            seconds, mfu = r["cycle_s"], "-"
            tokens_per_s = r["rows"][-1]["tokens"] / seconds
            notes.append(f"{r['arm']}: s/update is one cycle's mean, (median teacher {r['cycle_teacher_s']:.4f} + "
                         f"{r['cycle_every'] - 1} x median synthetic {r['cycle_synthetic_s']:.4f}) / "
                         f"{r['cycle_every']}, over the updates after the first cycle.")
        if "refresh_s" in r:
            seconds += r["refresh_share_s"]
            tokens_per_s = r["rows"][-1]["tokens"] / seconds
            notes.append(f"{r['arm']}: s/update counts its refresh: median update {r['median_last6_s']:.4f} + refresh "
                         f"{r['refresh_s']:.4f} s (timed apart, median of 3) / every {r['refresh_every']} updates; "
                         f"so do its paired and per-round columns.")
        line = (f"| {r['arm']} | {seconds:.4f} | {seconds / base:.4f} | "
                f"{tokens_per_s:,.0f} | {mfu} | {r['peak_allocated_mib']:,.0f} | "
                f"{_mib(r['peak_reserved_mib'])} | {r['first_update_s']:.1f} | {r['loss_last']:.4f} |")
        if paired:
            rows = _with_refresh(r)
            diff = None if "cycle_s" in r or r is results[0] else paired_ms(rows, results[0]["rows"])
            line += " - |" if diff is None else f" {diff[0]:+.1f} ({diff[1]:+.1f} .. {diff[2]:+.1f}) |"
            ratio = None if "cycle_s" in r or r is results[0] else steady_ratio(rows, results[0]["rows"])
            line += " - |" if ratio is None else f" {ratio[0]:.4f} ({ratio[1]:.4f} .. {ratio[2]:.4f}), {ratio[3]} |"
        lines.append(line)
    if paired:
        notes.append("paired ms: per round, the arm's update time minus the first arm's in the same round, over the "
                     "last six rounds (a cycle mixes kinds of update and has none).")
        notes.append("ratio per round: the arm's update time over the first arm's in the same round, its median over "
                     "every round from the third (the first two compile and warm) in which neither arm compiled a graph "
                     "(dropbp's drop patterns meet new variants for many updates), with a 95% bootstrap interval of "
                     "that median and the rounds it read.")
    check = meta.get("accounted")
    if check:
        notes.append(f"accounted: rounds {check['from_round']}-{check['rounds']} took {check['wall_s']:.3f} s of wall "
                     f"time, of which the updates' own times sum to {check['updates_s']:.3f} s "
                     f"({100 * check['updates_s'] / check['wall_s']:.1f}%); the rest is time between updates "
                     f"that no update counts.")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def main() -> int:
    global base_peak
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="output folder")
    ap.add_argument("--arms", default="native,zero")
    ap.add_argument("--preset", default="seed")
    ap.add_argument("--updates", type=int, default=12)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--profile", default="", help="comma-separated arms to profile after their timed updates")
    ap.add_argument("--memory", default="", help="comma-separated arms whose memory peak to break down")
    ap.add_argument("--schedule", choices=tuple(SCHEDULES), default="interleaved",
                    help="interleaved: one update of each arm per round, all arms resident (drift in clocks and "
                         "temperature falls on every arm alike); sequential: each arm's updates back to back, alone "
                         "on the GPU (per-arm reserved memory)")
    ap.add_argument("--resummarize", metavar="ARMS_JSON",
                    help="recompute the summaries and the table of a finished run from its stored rows (no GPU)")
    args = ap.parse_args()
    if args.resummarize:
        return resummarize(Path(args.resummarize))
    if not args.out:
        ap.error("--out is required")
    names = arm_names(args.arms)  # fail on a misspelt arm before any GPU time is spent
    out = rt.gpu_benchmark_folder(args.out)
    if out is None:
        return 2
    base = config_mod.load(args.preset, args.overrides)
    runtime = rt.resolve(base.train)
    base_peak = rt.measure_matmul_tflops(runtime)
    init_state = initial_state(base, runtime)
    gc.collect()
    torch.cuda.empty_cache()
    meta = {"preset": args.preset, "overrides": args.overrides, "updates": args.updates, "schedule": args.schedule,
            "env": rt.environment(runtime), "matmul_tflops": base_peak, "config": base.to_dict()}
    profiled, traced = set(args.profile.split(",")), set(args.memory.split(","))
    results = {}

    def save() -> None:
        done = [results[n] for n in names if n in results]
        (out / "arms.json").write_text(json.dumps({"meta": meta, "results": done}, indent=2, default=str))

    def report(r: dict) -> None:
        if "oom" in r:
            print(f"arm {r['arm']}: out of memory", flush=True)
            return
        print(f"arm {r['arm']}: {r['median_last6_s']:.4f} s/update, peak {r['peak_allocated_mib']:,.0f} MiB "
              f"(one forward keeps {r['saved_by_forward_mib']:,.0f} MiB) (reserved {_mib(r['peak_reserved_mib'])}), "
              f"first update {r['first_update_s']:.1f} s"
              + ("" if r.get("gc_ms_per_update") is None else
                 f", garbage collection {r['gc_ms_per_update']:.1f} ms per update (longest {r['gc_ms_max']:.1f})"),
              flush=True)

    def out_of_memory(name: str, exc: Exception) -> None:
        results[name] = {"arm": name, "oom": str(exc)[:2000]}
        gc.collect()
        torch.cuda.empty_cache()

    def diagnostics(arm: dict) -> None:
        name = arm["name"]
        stem = name.replace("+", "-")  # file names of plain characters
        diagnose(arm, out / f"profile_{stem}.txt" if name in profiled else None,
                 out / f"memory_{stem}.md" if name in traced else None)

    collector = CollectorTime()
    stopped = None  # the signal that stopped the run, the rounds every arm finished kept (interleaved schedule)
    if args.schedule == "sequential":
        for name in names:
            print(f"== arm {name}", flush=True)
            # Every arm compiles the same code objects; without a reset, the compiler's per-function cache limit
            # is reached after a few arms and later arms silently run eagerly.
            torch._dynamo.reset()
            own = OwnMemory(cuda_allocated, shared=False)
            try:
                arm = own.build(name, lambda: build_arm(name, base, init_state))
                for _ in range(args.updates):
                    run_update(arm, own, collector)
                results[name] = summarize_arm(arm)
                diagnostics(arm)
            except torch.OutOfMemoryError as exc:
                out_of_memory(name, exc)
            arm = None
            gc.collect()
            torch.cuda.empty_cache()
            report(results[name])
            save()
    else:
        # All arms resident at once (each keeps its parameters and optimizer state, about 1 GB at the seed
        # preset), through the package's arms runner, which the resource screen uses too.
        keep_compiled_side_by_side()
        own = OwnMemory(cuda_allocated, shared=True)
        arms = {}
        for name in names:
            print(f"== build {name}", flush=True)
            try:
                arms[name] = own.build(name, lambda: build_arm(name, base, init_state))
            except torch.OutOfMemoryError as exc:
                out_of_memory(name, exc)
                report(results[name])
        live = [n for n in names if n in arms]

        def step(at) -> bool:
            try:
                run_update(arms[at.arm], own, collector)
                return True
            except torch.OutOfMemoryError as exc:
                release(arms[at.arm])
                out_of_memory(at.arm, exc)
                return False  # retired; the other arms go on

        accounted = {"from_round": 3, "rounds": args.updates}
        full_rounds = [0]

        def after_round(r: int) -> None:
            full_rounds[0] = r + 1
            if r == 1:  # the wall clock of the rounds the ratios are read on, against the updates' own times
                accounted["start"] = time.perf_counter()
            print(f"round {r + 1}/{args.updates}: " + ", ".join(
                f"{n} {arms[n]['rows'][-1].seconds:.4f}" for n in live if n not in results and arms[n]["rows"]),
                flush=True)

        with StopRequest(lambda name: print(
                f"\narms.py: {name}: stopping after this update, keeping the rounds every arm finished (again to "
                "stop at once, nothing saved)", file=sys.stderr, flush=True)) as stop:
            run_rounds(live, args.updates, step, after_round=after_round, stop=lambda: stop.signal is not None)
        stopped = stop.signal
        if stopped:
            meta["stopped"] = {"signal": stopped, "full_rounds": full_rounds[0]}
        elif "start" in accounted and not results:  # every arm ran every round
            accounted["wall_s"] = time.perf_counter() - accounted.pop("start")
            accounted["updates_s"] = sum(r.seconds for n in live for r in arms[n]["rows"][2:])
            meta["accounted"] = accounted
        for name in live:
            if name not in results:
                keep_full_rounds(arms[name], full_rounds[0])
                if arms[name]["rows"]:
                    results[name] = summarize_arm(arms[name])
                    if not stopped:
                        diagnostics(arms[name])
            release(arms[name])
            if name in results:
                report(results[name])
        save()
        if stopped:
            print(f"arms.py: stopped by {stopped} after {full_rounds[0]} of {args.updates} rounds; "
                  f"{out / 'arms.json'} keeps them", file=sys.stderr, flush=True)
    meta["reserved_peak_all_arms_mib"] = torch.cuda.max_memory_reserved() / 2**20
    save()
    results = [results[n] for n in names if n in results]
    ok = [r for r in results if "oom" not in r]
    if ok:
        table = markdown(ok, meta)
        (out / "arms.md").write_text(table)
        print(table)
    return 130 if stopped else 0


def resummarize(path: Path) -> int:
    """The rows are the record; the summaries are derived. Rewrites ARMS_JSON's derived fields and its table."""
    data = json.loads(path.read_text())
    for r in data["results"]:
        if "rows" in r:
            for stale in [k for k in r if k.startswith("cycle_")]:
                del r[stale]
            r.update(cycle_estimate(r["rows"]))
    path.write_text(json.dumps(data, indent=2, default=str))
    table = markdown([r for r in data["results"] if "oom" not in r], data["meta"])
    path.with_suffix(".md").write_text(table)
    print(table)
    return 0


base_peak = None

if __name__ == "__main__":
    sys.exit(main())
