"""Per-key-channel decay inside one chunk, for both operations' TPU kernels (`gk`, `g` per channel).

| symbol | meaning                                                                 |
|--------|-------------------------------------------------------------------------|
| C, c   | chunk length, sub-block length (rows [p, p + c) of the chunk)           |
| A      | [C, K] chunk-local inclusive cumulative log decay, float32             |
| r      | an anchor row: e^{A_i − A_j} = e^{A_i − A_r} · e^{A_r − A_j} for j ≤ r < i |
| g      | rows of a sub-block's groups (`DIAGONAL_GROUP`, a power of two)          |

A per-channel decay sits inside the contraction over k, so a decayed product of rows i and j
is no matrix product of a decay matrix. Split at an anchor row r between them, both factors
are ≤ 0 for gates ≤ 0, and each side scales its own operand: one block matmul per anchor.

* **Rows of a sub-block against the rows before it** (`before_anchor`, r = p − 1) and the rows
  after it against it (`after_anchor`, r = p + c − 1).
* **The diagonal block** [p, p + c)²: its c rows split into groups of g. A group against the
  rows of earlier groups is one block matmul anchored at the row before the group
  (`DiagonalGroups.across`); pairs inside a group have no anchor, and are g element-wise steps
  (`DiagonalGroups.within`): step t takes each row's group's t-th row, gathered by a 0/1 selection
  product (`group_pick`, exact) and scattered back by its transpose (`group_scatter`).

Every exponent evaluated is a masked difference, so nothing positive reaches `exp`. Which
products each kernel forms around these factors (scores, or their adjoints) is the kernel's
own: `_recurrent_forward`, `_recurrent_backward`, `_delta_forward`, `_delta_backward`.
"""

from __future__ import annotations

import jax.numpy as jnp

from ._tiles import F32, TpuTiles, exp_where, iota, mm, mm_nt, pick_row

DIAGONAL_GROUP = TpuTiles.group
"""Rows of a sub-block's groups: pairs in different groups are block matmuls, pairs inside one
element-wise (`DiagonalGroups.within`); `TpuTiles.group` sets it for the `recurrent` kernels, the delta
rule's are this default."""


def before_anchor(y, a, p: int):
    """(A_r [1, K], y_j ⊙ e^{A_r − A_j} for rows j < p, 0 below): rows before the sub-block at
    p decayed to its anchor r = p − 1."""
    a_r = pick_row(a, p - 1)
    return a_r, y * exp_where(iota(y.shape, 0) < p, a_r - a)


def after_anchor(x, a, r: int):
    """(A_r [1, K], x_i ⊙ e^{A_i − A_r} for rows i > r, 0 above): rows after the anchor r
    decayed from it."""
    a_r = pick_row(a, r)
    return a_r, x * exp_where(iota(x.shape, 0) > r, a - a_r)


def group_pick(c: int, g: int, t: int):
    """[c, c] 0/1 selection: row i picks row g·⌊i/g⌋ + t, the t-th of its group of g rows (a
    product with it gathers those rows: exact, one nonzero term per entry)."""
    rows, cols = iota((c, c), 0), iota((c, c), 1)
    return (cols == rows - jnp.bitwise_and(rows, g - 1) + t).astype(F32)


def group_scatter(c: int, g: int, t: int):
    """`group_pick` transposed, built as such: [j, i] = 1 where row i picks row j."""
    rows, cols = iota((c, c), 0), iota((c, c), 1)
    return (rows == cols - jnp.bitwise_and(cols, g - 1) + t).astype(F32)


def into_columns(c: int, C: int, p: int):
    """[c, C] 0/1: column j of a [c, c] block → column p + j of the chunk's [c, C] rows."""
    return (iota((c, C), 1) == iota((c, C), 0) + p).astype(F32)


def diagonal_block(G_s, p: int):
    """(G, Gᵀ): the [c, c] diagonal block of the sub-block's rows `G_s` [c, C] at p, and its
    transpose, by selection products (no unaligned slice)."""
    c, C = G_s.shape
    columns = into_columns(c, C, p)
    return mm_nt(G_s, columns, F32), mm_nt(columns, G_s, F32)


class DiagonalGroups:
    """The rows of a sub-block's diagonal block in groups of g, with the decay `a_s` [c, K] of
    those rows: the anchored factors across groups and the element-wise steps inside them."""

    def __init__(self, a_s, group: int):
        c, K = a_s.shape
        self.a_s, self.g, self.rows = a_s, min(group, c), iota((c, K), 0)

    def across(self):
        """For each group [s, s + g) after the first: (e^{A_i − A_r} on the group's rows,
        e^{A_r − A_j} on the rows j < s, 0 elsewhere), both [c, K], anchored at r = s − 1."""
        a_s, g, rows = self.a_s, self.g, self.rows
        for start in range(g, a_s.shape[0], g):
            a_r = pick_row(a_s, start - 1)  # [1, K]
            yield exp_where((rows >= start) & (rows < start + g), a_s - a_r), exp_where(rows < start, a_r - a_s)

    def within(self):
        """For each step t < g: (t, the selection `group_pick` [c, c], E_t [c, K] = e^{A_i − A_j}
        with j the t-th row of row i's group, masked to j ≤ i)."""
        a_s, g = self.a_s, self.g
        c = a_s.shape[0]
        offset = jnp.bitwise_and(self.rows, g - 1)  # i − s: the row's place in its group
        for t in range(g):
            pick = group_pick(c, g, t)
            yield t, pick, exp_where(offset >= t, a_s - mm(pick, a_s, F32))


def diagonal_scores(q_s, k_s, a_s, scores, p: int, dtype, group: int = DIAGONAL_GROUP):
    """Add the exact scores of keys [p, p + c) against queries [p, p + c) to columns
    p … p + c − 1 of the [c, C] `scores`: P_ij = Σ_k q_ik k_jk e^{A_ik − A_jk} for i ≥ j, 0 for i < j.

    Queries of a group against the keys of earlier groups, one block matmul per group; keys
    inside the query's own group, g element-wise steps, the t-th masked to t ≤ i − s
    (`DiagonalGroups`)."""
    c = q_s.shape[0]
    groups = DiagonalGroups(a_s, group)
    D = jnp.zeros((c, c), F32)
    for from_anchor, to_anchor in groups.across():
        D = D + mm_nt(q_s * from_anchor, k_s * to_anchor, dtype)
    for _, pick, E in groups.within():  # the key g·⌊i/g⌋ + t of each query row's own group
        k_t = mm(pick, k_s, F32)  # [c, K] that key's k, per row
        P_t = jnp.sum(q_s * k_t * E, axis=1, keepdims=True)  # [c, 1]
        D = jnp.where(pick > 0, P_t, D)
    return scores + mm(D, into_columns(c, scores.shape[1], p), F32)


def sub_block_scores(x_s, a_s, k, a, p: int, dtype, group: int = DIAGONAL_GROUP):
    """The decayed scores Σ_d x_td k_sd e^{A_td − A_sd} (s ≤ t, 0 above) of the sub-block's rows
    `x_s` [c, K] (decay `a_s`) at p against every key of the chunk, [c, C] float32: keys s < p
    anchored at r = p − 1, the diagonal block by `diagonal_scores`."""
    c, C = x_s.shape[0], k.shape[0]
    scores = jnp.zeros((c, C), F32)
    if p > 0:  # keys s < p, anchored at r = p − 1
        a_r, k_anchor = before_anchor(k, a, p)  # [C, K]; 0 for s ≥ p
        scores = mm_nt(x_s * jnp.exp(a_s - a_r), k_anchor, dtype)  # [c, C]
    return diagonal_scores(x_s, k[p : p + c], a_s, scores, p, dtype, group)
