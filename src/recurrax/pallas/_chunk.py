"""The Pallas chunk algorithm as one differentiable function of the canonical `Problem`.

| symbol | meaning                                                              |
|--------|----------------------------------------------------------------------|
| B, H   | batch rows, heads                                                    |
| T, Tp  | tokens, tokens padded to a multiple of the chunk C                   |
| K, V   | key/query and value head dimensions                                  |
| g      | the key-side log decay the kernels see: [B, Tp, H] or [B, Tp, H, K]  |
| B_t    | global cumulative log decay Σ_{s ≤ t} g_s (never materialised)       |

Around the kernels (`_chunk_fwd`, `_chunk_bwd`), plain JAX does what autodiff handles
well: folding the per-head decay into a per-channel one when both are present, reversing
the token axis for `reverse=True`, zero-padding T to a multiple of C (padded tokens have
q = k = v = 0 and g = 0, so they leave the state unchanged), and casting.

**Gate gradients without stored states.** Write h_t = e^{B_t} ⊙ (h_{-1} + Σ_{j ≤ t}
(k_j ⊙ e^{−B_j}) v_jᵀ) and o_t = scale · (q_t ⊙ e^{B_t})ᵀ (…). Treating every B_t as a free
variable, B_t enters only through q̃_t = q_t ⊙ e^{B_t}, k̃_t = k_t ⊙ e^{−B_t} and, for the
last token, through the final state h_T = e^{B_T} ⊙ (…). Since ∂L/∂q_t = e^{B_t} ⊙ ∂L/∂q̃_t
and ∂L/∂k_t = e^{−B_t} ⊙ ∂L/∂k̃_t:

    dB_t := ∂L/∂B_t = q_t ⊙ dq_t − k_t ⊙ dk_t  (+ Σ_V h_T ⊙ dh_T on the last token)   [K]

and because B_s = Σ_{t ≤ s} g_t, dg_t = Σ_{s ≥ t} dB_s, a reverse cumulative sum.

That sum, taken over the whole sequence, adds O(1) terms that cancel to a much smaller
result, so the rounding of dq and dk (bf16 matmul operands) grows with T. It is cut at
chunk boundaries instead: for t in chunk n, whose last token is m − 1,

    dg_t = Σ_{t ≤ s < m} dB_s  +  Σ_V S_m ⊙ dS_m

because Σ_{s ≥ m} dB_s is the derivative of shifting B_s by the same δ for every s ≥ m,
which multiplies every pair (j < m ≤ i) and the initial state's contribution after m by
e^δ, i.e. scales the state S_m leaving chunk n (as later tokens see it) by e^δ; its
derivative is Σ_V S_m ⊙ dS_m with dS_m the gradient the backward kernel carries there
(for the last chunk: h_T ⊙ dh_T, the final-state term). The kernel writes that
"boundary" term per chunk; only sums of at most C terms are left to cancel. A per-head
decay sums the K channels. Everything else (the gradient of g_gamma, of grouped heads,
of the flip and the padding) is JAX's autodiff of the normalisation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .. import varlen
from .._inputs import Problem
from ._chunk_bwd import chunk_backward
from ._chunk_fwd import chunk_forward
from ._common import F32, BlockSizes, Gate, Static, Target, chunk_local_cumsum


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunk(static: Static, q, k, v, g, h0, meta, empty):
    """(o [B, Tp, H, V], h_T [R, H, K, V]) for padded, forward-ordered inputs.

    `meta` ([3, N] int32) and `empty` ([R] bool) describe packed input in the chunk-aligned
    layout (None when dense): sequences without tokens keep their initial state.
    """
    (o, h_T), _ = _chunk_fwd(static, q, k, v, g, h0, meta, empty)
    return o, h_T


def _chunk_fwd(static: Static, q, k, v, g, h0, meta, empty):
    a = None if g is None else chunk_local_cumsum(g, static.blocks.chunk)
    o, h_T = chunk_forward(q, k, v, a, h0, meta, static=static)
    if empty is not None:
        h_T = jnp.where(empty[:, None, None, None], h0, h_T)
    return (o, h_T), (q, k, v, g, h0, h_T, meta, empty)


def _chunk_bwd(static: Static, residuals, cotangents):
    q, k, v, g, h0, h_T, meta, empty = residuals
    do, dh_T = cotangents
    a = None if g is None else chunk_local_cumsum(g, static.blocks.chunk)
    _, states = chunk_forward(q, k, v, a, h0, meta, static=static, emit_output=False, emit_states=True)
    dh_T = dh_T.astype(F32)
    dq, dk, dv, dh0, boundary = chunk_backward(q, k, v, a, do.astype(q.dtype), states, h_T, dh_T, meta, static=static)
    if empty is not None:
        dh0 = jnp.where(empty[:, None, None, None], dh_T, dh0)
    dg = None if g is None else gate_gradient(q, k, dq, dk, boundary, static).astype(g.dtype)
    grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dg, dh0.astype(h0.dtype))
    return grads + (None, None)


_chunk.defvjp(_chunk_fwd, _chunk_bwd)


def gate_gradient(q, k, dq, dk, boundary, static: Static):
    """dg by the chunk-local reverse-cumsum identity (module docstring).

    **Arguments:** `q`, `k` [B, Tp, H, K]; `dq`, `dk` their float32 gradients; `boundary`
    [B, H, N, K] = Σ_V S_{n+1} ⊙ dS_{n+1} per chunk. **Returns** [B, Tp, H] (per-head
    decay) or [B, Tp, H, K] (per channel), float32.
    """
    B, Tp, H, K = q.shape
    C = static.blocks.chunk
    dB = q.astype(F32) * dq - k.astype(F32) * dk  # [B, Tp, H, K]
    within = lax.cumsum(dB.reshape(B, Tp // C, C, H, K), axis=2, reverse=True)  # Σ_{t ≤ s < chunk end}
    dg = (within + jnp.transpose(boundary, (0, 2, 1, 3))[:, :, None]).reshape(B, Tp, H, K)
    return dg.sum(-1) if static.gate is Gate.HEAD else dg


def _key_side_gate(problem: Problem) -> tuple[Gate, jax.Array | None]:
    head, key = problem.log_decay_head, problem.log_decay_key
    if key is not None:
        return Gate.KEY, key if head is None else key + head[..., None]
    if head is not None:
        return Gate.HEAD, head
    return Gate.NONE, None


def _dense(static: Static, q, k, v, g, h0):
    """[B, T, ...] rows: pad T to a multiple of C (padding leaves the state unchanged)."""
    T, C = q.shape[1], static.blocks.chunk
    Tp = -(-T // C) * C
    o, h_T = _chunk(static, *(varlen.pad_tokens(x, Tp) for x in (q, k, v, g)), h0, None, None)
    return o[:, :T], h_T


def _packed(static: Static, q, k, v, g, h0, cu_seqlens):
    """[1, N, ...] packed sequences: the chunk-aligned layout of `recurrax.varlen` (static
    size for a traced `cu_seqlens`), with a per-chunk (sequence, first, last) table."""
    layout = varlen.chunk_layout(cu_seqlens, q.shape[1], static.blocks.chunk)
    to_slots = lambda x: None if x is None else varlen.to_chunk_layout(x[0], layout)[None]  # noqa: E731
    meta = jnp.stack([layout.chunk_seq, layout.chunk_first, layout.chunk_last]).astype(jnp.int32)
    o, h_T = _chunk(static, *(to_slots(x) for x in (q, k, v, g)), h0, meta, layout.seq_empty)
    return varlen.from_chunk_layout(o[0], layout)[None], h_T


def pallas_chunk_recurrent(
    problem: Problem,
    *,
    scale: float,
    reverse: bool,
    chunk_size: int = 64,
    sub_size: int = 16,
    block_v: int = 64,
    num_warps: int = 8,
    num_stages: int = 2,
    interpret: bool = False,
    target: str = "triton",
):
    """The chunk algorithm as Pallas kernels; `(output, final_state)` as DESIGN §1.

    **Arguments:**
    - `problem`: the canonical form, without value-side decay; packed input (`cu_seqlens`)
      runs in the chunk-aligned layout of `recurrax.varlen` (every sequence starts a chunk).
    - `scale`, `reverse`: static configuration of the call.
    - `chunk_size`, `sub_size`, `block_v`, `num_warps`, `num_stages`: see `BlockSizes`.
    - `interpret`: run the kernels in Pallas interpret mode (any backend; for tests).
    - `target`: `"triton"`, the lowering when not interpreting (the only one so far).
    """
    if problem.log_decay_value is not None:
        raise ValueError("the Pallas chunk kernels do not support value-side decay (gv)")
    blocks = BlockSizes(chunk_size, sub_size, block_v, num_warps, num_stages)
    gate, g = _key_side_gate(problem)
    static = Static(float(scale), gate, blocks, Target.INTERPRET if interpret else Target(target))
    q, k, v, h0 = problem.query, problem.key, problem.value, problem.initial_state.astype(F32)
    g = None if g is None else g.astype(F32)
    T, cu_seqlens = q.shape[1], problem.cu_seqlens
    if reverse:  # the same recurrence on the flipped token axis (and sequence order)
        q, k, v, g = (None if x is None else jnp.flip(x, axis=1) for x in (q, k, v, g))
        if cu_seqlens is not None:
            cu_seqlens, h0 = T - cu_seqlens[::-1], h0[::-1]
    if cu_seqlens is None:
        o, h_T = _dense(static, q, k, v, g, h0)
    else:
        o, h_T = _packed(static, q, k, v, g, h0, cu_seqlens)
        h_T = h_T[::-1] if reverse else h_T
    o = jnp.flip(o, axis=1) if reverse else o
    return o.astype(problem.query.dtype), h_T.astype(problem.initial_state.dtype)
