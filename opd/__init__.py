"""Draft-OPD: on-policy distillation of speculative-decoding drafters (arXiv 2605.29343)."""

__version__ = "0.1.0"

# The drafter formats register what a model directory is recognised as (opd.model_dir.RECOGNISERS) when imported:
# importing them with the package means every reader of a ModelDir sees them.
from opd import formats  # noqa: E402, F401
