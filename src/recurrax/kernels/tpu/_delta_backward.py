"""Backward Pallas TPU kernel of the delta rule's chunk algorithm: every input's gradient.

| symbol  | meaning                                                                   |
|---------|---------------------------------------------------------------------------|
| C, c    | chunk length (one grid step), sub-block length (per-channel decays)       |
| S       | [K, BV] state entering the chunk (recomputed by the forward kernel)       |
| Ē       | [K, BV] gradient of the state leaving the chunk, VMEM scratch, float32    |
| A_t     | chunk-local inclusive cumulative log decay; A_L the chunk's last          |
| K̃, K̂, Q̃ | K ⊙ e^{A}, K ⊙ e^{A_L − A}, Q ⊙ e^{A} (`DecayFactors`)                      |
| L, P    | key scores (strictly lower), query scores (lower) of `_delta_forward`     |
| X, β    | (I + diag(β) L)⁻¹, the write strengths as a [C, 1] column                  |
| U, R    | the written values X (β ⊙ R), the residual R = V − K̃ S                    |
| X̄       | ∂L/∂X for every quantity X                                                |

The grid walks the chunks of each (row, head block, value block) from last to first (Hb heads a
step, one after another), carrying Ē
(the final state's cotangent at a sequence's last chunk). The chunk is `_delta_forward`'s:

    (I + diag(β) L) U = diag(β) R,   O = scale (Q̃ S + P U),   E = γ S + K̂ᵀ U   (γ = e^{A_L})

and its adjoint is that of `recurrax.delta._chunk_adjoint` (whose docstring derives it),
with the solve's adjoint taken against U directly: differentiating (I + M) U = diag(β) R
gives, with Ȳ = Xᵀ Ū,

    Ū = scale Pᵀ Ō + K̂ Ē,    M̄ = −Ȳ Uᵀ (strictly lower),   R̄ = β ⊙ Ȳ
    V̄ = β ⊙ Ȳ,   K̃̄ = −(β ⊙ Ȳ) Sᵀ,   β̄ = Σ_V Ȳ ⊙ R + Σ_s M̄ ⊙ L,   L̄ = β ⊙ M̄
    S̄ = scale Q̃ᵀ Ō + γ Ē − K̃ᵀ (β ⊙ Ȳ)                         (the gradient entering)

and the scores' adjoints as `_chunk_adjoint`'s: with apply(G, y)_t = Σ_{s≤t} G_ts y_s ⊙ e^{A_t − A_s}
and apply_t(G, x)_s = Σ_{t≥s} G_ts x_t ⊙ e^{A_t − A_s} (`decayed_products`), P̄ = scale Ō Uᵀ
split into its strictly lower part P̄ₛ and its diagonal d,

    Q̄ = apply(P̄ₛ, K) + d ⊙ K + Q̃̄ ⊙ e^{A}
    K̄ = apply_t(P̄ₛ, Q) + d ⊙ Q + apply(L̄, K) + apply_t(L̄, K) + K̃̄ ⊙ e^{A} + K̂̄ ⊙ e^{A_L − A}
    ā_u = Σ_{t≥u} Ā_t + Σ_{t<u} K̂_t ⊙ K̂̄_t + Σ_V (γ S) ⊙ Ē
    Ā = Q ⊙ apply(P̄ₛ, K) − K ⊙ apply_t(P̄ₛ, Q) + K ⊙ (apply(L̄, K) − apply_t(L̄, K)) + Q̃ ⊙ Q̃̄ + K̃ ⊙ K̃̄

where ā is the gradient of the per-token log decay (summed over K for a per-head decay) and
the two chunk sums are products with triangular ones matrices. M̄, K̃̄, β̄, Q̄, K̄ and ā contract
over the value columns, so each value block writes a partial sum that the wrapper adds up; V̄
and S̄ are the block's own columns.

**Layout** as the forward's (`_tiles`, `_delta_forward`): q, k, v, do, a per-channel decay
read and dq, dk (per value head), dv, a per-channel ā written lane-dense token-major in
[C, Hb·D] blocks; β and a per-head decay read as [C, H] blocks, β̄ and a per-head ā written as
columns of a [C, H] block per (value block, head block) ([nV, H / Hb, B, Tp, H], summed here:
a reduction, no transpose); the query/key heads' gradients summed over the value heads sharing
each here. The products with a transposed left operand are Pᵀ Ō and Xᵀ Ū, taken on [C, C]
float32 tiles transposed in VMEM (`x.T`, C a multiple of 128: a 32-bit transpose Mosaic
lowers), and Q̃ᵀ Ō, K̃ᵀ (β ⊙ Ȳ), on qᵀ and kᵀ transposed in VMEM. **Stability**: per-channel decays as in the `recurrent` backward (`_recurrent_backward.py`):
sub-blocks of c rows, anchors r = p − 1 (apply) and r = p + c − 1 (apply_t), every factor
≤ 0, the diagonal block as `_channel.diagonal_scores` (groups of 4 rows anchored at the row
before each, element-wise inside a group).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..._core.problem import Gate
from .._driver import KernelConfig, output_type
from .._recurrent_driver import sum_groups
from . import _tiles as tiles
from ._channel import DIAGONAL_GROUP, DiagonalGroups, after_anchor, before_anchor, diagonal_block, group_scatter
from ._delta_forward import DecayFactors, chunk_scores, chunk_writes, delta_shapes
from ._launch import finish_carry, launch, start_carries, take
from ._tiles import F32, exp_where, iota, mm, mm_nt


def _diagonal_products(G_s, y_s, x_s, a_s, ay, ax, p: int, dtype):
    """Add the diagonal block of sub-block [p, p + c) to apply(G, y) and apply_t(G, x) of its
    rows (`ay`, `ax` [c, K]); `G_s` [c, C] are G's rows. As `_channel.diagonal_scores`: pairs in
    different groups of g rows by block matmuls anchored at the row before the later group,
    pairs inside a group in g element-wise steps."""
    c = a_s.shape[0]
    G, G_t = diagonal_block(G_s, p)  # [t, s] the diagonal block of G, [s, t] the same transposed
    groups = DiagonalGroups(a_s, DIAGONAL_GROUP)
    for from_anchor, to_anchor in groups.across():  # e^{A_t − A_r} on the later group, e^{A_r − A_s} on s < start
        ay += from_anchor * mm(G, y_s * to_anchor, dtype)
        ax += to_anchor * mm(G_t, x_s * from_anchor, dtype)
    for step, pick, E in groups.within():  # column g·⌊t/g⌋ + step of each row t's own group, j ≤ t
        scatter = group_scatter(c, groups.g, step)
        y_j = mm(pick, y_s, F32)
        G_j = jnp.sum(pick * G, axis=1, keepdims=True)  # [c, 1] G[t, j]
        ay += G_j * y_j * E
        ax += mm(scatter, G_j * x_s * E, F32)
    return ay, ax


def _channel_products(G, y, x, a, c: int, dtype):
    """(apply(G, y), apply_t(G, x)) for a per-channel decay A [C, K], by sub-blocks of c rows."""
    C, K = y.shape
    Gt = G.T  # [C, C] float32
    applied, applied_t = [], []
    for p in range(0, C, c):
        a_s = a[p : p + c]
        ay = ax = jnp.zeros((c, K), F32)
        if p > 0:  # s < p, anchored at r = p − 1
            a_r, y_anchor = before_anchor(y, a, p)  # [C, K]; 0 for s ≥ p
            ay = mm(G[p : p + c], y_anchor, dtype) * jnp.exp(a_s - a_r)
        if p + c < C:  # t > r = p + c − 1, anchored at r
            a_r, x_anchor = after_anchor(x, a, p + c - 1)  # [C, K]; 0 for t ≤ r
            ax = mm(Gt[p : p + c], x_anchor, dtype) * jnp.exp(a_r - a_s)
        ay, ax = _diagonal_products(G[p : p + c], y[p : p + c], x[p : p + c], a_s, ay, ax, p, dtype)
        applied.append(ay)
        applied_t.append(ax)
    return jnp.concatenate(applied, axis=0), jnp.concatenate(applied_t, axis=0)


def decayed_products(G, y, x, decay, gate: Gate | None, c: int, dtype):
    """(apply(G, y), apply_t(G, x)) of a lower-triangular G [C, C] (module docstring), [C, K]."""
    C = G.shape[0]
    if gate is Gate.KEY:
        return _channel_products(G, y, x, decay[0], c, dtype)
    if gate is Gate.HEAD:
        a_col, a_row = decay
        G = G * exp_where(iota((C, C), 0) >= iota((C, C), 1), a_col - a_row)
    return mm(G, y, dtype), mm(G.T, x, dtype)


def _chunk_sums(through, after):
    """Σ_{t≥u} through_t + Σ_{t<u} after_t for every row u, [C, K] (triangular ones products)."""
    C = through.shape[0]
    rows, cols = iota((C, C), 0), iota((C, C), 1)
    return mm((cols >= rows).astype(F32), through, F32) + mm((cols < rows).astype(F32), after, F32)


def delta_chunk_bwd(q, k, qT, kT, v, beta, decay, S, do, dE, *, gate: Gate | None, c: int, scale: float, dtype):
    """One chunk's adjoint: `(dq, dk [C, K], dv [C, BV], dβ [C, 1], da [C, 1 or K] or None,
    dS entering [K, BV])`, float32 (dq, dk, dβ, da: this value block's partial sums)."""
    C = q.shape[0]
    f = DecayFactors.of(decay)
    strictly_lower = iota((C, C), 0) > iota((C, C), 1)
    U, L, X, residual = chunk_writes(k, v, beta, decay, S, gate=gate, c=c, dtype=dtype)
    P = chunk_scores(q, k, decay, gate, c, dtype)  # [C, C] lower
    k_start, k_end = f.from_start(k), f.to_end(k)

    dU = scale * mm(P.T, do, dtype) + mm(k_end, dE, F32)  # [C, BV]
    dP_lower = jnp.where(strictly_lower, scale * mm_nt(do, U, dtype), 0.0)  # P̄ₛ
    d_diagonal = scale * jnp.sum(do * U, axis=1, keepdims=True)  # [C, 1]
    dq_start = scale * mm_nt(do, S, dtype)  # Q̃̄ [C, K]
    dk_end = mm_nt(U, dE, F32)  # K̂̄ [C, K]
    Y = mm(X.T, dU, F32)  # Ȳ [C, BV]
    dv = beta * Y
    dk_start = -mm_nt(dv, S, F32)  # K̃̄ [C, K]
    dM = jnp.where(strictly_lower, -mm_nt(Y, U, F32), 0.0)
    d_beta = jnp.sum(Y * residual, axis=1, keepdims=True) + jnp.sum(dM * L, axis=1, keepdims=True)
    dS_entering = (f.state_rows() * dE + scale * mm(f.from_start_t(qT), do, dtype)
                   - mm(f.from_start_t(kT), dv, F32))

    q_scores, k_scores = decayed_products(dP_lower, k, q, decay, gate, c, dtype)
    k_rows, k_cols = decayed_products(beta * dM, k, k, decay, gate, c, dtype)
    dq = q_scores + d_diagonal * k + f.from_start(dq_start)
    dk = k_scores + d_diagonal * q + k_rows + k_cols + f.from_start(dk_start) + f.to_end(dk_end)
    if gate is None:
        return dq, dk, dv, d_beta, None, dS_entering
    through = (q * q_scores - k * k_scores + k * (k_rows - k_cols) + f.from_start(q) * dq_start
               + k_start * dk_start)
    kept = mm_nt(jnp.ones((C, S.shape[1]), F32), S * dE, F32) * f.state_columns()  # [C, K] Σ_V (γ S) ⊙ Ē
    da = _chunk_sums(through, k_end * dk_end) + kept
    return dq, dk, dv, d_beta, (da if gate is Gate.KEY else jnp.sum(da, axis=1, keepdims=True)), dS_entering


def _delta_backward_head(refs: list, flags, *, static: KernelConfig):
    """One head's chunk: `refs` are its views of the step's blocks (`_launch`)."""
    q_ref, k_ref, v_ref, beta_ref = take(refs, 4)
    decay_refs = take(refs, 0 if static.gate is None else 1)
    do_ref, states_ref, dhT_ref, dq_ref, dk_ref, dv_ref, dbeta_ref, dh0_ref = take(refs, 8)
    da_ref = refs.pop(0) if static.gate is not None else None
    (dE_ref,) = refs

    first, last, step0 = flags
    start_carries(step0, last, [(dE_ref, dhT_ref)])  # the walk starts at the last chunk
    decay = tiles.read_decay(decay_refs, static.gate)
    q, k, v, beta, do = (tiles.token(r) for r in (q_ref, k_ref, v_ref, beta_ref, do_ref))  # β [C, 1]; cleaned at load
    qT, kT = q.T, k.T  # [K, C], in VMEM
    dq, dk, dv, d_beta, da, dS_entering = delta_chunk_bwd(
        q, k, qT, kT, v, beta, decay, states_ref[...], do, dE_ref[...], gate=static.gate, c=static.tiles.sub,
        scale=static.scale, dtype=tiles.matmul_dtype(q_ref.dtype))
    dq_ref[...], dk_ref[...], dv_ref[...], dbeta_ref[...] = dq, dk, dv, d_beta
    if da_ref is not None:
        da_ref[...] = da
    dE_ref[...] = dS_entering
    finish_carry(first, dh0_ref, dS_entering)


@functools.partial(jax.jit, static_argnames=("static",))
def delta_backward(q, k, v, beta, a, do, states, dh_T, meta=None, *, static: KernelConfig):
    """Launch the backward kernel: `(dq, dk [B, Tp, G, K], dv [B, Tp, H, V], dβ [B, Tp, H],
    da (like `a`, or None), dh0 [R, H, K, V])`, float32; `da` is the gradient of the per-token
    log decay whose chunk-local cumulative sum is `a`, dq and dk summed over the value heads
    sharing each query/key head.

    **Arguments:** as `delta_forward`'s, and `do` [B, Tp, H, V] the output's cotangent, `states`
    [B, H, N, K, V] the states entering the chunks (`delta_forward(..., emit_states=True)`),
    `dh_T` [R, H, K, V] the final states' cotangent. dh0 is written only for sequences that
    own a chunk.
    """
    kdt = tiles.kernel_dtype(q.dtype)
    q, k, v, do = (x.astype(kdt) for x in (q, k, v, do))
    s = delta_shapes(q, v, static, backward=True)
    specs = tiles.Specs(s, backward=True, varlen=meta is not None)
    R = dh_T.shape[0]
    gate = static.gate

    state = specs.per_head(specs.state())
    ins = [specs.lanes_qk(), specs.lanes_qk(), specs.lanes_v(), specs.head_columns(), *specs.lane_decay(gate),
           specs.lanes_v(), specs.per_head(specs.chunk_states()), state]
    inputs = [tiles.token_lanes(x) for x in (q, k, v)] + [beta.astype(F32)]
    inputs += [] if a is None else [tiles.token_lanes(a) if gate is Gate.KEY else a]
    inputs += [tiles.token_lanes(do), states, dh_T.astype(F32)]

    per_head = lambda: (specs.head_columns_out(), output_type((s.nV, s.nH, s.B, s.Tp, s.H), F32, q))  # noqa: E731
    per_channel = lambda: (specs.lanes_partial(), output_type((s.nV, s.B, s.Tp, s.H * s.K), F32, q))  # noqa: E731
    outs = [per_channel(), per_channel(), (specs.lanes_v(), output_type((s.B, s.Tp, s.H * s.V), F32, q)), per_head(),
            (state, output_type((R, s.H, s.K, s.V), F32, q))]
    if gate is not None:
        outs.append(per_channel() if gate is Gate.KEY else per_head())
    blocks = ins + [b for b, _ in outs] + [specs.per_head(specs.state_scratch())]
    dq, dk, dv, d_beta, dh0, *da = launch(functools.partial(_delta_backward_head, static=static), inputs,
                                          [b.spec for b in ins], [b.spec for b, _ in outs], [t for _, t in outs],
                                          [blocks[-1].spec], meta, specs=specs, static=static,
                                          name="recurrax_tpu_delta_bwd", views=[b.view for b in blocks])
    G = q.shape[2]
    dq, dk = (sum_groups(tiles.from_lanes(x.sum(0), s.H), G) for x in (dq, dk))
    if da:
        da = tiles.from_lanes(da[0].sum(0), s.H) if gate is Gate.KEY else da[0].sum((0, 1))
    else:
        da = None
    return dq, dk, tiles.from_lanes(dv, s.H), d_beta.sum((0, 1)), da, dh0
