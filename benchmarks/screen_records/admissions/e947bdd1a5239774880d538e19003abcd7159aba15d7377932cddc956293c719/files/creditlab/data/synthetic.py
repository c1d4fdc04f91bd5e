"""A deterministic synthetic token stream: no files, the same batches for the same (seed, position)."""

from __future__ import annotations

import torch


class SyntheticLoader:
    """Micro-batches of B x (T+1) tokens drawn from a seeded generator keyed by (seed, rank, position).

    The stream has learnable structure (runs of a fixed random cyclic order of the vocabulary, with 10% of
    tokens replaced at random), so a model can be seen to learn from it.
    """

    def __init__(self, vocab_size: int, micro_batch: int, seq_len: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1, position: int = 0):
        self.vocab_size, self.micro_batch, self.seq_len = vocab_size, micro_batch, seq_len
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.position = position
        g = torch.Generator().manual_seed(seed)
        self._order = torch.randperm(vocab_size, generator=g)

    def batch_at(self, position: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.seed, position * self.world_size + self.rank)) % 2**62)
        B, T = self.micro_batch, self.seq_len + 1
        start = torch.randint(0, self.vocab_size, (B, 1), generator=g)
        ordered = self._order[(start + torch.arange(T)) % self.vocab_size]
        noise = torch.rand(B, T, generator=g) < 0.1
        return torch.where(noise, torch.randint(0, self.vocab_size, (B, T), generator=g), ordered)

    def next(self) -> torch.Tensor:
        batch = self.batch_at(self.position)
        self.position += 1
        return batch

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
