"""Causal attention at the seed shape, forward and forward + backward, in each kernel PyTorch offers here: SDPA's
cuDNN, FlashAttention-2 and memory-efficient backends, and FlexAttention compiled with a causal block mask.

    python benchmarks/attention.py --out DIR [--batch 64] [--seq 2048] [--heads 4] [--head-dim 128]
        [--backends cudnn,flash,efficient,flex,cudnn@heads_first]

The inputs are laid out as the model hands them over: q, k, v in (batch, sequence, heads, head dim), transposed
to SDPA's order without a copy, and the output's gradient laid out as the output (`creditlab/ops/causal_attention.py`);
scale 0.12, bf16. A backend named `KERNEL@heads_first` takes all four contiguous in SDPA's order (batch, heads,
sequence, head dim) instead, which the Q/K/V product could write directly. Each path is first checked on the
first two sequences against float64 (output and the three input gradients), then all are timed in alternated
rounds on the whole micro-batch. TFLOP/s count a causal forward as 2 B H T^2 D (half of the two products) and the
backward as 2.5 times that, as FlashAttention's papers count them. A path that fails is reported, not fatal.

Then the cuDNN backward's graph cache, at shapes no row above uses: SDPA called directly with the output's
gradient first contiguous, then laid out as the output (the second call reuses the first's graph, cached under q,
k and v alone), and `causal_attention` handed the same two gradients. Each call's largest gradient error
against float64. Writes DIR/attention.json and DIR/attention.md; any CUDA machine.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp8_head import alternated_rounds, error_text, failure_rows, ratio_text, round_summary  # noqa: E402
from qk_norm import attention_problem  # noqa: E402

from creditlab.runtime import largest_relative_error, write_benchmark  # noqa: E402

SCALE = 0.12  # the model's attention scale
BACKENDS = ("cudnn", "flash", "efficient", "flex")
LAYOUTS = ("model", "heads_first")  # where q, k, v and the output's gradient lie (`inputs`)


def sdpa_backend(kernel: str):
    """SDPA's backend by this script's name for it (cudnn, flash, efficient, math)."""
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[kernel]


def attention_fn(backend: str, seq: int, device: str):
    """attend(q, k, v) in (batch, heads, sequence, head dim) order, causal, with one kernel."""
    if backend == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, seq, seq, device=device)
        compiled = torch.compile(flex_attention)
        return lambda q, k, v: compiled(q, k, v, block_mask=mask, scale=SCALE)
    from torch.nn.attention import sdpa_kernel

    kind = sdpa_backend(backend)

    def attend(q, k, v):
        with sdpa_kernel(kind):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE)

    return attend


def inputs(batch: int, seq: int, heads: int, head_dim: int, device: str, dtype=torch.bfloat16, seed: int = 0,
           layout: str = "model"):
    """q, k, v and the output's gradient in SDPA's (batch, heads, sequence, head dim) order, from one seed, the same
    values in every layout. model: all four transposed from (batch, sequence, heads, head dim) without a copy (SDPA
    lays its output out as q is); heads_first: all four contiguous.

    Two layouts whose q, k, v strides agree but whose gradients' differ cannot both be timed in one process: cuDNN
    reuses the first one's backward graph for the second (`creditlab/ops/causal_attention.py`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v, dout = (torch.randn(batch, seq, heads, head_dim, generator=g).to(device, dtype).transpose(1, 2)
                     for _ in range(4))
    if layout == "heads_first":
        return q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous()
    return q, k, v, dout


def kernel_and_layout(backend: str) -> tuple[str, str]:
    """`cudnn@heads_first` -> ("cudnn", "heads_first"); a bare kernel takes the model's layout."""
    kernel, _, layout = backend.partition("@")
    return kernel, layout or "model"


def graph_cache_check(device: str, batch: int = 1, seq: int = 256, heads: int = 4, head_dim: int = 128,
                      kernel: str = "cudnn") -> dict:
    """The largest gradient error against float64 of four backward calls of `kernel` (cudnn; math on the CPU) in
    this order: SDPA called directly with the output's gradient contiguous, then laid out as the output; then, at
    another sequence length (a graph of its own), `causal_attention` handed the same two gradients."""
    from torch.nn.attention import sdpa_kernel

    from creditlab.ops.causal_attention import causal_attention

    backend = sdpa_backend(kernel)
    result = {}
    for attend, name, length in ((lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                  scale=SCALE), "sdpa", seq),
                                 (lambda q, k, v: causal_attention(q, k, v, scale=SCALE), "causal_attention",
                                  seq + 128)):
        q, k, v, dout = inputs(batch, length, heads, head_dim, device)  # dout laid out as the output
        want = reference(q, k, v, dout)
        for laid, grad in (("contiguous", dout.contiguous()), ("as the output", dout)):
            with sdpa_kernel(backend):
                got = forward_and_backward(attend, q, k, v, grad)
            result[f"{name}, gradient {laid}"] = gradient_error(got, want)
    return result


def forward_and_backward(attend, q, k, v, dout):
    """The output and the gradients of q, k and v."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def gradient_error(got, want) -> float:
    """The largest relative error of dq, dk and dv (forward_and_backward's last three) against `want`'s."""
    return max(largest_relative_error(a, b) for a, b in zip(got[1:], want[1:], strict=True))


def reference(q, k, v, dout):
    """Output and input gradients in float64, op by op."""
    return forward_and_backward(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE),
                                *(t.double() for t in (q, k, v, dout)))


def check(attend, q, k, v, dout) -> list[float]:
    """Each of the path's four results' largest relative error against float64."""
    want = reference(q, k, v, dout)
    got = forward_and_backward(attend, q, k, v, dout)
    return [largest_relative_error(a, b) for a, b in zip(got, want, strict=True)]


def flops(batch: int, seq: int, heads: int, head_dim: int) -> dict[str, float]:
    forward = 2.0 * batch * heads * seq * seq * head_dim
    return {"forward": forward, "forward + backward": 3.5 * forward}


def main() -> int:
    problem = attention_problem(__doc__.splitlines()[0], lambda ap: ap.add_argument(
        "--backends", default=",".join(BACKENDS), help="comma-separated, the first the base of the ratios"))
    if problem is None:
        return 2
    args, out, B, T, H, D, _ = problem
    runs, errors, failures, laid = {}, {}, {}, {}
    for backend in args.backends.split(","):
        try:
            kernel, layout = kernel_and_layout(backend)
            if layout not in laid:  # one set of inputs per layout, shared by its kernels
                laid[layout] = inputs(B, T, H, D, "cuda", layout=layout)
            q, k, v, dout = laid[layout]
            small = [t[:2] for t in (q, k, v, dout)]
            trained = [t.detach().requires_grad_() for t in (q, k, v)]
            attend = attention_fn(kernel, T, "cuda")
            errors[backend] = check(attend, *small)
            torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001 - a kernel this machine lacks is a row of the table
            failures[backend] = "".join(traceback.format_exception_only(error))[-2000:]
            print(f"{backend}: failed\n{failures[backend]}", flush=True)
            continue
        # the forward as training runs it: inputs that ask for gradients, so it keeps what its backward reads
        runs[f"{backend}: forward"] = lambda a=attend, t=trained: a(*t)
        runs[f"{backend}: forward + backward"] = lambda a=attend, x=(q, k, v, dout): forward_and_backward(a, *x)
    times = alternated_rounds(runs) if runs else {}
    work = flops(B, T, H, D)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "shape": {"batch": B, "seq": T, "heads": H, "head_dim": D},
              "flops": work, "paths": {}, "errors": errors, "failures": failures}
    lines = [f"# Causal attention, {B} x {T} tokens, {H} heads of {D}, bf16 ({result['gpu']}, torch {torch.__version__}, "
             f"cuDNN {result['cudnn']})", "",
             "Ten alternated rounds of five calls; ms per call. Ratio: over the first backend's same pass, round by "
             "round. Errors (output, d q, d k, d v): the largest entry's difference from float64 over the float64 "
             "result's largest entry, on the first two sequences.", "",
             "| backend: pass | ms per call | TFLOP/s | over the first backend, per round (range) | errors |",
             "|---|---|---|---|---|"]
    first = {}
    for name, ms in times.items():
        backend, kind = name.split(": ")
        first.setdefault(kind, name)
        r = round_summary(ms, times[first[kind]])
        rate = work[kind] / (r["median_ms"] * 1e-3) / 1e12
        result["paths"][name] = r | {"tflops": rate}
        lines.append(f"| {name} | {r['median_ms']:.3f} | {rate:.0f} | {ratio_text(r)} | "
                     f"{error_text(errors[backend])} |")
    lines += failure_rows(failures, 5)
    result["graph_cache"] = cache = graph_cache_check("cuda")
    lines += ["", "cuDNN's backward graph cache (the largest gradient error against float64 of each call, in this order; "
              "over 0.05 is a wrong gradient):", "",
              *(f"- {name}: {error:.1e}{' (wrong)' if error > 0.05 else ''}" for name, error in cache.items())]
    write_benchmark(out, "attention", result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
