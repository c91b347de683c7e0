"""The delta rule's problem cleaned around JAX's autodiff (`parallel.delta_rule`'s shards); its
rule for non-finite inputs, which `guarded` applies, is `recurrax/_core/finite_delta.py`."""

from __future__ import annotations

from collections.abc import Callable

import jax

from .._core.finite import clean_gate, clean_tokens
from .._core.finite_delta import GATE_FIELDS, TOKEN_FIELDS
from ._problem import DeltaProblem


def cleaned(problem: DeltaProblem) -> DeltaProblem:
    """The problem with its non-finite token entries read as 0 and its gates as `clean_gate`
    reads them, differentiated as the identity (what a chunkwise algorithm does at load inside
    its custom VJP; `parallel.delta_rule` does it once, around JAX's autodiff)."""
    fields = {name: _read_clean(getattr(problem, name)) for name in TOKEN_FIELDS}
    fields.update({name: _read_clean_gate(getattr(problem, name)) for name in GATE_FIELDS})
    return problem._replace(**fields)


def _straight_through(clean: Callable) -> Callable:
    """`clean`, whose derivative is taken as the identity's (the cleaned problem's gradient
    reaches every entry; `guarded` marks those that depend on a bad value)."""
    read = jax.custom_jvp(clean)
    read.defjvp(lambda primals, tangents: (clean(primals[0]), tangents[0]))
    return lambda x: None if x is None else read(x)


_read_clean = _straight_through(clean_tokens)
_read_clean_gate = _straight_through(clean_gate)
