"""The chunkwise-parallel XLA algorithm of `recurrax.recurrent` and its tilings (the code:
`recurrax/recurrence/_chunk/`)."""

from .recurrence._chunk import DEFAULT_TILING, SUPPORT, BackendTiling, Tiling, chunk_recurrent, default_tiling

__all__ = ["DEFAULT_TILING", "SUPPORT", "BackendTiling", "Tiling", "chunk_recurrent", "default_tiling"]
