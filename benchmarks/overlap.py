"""Does the overlapped loop (`train.overlap`) make updates faster? Settled and overlapped updates of the same
arms, side by side in one process.

    python benchmarks/overlap.py --out DIR [--arms native,learned] [--rounds 16]

Each round runs two blocks of one update per arm, in an order rotated each round (and the two blocks' order
swapped every other round): a settled block, each update timed from a synchronized device to a synchronized
device as `Trainer.train_update` runs it, and an overlapped block, each update queued before the one before it
(another arm's) is read, timed by CUDA events as `creditlab train` runs it with `train.overlap`. A block's first
overlapped update starts on an idle device like a settled one, so it is left out of the overlapped times. Per
arm: the median of each kind of update over rounds 3 on and the per-round difference (overlapped less settled,
with a 95% bootstrap interval). Per block: its wall time per update from a synchronized device to a
synchronized device, which also counts the time between updates that no update's own time holds. Arms are built
as `arms.py` builds them (same initialization, same micro-batches).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import arms as arms_bench  # noqa: E402
from creditlab import config as config_mod  # noqa: E402
from creditlab import runtime as rt  # noqa: E402
from creditlab.arms_runner import rotation, round_difference_ms  # noqa: E402

BLOCKS = ("settled", "overlapped")
SKIP = 2  # rounds left out: the first compile and warm


def settled_block(trainers: dict, order: list[str], synchronize: Callable[[], None]) -> tuple[dict, float]:
    """One settled update of each arm in `order`: ({arm: seconds}, the block's wall seconds)."""
    synchronize()
    start = time.perf_counter()
    seconds = {name: trainers[name].train_update().seconds for name in order}
    return seconds, time.perf_counter() - start


def overlapped_block(trainers: dict, order: list[str], synchronize: Callable[[], None]) -> tuple[dict, float]:
    """One overlapped update of each arm in `order`, each queued before the one before it is read, the last read
    at the block's end: ({arm: seconds} without the block's first arm, the block's wall seconds)."""
    seconds = {}
    in_flight = rt.InFlight()
    synchronize()
    start = time.perf_counter()
    for name in order:
        trainer = trainers[name]
        in_flight.launch(trainer.queue_update,
                         lambda queued, name=name, trainer=trainer:
                         seconds.__setitem__(name, trainer.read_update(queued).seconds))
    in_flight.settle()
    wall = time.perf_counter() - start
    del seconds[order[0]]  # it started on an idle device, as a settled update does
    return seconds, wall


def run(trainers: dict, rounds: int, synchronize: Callable[[], None], say=print) -> dict:
    """`rounds` rounds of both blocks: per arm and block kind the seconds of each round (None where the arm led
    its overlapped block), and each block's wall seconds per update."""
    names = list(trainers)
    times = {kind: {n: [] for n in names} for kind in BLOCKS}
    wall = {kind: [] for kind in BLOCKS}
    blocks = {"settled": settled_block, "overlapped": overlapped_block}
    for r in range(rounds):
        order = rotation(names, r)
        for kind in (BLOCKS if r % 2 == 0 else BLOCKS[::-1]):
            seconds, block_wall = blocks[kind](trainers, order, synchronize)
            for name in names:
                times[kind][name].append(seconds.get(name))
            wall[kind].append(block_wall / len(order))
        say(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{n} " + " / ".join("-" if times[k][n][-1] is None else f"{times[k][n][-1]:.4f}" for k in BLOCKS)
            for n in names))
    return {"times": times, "wall_per_update": wall}


def summarize(result: dict) -> tuple[dict, list[str]]:
    times, wall = result["times"], result["wall_per_update"]
    lines = ["| arm | settled s/update | overlapped s/update | overlapped less settled, ms per round | rounds |",
             "|---|---|---|---|---|"]
    summary = {"arms": {}}
    for name in times["settled"]:
        pairs = [(o, s) for o, s in zip(times["overlapped"][name][SKIP:], times["settled"][name][SKIP:])
                 if o is not None]
        overlapped, settled = [o for o, _ in pairs], [s for _, s in pairs]
        diff = round_difference_ms(overlapped, settled, skip=0)
        summary["arms"][name] = {"settled_s": statistics.median(settled), "overlapped_s": statistics.median(overlapped),
                                 "overlapped_less_settled_ms": None if diff is None else diff[:3], "rounds": len(pairs)}
        a = summary["arms"][name]
        lines.append(f"| {name} | {a['settled_s']:.4f} | {a['overlapped_s']:.4f} | "
                     + ("-" if diff is None else f"{diff[0]:+.1f} ({diff[1]:+.1f} .. {diff[2]:+.1f})")
                     + f" | {len(pairs)} |")
    walls = {kind: statistics.median(wall[kind][SKIP:]) for kind in BLOCKS}
    diff = round_difference_ms(wall["overlapped"], wall["settled"], skip=SKIP)
    summary["wall_per_update_s"] = walls
    summary["wall_overlapped_less_settled_ms"] = None if diff is None else diff[:3]
    lines += ["", f"Wall time per update of a block, synchronized to synchronized (the time between updates "
              f"included; the overlapped block's first update led in from an idle device): settled "
              f"{walls['settled']:.4f} s, overlapped {walls['overlapped']:.4f} s"
              + ("" if diff is None else f", per round {diff[0]:+.1f} ms ({diff[1]:+.1f} .. {diff[2]:+.1f})") + "."]
    return summary, lines


def main() -> int:
    ap = arms_bench.resident_parser(__doc__, "native,learned", 16)
    args, names = arms_bench.parse_resident(ap)
    if len(names) < 2:
        ap.error("--arms needs at least two arms (an overlapped update follows another arm's)")
    out = rt.gpu_benchmark_folder(args.out)
    if out is None:
        return 2
    import torch

    runtime, built = arms_bench.build_resident(names, config_mod.load(args.preset, args.overrides))
    trainers = {name: arm["trainer"] for name, arm in built.items()}
    result = run(trainers, args.rounds, torch.cuda.synchronize, say=lambda line: print(line, flush=True))
    summary, lines = summarize(result)
    lines = ["# Settled and overlapped updates side by side", "",
             f"{args.rounds} rounds, the first {SKIP} left out; medians, 95% bootstrap intervals; "
             f"{rt.environment(runtime)}", ""] + lines
    rt.write_benchmark(out, "overlap", {**result, **summary}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
