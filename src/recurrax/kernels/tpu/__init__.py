"""Pallas TPU (Mosaic) kernels of the chunk algorithm, `recurrent`'s and the delta rule's: both
read and write lane-dense token-major arrays.

| module                | what it holds                                                          |
|-----------------------|------------------------------------------------------------------------|
| `_tiles`              | `TpuTiles`, the lane-dense Mosaic-legal BlockSpecs and head views, tile maths |
| `_launch`             | both operations' grid step, carried state, `pallas_call`, the forward launch |
| `_channel`            | both operations' per-channel decay: anchors, the diagonal block's groups |
| `_recurrent_forward`  | `recurrent`'s forward kernel: outputs, final state, chunk-entry states |
| `_head_chunk`         | one head's chunk of that forward with no or a per-head decay           |
| `_recurrent_backward` | `recurrent`'s backward kernel: dq, dk, dv, d(initial state), the gate gradient |
| `_delta_forward`      | the delta rule's forward kernel: outputs, final states, chunk-entry states |
| `_delta_backward`     | the delta rule's backward kernel: every gradient, the log decay's included |
| `_vmem`               | a tiling's VMEM against the generation's scoped limit (refused before Mosaic) |
| `_measured`           | where a chip measured a kernel slower than XLA `chunk` (dispatch passes it over) |

**Array contract.** At the boundary the drivers' (`kernels/_recurrent_driver.py`,
`_delta_driver.py`): token-major [B, Tp, H, D]. Both operations' kernels read those arrays as
[B, Tp, H · D] (a reshape): q, k [B, Tp, G · K] (query/key heads unrepeated), v, do
[B, Tp, H · V], a per-channel decay [B, Tp, H · K], a per-head decay and the delta rule's β
[B, Tp, H]; they write o, dv [B, Tp, H · V] and dq, dk (and the delta rule's per-channel
decay gradient) [nV, B, Tp, H · K] the same way, in blocks [C, Hb · D] (head i of a grid
step: lanes [i · D, (i + 1) · D)); the delta rule's dβ and per-head decay gradient are
columns of a [C, H] block per (value block, head block), [nV, H / Hb, B, Tp, H], summed in
XLA. kᵀ and qᵀ are transposed in VMEM, so no head-major, transposed, repeated or other copy
of a token array is made in XLA (`_tiles`, `tests/test_kernels_tpu.py`,
`tests/test_kernels_tpu_delta.py`). `recurrent`'s backward kernel also forms the gate gradient
(`kernels/_recurrent_driver.py`'s docstring) and writes it per channel [nV, B, Tp, H · K], per
head [nV, H / Hb, B, Tp, H] (each step its heads' columns), summed in XLA only where there are
several value or head blocks; its dq and dk leave it in the caller's dtype with one value block
and no shared query/key heads, else float32 (summed over value blocks and groups after it).
`recurrent`'s kernels read q, k, v and do with non-finite entries as 0 (`_tiles.token`), so XLA
writes no cleaned copy. States stay [R, H, K, V] and [B, H, N, K, V]. The grid is
(b, head block, value block, chunk) with the chunk axis sequential ("arbitrary") and the state
in VMEM scratch, so VMEM use does not grow with T (`_launch`, `_tiles`). A grid step takes
`TpuTiles.heads` heads, one after another in the kernel body (v5e's one TensorCore runs the
grid steps in sequence; one head's 128 × 64 matmuls are mostly the step's overhead); by
default both operations take the most heads, up to 8, whose blocks are lane-dense (Hb · D a
multiple of 128, or all heads) and fit the scoped VMEM (`_vmem.py`, with the delta rule's
own estimate). Products run on the MXU with bf16 operands for bf16 inputs and float32
accumulation.

**Declared support** (`SUPPORT`; every combination is lowered for `platforms=["tpu"]` by the
tests, forward and backward): float32, bfloat16 and float16 inputs (float16 is upcast to
float32: TPUs have no float16 matmul); no decay, per head (`g` per head, `g_gamma`), per key
channel (`g` per channel, `gk`) and their sums, not `gv`; head dims K, V ∈ {64, 128, 256};
packed `cu_seqlens`, `reverse`, initial states, any T; query/key heads shared by groups of
value heads (Mamba-2), read unrepeated by the index maps (`_tiles`), refused where no heads
per grid step give lane-dense blocks that fit the scoped VMEM (`_tiles.tiling_problems`: one
64-wide query/key head of several needs a step of all the heads that share the 128-lane
pair); tiles C = 128 (any multiple of 16 is legal, e.g. `TpuTiles(chunk=256)`), c = 16, BV =
V (128 of V = 256 with one head per step), heads per grid step by the VMEM budget
(`TpuTiles`); TPU v5e and v6e (`GENERATIONS`: compiled for both by libtpu on a CPU, `recurrax
compile`); on other generations dispatch runs `chunk`.

**The delta rule** (`tpu_delta`, `DELTA_SUPPORT`): float32 and bfloat16 inputs, no decay, a
per-head `g`, a per-key-channel `gk` and their sum, query/key heads shared by groups of value
heads (read unrepeated by the index maps, as `recurrent`'s), initial states, packed
`cu_seqlens` (traced too), any T; K, V ∈ {64, 128, 256}; v5e and v6e; tiles C = 128 (a power
of two, a multiple of 128: the backward's [C, C] transposes), c = 16, BV = V with several
heads per step (min(V, 128) with one), heads per grid step by the VMEM budget; refused, with
the reason, where no heads per grid step give lane-dense blocks that fit (`tiling_problems`).
Gradients: the backward kernel, after the forward kernel has written the state entering every
chunk (`kernels/_delta_driver.py`).

`pallas_tpu_interpret` (both operations) runs these kernels in Pallas's TPU interpret mode on
any backend, a CPU included (`INTERPRET_SUPPORT`, `DELTA_INTERPRET_SUPPORT`: no head-dim or
generation limits; interpret mode takes any tiles).

Never run on a TPU from here: lowering to Mosaic on a CPU (`jax.export`) checks the
Pallas-level rules (block shapes, a lowering for every primitive); compiling with libtpu for a
deviceless v5e / v6e (`recurrax.targets`, `tests/test_compile.py`) also runs Mosaic's layout
passes and the VMEM check.
"""

from __future__ import annotations

import dataclasses

from ..._core.problem import Gate
from ..._core.registry import Request
from ..._core.registry import Support
from .._delta_driver import delta_kernel
from .._driver import head_dims_refusal, kernel_support, missing_module
from .._recurrent_driver import PallasBackend
from ._delta_backward import delta_backward
from ._delta_forward import delta_forward
from ._recurrent_backward import chunk_backward
from ._recurrent_forward import chunk_forward
from ._measured import SLOWER_THAN_CHUNK, passed_over
from ._tiles import TpuTiles, kernel_dtype, mosaic_problems, tiling_problems

__all__ = ["BACKEND", "DELTA_INTERPRET_SUPPORT", "DELTA_SUPPORT", "GENERATIONS", "HEAD_DIMS", "INTERPRET_SUPPORT",
           "SLOWER_THAN_CHUNK", "SUPPORT", "TILES", "TpuTiles", "mosaic_problems", "passed_over", "tpu_delta",
           "tpu_delta_interpret", "tpu_interpret", "tpu_recurrent", "unavailable"]

HEAD_DIMS = (64, 128, 256)
TILES = TpuTiles(chunk=128, sub=16, block_v=128)
"""The declared tiling (what `tpu_recurrent` runs)."""


GENERATIONS = ("v5e", "v6e")
"""The TPU generations the kernels are compiled for (libtpu, `recurrax compile`) and tested
on: others (v4, v5p, v7x, unknown) are refused, so dispatch runs XLA `chunk` there."""


def _head_dims_and_generation(request: Request) -> str | None:
    return head_dims_refusal(request, HEAD_DIMS, f"one of {HEAD_DIMS}") or _generation_refusal(request)


def _recurrent_refusal(request: Request) -> str | None:
    return _head_dims_and_generation(request) or _lane_refusal(request)


def _delta_refusal(request: Request) -> str | None:
    return _head_dims_and_generation(request) or _lane_refusal(request, delta=True)


def _lane_refusal(request: Request, delta: bool = False) -> str | None:
    """Why no heads per grid step give lane-dense blocks that fit (`_tiles.tiling_problems`;
    `delta`: the delta rule's kernels)."""
    if request.heads is None or request.qk_heads is None:
        return None
    gate = Gate.KEY if Gate.KEY in request.gates else Gate.HEAD if Gate.HEAD in request.gates else None
    problems = tiling_problems(request.heads, request.qk_heads, request.qk_head_dim, request.v_head_dim, gate,
                               kernel_dtype(request.dtype), delta=delta)
    return problems[0] if problems else None


def _generation_refusal(request: Request) -> str | None:
    chip = request.device
    if chip.backend != "tpu" or chip.generation in GENERATIONS:
        return None  # interpret mode elsewhere has no generation; other backends the registry refuses
    return (f"TPU {chip.generation or repr(chip.kind)} is not among the generations the kernels are compiled "
            f"and tested for {GENERATIONS}")


SUPPORT = kernel_support({"float32", "bfloat16", "float16"}, _recurrent_refusal, shared_query_key=True)
INTERPRET_SUPPORT = kernel_support({"float32", "bfloat16", "float16"}, None, shared_query_key=True)
"""`recurrent` in interpret mode: the dtypes and gates of `SUPPORT`, any head dims, any device."""

_DELTA_DTYPES = frozenset({"float32", "bfloat16"})
DELTA_SUPPORT = Support(dtypes=_DELTA_DTYPES, gates=SUPPORT.gates, varlen=True, check=_delta_refusal,
                        shared_query_key=True)
DELTA_INTERPRET_SUPPORT = dataclasses.replace(DELTA_SUPPORT, check=None)


def _declared_tiles(problem) -> TpuTiles:
    return TILES


BACKEND = PallasBackend(chunk_forward, chunk_backward, chip_tiles=_declared_tiles, interpret_tiles=TILES,
                        gate_in_kernel=True, cleans_at_load=True, head_decay_in_kernel=True,
                        states_residual=True)
"""The kernels lowered by Mosaic TPU, or run in Pallas's TPU interpret mode; tiles `TILES`."""

tpu_recurrent = BACKEND.recurrent
tpu_interpret = BACKEND.interpret


def tpu_delta(problem, *, scale: float, tiles: TpuTiles = TILES):
    """The delta rule through the forward kernel compiled by Mosaic TPU; `(output, final_state)`
    like `recurrax.delta.chunk_delta`, differentiable by the backward kernel."""
    return delta_kernel(problem, scale=scale, forward=delta_forward, backward=delta_backward, tiles=tiles)


def tpu_delta_interpret(problem, *, scale: float, tiles: TpuTiles = TILES):
    """`tpu_delta` in Pallas's TPU interpret mode, on any device (tests, laptops)."""
    return delta_kernel(problem, scale=scale, forward=delta_forward, backward=delta_backward, tiles=tiles,
                        interpret=True)


def unavailable() -> str | None:
    """Why this JAX cannot run these kernels, or None."""
    return missing_module("jax.experimental.pallas.tpu",
                          "this JAX has no Pallas TPU backend (jax.experimental.pallas.tpu)")
