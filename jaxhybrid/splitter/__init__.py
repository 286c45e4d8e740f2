"""The stage splitter: one Flax model (linen or NNX) as pipeline pieces (docs/splitter.md)."""
from jaxhybrid.splitter.model import Piece, SplitModel
from jaxhybrid.splitter.program import stage_boundary

__all__ = ["SplitModel", "Piece", "stage_boundary"]
