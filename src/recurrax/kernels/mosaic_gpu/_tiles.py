"""Tile-level helpers shared by the Mosaic GPU chunk kernels (Hopper, sm_90+).

| symbol      | meaning                                                                   |
|-------------|---------------------------------------------------------------------------|
| C           | chunk length = the wgmma M of every token-by-token product (64)            |
| K, V, BV    | key and value head dims; BV value columns per program (64)                |
| WGMMA       | register layout of a [64·m, n] tile held by one warpgroup (128 threads)    |
| ROWS, COLS  | a vector with one value per row / per column of a WGMMA tile              |
| SMEM tile   | shared memory tiled (8, 128 bytes) and 128-byte swizzled: TMA and wgmma    |

A kernel program is one warpgroup; every matrix product is a `plgpu.wgmma` with a float32
accumulator (`plgpu.ACC`). Its left operand is either a swizzled SMEM tile (optionally
transposed: `ref.T`) or a 16-bit register array in the WGMMA layout; its right operand is
always a swizzled SMEM tile (optionally transposed). Left and right SMEM operands must
share one swizzle, so K, V and BV are multiples of 64 (128-byte rows of 16-bit values).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

F32 = jnp.float32
CHUNK = 64  # wgmma's M: one warpgroup multiplies 64-row tiles
BLOCK_V = 64
WGMMA = plgpu.Layout.WGMMA
ROWS = plgpu.Layout.WGMMA.reduce(1)  # [C] broadcast along the rows of a [C, n] tile
COLS = plgpu.Layout.WGMMA.reduce(0)  # [n] broadcast along the columns


def swizzled(shape: tuple[int, ...], dtype) -> plgpu.SMEM:
    """An SMEM buffer laid out for TMA and wgmma (minor dim tiled by the swizzle width)."""
    dtype = jnp.dtype(dtype)
    swizzle = plgpu.find_swizzle(shape[-1] * dtype.itemsize * 8)
    tiling = plgpu.TilingTransform((8, swizzle // dtype.itemsize))
    return plgpu.SMEM(shape, dtype, transforms=(tiling, plgpu.SwizzleTransform(swizzle)))


def matmul(a, b, shape: tuple[int, int], init: jax.Array | None = None) -> jax.Array:
    """`init + a @ b` [M, N] float32 by wgmma (a: SMEM ref or 16-bit WGMMA array; b: SMEM ref).

    The accumulator lives in its own scope (register allocations cannot share one with
    SMEM) and starts at zero; `init` is added afterwards rather than loaded into the
    accumulator with `pl.run_state(...)(plgpu.ACC.init(init))`, which Mosaic GPU interpret
    mode (JAX 0.12) does not run. The optimisation barrier keeps later arithmetic after
    the accumulator's read (its `wgmma.wait_group` carries no data dependency).
    """
    out = matmuls([(a, b)], shape)
    return out if init is None else init + out


def matmuls(pairs, shape: tuple[int, int]) -> jax.Array:
    """Σ a @ b over `pairs` [M, N] float32, every product into one wgmma accumulator: no
    second [M, N] register tile for a partial sum (operands as for `matmul`)."""

    def scoped(acc):
        for a, b in pairs:
            plgpu.wgmma(acc, a, b)
        return acc[...]

    return lax.optimization_barrier(pl.run_scoped(scoped, plgpu.ACC(shape, F32)))


def iota(shape: tuple[int, int], axis: int) -> jax.Array:
    """[M, N] int32 WGMMA tile of row (axis 0) or column (axis 1) indices, broadcast from a
    ROWS / COLS vector: a thread keeps one value per row / column it holds, not one per
    element (fewer registers than a WGMMA-layout iota)."""
    vec = plgpu.broadcasted_iota(jnp.int32, (shape[axis],), 0, layout=ROWS if axis == 0 else COLS)
    return lax.broadcast_in_dim(vec, shape, [axis])


def along_rows(vec: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """vec[i] on row i of a `shape` tile (vec in the ROWS layout)."""
    return lax.broadcast_in_dim(vec, shape, [0])


def along_cols(vec: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """vec[j] on column j of a `shape` tile (vec in the COLS layout)."""
    return lax.broadcast_in_dim(vec, shape, [1])


def causal_decay(x, a_rows, a_cols, *, transposed: bool = False) -> jax.Array:
    """x ⊙ D for a [C, C] tile x, D_ij = e^{A_i − A_j} for j ≤ i (or x ⊙ Dᵀ with `transposed`).

    `a_rows`/`a_cols`: A in the ROWS / COLS layouts, or both None for no decay (the causal
    mask alone). The exponent is masked to −inf before `exp`, so the entries above the
    diagonal (positive exponents) never overflow, and the product is masked by `where`, not
    by a zero factor: a NaN or inf of x there (from a later token) stays out of the result.
    """
    i, j = iota(x.shape, 0), iota(x.shape, 1)
    keep = j <= i if not transposed else i <= j
    if a_rows is None:
        return jnp.where(keep, x, 0.0)
    later, earlier = (along_rows(a_rows, x.shape), along_cols(a_cols, x.shape))
    exponent = later - earlier if not transposed else earlier - later
    return jnp.where(keep, x * jnp.exp(jnp.where(keep, exponent, -jnp.inf)), 0.0)


@functools.cache
def interpret_params(detect_races: bool = True):
    """GPU interpret mode (CPU) with the happens-before race detector raising on a race."""
    return plgpu.InterpretGPUParams(detect_races=detect_races, on_race="raise")


def has_interpret_mode() -> bool:
    return hasattr(plgpu, "InterpretGPUParams")
