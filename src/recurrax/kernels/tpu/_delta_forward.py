"""Forward Pallas TPU kernel of the delta rule's chunk (WY/UT) algorithm: outputs, final states,
chunk-entry states.

| symbol  | meaning                                                                   |
|---------|---------------------------------------------------------------------------|
| C, c    | chunk length (one grid step, a power of two), sub-block length (per-channel decays) |
| S       | [K, BV] float32 state entering the chunk, a VMEM scratch across steps     |
| A_t     | chunk-local inclusive cumulative log decay Σ_{s ≤ t} a_s; A_L the last    |
| β       | write strengths of the chunk's tokens, a [C, 1] column                    |
| M       | strictly lower [C, C]: M_ts = β_t Σ_d k_td k_sd e^{A_td − A_sd} (s < t)   |
| P       | lower [C, C]: P_ts = Σ_d q_td k_sd e^{A_td − A_sd} (s ≤ t)                |
| X       | (I + M)⁻¹, unit lower-triangular                                          |
| U       | [C, BV] the values the chunk's tokens actually write                      |

One grid step is one chunk of Hb heads (`TpuTiles.heads`: by default the most, up to 8, whose
lane-dense blocks fit the scoped VMEM) of one (row, head block, value block), the heads one
after another (`_launch`); the chunk algorithm of
`recurrax.delta._chunk` (its docstring derives it), with the solve folded into one product:

    U   = X (β ⊙ (V − (K ⊙ e^{A}) S))
    O   = scale · ((Q ⊙ e^{A}) S + P U)
    S'  = e^{A_L} ⊙ S + (K ⊙ e^{A_L − A})ᵀ U

Nothing in U depends on other value columns, so the value blocks are independent programs
(each forms the same M and X). For the backward (`_delta_backward.py`) the same kernel, run
with `emit_states` and without `emit_output`, writes the state entering every chunk and skips
the queries. The scores P and M are those of the `recurrent` kernels (`_recurrent_forward.py`):
per head (q kᵀ) ⊙ e^{A_t − A_s} masked before the exponential; per key channel, sub-blocks of
c query rows anchored at the row before them, the keys inside the sub-block by groups of 4
rows, element-wise only inside a group (`_channel.sub_block_scores`). Every evaluated
exponential has a non-positive exponent for gates ≤ 0.

**The inverse by masked doubling.** With X_m the inverse of the block-diagonal part of I + M
in m-blocks (X_1 = I) and L_m the entries of M inside a 2m-block but outside the m-blocks
(row t, column s: t XOR s ∈ [m, 2m)), L_m X_m L_m = 0, so

    X_{2m} = X_m − X_m (L_m X_m)

`_unit_lower.py`'s recursion on whole [C, C] tiles: log₂ C levels of two matmuls, no slice.
It and the products with U run with float32 operands; the scores and the outputs' products
use the inputs' MXU type (bf16 for bf16 inputs), as the `recurrent` kernels do.

**Layout** (`_tiles`, as `recurrent`'s): q, k [B, Tp, G·K] (query/key heads unrepeated: value
head h reads head h // (H / G) through the index maps), v, o [B, Tp, H·V] and a per-channel A
[B, Tp, H·K] are read and written lane-dense token-major in [C, Hb·D] blocks (head i: lanes
[i·D, (i + 1)·D)); β and a per-head A [B, Tp, H] as [C, H] blocks (head i's column picked in
VMEM); kᵀ (and a per-channel Aᵀ) is transposed in VMEM. No copy is made in XLA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ..._core.problem import Gate
from .._driver import KernelConfig
from . import _tiles as tiles
from ._channel import sub_block_scores
from ._launch import forward
from ._tiles import F32, exp_where, iota, mm, mm_nt, pick_col, pick_row


def unit_lower_inverse(M):
    """(I + M)⁻¹ of a strictly lower-triangular [C, C] M (C a power of two), float32."""
    C = M.shape[0]
    rows, cols = iota((C, C), 0), iota((C, C), 1)
    X = (rows == cols).astype(F32)
    apart = jnp.bitwise_xor(rows, cols)
    m = 1
    while m < C:
        L = jnp.where((apart >= m) & (apart < 2 * m), M, 0.0)
        X = X - mm(X, mm(L, X, F32), F32)
        m *= 2
    return X


def channel_scores(x, k, a, c: int, dtype):
    """Σ_d x_td k_sd e^{A_td − A_sd} for s ≤ t (0 above the diagonal), [C, C] float32, built
    from sub-blocks of c rows anchored at the row before each (per-channel decay `a` [C, K])."""
    C = k.shape[0]
    return jnp.concatenate([sub_block_scores(x[p : p + c], a[p : p + c], k, a, p, dtype) for p in range(0, C, c)],
                           axis=0)


def chunk_scores(x, k, decay, gate: Gate | None, c: int, dtype):
    """The lower-triangular (s ≤ t) decayed scores of rows `x` against keys `k`, [C, C]."""
    C = k.shape[0]
    lower = iota((C, C), 0) >= iota((C, C), 1)
    if gate is Gate.KEY:
        return channel_scores(x, k, decay[0], c, dtype)
    if gate is Gate.HEAD:
        a_col, a_row = decay
        return mm_nt(x, k, dtype) * exp_where(lower, a_col - a_row)
    return jnp.where(lower, mm_nt(x, k, dtype), 0.0)


@dataclasses.dataclass(frozen=True)
class DecayFactors:
    """The decay factors of one chunk, every exponent non-positive for gates ≤ 0.

    `rows` is A as the token rows see it ([C, 1] per head, [C, K] per channel) and `cols` its
    transposed copy ([1, C], [K, C]); without a decay both are None and every factor is 1."""

    rows: jax.Array | None
    cols: jax.Array | None

    @classmethod
    def of(cls, decay):
        return cls(None, None) if decay is None else cls(*decay)

    @property
    def per_channel(self) -> bool:
        return self.rows is not None and self.rows.shape[1] > 1

    def _last_row(self):  # A_L as a row: [1, K] per channel, [1, 1] per head
        if self.per_channel:
            return pick_row(self.rows, self.rows.shape[0] - 1)
        return pick_col(self.cols, self.cols.shape[1] - 1)

    def from_start(self, x):
        """x ⊙ e^{A} for token rows x [C, ·]."""
        return x if self.rows is None else x * jnp.exp(self.rows)

    def from_start_t(self, xT):
        """xᵀ ⊙ e^{Aᵀ} for transposed token columns xT [K, C]."""
        return xT if self.cols is None else xT * jnp.exp(self.cols)

    def to_end(self, x):
        """x ⊙ e^{A_L − A} for token rows x [C, K]."""
        return x if self.rows is None else x * jnp.exp(self._last_row() - self.rows)

    def to_end_t(self, xT):
        """The same for transposed token columns xT [K, C]."""
        return xT if self.cols is None else xT * jnp.exp(pick_col(self.cols, self.cols.shape[1] - 1) - self.cols)

    def state_rows(self):
        """e^{A_L} scaling the state's key rows: [K, 1] per channel, [1, 1] per head, 1.0."""
        return 1.0 if self.cols is None else jnp.exp(pick_col(self.cols, self.cols.shape[1] - 1))

    def state_columns(self):
        """e^{A_L} as a row over keys: [1, K] per channel, [1, 1] per head, 1.0."""
        return 1.0 if self.rows is None else jnp.exp(self._last_row())


def chunk_writes(k, v, beta, decay, S, *, gate: Gate | None, c: int, dtype):
    """(U [C, BV], the key scores L [C, C] strictly lower, X = (I + M)⁻¹, v − (K ⊙ e^{A}) S):
    what the chunk's tokens write, from its entry state S [K, BV], float32."""
    C = k.shape[0]
    strictly_lower = iota((C, C), 0) > iota((C, C), 1)
    L = jnp.where(strictly_lower, chunk_scores(k, k, decay, gate, c, dtype), 0.0)
    X = unit_lower_inverse(beta * L)
    residual = v - mm(DecayFactors.of(decay).from_start(k), S, F32)  # [C, BV]
    return mm(X, beta * residual, F32), L, X, residual


def delta_chunk(q, k, kT, v, beta, decay, S, *, gate: Gate | None, c: int, scale: float, dtype):
    """One chunk from its entry state S [K, BV]: (o [C, BV] or None without q, S' [K, BV]), float32.

    `decay`: per head (A [C, 1], A [1, C]); per key channel (A [C, K], Aᵀ [K, C]); None."""
    factors = DecayFactors.of(decay)
    U = chunk_writes(k, v, beta, decay, S, gate=gate, c=c, dtype=dtype)[0]
    o = None
    if q is not None:
        P = chunk_scores(q, k, decay, gate, c, dtype)
        o = scale * (mm(factors.from_start(q), S, dtype) + mm(P, U, dtype))
    return o, factors.state_rows() * S + mm(factors.to_end_t(kT), U, F32)


def _chunk(q_ref, token_refs, decay_refs, S, o_ref, *, static: KernelConfig):
    """One head's chunk (`_launch.forward`): writes o when given `o_ref`; returns S'."""
    k_ref, v_ref, beta_ref = token_refs
    decay = tiles.read_decay(decay_refs, static.gate)
    q = None if q_ref is None else tiles.token(q_ref)  # non-finite entries as 0 (cleaned at load)
    k, v, beta = (tiles.token(r) for r in (k_ref, v_ref, beta_ref))  # β [C, 1]
    kT = k.T  # [K, C], in VMEM
    o, S_next = delta_chunk(q, k, kT, v, beta, decay, S, gate=static.gate, c=static.tiles.sub,
                            scale=static.scale, dtype=tiles.matmul_dtype(k_ref.dtype))
    if o_ref is not None:
        o_ref[...] = o.astype(o_ref.dtype)
    return S_next


def delta_shapes(q, v, static: KernelConfig, backward: bool = False) -> tiles.Shapes:
    """The call's sizes, by default the most heads per grid step whose lane-dense blocks fit
    the scoped VMEM (`_tiles.most_heads`), refused at trace time where Mosaic would refuse the
    tiles, they overflow the scoped VMEM (`_tiles.check_tiles`) or the chunk is not a power of
    two (the inverse's doubling); interpret mode takes any power of two."""
    s = tiles.shapes_of(q, v, static, backward=backward, delta=True)
    tiles.check_tiles(s, static, q.dtype, backward)
    problems = []
    if s.C & (s.C - 1):
        problems.append(f"chunk={s.C} must be a power of two")
    if s.C % s.c:
        problems.append(f"sub={s.c} must divide chunk={s.C}")
    if problems:
        raise ValueError("TPU delta-rule kernel: " + "; ".join(problems))
    return s


@functools.partial(jax.jit, static_argnames=("static", "emit_output", "emit_states"))
def delta_forward(q, k, v, beta, a, h0, meta=None, *, static: KernelConfig, emit_output: bool = True,
                  emit_states: bool = False):
    """Launch the forward kernel: a list of `o [B, Tp, H, V]` in q's dtype if `emit_output`,
    `h_T [R, H, K, V]` float32, and the states entering every chunk `[B, H, N, K, V]` float32
    if `emit_states` (what the backward kernel reads).

    **Arguments:** token-major q, k [B, Tp, G, K] (G query/key heads, each shared by H / G
    value heads, read unrepeated), v [B, Tp, H, V], β [B, Tp, H], `a` the chunk-local cumulative log decay (float32 [B, Tp, H] per head,
    [B, Tp, H, K] per channel, None), h0 [R, H, K, V] float32, `meta` the packed input's
    [3, N] owners table (`varlen.ChunkOwners.table()`) or None; Tp a multiple of the chunk.
    h_T is written only for sequences that own a chunk.
    """
    return forward(functools.partial(_chunk, static=static), q, k, v, [beta], a, h0, meta,
                   shapes=functools.partial(delta_shapes, static=static), static=static, name="recurrax_tpu_delta",
                   emit_output=emit_output, emit_states=emit_states)
