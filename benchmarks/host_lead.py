"""Is an arm's update bound by the host anywhere? Each update timed three ways: as it runs; with the GPU held
back at its start by a sleep kernel, so that the host runs ahead and fills the launch queue before the GPU begins
("led"); and with the same sleep run to its end before the update's timer starts ("rested").

    python benchmarks/host_lead.py --out DIR [--arms native,zero,learned] [--rounds 12] [--lead-ms 40]

An update whose GPU is never starved by its host takes the sleep's time longer when led, and no more. Where the
host falls behind somewhere (a stretch of Python, dispatch or launches longer than the GPU work queued ahead of
it), the lead absorbs that stretch: the led update takes less than the sleep plus the update, by the host-bound
time the lead removed (up to what the launch queue holds). But an idle GPU also draws less power, and this card
runs at its power limit, so the work after a sleep may run at a higher clock. The rested update has the same idle
GPU before its work without the host running ahead: led less the sleep against rested is the host's part, rested
against plain the clock's. Every update is preceded by the same sleep (its time measured there), so that all
three follow the same rest. Arms are built as `arms.py` builds them (same initialization, same micro-batches) and
interleaved, the three kinds of update in a rotating order.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import arms as arms_bench  # noqa: E402
from creditlab import config as config_mod  # noqa: E402
from creditlab import runtime as rt  # noqa: E402
from creditlab.experiments.arms_runner import rotation, round_difference_ms  # noqa: E402


KINDS = ("plain", "led", "rested")


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
    ap = arms_bench.resident_parser(__doc__, "native,zero,learned", 12)
    ap.add_argument("--lead-ms", type=float, default=40.0)
    args, names = arms_bench.parse_resident(ap)
    out = rt.gpu_benchmark_folder(args.out)
    if out is None:
        return 2
    runtime, built = arms_bench.build_resident(names, config_mod.load(args.preset, args.overrides))
    cycles = sleep_cycles(args.lead_ms)
    times = {kind: {n: [] for n in names} for kind in KINDS}
    sleeps = []
    for r in range(args.rounds):
        for name in rotation(names, r):
            trainer = built[name]["trainer"]
            for kind in rotation(KINDS, r):
                sleeps.append(timed_sleep(cycles))  # the same rest before every update
                if kind == "plain":
                    seconds = trainer.train_update().seconds
                elif kind == "rested":
                    timed_sleep(cycles)
                    seconds = trainer.train_update().seconds
                else:
                    seconds = led_update(trainer, cycles)
                times[kind][name].append(seconds)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} " + " / ".join(f"{times[k][n][-1]:.4f}" for k in KINDS) for n in names), flush=True)
    sleep_s = statistics.median(sleeps[2 * len(KINDS) * len(names):])  # rounds 3 on, as the updates
    led_less_sleep = {n: [t - sleep_s for t in times["led"][n]] for n in names}
    lines = [f"# Host lead: each update plain, led (the GPU held back {sleep_s * 1e3:.2f} ms at its start, the "
             "sleep subtracted) and rested (the same sleep before the timer)", "",
             f"{args.rounds} rounds, the first two left out; {rt.environment(runtime)}", "",
             "| arm | plain s/update | rested | led less the sleep | led less rested, ms per round (host) | "
             "rested less plain, ms per round (clock) |", "|---|---|---|---|---|---|"]
    result = {"sleep_s": sleep_s, "sleeps_s": sleeps, "lead_ms": args.lead_ms, "arms": {}}
    for name in names:
        host = round_difference_ms(led_less_sleep[name], times["rested"][name])
        clock = round_difference_ms(times["rested"][name], times["plain"][name])
        result["arms"][name] = {**{f"{k}_s": times[k][name] for k in KINDS},
                                "led_less_rested_ms": host[:3], "rested_less_plain_ms": clock[:3]}
        medians = [statistics.median(t[2:]) for t in (times["plain"][name], times["rested"][name],
                                                      led_less_sleep[name])]
        lines.append(f"| {name} | " + " | ".join(f"{m:.4f}" for m in medians) + " | "
                     + " | ".join(f"{d[0]:+.1f} ({d[1]:+.1f} .. {d[2]:+.1f})" for d in (host, clock)) + " |")
    lines += ["", "Medians over rounds 3 on, 95% bootstrap intervals. Led less rested below zero: host-bound time "
              "the lead took away. Rested less plain below zero: the clock's gain after an idle GPU."]
    rt.write_benchmark(out, "host_lead", result, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
