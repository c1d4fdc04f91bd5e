"""creditlab: a research harness for learned credit transport in language-model pretraining."""

__version__ = "0.1.0"
