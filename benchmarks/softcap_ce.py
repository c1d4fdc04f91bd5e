"""Soft-capped cross-entropy of one head-loss chunk on the GPU: the Triton kernel's configurations against the
compiler's fused torch arithmetic, in effective memory bandwidth (one read of the logits, one write of the
gradient).

    python benchmarks/softcap_ce.py --out DIR [--rows 16384] [--vocab 12289] [--padded 12352]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from creditlab import ops  # noqa: E402
from creditlab.ops.loss import softcap_ce_rows as torch_rows  # noqa: E402
from creditlab.runtime import cuda_ms, gpu_benchmark_folder, largest_relative_error  # noqa: E402

# (columns per step, warps, hardware tanh, pipeline stages of the row loop); 16,384 columns take a whole
# seed-vocabulary row per step.
CONFIGS = [(16384, 16, True, 1), (16384, 16, False, 1), (4096, 8, True, 1), (2048, 8, True, 1), (2048, 4, True, 1),
           (1024, 8, True, 1), (1024, 4, True, 1), (1024, 2, True, 1), (1024, 4, False, 1), (512, 4, True, 1),
           (512, 2, True, 1), (256, 2, True, 1),
           (512, 4, True, 2), (512, 4, True, 3), (1024, 4, True, 2), (1024, 4, True, 3), (1024, 8, True, 3),
           (2048, 8, True, 3), (256, 2, True, 3)]


def chunk_problem(description: str, rows: int = 16_384):
    """(output folder, arguments, bf16 logits, targets) of one head-loss chunk at the seed shape, from the command
    line (--out, --rows, --vocab, --padded); None where no CUDA GPU is visible."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=rows, help="rows of the chunk")
    ap.add_argument("--vocab", type=int, default=12_289)
    ap.add_argument("--padded", type=int, default=12_352)
    args = ap.parse_args()
    out = gpu_benchmark_folder(args.out)
    if out is None:
        return None
    torch.manual_seed(0)
    logits = (torch.randn(args.rows, args.padded, device="cuda") * 10).bfloat16()
    targets = torch.randint(0, args.vocab, (args.rows,), device="cuda")
    return out, args, logits, targets


def main() -> int:
    problem = chunk_problem(__doc__.splitlines()[0])
    if problem is None:
        return 2
    out, args, logits, targets = problem
    cap, scale = 15.0, 1.0 / args.rows
    gbytes = 2 * logits.numel() * logits.element_size() / 1e9
    ref_rows, ref_grad = torch_rows(logits, targets, args.vocab, cap, scale)
    results = []
    compiled = torch.compile(torch_rows)
    ms = cuda_ms(lambda: compiled(logits, targets, args.vocab, cap, scale), 20, warmup=1)
    results.append({"impl": "torch.compile", "ms": ms, "TB_per_s": gbytes / ms})
    for block, warps, fast, stages in CONFIGS:
        run = lambda: ops.softcap_ce_rows(logits, targets, args.vocab, cap, scale, block, warps,  # noqa: E731
                                              fast, stages)
        rows, grad = run()
        err = largest_relative_error(grad, ref_grad)
        ms = cuda_ms(run, 20, warmup=1)
        results.append({"impl": f"triton block {block} warps {warps} fast_tanh {int(fast)} stages {stages}", "ms": ms, "TB_per_s": gbytes / ms,
                        "grad_rel_err": err, "loss_rel_err": ((rows - ref_rows).abs() / ref_rows).max().item()})
    (out / "softcap_ce.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": args.rows,
                                                     "padded": args.padded, "results": results}, indent=2))
    for r in results:
        print(f"{r['impl']:<50} {r['ms']:.3f} ms  {r['TB_per_s']:.2f} TB/s  "
              f"{'grad err %.1e' % r['grad_rel_err'] if 'grad_rel_err' in r else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
