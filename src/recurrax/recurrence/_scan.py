"""The sequential algorithm: token-by-token `lax.scan` with a hand-written, checkpointed backward.

| symbol | meaning                                                        |
|--------|----------------------------------------------------------------|
| B, T   | batch rows, tokens per row                                     |
| H      | heads (grouped heads already expanded)                         |
| K, V   | key/query and value head dimensions                            |
| S      | packed sequences (varlen, B == 1); state rows are B or S       |
| C      | checkpoint interval: one state is kept every C tokens          |
| N      | number of blocks of C tokens, ceil(T / C); T is padded to N·C  |
| a_t    | key-side log decay [H, K] (or [H, 1] for a per-head decay)     |
| b_t    | value-side log decay [H, V]                                    |
| s      | the softmax scale                                              |

Forward, for each token in processing order (reversed when `reverse`):

    h⁻_t = initial_state[seq_t] if token t opens its sequence, else h_{t-1}
    d_t  = exp(a_t)[:, None] ⊙ h⁻_t ⊙ exp(b_t)[None, :]        the decayed state  [K, V]
    h_t  = d_t + k_t v_tᵀ
    o_t  = s · q_tᵀ h_t
    final[seq_t] = h_t if token t closes its sequence

Backward, with G_t = ∂L/∂h_t (the total cotangent of state t) and P_t = ∂L/∂h⁻_t:

    G_t  = s · q_t do_tᵀ + [t closes seq_t] · dfinal[seq_t] + (P_{t+1}, or 0 if t+1 opens a sequence)
    P_t  = exp(a_t)[:, None] ⊙ G_t ⊙ exp(b_t)[None, :]; if t opens seq_t, d initial_state[seq_t] += P_t
    dq_t = s · h_t do_t          dk_t = G_t v_t          dv_t = G_tᵀ k_t
    da_t[k] = Σ_v G_t[k, v] d_t[k, v]                    db_t[v] = Σ_k G_t[k, v] d_t[k, v]

The gate gradients use the direct form (∂h_t/∂a_t[k] = d_t[k, :]), not the reverse-cumsum
identity of `docs/design.md` §3 (gate gradients): the backward recomputes d_t anyway, so the direct form costs one
product and two sums per token and never divides by or subtracts large decayed terms.
Empty sequences pass their initial state straight to the final state, and its cotangent back.

Memory: the forward keeps the state before each block of C tokens (N·B·H·K·V); the backward
walks the blocks last to first, re-runs each block forward from its checkpoint to recover
the C states h⁻_t ([C, B, H, K, V], one block at a time), then runs the reverse recurrence
over the block. Residuals are the inputs plus the checkpoints: O(B·T·H·(K+V) + B·H·N·K·V).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._core.matmul_precision import matmul_precision, traced_precision
from .._core.problem import Problem
from .._core.registry import ALL_GATES, FLOAT_DTYPES, Support
from .._core.varlen import segments

SUPPORT = Support(dtypes=FLOAT_DTYPES, gates=ALL_GATES, varlen=True)
DEFAULT_CHECKPOINT_EVERY = 64


class Tokens(NamedTuple):
    """Per-token inputs, time-major and blocked: [N, C, B, H, ·]; absent decays are None."""

    query: Float[Array, "N C B H K"]
    key: Float[Array, "N C B H K"]
    value: Float[Array, "N C B H V"]
    key_side: Float[Array, "N C B H K"] | Float[Array, "N C B H 1"] | None
    value_side: Float[Array, "N C B H V"] | None


class Boundaries(NamedTuple):
    """Packed-sequence membership per token, blocked [N, C] (varlen only).

    Padding tokens belong to sequence 0 and neither open nor close it.
    """

    seq_id: Int[Array, "N C"]
    starts: Bool[Array, "N C"]
    ends: Bool[Array, "N C"]


# --------------------------------------------------------------------------- per-token math


def _decay(x: Array, a_t: Array | None, b_t: Array | None) -> Array:
    """exp(a_t)[:, None] ⊙ x ⊙ exp(b_t)[None, :] over [B, H, K, V]; absent decays are 1."""
    if a_t is not None:
        x = jnp.exp(a_t)[..., None] * x
    if b_t is not None:
        x = x * jnp.exp(b_t)[..., None, :]
    return x


def _outer(k_t: Array, v_t: Array) -> Float[Array, "B H K V"]:
    return k_t[..., :, None] * v_t[..., None, :]


def _as_state(token, dtype) -> Tokens:
    """A token's inputs in the state dtype."""
    return jax.tree.map(lambda x: x.astype(dtype), token)


def _enter(h, init, boundary):
    """h⁻_t: the carried state, or the sequence's initial state where token t opens one."""
    if boundary is None:
        return h
    seq, start, _ = boundary
    return jnp.where(start, init[seq][None], h)  # [1, H, K, V]


def _record_final(finals, h_t, boundary):
    """final[seq_t] = h_t where token t closes its sequence (varlen only)."""
    if boundary is None:
        return finals
    seq, _, end = boundary
    return finals.at[seq].set(jnp.where(end, h_t[0], finals[seq]))


# --------------------------------------------------------------------------- forward


def _forward_block(scale, init, carry, block):
    """Run one block of tokens: the new (h, finals), and (o [C, B, H, V], h before the block)."""
    tokens, boundaries = block
    state_dtype = init.dtype

    def step(carry, token):
        h, finals = carry
        x, boundary = token
        q_t, k_t, v_t, a_t, b_t = _as_state(x, state_dtype)
        h_t = _decay(_enter(h, init, boundary), a_t, b_t) + _outer(k_t, v_t)
        o_t = scale * jnp.einsum("bhk,bhkv->bhv", q_t, h_t)
        return (h_t, _record_final(finals, h_t, boundary)), o_t.astype(x.query.dtype)

    h_before = carry[0]
    carry, o = jax.lax.scan(step, carry, (tokens, boundaries))
    return carry, (o, h_before)


def _forward(scale, tokens: Tokens, init, boundaries: Boundaries | None):
    """(o [N, C, B, H, V], finals [R, H, K, V], checkpoints [N, B, H, K, V])."""
    if boundaries is None:
        carry = (init, None)  # dense: row b starts from init[b]
    else:
        h = jnp.zeros((1,) + init.shape[1:], init.dtype)
        carry = (h, init)  # finals start as init: empty sequences keep it
    block = functools.partial(_forward_block, scale, init)
    (h, finals), (o, checkpoints) = jax.lax.scan(block, carry, (tokens, boundaries))
    return o, (h if boundaries is None else finals), checkpoints


# --------------------------------------------------------------------------- backward


def _states_entering(init, h_before, block) -> Float[Array, "C B H K V"]:
    """Re-run one block from its checkpoint; the states h⁻_t each token decays."""
    tokens, boundaries = block

    def step(h, token):
        x, boundary = token
        _, k_t, v_t, a_t, b_t = _as_state(x, init.dtype)
        h_entering = _enter(h, init, boundary)
        return _decay(h_entering, a_t, b_t) + _outer(k_t, v_t), h_entering

    _, entering = jax.lax.scan(step, h_before, (tokens, boundaries))
    return entering


def _backward_token(scale, dfinal, carry, token):
    """One token of the reverse recurrence: G_t from P_{t+1}; returns P_t and the token's gradients."""
    P, dinit = carry
    x, boundary, h_entering, do_t = token
    q_t, k_t, v_t, a_t, b_t = _as_state(x, P.dtype)
    do_t = do_t.astype(P.dtype)
    G = P + scale * _outer(q_t, do_t)
    if boundary is not None:
        seq, start, end = boundary
        G = G + jnp.where(end, dfinal[seq], 0)[None]
    decayed = _decay(h_entering, a_t, b_t)  # d_t
    h_t = decayed + _outer(k_t, v_t)
    G_decayed = G * decayed
    grads = Tokens(
        query=(scale * jnp.einsum("bhkv,bhv->bhk", h_t, do_t)).astype(x.query.dtype),
        key=jnp.einsum("bhkv,bhv->bhk", G, v_t).astype(x.key.dtype),
        value=jnp.einsum("bhkv,bhk->bhv", G, k_t).astype(x.value.dtype),
        key_side=None if a_t is None else _sum_to(G_decayed.sum(-1), a_t).astype(a_t.dtype),
        value_side=None if b_t is None else G_decayed.sum(-2).astype(b_t.dtype),
    )
    P = _decay(G, a_t, b_t)
    if boundary is not None:
        dinit = dinit.at[seq].add(jnp.where(start, P[0], 0))
        P = jnp.where(start, 0, P)
    return (P, dinit), grads


def _sum_to(da: Float[Array, "B H K"], a_t: Array) -> Array:
    """da summed over K when the key-side decay is per head ([B, H, 1])."""
    return da.sum(-1, keepdims=True) if a_t.shape[-1] == 1 else da


def _backward_block(scale, init, dfinal, carry, block):
    """Gradients of one block, last token first, from the block's recomputed states."""
    tokens, boundaries, h_before, do = block
    entering = _states_entering(init, h_before, (tokens, boundaries))
    step = functools.partial(_backward_token, scale, dfinal)
    return jax.lax.scan(step, carry, (tokens, boundaries, entering, do), reverse=True)


def _backward(scale, residuals, cotangents):
    tokens, init, boundaries, checkpoints = residuals
    do, dfinal = cotangents
    dfinal = dfinal.astype(init.dtype)
    if boundaries is None:
        carry = (dfinal, None)  # dense: the final state's cotangent enters at the last token
    else:
        carry = (jnp.zeros((1,) + init.shape[1:], init.dtype), jnp.zeros_like(init))
    block = functools.partial(_backward_block, scale, init, dfinal)
    (P, dinit), grads = jax.lax.scan(block, carry, (tokens, boundaries, checkpoints, do), reverse=True)
    if boundaries is None:
        dinit = P
    else:
        dinit = dinit + jnp.where(_is_empty(boundaries, init.shape[0])[:, None, None, None], dfinal, 0)
    return grads, dinit, None


def _is_empty(boundaries: Boundaries, num_seqs: int) -> Bool[Array, " S"]:
    """Sequences that own no token (their final state is their initial state)."""
    starts = boundaries.starts.ravel().astype(jnp.int32)
    return jnp.zeros(num_seqs, jnp.int32).at[boundaries.seq_id.ravel()].add(starts) == 0


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _recurrence(scale: float, precision: str | None, tokens: Tokens, init, boundaries: Boundaries | None):
    """(o [N, C, B, H, V] in the query dtype, final state [R, H, K, V] in the state dtype);
    `precision` is the forward's matmul precision, which the backward re-enters."""
    return _recurrence_fwd(scale, precision, tokens, init, boundaries)[0]


def _recurrence_fwd(scale, precision, tokens, init, boundaries):
    o, finals, checkpoints = _forward(scale, tokens, init, boundaries)
    return (o, finals), (tokens, init, boundaries, checkpoints)


def _recurrence_bwd(scale, precision, residuals, cotangents):
    with matmul_precision(precision):
        return _backward(scale, residuals, cotangents)


_recurrence.defvjp(_recurrence_fwd, _recurrence_bwd)


# --------------------------------------------------------------------------- layout


def _to_blocks(x: Array | None, checkpoint_every: int, reverse: bool) -> Array | None:
    """[B, T, ...] in token order → [N, C, B, ...] in processing order.

    The padding is zeros: k = v = 0 and log decays 0 make a token that leaves the state as it is.
    """
    if x is None:
        return None
    x = x[:, ::-1] if reverse else x
    x = jnp.moveaxis(x, 1, 0)  # [T, B, ...]
    T = x.shape[0]
    padded = -(-T // checkpoint_every) * checkpoint_every
    x = jnp.pad(x, [(0, padded - T)] + [(0, 0)] * (x.ndim - 1))
    return x.reshape((padded // checkpoint_every, checkpoint_every) + x.shape[1:])


def _from_blocks(x: Float[Array, "N C B ..."], num_tokens: int, reverse: bool) -> Float[Array, "B T ..."]:
    x = x.reshape((-1,) + x.shape[2:])[:num_tokens]
    x = jnp.moveaxis(x, 0, 1)
    return x[:, ::-1] if reverse else x


def _boundaries(cu_seqlens, num_tokens: int, checkpoint_every: int, reverse: bool) -> Boundaries:
    seg = segments(cu_seqlens, num_tokens)
    seg = seg.reversed() if reverse else seg
    return Boundaries(*(_to_blocks(x[None], checkpoint_every, False)[..., 0] for x in seg))


def scan_recurrent(
    problem: Problem, *, scale: float, reverse: bool, checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY
):
    """Token-by-token recurrence over the canonical `problem` with a checkpointed backward.

    **Arguments:**
    - `problem`: the canonical inputs (`recurrax.Problem`).
    - `scale`: the softmax scale s.
    - `reverse`: process each row (each packed sequence) from its last token to its first.
    - `checkpoint_every`: C, the backward keeps one state every C tokens (capped at T).

    **Returns:** `(output [B, T, H, V]` in the query dtype, `final_state [R, H, K, V]` in the
    state dtype`)`.
    """
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be a positive integer, got {checkpoint_every}")
    T = problem.query.shape[1]
    C = min(checkpoint_every, T)
    blocks = lambda x: _to_blocks(x, C, reverse)  # noqa: E731
    tokens = Tokens(
        query=blocks(problem.query),
        key=blocks(problem.key),
        value=blocks(problem.value),
        key_side=blocks(problem.key_side_decay()),
        value_side=blocks(problem.log_decay_value),
    )
    boundaries = None if problem.cu_seqlens is None else _boundaries(problem.cu_seqlens, T, C, reverse)
    o, final_state = _recurrence(float(scale), traced_precision(), tokens, problem.initial_state, boundaries)
    return _from_blocks(o, T, reverse), final_state
