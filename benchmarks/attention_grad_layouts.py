"""Does cuDNN attention's backward return the right gradients whatever the layout of the output's gradient?

    python benchmarks/attention_grad_layouts.py --out DIR

Two experiments, each call's gradients (dq, dk, dv) against float64 (SDPA's math kernel), the largest relative
error of the three; over 0.05 is a wrong gradient:
- orders: in a fresh process each, cuDNN's backward called twice on the same q, k, v (two sequences of 2,048, 4
  heads of 128, transposed from (batch, sequence, heads, head dim) as the model hands them over) with the output's
  gradient contiguous or laid out as the output, in the orders contiguous then as the output, as the output then
  contiguous, and as the output twice;
- matrix: in one process, for three shapes and three layouts of q, k, v (contiguous heads first, transposed,
  one of three in a packed (batch, sequence, 3, heads, head dim) buffer), the gradient contiguous first and then
  laid out as the output.
PyTorch caches cuDNN's backward graph by q, k and v alone, so the second layout of each pair reuses the first's
graph (`creditlab/ops/causal_attention.py`). Writes DIR/attention_grad_layouts.json and .md; any CUDA machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention import attention_fn, forward_and_backward, gradient_error, reference  # noqa: E402

from creditlab.runtime import gpu_benchmark_folder, write_benchmark  # noqa: E402

ORDERS = ("contiguous,as_output", "as_output,contiguous", "as_output,as_output")
WRONG = 0.05


def cudnn_error(q, k, v, dout, want) -> float:
    """The largest relative error of cuDNN's dq, dk, dv against `want` (`reference`'s)."""
    return gradient_error(forward_and_backward(attention_fn("cudnn", q.shape[2], "cuda"), q, k, v, dout), want)


def laid_out(x: torch.Tensor, how: str) -> torch.Tensor:
    """x's values, given in (batch, heads, sequence, head dim) order, in one of the layouts."""
    if how in ("heads_first", "contiguous"):
        return x.contiguous()
    if how in ("transposed", "as_output"):  # SDPA lays its output out as q is: transposed here
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    B, H, T, D = x.shape  # packed: the middle one of three in a (batch, sequence, 3, heads, head dim) buffer
    buffer = torch.zeros(B, T, 3, H, D, device=x.device, dtype=x.dtype)
    buffer[:, :, 1] = x.transpose(1, 2)
    return buffer[:, :, 1].transpose(1, 2)


def one_order(order: str) -> dict[str, float]:
    """Each call's error, in a process whose cuDNN graphs are all its own."""
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(2, 2048, 4, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                  for _ in range(4))
    want = reference(q, k, v, g)
    return {f"{i + 1}. gradient {how}": cudnn_error(q, k, v, laid_out(g, how), want)
            for i, how in enumerate(order.split(","))}


def matrix() -> list[dict]:
    rows = []
    for B, T in ((2, 2048), (2, 256), (8, 1024)):
        torch.manual_seed(0)
        values = [torch.randn(B, 4, T, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        want = reference(*values)
        for qkv, grad in itertools.product(("heads_first", "transposed", "packed"), ("contiguous", "as_output")):
            q, k, v = (laid_out(t, qkv) for t in values[:3])
            rows.append({"shape": f"{B} x {T}", "qkv": qkv, "q_strides": list(q.stride()), "gradient": grad,
                         "error": cudnn_error(q, k, v, laid_out(values[3], grad), want)})
    return rows


def mark(e: float) -> str:
    return f"{e:.1e}" + (" (wrong)" if e > WRONG else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--order", choices=ORDERS, help="(internal) one order in this process, its errors as JSON")
    args = ap.parse_args()
    if args.order:
        print(json.dumps(one_order(args.order)), flush=True)
        return 0
    out = gpu_benchmark_folder(args.out)
    if out is None:
        return 2
    orders = {o: json.loads(subprocess.run([sys.executable, __file__, "--out", args.out, "--order", o],
                                           capture_output=True, text=True, check=True).stdout.splitlines()[-1])
              for o in ORDERS}
    rows = matrix()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "orders": orders, "matrix": rows}
    lines = [f"# cuDNN attention's gradients by the layout of the output's gradient ({result['gpu']}, torch "
             f"{torch.__version__}, cuDNN {result['cudnn']})", "",
             f"Largest relative error of dq, dk, dv against float64; over {WRONG} is a wrong gradient.", "",
             "## Orders, a fresh process each", "",
             *(f"- {o}: " + "; ".join(f"{call} {mark(e)}" for call, e in calls.items()) for o, calls in orders.items()),
             "", "## Matrix, one process (for each q, k, v layout the contiguous gradient first)", "",
             "| B x T | q, k, v layout (q strides) | output's gradient | error |", "|---|---|---|---|",
             *(f"| {r['shape']} | {r['qkv']} {tuple(r['q_strides'])} | {r['gradient']} | {mark(r['error'])} |"
               for r in rows)]
    write_benchmark(out, "attention_grad_layouts", result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
