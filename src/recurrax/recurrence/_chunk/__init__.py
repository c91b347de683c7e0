"""The chunkwise-parallel XLA algorithm (see `_algorithm.py` for the method).

| module          | what it holds                                                        |
|-----------------|----------------------------------------------------------------------|
| `_algorithm`    | `chunk_recurrent`: padding, packed layout, the call into the scan    |
| `_tiling`       | `Tiling` and the default tiling per backend                          |
| `_state_scan`   | the scan of the state across chunks and its hand-written backward    |
| `_shared`       | query/key shared by groups of heads with per-head decays (SSD)       |
| `_intra`        | the decayed causal products inside a chunk (masked matmul, ladder)   |
"""

from ._algorithm import SUPPORT, chunk_recurrent
from ._tiling import DEFAULT_TILING, BackendTiling, Tiling, default_tiling

__all__ = ["DEFAULT_TILING", "SUPPORT", "BackendTiling", "Tiling", "chunk_recurrent", "default_tiling"]
