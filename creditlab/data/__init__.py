"""Token data: the synthetic stream, prepared shards, splits, the access ledger and the loader."""

from creditlab.data.synthetic import SyntheticLoader

__all__ = ["SyntheticLoader"]
