"""FLOPs per token of each credit source's synthetic and teacher micro-batches at the seed model's width,
counted by torch's FlopCounterMode (matrix products; elementwise work and scans are not counted), less those of
the `zero` step (synthetic) and of native backprop (teacher). On the CPU, one micro-batch of a short sequence:
the sources' extra FLOPs per token do not depend on the sequence length, and what they spend once per
micro-batch (the teachers' statistics, the sketch's factors A = W V) is told apart by measuring at two lengths.

    python benchmarks/fit_flops.py --out DIR      writes DIR/flops.json and DIR/flops.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from creditlab import config as config_mod  # noqa: E402
from creditlab.train import Trainer  # noqa: E402
from creditlab.credit.sources import ZeroSource  # noqa: E402
from creditlab.data import SyntheticLoader  # noqa: E402
from creditlab.model import ExactCredit  # noqa: E402

SOURCES = {"learned": [], "typed": [], "fitted_feedback": [], "dfa": [], "dni": [],
           "learned_rank128": ["credit.rank=128"],
           **{f"sketch_rank{k}": [f"credit.sketch_rank={k}"] for k in (16, 32, 64)}}


def counted(fn) -> int:
    with FlopCounterMode(display=False) as flops:
        fn()
    return flops.get_total_flops()


def measure(name: str, extra: list[str], seq: int = 128) -> dict:
    """Per token at `seq`; the FLOPs may also hold a part fixed per micro-batch (the teacher's d x d and rank-size
    statistics, the sketch's factors), separated by measuring at two lengths: FLOPs(N) = per_token * N +
    per_micro_batch."""
    short, long = _measure(name, extra, seq), _measure(name, extra, 2 * seq)
    row = {"omitted_per_token": long["omitted_per_token"]}
    for step in ("synthetic", "teacher"):
        if long[step] is None:
            row[f"{step}_extra_per_token"] = row[f"{step}_extra_per_micro_batch"] = None
            continue
        per_token = (long[step] - short[step]) / seq
        row[f"{step}_extra_per_token"] = per_token
        row[f"{step}_extra_per_micro_batch"] = short[step] - per_token * seq
    return row


def _measure(name: str, extra: list[str], seq: int) -> dict:
    source = name.split("_rank")[0]
    cfg = config_mod.load("seed", [f"credit.source={source}", "train.device=cpu", "train.compile=off",
                                   "train.dtype=float32", "train.micro_batch=1", "train.grad_accum=1",
                                   f"model.seq_len={seq}", "credit.fit=lstsq", *extra])
    ids = torch.randint(0, cfg.model.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    trainer = Trainer(cfg, loader=SyntheticLoader(cfg.model.vocab_size, 1, seq, seed=0))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    model = trainer.model

    def step(credit):
        return lambda: model(inputs, targets, credit=credit).backward()

    zero = counted(step(ZeroSource().step()))
    native = counted(step(ExactCredit()))
    # The trainer's own synthetic context (the sketch takes its basis there), made outside the count: the
    # sketch's SVD refresh, every sketch_every updates, is not a matrix product the counter would see anyway.
    synthetic = counted(step(trainer.source.context(trainer, inputs, targets, "synthetic", 1.0)))
    teacher = counted(lambda: trainer.source.teach(trainer, inputs, targets, 1.0)) if trainer.source.fits else None
    return {"synthetic": synthetic - zero, "teacher": None if teacher is None else teacher - native,
            "omitted_per_token": (native - zero) / inputs.numel()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = {name: measure(name, extra) for name, extra in SOURCES.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "flops.json").write_text(json.dumps(rows, indent=2) + "\n")
    omitted = next(iter(rows.values()))["omitted_per_token"]
    lines = ["| source | synthetic step: extra MFLOP/token | share of the omitted products' FLOPs | "
             "synthetic: extra GFLOP per micro-batch | teacher: extra MFLOP/token | "
             "teacher: extra GFLOP per micro-batch |", "|---|---|---|---|---|---|"]
    mega = lambda x: "-" if x is None else f"{x / 1e6:.2f}"  # noqa: E731
    giga = lambda x: "-" if x is None else f"{x / 1e9:.2f}"  # noqa: E731
    for name, r in rows.items():
        lines.append(f"| {name} | {mega(r['synthetic_extra_per_token'])} | "
                     f"{r['synthetic_extra_per_token'] / omitted:.1%} | {giga(r['synthetic_extra_per_micro_batch'])} | "
                     f"{mega(r['teacher_extra_per_token'])} | {giga(r['teacher_extra_per_micro_batch'])} |")
    lines.append(f"\nThe omitted products: {omitted / 1e6:.2f} MFLOP/token (native's forward-and-backward matrix "
                 "FLOPs less zero's); at the seed shape they are 12.28% of a native update's FLOPs (DESIGN section 6).")
    (out / "flops.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
