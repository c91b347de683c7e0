"""The delta rule token by token: a plain `lax.scan`, differentiated by JAX's autodiff.

| symbol | meaning                                            |
|--------|----------------------------------------------------|
| B, T   | batch rows, tokens per row                         |
| H      | value heads (query/key heads repeated to H)        |
| K, V   | key/query and value head dimensions                |
| R      | state rows: B, or S packed sequences               |
| a_t    | log decay [H, K] (or [H, 1] per head; none: 0)     |
| β_t    | write strength [H]                                 |

For each token:

    S  ← initial_state[seq]                   if the token opens its sequence
    S' = diag(e^{a_t}) · S
    S  = S' + k_t (β_t (v_t − S'ᵀ k_t))ᵀ
    o_t = scale · Sᵀ q_t

Its backward keeps one state per token (O(T·K·V) memory): it is the oracle of the tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._core.varlen import Segments, segments, single_segment
from ._problem import DeltaProblem


def delta_token(state, q_t, k_t, v_t, beta_t, a_t, scale: float):
    """One token of every head: state [H, K, V], q_t, k_t [H, K], v_t [H, V], beta_t [H],
    a_t [H, K] / [H, 1] / None; returns (o_t [H, V], the new state)."""
    if a_t is not None:
        state = jnp.exp(a_t)[:, :, None] * state
    correction = v_t - jnp.einsum("hk,hkv->hv", k_t, state)
    state = state + k_t[:, :, None] * (beta_t[:, None] * correction)[:, None, :]
    return scale * jnp.einsum("hk,hkv->hv", q_t, state), state


def _row(q, k, v, beta, a, init, seg: Segments, scale: float):
    """One row of tokens; returns (o [T, H, V], finals [R, H, K, V])."""

    def step(carry, token):
        state, finals = carry
        q_t, k_t, v_t, beta_t, a_t, seq, start, end = token
        state = jnp.where(start, init[seq], state)
        o_t, state = delta_token(state, q_t, k_t, v_t, beta_t, a_t, scale)
        finals = finals.at[seq].set(jnp.where(end, state, finals[seq]))
        return (state, finals), o_t

    tokens = (q, k, v, beta, a, seg.seq_id, seg.starts, seg.ends)
    (_, finals), o = jax.lax.scan(step, (init[0], init), tokens)
    return o, finals


def reference_delta(problem: DeltaProblem, *, scale: float):
    """The token loop over the canonical `problem`; `(output [B, T, H, V], final_state)`."""
    B, T = problem.query.shape[:2]
    dtype = problem.state_dtype
    q, k = problem.expanded_query_key()
    v, beta = problem.value.astype(dtype), problem.beta
    a = problem.key_side_decay()
    if a is not None and a.ndim == 3:
        a = a[..., None]
    if problem.cu_seqlens is None:
        seg = single_segment(T)
        row = lambda q, k, v, beta, a, init: _row(q, k, v, beta, a, init[None], seg, scale)  # noqa: E731
        o, finals = jax.vmap(row)(q, k, v, beta, a, problem.initial_state)
        finals = finals[:, 0]
    else:
        seg = segments(problem.cu_seqlens, T)
        first = lambda x: None if x is None else x[0]  # noqa: E731
        o, finals = _row(q[0], k[0], v[0], beta[0], first(a), problem.initial_state, seg, scale)
        o = o[None]
    return o.astype(problem.query.dtype), finals
