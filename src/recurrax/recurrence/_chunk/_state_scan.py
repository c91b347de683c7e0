"""The chunk algorithm's two passes: a scan of the state over chunks, and its adjoint.

| symbol | meaning                                                                        |
|--------|--------------------------------------------------------------------------------|
| B, T   | batch rows, tokens per row (a multiple of P·C here)                            |
| H      | heads;  K, V: key and value head dimensions                                    |
| C      | chunk size: the state is materialised once per chunk                          |
| P      | chunks per scan step: one step handles P·C tokens                              |
| R      | state rows: B, or S sequences when packed (then B = 1)                         |
| S_n    | state entering chunk n (processing order);  E_n: state leaving it             |
| A, Bv  | chunk-local cumulative key-side / value-side log decays (`_intra`)       |

Forward, per chunk (q already carries the softmax scale; t, s index the chunk's tokens):

    o_t  = Σ_{s≤t} ⟨q_t, k_s e^{A_t−A_s}⟩ v_s e^{Bv_t−Bv_s}  +  e^{Bv_t} ⊙ ((q_t ⊙ e^{A_t})ᵀ S_n)
    E_n  = e^{A_C} ⊙ S_n ⊙ e^{Bv_C}  +  U_n,      U_n = Σ_s (k_s e^{A_C−A_s}) (v_s e^{Bv_C−Bv_s})ᵀ

Only the state crosses chunks. A `lax.scan` step takes P chunks: their intra-chunk products,
their U_n and their outputs are batched over P (no sequential dependence); only the cheap
elementwise recurrence S_{n+1} = decay_n ⊙ S_n + U_n is unrolled over the P chunks. The
residual is the state entering each chunk, O(B·H·(T/C)·K·V) (storing them is cheaper here
than recomputing the U_n products in the backward).

Backward, per chunk in reverse processing order, with Ē_n = ∂L/∂E_n:

    dP   = scores_Bv(do, v)                          (∂L/∂P where P = scores_A(q, k))
    dq   = apply_A(dP, k)    + e^{A_t} ⊙ (S_n (do_t ⊙ e^{Bv_t}))
    dk   = apply_t_A(dP, q)  + e^{A_C−A_s} ⊙ (Ē_n (v_s ⊙ e^{Bv_C−Bv_s}))
    dv   = apply_t_Bv(P, do) + e^{Bv_C−Bv_s} ⊙ (Ē_nᵀ (k_s ⊙ e^{A_C−A_s}))
    Ē_{n−1} = ∂L/∂S_n = e^{A_C} ⊙ Ē_n ⊙ e^{Bv_C} + W_n,   W_n = Σ_t (q_t e^{A_t}) (do_t e^{Bv_t})ᵀ

again with W_n batched and the Ē recurrence unrolled over a step's P chunks.

Gate gradients need no states (`docs/design.md` §3). With G_t = ∂L/∂h_t, ∂L/∂a_t = Σ_v G_t ⊙ (h_t − k_t v_tᵀ);
unrolling G_t = q_t do_tᵀ + e^{a_{t+1}} G_{t+1} e^{b_{t+1}} gives

    ∂L/∂a_t = Σ_{u ≥ t} (q_u ⊙ dq_u − k_u ⊙ dk_u)  +  Σ_v (∂L/∂h_final ⊙ h_final)
    ∂L/∂b_t = Σ_{u ≥ t} (o_u ⊙ do_u − v_u ⊙ dv_u)  +  Σ_k (∂L/∂h_final ⊙ h_final)

sums over the rest of the token's own sequence (the recursion restarts where a sequence
ends; the initial state's term is already inside q ⊙ dq). The suffix sum is a within-chunk
reverse cumsum plus a carry from later chunks, reset to the final-state term at each
sequence's last chunk. A per-head decay's gradient is the sum over its side's channels.

Packed sequences (`varlen.ChunkOwners`): the state is reset to the sequence's initial state
at its first chunk in processing order (`load`: its first chunk, or its last when
`reverse`), the final state is taken after its last in processing order (`emit`),
and the backward resets its carries at the same places.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from ..._core.finite import clean_gate, clean_tokens
from ..._core.intra import ChunkDecay, chunk_cumsum, dot
from ..._core.matmul_precision import matmul_precision
from ..._core.problem import Gate
from ..._core.varlen import ChunkOwners
from ...kernels._driver import vary_over, varying_axes


class ChunkCall(NamedTuple):
    """Static configuration of one chunked call: the tiling, the scale, the direction and the
    forward's matmul precision (which the backward re-enters)."""

    chunk_size: int
    leaf_size: int
    chunks_per_step: int
    scale: float
    reverse: bool
    precision: str | None = None


class LogDecays(NamedTuple):
    """Per-token log decays of the canonical problem, [B, T, H] / [B, T, H, K] / [B, T, H, V]."""

    head: Array | None
    key: Array | None
    value: Array | None


# ----------------------------------------------------------------------------- chunk math


def side_decays(gates: LogDecays, leaf: int, size: int) -> tuple[ChunkDecay, ChunkDecay, Gate | None]:
    """The key-side and value-side decays of chunks, and the side a per-head decay joined.

    A per-head decay multiplies the whole state, so it may ride on either side: it joins
    the key channels if there are any, else the value channels, else it stays a scalar.
    """
    head, key, value = gates
    if head is None:
        head_on = None
    elif key is not None:
        key, head_on = key + head[..., None], Gate.KEY
    elif value is not None:
        value, head_on = value + head[..., None], Gate.VALUE
    else:
        head_on = Gate.HEAD
    key_form = Gate.KEY if key is not None else Gate.HEAD
    key_side = ChunkDecay.build(head if head_on is Gate.HEAD else key, key_form, leaf, size)
    value_side = ChunkDecay.build(value, Gate.VALUE, leaf, size)
    return key_side, value_side, head_on


def chunk_updates(k, v, key: ChunkDecay, value: ChunkDecay):
    """U_n = Σ_s (k_s e^{A_C−A_s}) (v_s e^{Bv_C−Bv_s})ᵀ for every chunk, [..., K, V]."""
    return dot("...sk,...sv->...kv", key.to_end(k), value.to_end(v))


def chunk_outputs(q, k, v, key: ChunkDecay, value: ChunkDecay, starts):
    """o [..., C, V] of chunks entered with states `starts` [..., K, V]."""
    inter = dot("...tk,...kv->...tv", key.from_start(q), starts)
    return value.apply(key.scores(q, k), v) + value.from_start(inter)


def chunk_gradients(q, k, v, do, key: ChunkDecay, value: ChunkDecay, starts, d_ends, need_output: bool):
    """(dq, dk, dv, o or None) of chunks entered with `starts` whose leaving states have
    adjoints `d_ends`; dq is with respect to the scaled q."""
    d_scores = value.scores(do, v)
    scores, dq, dk = key.triple(q, k, d_scores)  # P, apply_A(dP, k), apply_t_A(dP, q)
    k_end, v_end = key.to_end(k), value.to_end(v)
    dq = dq + key.from_start(dot("...tv,...kv->...tk", value.from_start(do), starts))
    dk = dk + key.to_end(dot("...sv,...kv->...sk", v_end, d_ends))
    dv = value.apply_t(scores, do) + value.to_end(dot("...sk,...kv->...sv", k_end, d_ends))
    out = None
    if need_output:
        out = value.apply(scores, v) + value.from_start(dot("...tk,...kv->...tv", key.from_start(q), starts))
    return dq, dk, dv, out


def _state_decay(key: ChunkDecay, value: ChunkDecay):
    """Per-chunk factor [..., P, K|1, V|1] of the state's decay over a chunk, or None."""
    factor = None
    if key.total is not None:
        factor = key.total[..., None, None] if key.form is Gate.HEAD else key.total[..., :, None]
    if value.total is not None:
        columns = value.total[..., None, :]
        factor = columns if factor is None else factor * columns
    return factor


def _decayed(state, factor, p: int):
    return state if factor is None else state * factor[:, :, p]


# ----------------------------------------------------------------------------- step I/O


def _load(x: Array | None, start, length: int, shape: tuple[int, int], reverse: bool, dtype, clean=clean_tokens):
    """Tokens [start, start + length) of x [B, T, H, ...] as [B, H, P, C, ...], processing order,
    cleaned (`_finite`: non-finite entries read as 0; `clean_gate` for log decays)."""
    if x is None:
        return None
    piece = jnp.moveaxis(lax.dynamic_slice_in_dim(x, start, length, axis=1), 1, 2)
    piece = jnp.flip(piece, axis=2) if reverse else piece
    return clean(piece.reshape(*piece.shape[:2], *shape, *piece.shape[3:]).astype(dtype))


def _store(buffer: Array | None, piece: Array | None, start, reverse: bool):
    """Write a [B, H, P, C, ...] processing-order piece back into buffer [B, T, H, ...]."""
    if buffer is None:
        return None
    piece = piece.reshape(*piece.shape[:2], -1, *piece.shape[4:])
    piece = jnp.flip(piece, axis=2) if reverse else piece
    piece = jnp.moveaxis(piece, 2, 1).astype(buffer.dtype)
    return lax.dynamic_update_slice_in_dim(buffer, piece, start, axis=1)


def _step_meta(meta: ChunkOwners | None, first_chunk, count: int, reverse: bool):
    """The P chunks' (seq, load, emit) of one step, in processing order."""
    if meta is None:
        return None
    load, emit = (meta.last, meta.first) if reverse else (meta.first, meta.last)
    pieces = [lax.dynamic_slice_in_dim(x, first_chunk, count) for x in (meta.seq, load, emit)]
    return [x[::-1] for x in pieces] if reverse else pieces


class _Step(NamedTuple):
    """One scan step: where it sits and how to read it (token arrays and log decays)."""

    start: Array  # first token (storage order)
    first_chunk: Array  # first chunk (storage order)
    load: functools.partial
    load_gate: functools.partial


def _step(static: ChunkCall, num_steps: int, step, dtype) -> _Step:
    P, C = static.chunks_per_step, static.chunk_size
    index = num_steps - 1 - step if static.reverse else step
    load = functools.partial(
        _load, start=index * P * C, length=P * C, shape=(P, C), reverse=static.reverse, dtype=dtype
    )
    return _Step(index * P * C, index * P, load, functools.partial(load, clean=clean_gate))


def _chunk_starts(state, updates, factor, init, step_meta, P: int, finals=None):
    """States entering each of P chunks from the state entering the step: [B, H, P, K, V],
    and the state leaving the last chunk; resets to `init` where a sequence is loaded, and
    records the state leaving a chunk in `finals` where a sequence is emitted."""
    starts = []
    for p in range(P):
        if step_meta is not None:
            seq, load, emit = step_meta
            state = jnp.where(load[p], init[seq[p]][None], state)
        starts.append(state)
        state = _decayed(state, factor, p) + updates[:, :, p]
        if finals is not None:
            finals = finals.at[seq[p]].set(jnp.where(emit[p], state[0], finals[seq[p]]))
    return jnp.stack(starts, axis=2), state, finals


# ----------------------------------------------------------------------------- passes


def forward(static: ChunkCall, q, k, v, gates: LogDecays, init, meta: ChunkOwners | None):
    """(output [B, T, H, V], final states [R, H, K, V], chunk-entry states [steps, B, H, P, K, V])."""
    T = q.shape[1]
    P, C = static.chunks_per_step, static.chunk_size
    num_steps = T // (P * C)
    dtype = init.dtype

    def body(carry, step):
        state, out, finals = carry
        where = _step(static, num_steps, step, dtype)
        step_meta = _step_meta(meta, where.first_chunk, P, static.reverse)
        key, value, _ = side_decays(LogDecays(*(where.load_gate(g) for g in gates)), static.leaf_size, C)
        qc, kc, vc = where.load(q) * static.scale, where.load(k), where.load(v)
        updates = chunk_updates(kc, vc, key, value)
        factor = _state_decay(key, value)
        starts, leaving, finals = _chunk_starts(state, updates, factor, init, step_meta, P, finals)
        out = _store(out, chunk_outputs(qc, kc, vc, key, value, starts), where.start, static.reverse)
        return (leaving, out, finals), starts

    state0 = init if meta is None else jnp.zeros((1, *init.shape[1:]), dtype)
    # the output buffer varies over the mesh axes the inputs vary over (inside `jax.shard_map`)
    (out0,) = vary_over(varying_axes(q, k, v, state0), jnp.zeros(v.shape, q.dtype))
    carry0 = (state0, out0, None if meta is None else init)
    (last, out, finals), entries = lax.scan(body, carry0, jnp.arange(num_steps))
    return out, (last if meta is None else finals), entries


def _final_terms(d_final: Array, final: Array, key_form: Gate | None, value: bool):
    """Σ_v / Σ_k of ∂L/∂h_final ⊙ h_final: the suffix carries of the last chunk."""
    product = d_final * final  # [R, H, K, V]
    key_term = {Gate.KEY: product.sum(-1), Gate.HEAD: product.sum((-2, -1)), None: None}[key_form]
    return key_term, (product.sum(-2) if value else None)


def _key_form(gates: LogDecays) -> Gate | None:
    """The form of the key side's decay as `side_decays` builds it."""
    if gates.key is not None:
        return Gate.KEY
    return Gate.HEAD if gates.head is not None and gates.value is None else None


def _suffix(per_token, carry, term, step_meta, channel: bool, P: int):
    """∂L/∂(log decay) of a step's tokens: Σ over later tokens of the same sequence of
    `per_token` [B, H, P, C(, D)], plus `carry` (later steps) or `term` (final state)."""
    within = chunk_cumsum(per_token, channel, reverse=True)
    totals = jnp.sum(per_token, axis=-2 if channel else -1)  # [B, H, P(, D)]
    later = [None] * P
    for p in reversed(range(P)):
        if step_meta is not None:
            seq, _, emit = step_meta
            carry = jnp.where(emit[p], term[seq[p]][None], carry)
        later[p] = carry
        carry = carry + totals[:, :, p]
    later = jnp.stack(later, axis=2)
    return within + (later[..., None, :] if channel else later[..., None]), carry


def backward(static: ChunkCall, residuals, d_out, d_final):
    """Gradients (dq, dk, dv, LogDecays of gradients, d_init) of the chunked pass."""
    q, k, v, gates, init, meta, states, finals = residuals
    T = q.shape[1]
    P, C = static.chunks_per_step, static.chunk_size
    num_steps = T // (P * C)
    dtype = init.dtype
    key_form, has_value = _key_form(gates), gates.value is not None
    key_term, value_term = _final_terms(d_final, finals, key_form, has_value)

    def body(carry, xs):
        step, starts = xs
        d_end, key_carry, value_carry, buffers, d_init = carry
        where = _step(static, num_steps, step, dtype)
        step_meta = _step_meta(meta, where.first_chunk, P, static.reverse)
        key, value, head_on = side_decays(LogDecays(*(where.load_gate(g) for g in gates)), static.leaf_size, C)
        qc, kc, vc, doc = where.load(q) * static.scale, where.load(k), where.load(v), where.load(d_out)

        factor = _state_decay(key, value)
        reads = dot("...tk,...tv->...kv", key.from_start(qc), value.from_start(doc))  # W_n
        d_ends = [None] * P
        for p in reversed(range(P)):
            if step_meta is not None:
                seq, load, emit = step_meta
                d_end = jnp.where(emit[p], d_final[seq[p]][None], d_end)
            d_ends[p] = d_end
            d_end = _decayed(d_end, factor, p) + reads[:, :, p]
            if step_meta is not None:
                d_init = d_init.at[seq[p]].add(jnp.where(load[p], d_end[0], 0))
                d_end = jnp.where(load[p], 0, d_end)
        d_ends = jnp.stack(d_ends, axis=2)
        dq, dk, dv, out = chunk_gradients(qc, kc, vc, doc, key, value, starts, d_ends, has_value)

        d_head = d_key = d_value = None
        if key_carry is not None:
            per_token = qc * dq - kc * dk
            channel = key.per_channel
            per_token = per_token if channel else per_token.sum(-1)
            d_a, key_carry = _suffix(per_token, key_carry, key_term, step_meta, channel, P)
            d_key = d_a if gates.key is not None else None
            d_head = d_a.sum(-1) if head_on is Gate.KEY else (d_a if head_on is Gate.HEAD else None)
        if value_carry is not None:
            d_b, value_carry = _suffix(out * doc - vc * dv, value_carry, value_term, step_meta, True, P)
            d_value = d_b
            d_head = d_b.sum(-1) if head_on is Gate.VALUE else d_head

        grads = (dq * static.scale, dk, dv, d_head, d_key, d_value)
        buffers = tuple(_store(b, g, where.start, static.reverse) for b, g in zip(buffers, grads))
        return (d_end, key_carry, value_carry, buffers, d_init), None

    buffers0 = tuple(None if x is None else jnp.zeros_like(x) for x in (q, k, v, *gates))
    if meta is None:
        carry0 = (d_final, key_term, value_term, buffers0, None)
    else:
        row = lambda x: None if x is None else jnp.zeros((1, *x.shape[1:]), x.dtype)  # noqa: E731
        carry0 = (row(d_final), row(key_term), row(value_term), buffers0, jnp.zeros_like(init))
    (d_end, _, _, buffers, d_init), _ = lax.scan(body, carry0, (jnp.arange(num_steps), states), reverse=True)
    if meta is None:
        d_init = d_end
    else:
        d_init = d_init + jnp.where(meta.empty[:, None, None, None], d_final, 0)
    dq, dk, dv, d_head, d_key, d_value = buffers
    return dq, dk, dv, LogDecays(d_head, d_key, d_value), d_init.astype(init.dtype)


# ----------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def chunked(
    static: ChunkCall,
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T H V"],
    gates: LogDecays,
    init: Float[Array, "R H K V"],
    meta: ChunkOwners | None,
):
    """(output [B, T, H, V], final state [R, H, K, V]); T a multiple of P·C, and the number
    of chunks in `meta` a multiple of P."""
    out, finals, _ = forward(static, q, k, v, gates, init, meta)
    return out, finals


def _chunked_fwd(static, q, k, v, gates, init, meta):
    out, finals, states = forward(static, q, k, v, gates, init, meta)
    return (out, finals), (q, k, v, gates, init, meta, states, finals)


def _chunked_bwd(static, residuals, cotangents):
    d_out, d_final = cotangents
    with matmul_precision(static.precision):
        dq, dk, dv, d_gates, d_init = backward(static, residuals, d_out, d_final)
    meta = residuals[5]
    d_meta = None if meta is None else jax.tree.map(lambda _: None, meta)
    return dq, dk, dv, d_gates, d_init, d_meta


chunked.defvjp(_chunked_fwd, _chunked_bwd)
