"""Pallas kernels of the chunk algorithm on Pallas's Triton backend (Ampere-class GPUs).

| module                | what it holds                                                       |
|-----------------------|---------------------------------------------------------------------|
| `_recurrent_forward`  | `recurrent`'s forward kernel: outputs, final state, chunk-entry states |
| `_recurrent_backward` | `recurrent`'s backward kernel: dq, dk, dv, d(initial state), boundary terms |
| `_common`             | `TritonTiles`, launch parameters and tile-level helpers             |
| `_tiling`             | the tiles used on a GPU and in interpret mode                       |

What the kernels take (`SUPPORT`, fail-closed; anything else falls back to XLA `chunk`):
float32 / bfloat16 / float16 inputs; no decay, per-head decay (`g` per head, `g_gamma`),
per-key-channel decay (`g` per channel, `gk`) and their combinations; any T (padded to
the chunk); packed variable-length input; any grouped-head layout; `reverse`; initial
states. Refused: value-side decay (`gv`), float64, and head dims that are not powers of
two in [16, 256] (Triton tiles are power-of-two shaped and its dots need ≥ 16), and GPUs of
compute capability below 8.0 (`MIN_CAPABILITY`) or unknown. They are what dispatch picks on
Blackwell (10.x, 12.x), where the Mosaic GPU kernels (wgmma) do not exist.
"""

from __future__ import annotations

from ..._core.registry import Request
from .._driver import head_dims_refusal, kernel_support, missing_module
from .._recurrent_driver import PallasBackend
from ._common import TritonTiles
from ._recurrent_backward import chunk_backward
from ._recurrent_forward import chunk_forward
from ._tiling import INTERPRET_TILES, gpu_tiles

__all__ = ["BACKEND", "MIN_CAPABILITY", "SUPPORT", "TritonTiles", "gpu_tiles", "triton_interpret", "triton_recurrent", "unavailable"]

HEAD_DIMS = frozenset(2**i for i in range(4, 9))  # 16 … 256


MIN_CAPABILITY = (8, 0)
"""Ampere or newer: the kernels' bf16 dots need sm_80. Compiled on a CPU for 9.0 (H100) and
10.0 (B200) by `recurrax compile`; never run on a GPU from here."""


def _head_dims_and_device(request: Request) -> str | None:
    return head_dims_refusal(request, HEAD_DIMS, "a power of two in [16, 256]") or _capability_refusal(request)


def _capability_refusal(request: Request) -> str | None:
    chip = request.device
    if chip.backend != "gpu":
        return None  # interpret mode (CPU) has no architecture; other backends the registry refuses
    if chip.compute_capability is None:
        return f"the compute capability of {chip.kind!r} is unknown (the Triton kernels need ≥ 8.0)"
    if chip.compute_capability < MIN_CAPABILITY:
        major, minor = chip.compute_capability
        return f"compute capability {major}.{minor} < 8.0 (the Triton kernels need Ampere or newer: bf16 dots)"
    return None


SUPPORT = kernel_support({"float32", "bfloat16", "float16"}, _head_dims_and_device)


def _chip_tiles(problem) -> TritonTiles:
    B, _, H, K = problem.query.shape
    return gpu_tiles(B, H, K, problem.value.shape[-1])


BACKEND = PallasBackend(chunk_forward, chunk_backward, chip_tiles=_chip_tiles, interpret_tiles=INTERPRET_TILES)
"""The kernels through Pallas's Triton lowering (NVIDIA/AMD GPUs); tiles on a GPU: `gpu_tiles`
for the call's shape, in interpret mode `INTERPRET_TILES` (small)."""

triton_recurrent = BACKEND.recurrent
triton_interpret = BACKEND.interpret


def unavailable() -> str | None:
    """Why this JAX cannot run these kernels (its Pallas Triton backend is gone), or None."""
    return missing_module("jax.experimental.pallas.triton", "this JAX has no Pallas Triton backend "
                          "(jax.experimental.pallas.triton); GPUs use mosaic_gpu or chunk")
