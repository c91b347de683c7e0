"""The delta rule: `recurrax.delta_rule`, its canonical form and its algorithms.

| module        | what it holds                                                              |
|---------------|----------------------------------------------------------------------------|
| `_api`        | `delta_rule`, `delta_rule_step`: validate, dispatch through the registry  |
| `_implementations` | `kernel_registry`: the algorithms, their priority and `Support`      |
| `_problem`    | `DeltaProblem`: validation (reusing `recurrax.problem`'s), β, `qk_l2norm`, the β‖k‖² ≤ 2 check |
| `_finite`     | the problem cleaned around autodiff (`parallel.delta_rule`); the rule itself: `recurrax._core.finite_delta` |
| `_reference`  | the token loop (the oracle)                                                |
| `_step`       | one token for `delta_rule_step`: one read of the state and one write     |
| `_scan`       | the token loop in blocks, one stored state per block (the fallback)        |
| `_chunk`      | the chunkwise (WY/UT) algorithm: a triangular solve per chunk, a state scan |
| `_chunk_vjp`  | its scan over chunks with a custom VJP (recompute each chunk backwards)    |
| `_chunk_adjoint` | the hand-derived backward of one chunk                                |
| `_unit_lower` | (I + M)⁻¹ of a unit lower-triangular M by matmuls                         |
"""

from ._api import delta_rule, delta_rule_step
from ._chunk import chunk_delta
from ._implementations import DEFAULT_IMPLEMENTATION, IMPLEMENTATIONS, kernel_registry
from ._problem import DeltaProblem, ExpansiveUpdateWarning, canonicalize_delta
from ._reference import reference_delta
from ._scan import scan_delta

__all__ = [
    "DEFAULT_IMPLEMENTATION",
    "IMPLEMENTATIONS",
    "DeltaProblem",
    "ExpansiveUpdateWarning",
    "canonicalize_delta",
    "chunk_delta",
    "delta_rule",
    "delta_rule_step",
    "kernel_registry",
    "reference_delta",
    "scan_delta",
]
