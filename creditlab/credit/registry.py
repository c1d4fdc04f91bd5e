"""The credit sources by name: one line each, `name: "module:Class"`.

A source is one class (a `CreditSource` with a `name`, built by its `from_config(cfg)`) and one line here. The
table names modules instead of importing them so that config.py can check `credit.source` when a config is built
without importing a source (the sources import the config); a source's class is imported when first asked for.
"""

from __future__ import annotations

import importlib

SOURCES: dict[str, str] = {
    "exact": "creditlab.credit.sources:CreditSource",
    "oracle": "creditlab.credit.sources:OracleSource",
    "zero": "creditlab.credit.sources:ZeroSource",
    "learned": "creditlab.credit.predictor:LearnedSource",
    "typed": "creditlab.credit.predictor:TypedSource",
    "dfa": "creditlab.credit.feedback:DFASource",
    "dni": "creditlab.credit.dni:DNISource",
    "fitted_feedback": "creditlab.credit.feedback:FittedFeedbackSource",
    "fdfa": "creditlab.credit.fdfa:FDFASource",
    "sketch": "creditlab.credit.sketch:SketchSource",
    "fp8": "creditlab.credit.fp8:Fp8Source",
    "dropbp": "creditlab.credit.dropbp:DropBPSource",
}


def source_class(name: str):
    """The class registered as `name`; a ValueError lists the valid names."""
    if name not in SOURCES:
        raise ValueError(f"unknown credit source {name!r}; valid: {', '.join(SOURCES)}")
    module, _, cls = SOURCES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def make_source(cfg):
    """The configured source, built from the whole config."""
    return source_class(cfg.credit.source).from_config(cfg)
