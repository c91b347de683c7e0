"""The chunk algorithm's two passes: a scan of the state over chunks, and its adjoint.

| symbol | meaning                                                                        |
|--------|--------------------------------------------------------------------------------|
| B, T   | batch rows, tokens per row (a multiple of C here)                             |
| H      | heads;  K, V: key and value head dimensions                                    |
| C, N   | chunk size, chunks per row (N = T / C)                                         |
| R      | state rows: B, or S sequences when packed (then B = 1)                         |
| S_n    | state entering chunk n (processing order);  E_n: state leaving it             |
| A, Bv  | chunk-local cumulative key-side / value-side log decays (`_chunk_intra`)       |

Forward, per chunk (q already carries the softmax scale; t, s index the chunk's tokens):

    o_t  = Σ_{s≤t} ⟨q_t, k_s e^{A_t−A_s}⟩ v_s e^{Bv_t−Bv_s}  +  e^{Bv_t} ⊙ ((q_t ⊙ e^{A_t})ᵀ S_n)
    E_n  = e^{A_C} ⊙ S_n ⊙ e^{Bv_C}  +  Σ_s (k_s e^{A_C−A_s}) (v_s e^{Bv_C−Bv_s})ᵀ

Only the state crosses chunks, so the loop carries one [B, H, K, V] state and keeps S_n of
every chunk as the residual (O(B·H·N·K·V) memory); everything else is recomputed.

Backward, per chunk in reverse processing order, with Ē = ∂L/∂E_n carried in:

    dP   = scores_Bv(do, v)                          (∂L/∂P where P = scores_A(q, k))
    dq   = apply_A(dP, k)    + e^{A_t} ⊙ (S_n (do_t ⊙ e^{Bv_t}))
    dk   = apply_t_A(dP, q)  + e^{A_C−A_s} ⊙ (Ē (v_s ⊙ e^{Bv_C−Bv_s}))
    dv   = apply_t_Bv(P, do) + e^{Bv_C−Bv_s} ⊙ (Ēᵀ (k_s ⊙ e^{A_C−A_s}))
    ∂L/∂S_n = e^{A_C} ⊙ Ē ⊙ e^{Bv_C} + Σ_t (q_t e^{A_t}) (do_t e^{Bv_t})ᵀ   (carried on)

Gate gradients need no states (DESIGN §2). With G_t = ∂L/∂h_t, ∂L/∂a_t = Σ_v G_t ⊙ (h_t − k_t v_tᵀ);
unrolling G_t = q_t do_tᵀ + e^{a_{t+1}} G_{t+1} e^{b_{t+1}} gives

    ∂L/∂a_t = Σ_{u ≥ t} (q_u ⊙ dq_u − k_u ⊙ dk_u)  +  Σ_v (∂L/∂h_final ⊙ h_final)
    ∂L/∂b_t = Σ_{u ≥ t} (o_u ⊙ do_u − v_u ⊙ dv_u)  +  Σ_k (∂L/∂h_final ⊙ h_final)

sums over the rest of the token's own sequence (the recursion restarts where a sequence
ends, and the initial state's term is already inside q ⊙ dq). The suffix sum is a
within-chunk reverse cumsum plus a carry from later chunks, reset to the final-state term
at each sequence's last chunk. A per-head decay is the sum of its side's channels.

Packed sequences (`ChunkMeta`): the state is reset to the sequence's initial state at its
first chunk in processing order (`load`), the final state is taken after its last (`emit`),
and the backward resets its carries at the same places.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from ._chunk_intra import ChunkDecay, dot


class Static(NamedTuple):
    """Static configuration of one chunked call."""

    chunk_size: int
    block_size: int
    scale: float
    reverse: bool


class Gates(NamedTuple):
    """Per-token log decays of the canonical problem, [B, T, H] / [B, T, H, K] / [B, T, H, V]."""

    head: Array | None
    key: Array | None
    value: Array | None


class ChunkMeta(NamedTuple):
    """Packed sequences in the chunk-aligned layout, in storage order of the chunks.

    **Arguments:**
    - `seq`: [N] the sequence owning each chunk.
    - `load`: [N] the chunk its sequence is processed from first (state reset there).
    - `emit`: [N] the chunk its sequence is processed from last (final state taken there).
    - `empty`: [R] sequences without tokens (their final state is their initial state).
    """

    seq: Int[Array, " N"]
    load: Bool[Array, " N"]
    emit: Bool[Array, " N"]
    empty: Bool[Array, " R"]


# ----------------------------------------------------------------------------- one chunk


def side_decays(gates: Gates, leaf: int, size: int) -> tuple[ChunkDecay, ChunkDecay, str | None]:
    """The key-side and value-side decays of a chunk, and the side a per-head decay joined.

    A per-head decay multiplies the whole state, so it may ride on either side: it joins
    the key channels if there are any, else the value channels, else it stays a scalar.
    """
    head, key, value = gates
    if head is None:
        head_on = None
    elif key is not None:
        key, head_on = key + head[..., None], "key"
    elif value is not None:
        value, head_on = value + head[..., None], "value"
    else:
        head_on = "head"
    key_side = ChunkDecay.build(head if head_on == "head" else key, key is not None, leaf, size)
    value_side = ChunkDecay.build(value, True, leaf, size)
    return key_side, value_side, head_on


def forward_step(q, k, v, key: ChunkDecay, value: ChunkDecay, state):
    """(o [..., C, V], E [..., K, V]) of one chunk entered with `state`; q carries the scale."""
    scores = key.scores(q, k)
    inter = dot("...tk,...kv->...tv", key.from_start(q), state)
    out = value.apply(scores, v) + value.from_start(inter)
    update = dot("...sk,...sv->...kv", key.to_end(k), value.to_end(v))
    return out, value.decay_columns(key.decay_rows(state)) + update


def backward_step(q, k, v, do, key: ChunkDecay, value: ChunkDecay, state, d_end, need_output: bool):
    """Gradients of one chunk: (dq, dk, dv, ∂L/∂S_n, o or None). q carries the scale and dq
    is with respect to that scaled q."""
    scores = key.scores(q, k)
    d_scores = value.scores(do, v)
    q_start, do_start = key.from_start(q), value.from_start(do)
    k_end, v_end = key.to_end(k), value.to_end(v)
    dq = key.apply(d_scores, k) + key.from_start(dot("...tv,...kv->...tk", do_start, state))
    dk = key.apply_t(d_scores, q) + key.to_end(dot("...sv,...kv->...sk", v_end, d_end))
    dv = value.apply_t(scores, do) + value.to_end(dot("...sk,...kv->...sv", k_end, d_end))
    d_start = value.decay_columns(key.decay_rows(d_end)) + dot("...tk,...tv->...kv", q_start, do_start)
    out = None
    if need_output:
        out = value.apply(scores, v) + value.from_start(dot("...tk,...kv->...tv", q_start, state))
    return dq, dk, dv, d_start, out


def _suffix_sums(per_token: Array, carry: Array, channel: bool) -> tuple[Array, Array]:
    """Σ over this and later tokens: within-chunk reverse cumsum plus the carry from later
    chunks; returns (gradient per token, carry for earlier chunks)."""
    axis = -2 if channel else -1
    within = lax.cumsum(per_token, axis=per_token.ndim + axis, reverse=True)
    expanded = carry[..., None, :] if channel else carry[..., None]
    return within + expanded, carry + jnp.sum(per_token, axis=axis)


# ----------------------------------------------------------------------------- chunk I/O


def _load(x: Array | None, index, size: int, reverse: bool, dtype) -> Array | None:
    """Chunk `index` of x [B, T, H, ...] as [B, H, C, ...] in processing order."""
    if x is None:
        return None
    piece = jnp.moveaxis(lax.dynamic_slice_in_dim(x, index * size, size, axis=1), 1, 2)
    return (jnp.flip(piece, axis=2) if reverse else piece).astype(dtype)


def _store(buffer: Array | None, piece: Array | None, index, size: int, reverse: bool) -> Array | None:
    """Write a [B, H, C, ...] processing-order chunk back into buffer [B, T, H, ...]."""
    if buffer is None:
        return None
    piece = jnp.flip(piece, axis=2) if reverse else piece
    piece = jnp.moveaxis(piece, 2, 1).astype(buffer.dtype)
    return lax.dynamic_update_slice_in_dim(buffer, piece, index * size, axis=1)


def _storage_index(step, num_chunks: int, reverse: bool):
    return num_chunks - 1 - step if reverse else step


def _zeros_like(x: Array | None) -> Array | None:
    return None if x is None else jnp.zeros_like(x)


# ----------------------------------------------------------------------------- passes


def forward(static: Static, q, k, v, gates: Gates, init, meta: ChunkMeta | None):
    """(output [B, T, H, V], final states [R, H, K, V], chunk-start states [N, B, H, K, V])."""
    B, T, H, _ = q.shape
    C = static.chunk_size
    N = T // C
    dtype = init.dtype
    load = functools.partial(_load, size=C, reverse=static.reverse, dtype=dtype)

    def body(carry, step):
        state, out, finals = carry
        index = _storage_index(step, N, static.reverse)
        if meta is not None:
            seq = meta.seq[index]
            state = jnp.where(meta.load[index], init[seq][None], state)
        chunk_gates = Gates(*(load(g, index) for g in gates))
        key, value, _ = side_decays(chunk_gates, static.block_size, C)
        qc = load(q, index) * static.scale
        o, end = forward_step(qc, load(k, index), load(v, index), key, value, state)
        out = _store(out, o, index, C, static.reverse)
        if meta is not None:
            finals = finals.at[seq].set(jnp.where(meta.emit[index], end[0], finals[seq]))
        return (end, out, finals), state

    state0 = init if meta is None else jnp.zeros((1, *init.shape[1:]), dtype)
    out0 = jnp.zeros((*v.shape[:-1], v.shape[-1]), q.dtype)
    (last, out, finals), starts = lax.scan(body, (state0, out0, None if meta is None else init), jnp.arange(N))
    return out, (last if meta is None else finals), starts


def _final_terms(d_final: Array, final: Array, key: str, value: bool):
    """Σ_v / Σ_k of ∂L/∂h_final ⊙ h_final: the suffix carries of the last chunk."""
    product = d_final * final  # [R, H, K, V]
    key_term = {"channel": product.sum(-1), "head": product.sum((-2, -1)), "none": None}[key]
    return key_term, (product.sum(-2) if value else None)


def backward(static: Static, residuals, d_out, d_final):
    """Gradients (dq, dk, dv, Gates of gradients, d_init) of the chunked pass."""
    q, k, v, gates, init, meta, starts, finals = residuals
    T = q.shape[1]
    C = static.chunk_size
    N = T // C
    dtype = init.dtype
    load = functools.partial(_load, size=C, reverse=static.reverse, dtype=dtype)
    key_kind = "channel" if gates.key is not None else ("head" if gates.head is not None and gates.value is None else "none")
    has_value = gates.value is not None
    key_term, value_term = _final_terms(d_final, finals, key_kind, has_value)

    def body(carry, xs):
        step, state = xs
        d_end, key_carry, value_carry, buffers, d_init = carry
        index = _storage_index(step, N, static.reverse)
        if meta is not None:
            seq, emit = meta.seq[index], meta.emit[index]
            d_end = jnp.where(emit, d_final[seq][None], d_end)
            key_carry = None if key_carry is None else jnp.where(emit, key_term[seq][None], key_carry)
            value_carry = None if value_carry is None else jnp.where(emit, value_term[seq][None], value_carry)
        chunk_gates = Gates(*(load(g, index) for g in gates))
        key, value, head_on = side_decays(chunk_gates, static.block_size, C)
        qc, kc, vc, doc = load(q, index) * static.scale, load(k, index), load(v, index), load(d_out, index)
        dq, dk, dv, d_start, out = backward_step(qc, kc, vc, doc, key, value, state, d_end, has_value)

        d_head = d_key = d_value = None
        if key_carry is not None:
            per_token = qc * dq - kc * dk
            channel = key.kind == "channel"
            d_a, key_carry = _suffix_sums(per_token if channel else per_token.sum(-1), key_carry, channel)
            d_key = d_a if gates.key is not None else None
            d_head = d_a.sum(-1) if head_on == "key" else (d_a if head_on == "head" else None)
        if value_carry is not None:
            d_b, value_carry = _suffix_sums(out * doc - vc * dv, value_carry, True)
            d_value = d_b
            d_head = d_b.sum(-1) if head_on == "value" else d_head

        grads = (dq * static.scale, dk, dv, d_head, d_key, d_value)
        buffers = tuple(_store(b, g, index, C, static.reverse) for b, g in zip(buffers, grads))
        if meta is not None:
            loads = meta.load[index]
            d_init = d_init.at[seq].add(jnp.where(loads, d_start[0], 0))
            d_start = jnp.where(loads, 0, d_start)
        return (d_start, key_carry, value_carry, buffers, d_init), None

    buffers0 = tuple(_zeros_like(x) for x in (q, k, v, *gates))
    if meta is None:
        carry0 = (d_final, key_term, value_term, buffers0, None)
    else:
        zero_row = lambda x: None if x is None else jnp.zeros((1, *x.shape[1:]), x.dtype)  # noqa: E731
        carry0 = (zero_row(d_final), zero_row(key_term), zero_row(value_term), buffers0, jnp.zeros_like(init))
    (d_start, _, _, buffers, d_init), _ = lax.scan(body, carry0, (jnp.arange(N), starts), reverse=True)
    if meta is None:
        d_init = d_start
    else:
        d_init = d_init + jnp.where(meta.empty[:, None, None, None], d_final, 0)
    dq, dk, dv, d_head, d_key, d_value = buffers
    return dq, dk, dv, Gates(d_head, d_key, d_value), d_init.astype(init.dtype)


# ----------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunked(
    static: Static,
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    gates: Gates,
    init: Float[Array, "R H K V"],
    meta: ChunkMeta | None,
):
    """(output [B, T, H, V], final state [R, H, K, V]) with T a multiple of the chunk size."""
    out, finals, _ = forward(static, q, k, v, gates, init, meta)
    return out, finals


def _chunked_fwd(static, q, k, v, gates, init, meta):
    out, finals, starts = forward(static, q, k, v, gates, init, meta)
    return (out, finals), (q, k, v, gates, init, meta, starts, finals)


def _chunked_bwd(static, residuals, cotangents):
    d_out, d_final = cotangents
    dq, dk, dv, d_gates, d_init = backward(static, residuals, d_out, d_final)
    meta = residuals[5]
    d_meta = None if meta is None else jax.tree.map(lambda _: None, meta)
    return dq, dk, dv, d_gates, d_init, d_meta


chunked.defvjp(_chunked_fwd, _chunked_bwd)
