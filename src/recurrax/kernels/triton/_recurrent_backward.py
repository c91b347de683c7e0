"""Backward Pallas kernel of the chunk algorithm: dq, dk, dv and d(initial state).

| symbol  | meaning                                                                  |
|---------|--------------------------------------------------------------------------|
| C, c    | chunk length, sub-block length (per-channel decays)                      |
| S       | [K, BV] state entering chunk n (recomputed by the forward kernel)        |
| dS      | [K, BV] gradient w.r.t. the state leaving chunk n (float32, carried)     |
| A_i     | chunk-local inclusive cumulative log decay; A_L the chunk's last         |
| dP_ij   | scale · do_i · v_j, the gradient of the intra-chunk score P_ij           |
| p, r    | first token of a sub-block; anchors r = p − 1 (queries) / p + c − 1 (keys) |

One program per (row b, head h, value block j) walks the chunks from last to first,
carrying dS (initialised with the final-state cotangent dh_T). Differentiating the
forward's chunk equations (see `_chunk_fwd`):

    dq_i = scale · (S do_i) ⊙ e^{A_i}   +  Σ_{j ≤ i} dP_ij · k_j ⊙ e^{A_i − A_j}
    dk_j = (dS v_j) ⊙ e^{A_L − A_j}      +  Σ_{i ≥ j} dP_ij · q_i ⊙ e^{A_i − A_j}
    dv_j = (k_j ⊙ e^{A_L − A_j})ᵀ dS    +  Σ_{i ≥ j} P_ij do_i
    dS  ← e^{A_L} ⊙ dS  +  scale · Σ_i (q_i ⊙ e^{A_i}) do_iᵀ              (dS entering chunk n)

and after the first chunk dS is d(initial state). dq and dk contract over V, so each
value block writes a partial sum (`[nV, B, Tp, H, K]`, float32) that the caller adds up.

**Stability.** Per-head decays use the masked difference matrix D_ij = e^{A_i − A_j}
(j ≤ i) exactly as the forward. Per-channel decays use the same sub-block split with two
anchor choices, each keeping both factors ≤ 0:

* dq of query sub-block [p, p + c) against keys j < p: anchor r = p − 1,
  `dq_i += (Σ_j dP_ij · k_j ⊙ e^{A_r − A_j}) ⊙ e^{A_i − A_r}`.
* dk, dv of key sub-block [p, p + c) against queries i ≥ p + c: anchor r = p + c − 1,
  `q̂_i = q_i ⊙ e^{A_i − A_r}` (i > r; 0 otherwise), `k̃_j = k_j ⊙ e^{A_r − A_j}` (j ≤ r), then
  `P_ij = q̂_i · k̃_j`, `dv_j += Σ_i P_ij do_i` and `dk_j += e^{A_r − A_j} ⊙ Σ_i dP_ij q̂_i`.
* the diagonal block element-wise from E[i, j, k] = e^{A_ik − A_jk} (j ≤ i), shared by dq,
  dk and dv of that sub-block.

Gate gradients are not computed here: they follow from dq and dk by the reverse-cumsum
identity, cut at chunk boundaries (`kernels/_recurrent_driver.py`), for which the kernel writes, per
chunk, the boundary term Σ_V S ⊙ dS of the state leaving it (S from the recomputed states,
or h_T for the last chunk). Packed input: a sequence's last chunk starts from its
final-state cotangent, its first chunk writes d(initial state).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .._driver import KernelConfig, output_type
from ._common import (F32, Gate, anchor_before, block_v, causal_mask, col_index, compiler_params, decay_spec,
                      diagonal_column, exp_where, mm, mm_nt, mm_tn, row_index, rows, specs_for)


def _head_chunk_bwd(q, k, v, do, a, a_last, S, dS, *, scale, dtype):
    """Per-head (or no) decay: `(dq, dk, dv, dS entering)` of one chunk, float32."""
    C = q.shape[0]
    if a is None:
        mask = causal_mask(C)
        P = scale * jnp.where(mask, mm_nt(q, k, dtype), 0.0)  # [C, C]
        dP = scale * jnp.where(mask, mm_nt(do, v, dtype), 0.0)  # [C, C]
        dq = mm(dP, k, dtype) + scale * mm_nt(do, S, dtype)
        dk = mm_tn(dP, q, dtype) + mm_nt(v, dS, dtype)
        dv = mm_tn(P, do, dtype) + mm(k, dS, dtype)
        return dq, dk, dv, dS + scale * mm_tn(q, do, dtype)
    decay = exp_where(causal_mask(C), a[:, None] - a[None, :])  # [C, C] e^{A_i − A_j}, j ≤ i
    P = scale * mm_nt(q, k, dtype) * decay
    dP = scale * mm_nt(do, v, dtype) * decay
    from_start = jnp.exp(a)[:, None]  # [C, 1] e^{A_i}
    to_end = jnp.exp(a_last - a)[:, None]  # [C, 1] e^{A_L − A_j}
    dq = mm(dP, k, dtype) + scale * mm_nt(do, S, dtype) * from_start
    dk = mm_tn(dP, q, dtype) + mm_nt(v, dS, dtype) * to_end
    dv = mm_tn(P, do, dtype) + mm(k * to_end, dS, dtype)
    dS_entering = jnp.exp(a_last) * dS + scale * mm_tn(q * from_start, do, dtype)
    return dq, dk, dv, dS_entering


def _dq_before(do_s, a_s, k, v, a, a_r, p, *, scale, dtype):
    """dq of query rows [p, p + c) from keys j < p, anchored at r = p − 1: [c, K]."""
    C, K = k.shape
    k_anchor = k * exp_where(row_index(C, K) < p, a_r - a)  # [C, K] e^{A_r − A_j}; 0 for j ≥ p
    dP = scale * mm_nt(do_s, v, dtype)  # [c, C]
    return mm(dP, k_anchor, dtype) * jnp.exp(a_s - a_r)


def _dkv_after(q, do, a, k_s, v_s, a_s, a_r, r, *, scale, dtype):
    """dk, dv of key rows [p, r] from queries i > r, anchored at r = p + c − 1: [c, K], [c, BV]."""
    C, K = q.shape
    q_hat = q * exp_where(row_index(C, K) > r, a - a_r)  # [C, K] e^{A_i − A_r}; 0 for i ≤ r
    k_factor = jnp.exp(a_r - a_s)  # [c, K] e^{A_r − A_j}
    P = scale * mm_nt(q_hat, k_s * k_factor, dtype)  # [C, c]
    dP = scale * mm_nt(do, v_s, dtype)  # [C, c]
    return k_factor * mm_tn(dP, q_hat, dtype), mm_tn(P, do, dtype)


def _diagonal_bwd(q_s, v_s, do_s, a_s, k_ref, a_ref, start, *, scale, dtype):
    """Exact diagonal block, one key column j at a time: its (dq_s, dk_s, dv_s)."""
    c, K = q_s.shape
    dP = scale * mm_nt(do_s, v_s, dtype)  # [c, c]; the column's E_j masks i < j
    q32 = q_s.astype(F32)

    def column(j, carry):
        P, dq, dk = carry
        k_j, E_j, P_j = diagonal_column(q_s, a_s, k_ref, a_ref, start, j)
        is_j = col_index(c, c) == j
        dP_j = jnp.sum(jnp.where(is_j, dP, 0.0), axis=1, keepdims=True)  # [c, 1] = dP[:, j]
        dk_j = jnp.sum(dP_j * q32 * E_j, axis=0, keepdims=True)  # [1, K]
        P = jnp.where(is_j, scale * P_j, P)
        return P, dq + dP_j * k_j * E_j, jnp.where(row_index(c, K) == j, dk_j, dk)

    zeros = jnp.zeros((c, K), F32)
    P, dq, dk = lax.fori_loop(0, c, column, (jnp.zeros((c, c), F32), zeros, zeros))
    return dq, dk, mm_tn(P, do_s, dtype)


def _key_sub_block_bwd(refs, base, p, S, dS, a_last, *, C: int, c: int, scale, dtype):
    """Per-channel decay: (dq, dk, dv) of rows [p, p + c) of the chunk at `base`, float32.

    `p` may be traced. Anchors: r = p − 1 (A = 0 at the chunk start for the first
    sub-block) for dq against earlier keys; r = p + c − 1 for dk, dv against later queries
    (none for the last sub-block: the mask empties that term).
    """
    q_ref, k_ref, v_ref, do_ref, a_ref = refs
    q_s, k_s, v_s, do_s, a_s = (rows(ref, base + p, c) for ref in refs)
    dq, dk, dv = _diagonal_bwd(q_s, v_s, do_s, a_s, k_ref, a_ref, base + p, scale=scale, dtype=dtype)
    dq += scale * mm_nt(do_s, S, dtype) * jnp.exp(a_s)  # from the state entering the chunk
    to_end = jnp.exp(a_last - a_s)  # [c, K]
    dk += mm_nt(v_s, dS, dtype) * to_end  # from the state leaving the chunk
    dv += mm(k_s * to_end, dS, dtype)
    k, v, a = rows(k_ref, base, C), rows(v_ref, base, C), rows(a_ref, base, C)
    dq += _dq_before(do_s, a_s, k, v, a, anchor_before(a_ref, base, p), p, scale=scale, dtype=dtype)
    q, do = rows(q_ref, base, C), rows(do_ref, base, C)
    a_end = rows(a_ref, base + p + c - 1, 1)
    dk_after, dv_after = _dkv_after(q, do, a, k_s, v_s, a_s, a_end, p + c - 1, scale=scale, dtype=dtype)
    return dq, dk + dk_after, dv + dv_after


def _backward_kernel(*refs, static: KernelConfig, varlen: bool):
    gate = static.gate
    q_ref, k_ref, v_ref, *rest = refs
    a_ref = rest.pop(0) if gate is not None else None
    meta_ref = rest.pop(0) if varlen else None
    do_ref, states_ref, hT_ref, dhT_ref, dq_ref, dk_ref, dv_ref, dh0_ref, *rest = rest
    boundary_ref = rest.pop(0) if gate is not None else None

    C, c = static.tiles.chunk, static.tiles.sub
    Tp, K = q_ref.shape
    N = Tp // C
    dtype, scale = q_ref.dtype, static.scale

    def store(ref, start, size, x):
        ref[pl.ds(start, size), :] = x.astype(ref.dtype)

    def sub_blocks(base, S, dS, a_last):
        def step(s, carry):
            p = pl.multiple_of(s * c, c)
            refs = (q_ref, k_ref, v_ref, do_ref, a_ref)
            dq, dk, dv = _key_sub_block_bwd(refs, base, p, S, dS, a_last, C=C, c=c, scale=scale, dtype=dtype)
            store(dq_ref, base + p, c, dq)
            store(dk_ref, base + p, c, dk)
            store(dv_ref, base + p, c, dv)
            return carry

        return step

    def chunk_step(n, dS, after):
        """Gradients of chunk n given dS, the gradient of the state leaving it, and `after`
        [K, BV], that state (the boundary term needs it); returns the gradient of the state
        entering the chunk."""
        base = pl.multiple_of(n * C, C)
        S = states_ref[n]  # [K, BV] entering chunk n
        if boundary_ref is not None:  # Σ_V S ⊙ dS at the chunk's end, for the gate gradient
            boundary_ref[pl.ds(n, 1), :] = jnp.sum(after * dS, axis=1)[None, :]
        a_last = None if a_ref is None else rows(a_ref, base + C - 1, 1)
        if gate is Gate.KEY:
            lax.fori_loop(0, C // c, sub_blocks(base, S, dS, a_last), 0)
            q, do, a = rows(q_ref, base, C), rows(do_ref, base, C), rows(a_ref, base, C)
            return jnp.exp(a_last).T * dS + scale * mm_tn(q * jnp.exp(a), do, dtype)
        q, k = rows(q_ref, base, C), rows(k_ref, base, C)
        v, do = rows(v_ref, base, C), rows(do_ref, base, C)
        a = None if a_ref is None else rows(a_ref, base, C)
        dq, dk, dv, dS_entering = _head_chunk_bwd(q, k, v, do, a, a_last, S, dS, scale=scale, dtype=dtype)
        store(dq_ref, base, C, dq)
        store(dk_ref, base, C, dk)
        store(dv_ref, base, C, dv)
        return dS_entering

    def dense_step(step, dS):
        n = N - 1 - step
        after = jnp.where(n == N - 1, hT_ref[...], states_ref[jnp.minimum(n + 1, N - 1)])
        return chunk_step(n, dS, after)

    def packed_step(step, dS):
        """Packed input: a sequence's last chunk starts from its final-state cotangent, its
        first chunk writes the gradient of its initial state."""
        n = N - 1 - step
        seq, first, last = meta_ref[0, n], meta_ref[1, n], meta_ref[2, n]
        dS = jnp.where(last > 0, dhT_ref[seq].astype(F32), dS)
        after = jnp.where(last > 0, hT_ref[seq], states_ref[jnp.minimum(n + 1, N - 1)])
        dS_entering = chunk_step(n, dS, after)

        @pl.when(first > 0)
        def _():
            dh0_ref[seq] = dS_entering.astype(dh0_ref.dtype)

        return dS_entering

    if varlen:
        lax.fori_loop(0, N, packed_step, jnp.zeros(dh0_ref.shape[1:], F32))
    else:
        dS = lax.fori_loop(0, N, dense_step, dhT_ref[...].astype(F32))
        dh0_ref[...] = dS.astype(dh0_ref.dtype)


@functools.partial(jax.jit, static_argnames=("static",))
def chunk_backward(q, k, v, a, do, states, h_T, dh_T, meta=None, *, static: KernelConfig):
    """Launch the backward kernel: the driver's `PallasBackend.backward` contract (`kernels/_recurrent_driver.py`);
    one program per (row, head, value block) walks the chunks backwards; dq, dk and the boundary
    terms are summed over value blocks here."""
    B, Tp, H, K = q.shape
    V = v.shape[-1]
    R = h_T.shape[0]
    BV = block_v(static, V)
    nV, N = V // BV, Tp // static.tiles.chunk
    specs = specs_for(B, H, nV)
    a_spec = decay_spec(static.gate, Tp, K, specs)
    state_spec = specs["state"](K, BV) if meta is None else specs["seq_states"](R, K, BV)
    in_specs = [specs["tokens_k"](Tp, K), specs["tokens_k"](Tp, K), specs["tokens_v"](Tp, BV)]
    in_specs += [a_spec] if a_spec is not None else []
    in_specs += [specs["meta"](N)] if meta is not None else []
    in_specs += [specs["tokens_v"](Tp, BV), specs["states"](N, K, BV), state_spec, state_spec]
    out_specs = [specs["partial_k"](Tp, K), specs["partial_k"](Tp, K), specs["tokens_v"](Tp, BV), state_spec]
    out_shape = [
        output_type((nV, B, Tp, H, K), F32, q),
        output_type((nV, B, Tp, H, K), F32, q),
        output_type((B, Tp, H, V), F32, q),
        output_type((R, H, K, V), F32, q),
    ]
    if a_spec is not None:
        out_specs.append(specs["partial_chunks"](N, K))
        out_shape.append(output_type((nV, B, H, N, K), F32, q))
    args = (q, k, v) + ((a,) if a_spec is not None else ()) + ((meta,) if meta is not None else ())
    args += (do, states, h_T, dh_T)
    dq, dk, dv, dh0, *boundary = pl.pallas_call(
        functools.partial(_backward_kernel, static=static, varlen=meta is not None),
        grid=(B, H, nV),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(static),
        interpret=static.interpret,
        name="recurrax_chunk_bwd",
    )(*args)
    return dq.sum(0), dk.sum(0), dv, dh0, (boundary[0].sum(0) if boundary else None)
