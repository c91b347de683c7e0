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
from jaxtyping import Array, Float

from ._inputs import Problem
from .registry import Backend, Platform, Support, kernel_registry
from .varlen import Segments, segments, single_segment

ALL_FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})


def key_side_decay(problem: Problem) -> Float[Array, "B T H K"] | Float[Array, "B T H 1"] | None:
    """The key-side log decay a_t, without materialising absent terms."""
    head = None if problem.log_decay_head is None else problem.log_decay_head[..., None]
    key = problem.log_decay_key
    if head is None or key is None:
        return head if key is None else key
    return head + key


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


@kernel_registry.register(
    "reference",
    Platform.XLA,
    Backend.ANY,
    priority=0,
    supports=Support(dtypes=ALL_FLOATS, gates=frozenset({"head", "key", "value"}), varlen=True),
)
def reference(problem: Problem, *, scale: float, reverse: bool):
    """Token-by-token recurrence over the canonical `problem`; `(output, final_state)`."""
    B, T = problem.query.shape[:2]
    a = key_side_decay(problem)
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
