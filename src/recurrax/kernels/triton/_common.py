"""Configuration and tile-level helpers shared by the Pallas chunk kernels.

| symbol | meaning                                                        |
|--------|----------------------------------------------------------------|
| B, H   | batch rows, heads (grouped heads already expanded)             |
| T, Tp  | tokens, tokens padded to a multiple of C                       |
| K, V   | key/query and value head dimensions                            |
| C      | chunk length (tokens per step of the sequential chunk loop)    |
| c      | sub-block length inside a chunk (per-channel decays only)      |
| N      | chunks per row, Tp / C                                         |
| BV     | value columns handled by one kernel program; nV = V / BV       |
| A      | chunk-local inclusive cumulative log decay, float32            |

Everything a kernel sees is per (row b, head h, value block j): refs are 2-D `[Tp, K]`,
`[Tp, BV]`, the per-head decay a 1-D `[Tp]`, the state `[K, BV]`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..._core.problem import Gate
from .._driver import KernelConfig

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class TritonTiles:
    """Tile sizes of the Triton-backend chunk kernels (defaults and the GPU choice: `_tiling.py`).

    **Arguments:**
    - `chunk`: C, tokens per step of the sequential loop over chunks.
    - `sub`: c, sub-block length for per-channel decays (must divide `chunk`).
    - `block_v`: BV, value columns per program (clipped to V; must divide V).
    - `num_warps`, `num_stages`: Triton launch parameters (ignored in interpret mode).
    """

    chunk: int
    sub: int
    block_v: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        if self.chunk % self.sub:
            raise ValueError(f"TritonTiles.sub={self.sub} must divide chunk={self.chunk}")


def compiler_params(static: KernelConfig):
    """Triton launch parameters of the tiles (None in interpret mode)."""
    if static.interpret:
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=static.tiles.num_warps, num_stages=static.tiles.num_stages)


def block_v(static: KernelConfig, V: int) -> int:
    """BV: the configured value block, clipped to V."""
    return min(static.tiles.block_v, V)


# ----------------------------------------------------------------------------- tiles


def mm(a, b, dtype):
    """a @ b with operands cast to `dtype` (tensor cores for bf16/f16), float32 accumulation."""
    return lax.dot_general(a.astype(dtype), b.astype(dtype), (((1,), (0,)), ((), ())), preferred_element_type=F32)


def mm_nt(a, b, dtype):
    """a @ bᵀ: [M, D] x [N, D] -> [M, N]."""
    return lax.dot_general(a.astype(dtype), b.astype(dtype), (((1,), (1,)), ((), ())), preferred_element_type=F32)


def mm_tn(a, b, dtype):
    """aᵀ @ b: [D, M] x [D, N] -> [M, N]."""
    return lax.dot_general(a.astype(dtype), b.astype(dtype), (((0,), (0,)), ((), ())), preferred_element_type=F32)


def exp_where(mask, exponent):
    """exp(exponent) where `mask`, exactly 0 elsewhere (masked exponents may be positive)."""
    return jnp.exp(jnp.where(mask, exponent, -jnp.inf))


def rows(ref, start, size: int):
    """Rows `start : start + size` of a 1-D or 2-D ref (`start` may be traced)."""
    return ref[pl.ds(start, size)] if len(ref.shape) == 1 else ref[pl.ds(start, size), :]


def causal_mask(size: int):
    """[size, size] mask of (i, j) with j ≤ i."""
    i = lax.broadcasted_iota(jnp.int32, (size, size), 0)
    j = lax.broadcasted_iota(jnp.int32, (size, size), 1)
    return j <= i


def row_index(size: int, width: int):
    """[size, width] int32 row numbers."""
    return lax.broadcasted_iota(jnp.int32, (size, width), 0)


def col_index(size: int, width: int):
    """[size, width] int32 column numbers."""
    return lax.broadcasted_iota(jnp.int32, (size, width), 1)


def anchor_before(a_ref, base, p):
    """A at token p − 1 of the chunk starting at `base`, [1, K]; 0 (A before the chunk) when p = 0.

    `p` may be traced; the load is clamped in range and its value discarded when p = 0.
    """
    row = rows(a_ref, jnp.maximum(base + p - 1, 0), 1)
    return jnp.where(p > 0, row, 0.0)


def diagonal_column(q_s, a_s, k_ref, a_ref, start, j):
    """Column j of the exact diagonal block of a per-channel decay, with its decay factors.

    Returns `(k_j [1, K], E_j [c, K], P_j [c, 1])` with E_j[i] = e^{A_i − A_j} for i ≥ j
    (else 0) and P_j[i] = Σ_k q_ik k_jk E_j[i, k]: no anchor, every kept exponent is a sum
    of gates between j and i. One column at a time keeps the live tile at [c, K] instead
    of the [c, c, K] of a broadcast formulation.
    """
    c, K = q_s.shape
    k_j = rows(k_ref, start + j, 1).astype(F32)  # [1, K]
    E_j = exp_where(row_index(c, K) >= j, a_s - rows(a_ref, start + j, 1))  # [c, K]
    return k_j, E_j, jnp.sum(q_s.astype(F32) * k_j * E_j, axis=1, keepdims=True)


def specs_for(B: int, H: int, nV: int):
    """BlockSpec factories over the grid (b, h, j) for the [B, Tp, H, ...] layouts."""

    def tokens_k(Tp, K):  # [B, Tp, H, K] -> ref [Tp, K]
        return pl.BlockSpec((None, Tp, None, K), lambda b, h, j: (b, 0, h, 0))

    def tokens_v(Tp, BV):  # [B, Tp, H, V] -> ref [Tp, BV]
        return pl.BlockSpec((None, Tp, None, BV), lambda b, h, j: (b, 0, h, j))

    def tokens_head(Tp):  # [B, Tp, H] -> ref [Tp]
        return pl.BlockSpec((None, Tp, None), lambda b, h, j: (b, 0, h))

    def state(K, BV):  # [B, H, K, V] -> ref [K, BV]
        return pl.BlockSpec((None, None, K, BV), lambda b, h, j: (b, h, 0, j))

    def states(N, K, BV):  # [B, H, N, K, V] -> ref [N, K, BV]
        return pl.BlockSpec((None, None, N, K, BV), lambda b, h, j: (b, h, 0, 0, j))

    def partial_k(Tp, K):  # [nV, B, Tp, H, K] -> ref [Tp, K], one slab per value block
        return pl.BlockSpec((None, None, Tp, None, K), lambda b, h, j: (j, b, 0, h, 0))

    def partial_chunks(N, K):  # [nV, B, H, N, K] -> ref [N, K], one slab per value block
        return pl.BlockSpec((None, None, None, N, K), lambda b, h, j: (j, b, h, 0, 0))

    def seq_states(S, K, BV):  # [S, H, K, V] -> ref [S, K, BV] (packed input: one per sequence)
        return pl.BlockSpec((S, None, K, BV), lambda b, h, j: (0, h, 0, j))

    def meta(M):  # [3, M] int32: per chunk its sequence, whether it is the first, the last
        return pl.BlockSpec((3, M), lambda b, h, j: (0, 0))

    return dict(
        meta=meta,
        seq_states=seq_states,
        partial_chunks=partial_chunks,
        tokens_k=tokens_k,
        tokens_v=tokens_v,
        tokens_head=tokens_head,
        state=state,
        states=states,
        partial_k=partial_k,
    )


def decay_spec(gate: Gate | None, Tp: int, K: int, specs: dict):
    """The BlockSpec of the cumulative decay A for this gate kind (None when absent)."""
    if gate is Gate.HEAD:
        return specs["tokens_head"](Tp)
    if gate is Gate.KEY:
        return specs["tokens_k"](Tp, K)
    return None

