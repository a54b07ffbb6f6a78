"""partrain: a config-driven launcher for hybrid-parallel training of decoder-only transformers."""

__version__ = "0.1.0"
