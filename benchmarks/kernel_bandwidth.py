"""Every compiler-generated kernel of one micro-batch's forward and backward: its time alone, the bytes of its
arguments and the bandwidth that makes, so the memory-bound passes furthest from the card's bandwidth stand out.

    python benchmarks/kernel_bandwidth.py --out DIR [--arms native,learned] [--preset seed] [--set k=v ...]

Inductor's bandwidth profiler (TORCHINDUCTOR_PROFILE) times each generated Triton kernel on its first call and
counts the bytes its arguments hold; later calls are not run again but counted with the first call's figures.
So the profiled pass computes nothing meaningful (its gradients are not kept), and only generated kernels are
listed: cuBLAS, cuDNN and the package's own Triton operators are not. Bytes are the arguments' sizes: a kernel
that reads part of a tensor, or reads one twice, is credited with the tensor once. The sources of the kernels
furthest over the bandwidth are kept beside the table (DIR/kernel_sources/). Writes DIR/kernel_bandwidth.json
and DIR/kernel_bandwidth.md. Any CUDA machine.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHINDUCTOR_PROFILE", "1")  # before the compiler reads its configuration

import argparse  # noqa: E402
import copy  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch._dynamo  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from arms import overrides_of  # noqa: E402
from creditlab import config as config_mod  # noqa: E402
from creditlab import runtime as rt  # noqa: E402
from creditlab.data import SyntheticLoader  # noqa: E402
from creditlab.train import Trainer  # noqa: E402

BANDWIDTH_GBPS = 3000.0  # what a streaming pass reaches on an H200 (about 90% of its 3.35 TB/s)


def collect_graph_calls() -> list:
    """Every compiled graph's profiled calls, gathered as each graph ends (the profiler clears its list when a
    graph starts). Installed before anything compiles: the generated code imports the function it calls."""
    from torch._inductor.runtime import triton_heuristics

    gathered, end_graph = [], triton_heuristics.end_graph

    def end_graph_gathering(output_file):
        gathered.extend(triton_heuristics.collected_calls)
        return end_graph(output_file)

    triton_heuristics.end_graph = end_graph_gathering
    return gathered


GATHERED = collect_graph_calls()


def profiled_calls(name: str, base: config_mod.Config) -> list[tuple[float, float, str]]:
    """(ms, GB, kernel) of every generated kernel call in one micro-batch's forward and backward of arm `name`."""
    cfg = copy.deepcopy(base)
    for item in overrides_of(name):
        key, _, value = item.partition("=")
        config_mod._assign(cfg, key, value)
    config_mod.validate(cfg)
    torch._dynamo.reset()
    runtime = rt.resolve(cfg.train)
    loader = SyntheticLoader(cfg.model.vocab_size, cfg.train.micro_batch, cfg.model.seq_len, cfg.train.seed)
    trainer = Trainer(cfg, runtime, loader=loader)
    inputs, targets = trainer._batch()
    kind = "synthetic" if trainer.source.omits else "exact"
    start = len(GATHERED)
    credit = trainer.source.context(trainer, inputs, targets, kind, 1.0)
    trainer.forward_backward(inputs, targets, credit, 1.0)
    torch.cuda.synchronize()
    calls = [(ms, gb, kernel) for ms, gb, _, kernel in GATHERED[start:]]
    del trainer
    torch.cuda.empty_cache()
    return calls


def table(name: str, calls: list[tuple[float, float, str]], per_update: int, top: int) -> tuple[dict, list[str]]:
    grouped = defaultdict(lambda: [0, 0.0, 0.0])
    for ms, gb, kernel in calls:
        entry = grouped[(kernel, round(gb, 4))]
        entry[0] += 1
        entry[1] += ms
        entry[2] += gb
    rows = sorted(((kernel, n, ms, gb) for (kernel, _), (n, ms, gb) in grouped.items()), key=lambda r: -r[2])
    total_ms = per_update * sum(r[2] for r in rows)
    floor_ms = per_update * sum(r[3] for r in rows) / BANDWIDTH_GBPS * 1e3
    lines = [f"## {name}: {len(calls)} generated kernel calls per micro-batch, {total_ms:.1f} ms per update "
             f"({per_update} micro-batches), {floor_ms:.1f} ms at {BANDWIDTH_GBPS / 1e3:.1f} TB/s", "",
             "| kernel | calls | ms per call | GB per call | GB/s | ms per update | over the bandwidth, ms per update |",
             "|---|---|---|---|---|---|---|"]
    for kernel, n, ms, gb in rows[:top]:
        over = per_update * (ms - gb / BANDWIDTH_GBPS * 1e3)
        lines.append(f"| `{kernel[:90]}` | {n} | {ms / n:.4f} | {gb / n:.4f} | {gb / ms * 1e3:,.0f} | "
                     f"{per_update * ms:.2f} | {over:+.2f} |")
    result = {"arm": name, "calls": len(calls), "ms_per_update": total_ms, "floor_ms_per_update": floor_ms,
              "kernels": [{"kernel": k, "calls": n, "ms": ms, "gb": gb} for k, n, ms, gb in rows]}
    return result, lines + [""]


SOURCE = re.compile(r"^(triton_\w+) = async_compile\.triton\('\1', '''(.*?)'''", re.S | re.M)


def kernel_sources(names: set[str], to: Path) -> int:
    """Copy the generated source of each named kernel from the compiler's cache into `to`; how many were found."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    to.mkdir(parents=True, exist_ok=True)
    found = 0
    for path in Path(cache_dir()).rglob("*.py"):
        for kernel, source in SOURCE.findall(path.read_text(errors="replace")):
            if kernel in names and not (to / f"{kernel}.py").exists():
                (to / f"{kernel}.py").write_text(source)
                found += 1
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--arms", default="native,learned")
    ap.add_argument("--preset", default="seed")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--sources", type=int, default=6,
                    help="keep the sources of this many kernels per arm, those furthest over the bandwidth")
    args = ap.parse_args()
    out = rt.gpu_benchmark_folder(args.out)
    if out is None:
        return 2
    base = config_mod.load(args.preset, args.overrides)
    results, lines, wanted = [], [], set()
    for name in args.arms.split(","):
        print(f"== arm {name}", flush=True)
        result, text = table(name, profiled_calls(name, base), base.train.grad_accum, args.top)
        results.append(result)
        lines += text
        worst = sorted(result["kernels"], key=lambda k: -(k["ms"] - k["gb"] / BANDWIDTH_GBPS * 1e3))
        wanted.update(k["kernel"] for k in worst[:args.sources])
    rt.write_benchmark(out, "kernel_bandwidth", {"preset": args.preset, "overrides": args.overrides,
                                                 "bandwidth_gbps": BANDWIDTH_GBPS, "arms": results}, lines)
    print(f"kept the sources of {kernel_sources(wanted, out / 'kernel_sources')} of {len(wanted)} kernels", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
