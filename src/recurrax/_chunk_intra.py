"""The math inside one chunk: decayed causal products, exact for any decay strength.

| symbol   | meaning                                                                   |
|----------|---------------------------------------------------------------------------|
| ...      | leading batch axes (batch rows and heads), carried through untouched      |
| C        | tokens in the chunk, in processing order t = 0 … C−1                      |
| D        | channels of one side: K (key side) or V (value side)                      |
| c        | leaf block size: diagonal blocks of c tokens are done element-wise        |
| a_t      | log decay of token t on one side: [D] per channel, a scalar per head      |
| A_t      | Σ_{u≤t} a_u, the chunk-local inclusive cumulative log decay               |

Everything the chunk algorithm computes inside a chunk is one of three decayed causal
products of a side with cumulative log decay A:

    scores(x, y)[t, s] = Σ_d x_t[d] y_s[d] e^{A_t[d] − A_s[d]}          for s ≤ t, else 0
    apply(M, z)[t]     = Σ_{s≤t} M[t, s] z_s e^{A_t − A_s}               (rows of M)
    apply_t(M, z)[s]   = Σ_{t≥s} M[t, s] z_t e^{A_t − A_s}               (columns of M)

With no decay or a per-head decay these are plain masked matmuls: the decay matrix
`D[t, s] = exp(A_t − A_s)` (masked to −∞ above the diagonal *before* the exp) multiplies
elementwise. Per-channel decays cannot be pulled out of the contraction over d, and the
tempting factorisation `e^{A_t} · e^{−A_s}` overflows once a chunk decays by more than
~88 (float32). Instead the chunk is split recursively in halves (a *ladder*): for a block
of m tokens with left half L, right half R and anchor μ = A at the last token of L,

    e^{A_t − A_s} = e^{A_t − μ} · e^{μ − A_s}          t ∈ R, s ∈ L

and both exponents are ≤ 0 (A is non-increasing for log decays ≤ 0), so every factor lies
in [0, 1] and underflows only where the exact product is smaller still. The R×L block is
then one matmul of rescaled operands; the recursion ends at leaf blocks of c tokens, where
`e^{A_t − A_s}` is evaluated element-wise with the exponent masked before the exp (c = 1
leaves only the diagonal t = s, whose factor is 1). Each level costs one exp per token and
channel; the matmuls over all levels do the C²·D/2 work of the lower triangle.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float

NONE, HEAD, CHANNEL = "none", "head", "channel"


def dot(spec: str, x: Array, y: Array) -> Array:
    """`einsum` accumulating in the operands' (state) dtype."""
    return jnp.einsum(spec, x, y, preferred_element_type=jnp.result_type(x, y))


def _lower(size: int) -> Array:
    """[size, size] mask of s ≤ t (rows t, columns s)."""
    return jnp.tril(jnp.ones((size, size), bool))


@dataclasses.dataclass(frozen=True)
class Ladder:
    """Factors of the recursive halving of a chunk with per-channel cumulative decay A.

    **Arguments:**
    - `levels`: for block sizes m = 2c, 4c, …, C: `(m, left, right)` with
      `left = e^{μ − A_s}` for s in each block's left half and `right = e^{A_t − μ}` for t in
      its right half, both [..., C/m, m/2, D].
    - `leaf`: leaf block size c.
    - `leaf_decay`: [..., C/c, c, c, D] exact `e^{A_t − A_s}` inside each leaf (0 for s > t),
      or None when c = 1.
    """

    levels: tuple[tuple[int, Array, Array], ...]
    leaf: int
    leaf_decay: Array | None


def ladder(cum: Float[Array, "... C D"], leaf: int) -> Ladder:
    """The halving factors of a per-channel cumulative log decay (see the module docstring)."""
    *lead, C, D = cum.shape
    levels = []
    m = 2 * leaf
    while m <= C:
        blocks = cum.reshape(*lead, C // m, 2, m // 2, D)
        anchor = blocks[..., 0, -1:, :]  # [..., C/m, 1, D]   A at the end of each left half
        left = jnp.exp(anchor - blocks[..., 0, :, :])  # e^{μ − A_s} ≤ 1
        right = jnp.exp(blocks[..., 1, :, :] - anchor)  # e^{A_t − μ} ≤ 1
        levels.append((m, left, right))
        m *= 2
    leaf_decay = None
    if leaf > 1:
        blocks = cum.reshape(*lead, C // leaf, leaf, D)
        exponent = blocks[..., :, None, :] - blocks[..., None, :, :]  # [..., C/c, t, s, D]
        leaf_decay = jnp.exp(jnp.where(_lower(leaf)[:, :, None], exponent, -jnp.inf))
    return Ladder(tuple(levels), leaf, leaf_decay)


def _halves(x: Array, blocks: int, half: int) -> tuple[Array, Array]:
    """[..., C, D] -> left and right halves of each of `blocks` blocks, [..., blocks, half, D]."""
    split = x.reshape(*x.shape[:-2], blocks, 2, half, x.shape[-1])
    return split[..., 0, :, :], split[..., 1, :, :]


def _join(left: Array, right: Array) -> Array:
    """Inverse of `_halves`: [..., blocks, half, D] twice -> [..., C, D]."""
    joined = jnp.stack([left, right], axis=-3)
    return joined.reshape(*joined.shape[:-4], -1, joined.shape[-1])


def ladder_scores(x: Array, y: Array, lad: Ladder) -> Array:
    """scores(x, y) [..., C, C] for a per-channel decay, assembled from the leaves up."""
    *lead, C, D = x.shape
    c = lad.leaf
    if lad.leaf_decay is None:
        blocks = jnp.sum(x * y, axis=-1)[..., None, None]  # [..., C, 1, 1] the diagonal
    else:
        xb = x.reshape(*lead, C // c, c, D)
        yb = y.reshape(*lead, C // c, c, D)
        blocks = jnp.sum(xb[..., :, None, :] * yb[..., None, :, :] * lad.leaf_decay, axis=-1)
    for m, left, right in lad.levels:
        half = m // 2
        x_left, x_right = _halves(x, C // m, half)
        y_left, _ = _halves(y, C // m, half)
        del x_left
        corner = dot("...td,...sd->...ts", x_right * right, y_left * left)  # [..., C/m, m/2, m/2]
        below = blocks.reshape(*lead, C // m, 2, half, half)
        top = jnp.concatenate([below[..., 0, :, :], jnp.zeros_like(corner)], axis=-1)
        bottom = jnp.concatenate([corner, below[..., 1, :, :]], axis=-1)
        blocks = jnp.concatenate([top, bottom], axis=-2)  # [..., C/m, m, m]
    return blocks.reshape(*lead, C, C)


def _corners(M: Array, lad: Ladder):
    """Walk M [..., C, C] from the top level down: yield (m, left, right, corner) per level,
    corner = M's R×L block inside each m-block, [..., C/m, m/2, m/2]; return the leaf blocks."""
    *lead, C, _ = M.shape
    blocks = M[..., None, :, :]
    out = []
    for m, left, right in reversed(lad.levels):
        half = m // 2
        quad = blocks.reshape(*lead, C // m, 2, half, 2, half)
        out.append((m, left, right, quad[..., 1, :, 0, :]))
        diagonal = jnp.stack([quad[..., 0, :, 0, :], quad[..., 1, :, 1, :]], axis=-3)
        blocks = diagonal.reshape(*lead, 2 * C // m, half, half)
    return out, blocks


def ladder_apply(M: Array, z: Array, lad: Ladder) -> Array:
    """apply(M, z) [..., C, D]: rows t get Σ_{s≤t} M[t, s] z_s e^{A_t − A_s}."""
    *lead, C, D = z.shape
    corners, leaves = _corners(M, lad)
    out = _leaf_apply(leaves, z, lad)
    for m, left, right, corner in corners:
        half = m // 2
        z_left, _ = _halves(z, C // m, half)
        into_right = right * dot("...ts,...sd->...td", corner, z_left * left)
        out = out + _join(jnp.zeros_like(into_right), into_right)
    return out


def ladder_apply_t(M: Array, z: Array, lad: Ladder) -> Array:
    """apply_t(M, z) [..., C, D]: rows s get Σ_{t≥s} M[t, s] z_t e^{A_t − A_s}."""
    *lead, C, D = z.shape
    corners, leaves = _corners(M, lad)
    out = _leaf_apply_t(leaves, z, lad)
    for m, left, right, corner in corners:
        half = m // 2
        _, z_right = _halves(z, C // m, half)
        into_left = left * dot("...ts,...td->...sd", corner, z_right * right)
        out = out + _join(into_left, jnp.zeros_like(into_left))
    return out


def _leaf_apply(leaves: Array, z: Array, lad: Ladder) -> Array:
    *lead, C, D = z.shape
    if lad.leaf_decay is None:
        return leaves[..., 0] * z  # leaves [..., C, 1, 1]: the diagonal of M
    c = lad.leaf
    zb = z.reshape(*lead, C // c, c, D)
    out = jnp.sum(leaves[..., None] * zb[..., None, :, :] * lad.leaf_decay, axis=-2)  # over s
    return out.reshape(*lead, C, D)


def _leaf_apply_t(leaves: Array, z: Array, lad: Ladder) -> Array:
    *lead, C, D = z.shape
    if lad.leaf_decay is None:
        return leaves[..., 0] * z
    c = lad.leaf
    zb = z.reshape(*lead, C // c, c, D)
    out = jnp.sum(leaves[..., None] * zb[..., :, None, :] * lad.leaf_decay, axis=-3)  # over t
    return out.reshape(*lead, C, D)


@dataclasses.dataclass(frozen=True)
class ChunkDecay:
    """One side's decay inside a chunk, with the factors every product needs.

    **Arguments:**
    - `kind`: `"none"`, `"head"` (cumulative [..., C]) or `"channel"` ([..., C, D]).
    - `cum`: the inclusive cumulative log decay A, or None.
    - `start`: e^{A_t} (decay from the chunk start through t), `end`: e^{A_{C−1} − A_t}
      (decay after t to the chunk end), `total`: e^{A_{C−1}}; all exponents ≤ 0.
    - `mask`: the [..., C, C] decay matrix (none/head), `lad`: the `Ladder` (channel).
    """

    kind: str
    cum: Array | None = None
    start: Array | None = None
    end: Array | None = None
    total: Array | None = None
    mask: Array | None = None
    lad: Ladder | None = None

    @staticmethod
    def build(log_decay: Array | None, channel: bool, leaf: int, size: int) -> ChunkDecay:
        """From per-token log decays [..., C] (per head) or [..., C, D] (per channel) or None."""
        if log_decay is None:
            return ChunkDecay(NONE, mask=_lower(size))
        cum = jnp.cumsum(log_decay, axis=-2 if channel else -1)
        last = cum[..., -1:, :] if channel else cum[..., -1:]
        start, end, total = jnp.exp(cum), jnp.exp(last - cum), jnp.exp(last[..., 0, :] if channel else last[..., 0])
        if channel:
            return ChunkDecay(CHANNEL, cum, start, end, total, lad=ladder(cum, leaf))
        exponent = jnp.where(_lower(size), cum[..., :, None] - cum[..., None, :], -jnp.inf)
        return ChunkDecay(HEAD, cum, start, end, total, mask=jnp.exp(exponent))

    # -- per-token rescalings ([..., C, D] arrays); identity without decay
    def from_start(self, x: Array) -> Array:
        """x_t · e^{A_t}."""
        return x if self.start is None else x * self._rows(self.start)

    def to_end(self, x: Array) -> Array:
        """x_t · e^{A_{C−1} − A_t}."""
        return x if self.end is None else x * self._rows(self.end)

    def _rows(self, factor: Array) -> Array:
        return factor[..., None] if self.kind == HEAD else factor

    # -- the state's decay over the whole chunk ([..., K, V])
    def decay_rows(self, state: Array) -> Array:
        if self.total is None:
            return state
        return state * (self.total[..., None, None] if self.kind == HEAD else self.total[..., :, None])

    def decay_columns(self, state: Array) -> Array:
        if self.total is None:
            return state
        return state * (self.total[..., None, None] if self.kind == HEAD else self.total[..., None, :])

    # -- the three decayed causal products (module docstring)
    def scores(self, x: Array, y: Array) -> Array:
        if self.kind == CHANNEL:
            return ladder_scores(x, y, self.lad)
        return self._masked(dot("...td,...sd->...ts", x, y))

    def apply(self, M: Array, z: Array) -> Array:
        """M must be lower-triangular (every M here is some side's `scores`)."""
        if self.kind == CHANNEL:
            return ladder_apply(M, z, self.lad)
        return dot("...ts,...sd->...td", M if self.kind == NONE else M * self.mask, z)

    def apply_t(self, M: Array, z: Array) -> Array:
        """M must be lower-triangular (every M here is some side's `scores`)."""
        if self.kind == CHANNEL:
            return ladder_apply_t(M, z, self.lad)
        return dot("...ts,...td->...sd", M if self.kind == NONE else M * self.mask, z)

    def _masked(self, M: Array) -> Array:
        """scores: mask the raw product; apply: M is already lower-triangular (a `scores`)."""
        return jnp.where(self.mask, M, 0) if self.kind == NONE else M * self.mask
