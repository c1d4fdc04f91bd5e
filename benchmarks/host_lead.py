"""Is an arm's update bound by the host anywhere? Each update timed twice: as it runs, and with the GPU held back
at its start by a sleep kernel, so that the host runs ahead and fills the launch queue before the GPU begins.

    python benchmarks/host_lead.py --out DIR [--arms native,zero,learned] [--rounds 12] [--lead-ms 40]

An update whose GPU is never starved by its host takes the sleep's time longer with the lead, and no more. Where
the host falls behind somewhere (a stretch of Python, dispatch or launches longer than the GPU work queued
ahead of it), the lead absorbs that stretch, and the update with the lead takes less than the plain update plus
the sleep: the difference is the host-bound time the lead removed, up to what the launch queue holds.
The sleep's own time is measured alone, alternated with the updates. Arms are built as `arms.py` builds them
(same initialization, same micro-batches) and interleaved, one plain and one led update of every arm per round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import arms as arms_bench  # noqa: E402
from creditlab import config as config_mod  # noqa: E402
from creditlab import runtime as rt  # noqa: E402
from creditlab.arms_runner import keep_compiled_side_by_side, rotation, round_difference_ms  # noqa: E402
from creditlab.train import build_model  # noqa: E402


def sleep_cycles(ms: float) -> int:
    """Cycles of torch.cuda._sleep for about `ms`, from one timed sleep (its exact time is measured later)."""
    probe = 10_000_000
    timed_sleep(probe)  # the first launch loads the kernel
    return int(probe * ms * 1e-3 / timed_sleep(probe))


def timed_sleep(cycles: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def led_update(trainer, cycles: int) -> float:
    """One update with the sleep queued as the update's first GPU work (after the timer's synchronization, before
    the first micro-batch is taken): its seconds, sleep included."""
    take = trainer._batch
    first = [True]

    def batch_after_sleep():
        if first[0]:
            first[0] = False
            torch.cuda._sleep(cycles)
        return take()

    trainer._batch = batch_after_sleep
    try:
        return trainer.train_update().seconds
    finally:
        del trainer._batch  # the bound method again


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--arms", default="native,zero,learned")
    ap.add_argument("--preset", default="seed")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--lead-ms", type=float, default=40.0)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    if args.rounds < 5:
        ap.error("--rounds must be at least 5 (the first two are left out, and a median needs three)")
    names = args.arms.split(",")
    for name in names:
        arms_bench.overrides_of(name)
    out = rt.gpu_benchmark_folder(args.out)
    if out is None:
        return 2
    base = config_mod.load(args.preset, args.overrides)
    runtime = rt.resolve(base.train)
    arms_bench.base_peak = None
    init_state = {k: v.detach().cpu().clone() for k, v in build_model(base, runtime).state_dict().items()}
    keep_compiled_side_by_side()
    built = {}
    for name in names:
        print(f"== build {name}", flush=True)
        built[name] = arms_bench.build_arm(name, base, init_state)
    cycles = sleep_cycles(args.lead_ms)
    plain = {n: [] for n in names}
    led = {n: [] for n in names}
    sleeps = []
    for r in range(args.rounds):
        for name in rotation(names, r):
            trainer = built[name]["trainer"]
            plain[name].append(trainer.train_update().seconds)
            sleeps.append(timed_sleep(cycles))
            led[name].append(led_update(trainer, cycles))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} {plain[n][-1]:.4f} / {led[n][-1] - sleeps[-1]:.4f}" for n in names), flush=True)
    sleep_s = statistics.median(sleeps[2 * len(names):] or sleeps)
    lines = [f"# Host lead: each update plain, and with the GPU held back {sleep_s * 1e3:.2f} ms at its start",
             "", f"{args.rounds} rounds, the first two left out; {rt.environment(runtime)}", "",
             "| arm | plain s/update (median) | led s/update less the sleep (median) | led less sleep less plain, "
             "per round (median, 95% interval), ms |", "|---|---|---|---|"]
    result = {"sleep_s": sleep_s, "sleeps_s": sleeps, "lead_ms": args.lead_ms, "arms": {}}
    for name in names:
        led_less_sleep = [s - sleep_s for s in led[name]]
        mid, lo, hi, _ = round_difference_ms(led_less_sleep, plain[name])
        result["arms"][name] = {"plain_s": plain[name], "led_s": led[name], "led_less_plain_ms": [mid, lo, hi]}
        lines.append(f"| {name} | {statistics.median(plain[name][2:]):.4f} | "
                     f"{statistics.median(led_less_sleep[2:]):.4f} | "
                     f"{mid:+.1f} ({lo:+.1f} .. {hi:+.1f}) |")
    lines += ["", "A negative difference is host-bound time the lead took away; about zero, a step the GPU bounds."]
    rt.write_benchmark(out, "host_lead", result, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
