"""The prefetching loader hands out the wrapped loader's batches in order, resumes exactly, and fails loudly."""

import time

import pytest
import torch

from creditlab.data import SyntheticLoader
from creditlab.data.prefetch import Prefetcher


def _loader(position: int = 0) -> SyntheticLoader:
    return SyntheticLoader(97, micro_batch=3, seq_len=8, seed=5, position=position)


def _read_ahead(ahead: Prefetcher) -> None:
    """Wait until the thread has filled its queue (it is then depth batches ahead of the trainer)."""
    deadline = time.monotonic() + 10
    while not ahead._queue.full():
        assert time.monotonic() < deadline, "the prefetch thread never filled its queue"
        time.sleep(0.005)


def test_same_batches_in_order():
    plain, ahead = _loader(), Prefetcher(_loader(), depth=3, pin=False)
    for _ in range(7):
        assert torch.equal(ahead.next(), plain.next())
    ahead.close()


def test_state_is_that_of_the_batches_taken_not_read_ahead():
    ahead = Prefetcher(_loader(), depth=4, pin=False)
    for _ in range(3):
        ahead.next()
    _read_ahead(ahead)
    assert ahead.loader.state_dict()["position"] > 3
    state = ahead.state_dict()
    assert state["position"] == 3  # the thread has read further ahead; the trainer took three
    resumed = Prefetcher(_loader(), depth=2, pin=False)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.next(), _loader(position=3).next())
    assert torch.equal(ahead.next(), _loader(position=3).next())
    ahead.close(), resumed.close()


def test_load_state_dict_restarts_at_the_given_position():
    ahead = Prefetcher(_loader(), depth=2, pin=False)
    first = ahead.next()
    ahead.next()
    ahead.load_state_dict({"position": 0})
    assert torch.equal(ahead.next(), first)
    ahead.close()


class _Broken:
    def __init__(self):
        self.position = 0

    def next(self):
        self.position += 1
        if self.position == 3:
            raise ValueError("shard 7 differs from the manifest")
        return torch.zeros(2, 3)

    def state_dict(self):
        return {"position": self.position}


def test_a_loader_error_reaches_the_trainer_at_its_batch():
    ahead = Prefetcher(_Broken(), depth=4, pin=False)
    ahead.next(), ahead.next()
    with pytest.raises(ValueError, match="shard 7"):
        ahead.next()
    with pytest.raises(ValueError, match="shard 7"):  # and every later call, rather than waiting forever
        ahead.next()


def test_attributes_pass_through():
    ahead = Prefetcher(_loader(), pin=False)
    assert (ahead.micro_batch, ahead.seq_len) == (3, 8)
    ahead.close()
