"""Shared test settings."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny shapes gain nothing from intra-op threads, and spinning threads crawl on shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
