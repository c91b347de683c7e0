"""Hard resets and non-finite inputs around the chunkwise algorithms (XLA `chunk`, the kernels).

| symbol | meaning                                                                  |
|--------|--------------------------------------------------------------------------|
| B, T, H | batch rows, tokens, heads of the canonical problem                      |
| segment | a batch row (dense) or a packed sequence (`cu_seqlens`)                  |
| bad_t   | a non-finite query, key, value or gate entry at token t (per head)       |
| RESET   | −1e4, the log decay a gate ≤ RESET (−inf, a hard reset `log 0`, included) runs as |

Chunkwise algorithms form intra-chunk products as matmuls, `P v` with P masked to the
causal triangle: a NaN or inf at token t multiplies the zeros of earlier rows, and
`0 · NaN = NaN` reaches tokens before t (forward) or after it (the backward's `Pᵀ do`). And
a gate of −inf makes chunk-local cumulative log decays −inf, whose differences are NaN.
Both are handled here, the same way for every such implementation, with `where` only:

- gates below RESET become RESET (e^RESET is 0 in float32 and float64, so −inf gives the
  −1e4 result; the gradient there is 0, as e^g is);
- non-finite entries become 0 before the algorithm runs, then the outputs from the first
  bad token of a segment on (in processing order; `reverse` flips it) and that segment's
  final state are set to NaN;
- backward: non-finite output cotangents become 0 likewise; the gradients of the tokens a
  bad cotangent reaches (at or before it in processing order), and all gradients of a
  segment with a bad input or a bad final-state cotangent, are set to NaN.

So a non-finite value never reaches earlier tokens, other rows or other sequences, and
where it does reach the result says so (NaN; where the exact answer is finite, e.g. the
query gradients of tokens before a bad one, the guard errs towards NaN).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool

from .problem import Problem

RESET = -1e4
"""Gates at or below this log decay are hard resets (e^RESET underflows to 0)."""

TOKEN_FIELDS = ("query", "key", "value", "log_decay_head", "log_decay_key", "log_decay_value")


def _bad_entries(x) -> Bool[Array, "B T H"]:
    """Per token and head: any non-finite entry of `x` ([B, T, H] or [B, T, H, D])."""
    bad = ~jnp.isfinite(x)
    return bad if bad.ndim == 3 else bad.any(-1)


def _to_heads(mask: Bool[Array, "B T Hx"], heads: int) -> Bool[Array, "B T heads"]:
    """A per-head mask between H value heads and the heads of a shared query/key: repeated
    to every head of a group, or any over the group."""
    have = mask.shape[2]
    if have < heads:
        return jnp.repeat(mask, heads // have, axis=2)
    return mask if have == heads else mask.reshape(*mask.shape[:2], heads, have // heads).any(-1)


def _clean_gate(g):
    """Gates ≤ RESET (−inf included) become RESET, NaN and +inf become 0."""
    g = jnp.where(jnp.isnan(g) | (g == jnp.inf), 0.0, g)
    return jnp.where(g < RESET, RESET, g).astype(g.dtype)


def _clean(problem: Problem) -> tuple[Problem, Bool[Array, "B T H"]]:
    """The problem with every non-finite token entry zeroed and gates clamped; the bad tokens."""
    bad = jnp.zeros(problem.value.shape[:3], bool)
    fields = {}
    for name in TOKEN_FIELDS:
        x = getattr(problem, name)
        if x is None:
            continue
        gate = name.startswith("log_decay")
        bad = bad | _to_heads(_bad_entries(jnp.where(x == -jnp.inf, 0.0, x) if gate else x), bad.shape[2])
        fields[name] = _clean_gate(x) if gate else jnp.where(jnp.isfinite(x), x, 0.0).astype(x.dtype)
    return problem._replace(**fields), bad


def _segments(problem: Problem) -> Array | None:
    """The packed sequence of every token ([T] int32), or None for dense rows."""
    if problem.cu_seqlens is None:
        return None
    T = problem.query.shape[1]
    return jnp.searchsorted(problem.cu_seqlens, jnp.arange(T), side="right").astype(jnp.int32) - 1


def _reached(bad: Bool[Array, "B T H"], segments, num_segments: int, later: bool):
    """(per token: a bad token of its segment at or before it — at or after it when `later` —,
    per segment [R, H]: any bad token). Segments are rows (dense) or packed sequences."""
    T = bad.shape[1]
    index = jnp.arange(T)[None, :, None]
    if later:  # the last bad token of the segment
        marks = jnp.where(bad, index, -1)
        pick = jnp.max if segments is None else functools.partial(jax.ops.segment_max, num_segments=num_segments)
    else:  # the first
        marks = jnp.where(bad, index, T)
        pick = jnp.min if segments is None else functools.partial(jax.ops.segment_min, num_segments=num_segments)
    if segments is None:
        bound = pick(marks, axis=1, keepdims=True)  # [B, 1, H]
        per_segment = bad.any(1)
    else:
        bound = pick(marks[0], segments)[segments][None]  # [1, T, H]
        per_segment = jax.ops.segment_max(bad[0].astype(jnp.int32), segments, num_segments=num_segments) > 0
    reached = index >= bound if not later else index <= bound
    return reached, per_segment


def guarded(fn: Callable, reverse: bool, problem: Problem):
    """`fn(problem)` = (output [B, T, H, V], final state [R, H, K, V]) with hard resets and
    non-finite values handled as the module docstring says.

    **Arguments:** `fn` the algorithm on a canonical problem; `reverse` whether it runs from the
    last token to the first; `problem` the canonical problem (its `cu_seqlens`, concrete or
    traced, reaches `fn` as given).
    """
    cu_seqlens = problem.cu_seqlens
    with_sequences = lambda p: fn(p._replace(cu_seqlens=cu_seqlens))  # noqa: E731
    return _guarded(with_sequences, bool(reverse), problem._replace(cu_seqlens=None), _segments(problem))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _guarded(fn, reverse, problem: Problem, segments):
    clean, bad = _clean(problem)
    return _poisoned(fn(clean), bad, problem, segments, reverse)[0]


def _poisoned(results, bad, problem: Problem, segments, reverse: bool):
    """Outputs reached by a bad token and final states of segments holding one, set to NaN;
    also which segments hold a bad token."""
    output, final = results
    reached, tainted = _reached(bad, segments, problem.initial_state.shape[0], later=reverse)
    output = jnp.where(reached[..., None], jnp.nan, output).astype(output.dtype)
    final = jnp.where(tainted[..., None, None], jnp.nan, final).astype(final.dtype)
    return (output, final), tainted


def _guarded_fwd(fn, reverse, problem, segments):
    clean, bad = _clean(problem)
    results, pullback = jax.vjp(fn, clean)
    results, tainted = _poisoned(results, bad, problem, segments, reverse)
    return results, (pullback, segments, tainted)


def _guarded_bwd(fn, reverse, residuals, cotangents):
    pullback, segments, tainted = residuals
    d_output, d_final = cotangents
    bad_final = ~jnp.isfinite(d_final).all((-2, -1))  # [R, H]
    clean = lambda x: jnp.where(jnp.isfinite(x), x, 0.0).astype(x.dtype)  # noqa: E731
    (grads,) = pullback((clean(d_output), clean(d_final)))
    reached, bad_segment = _reached(_bad_entries(d_output), segments, tainted.shape[0], later=not reverse)
    whole = tainted | bad_final  # [R, H]: every gradient of the segment
    per_token = reached | (whole[:, None] if segments is None else whole[segments][None])  # [B, T, H]
    poison = lambda x, mask: None if x is None else jnp.where(mask, jnp.nan, x).astype(x.dtype)  # noqa: E731
    fields = {}
    for name in TOKEN_FIELDS:
        x = getattr(grads, name)
        if x is not None:
            mask = _to_heads(per_token, x.shape[2])
            fields[name] = poison(x, mask if x.ndim == 3 else mask[..., None])
    fields["initial_state"] = poison(grads.initial_state, (whole | bad_segment)[..., None, None])
    return grads._replace(**fields), None


_guarded.defvjp(_guarded_fwd, _guarded_bwd)
