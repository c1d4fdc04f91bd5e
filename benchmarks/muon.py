"""Muon's step for the seed model's hidden matrices on the GPU: torch.optim.Muon (one matrix after another)
against optim.GroupedMuon (the matrices of one shape orthogonalized together), alternated in one process. Each
step is timed on the host from its first launch to the GPU's end (what an update pays when the step follows the
backward), and on the GPU alone (CUDA events around back-to-back steps).

    python benchmarks/muon.py --out DIR [--preset seed]

Writes DIR/muon.json and DIR/muon.md. Any CUDA machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from creditlab import config  # noqa: E402
from creditlab.model import GPT  # noqa: E402
from creditlab.optim import GroupedMuon, parameter_groups  # noqa: E402
from creditlab.runtime import cuda_ms, gpu_benchmark_folder, largest_relative_error, write_benchmark  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="seed")
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    out = gpu_benchmark_folder(args.out)
    if out is None:
        return 2
    cfg = config.load(args.preset)
    torch.manual_seed(0)
    hidden = parameter_groups(GPT(cfg.model).cuda())["hidden"]
    grads = [torch.randn_like(p) * 1e-3 for p in hidden]  # the same gradients for both
    arms = {}
    for name, cls in (("torch.optim.Muon", torch.optim.Muon), ("GroupedMuon", GroupedMuon)):
        params = [torch.nn.Parameter(p.detach().clone()) for p in hidden]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        arms[name] = (params, cls(params, lr=cfg.train.lr_muon, momentum=0.95, adjust_lr_fn="match_rms_adamw"))
    host = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, (_, opt) in arms.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            opt.step()
            torch.cuda.synchronize()
            host[name].append((time.perf_counter() - start) * 1e3)
    gpu = {name: cuda_ms(opt.step, 20) for name, (_, opt) in arms.items()}
    (a, _), (b, _) = arms.values()
    diff = max(largest_relative_error(y, x) for x, y in zip(a, b))
    result = {"matrices": len(hidden), "shapes": sorted({tuple(p.shape) for p in hidden}),
              "host_to_gpu_end_ms": {k: statistics.median(v[2:]) for k, v in host.items()},
              "back_to_back_ms": gpu, "params_max_rel_diff_after_all_steps": diff,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    lines = [f"# Muon's step, {len(hidden)} matrices of the {args.preset} model ({result['device']}, torch "
             f"{torch.__version__})", "", "| implementation | ms a step, launch to GPU end (median) | ms a step, back to back |",
             "|---|---|---|"]
    lines += [f"| {k} | {result['host_to_gpu_end_ms'][k]:.2f} | {gpu[k]:.2f} |" for k in arms]
    lines += ["", f"After the same steps on the same gradients, the parameters' largest difference relative to the "
              f"largest entry: {diff:.1e}."]
    write_benchmark(out, "muon", result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
