"""The delta rule chunk by chunk: a triangular solve inside each chunk, a scan of the state across.

| symbol   | meaning                                                                   |
|----------|---------------------------------------------------------------------------|
| B, T, H  | batch rows, tokens per row, value heads (shared query/key heads repeated to H per chunk) |
| n        | chunks per row: ceil(T / C) (packed: the aligned layout's M chunks)       |
| K, V     | key/query and value head dimensions                                       |
| C, c     | chunk size; leaf size of the per-channel decay ladder (`_core/intra.py`) |
| t, s     | token positions inside a chunk, 0 … C−1                                   |
| S_0      | the state entering the chunk [K, V]                                       |
| a_t, A_t | log decay of token t [K] (per head: the same for every channel); A_t = Σ_{u≤t} a_u |
| β_t      | write strength                                                            |
| u_t      | the value actually written by token t: β_t (v_t − S'_tᵀ k_t) [V]          |

**Derivation.** Unrolling S_t = diag(e^{a_t}) S_{t−1} + k_t u_tᵀ inside the chunk,

    S_t  = diag(e^{A_t}) S_0 + Σ_{s≤t} diag(e^{A_t − A_s}) k_s u_sᵀ
    S'_t = diag(e^{a_t}) S_{t−1} = diag(e^{A_t}) S_0 + Σ_{s<t} diag(e^{A_t − A_s}) k_s u_sᵀ

so u_t = β_t v_t − β_t S_0ᵀ (k_t ⊙ e^{A_t}) − Σ_{s<t} M_{ts} u_s with the strictly lower

    M_{ts} = β_t Σ_d k_t[d] k_s[d] e^{A_t[d] − A_s[d]}        (s < t; 0 otherwise)

that is (I + M) U = diag(β) V − diag(β) (K ⊙ e^{A}) S_0. With the unit-lower-triangular
solve Φ = (I + M)⁻¹ diag(β), W = Φ (K ⊙ e^{A}) and U_0 = Φ V (both independent of S_0):

    U   = U_0 − W S_0
    O   = scale · ((Q ⊙ e^{A}) S_0 + (P ⊙ [s ≤ t]) U),    P_{ts} = Σ_d q_t[d] k_s[d] e^{A_t[d] − A_s[d]}
    S_C = diag(e^{A_{C−1}}) S_0 + (K ⊙ e^{A_{C−1} − A})ᵀ U         (the state leaving the chunk)

Every factor has a non-positive exponent (for log decays ≤ 0): e^{A_t} and e^{A_{C−1} − A_t}
are products of e^{a}; P and M are `ChunkDecay.scores` of `_core/intra.py` (per head the
decay matrix built from products of e^{a}, per channel the ladder of rescaled halves), never
e^{A_t}·e^{−A_s}. The
per-head and per-channel gates are combined into one per-channel decay when both are present.

**Cost.** Per chunk: the C×C products P and M, the solve (C²·(K+V)), and the state products
(C·K·V); the chunks run in a `lax.scan` (`_chunk_vjp.chunk_scan`) whose step builds that
chunk's terms from its inputs and entry state, so nothing token-sized is kept besides the
inputs and the output. The backward is a custom VJP: a reverse scan that recomputes each
chunk's terms from its inputs and its entry state (the exit states are the forward's only
residual) and applies the hand-derived adjoint of `_chunk_adjoint`; across chunks only the
[K, V] state cotangent flows. Memory of jit(grad): one state per chunk, O(T/C·K·V) per head,
plus token-sized inputs, output and gradients. Measured here (XLA's temp bytes at B = 1,
T = 16384, H = 4, K = V = 128, float32, `qk_l2norm`): 194 MiB with a per-head g and with a
per-channel gk (autodiff through all chunk terms at once, before: 709 and 1451 MiB).
The chunks are laid out [n, B, C, H, ...] (a reshape of the tokens, no copy for B = 1) and
turned heads-first inside the step. The solve is a product with (I + M)⁻¹ (`_unit_lower`),
which the adjoint reuses transposed. Time on a 2-core CPU at B = 2, T = 2048, H = 4,
K = V = 128, g, `qk_l2norm` (jit, min of 7, a shared machine): forward ~78 ms, fwd+bwd
~224 ms (before: ~89 and ~290 ms); what remains is many small per-chunk ops ([B·H] batches
of 64×128 matmuls) run one scan step at a time.
- Padding: T is padded to a multiple of C with q = k = v = 0, β = 0 and log decay 0, tokens
  that neither change the state nor read it. A short T first shrinks C (by halving).
- Packed input: tokens are gathered into the chunk-aligned layout of `varlen.chunk_layout`
  (every sequence starts on a chunk boundary; C is halved until S·C ≤ N, so the layout's
  N + S·(C − 1) slots stay under 2N and memory grows with the tokens, not with S·C: at
  N = 8192 in 512 sequences of 16, H = 2, K = V = 64, `g`, XLA's temp bytes went from 99 MiB
  (forward) and 315 MiB (jit(grad)) at C = 64 to 39 and 181 MiB at C = 16, against 20 and
  77 MiB for one sequence of 8192); a chunk opening a sequence starts from that
  sequence's initial state, and each sequence's final state is the state leaving its last
  chunk (an empty sequence keeps its initial state). Shapes depend only on N and S, so
  `cu_seqlens` may be traced.
- Non-finite inputs: each step reads its chunk's non-finite token entries (and output
  cotangents) as 0 and its gates as `_finite.clean_gate` does, where it loads them; `_finite`
  marks NaN the results that depend on them, as the token loop's autodiff does.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Float

from .._core import varlen
from .._core.finite import clean_gate, clean_tokens
from .._core.finite_delta import guarded
from .._core.intra import ChunkDecay, dot
from .._core.matmul_precision import matmul_precision, traced_precision
from .._core.problem import Gate
from ._chunk_adjoint import chunk_backward
from ._chunk_vjp import chunk_scan
from ._problem import DeltaProblem
from ._unit_lower import unit_lower_inverse

CHUNK_SIZES = {"scalar_decays": 64, "channel_decays": 64}
"""Default C without / with a per-channel decay; with the ladder's leaf c = 1. The backward keeps
one [K, V] state per chunk, so C sets its memory: at B = 1, T = 16384, 4 heads, K = V = 128 with
`gk`, XLA's temporaries of jit(grad) were 258 MiB at C = 32 and 194 MiB at C = 64 (per-head
g: 194 MiB), and fwd+bwd at the issue's CPU shape was no slower at 64 (a loaded machine: a
fine sweep is still to do)."""
LEAF_SIZE = 1


class ChunkTerms(NamedTuple):
    """What a chunk contributes, independent of its entry state ([B, H, C, ...] per chunk).

    **Arguments:**
    - `queries`: Q ⊙ e^{A} [.., C, K]; `scores`: P ⊙ [s ≤ t] [.., C, C].
    - `writes`: U_0 = Φ V [.., C, V]; `corrections`: W = Φ (K ⊙ e^{A}) [.., C, K].
    - `keys_to_end`: K ⊙ e^{A_{C−1} − A} [.., C, K].
    - `state_decay`: e^{A_{C−1}} as [.., K, 1] (per channel) or [.., 1, 1] (per head), or None.
    """

    queries: Array
    scores: Array
    writes: Array
    corrections: Array
    keys_to_end: Array
    state_decay: Array | None


def _fitted_sizes(num_tokens: int, chunk_size: int, leaf_size: int, num_seqs: int = 1) -> tuple[int, int]:
    """(C, c): C halved while half of it still holds every token, and while S sequences would
    pad the aligned layout by more than its N tokens (S·C > N: every sequence starts a chunk,
    so the layout holds up to N + S·(C − 1) slots); c at most C."""
    while chunk_size > 1 and (chunk_size // 2 >= num_tokens or num_seqs * chunk_size > num_tokens):
        chunk_size //= 2
    return chunk_size, min(leaf_size, chunk_size)


def _strictly_lower(size: int) -> Array:
    return jnp.tril(jnp.ones((size, size), bool), -1)


def _chunk_decay(log_decay: Array | None, per_head: bool, leaf: int, size: int) -> ChunkDecay:
    """The decay factors of [.., C] (per head) or [.., C, K] (per channel) log decays."""
    if log_decay is None:
        return ChunkDecay.build(None, None, leaf, size)
    form = Gate.HEAD if per_head else Gate.KEY
    return ChunkDecay.build(log_decay, form, leaf, size)


def _state_decay(decay: ChunkDecay) -> Array | None:
    if decay.total is None:
        return None
    return decay.total[..., None, None] if decay.form is Gate.HEAD else decay.total[..., :, None]


def chunk_terms(q, k, v, beta, log_decay, leaf: int) -> ChunkTerms:
    """The state-independent terms of every chunk: q, k [.., n, C, K], v [.., n, C, V],
    beta [.., n, C], log_decay [.., n, C] / [.., n, C, K] / None (all in the state dtype)."""
    C, V = v.shape[-2], v.shape[-1]
    decay = _chunk_decay(log_decay, log_decay is not None and log_decay.ndim == beta.ndim, leaf, C)
    key_scores = jnp.where(_strictly_lower(C), decay.scores(k, k), 0)
    interactions = beta[..., :, None] * key_scores  # M
    rhs = beta[..., None] * jnp.concatenate([v, decay.from_start(k)], axis=-1)
    # (I + M) X = rhs, through the inverse of the unit lower-triangular I + M
    solved = dot("...ts,...sj->...tj", unit_lower_inverse(interactions), rhs)
    return ChunkTerms(
        queries=decay.from_start(q),
        scores=decay.scores(q, k),
        writes=solved[..., :V],
        corrections=solved[..., V:],
        keys_to_end=decay.to_end(k),
        state_decay=_state_decay(decay),
    )


def chunk_step(state: Float[Array, "... K V"], terms: ChunkTerms, scale: float):
    """One chunk from its entry state: (output [.., C, V], exit state [.., K, V])."""
    written = terms.writes - dot("...ck,...kv->...cv", terms.corrections, state)
    output = scale * (dot("...ck,...kv->...cv", terms.queries, state)
                      + dot("...ts,...sv->...tv", terms.scores, written))
    decayed = state if terms.state_decay is None else state * terms.state_decay
    return output, decayed + dot("...ck,...cv->...kv", terms.keys_to_end, written)


def _to_chunks(x: Array, C: int) -> Array:
    """[B, T, H, ...] (T a multiple of C) -> [n, B, C, H, ...]: a reshape, and no copy for B = 1."""
    B, T = x.shape[:2]
    return jnp.moveaxis(x.reshape(B, T // C, C, *x.shape[2:]), 1, 0)


def _from_chunks(o: Array) -> Array:
    """[n, B, C, H, V] -> [B, n·C, H, V]."""
    n, B, C = o.shape[:3]
    return jnp.moveaxis(o, 0, 1).reshape(B, n * C, *o.shape[3:])


def _heads_first(x: Array | None) -> Array | None:
    """One chunk's [B, C, H, ...] -> [B, H, C, ...] (inside a scan step: chunk-sized copies only)."""
    return None if x is None else jnp.moveaxis(x, 2, 1)


def _tokens_first(x: Array | None) -> Array | None:
    return None if x is None else jnp.moveaxis(x, 1, 2)


def _chunk_inputs(problem: DeltaProblem, C: int, take) -> tuple:
    """The problem's tokens placed by `take` ([B, T, ...] -> [B, n·C, ...]) as chunks with the
    chunk axis first: q, k [n, B, C, Hqk, K] (shared heads as they are), v [n, B, C, H, V],
    beta [n, B, C, H], log decay."""
    dtype = problem.state_dtype
    arrays = (problem.query.astype(dtype), problem.key.astype(dtype), problem.value.astype(dtype), problem.beta,
              problem.key_side_decay())
    return tuple(None if x is None else _to_chunks(take(x), C) for x in arrays)


def _expanded(x: tuple) -> tuple:
    """One chunk's inputs with query and key repeated to every value head (a chunk-sized copy:
    value head h reads query/key head h // (H / Hqk))."""
    q, k, v, *rest = x
    groups = v.shape[2] // q.shape[2]
    return (jnp.repeat(q, groups, axis=2), jnp.repeat(k, groups, axis=2), v, *rest)


def _grouped(d_x: tuple, heads: int) -> tuple:
    """The cotangents of `_expanded`'s query and key summed back over each group of heads."""
    d_q, d_k, *rest = d_x
    B, C, H, K = d_q.shape
    back = lambda d: d.reshape(B, C, heads, H // heads, K).sum(3)  # noqa: E731
    return (back(d_q), back(d_k), *rest)


def _stepper(scale: float, leaf: int):
    """One chunk from its inputs (q, k, v, beta, log decay; [B, C, H, ...]) and entry state,
    (output [B, C, H, V], exit), and its adjoint (traced in the backward pass, under the
    forward's matmul precision)."""
    return (functools.partial(_chunk_from_inputs, scale=scale, leaf=leaf),
            functools.partial(_chunk_adjoint, scale=scale, leaf=leaf, precision=traced_precision()))


def _loaded(x: tuple) -> tuple:
    """One chunk's inputs as the step reads them: non-finite token entries as 0, gates cleaned
    (`recurrax._core.finite_delta`)."""
    q, k, v, beta, log_decay = x
    return (*map(clean_tokens, (q, k, v, beta)), clean_gate(log_decay))


def _chunk_from_inputs(x: tuple, state: Array, *, scale: float, leaf: int):
    out, exit_state = chunk_step(state, chunk_terms(*map(_heads_first, _expanded(_loaded(x))), leaf), scale)
    return _tokens_first(out), exit_state


def _chunk_adjoint(x: tuple, state: Array, d_out: Array, d_exit: Array, *, scale: float, leaf: int, precision):
    with matmul_precision(precision):
        return _chunk_adjoint_at(x, state, d_out, d_exit, scale, leaf)


def _chunk_adjoint_at(x: tuple, state: Array, d_out: Array, d_exit: Array, scale: float, leaf: int):
    qk_heads = x[0].shape[2]
    x, d_out = tuple(map(_heads_first, _expanded(_loaded(x)))), clean_tokens(d_out)
    _, _, v, beta, log_decay = x
    decay = _chunk_decay(log_decay, log_decay is not None and log_decay.ndim == beta.ndim, leaf, v.shape[-2])
    d_x, d_state = chunk_backward(x, state, _heads_first(d_out), d_exit, decay, scale)
    return _grouped(tuple(map(_tokens_first, d_x)), qk_heads), d_state


def _dense(problem: DeltaProblem, scale: float, C: int, leaf: int):
    T = problem.query.shape[1]
    padded = -(-T // C) * C
    chunks = _chunk_inputs(problem, C, lambda x: varlen.pad_tokens(x, padded))
    chunk = jnp.arange(padded // C)
    owners = (jnp.zeros_like(chunk), chunk == 0, chunk == chunk[-1])
    out, finals = chunk_scan(*_stepper(scale, leaf), chunks, problem.initial_state[None], owners)
    return _from_chunks(out)[:, :T], finals[0]


def _packed(problem: DeltaProblem, scale: float, C: int, leaf: int):
    N = problem.query.shape[1]
    layout = varlen.chunk_layout(problem.cu_seqlens, N, C)
    owners = layout.owners
    take = lambda x: None if x is None else varlen.to_chunk_layout(x[0], layout)[None]  # noqa: E731
    chunks = _chunk_inputs(problem, C, take)
    init = problem.initial_state  # [S, H, K, V]
    owners = (owners.seq, owners.first, owners.last)
    out, finals = chunk_scan(*_stepper(scale, leaf), chunks, init[:, None], owners)
    out = _from_chunks(out)
    return varlen.from_chunk_layout(out[0], layout)[None], finals[:, 0]


def chunk_delta(
    problem: DeltaProblem, *, scale: float, chunk_size: int | None = None, leaf_size: int = LEAF_SIZE
):
    """The chunk algorithm on a canonical `problem`; `(output [B, T, H, V], final_state)`.

    `chunk_size` (C; None: `CHUNK_SIZES`) and `leaf_size` (c) are static: powers of two.
    """
    if chunk_size is None:
        chunk_size = CHUNK_SIZES["scalar_decays" if problem.log_decay_key is None else "channel_decays"]
    for name, size in (("chunk_size", chunk_size), ("leaf_size", leaf_size)):
        if size < 1 or size & (size - 1):
            raise ValueError(f"{name} must be a power of two, got {size}")
    num_seqs = 1 if problem.cu_seqlens is None else problem.cu_seqlens.shape[0] - 1
    C, leaf = _fitted_sizes(problem.query.shape[1], chunk_size, leaf_size, num_seqs)
    return guarded(functools.partial(_chunk_delta, float(scale), C, leaf), problem)


def _chunk_delta(scale: float, C: int, leaf: int, problem: DeltaProblem):
    run = _dense if problem.cu_seqlens is None else _packed
    out, final = run(problem, scale, C, leaf)
    return out.astype(problem.query.dtype), final
