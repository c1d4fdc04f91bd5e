"""Evaluation: next-token loss (nats per token) and bits per byte on a fixed subset of DEV or FINAL_HELDOUT.

Forward only: the head's loss is summed chunk by chunk with no gradient work (`GPT.loss_sum`). The subset is
fixed when the evaluator is made: the first windows of the split in the loader's order for `EVAL_SEED`, the same
for every arm and every training seed, read once through the access ledger (one entry, with its purpose).

Bits per byte convert the mean loss with the split's own ratio of tokens to UTF-8 bytes from the manifest:
bits/byte = (nats/token) / ln 2 * (tokens / bytes). The document separators count as targets (each document is
preceded by one) and as tokens in that ratio, so both sides count the same things. The synthetic stream has no
bytes: it reports nats per token only.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from creditlab import data
from creditlab import runtime as rt
from creditlab.config import Config

EVAL_SEED = 0  # the order the evaluation subset is drawn in; not a training seed


@dataclass
class EvalRow:
    update: int  # updates done when evaluated (0: the initial model)
    split: str
    loss: float  # mean nats per target token
    bits_per_byte: float | None
    tokens: int  # target tokens evaluated
    seconds: float

    def to_dict(self) -> dict:
        return asdict(self)


def split_tokens_per_byte(cfg: Config, split: str) -> float | None:
    """Tokens per UTF-8 byte of a prepared split (None for the synthetic stream, or without byte counts)."""
    if cfg.data.source != "shards":
        return None
    s = data.load_manifest(cfg.data.dir)["splits"][split]
    return s["tokens"] / s["bytes"] if s.get("bytes") else None


class Evaluator:
    """The loss of a model on a fixed subset of `tokens` target tokens of one split."""

    def __init__(self, cfg: Config, runtime: rt.Runtime, split: str = "dev", tokens: int | None = None, *,
                 purpose: str, admission: str | None = None, allow_final_heldout: bool = False):
        tokens = cfg.train.eval_tokens if tokens is None else tokens
        if tokens < 1:
            raise ValueError(f"an evaluation needs at least one token (train.eval_tokens={tokens})")
        self.cfg, self.runtime, self.split = cfg, runtime, split
        seed = EVAL_SEED if cfg.data.source == "shards" else None  # the synthetic stream's structure is its seed
        loader = data.make_loader(cfg, split, purpose=purpose, admission=admission,
                                  allow_final_heldout=allow_final_heldout, seed=seed)
        B, T = cfg.train.micro_batch, cfg.model.seq_len
        batches = math.ceil(tokens / (B * T))
        windows = getattr(loader, "windows_per_epoch", None)
        if windows is not None:  # a prepared split: never serve a window twice
            batches = max(1, min(batches, windows // B))
        self.batches = [loader.batch_at(i) for i in range(batches)]  # (B, T+1) each, kept on the host
        self.tokens = batches * B * T
        self.tokens_per_byte = split_tokens_per_byte(cfg, split)

    @torch.no_grad()
    def __call__(self, model, update: int) -> EvalRow:
        rt_ = self.runtime
        start = time.perf_counter()
        total = torch.zeros((), dtype=torch.float64, device=rt_.device)
        for batch in self.batches:
            batch = batch.to(rt_.device, non_blocking=True)
            with rt_.autocast():
                total += model.loss_sum(batch[:, :-1], batch[:, 1:], self.cfg.train.loss_chunk).double()
        loss = total.item() / self.tokens
        bpb = None if self.tokens_per_byte is None else loss / math.log(2) * self.tokens_per_byte
        return EvalRow(update, self.split, loss, bpb, self.tokens, time.perf_counter() - start)
