"""Pallas Mosaic GPU kernels of the chunk algorithm (Hopper: compute capability 9.x).

| module                | what it holds                                                        |
|-----------------------|----------------------------------------------------------------------|
| `_tiles`              | swizzled SMEM tiles, the wgmma helper (f32 accumulator), decay masks, interpret settings |
| `_channel`            | per-key-channel decay inside a chunk: anchored wgmma products + the exact diagonal |
| `_layout`             | driver arrays to TMA-friendly ones; the SMEM budget (slots)          |
| `_recurrent_forward`  | `recurrent`'s forward kernel: outputs, final state, chunk-entry states |
| `_recurrent_backward` | `recurrent`'s backward kernel: dq, dk, dv, d(initial state), boundary terms |

One warpgroup per (row, head, 64 value columns); chunks of 64 tokens (the wgmma M). Every
product is a `wgmma` with SMEM operands and a float32 accumulator; input tiles come by TMA
straight from the `[B, T, H, D]` layout, double-buffered (chunk n + 1 loads while n
computes) where two slots fit in 227 KiB of SMEM; outputs and states leave by TMA stores.
The state `[K, 64]` float32 (and its gradient in the backward) is carried from chunk to chunk
in SMEM, not in registers.

**Register budget** (ptxas, sm_90a; `tests/test_kernel_budget.py`,
`benchmarks/results/kernel_resources.md`): no spills in the forward kernels at K 64 and 128,
nor in any backward at K = 64 (per key channel at 250–251 registers: little margin). At
K = 128 the backward spills nothing without decay, 60–120 B per head (the dS update reads dS
after its wgmma, not beside the accumulator), 0.68–0.87 KB per key channel (a quarter or less
of before).
Levers used: one wgmma accumulator per output (row scalings moved into the left operand),
carries in SMEM, per-channel [C, K] tiles made one 64-channel panel at a time where used,
index tiles broadcast from row/column vectors, loops ptxas cannot unroll; per key channel, the same-block terms read a dP column as a row
vector of an untiled float32 SMEM tile (dPᵀ / dP staged in dv's tile). Not used: wgmma's
register left operand (Mosaic GPU interpret mode, JAX 0.12, takes only SMEM operands, so
the tests could not check it).

**Declared support** (`SUPPORT`, fail-closed): bfloat16 and float16 inputs (wgmma needs
16-bit operands); no decay, a per-head decay (`g` per head, `g_gamma`) or a per-key-channel
decay (`gk`, `g` per channel, and their sums); not `gv`; packed `cu_seqlens`, `reverse`,
initial states, any T; K ∈ {64, 128} and V a multiple of 64 (K = 256: the backward's tiles
exceed SMEM); compute capability 9.x only (`ARCHITECTURES`: wgmma is Hopper's; on 10.x and
12.x dispatch goes to the Triton kernels or `chunk`). Compiled for sm_90a on a CPU by
`recurrax.targets` (ptxas). Tested on a CPU in Mosaic GPU interpret mode (JAX ≥ 0.12) with race
detection on; never run on a GPU from here.
"""

from __future__ import annotations

from ..._core.registry import Request
from .._driver import kernel_support, missing_module
from .._recurrent_driver import PallasBackend

try:
    from ._recurrent_backward import chunk_backward
    from ._recurrent_forward import chunk_forward
    from ._tiles import CHUNK, has_interpret_mode
except ImportError as error:  # JAX's Mosaic GPU imports absl-py, which a plain `pip install jax` lacks
    _IMPORT_FAILURE: str | None = f"JAX's Mosaic GPU backend does not import here ({type(error).__name__}: {error})"
else:
    _IMPORT_FAILURE = None

__all__ = ["ARCHITECTURES", "BACKEND", "INTERPRET_SUPPORT", "SUPPORT", "has_interpret_mode", "interpret_unavailable",
           "mosaic_gpu_interpret", "mosaic_gpu_recurrent", "unavailable"]

QK_HEAD_DIMS = (64, 128)


ARCHITECTURES = frozenset({9})
"""Compute capability majors the kernels compile for: 9.x (Hopper, sm_90a). Blackwell (10.x,
12.x) has no `wgmma` ("Instruction 'wgmma.fence' not supported on .target 'sm_100a'"), so
there dispatch takes the Triton kernels or `chunk`."""


def _shapes(request: Request) -> str | None:
    if request.qk_head_dim not in QK_HEAD_DIMS:
        return f"qk_head_dim={request.qk_head_dim} is not one of {QK_HEAD_DIMS}"
    if request.v_head_dim % 64:
        return f"v_head_dim={request.v_head_dim} is not a multiple of 64"
    return None


def _shapes_and_device(request: Request) -> str | None:
    return _shapes(request) or _compute_capability_refusal(request)


def _compute_capability_refusal(request: Request) -> str | None:
    chip = request.device
    if chip.backend != "gpu":
        return None  # the registry refuses other backends with its own reason
    capability = chip.compute_capability
    if capability is None:
        return f"the compute capability of {chip.kind!r} is unknown (Mosaic GPU kernels need 9.x, Hopper)"
    if capability[0] not in ARCHITECTURES:
        return (f"compute capability {capability[0]}.{capability[1]} is not 9.x: the kernels use Hopper's wgmma, "
                "which sm_100 and later lack")
    return None


SUPPORT = kernel_support({"bfloat16", "float16"}, _shapes_and_device)
INTERPRET_SUPPORT = kernel_support({"bfloat16", "float16"}, _shapes)
"""`mosaic_gpu_interpret`: the dtypes, gates and head dims of `SUPPORT` (the tiles are fixed), any device."""


BACKEND = PallasBackend(chunk_forward, chunk_backward, chunk=CHUNK) if _IMPORT_FAILURE is None else None
"""The kernels compiled by Mosaic GPU (Hopper), or run in Mosaic GPU interpret mode on a CPU
with races detected (JAX ≥ 0.12); tiles fixed (chunk 64). None where the backend does not
import (`unavailable()` says why; nothing is registered)."""

mosaic_gpu_recurrent = BACKEND.recurrent if BACKEND is not None else None
mosaic_gpu_interpret = BACKEND.interpret if BACKEND is not None else None


def unavailable() -> str | None:
    """Why this JAX cannot run these kernels, or None."""
    if _IMPORT_FAILURE is not None:
        return _IMPORT_FAILURE
    reason = missing_module("jax.experimental.pallas.mosaic_gpu",
                            "this JAX has no Pallas Mosaic GPU backend (jax.experimental.pallas.mosaic_gpu)")
    if reason is None:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        missing = [name for name in ("kernel", "wgmma", "copy_gmem_to_smem", "Barrier") if not hasattr(plgpu, name)]
        reason = f"this JAX's Mosaic GPU lacks {missing}" if missing else None
    return reason


def interpret_unavailable() -> str | None:
    """Why this JAX cannot run these kernels in Mosaic GPU interpret mode, or None."""
    reason = unavailable()
    if reason is None and not has_interpret_mode():
        reason = "this JAX's Mosaic GPU has no interpret mode (InterpretGPUParams, JAX >= 0.12)"
    return reason
