"""What making one micro-batch costs the host at the seed shape: the arms' synthetic stream's `next()`, its
`pin_memory()` and the launch of its copy to the GPU, with torch's default intra-op threads and with one.

    python benchmarks/batch_host.py --out DIR [--repeats 30]

The first micro-batch of an update is made inside the timed update after the synchronization that opens it, so
the GPU waits for all three (benchmarks/native_seed.md, "What 0.29 s would take").
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from creditlab.data import SyntheticLoader  # noqa: E402
from creditlab.runtime import gpu_benchmark_folder, write_benchmark  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=12_289)
    args = ap.parse_args()
    out = gpu_benchmark_folder(args.out)
    if out is None:
        return 2
    loader = SyntheticLoader(args.vocab, args.batch, args.seq, seed=0)
    torch.ones(1, device="cuda")
    default_threads = torch.get_num_threads()
    results, lines = {}, [f"# One micro-batch's making on the host, {args.batch} x {args.seq + 1} tokens", "",
                          "| intra-op threads | next() ms | pin_memory ms | launch of the copy ms |", "|---|---|---|---|"]
    for threads in (default_threads, 1):
        torch.set_num_threads(threads)
        times = {"next": [], "pin_memory": [], "copy_launch": []}
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            batch = loader.next()
            t1 = time.perf_counter()
            pinned = batch.pin_memory()
            t2 = time.perf_counter()
            pinned.to("cuda", non_blocking=True)
            t3 = time.perf_counter()
            torch.cuda.synchronize()
            for key, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[key].append(seconds)
        medians = {key: 1e3 * statistics.median(v[5:]) for key, v in times.items()}  # the first five warm up
        results[str(threads)] = medians
        lines.append(f"| {threads} | {medians['next']:.3f} | {medians['pin_memory']:.3f} | "
                     f"{medians['copy_launch']:.3f} |")
    torch.set_num_threads(default_threads)
    write_benchmark(out, "batch_host", {"args": vars(args), "median_ms_by_threads": results}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
