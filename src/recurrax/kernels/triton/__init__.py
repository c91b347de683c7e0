"""Pallas kernels of the chunk algorithm on Pallas's Triton backend (Ampere-class GPUs).

| module       | what it holds                                                     |
|--------------|-------------------------------------------------------------------|
| `_forward`   | the forward kernel: outputs, final state, chunk-entry states      |
| `_backward`  | the backward kernel: dq, dk, dv, d(initial state), boundary terms |
| `_common`    | `TritonTiles`, `TritonCall` and tile-level helpers                |
| `_tiling`    | the tiles used on a GPU and in interpret mode                     |

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

import dataclasses

from ...problem import Gate
from ...registry import Request, Support
from .._driver import head_dims_refusal, kernel_recurrent
from ._backward import chunk_backward
from ._common import TritonCall, TritonTiles
from ._forward import chunk_forward
from ._tiling import INTERPRET_TILES, gpu_tiles

__all__ = ["MIN_CAPABILITY", "SUPPORT", "TritonKernels", "TritonTiles", "gpu_tiles", "triton_interpret", "triton_recurrent", "unavailable"]

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


SUPPORT = Support(
    dtypes=frozenset({"float32", "bfloat16", "float16"}),
    gates=frozenset({Gate.HEAD, Gate.KEY}),
    varlen=True,
    check=_head_dims_and_device,
)


@dataclasses.dataclass(frozen=True)
class TritonKernels:
    """The Triton-backend kernels with their tiles (a `kernels._driver.ChunkKernels`)."""

    tiles: TritonTiles
    interpret: bool = False

    @property
    def chunk(self) -> int:
        return self.tiles.chunk

    def _call(self, scale, gate) -> TritonCall:
        return TritonCall(scale, gate, self.tiles, self.interpret)

    def forward(self, q, k, v, a, h0, table, *, scale, gate, emit_output, emit_states):
        static = self._call(scale, gate)
        return chunk_forward(q, k, v, a, h0, table, static=static, emit_output=emit_output, emit_states=emit_states)

    def backward(self, q, k, v, a, do, states, h_T, dh_T, table, *, scale, gate):
        return chunk_backward(q, k, v, a, do, states, h_T, dh_T, table, static=self._call(scale, gate))


def triton_recurrent(problem, *, scale: float, reverse: bool, tiles: TritonTiles | None = None):
    """The chunk kernels through Pallas's Triton lowering (NVIDIA/AMD GPUs); tiles default to
    `gpu_tiles` for the call's shape."""
    if tiles is None:
        B, _, H, K = problem.query.shape
        tiles = gpu_tiles(B, H, K, problem.value.shape[-1])
    return kernel_recurrent(problem, scale=scale, reverse=reverse, kernels=TritonKernels(tiles))


def triton_interpret(problem, *, scale: float, reverse: bool, tiles: TritonTiles = INTERPRET_TILES):
    """The same kernels in Pallas interpret mode on any backend, small tiles (tests)."""
    return kernel_recurrent(problem, scale=scale, reverse=reverse, kernels=TritonKernels(tiles, interpret=True))


def unavailable() -> str | None:
    """Why this JAX cannot run these kernels (its Pallas Triton backend is gone), or None."""
    try:
        import jax.experimental.pallas.triton  # noqa: F401
    except ImportError:
        return "this JAX has no Pallas Triton backend (jax.experimental.pallas.triton); GPUs use mosaic_gpu or chunk"
    return None
