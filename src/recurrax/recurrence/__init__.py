"""The recurrent operation (`recurrax.recurrent`): gated linear attention as a recurrence.

The same shape as `recurrax.delta`:

| module             | what it holds                                                          |
|--------------------|------------------------------------------------------------------------|
| `_api`             | `recurrent`: validate (`recurrax._core.problem`), dispatch, restore the layout |
| `_implementations` | the table of registered implementations and their priorities           |
| `_reference`       | the token loop (the oracle)                                            |
| `_scan`            | the token loop with a checkpointed hand-written backward               |
| `_chunk`           | the chunkwise-parallel XLA algorithm (a package)                       |
| `_parallel`        | `parallel.recurrent`: the token axis split over a device mesh          |
| `_step`            | `recurrent_step`: the state advanced by the next token(s)              |

Its canonical form is `recurrax._core.problem.Problem`, the base the registry and the kernels
are typed on; its rule for non-finite inputs is `recurrax/_core/finite_recurrent.py` (the
kernels' driver applies it too, so it sits on the floor below).
"""

from . import _implementations  # noqa: F401  (registers the table's implementations)
from ._api import recurrent
from ._step import recurrent_step

__all__ = ["recurrent", "recurrent_step"]
