"""What one compiled forward keeps for its backward: the distinct storages saved, grouped by shape and dtype,
largest first, in bytes per token.

    python benchmarks/kept.py --out DIR [--preset seed] [--micro 64] [--set k=v ...]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from creditlab import config as config_mod  # noqa: E402
from creditlab import runtime as rt  # noqa: E402
from creditlab.train import build_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="seed")
    ap.add_argument("--micro", type=int, default=None, help="micro-batch (default: the preset's)")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    cfg = config_mod.load(args.preset, args.overrides)
    runtime = rt.resolve(cfg.train)
    model = build_model(cfg, runtime)
    forward = rt.maybe_compile(model, runtime)
    B, T = args.micro or cfg.train.micro_batch, cfg.model.seq_len
    idx = torch.randint(0, cfg.model.vocab_size, (B, T), device=runtime.device)
    owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    kept, groups = {}, collections.Counter()

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in owned and storage.data_ptr() not in kept:
            kept[storage.data_ptr()] = storage.nbytes()
            groups[(tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch."), storage.nbytes())] += 1
        return t

    for _ in range(2):  # the second call runs the compiled graph
        kept.clear()
        groups.clear()
        with runtime.autocast(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = forward(idx, idx, loss_chunk=cfg.train.loss_chunk)
        loss.backward()
        model.zero_grad(set_to_none=True)
    tokens = B * T
    lines = [f"{cfg.model.layers} layers, {tokens:,} tokens: {sum(kept.values()) / 2**20:,.0f} MiB kept, "
             f"{sum(kept.values()) / tokens / cfg.model.layers:,.0f} bytes per token per layer", "",
             "| storages | shape of one view | strides | dtype | bytes per token (each) |", "|---|---|---|---|---|"]
    for (shape, stride, dtype, nbytes), count in sorted(groups.items(), key=lambda kv: -kv[0][3] * kv[1]):
        lines.append(f"| {count} | {shape} | {stride} | {dtype} | {nbytes / tokens:,.1f} |")
    text = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kept.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
