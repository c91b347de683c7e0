"""Sequence parallelism: the token axis split over a device mesh, exact forward and backward.

`recurrent` is `recurrax.recurrent`'s parallel form (its derivation: `recurrax/recurrence/_parallel.py`),
`delta_rule` the delta rule's (`recurrax/delta/_parallel.py`); the mesh plumbing they share is
`recurrax/_core/mesh.py`.
"""

from .delta._parallel import delta_rule
from .recurrence._parallel import recurrent

__all__ = ["delta_rule", "recurrent"]
