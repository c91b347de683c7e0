"""Per-key-channel decay inside one chunk, for the Mosaic GPU kernels (`gk`, `g` per channel).

| symbol   | meaning                                                                     |
|----------|-----------------------------------------------------------------------------|
| C, c     | chunk length 64 (the wgmma M); sub-block length c = 16, so C / c = 4 blocks |
| A        | [C, K] float32 chunk-local cumulative log decay, A_ik = Σ_{s ≤ i} g_sk       |
| β(i)     | the sub-block of token i, ⌊i / c⌋                                            |
| r        | an anchor token: the last token of a sub-block                              |
| P        | [C, C] decayed causal scores P_ij = Σ_k q_ik k_jk e^{A_ik − A_jk}, j ≤ i     |
| dP       | [C, C] scale · (do vᵀ) masked to j ≤ i (the decay sits inside the K sums)   |

A per-channel decay sits inside the contraction over k, so P is no `(q kᵀ) ⊙ D`. The exact
split that keeps every exponent ≤ 0 (gates ≤ 0; nothing can overflow):

* **Earlier sub-blocks** (β(j) < β(i)): with r the last token before i's sub-block,
  e^{A_i − A_j} = e^{A_i − A_r} · e^{A_r − A_j}, both factors ≤ 0 (j ≤ r < i). For each
  anchor r = s·c − 1 (s = 1, 2, 3) one wgmma: (q ⊙ e^{A − A_r} on the rows of block s) times
  (k ⊙ e^{A_r − A} on the rows j ≤ r)ᵀ; exponents outside those rows are −inf before `exp`.
  A wgmma's M is 64, so each of the three products is a full [C, K]·[K, C] of which a
  quarter to three quarters is used: tensor cores are cheap next to the element-wise rest.
* **The same sub-block** (β(j) = β(i), j ≤ i) has no anchor that keeps both factors ≤ 0:
  those entries are summed element-wise, one key column j at a time, P_ij = Σ_k q_ik k_jk
  e^{A_ik − A_jk} over the C rows (rows of other blocks masked to −inf): C iterations of a
  [C, K] tile each. The row vectors k_j and A_j are loaded from memory in the column layout.

The backward needs the same two sums with other operands (derivation in `_backward`):
dq_i ∋ Σ_{j ≤ i} dP_ij k_j ⊙ e^{A_i − A_j} (anchors before i's block, as for P) and
dk_j ∋ Σ_{i ≥ j} dP_ij q_i ⊙ e^{A_i − A_j} (anchors r = the last token of j's block, the
factors e^{A_r − A_j} and e^{A_i − A_r}, i > r).

Every function takes `Rows`: where the row vectors come from and the SMEM operand tiles.
Row vectors are loaded from GMEM (q, k: `plgpu.load` of one token's [K]) and from an SMEM
copy of A (the anchors and A_j): loading one SMEM buffer in two register layouts (the
[C, K] tile and its rows) does not lower on Mosaic GPU (JAX 0.12), so the [C, K] tile of A
is read from GMEM.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from ._tiles import CHUNK, COLS, F32, along_cols, along_rows, iota, matmul

SUB = 16
"""c, the sub-block length: anchors every 16 tokens, as fla's chunk_gla."""
BLOCKS = CHUNK // SUB


@dataclasses.dataclass(frozen=True)
class Rows:
    """One chunk's operands for the per-channel sums.

    - `a`: [C, K] float32 SMEM ref, A (for its rows A_j and the anchors A_r);
    - `q`, `k`: [C, K] GMEM refs (views of the chunk's tokens), for the rows q_i, k_j;
    - `lhs`, `rhs`: [C, K] swizzled SMEM tiles in the input dtype, wgmma operands.
    """

    a: Any
    q: Any
    k: Any
    lhs: Any
    rhs: Any

    def a_row(self, t):
        return plgpu.load(self.a.at[t], layout=COLS)

    def row(self, ref, t):
        return gmem_load(ref.at[t], COLS).astype(F32)


def gmem_load(ref, layout):
    """A register array in `layout` straight from GMEM. `optimized=False`: these reads
    (one token's row, a tile in the WGMMA layout) are not whole 32-byte sectors per warp,
    which the optimized transfer planner refuses."""
    return plgpu.load(ref, layout=layout, optimized=False)


def exp_masked(keep, exponent):
    """e^{exponent} where `keep`, exactly 0 elsewhere (masked before `exp`: no overflow)."""
    return jnp.exp(jnp.where(keep, exponent, -jnp.inf))


def _token_and_block(shape):
    token = iota(shape, 0)
    return token, token // SUB


def scores(q, k, A, rows: Rows) -> jax.Array:
    """[C, C] float32 P (module table), masked to j ≤ i; uses `rows.lhs` and `rows.rhs`."""
    C, K = A.shape
    token, block = _token_and_block((C, K))
    P = plgpu.layout_cast(jnp.zeros((C, C), F32), plgpu.Layout.WGMMA)
    for s in range(1, BLOCKS):  # keys of earlier sub-blocks, anchored at r = s·c − 1
        a_r = along_cols(rows.a_row(s * SUB - 1), (C, K))
        rows.lhs[...] = (q * exp_masked(block == s, A - a_r)).astype(rows.lhs.dtype)
        rows.rhs[...] = (k * exp_masked(token <= s * SUB - 1, a_r - A)).astype(rows.rhs.dtype)
        plgpu.commit_smem()
        P = P + matmul(rows.lhs, rows.rhs.T, (C, C))
    column = iota((C, C), 1)

    def same_block(j, P):
        k_j, a_j = along_cols(rows.row(rows.k, j), (C, K)), along_cols(rows.a_row(j), (C, K))
        keep = (token >= j) & (block == j // SUB)
        P_j = jnp.sum(q * k_j * exp_masked(keep, A - a_j), axis=1)  # [C]
        return P + jnp.where(column == j, along_rows(P_j, (C, C)), 0.0)  # the anchored terms are 0 there

    return lax.fori_loop(0, C, same_block, P)


def _column(x, j):
    """Column j of a [C, C] register tile, as a [C] vector along its rows."""
    return jnp.sum(jnp.where(iota(x.shape, 1) == j, x, 0.0), axis=1)


def dq_within(dP, dP_smem, k, A, rows: Rows) -> jax.Array:
    """[C, K] Σ_{j ≤ i} dP_ij k_j ⊙ e^{A_i − A_j}; `dP_smem` holds dP in the input dtype."""
    C, K = A.shape
    token, block = _token_and_block((C, K))
    dq = plgpu.layout_cast(jnp.zeros((C, K), F32), plgpu.Layout.WGMMA)
    for s in range(1, BLOCKS):  # keys j ≤ r = s·c − 1 for queries of block s
        a_r = along_cols(rows.a_row(s * SUB - 1), (C, K))
        rows.rhs[...] = (k * exp_masked(token <= s * SUB - 1, a_r - A)).astype(rows.rhs.dtype)
        plgpu.commit_smem()
        dq = dq + exp_masked(block == s, A - a_r) * matmul(dP_smem, rows.rhs, (C, K))

    def same_block(j, dq):
        k_j, a_j = along_cols(rows.row(rows.k, j), (C, K)), along_cols(rows.a_row(j), (C, K))
        keep = (token >= j) & (block == j // SUB)
        return dq + along_rows(_column(dP, j), (C, K)) * k_j * exp_masked(keep, A - a_j)

    return lax.fori_loop(0, C, same_block, dq)


def dk_within(dPt, dPt_smem, q, A, rows: Rows) -> jax.Array:
    """[C, K] Σ_{i ≥ j} dP_ij q_i ⊙ e^{A_i − A_j} (rows: keys j); `dPt` = dPᵀ, and
    `dPt_smem` holds it in the input dtype."""
    C, K = A.shape
    token, block = _token_and_block((C, K))
    dk = plgpu.layout_cast(jnp.zeros((C, K), F32), plgpu.Layout.WGMMA)
    for s in range(BLOCKS - 1):  # queries i > r = (s + 1)·c − 1 for keys of block s
        r = (s + 1) * SUB - 1
        a_r = along_cols(rows.a_row(r), (C, K))
        rows.rhs[...] = (q * exp_masked(token > r, A - a_r)).astype(rows.rhs.dtype)
        plgpu.commit_smem()
        dk = dk + exp_masked(block == s, a_r - A) * matmul(dPt_smem, rows.rhs, (C, K))

    def same_block(i, dk):
        q_i, a_i = along_cols(rows.row(rows.q, i), (C, K)), along_cols(rows.a_row(i), (C, K))
        keep = (token <= i) & (block == i // SUB)
        return dk + along_rows(_column(dPt, i), (C, K)) * q_i * exp_masked(keep, a_i - A)

    return lax.fori_loop(0, C, same_block, dk)
