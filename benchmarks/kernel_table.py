"""Where an update's GPU time goes, by kind of kernel, from the profiles `benchmarks/arms.py --profile` writes.

    python benchmarks/kernel_table.py NAME=PROFILE.txt [NAME=PROFILE.txt ...] [--out TABLE.md]

A profile's table lists the largest rows of torch.profiler's key averages; the kernels are the rows with no CPU
time of their own. Each is put in one class by its name (inductor names a generated kernel after the operations
it fused, which says what it computes only roughly: the classes below say which words decide). Time is per
update (the profile covers `updates` updates, read from its first line); what the table's rows leave out is
the difference between the GPU's busy time and the listed kernels.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stored import read_stored  # noqa: E402  (a profile packed in results/raw.tar.xz is read from there)

# (class, test on the kernel's name), first match wins.
CLASSES = [
    ("products (cuBLAS)", lambda n: n.startswith("nvjet") or "gemm" in n or "cutlass" in n),
    ("fused MLP products (Triton, Gluon)", lambda n: n.startswith(("_matmul_kernel", "_mlp_kernel"))),
    ("Q/K/V product with QK-norm + rotary", lambda n: n.startswith("_qkv_kernel")),
    ("attention (cuDNN)", lambda n: "cudnn" in n or "flash" in n or "sdpa" in n),
    ("head cross-entropy (Triton)", lambda n: n.startswith("_softcap_ce_rows")),
    ("QK-norm + rotary", lambda n: n.startswith("_qk_") or n in ("_forward", "_backward")  # the kernels' first names
     or (n.startswith("triton") and "cat" in n and ("neg" in n or "split" in n))),
    ("ReLU^2 (plain MLP)", lambda n: n.startswith("triton") and ("relu" in n or "threshold" in n or "le_" in n)
     and "dgrad" not in n),
    # before the norms: the compiler fused the token embedding's backward (an atomic add per element) with the
    # first norm's, so its name also says mean; the sorted backward's kernel and its sort are counted here too
    ("embeddings", lambda n: (n.startswith("triton") and "embedding" in n) or n.startswith("_embedding_grads")
     or "RadixSort" in n),
    ("norms", lambda n: n.startswith("_norm_decode") or (n.startswith("triton") and ("rsqrt" in n or "mean" in n))),
    ("the teacher's fit (Triton)", lambda n: n.startswith("_fit_rows")),
    ("attention gate (Triton)", lambda n: n.startswith(("_thin_forward", "_thin_backward"))),
    ("state gate and decode (Triton)", lambda n: n.startswith(("_state_gate", "_gated_decode"))),
    ("other generated pointwise / reductions", lambda n: n.startswith("triton")),
    ("optimizer and eager elementwise", lambda n: "at::native" in n or "multi_tensor" in n or "foreach" in n),
    ("copies and memsets", lambda n: n.startswith("Memcpy") or n.startswith("Memset")),
]
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()
    return float(value) * _UNITS[unit]


def classify(name: str) -> str:
    for label, test in CLASSES:
        if test(name):
            return label
    return "other"


def read_profile(path: Path) -> dict:
    lines = read_stored(path).splitlines()
    head = re.search(r"([\d.]+) ms per update, ([\d,]+) kernels per update, over (\d+) profiled", lines[0])
    busy, updates = float(head.group(1)), int(head.group(3))
    by_class: dict[str, float] = {}
    seen = set()
    for line in lines:
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) != 11 or not cells[-1].isdigit():
            continue
        name, self_cpu, self_cuda = cells[0], cells[2], cells[6]
        try:
            cpu, cuda = _ms(self_cpu), _ms(self_cuda)
        except AttributeError:
            continue
        # no CPU time of its own: a kernel, or a range the profiler draws on the GPU's timeline over kernels
        # listed anyway (the optimizers' steps, the compiled graphs' calls), which would count them twice
        if (cpu > 0 or cuda == 0 or (name, self_cuda) in seen
                or name.startswith(("Optimizer.", "ProfilerStep", "## Call CompiledFxGraph"))):
            continue
        seen.add((name, self_cuda))
        by_class[classify(name)] = by_class.get(classify(name), 0.0) + cuda / updates
    listed = sum(by_class.values())
    by_class["not among the listed rows"] = max(busy - listed, 0.0)
    return {"busy_ms": busy, "kernels": int(head.group(2).replace(",", "")), "by_class": by_class}


def table(profiles: dict[str, dict]) -> str:
    names = list(profiles)
    classes = [c for c, _ in CLASSES] + ["other", "not among the listed rows"]
    rows = ["| ms per update | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for c in classes:
        values = [profiles[n]["by_class"].get(c, 0.0) for n in names]
        if any(v > 0.05 for v in values):
            rows.append(f"| {c} | " + " | ".join(f"{v:.1f}" for v in values) + " |")
    rows.append("| **GPU busy** | " + " | ".join(f"**{profiles[n]['busy_ms']:.1f}**" for n in names) + " |")
    rows.append("| kernels per update | " + " | ".join(f"{profiles[n]['kernels']:,}" for n in names) + " |")
    return "\n".join(rows) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profiles", nargs="+", metavar="NAME=PROFILE.txt")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    profiles = {}
    for item in args.profiles:
        name, eq, path = item.partition("=")
        if not eq:
            print(f"kernel_table: {item!r} is not NAME=PROFILE.txt", file=sys.stderr)
            return 2
        profiles[name] = read_profile(Path(path))
    text = table(profiles)
    if args.out:
        Path(args.out).write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
