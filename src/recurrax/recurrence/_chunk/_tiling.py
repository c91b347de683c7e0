"""Tile sizes of the XLA chunk algorithm, and the defaults per backend.

| symbol | meaning                                                             |
|--------|---------------------------------------------------------------------|
| C      | chunk size: one K×V state is materialised per chunk                 |
| c      | leaf size of the per-channel decay ladder                           |
| P      | chunks per step of the state scan                                   |

This is where the XLA chunk algorithm's tiling is changed. It applies wherever `chunk` runs
(it is also the fallback when an accelerator kernel refuses a call); the Pallas kernels
have their own tiles in `recurrax/kernels/*/`.
"""

from __future__ import annotations

import dataclasses

from ..._core.registry import current_backend


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static tile sizes of the chunk algorithm.

    **Arguments:**
    - `chunk_size`: tokens per chunk C; the state is materialised once per chunk.
    - `leaf_size`: leaf block c of the per-channel decay ladder: diagonal blocks of c
      tokens are evaluated element-wise (C / c must be a power of two).
    - `chunks_per_step`: chunks P handled by one step of the state scan (their intra-chunk
      work is batched; a larger P amortises per-operation overhead, a smaller P keeps a
      step's working set in cache).
    """

    chunk_size: int
    leaf_size: int
    chunks_per_step: int

    def check(self) -> None:
        C, c = self.chunk_size, self.leaf_size
        for name in ("chunk_size", "leaf_size", "chunks_per_step"):
            size = getattr(self, name)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{name} must be a positive int, got {size!r}")
        ratio = C // c
        if C % c or ratio & (ratio - 1):
            raise ValueError(f"chunk_size must be leaf_size times a power of two, got chunk_size={C}, leaf_size={c}")

    def fitted(self, seq_len: int) -> Tiling:
        """Smaller tiles for a short sequence: halve C while it fits in half a chunk (C / c
        stays a power of two), then fit the chunks per step to the chunk count."""
        size = self.chunk_size
        while size // 2 >= max(seq_len, self.leaf_size):
            size //= 2
        return Tiling(size, min(self.leaf_size, size), self.steps_for(-(-seq_len // size)))

    def steps_for(self, num_chunks: int) -> int:
        """Chunks per step for `num_chunks` chunks: the largest P' ≤ P whose padding of the
        chunk count to a multiple of P' wastes at most an eighth (P' = 1 never pads)."""
        for per_step in range(min(self.chunks_per_step, num_chunks), 0, -1):
            padded = -(-num_chunks // per_step) * per_step
            if 8 * (padded - num_chunks) <= padded:
                return per_step
        return 1


@dataclasses.dataclass(frozen=True)
class BackendTiling:
    """A backend's default tilings: `scalar_decays` when no per-channel decay is present
    (the intra-chunk product is a masked matmul), `channel_decays` otherwise (the ladder)."""

    scalar_decays: Tiling
    channel_decays: Tiling
    shared_query_key: Tiling = Tiling(64, 1, 2)
    """Query/key shared by groups of heads with per-head decays (`_shared.py`): its per-chunk
    states are a whole group's, so fewer chunks per step (P = 2: 26% less CPU time than
    P = 8 at Mamba-2 130M's SSD shape, [8, 512] tokens, 24 heads sharing one 128-wide
    query/key, P = 1 within noise of P = 2)."""


_SWEPT_ON_CPU = BackendTiling(scalar_decays=Tiling(64, 1, 8), channel_decays=Tiling(32, 1, 4))

_SWEPT_ON_V5E = BackendTiling(scalar_decays=Tiling(128, 1, 8), channel_decays=Tiling(32, 1, 4))
"""A TPU v5e, bfloat16, B = 4, T = 4096, H = 16, K = V = 64 (`benchmarks/tpu_chunk_sweep.py`,
`benchmarks/results/tpu_chunk_sweep.md`): a per-head decay runs fastest at C = 128
(3.10 / 9.91 ms forward / fwd+bwd against 4.88 / 13.47 at the CPU's 64x1x8; 256x1x4 within 2%);
per-channel decays keep 32x1x4 (6.98 / 23.76 ms; every larger C or P tried was slower: the
ladder's levels grow with C). The shared query/key tiling was not swept there."""

DEFAULT_TILING = {"cpu": _SWEPT_ON_CPU, "gpu": _SWEPT_ON_CPU, "tpu": _SWEPT_ON_V5E}
"""Default tiling per backend. The CPU entries come from `benchmarks/chunk_sweep.py` (results
and reasons in `benchmarks/results/chunk_sweep.md`), the TPU's from a v5e; GPUs have not been
swept and reuse the CPU's."""


def default_tiling(per_channel: bool, backend: str | None = None, shared_query_key: bool = False) -> Tiling:
    """The default tiling for a problem with (or without) per-channel decays on `backend`
    (default: the current one); `shared_query_key`: query and key shared by groups of heads."""
    table = DEFAULT_TILING.get(backend or current_backend(), DEFAULT_TILING["cpu"])
    if per_channel:
        return table.channel_decays
    return table.shared_query_key if shared_query_key else table.scalar_decays
