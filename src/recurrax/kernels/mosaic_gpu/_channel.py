"""Per-key-channel decay inside one chunk, for the Mosaic GPU kernels (`gk`, `g` per channel).

| symbol   | meaning                                                                     |
|----------|-----------------------------------------------------------------------------|
| C, c     | chunk length 64 (the wgmma M); sub-block length c = 16, so C / c = 4 blocks |
| A        | [C, K] float32 chunk-local cumulative log decay, A_ik = Σ_{s ≤ i} g_sk       |
| β(i)     | the sub-block of token i, ⌊i / c⌋                                            |
| r        | an anchor token: the last token of a sub-block                              |
| P        | [C, C] decayed causal scores P_ij = Σ_k q_ik k_jk e^{A_ik − A_jk}, j ≤ i     |
| dP       | [C, C] scale · (do vᵀ) masked to j ≤ i (the decay sits inside the K sums)   |
| panel    | 64 key channels (`PANEL`): [C, K] tiles are built, summed and returned per panel |

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

The backward needs the same two sums with other operands (derivation in `_recurrent_backward`):
dq_i ∋ Σ_{j ≤ i} dP_ij k_j ⊙ e^{A_i − A_j} (anchors before i's block, as for P) and
dk_j ∋ Σ_{i ≥ j} dP_ij q_i ⊙ e^{A_i − A_j} (anchors r = the last token of j's block, the
factors e^{A_r − A_j} and e^{A_i − A_r}, i > r).

Register budget: every [C, K] float32 tile (q, k, A and what is made of them) is formed one
panel of 64 channels at a time, loaded from memory where it is used rather than held
through the chunk step: at K = 128 four whole [C, K] tiles alone are 256 registers a
thread, which ptxas can only spill. Products with a masked factor are masked by `where`
(`decayed`), so a NaN or inf of a later token never reaches an earlier one through a zero
factor.

Every function takes `Rows`: where the tiles and row vectors come from and the SMEM operand tiles.
Row vectors are loaded from GMEM (q, k: `plgpu.load` of one token's [K]) and from the SMEM
copy of A (the anchors and A_j); the [C, K] tile of A comes from that copy too, and the q
and k tiles from their swizzled SMEM slots. An SMEM buffer read or written in two register
layouts (A: tile and rows; the score columns: written as a tile, read by rows) must stay
untiled, so its tile transfers are `optimized=False`: with the optimized ones, Mosaic GPU's
layout inference (JAX 0.12) searches for a tiling without end rather than fail.

The same-block terms of the backward take one column of dP (or dPᵀ) per key (query) j: a
[C] vector along the rows, read as row j of the transposed tile, which the caller stores
in float32 in a plain [C, C] SMEM tile (`dq_within`, `dk_within`): two values a thread,
where reducing a [C, C] register tile to one column held 32 more registers in the loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ._tiles import CHUNK, COLS, F32, ROWS, WGMMA, along_cols, along_rows, iota, matmul

SUB = 16
"""c, the sub-block length: anchors every 16 tokens, as fla's chunk_gla."""
BLOCKS = CHUNK // SUB
PANEL = 64
"""Key channels per register tile (one 128-byte swizzle row of 16-bit values)."""


def panels(K: int) -> range:
    return range(K // PANEL)


def panel_cols(p: int):
    return pl.ds(p * PANEL, PANEL)


@dataclasses.dataclass(frozen=True)
class Rows:
    """One chunk's operands for the per-channel sums.

    - `a`: [C, K] float32 SMEM ref (untiled), A: its rows A_j, the anchors A_r and its
      [C, PANEL] register tiles;
    - `q`, `k`: [C, K] GMEM refs (views of the chunk's tokens), for the rows q_i, k_j;
    - `q_s`, `k_s`: the chunk's [C, K] swizzled SMEM tiles of q and k (16-bit);
    - `lhs`, `rhs`: [C, K] swizzled SMEM tiles in the input dtype, wgmma operands.
    """

    a: Any
    q: Any
    k: Any
    q_s: Any
    k_s: Any
    lhs: Any
    rhs: Any

    def a_row(self, t, p: int):
        """A_t on panel p, in the COLS layout."""
        return plgpu.load(self.a.at[t, panel_cols(p)], layout=COLS)

    def row(self, ref, t, p: int):
        """Token t's row of a GMEM ref on panel p, float32, in the COLS layout."""
        return gmem_load(ref.at[t, panel_cols(p)], COLS).astype(F32)

    def A(self, p: int):
        """[C, PANEL] float32 A on panel p (`optimized=False`: the optimized transfer would
        need a tiled buffer, which its row loads cannot read)."""
        return plgpu.load(self.a.at[:, panel_cols(p)], layout=WGMMA, optimized=False)

    def tile(self, ref, p: int):
        """[C, PANEL] float32 panel p of a swizzled [C, K] SMEM tile (`q_s`, `k_s`)."""
        return plgpu.load(ref.at[:, panel_cols(p)], layout=WGMMA).astype(F32)

    def to_end(self, p: int):
        """[C, PANEL] e^{A_L − A} on panel p (A_L: the chunk's last token)."""
        return jnp.exp(along_cols(self.a_row(CHUNK - 1, p), (CHUNK, PANEL)) - self.A(p))


def gmem_load(ref, layout):
    """A register array in `layout` straight from GMEM. `optimized=False`: these reads
    (one token's row, a tile in the WGMMA layout) are not whole 32-byte sectors per warp,
    which the optimized transfer planner refuses."""
    return plgpu.load(ref, layout=layout, optimized=False)


def decayed(keep, x, exponent):
    """x ⊙ e^{exponent} where `keep`, exactly 0 elsewhere: masked by `where` before `exp` (no
    overflow) and after the product (a NaN or inf of x there stays out)."""
    return jnp.where(keep, x * jnp.exp(jnp.where(keep, exponent, -jnp.inf)), 0.0)


def _token_and_block(shape):
    """[C, n] int32 tiles: each row's token and sub-block, broadcast from a ROWS vector (one
    value per row a thread holds, not one per element)."""
    token = plgpu.broadcasted_iota(jnp.int32, (shape[0],), 0, layout=ROWS)
    return along_rows(token, shape), along_rows(token // SUB, shape)  # (the block: one division a row)


def scores(rows: Rows) -> jax.Array:
    """[C, C] float32 P (module table), masked to j ≤ i; uses `rows.lhs` and `rows.rhs`."""
    C, K = rows.lhs.shape
    shape = (C, PANEL)
    token, block = _token_and_block(shape)

    def anchored(s, P):  # keys of earlier sub-blocks, anchored at r = s·c − 1
        for p in panels(K):
            A, a_r = rows.A(p), along_cols(rows.a_row(s * SUB - 1, p), shape)
            rows.lhs[:, panel_cols(p)] = decayed(block == s, rows.tile(rows.q_s, p), A - a_r).astype(rows.lhs.dtype)
            rows.rhs[:, panel_cols(p)] = decayed(token <= s * SUB - 1, rows.tile(rows.k_s, p),
                                                 a_r - A).astype(rows.rhs.dtype)
        plgpu.commit_smem()
        return P + matmul(rows.lhs, rows.rhs.T, (C, C))

    P = lax.fori_loop(1, BLOCKS, anchored, plgpu.layout_cast(jnp.zeros((C, C), F32), WGMMA))
    column = iota((C, C), 1)
    for p in panels(K):
        q, A = rows.tile(rows.q_s, p), rows.A(p)

        def same_block(j, P):
            k_j, a_j = along_cols(rows.row(rows.k, j, p), shape), along_cols(rows.a_row(j, p), shape)
            keep = (token >= j) & (block == j // SUB)
            P_j = jnp.sum(decayed(keep, q * k_j, A - a_j), axis=1)  # [C]
            return P + jnp.where(column == j, along_rows(P_j, (C, C)), 0.0)  # the anchored terms are 0 there

        P = lax.fori_loop(0, C, same_block, P)
    return P


def dq_within(dP_smem, dP_cols, rows: Rows, p: int) -> jax.Array:
    """[C, PANEL] panel p of Σ_{j ≤ i} dP_ij k_j ⊙ e^{A_i − A_j}. `dP_smem`: dP in the input
    dtype (a swizzled wgmma operand); `dP_cols`: a plain [C, C] float32 SMEM tile holding dPᵀ,
    whose row j is the column dP_{·j} the same-block terms take, loaded as a ROWS vector (two
    values a thread rather than a [C, C] tile reduced to one column). Uses `rows.rhs`."""
    C = dP_smem.shape[0]
    shape = (C, PANEL)
    token, block = _token_and_block(shape)
    rhs = rows.rhs.at[:, panel_cols(p)]

    def anchored(s, dq):  # keys j ≤ r = s·c − 1 for queries of block s
        A, a_r = rows.A(p), along_cols(rows.a_row(s * SUB - 1, p), shape)
        rhs[...] = decayed(token <= s * SUB - 1, rows.tile(rows.k_s, p), a_r - A).astype(rows.rhs.dtype)
        plgpu.commit_smem()
        return dq + decayed(block == s, matmul(dP_smem, rhs, shape), A - a_r)

    dq = lax.fori_loop(1, BLOCKS, anchored, plgpu.layout_cast(jnp.zeros(shape, F32), WGMMA))
    A = rows.A(p)

    def same_block(j, dq):
        k_j, a_j = along_cols(rows.row(rows.k, j, p), shape), along_cols(rows.a_row(j, p), shape)
        keep = (token >= j) & (block == j // SUB)
        dP_j = plgpu.load(dP_cols.at[j], layout=ROWS)  # dP_{·j}
        return dq + decayed(keep, along_rows(dP_j, shape) * k_j, A - a_j)

    return lax.fori_loop(0, C, same_block, dq)


def dk_within(dPt_smem, dPt_cols, rows: Rows, p: int) -> jax.Array:
    """[C, PANEL] panel p of Σ_{i ≥ j} dP_ij q_i ⊙ e^{A_i − A_j} (rows: keys j). `dPt_smem`:
    dPᵀ in the input dtype; `dPt_cols`: a plain [C, C] float32 SMEM tile holding dP, whose row
    i is the column dPᵀ_{·i} (as in `dq_within`). Uses `rows.rhs`."""
    C = dPt_smem.shape[0]
    shape = (C, PANEL)
    token, block = _token_and_block(shape)
    rhs = rows.rhs.at[:, panel_cols(p)]

    def anchored(s, dk):  # queries i > r = (s + 1)·c − 1 for keys of block s
        r = (s + 1) * SUB - 1
        A, a_r = rows.A(p), along_cols(rows.a_row(r, p), shape)
        rhs[...] = decayed(token > r, rows.tile(rows.q_s, p), A - a_r).astype(rows.rhs.dtype)
        plgpu.commit_smem()
        return dk + decayed(block == s, matmul(dPt_smem, rhs, shape), a_r - A)

    dk = lax.fori_loop(0, BLOCKS - 1, anchored, plgpu.layout_cast(jnp.zeros(shape, F32), WGMMA))
    A = rows.A(p)

    def same_block(i, dk):
        q_i, a_i = along_cols(rows.row(rows.q, i, p), shape), along_cols(rows.a_row(i, p), shape)
        keep = (token <= i) & (block == i // SUB)
        dPt_i = plgpu.load(dPt_cols.at[i], layout=ROWS)  # dPᵀ_{·i}
        return dk + decayed(keep, along_rows(dPt_i, shape) * q_i, a_i - A)

    return lax.fori_loop(0, C, same_block, dk)
