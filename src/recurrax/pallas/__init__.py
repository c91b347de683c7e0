"""Pallas kernels for the chunk algorithm, registered as `Platform.PALLAS`.

| name               | backend | priority | lowering              | status                                       |
|--------------------|---------|----------|-----------------------|----------------------------------------------|
| `pallas_gpu`       | GPU     | 30       | Pallas → Triton       | compiled for sm_90 offline; not run on a GPU |
| `pallas_interpret` | CPU     | −10      | Pallas interpret mode | tested against the reference                 |

What the kernels take (fail-closed `Support`; anything else falls back to XLA `chunk`):
float32 / bfloat16 / float16 inputs; no decay, per-head decay (`g` per head, `g_gamma`),
per-key-channel decay (`g` per channel, `gk`) and their combinations; any T (padded to
the chunk); packed variable-length input (`cu_seqlens`, traced or not: the chunk-aligned
layout of `recurrax.varlen`, with per-chunk sequence resets inside the kernels); any
grouped-head layout; `reverse`; initial states. Refused: value-side decay (`gv`), float64,
and head dims that are not powers of two in [16, 256] (Triton tiles are power-of-two
shaped and its dots need ≥ 16).

`pallas_interpret` runs the very same kernels in interpret mode on CPU, with small tiles
(C = 16, c = 8) so that tiny test shapes still cross chunk and sub-block boundaries. Its
priority is below the reference's (0), so dispatch never picks it; tests force it by name.
No TPU registration: the kernels index the [B, T, H, D] layout with a squeezed head axis
in the second-minor position, which Mosaic TPU's (8, 128) tiling does not take; a TPU
variant needs a head-major layout (and was never run on a TPU from here).
"""

from __future__ import annotations

from ..registry import Backend, Platform, Request, Support, kernel_registry
from ._chunk import gate_gradient, pallas_chunk_recurrent
from ._common import BlockSizes, Gate, Target

__all__ = ["BlockSizes", "Gate", "Target", "gate_gradient", "gpu_tiles", "pallas_chunk_recurrent", "SUPPORT"]

_HEAD_DIMS = frozenset(2**i for i in range(4, 9))  # 16 … 256


def _head_dims(request: Request) -> str | None:
    for name, dim in (("qk_head_dim", request.qk_head_dim), ("v_head_dim", request.v_head_dim)):
        if dim not in _HEAD_DIMS:
            return f"{name}={dim} is not a power of two in [16, 256]"
    return None


SUPPORT = Support(
    dtypes=frozenset({"float32", "bfloat16", "float16"}),
    gates=frozenset({"head", "key"}),
    varlen=True,
    check=_head_dims,
)


def gpu_tiles(B: int, H: int, K: int, V: int, num_sms: int = 132) -> dict:
    """Tile choice for the Triton kernels, from offline compiles (ptxas for sm_90, no GPU).

    C = 64, c = 16, 8 warps. BV = 64 for K ≤ 64 and 32 above (the [K, BV] float32 state,
    its gradient and the chunk tiles must fit in 255 registers per thread: at K = V = 128
    the backward spills ~0.6 KB per thread with BV = 32, ~1.2 KB with BV = 64); then halved
    (down to 16) while the B·H·V/BV programs would not fill the GPU's multiprocessors once.
    Not yet confirmed by timings on a GPU (`benchmarks/gpu.sh` sweeps a few).
    """
    block_v = min(V, 64 if K <= 64 else 32)
    while B * H * (V // block_v) < num_sms and block_v > 16:
        block_v //= 2
    return dict(chunk_size=64, sub_size=16, block_v=block_v, num_warps=8, num_stages=2)


@kernel_registry.register("pallas_gpu", Platform.PALLAS, Backend.GPU, priority=30, supports=SUPPORT)
def pallas_gpu(problem, *, scale: float, reverse: bool):
    """The chunk kernels through Pallas's Triton lowering (NVIDIA/AMD GPUs)."""
    B, _, H, K = problem.query.shape
    tiles = gpu_tiles(B, H, K, problem.value.shape[-1])
    return pallas_chunk_recurrent(problem, scale=scale, reverse=reverse, target="triton", **tiles)


@kernel_registry.register("pallas_interpret", Platform.PALLAS, Backend.CPU, priority=-10, supports=SUPPORT)
def pallas_interpret(problem, *, scale: float, reverse: bool):
    """The same kernels in Pallas interpret mode, small tiles (tests; never auto-selected)."""
    return pallas_chunk_recurrent(problem, scale=scale, reverse=reverse, chunk_size=16, sub_size=8, interpret=True)
