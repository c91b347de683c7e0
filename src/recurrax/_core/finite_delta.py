"""Non-finite inputs of the delta rule: `finite.py`'s guard with the delta rule's table (`RULE`).
Here, on the floor below the operations, because the TPU kernels' driver wraps its runs in it too.

| symbol    | meaning                                                                       |
|-----------|-------------------------------------------------------------------------------|
| B, T, H   | batch rows, tokens (on this device), value heads                              |
| segment   | a batch row (dense) or a packed sequence (`cu_seqlens`)                       |
| p         | a token's position in its row (under `parallel.delta_rule`: in the whole row) |
| Q_p … O_p | token p holds a non-finite query / key / value / β / gate / output-cotangent entry (per head) |

As for `recurrent` (`finite.py`): a chunkwise algorithm reads every non-finite
entry of the token inputs and of the output cotangent as 0 and every gate below −1e4 as
−1e4 (`clean_tokens`, `clean_gate`, where it loads a chunk), and computes the exact results
of that cleaned problem; this module marks NaN the results that depend on a non-finite value,
per (token, head). With S_p = (I − β_p k_p k_pᵀ) diag(e^{a_p}) S_{p−1} + β_p k_p v_pᵀ, the
state is tainted from F = min{p : K_p or V_p or B_p or G_p}; its adjoint ∂L/∂S_p from
Cb = max({p : Q_p or O_p} ∪ {p − 1 : K_p or B_p or G_p}) (its pullback to S_{p−1} reads k_p,
β_p and a_p, not v_p; a bad final-state cotangent: every p). Then, as the token loop's
autodiff has it (S'_p = diag(e^{a_p}) S_{p−1}, c_p = v_p − S'_pᵀ k_p):

| result        | reads                                    | NaN where                              |
|---------------|------------------------------------------|----------------------------------------|
| output o_p    | S_p, q_p                                 | p ≥ F or Q_p                           |
| final state   |                                          | F exists in the segment                |
| dq_p          | S_p, do_p                                | p ≥ F or O_p                           |
| dk_p          | ∂S_p, β_p c_p, S'_p                      | p ≤ Cb or p ≥ F                        |
| dv_p          | β_p k_pᵀ ∂S_p                            | p ≤ Cb or K_p or B_p                   |
| dβ_p          | k_pᵀ ∂S_p, c_p                           | p ≤ Cb or p > F or K_p or V_p or G_p   |
| d gate_p      | ∂S'_p (reads k_p, β_p), e^{a_p}, S_{p−1} | p ≤ Cb or p > F or K_p or B_p or G_p   |
| d initial     |                                          | Cb ≥ −1                                |

Everything else is the cleaned problem's exact value, which is the true one. Under
`parallel.delta_rule` each device holds a block of every row: F and Cb are reduced over the
sequence axis too (a `pmin` / `pmax` of [segments, H] integers), so the marks are those of
the whole row.

Cost on the clean path: one read of the inputs (and of the output cotangent in the backward)
reduced to [B, T, H] booleans; the marks run only when a flag is set (`lax.cond`; on a mesh
always, as `where`s: the branch would hold collectives).
"""

from __future__ import annotations

from collections.abc import Callable

from .finite import Rule
from .finite import guarded as guarded_by

TOKEN_FIELDS = ("query", "key", "value", "beta")
GATE_FIELDS = ("log_decay_head", "log_decay_key")


def _gradients(bad: dict, bad_output, p, first, adjoint) -> dict:
    """The masks of (dq, dk, dv, dβ, d gate), the module table's rows."""
    after = p > first
    d_gate = adjoint | after | bad["key"] | bad["beta"] | bad["gate"]
    return {"query": (p >= first) | bad_output,
            "key": adjoint | (p >= first),
            "value": adjoint | bad["key"] | bad["beta"],
            "beta": adjoint | after | bad["key"] | bad["value"] | bad["gate"],
            **dict.fromkeys(GATE_FIELDS, d_gate)}


RULE = Rule(
    fields=TOKEN_FIELDS,
    gate_fields=GATE_FIELDS,
    writes=lambda bad: bad["key"] | bad["value"] | bad["beta"] | bad["gate"],
    read_before=lambda bad: bad["key"] | bad["beta"] | bad["gate"],
    gradients=_gradients,
)


def guarded(fn: Callable, problem, axis: str | None = None):
    """`fn(problem)` = (output [B, T, H, V], final state [R, H, K, V]) with the results that
    depend on a non-finite input set to NaN (module docstring).

    **Arguments:** `fn` the algorithm on a canonical problem (a `DeltaProblem`), cleaning at load (the module
    docstring; it must close over static configuration only); `problem` the canonical
    problem; `axis`: None on one device, or, inside `parallel.delta_rule`'s `shard_map`, the
    sequence axis: `problem` is then this device's block of tokens (block `axis_index(axis)`
    of every row, `cu_seqlens` the whole row's boundaries) and `fn` may hold collectives.
    """
    return guarded_by(fn, RULE, problem, axis=axis)
