"""Hard resets and non-finite inputs around the chunkwise algorithms (XLA `chunk`, the kernels),
for both operations: the cleaning, and `guarded`, which marks NaN what an operation's `Rule`
says depends on a bad entry. The table below is `recurrent`'s (its `Rule`:
`finite_recurrent.py`); the delta rule's is `finite_delta.py`'s.

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


RESET = -1e4
"""Gates at or below this log decay are hard resets (e^RESET underflows to 0)."""

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


def bad_tokens(problem, fields: tuple[str, ...], gate_fields: tuple[str, ...]) -> dict[str, Array]:
    """Per token and value head [B, T, H]: which of the token `fields` of a canonical problem
    hold a non-finite entry, and under "gate" which of its `gate_fields` do (a gate of −inf is
    a hard reset, not bad)."""
    H = problem.value.shape[2]
    bad = {name: _bad_entries(getattr(problem, name), H) for name in fields}
    bad["gate"] = jnp.zeros(problem.value.shape[:3], bool)
    for name in gate_fields:
        g = getattr(problem, name)
        if g is not None:
            bad["gate"] = bad["gate"] | _bad_entries(jnp.where(g == -jnp.inf, 0, g), H)
    return bad


_NONE = 2**30  # a position beyond every token ("no such token")


class Span(NamedTuple):
    """Where the tokens a device holds sit in their rows.

    **Arguments:**
    - `ids`: packed input: the sequence of every token [T]; dense: None (the row).
    - `count`: segments (B rows, or S sequences).
    - `position`: p of every token in processing order, [1, T, 1].
    - `axis`: the mesh axis a row's tokens are split over (`parallel.delta_rule`), or None.
    """

    ids: Int[Array, " T"] | None
    count: int
    position: Int[Array, "1 T 1"]
    axis: str | None

    @classmethod
    def of(cls, cu_seqlens: Array | None, num_tokens: int, rows: int, reverse: bool, axis: str | None) -> Span:
        """The span of `num_tokens` tokens: a row's (or, packed, all tokens') tokens, or on a
        mesh the block of `axis`'s index (`cu_seqlens` the whole row's boundaries); `reverse`
        (one device only) numbers them from the last."""
        offset = 0 if axis is None else jax.lax.axis_index(axis) * num_tokens
        tokens = offset + jnp.arange(num_tokens, dtype=jnp.int32)
        position = (num_tokens - 1 - tokens if reverse else tokens)[None, :, None]
        if cu_seqlens is None:
            return cls(None, rows, position, axis)
        ids = jnp.searchsorted(cu_seqlens[1:], tokens, side="right").astype(jnp.int32)
        return cls(jnp.minimum(ids, cu_seqlens.shape[0] - 2), cu_seqlens.shape[0] - 1, position, axis)

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


class Rule(NamedTuple):
    """An operation's table (its module docstring): where a bad entry reaches the results.

    **Arguments:**
    - `fields`, `gate_fields`: the canonical problem's token inputs (`query` among them) and
      gates, whose non-finite entries are flagged per token and head (`bad_tokens`).
    - `writes`: flags (by name) → [B, T, H]: token p writes a bad value into the state (F = the first p).
    - `read_before`: flags (by name) → [B, T, H]: the state's adjoint at p − 1 reads a bad value of
      token p (with the bad queries and output cotangents at p, Cb = the last such position).
    - `gradients`: (flags, bad output cotangent, p, F per token, p ≤ Cb) → {field of the
      canonical problem: its gradient's NaN mask [B, T, H]}.
    """

    fields: tuple[str, ...]
    gate_fields: tuple[str, ...]
    writes: Callable
    read_before: Callable
    gradients: Callable


def _first_tainted(rule: Rule, bad, span: Span):
    """F: the first position whose state holds a bad value, per segment and per token."""
    return span.reduce(jnp.where(rule.writes(bad), span.position, _NONE), "min")


def _output_marks(rule: Rule, bad, span: Span):
    """(output [B, T, H], final state [R, H]) masks: NaN where they depend on a bad entry."""
    first_segment, first = _first_tainted(rule, bad, span)
    return (span.position >= first) | bad["query"], first_segment < _NONE


def _gradient_marks(rule: Rule, bad, bad_output: Array, bad_final: Array, span: Span):
    """Masks of the token fields' gradients ({field: [B, T, H]}) and d initial state [R, H]."""
    _, first = _first_tainted(rule, bad, span)
    p = span.position
    reads = jnp.maximum(jnp.where(bad["query"] | bad_output, p, -_NONE), jnp.where(rule.read_before(bad), p - 1, -_NONE))
    last_segment, _ = span.reduce(reads, "max")
    last_segment = jnp.where(bad_final, _NONE, last_segment)  # [R, H]
    adjoint = p <= span.per_token(last_segment)
    return rule.gradients(bad, bad_output, p, first, adjoint), last_segment >= -1


def _nan_where(x: Array | None, mask: Bool[Array, "B T H"]) -> Array | None:
    """x [B, T, Hx(, D)] with its (token, head) cells under `mask` set to NaN."""
    if x is None:
        return None
    mask = _to_heads(mask, x.shape[2])
    return jnp.where(mask if x.ndim == 3 else mask[..., None], jnp.nan, x).astype(x.dtype)


def guarded(fn: Callable, rule: Rule, problem, *, reverse: bool = False, axis: str | None = None):
    """`fn(problem)` = (output [B, T, H, V], final state [R, H, K, V]) with the results that
    depend on a non-finite input set to NaN, as `rule` tables it (module docstring).

    **Arguments:** `fn` the algorithm on a canonical problem, cleaning at load as the module
    docstring says (it must close over static configuration only); `rule` the operation's
    table; `problem` the canonical problem (its `cu_seqlens`, concrete or traced, reaches `fn`
    as given); `reverse` whether `fn` runs from the last token to the first; `axis`: None on
    one device, or, inside a `shard_map`, the sequence axis: `problem` is then this device's
    block of tokens (block `axis_index(axis)` of every row, `cu_seqlens` the whole row's
    boundaries) and `fn` may hold collectives.
    """
    return _guarded(fn, rule, bool(reverse), axis, problem)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _guarded(fn, rule, reverse, axis, problem):
    return _marked_results(rule, reverse, axis, problem, fn(problem))[0]  # not differentiated: fn's primal


def _if_any(flags, mark: Callable, results):
    """`mark(results)` if any of `flags` is set, else `results` untouched: the clean path
    skips the `where` passes (under `vmap` both branches run, as a select)."""
    any_bad = functools.reduce(jnp.logical_or, (jnp.any(f) for f in flags))
    return jax.lax.cond(any_bad, mark, lambda x: x, results)


def _marked(flags, axis: str | None, mark: Callable, results):
    """`mark(results)`: skipped by a `lax.cond` when no flag is set, on one device (on a mesh
    the branch would hold collectives: always run, as `where`s)."""
    return mark(results) if axis is not None else _if_any(flags, mark, results)


def _marked_results(rule, reverse, axis, problem, results):
    """(`results` marked NaN where `rule` says, the per-token flags, the span's shape)."""
    bad = bad_tokens(problem, rule.fields, rule.gate_fields)
    shape = (problem.cu_seqlens, problem.query.shape[1], problem.initial_state.shape[0])

    def mark(results):
        (output, final) = results
        output_mask, final_mask = _output_marks(rule, bad, Span.of(*shape, reverse, axis))
        return _nan_where(output, output_mask), jnp.where(final_mask[..., None, None], jnp.nan, final).astype(final.dtype)

    return _marked(bad.values(), axis, mark, results), bad, shape


def _guarded_fwd(fn, rule, reverse, axis, problem):
    results, pullback = jax.vjp(fn, problem)
    marked, bad, shape = _marked_results(rule, reverse, axis, problem, results)
    return marked, (pullback, bad, shape)


def _guarded_bwd(fn, rule, reverse, axis, residuals, cotangents):
    pullback, bad, shape = residuals
    d_output, d_final = cotangents
    bad_final = ~jnp.isfinite(d_final).all((-2, -1))  # [R, H]
    bad_output = _bad_cotangent(d_output, bad["query"].shape[2])
    (grads,) = pullback((d_output, clean_tokens(d_final)))  # fn cleans d_output at load

    def mark(grads):
        masks, d_init = _gradient_marks(rule, bad, bad_output, bad_final, Span.of(*shape, reverse, axis))
        fields = {name: _nan_where(getattr(grads, name), mask) for name, mask in masks.items()}
        init = grads.initial_state
        fields["initial_state"] = jnp.where(d_init[..., None, None], jnp.nan, init).astype(init.dtype)
        return grads._replace(**fields)

    return (_marked((*bad.values(), bad_output, bad_final), axis, mark, grads._replace(cu_seqlens=None)),)


_guarded.defvjp(_guarded_fwd, _guarded_bwd)
