"""Draft-OPD: on-policy distillation of DFlash speculative-decoding drafters (arXiv 2605.29343)."""

__version__ = "0.1.0"
