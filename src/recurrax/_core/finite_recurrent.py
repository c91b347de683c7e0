"""`recurrent`'s rule for non-finite inputs (the table in `finite.py`'s note): which of a
token's bad entries taint the state and its adjoint, and so which gradients are NaN. Here, on
the floor below the operations, because the kernels' driver wraps its runs in it too."""

from __future__ import annotations

from collections.abc import Callable

from .finite import Rule
from .finite import guarded as guarded_by
from .problem import Problem

GATE_FIELDS = ("log_decay_head", "log_decay_key", "log_decay_value")


def _gradients(bad: dict, bad_output, p, first, adjoint) -> dict:
    """dq_p = h_p do_p, dk_p = ∂h_p v_p, dv_p = ∂h_pᵀ k_p, da_p = Σ ∂h_p ⊙ e^{a_p} h_{p−1}."""
    d_gate = adjoint | (p > first) | bad["gate"]
    return {"query": (p >= first) | bad_output, "key": adjoint | bad["value"], "value": adjoint | bad["key"],
            **dict.fromkeys(GATE_FIELDS, d_gate)}


RULE = Rule(
    fields=("query", "key", "value"),
    gate_fields=GATE_FIELDS,
    writes=lambda bad: bad["key"] | bad["value"] | bad["gate"],
    read_before=lambda bad: bad["gate"],
    gradients=_gradients,
)


def guarded(fn: Callable, reverse: bool, problem: Problem):
    """`fn(problem)` with the results that depend on a non-finite input set to NaN
    (`recurrax._core.finite.guarded` with `recurrent`'s rule)."""
    return guarded_by(fn, RULE, problem, reverse=reverse)
