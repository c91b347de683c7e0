"""The delta rule: `recurrax.delta_rule`, its canonical form and its algorithms.

| module        | what it holds                                                              |
|---------------|----------------------------------------------------------------------------|
| `_api`        | `delta_rule`, `delta_rule_step`: validate, dispatch by name               |
| `_problem`    | `DeltaProblem`: validation (reusing `recurrax.problem`'s), β, `qk_l2norm`  |
| `_reference`  | the token loop (the oracle)                                                |
| `_chunk`      | the chunkwise (WY/UT) algorithm: a triangular solve per chunk, a state scan |
"""

from ._api import DEFAULT_IMPLEMENTATION, IMPLEMENTATIONS, delta_rule, delta_rule_step
from ._chunk import chunk_delta
from ._problem import DeltaProblem, canonicalize_delta
from ._reference import reference_delta

__all__ = [
    "DEFAULT_IMPLEMENTATION",
    "IMPLEMENTATIONS",
    "DeltaProblem",
    "canonicalize_delta",
    "chunk_delta",
    "delta_rule",
    "delta_rule_step",
    "reference_delta",
]
