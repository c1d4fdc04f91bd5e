"""One micro-batch of the head loss on the GPU at the seed shape: its three products in bf16 (the default) and
on FP8 tensor cores (`model.head=fp8`), in time and in error against float64; and the FP8 path's parts.

    python benchmarks/fp8_head.py --out DIR [--tokens 131072] [--width 512] [--vocab 12289] [--chunk 8192]

Writes DIR/fp8_head.json and DIR/fp8_head.md. Any CUDA machine whose GPU has FP8 tensor cores (sm_89 or later).
The two paths are timed alternately, ten rounds of five calls each, and each round's ratio is reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from creditlab import ops  # noqa: E402
from creditlab.ops import tiled_transpose  # noqa: E402
from creditlab.ops.fp8 import quantize as fp8_quantize, quantize_eager as _quantize  # noqa: E402
from creditlab.ops.loss import (HEAD_GRAD_FP8, HEAD_GRAD_SCALE, HEAD_INPUT_FP8, Fp8Head,  # noqa: E402
                                fused_head_loss, softcap_ce_rows)
from creditlab.runtime import cuda_ms, gpu_benchmark_folder, largest_relative_error, write_benchmark  # noqa: E402

CAP = 15.0


def reference(h, w, targets, vocab, chunk, quantized=False):
    """Loss, d loss/dh and d loss/dW in float64, chunk by chunk (the torch arithmetic of loss.py). quantized: what
    the FP8 path computes, the products of the quantized operands, with each chunk's gradient of the logits
    rounded to e5m2 at the fixed scale (from float64 logits)."""
    n = h.shape[0]
    if quantized:
        (h8, sh), (w8, sw) = fp8_quantize(h), fp8_quantize(w)
        h64, w64 = h8.double() * sh.double(), w8.double() * sw.double()
    else:
        h64, w64 = h.double(), w.double()
    total, gh, gw = 0.0, torch.empty_like(h64), torch.zeros_like(w64)
    for start in range(0, n, chunk):
        rows, g = softcap_ce_rows(h64[start:start + chunk] @ w64.t(), targets[start:start + chunk], vocab, CAP,
                                  HEAD_GRAD_SCALE if quantized else 1.0 / n)
        if quantized:
            g = g.to(HEAD_GRAD_FP8).double() / (HEAD_GRAD_SCALE * n)
        total += rows.sum().item()
        gh[start:start + chunk] = g @ w64
        gw += g.t() @ h64[start:start + chunk]
    return total / n, gh, gw


def errors(got, want):
    return {"loss": abs(got[0].item() - want[0]) / abs(want[0]), "grad_h": largest_relative_error(got[1], want[1]),
            "grad_w": largest_relative_error(got[2], want[2])}


def head_problem(description: str):
    """A head-loss benchmark's command line and its seed-shape problem on the GPU: (output folder, N, d, V, padded
    V, chunk, h, W, targets), or None after saying so where no CUDA GPU is visible."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=64 * 2048)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=12_289)
    ap.add_argument("--chunk", type=int, default=8_192)
    args = ap.parse_args()
    out = gpu_benchmark_folder(args.out)
    if out is None:
        return None
    N, d, V, chunk = args.tokens, args.width, args.vocab, args.chunk
    Vp = (V + 63) // 64 * 64
    torch.manual_seed(0)
    h = torch.nn.functional.rms_norm(torch.randn(N, d, device="cuda"), (d,)).bfloat16()  # the head reads norm(x)
    w = torch.randn(Vp, d, device="cuda") * 0.02  # a trained head's scale: logits of a few units
    targets = torch.randint(0, V, (N,), device="cuda")
    return out, N, d, V, Vp, chunk, h, w, targets


def alternated_rounds(run: dict, rounds: int = 10) -> dict[str, list[float]]:
    """Each callable's milliseconds (five calls a round), the order of the paths reversed every other round."""
    for fn in run.values():
        fn()
    times = {name: [] for name in run}
    for r in range(rounds):
        for name in (list(run) if r % 2 == 0 else list(run)[::-1]):
            times[name].append(cuda_ms(run[name], repeats=5, warmup=1))
    return times


def checked_paths(groups: dict, wrap=lambda fn: fn) -> tuple[dict, dict, dict, dict, dict]:
    """Each path of `groups` ({product: [(name, callable, the float64 result it computes or None)]}) run once and
    checked against its float64 result, then all timed in alternated rounds: (times in ms, errors, failures,
    group of each path, base path of each group, its first that ran). A path with several outputs gives a tuple
    of float64 results, and its error is the list of each output's. `wrap` turns a checked callable into the
    one timed (a CUDA graph of several calls, say). A path that fails is reported, not fatal."""
    runs, errors, failures, group_of = {}, {}, {}, {}
    for group, paths in groups.items():
        for name, fn, want in paths:
            try:
                got = fn()
                torch.cuda.synchronize()
                if isinstance(want, tuple):
                    errors[name] = [largest_relative_error(g, w) for g, w in zip(got, want, strict=True)]
                else:
                    errors[name] = None if want is None else largest_relative_error(got, want)
                runs[name] = wrap(fn)
            except Exception as error:
                failures[name] = "".join(traceback.format_exception_only(error))[-2000:]
                print(f"{name}: failed\n{failures[name]}", flush=True)
                errors.pop(name, None)
                continue
            group_of[name] = group
    times = alternated_rounds(runs) if runs else {}
    base = {group: next(name for name in times if group_of[name] == group) for group in set(group_of.values())}
    return times, errors, failures, group_of, base


def error_text(error) -> str:
    """A path's error as its table prints it: "-" where it has no float64 result, several outputs comma-joined."""
    if error is None:
        return "-"
    return ", ".join(f"{e:.1e}" for e in error) if isinstance(error, list) else f"{error:.1e}"


def ratio_text(r: dict) -> str:
    """A round_summary's ratio per round with its range, as the tables print it."""
    lo, hi = r["ratio_range"]
    return f"{r['ratio_per_round']:.3f} ({lo:.3f} .. {hi:.3f})"


def failure_rows(failures: dict, columns: int) -> list[str]:
    """One table row of `columns` columns for each path that failed its check or its run, with the error's last
    line."""
    return [f"| {name} | failed: {why.strip().splitlines()[-1][:200]} |" + " |" * (columns - 2)
            for name, why in failures.items()]


def round_summary(ms: list[float], base_ms: list[float]) -> dict:
    """A path's times and their ratios over its group's base, round by round."""
    ratios = [t / b for t, b in zip(ms, base_ms)]
    return {"ms": ms, "median_ms": statistics.median(ms), "ratio_per_round": statistics.median(ratios),
            "ratio_range": [min(ratios), max(ratios)]}


def main() -> int:
    problem = head_problem(__doc__.splitlines()[0])
    if problem is None:
        return 2
    out, N, d, V, Vp, chunk, h, w, targets = problem
    paths = {"bf16": False, "fp8": True}
    rounds = alternated_rounds({name: (lambda fp8=fp8: fused_head_loss(h, w, targets, V, CAP, chunk, fp8))
                                for name, fp8 in paths.items()})
    ratios = [f / b for f, b in zip(rounds["fp8"], rounds["bf16"])]
    times = {name: statistics.median(ms) for name, ms in rounds.items()}

    # the FP8 path's parts, one chunk of the seed shape
    head = Fp8Head(h, w, 1.0 / N)
    logits = torch._scaled_mm(head.h8[:chunk], head.w8.t(), scale_a=head.h_scale, scale_b=head.w_scale,
                              out_dtype=torch.bfloat16)
    _, g8 = ops.softcap_ce_rows(logits, targets[:chunk], V, CAP, HEAD_GRAD_SCALE, grad_dtype=HEAD_GRAD_FP8)
    h16, w16 = h[:chunk], w.bfloat16()
    g16 = ops.softcap_ce_rows(h16 @ w16.t(), targets[:chunk], V, CAP, 1.0 / N)[1]
    g_scale = head.g_scale
    parts = {
        "quantize and transpose h and W (per micro-batch)": cuda_ms(lambda: Fp8Head(h, w, 1.0 / N)),
        "quantize h, compiled (per micro-batch)": cuda_ms(lambda: fp8_quantize(h)),
        "quantize h, eager (per micro-batch)": cuda_ms(lambda: _quantize(h, HEAD_INPUT_FP8)),
        "logits product, bf16": cuda_ms(lambda: h16 @ w16.t()),
        "logits product, fp8": cuda_ms(lambda: torch._scaled_mm(head.h8[:chunk], head.w8.t(), scale_a=head.h_scale,
                                                                scale_b=head.w_scale, out_dtype=torch.bfloat16)),
        "cross-entropy kernel, bf16 gradient": cuda_ms(
            lambda: ops.softcap_ce_rows(logits, targets[:chunk], V, CAP, 1.0 / N)),
        "cross-entropy kernel, e5m2 gradient": cuda_ms(
            lambda: ops.softcap_ce_rows(logits, targets[:chunk], V, CAP, HEAD_GRAD_SCALE, grad_dtype=HEAD_GRAD_FP8)),
        "dh product, bf16": cuda_ms(lambda: g16 @ w16),
        "dh product, fp8": cuda_ms(lambda: torch._scaled_mm(g8, head.w8_t.t(), scale_a=g_scale, scale_b=head.w_scale,
                                                            out_dtype=torch.bfloat16)),
        "dW product, bf16": cuda_ms(lambda: g16.t() @ h16),
        "dW product, fp8": cuda_ms(lambda: torch._scaled_mm(tiled_transpose.transpose(g8), head.h8_t[:, :chunk].t(),
                                                            scale_a=g_scale, scale_b=head.h_scale,
                                                            out_dtype=torch.float32)),
        "transpose of the e5m2 gradient, tiled kernel": cuda_ms(lambda: tiled_transpose.transpose(g8)),
        "transpose of the e5m2 gradient, torch copy": cuda_ms(lambda: g8.t().contiguous()),
    }
    # the kernel's e5m2 rounding against torch's of the same float32 gradient
    g32 = ops.softcap_ce_rows(logits.float(), targets[:chunk], V, CAP, HEAD_GRAD_SCALE,
                                  grad_dtype=torch.float32)[1]
    g8_from_32 = ops.softcap_ce_rows(logits.float(), targets[:chunk], V, CAP, HEAD_GRAD_SCALE,
                                         grad_dtype=HEAD_GRAD_FP8)[1]
    same_rounding = (g8_from_32.view(torch.uint8) == g32.to(HEAD_GRAD_FP8).view(torch.uint8)).double().mean().item()
    compiled_q, eager_q = fp8_quantize(h), _quantize(h, HEAD_INPUT_FP8)
    compiled_quantize_exact = (torch.equal(compiled_q[0].view(torch.uint8), eager_q[0].view(torch.uint8))
                               and torch.equal(compiled_q[1], eager_q[1]))
    transpose_exact = torch.equal(tiled_transpose.transpose(g8).view(torch.uint8),
                                  g8.t().contiguous().view(torch.uint8))

    # errors on a slice of the micro-batch (float64 over all of it would take minutes)
    n_err = min(N, 4 * chunk)
    he, te = h[:n_err], targets[:n_err]
    ref = reference(he, w, te, V, chunk)
    quant = reference(he, w, te, V, chunk, quantized=True)
    got = {name: fused_head_loss(he, w, te, V, CAP, chunk, fp8) for name, fp8 in paths.items()}
    errs = {name: errors(value, ref) for name, value in got.items()}
    fp8_vs_quantized = errors(got["fp8"], quant)

    result = {"shape": {"tokens": N, "width": d, "vocab": V, "padded_vocab": Vp, "chunk": chunk},
              "ms_per_micro_batch": times, "rounds_ms": rounds, "fp8_over_bf16_per_round": ratios,
              "parts_ms_one_chunk": parts, "errors_vs_float64": errs, "fp8_vs_its_quantized_operands": fp8_vs_quantized,
              "e5m2_rounding_equal_to_torch": same_rounding, "tiled_transpose_exact": transpose_exact,
              "compiled_quantize_equals_eager": compiled_quantize_exact,
              "error_tokens": n_err, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    lines = [f"# The head loss of one micro-batch: {N} tokens x {d} -> {Vp} (vocabulary {V}), chunk {chunk} "
             f"({result['device']}, torch {torch.__version__})", "",
             "| path | ms per micro-batch (median of 10 alternated rounds) | loss rel. error | d h | d W |",
             "|---|---|---|---|---|"]
    lines += [f"| {name} | {times[name]:.3f} | {errs[name]['loss']:.1e} | {errs[name]['grad_h']:.1e} | "
              f"{errs[name]['grad_w']:.1e} |" for name in paths]
    lines += ["", f"FP8 over bf16 per round: median {statistics.median(ratios):.4f} (range {min(ratios):.4f} .. "
              f"{max(ratios):.4f}). Errors: largest entry's difference over the largest entry, against float64 on "
              f"the first {n_err} tokens; the FP8 path against the float64 products of its own quantized operands: "
              f"loss {fp8_vs_quantized['loss']:.1e}, d h {fp8_vs_quantized['grad_h']:.1e}, d W "
              f"{fp8_vs_quantized['grad_w']:.1e}.", "",
              f"The cross-entropy kernel's e5m2 rounding equals torch's for {same_rounding:.6f} of the entries; the "
              f"tiled transpose is exact: {transpose_exact}; the compiled quantization equals the eager one bit for bit: "
              f"{compiled_quantize_exact}.", "", "| part (one chunk) | ms |", "|---|---|"]
    lines += [f"| {name} | {ms:.3f} |" for name, ms in parts.items()]
    write_benchmark(out, "fp8_head", result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
