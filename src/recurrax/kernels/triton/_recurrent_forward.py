"""Forward Pallas kernel of the chunk algorithm: outputs, final state, chunk states.

| symbol  | meaning                                                                  |
|---------|--------------------------------------------------------------------------|
| C, c    | chunk length, sub-block length (per-channel decays)                      |
| n       | chunk index; token i of chunk n is global token n·C + i                  |
| S       | [K, BV] state entering chunk n (float32, lives in registers/VMEM)        |
| A_i     | chunk-local inclusive cumulative log decay: A_i = Σ_{s ≤ i} a_s           |
| A_L     | A of the chunk's last token (the whole chunk's decay)                    |
| p       | first token of a sub-block; r = p − 1 its anchor                         |

One program per (row b, head h, value block j) runs a `fori_loop` over the N chunks,
carrying S in float32. Inside chunk n, with ⊙ broadcasting a decay over the axis it
belongs to (K for per-channel, everything for per-head):

    o_i   = scale · [ (q_i ⊙ e^{A_i})ᵀ S  +  Σ_{j ≤ i} P_ij v_j ]          (inter + intra)
    P_ij  = Σ_k q_ik k_jk e^{A_ik − A_jk}                                 (j ≤ i)
    S'    = e^{A_L} ⊙ S  +  Σ_j (k_j ⊙ e^{A_L − A_j}) v_jᵀ

**Why every exponent is ≤ 0** (for non-positive gates a ≤ 0; positive gates stay exact
but may grow, as the contract allows): A_i, A_L − A_j (j ≤ L) and A_i − A_j (j ≤ i) are
sums of gates, hence ≤ 0. The intra-chunk sum must become a matmul:

* per-head decay (scalar A): P = (q kᵀ) ⊙ D with D_ij = e^{A_i − A_j} for j ≤ i and D_ij = 0
  otherwise; D is formed from the difference directly, never from e^{A_i}·e^{−A_j}
  (e^{−A_j} overflows float32 once A_j < −88). A pure [C, C] matmul, no sub-blocks.
* per-channel decay (A over K): the difference sits inside the contraction over k, so
  it must be split, e^{A_i − A_j} = e^{A_i − A_r} · e^{A_r − A_j}, and the split is safe
  only when both factors are ≤ 0, i.e. j ≤ r ≤ i. For the query sub-block starting at p
  and every key j < p take r = p − 1: A_i − A_r = Σ_{r < s ≤ i} a_s ≤ 0 (i ≥ p) and
  A_r − A_j = Σ_{j < s ≤ r} a_s ≤ 0 (j ≤ r). Keys j ≥ p are masked to exactly 0 before the
  exponential (their exponent would be positive). The remaining diagonal block
  (j, i both in [p, p + c)) has no valid single anchor, so it is computed element-wise,
  one key column j at a time: E_j[i, k] = e^{A_ik − A_jk} for i ≥ j (a [c, K] tile; the
  [c, c, K] broadcast would not fit in registers at K = 128), c = 16 by default.
  For the first sub-block (p = 0) the anchor is the chunk start, where A = 0.

So a per-channel chunk runs a loop over its query sub-blocks, each doing one
[c, K]·[K, C] score matmul against all keys of the chunk (keys at or after p zeroed), one
[c, C]·[C, BV] value matmul, and the exact diagonal (a loop over its c key columns).
Matmul operands are cast to the input dtype (bf16/f16 tensor cores; the decay factors
are ≤ 1 so nothing overflows); accumulation and the state are float32.

With `emit_states` the kernel also writes S entering every chunk ([N, K, BV]): the
backward recomputes them with `emit_output=False` instead of keeping them from the
forward (residual memory stays O(T·(K + V)) per head).

Packed input adds a [3, N] int32 table (`varlen.ChunkOwners.table()`: sequence, first,
last per chunk): a sequence's first chunk starts from its initial state, its last chunk
writes its final state.
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


def _head_chunk(q, k, v, a, a_last, S, *, scale, dtype):
    """Per-head (or no) decay: `(o [C, BV] float32, S' [K, BV])` for one chunk; a_last [1]."""
    C = q.shape[0]
    scores = mm_nt(q, k, dtype)  # [C, C]
    if a is None:
        o = mm(q, S, dtype) + mm(jnp.where(causal_mask(C), scores, 0.0), v, dtype)
        return scale * o, S + mm_tn(k, v, dtype)
    decay = exp_where(causal_mask(C), a[:, None] - a[None, :])  # [C, C] = e^{A_i − A_j}, j ≤ i
    o = mm(q * jnp.exp(a)[:, None], S, dtype) + mm(scores * decay, v, dtype)
    k_to_end = k * jnp.exp(a_last - a)[:, None]  # [C, K]
    return scale * o, jnp.exp(a_last) * S + mm_tn(k_to_end, v, dtype)


def _key_sub_block(refs, base, p, S, *, C: int, c: int, dtype):
    """Per-channel decay: unscaled output rows [p, p + c) of the chunk at `base`, [c, BV] float32.

    `p` may be traced (a loop over sub-blocks); the anchor is r = p − 1, or the chunk
    start (A = 0) for the first sub-block, whose "earlier keys" term is then empty.
    """
    q_ref, k_ref, v_ref, a_ref = refs
    q_s, v_s, a_s = rows(q_ref, base + p, c), rows(v_ref, base + p, c), rows(a_ref, base + p, c)
    k, v, a = rows(k_ref, base, C), rows(v_ref, base, C), rows(a_ref, base, C)
    K = k.shape[1]
    o = mm(q_s * jnp.exp(a_s), S, dtype)  # inter-chunk: e^{A_i} ≤ 1
    a_r = anchor_before(a_ref, base, p)  # [1, K]
    k_anchor = k * exp_where(row_index(C, K) < p, a_r - a)  # [C, K] e^{A_r − A_j}, j < p; 0 for j ≥ p
    q_anchor = q_s * jnp.exp(a_s - a_r)  # [c, K] e^{A_i − A_r}, i ≥ p
    o = o + mm(mm_nt(q_anchor, k_anchor, dtype), v, dtype)

    def column(j, P):  # the exact diagonal block, one key at a time
        _, _, P_j = diagonal_column(q_s, a_s, k_ref, a_ref, base + p, j)
        return jnp.where(col_index(c, c) == j, P_j, P)

    P = lax.fori_loop(0, c, column, jnp.zeros((c, c), F32))
    return o + mm(P, v_s, dtype)


def _forward_kernel(*refs, static: KernelConfig, varlen: bool, emit_output: bool, emit_states: bool):
    gate = static.gate
    q_ref, k_ref, v_ref, *rest = refs
    a_ref = rest.pop(0) if gate is not None else None
    meta_ref = rest.pop(0) if varlen else None
    h0_ref, *outs = rest
    o_ref = outs.pop(0) if emit_output else None
    hT_ref = outs.pop(0)
    states_ref = outs.pop(0) if emit_states else None

    C, c = static.tiles.chunk, static.tiles.sub
    Tp, K = q_ref.shape
    dtype = q_ref.dtype

    def sub_block(base, S):
        def step(s, carry):  # output rows [p, p + c) of the chunk at `base`
            p = pl.multiple_of(s * c, c)
            o_s = _key_sub_block((q_ref, k_ref, v_ref, a_ref), base, p, S, C=C, c=c, dtype=dtype)
            o_ref[pl.ds(base + p, c), :] = (static.scale * o_s).astype(o_ref.dtype)
            return carry

        return step

    def chunk_step(n, S):
        """Outputs of chunk n (written) and the state leaving it."""
        base = pl.multiple_of(n * C, C)
        if emit_states:
            states_ref[n] = S
        if gate is Gate.KEY and emit_output:
            lax.fori_loop(0, C // c, sub_block(base, S), 0)
        k, v = rows(k_ref, base, C), rows(v_ref, base, C)
        a = None if a_ref is None else rows(a_ref, base, C)
        a_last = None if a is None else rows(a_ref, base + C - 1, 1)  # [1] or [1, K]
        if gate is Gate.KEY:
            k_to_end = k * jnp.exp(a_last - a)  # [C, K]
            return jnp.exp(a_last).T * S + mm_tn(k_to_end, v, dtype)
        o, S_next = _head_chunk(rows(q_ref, base, C), k, v, a, a_last, S, scale=static.scale, dtype=dtype)
        if emit_output:
            o_ref[pl.ds(base, C), :] = o.astype(o_ref.dtype)
        return S_next

    def packed_step(n, S):
        """Packed input: a sequence's first chunk starts from its initial state, its last
        chunk writes its final state (chunk-aligned layout: no chunk holds two sequences).
        The reset is a branch, not `jnp.where`: Triton keeps S, a matmul accumulator, in
        Blackwell's tensor memory and cannot lower a select on it (sm_100a: "'ttng.tmem_store'
        op operand #2 must be 1-bit signless integer")."""
        seq, first, last = meta_ref[0, n], meta_ref[1, n], meta_ref[2, n]
        S = lax.cond(first > 0, lambda: h0_ref[seq].astype(F32), lambda: S)
        S_next = chunk_step(n, S)

        @pl.when(last > 0)
        def _():
            hT_ref[seq] = S_next.astype(hT_ref.dtype)

        return S_next

    if varlen:
        lax.fori_loop(0, Tp // C, packed_step, jnp.zeros(hT_ref.shape[1:], F32))
    else:
        S = lax.fori_loop(0, Tp // C, chunk_step, h0_ref[...].astype(F32))
        hT_ref[...] = S.astype(hT_ref.dtype)


@functools.partial(jax.jit, static_argnames=("static", "emit_output", "emit_states"))
def chunk_forward(q, k, v, a, h0, meta=None, *, static: KernelConfig, emit_output: bool = True,
                  emit_states: bool = False):
    """Launch the forward kernel: the driver's `PallasBackend.forward` contract (`kernels/_recurrent_driver.py`);
    one program per (row, head, value block) walks the chunks."""
    B, Tp, H, K = q.shape
    V = v.shape[-1]
    R = h0.shape[0]
    BV = block_v(static, V)
    N = Tp // static.tiles.chunk
    specs = specs_for(B, H, V // BV)
    a_spec = decay_spec(static.gate, Tp, K, specs)
    state_spec = specs["state"](K, BV) if meta is None else specs["seq_states"](R, K, BV)
    in_specs = [specs["tokens_k"](Tp, K), specs["tokens_k"](Tp, K), specs["tokens_v"](Tp, BV)]
    in_specs += [a_spec] if a_spec is not None else []
    in_specs += [specs["meta"](N)] if meta is not None else []
    in_specs += [state_spec]
    out_specs, out_shape = [], []
    if emit_output:
        out_specs.append(specs["tokens_v"](Tp, BV))
        out_shape.append(output_type((B, Tp, H, V), q.dtype, q))
    out_specs.append(state_spec)
    out_shape.append(output_type((R, H, K, V), F32, q))
    if emit_states:
        out_specs.append(specs["states"](N, K, BV))
        out_shape.append(output_type((B, H, N, K, V), F32, q))
    args = (q, k, v) + ((a,) if a_spec is not None else ()) + ((meta,) if meta is not None else ()) + (h0,)
    kernel = functools.partial(
        _forward_kernel, static=static, varlen=meta is not None, emit_output=emit_output, emit_states=emit_states
    )
    return pl.pallas_call(
        kernel,
        grid=(B, H, V // BV),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=compiler_params(static),
        interpret=static.interpret,
        name="recurrax_chunk_fwd" if emit_output else "recurrax_chunk_states",
    )(*args)
