"""The one table of what `recurrax` registers: each implementation, where it runs, and its
priority (with no name given, dispatch takes the highest-priority implementation whose
`Support` covers the call; see `recurrax/_core/registry.py`).

A new algorithm or kernel is one more row here, with its function and the `Support` it
declares beside its code. A row whose `unavailable()` gives a reason (a JAX without the
Pallas backend the kernels are written for) is not registered; the registry keeps the
reason, so forcing that name says why.
"""

from __future__ import annotations

from typing import NamedTuple

from .._core.registry import Backend, Platform, kernel_registry
from ..kernels import mosaic_gpu, tpu, triton
from . import _chunk as chunk, _reference as reference, _scan as scan


class Row(NamedTuple):
    name: str
    platform: Platform
    backend: Backend
    priority: int
    function: object
    support: object
    unavailable: object = None  # () -> reason or None
    passed_over: object = None  # (Request) -> why dispatch skips a call it can run, or None


IMPLEMENTATIONS = (
    Row("mosaic_gpu",       Platform.PALLAS, Backend.GPU,  40, mosaic_gpu.mosaic_gpu_recurrent, mosaic_gpu.SUPPORT, mosaic_gpu.unavailable),
    Row("pallas_gpu",       Platform.PALLAS, Backend.GPU,  30, triton.triton_recurrent,       triton.SUPPORT, triton.unavailable),
    Row("pallas_tpu",       Platform.PALLAS, Backend.TPU,  30, tpu.tpu_recurrent,             tpu.SUPPORT,    tpu.unavailable,
        tpu.passed_over("recurrent")),
    Row("chunk",            Platform.XLA,    Backend.ANY,  20, chunk.chunk_recurrent,         chunk.SUPPORT),
    Row("scan",             Platform.XLA,    Backend.ANY,  10, scan.scan_recurrent,           scan.SUPPORT),
    Row("reference",        Platform.XLA,    Backend.ANY,   0, reference.reference_recurrent, reference.SUPPORT),
    Row("pallas_interpret", Platform.PALLAS, Backend.CPU, -10, triton.triton_interpret,       triton.SUPPORT),
    Row("pallas_tpu_interpret", Platform.PALLAS, Backend.ANY, -10, tpu.tpu_interpret,     tpu.INTERPRET_SUPPORT, tpu.unavailable),
    Row("mosaic_gpu_interpret", Platform.PALLAS, Backend.ANY, -10, mosaic_gpu.mosaic_gpu_interpret,
        mosaic_gpu.INTERPRET_SUPPORT, mosaic_gpu.interpret_unavailable),
)  # fmt: skip
"""`pallas_interpret`, `pallas_tpu_interpret` and `mosaic_gpu_interpret` run the Triton, TPU and
Mosaic GPU kernels in their Pallas interpret modes (on any backend, a CPU included, for the
last two); their priority is below the reference's, so dispatch never picks them (force them
by name to check a kernel on a laptop)."""

for row in IMPLEMENTATIONS:
    reason = row.unavailable() if row.unavailable is not None else None
    if reason is not None:
        kernel_registry.mark_unavailable(row.name, reason)
        continue
    kernel_registry.register(row.name, row.platform, row.backend, priority=row.priority, supports=row.support,
                             passed_over=row.passed_over)(row.function)
