"""Pallas TPU (Mosaic) kernels of the chunk algorithm, head-major inside.

| module       | what it holds                                                               |
|--------------|-----------------------------------------------------------------------------|
| `_tiles`     | `TpuTiles`, `TpuCall`, head-major layouts, Mosaic-legal BlockSpecs, tile maths |
| `_forward`   | the forward kernel: outputs, final state, chunk-entry states               |
| `_backward`  | the backward kernel: dq, dk, dv, d(initial state), boundary terms          |
| `_vmem`      | a tiling's VMEM against the generation's scoped limit (refused before Mosaic) |

The array contract at the boundary is the driver's (`kernels/_driver.py`, token-major); the
wrappers transpose to `[B, H, Tp, D]`, and the grid is (b, h, value block, chunk) with the
chunk axis sequential ("arbitrary") and the state in VMEM scratch, so VMEM use does not grow
with T. Products run on the MXU with bf16 operands for bf16 inputs and float32 accumulation.

**Declared support** (`SUPPORT`; every combination is lowered for `platforms=["tpu"]` by the
tests, forward and backward): float32, bfloat16 and float16 inputs (float16 is upcast to
float32: TPUs have no float16 matmul); no decay, per head (`g` per head, `g_gamma`), per key
channel (`g` per channel, `gk`) and their sums, not `gv`; head dims K, V ∈ {64, 128, 256};
packed `cu_seqlens`, `reverse`, initial states, any T; tiles C = 128, c = 16,
BV = min(V, 128); TPU v5e and v6e (`GENERATIONS`: compiled for both by libtpu on a CPU,
`recurrax compile`); on other generations dispatch runs `chunk`. A chunk of 64 cannot be made legal (the transposed [K, C] blocks need C to
be a multiple of 128) and is refused at trace time.

Never run on a TPU from here: lowering to Mosaic on a CPU (`jax.export`) checks the
Pallas-level rules (block shapes, a lowering for every primitive); compiling with libtpu for a
deviceless v5e / v6e (`recurrax.targets`, `tests/test_compile.py`) also runs Mosaic's layout
passes and the VMEM check.
"""

from __future__ import annotations

import dataclasses

from ...problem import Gate
from ...registry import Request, Support
from .._driver import head_dims_refusal, kernel_recurrent
from ._backward import chunk_backward
from ._forward import chunk_forward
from ._tiles import TpuCall, TpuTiles, mosaic_problems

__all__ = ["GENERATIONS", "HEAD_DIMS", "SUPPORT", "TILES", "TpuKernels", "TpuTiles", "mosaic_problems", "tpu_interpret",
           "tpu_recurrent", "unavailable"]

HEAD_DIMS = (64, 128, 256)
TILES = TpuTiles(chunk=128, sub=16, block_v=128)
"""The declared tiling (what `tpu_recurrent` runs)."""


GENERATIONS = ("v5e", "v6e")
"""The TPU generations the kernels are compiled for (libtpu, `recurrax compile`) and tested
on: others (v4, v5p, v7x, unknown) are refused, so dispatch runs XLA `chunk` there."""


def _head_dims_and_generation(request: Request) -> str | None:
    return head_dims_refusal(request, HEAD_DIMS, f"one of {HEAD_DIMS}") or _generation_refusal(request)


def _generation_refusal(request: Request) -> str | None:
    chip = request.device
    if chip.backend != "tpu" or chip.generation in GENERATIONS:
        return None  # interpret mode elsewhere has no generation; other backends the registry refuses
    return (f"TPU {chip.generation or repr(chip.kind)} is not among the generations the kernels are compiled "
            f"and tested for {GENERATIONS}")


SUPPORT = Support(
    dtypes=frozenset({"float32", "bfloat16", "float16"}),
    gates=frozenset({Gate.HEAD, Gate.KEY}),
    varlen=True,
    check=_head_dims_and_generation,
)


@dataclasses.dataclass(frozen=True)
class TpuKernels:
    """The TPU kernels with their tiles (a `kernels._driver.ChunkKernels`)."""

    tiles: TpuTiles = TILES
    interpret: bool = False

    @property
    def chunk(self) -> int:
        return self.tiles.chunk

    def forward(self, q, k, v, a, h0, table, *, scale, gate, emit_output, emit_states):
        static = TpuCall(scale, gate, self.tiles, self.interpret)
        return chunk_forward(q, k, v, a, h0, table, static=static, emit_output=emit_output, emit_states=emit_states)

    def backward(self, q, k, v, a, do, states, h_T, dh_T, table, *, scale, gate):
        return chunk_backward(q, k, v, a, do, states, h_T, dh_T, table, static=TpuCall(scale, gate, self.tiles,
                                                                                        self.interpret))


def tpu_recurrent(problem, *, scale: float, reverse: bool, tiles: TpuTiles = TILES):
    """The chunk kernels lowered by Mosaic TPU."""
    return kernel_recurrent(problem, scale=scale, reverse=reverse, kernels=TpuKernels(tiles))


def tpu_interpret(problem, *, scale: float, reverse: bool, tiles: TpuTiles = TILES):
    """The same kernels in Pallas's TPU interpret mode on any backend (tests)."""
    return kernel_recurrent(problem, scale=scale, reverse=reverse, kernels=TpuKernels(tiles, interpret=True))


def unavailable() -> str | None:
    """Why this JAX cannot run these kernels, or None."""
    try:
        from jax.experimental.pallas import tpu  # noqa: F401
    except ImportError:
        return "this JAX has no Pallas TPU backend (jax.experimental.pallas.tpu)"
    return None
