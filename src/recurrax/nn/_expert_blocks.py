"""The routed experts' FFNs on the CPU: a loop over the experts that have rows, and inside it
over each expert's blocks of sorted rows, each block through the expert's whole FFN and added,
weighted, into its tokens' outputs; with a hand-written VJP.

| symbol | meaning                                                                  |
|--------|--------------------------------------------------------------------------|
| n, D   | tokens, model width (`x` carries one more row of zeros: the padding row) |
| F, E   | an expert's hidden width, experts                                        |
| B      | rows per block (`recurrax.nn.dispatch`: each block belongs to one expert) |
| P      | padded rows, `P = blocks · B`                                            |
| c_e    | expert e's blocks, `group_sizes[e] / B` (they follow one another)        |
| r_b    | the token of each row of block b (n for a padding row)                   |
| w_b    | each row's combine weight (0 for a padding row)                          |

Forward, for each expert e with c_e > 0 (its matrices sliced once), for each of its blocks b
(the rows gathered and the outputs added inside the step, so neither the `[P, D]` rows nor
their outputs are ever held: the temporaries do not grow with E):

    X = x[r_b]                           [B, D]
    G = X Wg_e,  U = X Wu_e              [B, F]     (ungated: G absent, H = act(U))
    H = act(G) ⊙ U                       (with a limit L: min(act(G), L) ⊙ clip(U, −L, L), `glu`)
    O_b = H Wd_e                         [B, D]
    y[r_b] += w_b · O_b                  (float32 or wider; y_t = Σ_{e∈S_t} w_{t,e} FFN_e(x_t))

Backward, from ȳ, in the same order, G and U saved by the forward (O_b recomputed: one more
matmul, no `[P, D]` saved):

    Ō_b = w_b · ȳ[r_b],   w̄_b = Σ_D ȳ[r_b] ⊙ O_b
    H̄ = Ō_b Wd_eᵀ,   W̄d_e += Hᵀ Ō_b
    (Ḡ, Ū) = glu'(G, U)ᵀ H̄               (no limit: Ū = H̄ ⊙ act(G), Ḡ = act'(G)ᵀ (H̄ ⊙ U);
                                          ungated: Ū = act'(U)ᵀ H̄)
    W̄u_e += Xᵀ Ū,    W̄g_e += Xᵀ Ḡ
    x̄[r_b] += Ū Wu_eᵀ + Ḡ Wg_eᵀ

Each expert's W̄ sums its blocks in float32 and is written once, cast to the weights' dtype at
the end; an expert without rows gets zeros. The blocks past the routed ones (the static bound
P holds up to E(B − 1)/B of them) are never visited. Inside `jax.shard_map` each cotangent is
summed over the mesh axes its terms vary over and its primal does not (x̄ and w̄ over the
shards of the experts' width, W̄ over the shards of the rows). Weights in PyTorch's
`[E, out, in]` layout (`transposed`) are used, and their cotangents built, in that layout.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..kernels._driver import sum_to_vary_like, vary_over, varying_axes


def block_ffn(x: Float[Array, "n1 D"], rows: Int[Array, " P"], row_weights: Float[Array, " P"],
              group_sizes: Int[Array, " E"], gate: Float[Array, "E D F"] | None, up: Float[Array, "E D F"],
              down: Float[Array, "E F D"], *, act: Callable, transposed: bool, block_size: int,
              limit: float | None = None) -> Float[Array, "n D"]:
    """`y [n, D]`: `y_t = Σ_{p: rows[p] = t} row_weights[p] · FFN_{e(p)}(x_t)`, row p through
    the FFN of the expert whose padded group (`group_sizes`, multiples of `block_size`, in
    expert order) holds it (module docstring). `x` ends with a zero row that padding rows
    (`rows == n`) point to. `limit`: the gated FFN's clipping (`glu`)."""
    return _block_ffn((act, limit), transposed, block_size, x, rows, row_weights, group_sizes, gate, up, down)


def glu(act: Callable, limit: float | None, G: Array, U: Array) -> Array:
    """`act(G) ⊙ U`; with a `limit` L, `min(act(G), L) ⊙ clip(U, −L, L)` (the SwiGLU clipping
    of Ling's experts, `transformers`' `limit_after_act`)."""
    A = act(G)
    if limit is None:
        return A * U
    return jnp.minimum(A, limit) * jnp.clip(U, -limit, limit)


def combine(out: Float[Array, "P D"], positions: Int[Array, "n k"], weights: Float[Array, "n k"]) -> Float[Array, "n D"]:
    """`y_t = Σ_j w_{t,j} · out[positions[t, j]]`, one gather of `[n, D]` rows per slot j, each
    fused with its multiply-add (on the CPU about 6× faster than gathering `[n, k, D]` at once:
    benchmarks/results/moe.md)."""
    weights = weights.astype(out.dtype)
    total = out[positions[:, 0]] * weights[:, :1]
    for slot in range(1, positions.shape[1]):
        total = total + out[positions[:, slot]] * weights[:, slot:slot + 1]
    return total


class _Plan:
    """The loops' bounds: the experts with rows (`order[:active]`), each one's first block and
    block count, and the rows and weights as `[blocks, B]`."""

    def __init__(self, rows, row_weights, group_sizes, block_size: int):
        counts = group_sizes // block_size
        self.first, self.counts = jnp.cumsum(counts) - counts, counts
        self.active = jnp.sum(counts > 0)
        self.order = jnp.nonzero(counts > 0, size=counts.shape[0], fill_value=0)[0]
        self.rows = rows.reshape(-1, block_size)
        self.weights = row_weights.reshape(-1, block_size)

    def over_experts(self, body, carry):
        """`body(e, carry)` for each expert with rows, in expert order."""
        return jax.lax.fori_loop(0, self.active, lambda i, carry: body(self.order[i], carry), carry)

    def over_blocks(self, e, body, carry):
        """`body(b, carry)` for each block of expert e."""
        return jax.lax.fori_loop(self.first[e], self.first[e] + self.counts[e], body, carry)


def _accumulator(dtype):
    """The sums' dtype: float32, or the inputs' if wider (float64 models)."""
    return jnp.promote_types(dtype, jnp.float32)


class _Matrix(NamedTuple):
    """One expert's matrix W (`[in, out]`) as stored: W, or Wᵀ when `transposed` (PyTorch's
    `[out, in]`), read in place. A product that contracts the stored matrix's minor axis is
    taken as `(S · Xᵀ)ᵀ` (`_rows_times`): XLA's CPU backend otherwise copies the transposed
    matrix whole, or multiplies a few rows at a third of the rate (decoding: a block of 8 rows,
    1024 × 2304 matrices)."""

    stored: Array
    transposed: bool

    def apply(self, X):
        """`X W`."""
        return _rows_times(self.stored, X) if self.transposed else X @ self.stored

    def apply_transpose(self, Y):
        """`Y Wᵀ`."""
        return Y @ self.stored if self.transposed else _rows_times(self.stored, Y)

    def gradient(self, X, Y):
        """`Xᵀ Y` (W's cotangent from a block), in W's stored layout."""
        return Y.T @ X if self.transposed else X.T @ Y


def _rows_times(S, X):
    """`X Sᵀ` as `(S Xᵀ)ᵀ`: S read row by row; the barrier keeps XLA from turning the product
    back into `X Sᵀ` (as `recurrax.nn._tied`'s head does)."""
    return jax.lax.optimization_barrier(jnp.einsum("oi,bi->ob", S, X)).T


def _matrices(gate, up, down, e, transposed: bool, dtype):
    """Expert e's `(Wg [D, F] or None, Wu [D, F], Wd [F, D])` as `_Matrix`es, in `dtype`."""
    return tuple(None if w is None else _Matrix(w[e].astype(dtype), transposed) for w in (gate, up, down))


def _hidden(X, Wg, Wu, activation):
    """`(H, G, U)` of a block's rows (G None without a gate); `activation`: `(act, limit)`."""
    act, limit = activation
    U = Wu.apply(X)
    if Wg is None:
        return act(U), None, U
    G = Wg.apply(X)
    return glu(act, limit, G, U), G, U


def _run_forward(activation, transposed, block_size, save: bool, x, rows, row_weights, group_sizes, gate, up, down):
    plan = _Plan(rows, row_weights, group_sizes, block_size)
    acc = _accumulator(x.dtype)
    F = up.shape[1 if transposed else 2]
    blocks = plan.rows.shape[0]
    saved = () if not save else tuple(jnp.zeros((blocks, block_size, F), x.dtype) for _ in range(2 - (gate is None)))
    axes = varying_axes(x, row_weights, gate, up, down)
    carry = vary_over(axes, jnp.zeros(x.shape, acc), *saved)

    def expert(e, carry):
        Wg, Wu, Wd = _matrices(gate, up, down, e, transposed, x.dtype)

        def block(b, carry):
            y, *saved = carry
            r = plan.rows[b]
            H, G, U = _hidden(x[r], Wg, Wu, activation)
            O = Wd.apply(H) * plan.weights[b][:, None].astype(H.dtype)
            y = y.at[r].add(O.astype(acc))
            if save:
                saved = [s.at[b].set(a) for s, a in zip(saved, (U,) if G is None else (U, G))]
            return (y, *saved)

        return plan.over_blocks(e, block, carry)

    y, *saved = plan.over_experts(expert, carry)
    return y[: x.shape[0] - 1].astype(x.dtype), saved


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _block_ffn(activation, transposed, block_size, x, rows, row_weights, group_sizes, gate, up, down):
    """`block_ffn`; `activation`: `(act, limit)`."""
    return _run_forward(activation, transposed, block_size, False, x, rows, row_weights, group_sizes, gate, up, down)[0]


def _block_ffn_forward(activation, transposed, block_size, x, rows, row_weights, group_sizes, gate, up, down):
    y, saved = _run_forward(activation, transposed, block_size, True, x, rows, row_weights, group_sizes, gate, up, down)
    return y, (x, rows, row_weights, group_sizes, gate, up, down, saved)


def _block_ffn_backward(activation, transposed, block_size, residuals, y_bar):
    x, rows, row_weights, group_sizes, gate, up, down, saved = residuals
    plan = _Plan(rows, row_weights, group_sizes, block_size)
    acc = _accumulator(x.dtype)
    y_bar = jnp.concatenate([y_bar, jnp.zeros((1, y_bar.shape[1]), y_bar.dtype)])  # the padding row's
    zeros = lambda w: None if w is None else jnp.zeros(w.shape, acc)  # noqa: E731
    # inside shard_map the sums vary over every axis their terms do (the rows, the experts' shards)
    axes = varying_axes(x, row_weights, gate, up, down, y_bar, *saved)
    carry = vary_over(axes, jnp.zeros(x.shape, acc), jnp.zeros(plan.rows.shape, acc),
                      zeros(gate), zeros(up), zeros(down))

    def expert(e, carry):
        x_bar, w_bar, gate_bar, up_bar, down_bar = carry
        Wg, Wu, Wd = _matrices(gate, up, down, e, transposed, x.dtype)
        sums = vary_over(axes, *(None if W is None else jnp.zeros(W.stored.shape, acc) for W in (Wg, Wu, Wd)))

        def block(b, carry):
            x_bar, w_bar, *sums = carry
            r, w = plan.rows[b], plan.weights[b]
            X, Y_bar, U = x[r], y_bar[r], saved[0][b]
            if Wg is None:
                H, act_vjp = jax.vjp(activation[0], U)
            else:
                H, glu_vjp = jax.vjp(partial(glu, *activation), saved[1][b], U)
            O = Wd.apply(H)
            w_bar = w_bar.at[b].set(jnp.sum(Y_bar * O, axis=-1).astype(acc))
            O_bar = Y_bar * w[:, None].astype(Y_bar.dtype)
            H_bar = Wd.apply_transpose(O_bar)
            if Wg is None:
                U_bar, G_bar = act_vjp(H_bar)[0], None
            else:
                G_bar, U_bar = glu_vjp(H_bar)
            X_bar = Wu.apply_transpose(U_bar)
            products = (None if G_bar is None else Wg.gradient(X, G_bar), Wu.gradient(X, U_bar), Wd.gradient(H, O_bar))
            if G_bar is not None:
                X_bar = X_bar + Wg.apply_transpose(G_bar)
            sums = [None if s is None else s + p.astype(acc) for s, p in zip(sums, products)]
            x_bar = x_bar.at[r].add(X_bar.astype(acc))
            return (x_bar, w_bar, *sums)

        x_bar, w_bar, *sums = plan.over_blocks(e, block, (x_bar, w_bar, *sums))
        store = lambda total, s: None if s is None else total.at[e].set(s)  # noqa: E731
        return (x_bar, w_bar, store(gate_bar, sums[0]), store(up_bar, sums[1]), store(down_bar, sums[2]))

    x_bar, w_bar, gate_bar, up_bar, down_bar = plan.over_experts(expert, carry)
    cast = lambda bar, w: None if w is None else sum_to_vary_like(bar, w).astype(w.dtype)  # noqa: E731
    return (cast(x_bar, x), None, cast(w_bar.reshape(-1), row_weights), None, cast(gate_bar, gate),
            cast(up_bar, up), cast(down_bar, down))


_block_ffn.defvjp(_block_ffn_forward, _block_ffn_backward)
