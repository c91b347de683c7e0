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
leaves only the diagonal t = s, whose factor is 1). Every ladder factor is a product of
α_u = e^{a_u} over a run of tokens, so one exp per token and channel feeds all levels and
each level adds one multiply; the matmuls over all levels do the C²·D/2 work of the lower
triangle. (Exps dominate the elementwise cost on CPU, and `jnp.cumsum` is a reduce-window
there: cumulative sums are products with a triangular ones matrix instead.)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .problem import Gate

CHANNEL_FORMS = (Gate.KEY, Gate.VALUE)
"""The forms of a side's decay that vary over its channels (the ladder is needed)."""


def dot(spec: str, x: Array, y: Array) -> Array:
    """`einsum` accumulating in the operands' (state) dtype."""
    return jnp.einsum(spec, x, y, preferred_element_type=jnp.result_type(x, y))


def _lower(size: int) -> Array:
    """[size, size] mask of s ≤ t (rows t, columns s)."""
    return jnp.tril(jnp.ones((size, size), bool))


@dataclasses.dataclass(frozen=True)
class Ladder:
    """Factors of the recursive halving of a chunk with per-channel log decays.

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


def ladder(log_decay: Float[Array, "... C D"], leaf: int) -> tuple[Ladder, Array, Array]:
    """The halving factors of per-channel log decays a [..., C, D], with `start` = e^{A_t}
    and `end` = e^{A_{C−1} − A_t} over the whole chunk.

    Every factor is a product of α_u = e^{a_u} ≤ 1 over a run of tokens, so one exp per
    token and channel suffices: within aligned blocks of h tokens keep the inclusive prefix
    products (`prefix`, e^{A_t − A_{block start − 1}}) and the exclusive suffix products
    (`after`, e^{A_{block end} − A_t}); doubling h multiplies the right half's prefix by the
    left half's total and the left half's suffix by the right half's total. At level m = 2h
    the right factor of the halving is `prefix` and the left one is `after`.
    """
    *lead, C, D = log_decay.shape
    alpha = jnp.exp(log_decay)
    prefix, after = alpha, jnp.ones_like(alpha)
    levels = []
    h = 1
    while h < C:
        pairs = C // (2 * h)
        p = prefix.reshape(*lead, pairs, 2, h, D)
        a = after.reshape(*lead, pairs, 2, h, D)
        if h >= leaf:
            levels.append((2 * h, a[..., 0, :, :], p[..., 1, :, :]))
        left_total = p[..., 0, -1:, :]  # e^{A at left end − A before the block}
        right_total = (alpha.reshape(*lead, pairs, 2, h, D) * a)[..., 1, :1, :]
        prefix = jnp.stack([p[..., 0, :, :], p[..., 1, :, :] * left_total], axis=-3).reshape(*lead, C, D)
        after = jnp.stack([a[..., 0, :, :] * right_total, a[..., 1, :, :]], axis=-3).reshape(*lead, C, D)
        h *= 2
    leaf_decay = None
    if leaf > 1:
        cum = chunk_cumsum(log_decay.reshape(*lead, C // leaf, leaf, D), True)
        exponent = cum[..., :, None, :] - cum[..., None, :, :]  # [..., C/c, t, s, D]
        leaf_decay = jnp.exp(jnp.where(_lower(leaf)[:, :, None], exponent, -jnp.inf))
    return Ladder(tuple(levels), leaf, leaf_decay), prefix, after


def _halves(x: Array, blocks: int, half: int) -> tuple[Array, Array]:
    """[..., C, D] -> left and right halves of each of `blocks` blocks, [..., blocks, half, D]."""
    split = x.reshape(*x.shape[:-2], blocks, 2, half, x.shape[-1])
    return split[..., 0, :, :], split[..., 1, :, :]


def _join(left: Array, right: Array) -> Array:
    """Inverse of `_halves`: [..., blocks, half, D] twice -> [..., C, D]."""
    joined = jnp.stack([left, right], axis=-3)
    return joined.reshape(*joined.shape[:-4], -1, joined.shape[-1])


def _leaf_scores(x: Array, y: Array, lad: Ladder) -> Array:
    """The leaf (diagonal) blocks of scores(x, y), [..., C/c, c, c]."""
    *lead, C, D = x.shape
    c = lad.leaf
    if lad.leaf_decay is None:
        return jnp.sum(x * y, axis=-1)[..., None, None]  # [..., C, 1, 1] the diagonal
    xb = x.reshape(*lead, C // c, c, D)
    yb = y.reshape(*lead, C // c, c, D)
    return jnp.einsum("...td,...sd,...tsd->...ts", xb, yb, lad.leaf_decay)


def _grow(blocks: Array, corner: Array) -> Array:
    """Diagonal blocks of size m/2 [..., 2·C/m, m/2, m/2] and the R×L corners of the m-blocks
    [..., C/m, m/2, m/2] -> the lower-triangular m-blocks [..., C/m, m, m]."""
    *lead, pairs, half, _ = corner.shape
    below = blocks.reshape(*lead, pairs, 2, half, half)
    top = jnp.concatenate([below[..., 0, :, :], jnp.zeros_like(corner)], axis=-1)
    bottom = jnp.concatenate([corner, below[..., 1, :, :]], axis=-1)
    return jnp.concatenate([top, bottom], axis=-2)


def ladder_scores(x: Array, y: Array, lad: Ladder) -> Array:
    """scores(x, y) [..., C, C] for a per-channel decay, assembled from the leaves up."""
    *lead, C, D = x.shape
    blocks = _leaf_scores(x, y, lad)
    for m, left, right in lad.levels:
        half = m // 2
        _, x_right = _halves(x, C // m, half)
        y_left, _ = _halves(y, C // m, half)
        blocks = _grow(blocks, dot("...td,...sd->...ts", x_right * right, y_left * left))
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


def ladder_triple(x: Array, y: Array, M: Array, lad: Ladder) -> tuple[Array, Array, Array]:
    """(scores(x, y), apply(M, y), apply_t(M, x)) in one walk: each level rescales x's right
    halves and y's left halves once and cuts M's corners once for all three products."""
    *lead, C, D = x.shape
    corners, leaves = _corners(M, lad)
    scores = _leaf_scores(x, y, lad)
    into_x = _leaf_apply(leaves, y, lad)  # apply(M, y): rows of x's shape
    into_y = _leaf_apply_t(leaves, x, lad)  # apply_t(M, x): rows of y's shape
    for (m, left, right), (_, _, _, corner) in zip(lad.levels, reversed(corners)):
        half = m // 2
        _, x_right = _halves(x, C // m, half)
        y_left, _ = _halves(y, C // m, half)
        x_right, y_left = x_right * right, y_left * left
        scores = _grow(scores, dot("...td,...sd->...ts", x_right, y_left))
        gain = right * dot("...ts,...sd->...td", corner, y_left)
        into_x = into_x + _join(jnp.zeros_like(gain), gain)
        gain = left * dot("...ts,...td->...sd", corner, x_right)
        into_y = into_y + _join(gain, jnp.zeros_like(gain))
    return scores.reshape(*lead, C, C), into_x, into_y


def _leaf_apply(leaves: Array, z: Array, lad: Ladder) -> Array:
    *lead, C, D = z.shape
    if lad.leaf_decay is None:
        return leaves[..., 0] * z  # leaves [..., C, 1, 1]: the diagonal of M
    c = lad.leaf
    zb = z.reshape(*lead, C // c, c, D)
    out = jnp.einsum("...ts,...sd,...tsd->...td", leaves, zb, lad.leaf_decay)
    return out.reshape(*lead, C, D)


def _leaf_apply_t(leaves: Array, z: Array, lad: Ladder) -> Array:
    *lead, C, D = z.shape
    if lad.leaf_decay is None:
        return leaves[..., 0] * z
    c = lad.leaf
    zb = z.reshape(*lead, C // c, c, D)
    out = jnp.einsum("...ts,...td,...tsd->...sd", leaves, zb, lad.leaf_decay)
    return out.reshape(*lead, C, D)


def head_decay(log_decay: Float[Array, "... C"]) -> tuple[Array, Array, Array]:
    """A per-head decay's factors inside a chunk: `start` e^{A_t} and `end` e^{A_{C−1} − A_t}
    [..., C], and the decay matrix e^{A_t − A_s} [..., C, C] (0 above the diagonal).

    Each entry is a product of α_u = e^{a_u} over its run of tokens, assembled along the
    ladder (`ladder` with one channel): the R×L corner of an m-block is the outer product of
    the right half's prefix products and the left half's suffix products. No cumulative sum
    is differenced, so a strong decay (a hard reset, −1e4) elsewhere in the chunk costs the
    other entries no precision: e^{A_t − A_s} from float32 cumulative sums near −1e4 would
    keep only about 3 correct digits. One exp per token, and no exp per matrix entry.
    """
    lad, prefix, after = ladder(log_decay[..., None], 1)
    matrix = jnp.ones((*log_decay.shape, 1, 1), log_decay.dtype)  # the diagonal: 1
    for _, left, right in lad.levels:
        matrix = _grow(matrix, right[..., :, :] * jnp.swapaxes(left, -1, -2))
    return prefix[..., 0], after[..., 0], matrix.reshape(*log_decay.shape, log_decay.shape[-1])


def chunk_cumsum(x: Array, channel: bool, reverse: bool = False) -> Array:
    """Inclusive cumulative sum over the chunk axis (-2 per channel, -1 per head), from the
    front, or from the back when `reverse`.

    As a product with a triangular ones matrix: one small matmul, far cheaper on CPU than
    `jnp.cumsum` (lowered to a reduce-window there), and exact up to rounding at every
    precision asked of the call: log decays are summed at full precision (a TPU's default
    one bfloat16 pass would keep three digits of each decay).
    """
    size = x.shape[-2] if channel else x.shape[-1]
    ones = _lower(size).astype(x.dtype)
    ones = ones.T if reverse else ones
    spec = "ts,...sd->...td" if channel else "ts,...s->...t"
    return jnp.einsum(spec, ones, x, precision=jax.lax.Precision.HIGHEST, preferred_element_type=x.dtype)


@dataclasses.dataclass(frozen=True)
class ChunkDecay:
    """One side's decay inside a chunk, with the factors every product needs.

    **Arguments:**
    - `form`: `None` (no decay), `Gate.HEAD` (a scalar per token) or the side's channel
      gate, `Gate.KEY` / `Gate.VALUE` ([..., C, D]).
    - `start`: e^{A_t} (decay from the chunk start through t), `end`: e^{A_{C−1} − A_t}
      (decay after t to the chunk end), `total`: e^{A_{C−1}}; all exponents ≤ 0.
    - `mask`: the [..., C, C] decay matrix (none/head), `lad`: the `Ladder` (channel).
    """

    form: Gate | None
    start: Array | None = None
    end: Array | None = None
    total: Array | None = None
    mask: Array | None = None
    lad: Ladder | None = None

    @staticmethod
    def build(log_decay: Array | None, form: Gate | None, leaf: int, size: int) -> ChunkDecay:
        """From per-token log decays [..., C] (form `HEAD`) or [..., C, D] (a channel form);
        no decay when `log_decay` is None."""
        if log_decay is None:
            return ChunkDecay(None, mask=_lower(size))
        if form in CHANNEL_FORMS:
            lad, start, end = ladder(log_decay, leaf)
            return ChunkDecay(form, start, end, start[..., -1, :], lad=lad)
        start, end, matrix = head_decay(log_decay)
        return ChunkDecay(Gate.HEAD, start, end, start[..., -1], mask=matrix)

    @property
    def per_channel(self) -> bool:
        return self.form in CHANNEL_FORMS

    # -- per-token rescalings ([..., C, D] arrays); identity without decay
    def from_start(self, x: Array) -> Array:
        """x_t · e^{A_t}."""
        return x if self.start is None else x * self._rows(self.start)

    def to_end(self, x: Array) -> Array:
        """x_t · e^{A_{C−1} − A_t}."""
        return x if self.end is None else x * self._rows(self.end)

    def _rows(self, factor: Array) -> Array:
        return factor[..., None] if self.form is Gate.HEAD else factor

    # -- the state's decay over the whole chunk ([..., K, V])
    def decay_rows(self, state: Array) -> Array:
        if self.total is None:
            return state
        return state * (self.total[..., None, None] if self.form is Gate.HEAD else self.total[..., :, None])

    def decay_columns(self, state: Array) -> Array:
        if self.total is None:
            return state
        return state * (self.total[..., None, None] if self.form is Gate.HEAD else self.total[..., None, :])

    # -- the three decayed causal products (module docstring)
    def scores(self, x: Array, y: Array) -> Array:
        if self.per_channel:
            return ladder_scores(x, y, self.lad)
        return self._masked(dot("...td,...sd->...ts", x, y))

    def apply(self, M: Array, z: Array) -> Array:
        """M must be lower-triangular (every M here is some side's `scores`)."""
        if self.per_channel:
            return ladder_apply(M, z, self.lad)
        return dot("...ts,...sd->...td", M if self.form is None else M * self.mask, z)

    def apply_t(self, M: Array, z: Array) -> Array:
        """M must be lower-triangular (every M here is some side's `scores`)."""
        if self.per_channel:
            return ladder_apply_t(M, z, self.lad)
        return dot("...ts,...td->...sd", M if self.form is None else M * self.mask, z)

    def triple(self, x: Array, y: Array, M: Array) -> tuple[Array, Array, Array]:
        """(scores(x, y), apply(M, y), apply_t(M, x)), sharing work along a ladder."""
        if self.per_channel:
            return ladder_triple(x, y, M, self.lad)
        return self.scores(x, y), self.apply(M, y), self.apply_t(M, x)

    def _masked(self, M: Array) -> Array:
        """The raw product masked to s ≤ t and decayed (none: mask only; head: the decay matrix)."""
        return jnp.where(self.mask, M, 0) if self.form is None else M * self.mask
