"""Does the training step as it runs on this GPU compute the gradient it claims? Each arm's compiled step, its
eager step and its plain step (every module torch arithmetic, same precision) against the same step in float64
on the CPU (creditlab/checks/step_check.py).

    python benchmarks/step_gradients.py --out DIR [--arms native,zero,learned] [--preset seed] [--micro-batch 2]
        [--set key=value ...]

One micro-batch of each kind an arm trains with (native; synthetic; synthetic and teacher), from random weights
(no zero projection or head) and the same tokens in all four. Per arm and kind: each parameter's gradient error
||g - g_ref|| / ||g_ref||, compiled, eager and plain (on a teacher micro-batch also the fit's: the predictor's
gradients and the fit's statistics). The plain error is the precision's level: a parameter is flagged where the
eager error is over 4 x the level (a fused module's or kernel's), the compiled error over 4 x the larger of
eager's and the level (the compiler's), either also over 1e-3, or the level over 0.1; one of fewer than 16
elements whose level could reach the flags (the scalar mixes in bf16) is listed, not judged. Writes
DIR/step_gradients.json (every parameter), DIR/step_gradients.md and DIR/step_gradients.png (each parameter's
error over its level); exits 1 when anything is flagged. Any CUDA machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import plot  # noqa: E402
from arms import overrides_of  # noqa: E402
from creditlab.checks import step_check  # noqa: E402
from creditlab.runtime import gpu_benchmark_folder, write_benchmark  # noqa: E402


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


def summary_rows(arm: str, result: dict) -> list[str]:
    """One table row per kind of an arm's step check: the largest errors, the ratios the flags read (over the
    judged parameters), and the parameters not judged or flagged."""
    rows = []
    for kind, errors in result["errors"].items():
        unjudged = [f["parameter"] for f in result["unjudged"] if f["kind"] == kind]
        judged = step_check.judged_errors(errors, result["unjudged"], kind)
        if not judged:
            rows.append(f"| {arm} | {kind} | - | - | - | - | {len(unjudged)} (every parameter) | 0 |")
            continue
        eager_over_plain = [ratio(e["eager"], e["plain"]) for e in judged.values()]
        compiled_over = [ratio(e["compiled"], max(e["eager"], e["plain"])) for e in judged.values()]
        worst_compiled, worst_eager = step_check.largest(judged, "compiled"), step_check.largest(judged, "eager")
        flagged = [f"`{f['parameter']}` ({f['why']})" for f in result["flagged"] if f["kind"] == kind]
        rows.append(f"| {arm} | {kind} | {errors[worst_compiled]['compiled']:.2e} (`{worst_compiled}`) | "
                    f"{errors[worst_eager]['eager']:.2e} (`{worst_eager}`) | "
                    f"{statistics.median(eager_over_plain):.2f} (max {max(eager_over_plain):.2f}) | "
                    f"{statistics.median(compiled_over):.2f} (max {max(compiled_over):.2f}) | "
                    f"{len(unjudged)}{': ' + ', '.join(f'`{p}`' for p in unjudged[:4]) if unjudged else ''}"
                    f"{' ...' if len(unjudged) > 4 else ''} | "
                    f"{len(flagged)}{': ' + ', '.join(flagged[:4]) if flagged else ''}"
                    f"{' ...' if len(flagged) > 4 else ''} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--arms", default="native,zero,learned")
    ap.add_argument("--preset", default="seed")
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    arms = {name: overrides_of(name) for name in args.arms.split(",")}  # a misspelt arm fails before GPU time
    out = gpu_benchmark_folder(args.out)
    if out is None:
        return 2
    results = {}
    for arm, overrides in arms.items():
        print(f"{arm}:", flush=True)
        results[arm] = step_check.check_step(args.preset, [*args.overrides, *overrides], args.micro_batch,
                                             args.seed, say=lambda line: print(f"  {line}", flush=True))
    verdict = "consistent" if all(r["verdict"] == "consistent" for r in results.values()) else "INCONSISTENT"
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": args.preset,
              "overrides": args.overrides, "micro_batch": args.micro_batch, "seed": args.seed,
              "bounds": results[next(iter(results))]["bounds"], "verdict": verdict, "arms": results}
    lines = [f"# The training step's gradients against float64, preset {args.preset} "
             f"({torch.cuda.get_device_name()}, torch {torch.__version__})", "",
             f"One micro-batch of {args.micro_batch} sequences per kind, random weights. Error: ||g - g_ref|| / "
             "||g_ref|| per parameter against the same step in float64 on the CPU with every module plain. The "
             "level: the plain step's error (torch arithmetic in this precision, no kernel of ours). Flagged: eager "
             f"over {step_check.OVER_LEVEL:g} x the level (a fused module's or a kernel's), or compiled over "
             f"{step_check.OVER_LEVEL:g} x the larger of eager's and the level (the compiler's), either also over "
             f"{step_check.FLOOR:g}, or the level over {step_check.CEILING:g} (the plain step off). A parameter of "
             f"fewer than {step_check.MIN_ELEMENTS} elements whose level is over {step_check.FLOOR:g} / "
             f"{step_check.OVER_LEVEL:g} is not judged (one draw of the rounding's noise over a few elements is no "
             "level); the largest errors and the ratios are over the judged ones.", "",
             "| arm | kind | largest compiled error | largest eager error | eager over the level, median | "
             "compiled over eager or the level, median | not judged | flagged |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, r in results.items():
        lines += summary_rows(arm, r)
    lines += ["", f"Verdict: **{verdict}**."]
    write_benchmark(out, "step_gradients", result, lines)
    plot.plot_step_gradients(out / "step_gradients.json", out, "step_gradients.png")
    return 0 if verdict == "consistent" else 1


if __name__ == "__main__":
    sys.exit(main())
