"""The adjoint of one delta-rule chunk: every input's cotangent from the output's and the exit state's.

| symbol      | meaning                                                                     |
|-------------|-----------------------------------------------------------------------------|
| C, K, V     | chunk size, key and value head dimensions (leading batch/head axes omitted) |
| S, E        | the state entering the chunk [K, V], the state leaving it                   |
| a_t, A_t    | log decay of token t (per channel [K], or per head) and Σ_{u≤t} a_u         |
| γ           | e^{A_{C−1}}, the state's decay over the chunk                               |
| Q̃, K̃, K̂     | Q ⊙ e^{A}, K ⊙ e^{A}, K ⊙ e^{A_{C−1} − A} (`ChunkDecay.from_start/to_end`)   |
| L, P        | scores(K, K) strictly lower, scores(Q, K) lower (`ChunkDecay.scores`)       |
| X̄           | ∂L/∂X for every quantity X                                                  |

The forward (`_chunk`'s module docstring), in the order it is computed:

    M = diag(β) L,   R = diag(β) [V, K̃],   [U_0, W] = (I + M)⁻¹ R
    U = U_0 − W S,   O = scale (Q̃ S + P U),   E = γ S + K̂ᵀ U

Reversed, given Ō and Ē:

    Ū   = scale Pᵀ Ō + K̂ Ē                     P̄ = scale Ō Uᵀ (lower)
    Q̃̄   = scale Ō Sᵀ                           K̂̄ = U Ēᵀ
    S̄   = scale Q̃ᵀ Ō + γ Ē − Wᵀ Ū              (the cotangent passed to the previous chunk)
    Ȳ   = (I + M)⁻ᵀ [Ū, −Ū Sᵀ]                  (the forward's inverse, transposed: `_unit_lower`)
    M̄   = −Ȳ [U_0, W]ᵀ (strictly lower),       L̄ = diag(β) M̄
    β̄_t = Σ_j Ȳ_tj R_tj / β_t + Σ_s M̄_ts L_ts  = Σ_j Ȳ_tj [V, K̃]_tj + Σ_s M̄_ts L_ts
    [V̄, K̃̄] = diag(β) Ȳ

A decayed causal product scores(x, y) with cotangent G gives x̄ = apply(G, y) and
ȳ = apply_t(G, x) (`_core/intra.py`), and since ∂/∂A_t of e^{A_t − A_s} is the factor itself,

    Ā_t += x_t ⊙ apply(G, y)_t,     Ā_s −= y_s ⊙ apply_t(G, x)_s

(per channel; per head summed over the channels). So

    Q̄ = apply(P̄, K) + Q̃̄ ⊙ e^{A}
    K̄ = apply_t(P̄, Q) + apply(L̄, K) + apply_t(L̄, K) + K̃̄ ⊙ e^{A} + K̂̄ ⊙ e^{A_{C−1} − A}
    Ā = Q ⊙ apply(P̄, K) − K ⊙ apply_t(P̄, Q) + K ⊙ (apply(L̄, K) − apply_t(L̄, K))
        + Q̃ ⊙ Q̃̄ + K̃ ⊙ K̃̄                      (A_t's own terms; K̂ and γ hold A_{C−1} − A_t)
    ā_u = Σ_{t≥u} Ā_t  +  Σ_{t<u} K̂_t ⊙ K̂̄_t  +  Σ_v (γ S) ⊙ Ē

(a_u is inside A_t for t ≥ u, inside A_{C−1} − A_t for t < u, and inside γ). Summed so, no
two large terms cancel: P's diagonal (factor e^0 = 1, whose two terms of Ā_t would cancel
at the same token) is kept out of P̄ in the Ā terms and added to Q̄, K̄ directly, and the
K̂ term is a sum over t < u rather than +Σ_t at the end minus itself below u. What remains
cancelling is a pair (t > s ≥ u) weighted by its own decay e^{A_t − A_s}, so with strong
decays the cotangent keeps its relative precision. Every factor is one the forward already
uses (`ChunkDecay`'s products of e^{a}, never a difference of cumulative sums), so hard
resets (a = −∞) give finite cotangents.
"""

from __future__ import annotations

import jax.numpy as jnp

from .._core.intra import ChunkDecay, chunk_cumsum, dot
from .._core.problem import Gate
from ._unit_lower import unit_lower_inverse


def _channel_sum(x, decay: ChunkDecay):
    """A per-channel log-decay cotangent [.., C, K] as the decay's own shape."""
    return jnp.sum(x, axis=-1) if decay.form is Gate.HEAD else x


def chunk_backward(x: tuple, state, d_out, d_exit, decay: ChunkDecay, scale: float):
    """Cotangents ((q̄, k̄, v̄, β̄, ā or None), S̄) of one chunk (the module docstring);
    `x` = (q, k, v, beta, log_decay) as `_chunk.chunk_terms` takes them, `decay` their
    `ChunkDecay`."""
    q, k, v, beta, log_decay = x
    C, V = v.shape[-2:]
    lower = jnp.tril(jnp.ones((C, C), bool))
    strict = jnp.tril(jnp.ones((C, C), bool), -1)
    key_scores = jnp.where(strict, decay.scores(k, k), 0)  # L
    interactions = beta[..., :, None] * key_scores  # M
    k_start = decay.from_start(k)
    inputs = jnp.concatenate([v, k_start], axis=-1)  # [V, K̃]
    inverse = unit_lower_inverse(interactions)  # (I + M)⁻¹
    solved = dot("...ts,...sj->...tj", inverse, beta[..., None] * inputs)  # [U_0, W]
    corrections = solved[..., V:]
    written = solved[..., :V] - dot("...ck,...kv->...cv", corrections, state)  # U
    scores = decay.scores(q, k)  # P
    q_start, k_end = decay.from_start(q), decay.to_end(k)

    d_written = scale * dot("...ts,...tv->...sv", scores, d_out) + dot("...ck,...kv->...cv", k_end, d_exit)
    d_scores = jnp.where(lower, scale * dot("...tv,...sv->...ts", d_out, written), 0)
    d_q_start = scale * dot("...tv,...kv->...tk", d_out, state)
    d_k_end = dot("...cv,...kv->...ck", written, d_exit)
    d_state = (scale * dot("...ck,...cv->...kv", q_start, d_out) + decay.decay_rows(d_exit)
               - dot("...ck,...cv->...kv", corrections, d_written))
    d_solved = jnp.concatenate([d_written, -dot("...cv,...kv->...ck", d_written, state)], axis=-1)
    d_rhs = dot("...st,...sj->...tj", inverse, d_solved)  # Ȳ = (I + M)⁻ᵀ [Ū, −Ū Sᵀ]
    d_interactions = jnp.where(strict, -dot("...tj,...sj->...ts", d_rhs, solved), 0)  # M̄
    d_beta = jnp.sum(d_rhs * inputs, axis=-1) + jnp.sum(d_interactions * key_scores, axis=-1)
    d_inputs = beta[..., None] * d_rhs
    d_key_scores = beta[..., :, None] * d_interactions  # L̄

    # P's diagonal (decay factor 1) apart: its two terms of Ā would cancel at the same token
    d_diagonal = jnp.sum(jnp.where(jnp.eye(C, dtype=bool), d_scores, 0), axis=-1)[..., None]
    d_scores = jnp.where(strict, d_scores, 0)
    q_from_scores = decay.apply(d_scores, k)
    k_from_scores = decay.apply_t(d_scores, q)
    k_from_rows = decay.apply(d_key_scores, k)
    k_from_columns = decay.apply_t(d_key_scores, k)
    d_k_start = d_inputs[..., V:]
    d_q = q_from_scores + d_diagonal * k + decay.from_start(d_q_start)
    d_k = (k_from_scores + d_diagonal * q + k_from_rows + k_from_columns + decay.from_start(d_k_start)
           + decay.to_end(d_k_end))
    d_x = (d_q, d_k, d_inputs[..., :V], d_beta, None)
    if log_decay is None:
        return d_x, d_state
    through = _channel_sum(q * q_from_scores - k * k_from_scores + k * (k_from_rows - k_from_columns)
                           + q_start * d_q_start + k_start * d_k_start, decay)
    after = _channel_sum(k_end * d_k_end, decay)
    kept = _channel_sum(jnp.sum(decay.decay_rows(state) * d_exit, axis=-1), decay)
    kept = kept[..., None, :] if decay.per_channel else kept[..., None]  # every token's decay is in γ
    d_log_decay = chunk_cumsum(through, decay.per_channel, reverse=True) + _before(after, decay.per_channel) + kept
    return (*d_x[:4], d_log_decay), d_state


def _before(x, channel: bool):
    """Σ_{t<u} x_t for every u: the strictly exclusive cumulative sum over the chunk axis, as a
    product with a strictly triangular ones matrix (not an inclusive sum minus x, which would
    cancel)."""
    size = x.shape[-2] if channel else x.shape[-1]
    ones = jnp.tril(jnp.ones((size, size), x.dtype), -1)
    return dot("us,...sd->...ud", ones, x) if channel else dot("us,...s->...u", ones, x)
