"""The credit path: which input-gradient products are omitted and what is injected in their place.

`registry` names every source, `schedules` every schedule; both are leaves that import nothing else of creditlab.
"""

from creditlab.credit.registry import SOURCES, make_source, source_class

__all__ = ["SOURCES", "make_source", "source_class"]
