"""The delta rule: `recurrax.delta_rule`, its canonical form and its algorithms.

| module        | what it holds                                                         |
|---------------|-----------------------------------------------------------------------|
| `_problem`    | `DeltaProblem`: validation (reusing `recurrax.problem`'s), `qk_l2norm` |
| `_reference`  | the token loop (the oracle)                                           |
"""

from ._problem import DeltaProblem, canonicalize_delta
from ._reference import reference_delta

__all__ = ["DeltaProblem", "canonicalize_delta", "reference_delta"]
