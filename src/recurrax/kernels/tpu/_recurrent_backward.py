"""Backward Pallas TPU kernel of the chunk algorithm: dq, dk, dv, d(initial state), gate gradient.

| symbol  | meaning                                                                   |
|---------|---------------------------------------------------------------------------|
| C, c    | chunk length (one grid step), sub-block length (per-channel decays)       |
| S       | [K, BV] state entering the chunk (written by the differentiated forward) |
| dS      | [K, BV] gradient of the state leaving the chunk, VMEM scratch, float32    |
| S⁺      | [K, BV] state leaving the chunk (S of the chunk after it, or h_T)         |
| A_i     | chunk-local inclusive cumulative log decay; A_L the chunk's last          |
| dP_ij   | scale · do_i · v_j, the gradient of the intra-chunk score P_ij            |

The grid walks the chunks of each (row, head block, value block) from last to first (the Hb
heads of a step one after another, `_launch`), carrying
dS (initialised with the final-state cotangent) and S⁺ in VMEM. Differentiating the
forward's chunk equations (`_recurrent_forward`), with ⊙ broadcasting a decay over its axis:

    dq_i = scale · (S do_i) ⊙ e^{A_i}    +  Σ_{j ≤ i} dP_ij · k_j ⊙ e^{A_i − A_j}
    dk_j = (dS v_j) ⊙ e^{A_L − A_j}       +  Σ_{i ≥ j} dP_ij · q_i ⊙ e^{A_i − A_j}
    dv_j = (k_j ⊙ e^{A_L − A_j})ᵀ dS     +  Σ_{i ≥ j} P_ij do_i
    dS  ← e^{A_L} ⊙ dS  +  scale · Σ_i (q_i ⊙ e^{A_i}) do_iᵀ          (gradient entering)

and at a sequence's first chunk dS is d(initial state). dq and dk contract over V, so
each value block writes a partial sum ([nV, B, Tp, H · K]: in the caller's dtype when nV = 1
and no query/key heads are shared, else float32, which the wrapper adds up).

**Gate gradient** (`recurrax.kernels._recurrent_driver`'s docstring): per chunk, with the
boundary term b = Σ_V S⁺ ⊙ dS [1, K] (a lane reduction turned into a row by a masked sublane
sum) and dB = q ⊙ dq − k ⊙ dk in float32 (q, k the head's own, shared by a group; dq, dk its
value head's, before the group sum),

    dg_t = Σ_{t ≤ s ≤ L} dB_s + b  =  (U dB)_t + b,   U_ts = 1 for s ≥ t   [C, C] 0/1

exact on the MXU in three bf16 passes (`suffix_sums`); per channel dB is staged sub-block by
sub-block in the [C, K] output view, then summed in place ([nV, B, Tp, H · K]); per head
the K channels are summed first, dg [C, 1] goes to column
h · Hb + i of a [C, H] block ([nV, H / Hb, B, Tp, H]: each step writes its heads' columns,
zeros the others). Linear in dq, dk and dS, so value blocks (and head blocks) add up.

**Transposes avoided.** The sums over i ≥ j are computed directly in transposed form,
Pᵀ = k̃ q̃ᵀ and dPᵀ = v doᵀ (`a @ bᵀ` matmuls), and Σ_i q̃_i do_iᵀ reads q in the [K, C]
layout. **Stability** as the forward: per-head decays through the masked difference
matrix; per-channel decays through sub-blocks [p, p + c) with anchors r = p − 1 (dq
against keys j < p) and r = p + c − 1 (dk, dv against queries i > r), both factors of
each split ≤ 0, and the diagonal block as the forward's (`diagonal_bwd`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..._core.problem import Gate
from .._driver import KernelConfig, output_type
from .._recurrent_driver import sum_groups
from . import _tiles as tiles
from ._channel import DIAGONAL_GROUP, DiagonalGroups, after_anchor, before_anchor, diagonal_block, group_scatter
from ._launch import finish_carry, launch, start_carries, take
from ._recurrent_forward import recurrent_shapes
from ._tiles import F32, exp_where, iota, mm, mm_nt, pick_col, pick_row, running_sums


def head_chunk_bwd(q, k, qT, v, do, a_col, a_row, S, dS, *, scale, dtype):
    """No or per-head decay: `(dq, dk, dv, dS entering)` of one chunk, float32.
    `a_col` [C, 1], `a_row` [1, C]; no decay is A = 0 (exact: every factor is 1)."""
    C = q.shape[0]
    if a_col is None:
        a_col, a_row = jnp.zeros((C, 1), F32), jnp.zeros((1, C), F32)
    decay = exp_where(iota((C, C), 0) >= iota((C, C), 1), a_col - a_row)  # [i, j] e^{A_i − A_j}, j ≤ i
    decay_t = exp_where(iota((C, C), 0) <= iota((C, C), 1), a_row - a_col)  # [j, i], the same transposed
    a_last = pick_col(a_row, C - 1)  # [1, 1]
    from_start, to_end = jnp.exp(a_col), jnp.exp(a_last - a_col)  # [C, 1] e^{A_i}, e^{A_L − A_j}
    dP = scale * mm_nt(do, v, dtype) * decay  # [i, j]
    dP_t = scale * mm_nt(v, do, dtype) * decay_t  # [j, i]
    P_t = scale * mm_nt(k, q, dtype) * decay_t  # [j, i]
    dq = mm(dP, k, dtype) + scale * mm_nt(do, S, dtype) * from_start
    dk = mm(dP_t, q, dtype) + mm_nt(v, dS, dtype) * to_end
    dv = mm(P_t, do, dtype) + mm(k * to_end, dS, dtype)
    dS_entering = jnp.exp(a_last) * dS + scale * mm(qT * jnp.exp(a_row), do, dtype)  # qT [K, C]
    return dq, dk, dv, dS_entering


def diagonal_bwd(q_s, k_s, do_s, a_s, dP_s, dq, dk, dv, p: int, *, scale, dtype, group: int = DIAGONAL_GROUP):
    """Add the exact diagonal block of sub-block [p, p + c) to its (dq, dk, dv); `dP_s` [c, C] =
    scale · do_s vᵀ for the sub-block's queries. As `_channel.diagonal_scores`: pairs in different
    groups of g rows by block matmuls anchored at the row before the query's group, pairs inside
    a group in g element-wise steps (step t: each row's group's t-th key, gathered and scattered
    back by selection products)."""
    c = q_s.shape[0]
    dP, dP_t = diagonal_block(dP_s, p)  # [i, j] the diagonal block of dP, [j, i] the same transposed
    groups = DiagonalGroups(a_s, group)
    for from_anchor, to_anchor in groups.across():  # e^{A_i − A_r} on the query group, e^{A_r − A_j} on j < s
        q_g, k_g = q_s * from_anchor, k_s * to_anchor
        dq += from_anchor * mm(dP, k_g, dtype)
        dk += to_anchor * mm(dP_t, q_g, dtype)
        dv += mm(scale * mm_nt(k_g, q_g, dtype), do_s, dtype)  # Pᵀ [j, i] of the group's pairs
    for t, pick, E_t in groups.within():  # key g·⌊i/g⌋ + t of each query row i's own group, j ≤ i
        scatter = group_scatter(c, groups.g, t)  # [j, i]: pick transposed
        k_t = mm(pick, k_s, F32)
        qE = q_s * E_t
        P_t = scale * jnp.sum(qE * k_t, axis=1, keepdims=True)  # [c, 1] P[i, j]
        dP_i = jnp.sum(pick * dP, axis=1, keepdims=True)  # [c, 1] dP[i, j]
        dq += dP_i * k_t * E_t
        dk += mm(scatter, dP_i * qE, F32)
        dv += mm(scatter, P_t * do_s, F32)
    return dq, dk, dv


def key_sub_block_bwd(q, k, v, do, a, a_last, S, dS, p: int, c: int, *, scale, dtype, group: int):
    """Per-channel decay: (dq, dk, dv) of rows [p, p + c), float32."""
    C = q.shape[0]
    q_s, k_s, v_s, do_s, a_s = (x[p : p + c] for x in (q, k, v, do, a))
    dP_s = scale * mm_nt(do_s, v, dtype)  # [c, C]
    dq = scale * mm_nt(do_s, S, dtype) * jnp.exp(a_s)  # from the state entering the chunk
    to_end = jnp.exp(a_last - a_s)  # [c, K]
    dk = mm_nt(v_s, dS, dtype) * to_end  # from the state leaving the chunk
    dv = mm(k_s * to_end, dS, dtype)
    if p > 0:  # keys j < p, anchored at r = p − 1
        a_r, k_anchor = before_anchor(k, a, p)  # [C, K]; 0 for j ≥ p
        dq += mm(dP_s, k_anchor, dtype) * jnp.exp(a_s - a_r)
    if p + c < C:  # queries i > r = p + c − 1, anchored at r
        a_r, q_hat = after_anchor(q, a, p + c - 1)  # [C, K]; 0 for i ≤ r
        k_factor = jnp.exp(a_r - a_s)  # [c, K] e^{A_r − A_j}
        P_t = scale * mm_nt(k_s * k_factor, q_hat, dtype)  # [c, C] = Pᵀ rows j
        dP_t = scale * mm_nt(v_s, do, dtype)  # [c, C]
        dk += k_factor * mm(dP_t, q_hat, dtype)
        dv += mm(P_t, do, dtype)
    return diagonal_bwd(q_s, k_s, do_s, a_s, dP_s, dq, dk, dv, p, scale=scale, dtype=dtype, group=group)


def gate_terms(q, dq, k, dk):
    """dB = q ⊙ dq − k ⊙ dk, [rows, K] float32 (the driver's docstring)."""
    return q * dq - k * dk


class HeadGateColumn:
    """Head i's column `index` (traced) of a step's [C, H] per-head gate gradient block;
    writing a [C, 1] column puts it there by a masked select (the step's first head zeroes the
    other columns: the block's other head blocks' columns are theirs, summed by the wrapper)."""

    def __init__(self, ref, index, first: bool):
        self.ref, self.index, self.first = ref, index, first

    def __setitem__(self, index, column):
        ref = self.ref
        mine = iota(ref.shape, 1) == self.index
        ref[...] = jnp.where(mine, column, 0.0 if self.first else ref[...])


def head_gate_block(specs: tiles.Specs) -> tiles.Block:
    """[nV, nH, B, Tp, H] -> [C, H]: the per-head gate gradient of one value block and head block
    (nH = H / Hb), every head's column, head i's column h · Hb + i (`HeadGateColumn`)."""
    s = specs.s
    spec = tiles._block_spec((None, None, None, s.C, s.H), lambda b, h, j, n, *m: (j, h, b, specs.chunk(n), 0))
    return tiles.Block(spec, lambda ref, i: HeadGateColumn(ref, pl.program_id(1) * s.Hb + i, first=i == 0))


def _backward_head(refs: list, flags, *, static: KernelConfig, specs: tiles.Specs):
    """One head's chunk: `refs` are its views of the step's blocks (`_launch`)."""
    q_ref, k_ref, v_ref = take(refs, 3)
    decay_refs = take(refs, len(specs.lane_decay(static.gate)))
    do_ref, states_ref, hT_ref, dhT_ref, dq_ref, dk_ref, dv_ref, dh0_ref = take(refs, 8)
    dg_ref = refs.pop(0) if static.gate is not None else None
    dS_ref, after_ref = refs

    first, last, step0 = flags
    dtype, scale = tiles.matmul_dtype(q_ref.dtype), static.scale
    start_carries(step0, last, [(dS_ref, dhT_ref), (after_ref, hT_ref)])  # the walk starts at the last chunk

    S, dS = states_ref[...], dS_ref[...]
    boundary = None if dg_ref is None else jnp.sum(after_ref[...] * dS, axis=1, keepdims=True)  # [K, 1] Σ_V S⁺⊙dS
    q, k, v, do = (tiles.token(r) for r in (q_ref, k_ref, v_ref, do_ref))  # cleaned at load
    qT = q.T  # [K, C], in VMEM
    a, aT = tiles.read_decay(decay_refs, static.gate, local_sums=True) or (None, None)
    C = q.shape[0]
    if static.gate is Gate.KEY:
        c = static.tiles.sub
        a_last = pick_row(a, C - 1)  # [1, K]
        for p in range(0, C, c):
            dq, dk, dv = key_sub_block_bwd(q, k, v, do, a, a_last, S, dS, p, c, scale=scale, dtype=dtype,
                                           group=static.tiles.group)
            dq_ref[p : p + c, :] = dq.astype(dq_ref.dtype)
            dk_ref[p : p + c, :] = dk.astype(dk_ref.dtype)
            dv_ref[p : p + c, :] = dv.astype(dv_ref.dtype)
            dg_ref[p : p + c, :] = gate_terms(q[p : p + c], dq, k[p : p + c], dk)  # dB, summed below
        dg_ref[...] = running_sums(dg_ref[...], reverse=True) + tiles.row_of(boundary)
        aT_last = pick_col(aT, C - 1)  # [K, 1]
        dS_entering = jnp.exp(aT_last) * dS + scale * mm(qT * jnp.exp(aT), do, dtype)
    else:
        dq, dk, dv, dS_entering = head_chunk_bwd(q, k, qT, v, do, a, aT, S, dS, scale=scale, dtype=dtype)
        for x, ref in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
            ref[...] = x.astype(ref.dtype)
        if dg_ref is not None:  # per head: the K channels summed, then the suffix sums of a column
            dB = jnp.sum(gate_terms(q, dq, k, dk), axis=1, keepdims=True)  # [C, 1]
            dg_ref[...] = running_sums(dB, reverse=True) + jnp.sum(boundary, axis=0, keepdims=True)
    dS_ref[...] = dS_entering
    after_ref[...] = S
    finish_carry(first, dh0_ref, dS_entering)


def gradient_dtype(dtype, kernel_dtype, s: tiles.Shapes):
    """The dtype the kernel writes dq or dk in: the caller's (`dtype`) where it is the kernel's
    operand dtype and nothing is summed after the kernel (one value block, no shared query/key
    heads), else float32 (summed, or cast, by the wrapper)."""
    exact = s.nV == 1 and s.groups == 1 and jnp.dtype(dtype) == jnp.dtype(kernel_dtype)
    return jnp.dtype(dtype) if exact else jnp.dtype(F32)


def summed(x, axes: int):
    """`x` summed over its `axes` leading axes (taken, a free reshape, where they are all 1)."""
    lead = x.shape[:axes]
    return x.reshape(x.shape[axes:]) if all(n == 1 for n in lead) else x.sum(tuple(range(axes)))


@functools.partial(jax.jit, static_argnames=("static", "grad_dtypes"))
def chunk_backward(q, k, v, a, do, states, h_T, dh_T, meta=None, *, static: KernelConfig, grad_dtypes=None):
    """Launch the backward kernel: the driver's `PallasBackend.backward` contract with
    `gate_in_kernel` (`kernels/_recurrent_driver.py`); `grad_dtypes` (q's, k's, v's; default
    q's dtype) are the dtypes dq, dk and dv are cast to (dv is written in v's where that is the
    kernel's operand dtype). q, k, v, do and the decay are read lane-dense
    token-major (`_tiles.token_lanes`; float16 upcast); dq, dk [nV, B, Tp, H · K] come out in
    the caller's dtype where nothing is summed after the kernel (`gradient_dtype`), else float32
    summed over value blocks and shared query/key heads here; the gate gradient per value block
    (per head: per value and head block, [nV, H / Hb, B, Tp, H]) is summed here where there are
    several."""
    grad_dtypes = grad_dtypes or (q.dtype,) * 3
    kdt = tiles.kernel_dtype(q.dtype)
    q, k, v, do = (x.astype(kdt) for x in (q, k, v, do))
    s = recurrent_shapes(q, v, static, backward=True)
    specs = tiles.Specs(s, backward=True, varlen=meta is not None)
    R = h_T.shape[0]

    state = specs.per_head(specs.state())
    ins = [specs.lanes_qk(), specs.lanes_qk(), specs.lanes_v(), *specs.lane_decay(static.gate), specs.lanes_v(),
           specs.per_head(specs.chunk_states()), state, state]
    inputs = [tiles.token_lanes(x) for x in (q, k, v)]
    inputs += [] if a is None else [tiles.token_lanes(a) if static.gate is Gate.KEY else a]
    inputs += [tiles.token_lanes(do), states, h_T.astype(F32), dh_T.astype(F32)]

    dq_dtype, dk_dtype = (gradient_dtype(d, kdt, s) for d in grad_dtypes[:2])
    dv_dtype = grad_dtypes[2] if jnp.dtype(grad_dtypes[2]) == jnp.dtype(kdt) else F32  # dv is no partial sum
    outs = [specs.lanes_partial(), specs.lanes_partial(), specs.lanes_v(), state]
    out_shape = [
        output_type((s.nV, s.B, s.Tp, s.H * s.K), dq_dtype, q),
        output_type((s.nV, s.B, s.Tp, s.H * s.K), dk_dtype, q),
        output_type((s.B, s.Tp, s.H * s.V), dv_dtype, q),
        output_type((R, s.H, s.K, s.V), F32, q),
    ]
    if static.gate is Gate.KEY:
        outs.append(specs.lanes_partial())
        out_shape.append(output_type((s.nV, s.B, s.Tp, s.H * s.K), F32, q))
    elif static.gate is Gate.HEAD:
        outs.append(head_gate_block(specs))
        out_shape.append(output_type((s.nV, s.H // s.Hb, s.B, s.Tp, s.H), F32, q))
    scratch = [specs.per_head(specs.state_scratch())] * 2  # dS, S⁺
    blocks = ins + outs + scratch
    dq, dk, dv, dh0, *dg = launch(functools.partial(_backward_head, static=static, specs=specs), inputs,
                                  [b.spec for b in ins], [b.spec for b in outs], out_shape,
                                  [b.spec for b in scratch], meta, specs=specs, static=static,
                                  name="recurrax_tpu_chunk_bwd", views=[b.view for b in blocks])
    dq, dk = (tiles.from_lanes(summed(x, 1), s.H) for x in (dq, dk))
    dq, dk = (sum_groups(x, s.G or s.H) for x in (dq, dk))
    if not dg:
        dg = None
    elif static.gate is Gate.KEY:
        dg = tiles.from_lanes(summed(dg[0], 1), s.H)
    else:
        dg = summed(dg[0], 2)
    return dq, dk, tiles.from_lanes(dv, s.H), dh0, dg
