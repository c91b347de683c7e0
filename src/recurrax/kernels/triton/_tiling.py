"""The Triton-backend kernels' tiles: the one place they are chosen.

| symbol | meaning                                                      |
|--------|--------------------------------------------------------------|
| C, c   | chunk length, sub-block length (per-channel decays)          |
| BV     | value columns per kernel program                             |

On a GPU: C = 64, c = 16, 8 warps, 2 stages. BV = 64 for K ≤ 64 and 32 above (the
[K, BV] float32 state, its gradient and the chunk tiles must fit in 255 registers per thread;
at K = V = 128 the backward spills with BV = 64), then halved (down to 16) while the
B·H·V/BV programs would not fill the GPU's multiprocessors once. In interpret mode (tests)
the tiles are small, so that tiny shapes still cross chunk and sub-block boundaries.
"""

from __future__ import annotations

from ._common import TritonTiles

GPU_CHUNK, GPU_SUB, GPU_WARPS, GPU_STAGES = 64, 16, 8, 2
INTERPRET_TILES = TritonTiles(chunk=16, sub=8, block_v=64, num_warps=GPU_WARPS, num_stages=GPU_STAGES)


def gpu_tiles(B: int, H: int, K: int, V: int, num_sms: int = 132) -> TritonTiles:
    """The tiles for a [B, ·, H, K] × [·, V] call on a GPU with `num_sms` multiprocessors."""
    block_v = min(V, 64 if K <= 64 else 32)
    while B * H * (V // block_v) < num_sms and block_v > 16:
        block_v //= 2
    return TritonTiles(GPU_CHUNK, GPU_SUB, block_v, GPU_WARPS, GPU_STAGES)
