"""The one table of what `recurrax` registers: each implementation, where it runs, and its
priority (with no name given, dispatch takes the highest-priority implementation whose
`Support` covers the call; see `registry.py`).

A new algorithm or kernel is one more row here, with its function and the `Support` it
declares beside its code.
"""

from __future__ import annotations

from . import chunk, reference, scan
from .kernels import triton
from .registry import Backend, Platform, kernel_registry

IMPLEMENTATIONS = (
    # name               platform          backend      priority  function                     support
    ("pallas_gpu",       Platform.PALLAS,  Backend.GPU,  30,      triton.triton_recurrent,     triton.SUPPORT),
    ("chunk",            Platform.XLA,     Backend.ANY,  20,      chunk.chunk_recurrent,       chunk.SUPPORT),
    ("scan",             Platform.XLA,     Backend.ANY,  10,      scan.scan_recurrent,         scan.SUPPORT),
    ("reference",        Platform.XLA,     Backend.ANY,   0,      reference.reference_recurrent, reference.SUPPORT),
    ("pallas_interpret", Platform.PALLAS,  Backend.CPU, -10,      triton.triton_interpret,     triton.SUPPORT),
)  # fmt: skip
"""`pallas_interpret` runs the Triton kernels in Pallas interpret mode; its priority is below
the reference's, so dispatch never picks it (tests force it by name)."""

for name, platform, backend, priority, function, support in IMPLEMENTATIONS:
    kernel_registry.register(name, platform, backend, priority=priority, supports=support)(function)
