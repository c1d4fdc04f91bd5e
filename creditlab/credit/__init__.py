"""The credit path: which input-gradient products are omitted and what is injected in their place."""

from creditlab.credit.sources import SOURCES, CreditSource, make_source

__all__ = ["SOURCES", "CreditSource", "make_source"]
