"""Chunks for query and key shared by groups of heads, with per-head decays (Mamba-2's SSD).

| symbol | meaning                                                                        |
|--------|--------------------------------------------------------------------------------|
| B, T   | batch rows, tokens per row (a multiple of P·C here)                            |
| G, H   | query/key heads (groups), value heads; r = H / G heads share one query/key     |
| K, V   | query/key and value head dimensions; X = r·V, a group's values side by side    |
| C, P   | chunk size, chunks per scan step                                               |
| R      | state rows: B, or S sequences when packed (then B = 1)                         |
| A_t    | Σ_{u≤t} a_u inside a chunk, per head: the cumulative log decay                 |
| S_n    | state entering chunk n, per group [K, X] (its heads' [K, V] states side by side) |

Stack the r heads of a group side by side: their values form one [X] row per token and
their states one [K, X] matrix. A per-head decay is then a decay of that matrix's columns,
so each group is one recurrence whose products over K are shared by its heads. Per chunk
(q already carries the softmax scale; t, s index the chunk's tokens, h a head of the group):

    o_t^h = Σ_{s≤t} (q_t · k_s) e^{A_t^h − A_s^h} v_s^h  +  e^{A_t^h} (q_tᵀ S_n)^h
    S_{n+1} = S_n ⊙ e^{A_C} + U_n,        U_n = Σ_s k_s (e^{A_C − A_s} ⊙ v_s)ᵀ

The scores q_t · k_s are formed once per group (C²·K), not once per head; the decay matrix
e^{A_t − A_s} (`_intra.head_decay`: products of per-token factors, exact for any decay,
hard resets included) weights them per head; the inter-chunk product q_tᵀ S_n and the update U_n
are one [C, K] × [K, X] product per group. No head is repeated: compared with expanding
query and key to H heads, this saves (r − 1)/r of their memory and of the score products.
The intra-chunk product runs per head with the heads as its leading batch axis: the values
are moved to [r, C, V] (rows of V stay contiguous) and the result back to [C, r, V]. Left as
`[C, r, V]` operands, XLA chose to transpose the values to [r, V, C] while loading them, a
strided copy that took a sixth of the forward at mamba2-130m's SSD shape ([8, 512] tokens:
57 → 47 ms forward, 192 → 180 ms forward+backward, side by side).
The update takes k transposed per chunk, [K, C] × [C, X]: both state products are then
plain row-major matmuls, which XLA on CPU hands to its fast (YNNPACK) path; contracting
over the tokens of both operands went to a slower one (at mamba2-130m's SSD shape the
forward was 5–16% faster this way in three side-by-side runs; forward+backward, whose
products contract the tokens either way, 1–10% slower).

A `lax.scan` steps through P chunks at a time (their products batched, the state
recurrence unrolled over P); each step is rematerialised in the backward (`jax.checkpoint`),
so training stores the state entering each step and the inputs. Packed sequences reset
the state at their first chunk (`varlen.ChunkOwners`) and take their final state from
the chunk they end on. `reverse` visits steps and chunks from last to first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from ..._core.finite import clean_cotangent
from ..._core.intra import dot, head_decay
from ..._core.varlen import ChunkOwners
from ._state_scan import ChunkCall, _chunk_starts, _step, _step_meta


def _per_column(factor: Array, width: int) -> Array:
    """Per-head factors [..., r] -> per column of the stacked values [..., r·V]."""
    return jnp.broadcast_to(factor[..., None], (*factor.shape, width)).reshape(*factor.shape[:-1], -1)


def _chunks(static: ChunkCall, q, k, v, log_decay, state, init, step_meta, V: int):
    """Outputs [B, G, P, C, X] of one step's chunks, and the states leaving each [B, G, P, K, X]."""
    P = static.chunks_per_step
    from_start, to_end, decay = head_decay(jnp.swapaxes(log_decay, -1, -2))  # [B, G, P, r, C(, C)]
    from_start, to_end = jnp.swapaxes(from_start, -1, -2), jnp.swapaxes(to_end, -1, -2)  # [B, G, P, C, r]
    update = dot("...ks,...sx->...kx", jnp.swapaxes(k, -1, -2), v * _per_column(to_end, V))
    factor = _per_column(from_start[..., -1, :], V)[..., None, :]  # [B, G, P, 1, X]
    starts, _, _ = _chunk_starts(state, update, factor, init, step_meta, P)
    leaving = starts * factor + update
    inter = dot("...tk,...kx->...tx", q, starts) * _per_column(from_start, V)
    scores = dot("...tk,...sk->...ts", q, k)[..., None, :, :] * decay  # [B, G, P, r, C, C]
    values = jnp.swapaxes(v.reshape(*v.shape[:-1], -1, V), -3, -2)  # [B, G, P, r, C, V]
    intra = jnp.swapaxes(dot("...rts,...rsv->...rtv", scores, values), -3, -2)
    return intra.reshape(inter.shape) + inter, leaving


def shared_chunked(
    static: ChunkCall,
    q: Float[Array, "B T G K"],
    k: Float[Array, "B T G K"],
    v: Float[Array, "B T H V"],
    log_decay: Float[Array, "B T H"] | None,
    init: Float[Array, "R H K V"],
    meta: ChunkOwners | None,
) -> tuple[Float[Array, "B T H V"], Float[Array, "R H K V"]]:
    """(output, final state) of the recurrence with query and key shared by groups of heads
    and per-head log decays (None: no decay). T is a multiple of P·C, and the number of
    chunks in `meta` a multiple of P."""
    B, T, G, K = q.shape
    H, V = v.shape[2:]
    r, P, C = H // G, static.chunks_per_step, static.chunk_size
    num_steps = T // (P * C)
    dtype = init.dtype
    if log_decay is None:
        log_decay = jnp.zeros((B, T, H), dtype)
    v, log_decay = v.reshape(B, T, G, r * V), log_decay.reshape(B, T, G, r)
    grouped_init = jnp.moveaxis(init.reshape(init.shape[0], G, r, K, V), 2, 3).reshape(-1, G, K, r * V)

    @jax.checkpoint
    def body(state, step):
        where = _step(static, num_steps, step, dtype)
        step_meta = _step_meta(meta, where.first_chunk, P, static.reverse)
        qc, kc, vc, ac = where.load(q) * static.scale, where.load(k), where.load(v), where.load_gate(log_decay)
        out, leaving = _chunks(static, qc, kc, vc, ac, state, grouped_init, step_meta, V)
        return leaving[:, :, -1], (clean_cotangent(out.astype(q.dtype)), leaving if meta is not None else None)

    state0 = grouped_init if meta is None else jnp.zeros((1, G, K, r * V), dtype)
    last, (outs, leaving) = lax.scan(body, state0, jnp.arange(num_steps))
    out = _in_token_order(outs, static.reverse).reshape(B, G, T, r, V)
    final = last if meta is None else _packed_finals(leaving, meta, grouped_init, static.reverse)
    final = jnp.moveaxis(final.reshape(-1, G, K, r, V), 3, 2).reshape(-1, H, K, V)
    return jnp.moveaxis(out, 2, 1).reshape(B, T, H, V), final


def _in_token_order(per_step: Array, reverse: bool) -> Array:
    """[steps, B, G, P, C, ...] in processing order -> [B, G, steps·P·C, ...] in token order."""
    steps, B, G, P, C = per_step.shape[:5]
    flat = jnp.moveaxis(per_step, 0, 2).reshape(B, G, steps * P * C, *per_step.shape[5:])
    return jnp.flip(flat, axis=2) if reverse else flat


def _packed_finals(leaving: Array, meta: ChunkOwners, init: Array, reverse: bool) -> Array:
    """Each sequence's state after its last chunk in processing order, [S, G, K, X]; the
    initial state for a sequence without tokens."""
    steps, _, G, P = leaving.shape[:4]
    chunks = jnp.moveaxis(leaving[:, 0], 1, 0).reshape(G, steps * P, *leaving.shape[4:])  # processing order
    chunks = jnp.flip(chunks, axis=1) if reverse else chunks  # storage order
    closing = meta.first if reverse else meta.last
    index = jnp.arange(closing.shape[0])
    last_chunk = jax.ops.segment_max(jnp.where(closing, index, -1), meta.seq, num_segments=init.shape[0])
    finals = jnp.moveaxis(chunks[:, jnp.maximum(last_chunk, 0)], 1, 0)
    return jnp.where(meta.empty[:, None, None, None], init, finals)

