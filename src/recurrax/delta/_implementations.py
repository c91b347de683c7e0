"""The delta rule's registry: its algorithms, where they run, and their priority.

The same machinery as `recurrent`'s (`recurrax.registry`): with no name given, dispatch takes
the highest-priority implementation whose `Support` covers the call; a forced name that cannot
take it raises `ValueError` saying why; `kernel_registry.select(...)` explains the choice.
"""

from __future__ import annotations

from .._core.problem import Gate
from .._core.registry import FLOAT_DTYPES, Backend, KernelRegistry, Platform, Request, Support
from ..kernels import tpu
from ._chunk import chunk_delta
from ._problem import canonicalize_delta
from ._reference import reference_delta
from ._scan import scan_delta

SUPPORT = Support(dtypes=FLOAT_DTYPES, gates=frozenset({Gate.HEAD, Gate.KEY}), varlen=True, shared_query_key=True)
"""Every XLA algorithm takes every float dtype, both gates, packed input, and query/key heads
shared by groups of value heads as they are."""

ROWS = (
    ("pallas_tpu",           Platform.PALLAS, Backend.TPU,  30, tpu.tpu_delta,           tpu.DELTA_SUPPORT,           tpu.unavailable),
    ("chunk",                Platform.XLA,    Backend.ANY,  20, chunk_delta,             SUPPORT,                     None),
    ("scan",                 Platform.XLA,    Backend.ANY,  10, scan_delta,              SUPPORT,                     None),
    ("reference",            Platform.XLA,    Backend.ANY,   0, reference_delta,         SUPPORT,                     None),
    ("pallas_tpu_interpret", Platform.PALLAS, Backend.ANY, -10, tpu.tpu_delta_interpret, tpu.DELTA_INTERPRET_SUPPORT, tpu.unavailable),
)  # fmt: skip
"""`pallas_tpu`: the Pallas TPU forward and backward kernels (`recurrax.kernels.tpu`), on v5e and
v6e. `pallas_tpu_interpret`: the same kernels in Pallas's TPU interpret
mode on any backend; below the reference, so dispatch never picks it (force it by name).
A row whose `unavailable()` gives a reason is not registered; forcing it says why."""

_ARGUMENTS = ("query", "key", "value", "beta", "g", "gk", "softmax_scale", "initial_state", "cu_seqlens", "qk_l2norm")


def _describe(*arguments, **keyword_arguments) -> Request:
    """The `Request` of `recurrax.delta_rule(*arguments, **keyword_arguments)`."""
    given = {"qk_l2norm": False, **dict(zip(_ARGUMENTS, arguments)), **keyword_arguments}
    problem, _, _ = canonicalize_delta(*(given.get(name) for name in _ARGUMENTS),
                                       given.get("allow_positive_gates", False))
    return Request.of(problem)


kernel_registry = KernelRegistry("delta_rule", _describe)
for _name, _platform, _backend, _priority, _function, _support, _unavailable in ROWS:
    _reason = _unavailable() if _unavailable is not None else None
    if _reason is not None:
        kernel_registry.mark_unavailable(_name, _reason)
        continue
    passed_over = tpu.passed_over("delta_rule") if _name == "pallas_tpu" else None
    kernel_registry.register(_name, _platform, _backend, priority=_priority, supports=_support,
                             passed_over=passed_over)(_function)

IMPLEMENTATIONS = {impl.name: impl.fn for impl in kernel_registry.implementations()}
"""The delta rule's algorithms by name, highest priority first."""
DEFAULT_IMPLEMENTATION = kernel_registry.names()[0]
