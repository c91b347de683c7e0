"""Hard resets and non-finite inputs around the chunkwise algorithms (XLA `chunk`, the kernels).

| symbol  | meaning                                                                       |
|---------|-------------------------------------------------------------------------------|
| B, T, H | batch rows, tokens, (value) heads of the canonical problem                    |
| segment | a batch row (dense) or a packed sequence (`cu_seqlens`)                       |
| p       | a token's position in processing order (t, or T − 1 − t when `reverse`)       |
| Q_p … O_p | token p holds a non-finite query / key / value / gate / output-cotangent entry (per head) |
| RESET   | −1e4, the log decay a gate ≤ RESET (−inf, a hard reset `log 0`, included) runs as |

Chunkwise algorithms form intra-chunk products as masked matmuls: a NaN or inf at token t
meets the zeros of the other rows, and `0 · NaN = NaN` reaches tokens it cannot influence.
A gate of −inf makes chunk-local cumulative log decays −inf, whose differences are NaN. The
work is split in two:

- **The algorithm cleans at load.** It reads every non-finite entry of the token inputs and
  of the output cotangent as 0 and every gate below RESET as RESET (`clean_tokens`,
  `clean_gate`, applied where a tile is loaded, so no cleaned copy is stored), and computes
  the exact results of that cleaned problem. e^RESET is 0 in float32 and float64, so −inf
  gives the −1e4 result, and its gradient there is 0, as e^g's is.
- **This module marks NaN the results that depend on a non-finite value**, per (token, head),
  from where the bad entries sit. The state h_p is tainted from the first token that writes a
  bad value into it, F = min{p : K_p or V_p or G_p}; the state's adjoint ∂L/∂h_p from the
  last token that reads one into it, Cb = max({p : Q_p or O_p} ∪ {p − 1 : G_p}) (a bad final-state
  cotangent: every p). Then, as the token loop's autodiff has it (`dq_p = h_p do_p`,
  `dk_p = ∂h_p v_p`, `dv_p = ∂h_pᵀ k_p`, `da_p = Σ ∂h_p ⊙ e^{a_p} h_{p−1}`):

  | result             | NaN where                              |
  |--------------------|----------------------------------------|
  | output o_p         | p ≥ F or Q_p                           |
  | final state        | F exists in the segment                |
  | dq_p               | p ≥ F or O_p                           |
  | dk_p               | p ≤ Cb or V_p                          |
  | dv_p               | p ≤ Cb or K_p                          |
  | d gate_p           | p ≤ Cb or p > F or G_p                 |
  | d initial state    | Cb ≥ −1 (the initial state sits at p = −1) |

  Everything else is the cleaned problem's exact value, which is the true one: it depends on
  no bad entry. So a non-finite value never reaches earlier tokens, other rows or other
  sequences, and where it does reach, the result is NaN in that (token, head) (its other
  channels included: the rule is per token and head, not per channel).

Cost on the clean path: the flags are one read of the inputs (and of the output cotangent in
the backward) reduced to [B, T, H] booleans; the NaN marks (a `where` over the outputs and
gradients) run only when a flag is set (`lax.cond`); no input is copied.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from . import varlen
from .problem import Problem

RESET = -1e4
"""Gates at or below this log decay are hard resets (e^RESET underflows to 0)."""

GATE_FIELDS = ("log_decay_head", "log_decay_key", "log_decay_value")


def clean_tokens(x: Array | None) -> Array | None:
    """Non-finite entries read as 0 (an algorithm applies it where it loads a token tile)."""
    return None if x is None else jnp.where(jnp.isfinite(x), x, 0).astype(x.dtype)


def clean_gate(g: Array | None) -> Array | None:
    """Log decays ≤ RESET (−inf included) read as RESET, NaN and +inf as 0."""
    if g is None:
        return None
    g = jnp.where(jnp.isnan(g) | (g == jnp.inf), 0, g)
    return jnp.where(g < RESET, RESET, g).astype(g.dtype)


@jax.custom_vjp
def clean_cotangent(x: Array) -> Array:
    """The identity, whose cotangent has its non-finite entries read as 0: for an algorithm
    differentiated by JAX, where a bad output cotangent would otherwise meet masked zeros."""
    return x


clean_cotangent.defvjp(lambda x: (x, None), lambda _, ct: (clean_tokens(ct),))


class BadTokens(NamedTuple):
    """Per token and value head [B, T, H]: which inputs of the token hold a non-finite entry
    (a gate of −inf is a reset, not bad)."""

    query: Bool[Array, "B T H"]
    key: Bool[Array, "B T H"]
    value: Bool[Array, "B T H"]
    gate: Bool[Array, "B T H"]


def _bad_entries(x: Array, heads: int) -> Bool[Array, "B T H"]:
    """Any non-finite entry per token and head of x [B, T, Hx] or [B, T, Hx, D], as H heads.

    Over D as the product `x · 0⃗` (0 where every entry is finite, NaN where one is not: 0 · ±inf
    is NaN): a matrix-vector product reads x in place, where a boolean `any` of `isfinite`
    materialised a [B, T, H, D] mask (XLA on CPU does not fuse it into the reduction). At
    HIGHEST precision: a one-pass bfloat16 product (a TPU's default) rounds a float32 entry
    near its largest value up to infinity."""
    if x.ndim == 4:
        x = jnp.einsum("...d,d->...", x, jnp.zeros(x.shape[-1], x.dtype), precision=jax.lax.Precision.HIGHEST)
    return _to_heads(~jnp.isfinite(x), heads)


def _bad_cotangent(d_output: Array, heads: int) -> Bool[Array, "B T H"]:
    """`_bad_entries` of the output cotangent [B, T, H, V], over V as the sum of `x − x` (0, or
    NaN where an entry is not finite), which XLA fuses into the reduction. The cotangent may
    not be an array yet (`output.sum()`'s is a broadcast of ones, which the algorithm reads
    tile by tile); a matrix-vector product made XLA materialise it: 16 MiB at T 16384, H 4,
    V 64. (It costs more than the product on an array: 0.31 against 0.14 ms at [2, 2048, 8, 64].)"""
    return _to_heads(~jnp.isfinite((d_output - d_output).sum(-1)), heads)


def _to_heads(mask: Bool[Array, "B T Hx"], heads: int) -> Bool[Array, "B T heads"]:
    """A per-head mask between H value heads and the heads of a shared query/key: repeated
    to every head of a group, or any over the group."""
    have = mask.shape[2]
    if have < heads:
        return jnp.repeat(mask, heads // have, axis=2)
    return mask if have == heads else mask.reshape(*mask.shape[:2], heads, have // heads).any(-1)


def bad_tokens(problem: Problem) -> BadTokens:
    """The non-finite entries of a canonical problem, per token and value head."""
    H = problem.value.shape[2]
    gate = jnp.zeros(problem.value.shape[:3], bool)
    for name in GATE_FIELDS:
        g = getattr(problem, name)
        if g is not None:
            gate = gate | _bad_entries(jnp.where(g == -jnp.inf, 0, g), H)
    return BadTokens(_bad_entries(problem.query, H), _bad_entries(problem.key, H), _bad_entries(problem.value, H), gate)


class _Segments(NamedTuple):
    """Where every token sits: its segment and its processing position."""

    ids: Int[Array, "T"] | None  # packed: the sequence of every token; dense: None (the row)
    count: int  # segments: B rows, or S sequences
    position: Int[Array, "1 T 1"]  # p of every token


def _segments(cu_seqlens: Array | None, num_tokens: int, rows: int, reverse: bool) -> _Segments:
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    position = (num_tokens - 1 - tokens if reverse else tokens)[None, :, None]
    if cu_seqlens is None:
        return _Segments(None, rows, position)
    return _Segments(varlen.segments(cu_seqlens, num_tokens).seq_id, cu_seqlens.shape[0] - 1, position)


_NONE = 2**30  # a position beyond every token ("no such token")


def _per_segment(marks: Array, seg: _Segments, pick: str) -> tuple[Array, Array]:
    """(per segment [R, H], per token [B, T, H]) of `pick` ("min" or "max") over each segment's
    tokens of `marks` [B, T, H]."""
    if seg.ids is None:
        reduced = (jnp.min if pick == "min" else jnp.max)(marks, axis=1)  # [B, H]
        return reduced, reduced[:, None]
    reduce = jax.ops.segment_min if pick == "min" else jax.ops.segment_max
    reduced = reduce(marks[0], seg.ids, num_segments=seg.count)  # [S, H]
    return reduced, reduced[seg.ids][None]


def _first_tainted(bad: BadTokens, seg: _Segments):
    """F: the first position whose state holds a bad value, per segment and per token."""
    writes = bad.key | bad.value | bad.gate
    return _per_segment(jnp.where(writes, seg.position, _NONE), seg, "min")


def _output_marks(bad: BadTokens, seg: _Segments):
    """(output [B, T, H], final state [R, H]) masks: NaN where they depend on a bad entry."""
    first_segment, first = _first_tainted(bad, seg)
    return (seg.position >= first) | bad.query, first_segment < _NONE


def _gradient_marks(bad: BadTokens, bad_output: Array, bad_final: Array, seg: _Segments):
    """Masks of (dq, dk, dv, d gate) [B, T, H] and d initial state [R, H] (module table)."""
    _, first = _first_tainted(bad, seg)
    p = seg.position
    reads = jnp.maximum(jnp.where(bad.query | bad_output, p, -_NONE), jnp.where(bad.gate, p - 1, -_NONE))
    last_segment, _ = _per_segment(reads, seg, "max")
    last_segment = jnp.where(bad_final, _NONE, last_segment)  # [R, H]
    last = last_segment[:, None] if seg.ids is None else last_segment[seg.ids][None]
    adjoint = p <= last
    marks = ((p >= first) | bad_output, adjoint | bad.value, adjoint | bad.key, adjoint | (p > first) | bad.gate)
    return marks, last_segment >= -1


def _nan_where(x: Array | None, mask: Bool[Array, "B T H"]) -> Array | None:
    """x [B, T, Hx(, D)] with its (token, head) cells under `mask` set to NaN."""
    if x is None:
        return None
    mask = _to_heads(mask, x.shape[2])
    return jnp.where(mask if x.ndim == 3 else mask[..., None], jnp.nan, x).astype(x.dtype)


def guarded(fn: Callable, reverse: bool, problem: Problem):
    """`fn(problem)` = (output [B, T, H, V], final state [R, H, K, V]) with the results that
    depend on a non-finite input set to NaN (module docstring).

    **Arguments:** `fn` the algorithm on a canonical problem, cleaning at load as the module
    docstring says (it must close over static configuration only); `reverse` whether it runs
    from the last token to the first; `problem` the canonical problem (its `cu_seqlens`, concrete
    or traced, reaches `fn` as given).
    """
    return _guarded(fn, bool(reverse), problem)


def _segments_of(problem: Problem, reverse: bool) -> _Segments:
    return _segments(problem.cu_seqlens, problem.query.shape[1], problem.initial_state.shape[0], reverse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _guarded(fn, reverse, problem: Problem):
    return _guarded_fwd(fn, reverse, problem)[0]


def _if_any(flags, mark: Callable, results):
    """`mark(results)` if any of `flags` is set, else `results` untouched: the clean path
    skips the `where` passes (under `vmap` both branches run, as a select)."""
    any_bad = functools.reduce(jnp.logical_or, (jnp.any(f) for f in flags))
    return jax.lax.cond(any_bad, mark, lambda x: x, results)


def _guarded_fwd(fn, reverse, problem: Problem):
    results, pullback = jax.vjp(fn, problem)
    bad = bad_tokens(problem)

    def mark(results):
        (output, final), (output_mask, final_mask) = results, _output_marks(bad, _segments_of(problem, reverse))
        return _nan_where(output, output_mask), jnp.where(final_mask[..., None, None], jnp.nan, final).astype(final.dtype)

    results = _if_any(bad, mark, results)
    return results, (pullback, bad, problem.cu_seqlens, problem.query.shape[1], problem.initial_state.shape[0])


def _guarded_bwd(fn, reverse, residuals, cotangents):
    pullback, bad, cu_seqlens, num_tokens, rows = residuals
    d_output, d_final = cotangents
    bad_final = ~jnp.isfinite(d_final).all((-2, -1))  # [R, H]
    bad_output = _bad_cotangent(d_output, bad.query.shape[2])
    (grads,) = pullback((d_output, clean_tokens(d_final)))  # fn cleans d_output at load
    seg = _segments(cu_seqlens, num_tokens, rows, reverse)

    def mark(grads):
        (dq, dk, dv, d_gate), d_init = _gradient_marks(bad, bad_output, bad_final, seg)
        fields = {"query": _nan_where(grads.query, dq), "key": _nan_where(grads.key, dk),
                  "value": _nan_where(grads.value, dv)}
        for name in GATE_FIELDS:
            fields[name] = _nan_where(getattr(grads, name), d_gate)
        init = grads.initial_state
        fields["initial_state"] = jnp.where(d_init[..., None, None], jnp.nan, init).astype(init.dtype)
        return grads._replace(**fields)

    return (_if_any((*bad, bad_output, bad_final), mark, grads._replace(cu_seqlens=None)),)


_guarded.defvjp(_guarded_fwd, _guarded_bwd)
