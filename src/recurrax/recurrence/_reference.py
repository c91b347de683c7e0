"""The token-by-token oracle: a plain `lax.scan`, differentiated by JAX's autodiff.

| symbol | meaning                                  |
|--------|------------------------------------------|
| B, T   | batch rows, tokens per row               |
| H      | heads (grouped heads already expanded)   |
| K, V   | key/query and value head dimensions      |
| R      | state rows: B, or S packed sequences     |
| a_t    | key-side log decay [H, K] (or [H, 1])    |
| b_t    | value-side log decay [H, V]              |

For each token, in processing order (reversed when `reverse`):

    h ← initial_state[seq]                    if the token opens its sequence
    h ← exp(a_t)[:, :, None] · h · exp(b_t)[:, None, :] + k_t ⊗ v_t
    o_t = scale · q_tᵀ h

Its backward keeps one state per token (O(T·K·V) memory): it is for tests and docs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .._core.problem import Problem
from .._core.registry import ALL_GATES, FLOAT_DTYPES, Support
from .._core.varlen import Segments, segments, single_segment

SUPPORT = Support(dtypes=FLOAT_DTYPES, gates=ALL_GATES, varlen=True)


def _row(q, k, v, a, b, init, seg: Segments, scale: float):
    """One row of tokens in processing order; returns (o [T, H, V], finals [R, H, K, V])."""
    state_dtype = init.dtype

    def step(carry, token):
        h, finals = carry
        q_t, k_t, v_t, a_t, b_t, seq, start, end = token
        h = jnp.where(start, init[seq], h)
        if a_t is not None:
            h = jnp.exp(a_t)[:, :, None] * h
        if b_t is not None:
            h = h * jnp.exp(b_t)[:, None, :]
        h = h + k_t.astype(state_dtype)[:, :, None] * v_t.astype(state_dtype)[:, None, :]
        o_t = scale * jnp.einsum("hk,hkv->hv", q_t.astype(state_dtype), h)
        finals = finals.at[seq].set(jnp.where(end, h, finals[seq]))
        return (h, finals), o_t

    tokens = (q, k, v, a, b, seg.seq_id, seg.starts, seg.ends)
    (_, finals), o = jax.lax.scan(step, (init[0], init), tokens)
    return o, finals


def reference_recurrent(problem: Problem, *, scale: float, reverse: bool):
    """Token-by-token recurrence over the canonical `problem`; `(output, final_state)`."""
    B, T = problem.query.shape[:2]
    a = problem.key_side_decay()
    b = problem.log_decay_value
    flip = (lambda x: None if x is None else x[:, ::-1]) if reverse else (lambda x: x)
    q, k, v, a, b = map(flip, (problem.query, problem.key, problem.value, a, b))

    if problem.cu_seqlens is None:
        seg = single_segment(T)
        seg = seg.reversed() if reverse else seg
        row = lambda q, k, v, a, b, init: _row(q, k, v, a, b, init[None], seg, scale)  # noqa: E731
        o, finals = jax.vmap(row)(q, k, v, a, b, problem.initial_state)
        finals = finals[:, 0]
    else:
        seg = segments(problem.cu_seqlens, T)
        seg = seg.reversed() if reverse else seg
        o, finals = _row(q[0], k[0], v[0], _first(a), _first(b), problem.initial_state, seg, scale)
        o = o[None]
    o = o[:, ::-1] if reverse else o
    return o.astype(problem.query.dtype), finals


def _first(x):
    return None if x is None else x[0]
