"""Non-finite inputs of the delta rule: `recurrax._finite`'s guarantee with the delta rule's table.

| symbol    | meaning                                                                       |
|-----------|-------------------------------------------------------------------------------|
| B, T, H   | batch rows, tokens (on this device), value heads                              |
| segment   | a batch row (dense) or a packed sequence (`cu_seqlens`)                       |
| p         | a token's position in its row (under `parallel.delta_rule`: in the whole row) |
| Q_p … O_p | token p holds a non-finite query / key / value / β / gate / output-cotangent entry (per head) |

As for `recurrent` (`recurrax/_finite.py`): a chunkwise algorithm reads every non-finite
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

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from .._core.finite import _NONE, _bad_entries, _if_any, _nan_where, clean_gate, clean_tokens
from ._problem import DeltaProblem

GATE_FIELDS = ("log_decay_head", "log_decay_key")


class BadTokens(NamedTuple):
    """Per token and value head [B, T, H]: which inputs hold a non-finite entry (a gate of
    −inf is a hard reset, not bad)."""

    query: Bool[Array, "B T H"]
    key: Bool[Array, "B T H"]
    value: Bool[Array, "B T H"]
    beta: Bool[Array, "B T H"]
    gate: Bool[Array, "B T H"]


def bad_tokens(problem: DeltaProblem) -> BadTokens:
    """The non-finite entries of a canonical problem, per token and value head."""
    H = problem.value.shape[2]
    gate = jnp.zeros(problem.value.shape[:3], bool)
    for name in GATE_FIELDS:
        g = getattr(problem, name)
        if g is not None:
            gate = gate | _bad_entries(jnp.where(g == -jnp.inf, 0, g), H)
    return BadTokens(_bad_entries(problem.query, H), _bad_entries(problem.key, H), _bad_entries(problem.value, H),
                     _bad_entries(problem.beta, H), gate)


def cleaned(problem: DeltaProblem) -> DeltaProblem:
    """The problem with its non-finite token entries read as 0 and its gates as `clean_gate`
    reads them, differentiated as the identity (what a chunkwise algorithm does at load inside
    its custom VJP; `parallel.delta_rule` does it once, around JAX's autodiff)."""
    fields = {name: _read_clean(getattr(problem, name)) for name in ("query", "key", "value", "beta")}
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


class Span(NamedTuple):
    """Where the tokens a device holds sit in their rows.

    **Arguments:**
    - `ids`: packed input: the sequence of every token [T]; dense: None (the row).
    - `count`: segments (B rows, or S sequences).
    - `position`: p of every token, [1, T, 1].
    - `axis`: the mesh axis a row's tokens are split over (`parallel.delta_rule`), or None.
    """

    ids: Int[Array, " T"] | None
    count: int
    position: Int[Array, "1 T 1"]
    axis: str | None

    @classmethod
    def of(cls, cu_seqlens: Array | None, num_tokens: int, rows: int, axis: str | None) -> Span:
        """The span of `num_tokens` tokens: a row's (or, packed, all tokens') first ones, or on
        a mesh the block of `axis`'s index (`cu_seqlens` the whole row's boundaries)."""
        offset = 0 if axis is None else jax.lax.axis_index(axis) * num_tokens
        position = offset + jnp.arange(num_tokens, dtype=jnp.int32)
        if cu_seqlens is None:
            return cls(None, rows, position[None, :, None], axis)
        ids = jnp.searchsorted(cu_seqlens[1:], position, side="right").astype(jnp.int32)
        return cls(jnp.minimum(ids, cu_seqlens.shape[0] - 2), cu_seqlens.shape[0] - 1, position[None, :, None], axis)

    def reduce(self, marks: Array, pick: str) -> tuple[Array, Array]:
        """(per segment [R, H], per token [B, T, H]) of `pick` ("min" or "max") over each
        segment's tokens of `marks` [B, T, H] (over every device's tokens on a mesh)."""
        if self.ids is None:
            reduced = (jnp.min if pick == "min" else jnp.max)(marks, axis=1)  # [B, H]
        else:
            segment = jax.ops.segment_min if pick == "min" else jax.ops.segment_max
            reduced = segment(marks[0], self.ids, num_segments=self.count)  # [S, H]
        if self.axis is not None:
            reduced = (jax.lax.pmin if pick == "min" else jax.lax.pmax)(reduced, self.axis)
        return reduced, self.per_token(reduced)

    def per_token(self, per_segment: Array) -> Array:
        return per_segment[:, None] if self.ids is None else per_segment[self.ids][None]


def _first_tainted(bad: BadTokens, span: Span):
    """F: the first position whose state holds a bad value, per segment and per token."""
    writes = bad.key | bad.value | bad.beta | bad.gate
    return span.reduce(jnp.where(writes, span.position, _NONE), "min")


def _output_marks(bad: BadTokens, span: Span):
    """(output [B, T, H], final state [R, H]) masks: NaN where they depend on a bad entry."""
    first_segment, first = _first_tainted(bad, span)
    return (span.position >= first) | bad.query, first_segment < _NONE


def _gradient_marks(bad: BadTokens, bad_output: Array, bad_final: Array, span: Span):
    """Masks of (dq, dk, dv, dβ, d gate) [B, T, H] and d initial state [R, H] (module table)."""
    _, first = _first_tainted(bad, span)
    p = span.position
    reads = jnp.maximum(jnp.where(bad.query | bad_output, p, -_NONE),
                        jnp.where(bad.key | bad.beta | bad.gate, p - 1, -_NONE))
    last_segment, _ = span.reduce(reads, "max")
    last_segment = jnp.where(bad_final, _NONE, last_segment)  # [R, H]
    adjoint = p <= span.per_token(last_segment)
    after = p > first
    marks = ((p >= first) | bad_output,
             adjoint | (p >= first),
             adjoint | bad.key | bad.beta,
             adjoint | after | bad.key | bad.value | bad.gate,
             adjoint | after | bad.key | bad.beta | bad.gate)
    return marks, last_segment >= -1


def guarded(fn: Callable, problem: DeltaProblem, axis: str | None = None):
    """`fn(problem)` = (output [B, T, H, V], final state [R, H, K, V]) with the results that
    depend on a non-finite input set to NaN (module docstring).

    **Arguments:** `fn` the algorithm on a canonical problem, cleaning at load (the module
    docstring; it must close over static configuration only); `problem` the canonical
    problem; `axis`: None on one device, or, inside `parallel.delta_rule`'s `shard_map`, the
    sequence axis: `problem` is then this device's block of tokens (block `axis_index(axis)`
    of every row, `cu_seqlens` the whole row's boundaries) and `fn` may hold collectives.
    """
    return _guarded(fn, axis, problem)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _guarded(fn, axis, problem: DeltaProblem):
    return _guarded_fwd(fn, axis, problem)[0]


def _span(problem: DeltaProblem, axis: str | None) -> Span:
    return Span.of(problem.cu_seqlens, problem.query.shape[1], problem.initial_state.shape[0], axis)


def _marked(flags, span: Span, mark: Callable, results):
    """`mark(results)`: skipped by a `lax.cond` when no flag is set, on one device (on a mesh
    the branch would hold collectives: always run, as `where`s)."""
    if span.axis is not None:
        return mark(results)
    return _if_any(flags, mark, results)


def _guarded_fwd(fn, axis, problem: DeltaProblem):
    results, pullback = jax.vjp(fn, problem)
    bad = bad_tokens(problem)
    span = _span(problem, axis)

    def mark(results):
        (output, final), (output_mask, final_mask) = results, _output_marks(bad, span)
        return _nan_where(output, output_mask), jnp.where(final_mask[..., None, None], jnp.nan, final).astype(final.dtype)

    return _marked(bad, span, mark, results), (pullback, bad, problem.cu_seqlens, problem.query.shape[1],
                                               problem.initial_state.shape[0])


def _guarded_bwd(fn, axis, residuals, cotangents):
    pullback, bad, cu_seqlens, num_tokens, rows = residuals
    d_output, d_final = cotangents
    bad_final = ~jnp.isfinite(d_final).all((-2, -1))  # [R, H]
    bad_output = _bad_entries(d_output, bad.query.shape[2])
    (grads,) = pullback((d_output, clean_tokens(d_final)))  # fn cleans d_output at load
    span = Span.of(cu_seqlens, num_tokens, rows, axis)

    def mark(grads):
        (dq, dk, dv, d_beta, d_gate), d_init = _gradient_marks(bad, bad_output, bad_final, span)
        fields = {"query": _nan_where(grads.query, dq), "key": _nan_where(grads.key, dk),
                  "value": _nan_where(grads.value, dv), "beta": _nan_where(grads.beta, d_beta)}
        for name in GATE_FIELDS:
            fields[name] = _nan_where(getattr(grads, name), d_gate)
        init = grads.initial_state
        fields["initial_state"] = jnp.where(d_init[..., None, None], jnp.nan, init).astype(init.dtype)
        return grads._replace(**fields)

    return (_marked((*bad, bad_output, bad_final), span, mark, grads._replace(cu_seqlens=None)),)


_guarded.defvjp(_guarded_fwd, _guarded_bwd)
