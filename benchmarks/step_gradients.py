"""Does the training step as it runs on this GPU compute the gradient it claims? Each arm's compiled step and
its eager step against the same step in float64 on the CPU, every module at its plain form
(creditlab/step_check.py).

    python benchmarks/step_gradients.py --out DIR [--arms native,zero,learned] [--preset seed] [--micro-batch 2]
        [--set key=value ...]

One micro-batch of each kind an arm trains with (native; synthetic; synthetic and teacher), from random weights
(no zero projection or head) and the same tokens in all three. Per arm and kind: each parameter's gradient error
||g - g_ref|| / ||g_ref||, compiled and eager (on a teacher micro-batch also the fit's: the predictor's gradients
and the fit's statistics); the eager error is the precision's, so a compiled error above it is the compiler's. A
parameter is flagged where the compiled error is over twice eager's (and over 1e-3), or either is over 0.1.
Writes DIR/step_gradients.json (every parameter) and DIR/step_gradients.md; exits 1 when anything is flagged.
Any CUDA machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from arms import overrides_of  # noqa: E402
from creditlab import step_check  # noqa: E402
from creditlab.runtime import gpu_benchmark_folder, write_benchmark  # noqa: E402


def summary_rows(arm: str, result: dict) -> list[str]:
    """One table row per kind of an arm's step check: the largest errors and where they fall."""
    rows = []
    for kind, errors in result["errors"].items():
        worst_compiled, worst_eager = step_check.largest(errors, "compiled"), step_check.largest(errors, "eager")
        ratios = [e["compiled"] / e["eager"] for e in errors.values() if e["eager"] > 0]
        flagged = [f"{f['parameter']}` ({f['why']})" for f in result["flagged"] if f["kind"] == kind]
        rows.append(f"| {arm} | {kind} | {errors[worst_compiled]['compiled']:.2e} (`{worst_compiled}`) | "
                    f"{errors[worst_eager]['eager']:.2e} (`{worst_eager}`) | "
                    f"{statistics.median(ratios):.2f} (max {max(ratios):.2f}) | "
                    f"{len(flagged)}{': ' + ', '.join(f'`{p}' for p in flagged[:4]) if flagged else ''}"
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
             "||g_ref|| per parameter against the same step in float64 on the CPU with every module plain. "
             "Compiled over eager: the ratio of the two errors over parameters. Flagged: compiled over "
             f"{step_check.COMPILED_OVER_EAGER:g} x eager's error and over {step_check.FLOOR:g} (the compiler's), or "
             f"either over {step_check.CEILING:g} (a Function's or a kernel's, or the precision's).", "",
             "| arm | kind | largest compiled error | largest eager error | compiled over eager, median | "
             "flagged |", "|---|---|---|---|---|---|"]
    for arm, r in results.items():
        lines += summary_rows(arm, r)
    lines += ["", f"Verdict: **{verdict}**."]
    write_benchmark(out, "step_gradients", result, lines)
    return 0 if verdict == "consistent" else 1


if __name__ == "__main__":
    sys.exit(main())
