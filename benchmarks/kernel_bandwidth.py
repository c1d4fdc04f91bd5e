"""Every compiler-generated kernel of an update: its time in the step, the bytes its arguments hold, and the
bandwidth those make, so that the memory-bound passes furthest from the card's streaming rate stand out.

    python benchmarks/kernel_bandwidth.py --out DIR [--arms native,zero,learned] [--preset seed] [--set k=v ...]

Each arm runs in a process of its own with a compiler cache of its own (kernel names repeat across graphs), with
TORCHINDUCTOR_BENCHMARK_KERNEL set, which makes the compiler write each kernel's byte count into its source and
changes nothing it runs. The times come from a profiler trace of one update's micro-batches (forward and
backward, after two warm ones); the bytes from the sources. Only generated kernels are listed: cuBLAS, cuDNN and
the package's own Triton operators are not. Bytes are the arguments' sizes: a kernel that reads part of a tensor
is credited with all of it, one that reads a tensor twice with it once. A name the compiler gave two kernels of
different sizes is listed without a bandwidth. Writes DIR/kernel_bandwidth.json and DIR/kernel_bandwidth.md.
Any CUDA machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# The streaming rate of a device-to-device copy on an H200 (about 4.3 TB/s counting bytes read and written;
# the datasheet's 4.8 is not reached by a copy): the ceiling a memory-bound pass is held to here.
STREAMING_GBPS = 4300.0
META = re.compile(r"^(triton_\w+) = async_compile\.triton\('\1', '''(.*?)'''", re.S | re.M)
NUM_GB = re.compile(r"'kernel_num_gb': ([0-9.eE+-]+)")


def kernel_bytes(cache: Path) -> dict[str, set[float]]:
    """Each generated kernel's byte counts (GB) by name, from the sources in a compiler cache."""
    found = defaultdict(set)
    for path in cache.rglob("*.py"):
        for kernel, source in META.findall(path.read_text(errors="replace")):
            match = NUM_GB.search(source)
            if match:
                found[kernel].add(round(float(match.group(1)), 6))
    return found


def measure_arm(name: str, preset: str, overrides: list[str]) -> dict:
    """One arm, in this process: two warm micro-batches, then one update's micro-batches under the profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from arms import overrides_of
    from creditlab import config as config_mod
    from creditlab import runtime as rt
    from creditlab.data import SyntheticLoader
    from creditlab.train import Trainer

    cfg = config_mod.load(preset, overrides)
    for item in overrides_of(name):
        key, _, value = item.partition("=")
        config_mod._assign(cfg, key, value)
    config_mod.validate(cfg)
    loader = SyntheticLoader(cfg.model.vocab_size, cfg.train.micro_batch, cfg.model.seq_len, cfg.train.seed)
    trainer = Trainer(cfg, rt.resolve(cfg.train), loader=loader)
    kind = "synthetic" if trainer.source.omits else "exact"

    def micro_batch():
        inputs, targets = trainer._batch()
        credit = trainer.source.context(trainer, inputs, targets, kind, 1.0 / cfg.train.grad_accum)
        trainer.forward_backward(inputs, targets, credit, 1.0 / cfg.train.grad_accum)

    for _ in range(2):
        micro_batch()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(cfg.train.grad_accum):
            micro_batch()
        torch.cuda.synchronize()
    times = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.name.startswith("triton_"):
            times[event.name][0] += 1
            times[event.name][1] += event.device_time_total / 1e3
    return {"arm": name, "times": {k: {"calls": n, "ms": ms} for k, (n, ms) in times.items()}}


def table(measured: dict, sizes: dict[str, set[float]], top: int) -> tuple[dict, list[str]]:
    rows = []
    for kernel, t in measured["times"].items():
        gb = sizes.get(kernel, set())
        per_call = next(iter(gb)) if len(gb) == 1 else None
        floor = None if per_call is None else t["calls"] * per_call / STREAMING_GBPS * 1e3
        rows.append({"kernel": kernel, "calls": t["calls"], "ms": t["ms"], "gb_per_call": per_call,
                     "ms_at_streaming_rate": floor})
    rows.sort(key=lambda r: -(r["ms"] - (r["ms_at_streaming_rate"] or r["ms"])))
    sized = [r for r in rows if r["gb_per_call"] is not None]
    total = sum(r["ms"] for r in rows)
    over = sum(r["ms"] - r["ms_at_streaming_rate"] for r in sized)
    lines = [f"## {measured['arm']}: {len(rows)} generated kernels, {sum(r['calls'] for r in rows)} calls and "
             f"{total:.1f} ms per update; the {len(sized)} with one size take {over:+.1f} ms over "
             f"{STREAMING_GBPS / 1e3:.1f} TB/s", "",
             "| kernel | calls per update | ms per update | GB per call | TB/s | ms over the streaming rate |",
             "|---|---|---|---|---|---|"]
    for r in rows[:top]:
        if r["gb_per_call"] is None:
            lines.append(f"| `{r['kernel'][:90]}` | {r['calls']} | {r['ms']:.2f} | - | - | - |")
            continue
        rate = r["calls"] * r["gb_per_call"] / r["ms"]
        lines.append(f"| `{r['kernel'][:90]}` | {r['calls']} | {r['ms']:.2f} | {r['gb_per_call']:.4f} | "
                     f"{rate:.2f} | {r['ms'] - r['ms_at_streaming_rate']:+.2f} |")
    return {"arm": measured["arm"], "ms_per_update": total, "over_streaming_ms": over, "kernels": rows}, lines + [""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--arms", default="native,zero,learned")
    ap.add_argument("--preset", default="seed")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure this arm here, print its JSON
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(measure_arm(args.one, args.preset, args.overrides)), flush=True)
        return 0
    from creditlab import runtime as rt

    out = rt.gpu_benchmark_folder(args.out)
    if out is None:
        return 2
    results, lines = [], []
    for name in args.arms.split(","):
        print(f"== arm {name}", flush=True)
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_BENCHMARK_KERNEL="1", TORCHINDUCTOR_CACHE_DIR=cache)
            command = [sys.executable, __file__, "--out", args.out, "--one", name, "--preset", args.preset]
            command += [f"--set={o}" for o in args.overrides]
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return done.returncode
            measured = json.loads(done.stdout.rsplit("RESULT ", 1)[1])
            result, text = table(measured, kernel_bytes(Path(cache)), args.top)
        results.append(result)
        lines += text
    rt.write_benchmark(out, "kernel_bandwidth", {"preset": args.preset, "overrides": args.overrides,
                                                 "streaming_gbps": STREAMING_GBPS, "arms": results}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
