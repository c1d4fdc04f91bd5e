"""`creditlab demo`: the real path at tiny size on the CPU, in a few minutes.

Prepares the built-in prose corpus (cached after the first run), prints the FLOP accounting of the seed
model, runs the float64 credit checks, trains the tiny model natively and with learned credit on the corpus,
compares arms on DEV loss with the verdict's instrument (native's budgets, a fair floor, two seeds), and runs
an exploratory resource screen.
"""

from __future__ import annotations

import time
from pathlib import Path


def _banner(text: str) -> None:
    print(f"\n=== {text} " + "=" * max(0, 100 - len(text)), flush=True)


def cmd_demo(args) -> int:
    if args.updates < 1:
        from creditlab.config import ConfigError
        raise ConfigError(f"--updates {args.updates}: give a positive count of updates per training run")
    start = time.time()
    runs = f"runs/demo-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    steps = [
        ("data: prepare the built-in prose corpus (cached)", ["data", "prepare", "--source", "pack:prose",
                                                              "--out", args.data]),
        ("flops: the seed model's nominal FLOP derivation", ["flops", "--preset", "seed"]),
        ("check: float64 interface checks of the credit path", ["check", "--preset", "tiny", "--seeds", "0"]),
        ("train: tiny model, exact backprop, on the corpus",
         ["train", "--preset", "tiny", "--set", "data.source=shards", "--set", f"data.dir={args.data}",
          "--set", f"train.updates={args.updates}", "--set", f"train.out_dir={runs}"]),
        ("train: tiny model, learned credit with one exact teacher update in four",
         ["train", "--preset", "tiny", "--set", "data.source=shards", "--set", f"data.dir={args.data}",
          "--set", f"train.updates={args.updates}", "--set", "credit.source=learned",
          "--set", f"train.out_dir={runs}"]),
        ("compare: native at its budgets, zero, learned and its fair floor from one start; the verdict",
         ["compare", "--preset", "tiny", "--arms", "native,zero,learned", "--seeds", "1,2", "--set",
          "data.source=shards", "--set", f"data.dir={args.data}", "--set", f"train.updates={max(4, args.updates // 2)}",
          "--set", "compare.native_budgets=0.7,1.0", "--set", "train.eval_every=10", "--set", "train.eval_tokens=8192",
          "--set", "compare.align_every=4", "--no-progress", "--out", f"{runs}/compare"]),
        ("screen: exploratory two-arm resource screen (native vs learned, zero decoders)",
         ["screen", "--preset", "tiny", "--set", "data.source=shards", "--set", f"data.dir={args.data}"]),
    ]
    for title, argv in steps:
        if argv[0] not in args.commands:
            continue
        _banner(title)
        code = args.run_command(argv)
        if code not in (0,) and argv[0] != "screen":  # a screen's verdict is a result, not a failure
            print(f"demo: step '{' '.join(argv)}' exited with {code}")
            return code
    trained = sorted(str(p) for p in Path(runs).glob("*-train-*"))
    if len(trained) > 1:
        _banner("report: the two training runs side by side")
        args.run_command(["report", *trained, "--out", runs])
    print(f"\ndemo finished in {time.time() - start:.0f} s; records are under runs/, the comparison in {runs}/")
    return 0


def add_commands(sub, config_args) -> None:
    p = sub.add_parser("demo", help="the whole path at tiny size on the CPU (data, flops, check, train, compare, "
                                    "screen)")
    p.add_argument("--data", default="data/prose", help="prepared corpus folder (default data/prose)")
    p.add_argument("--updates", type=int, default=60, help="updates per training run (default 60)")
    p.set_defaults(func=cmd_demo)


__all__ = ["add_commands", "cmd_demo"]
