"""The routed experts' FFNs on the CPU: one pass over blocks of sorted rows, each block through
its expert's whole FFN, with a hand-written VJP; and the combine of each token's routed rows.

| symbol | meaning                                                                  |
|--------|--------------------------------------------------------------------------|
| n, D   | tokens, model width (`x` carries one more row of zeros: the padding row) |
| F, E   | an expert's hidden width, experts                                        |
| B, c   | rows per block, blocks per step                                          |
| P      | padded rows, `P = blocks · B` (`recurrax.nn.dispatch`)                   |
| r_b    | the token of each row of block b (n for a padding row)                   |
| e_b    | block b's expert                                                         |

Forward, per block b (its rows gathered inside the step, so the `[P, D]` rows and the `[P, F]`
activations of three separate grouped matmuls are never all live between passes):

    X = x[r_b]                           [B, D]
    G = X Wg_e,  U = X Wu_e              [B, F]     (ungated: G absent, H = act(U))
    H = act(G) ⊙ U
    O_b = H Wd_e                         [B, D]

Backward, from Ō (the combine's cotangent of each row's output), per block, G and U saved:

    H̄ = Ō_b Wd_eᵀ,   W̄d_e += Hᵀ Ō_b
    Ū = H̄ ⊙ act(G),  Ḡ = act'(G)ᵀ (H̄ ⊙ U)     (ungated: Ū = act'(U)ᵀ H̄)
    W̄u_e += Xᵀ Ū,    W̄g_e += Xᵀ Ḡ
    x̄[r_b] += Ū Wu_eᵀ + Ḡ Wg_eᵀ

The weight cotangents accumulate in float32 over the blocks (a scatter-add by expert: blocks
of one step may share an expert) and are cast to the weights' dtype at the end. Inside
`jax.shard_map` each cotangent is summed over the mesh axes its terms vary over and its
primal does not (x̄ over the shards of the experts' width, W̄ over the shards of the rows). A padding row
gathers zeros, so it contributes nothing either way. Weights in PyTorch's `[E, out, in]`
layout (`transposed`) are used, and their cotangents built, in that layout.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..kernels._driver import vary_over, varying_axes


def block_ffn(x: Float[Array, "n1 D"], rows: Int[Array, " P"], block_experts: Int[Array, " blocks"],
              gate: Float[Array, "E D F"] | None, up: Float[Array, "E D F"], down: Float[Array, "E F D"], *,
              act: Callable, transposed: bool, chunk: int) -> Float[Array, "P D"]:
    """`O [P, D]`: row p of `x[rows]` through the FFN of its block's expert (module docstring).
    `x` ends with a zero row that padding rows (`rows == n`) point to."""
    return _block_ffn(act, transposed, chunk, x, rows, block_experts, gate, up, down)


def combine(out: Float[Array, "P D"], positions: Int[Array, "n k"], weights: Float[Array, "n k"]) -> Float[Array, "n D"]:
    """`y_t = Σ_j w_{t,j} · out[positions[t, j]]`, one gather of `[n, D]` rows per slot j, each
    fused with its multiply-add (on the CPU about 6× faster than gathering `[n, k, D]` at once:
    benchmarks/results/moe.md)."""
    weights = weights.astype(out.dtype)
    total = out[positions[:, 0]] * weights[:, :1]
    for slot in range(1, positions.shape[1]):
        total = total + out[positions[:, slot]] * weights[:, slot:slot + 1]
    return total


def _matrix(weights, experts, transposed: bool):
    """The chosen experts' matrices `[c, in, out]` (from `[E, in, out]` or, transposed, `[E, out, in]`)."""
    chosen = weights[experts]
    return jnp.swapaxes(chosen, 1, 2) if transposed else chosen


def _split(rows, block_experts, chunk: int, padding_row: int):
    """Rows `[steps, c, B]` and experts `[steps, c]`, the last step filled with padding rows,
    and how many rows were added."""
    blocks = block_experts.shape[0]
    block_size = rows.shape[0] // blocks
    chunk = min(chunk, blocks)  # a step no longer than the blocks (decoding: a few blocks in all)
    steps = -(-blocks // chunk)
    extra = steps * chunk - blocks
    rows = jnp.pad(rows, (0, extra * block_size), constant_values=padding_row).reshape(steps, chunk, block_size)
    experts = jnp.pad(block_experts, (0, extra)).reshape(steps, chunk)
    return rows, experts, extra * block_size


def _forward_step(x, gate, up, down, act, transposed, rows, experts):
    """One step's `(O, G, U)` for `c` blocks."""
    X = x[rows]  # [c, B, D]
    U = jnp.einsum("cbd,cdf->cbf", X, _matrix(up, experts, transposed).astype(X.dtype))
    G = None if gate is None else jnp.einsum("cbd,cdf->cbf", X, _matrix(gate, experts, transposed).astype(X.dtype))
    H = act(U) if gate is None else act(G) * U
    O = jnp.einsum("cbf,cfd->cbd", H, _matrix(down, experts, transposed).astype(H.dtype))
    return O, G, U


def _needed(step_rows, padding_row: int):
    """Whether a step holds any routed row. Every expert's blocks start with one of its rows
    (its < B padding rows come last), so the steps past the last expert's rows are padding
    alone (up to E(B − 1)/B blocks of the bound P): skipped, not computed."""
    return step_rows[0, 0] < padding_row


def _run_forward(act, transposed, chunk, x, rows, block_experts, gate, up, down):
    steps_rows, steps_experts, extra = _split(rows, block_experts, chunk, x.shape[0] - 1)

    def step(_, inputs):
        compute = partial(_forward_step, x, gate, up, down, act, transposed, *inputs)
        axes = varying_axes(x, gate, up, down, *inputs)
        skip = lambda: vary_over(axes, *jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),  # noqa: E731
                                                     jax.eval_shape(compute)))
        return None, jax.lax.cond(_needed(inputs[0], x.shape[0] - 1), lambda: vary_over(axes, *compute()), skip)

    _, (O, G, U) = jax.lax.scan(step, None, (steps_rows, steps_experts))
    O = O.reshape(-1, x.shape[1])
    return O[: O.shape[0] - extra], (G, U)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _block_ffn(act, transposed, chunk, x, rows, block_experts, gate, up, down):
    return _run_forward(act, transposed, chunk, x, rows, block_experts, gate, up, down)[0]


def _block_ffn_forward(act, transposed, chunk, x, rows, block_experts, gate, up, down):
    O, (G, U) = _run_forward(act, transposed, chunk, x, rows, block_experts, gate, up, down)
    return O, (x, rows, block_experts, gate, up, down, G, U)


def _accumulate(total, experts, product, transposed: bool):
    """`total[e] += product` for each block's expert, `product [c, in, out]` turned to the layout."""
    product = jnp.swapaxes(product, 1, 2) if transposed else product
    return total.at[experts].add(product.astype(jnp.float32))


def _block_ffn_backward(act, transposed, chunk, residuals, O_bar):
    x, rows, block_experts, gate, up, down, G_all, U_all = residuals
    steps_rows, steps_experts, extra = _split(rows, block_experts, chunk, x.shape[0] - 1)
    B = steps_rows.shape[2]
    O_bar = jnp.pad(O_bar, ((0, extra), (0, 0))).reshape(*steps_rows.shape, -1)
    zeros = lambda w: None if w is None else jnp.zeros(w.shape, jnp.float32)  # noqa: E731
    carry = (jnp.zeros(x.shape, jnp.float32), zeros(gate), zeros(up), zeros(down))
    # inside shard_map the sums vary over every axis their terms do (the rows, the experts' shards)
    carry = vary_over(varying_axes(x, gate, up, down, O_bar, G_all, U_all), *carry)

    def step(carry, inputs):
        return jax.lax.cond(_needed(inputs[0], x.shape[0] - 1), _backward_step, lambda carry, _: carry,
                            carry, inputs), None

    def _backward_step(carry, inputs):
        x_bar, gate_bar, up_bar, down_bar = carry
        r, e, O_b, G, U = inputs
        X = x[r]
        Wd = _matrix(down, e, transposed).astype(O_b.dtype)
        H_bar = jnp.einsum("cbd,cfd->cbf", O_b, Wd)
        if gate is None:
            H, act_vjp = jax.vjp(act, U)
            U_bar = act_vjp(H_bar)[0]
        else:
            A, act_vjp = jax.vjp(act, G)
            H = A * U
            U_bar = H_bar * A
            G_bar = act_vjp(H_bar * U)[0]
        down_bar = _accumulate(down_bar, e, jnp.einsum("cbf,cbd->cfd", H, O_b), transposed)
        up_bar = _accumulate(up_bar, e, jnp.einsum("cbd,cbf->cdf", X, U_bar), transposed)
        X_bar = jnp.einsum("cbf,cdf->cbd", U_bar, _matrix(up, e, transposed).astype(U_bar.dtype))
        if gate is not None:
            gate_bar = _accumulate(gate_bar, e, jnp.einsum("cbd,cbf->cdf", X, G_bar), transposed)
            X_bar = X_bar + jnp.einsum("cbf,cdf->cbd", G_bar, _matrix(gate, e, transposed).astype(G_bar.dtype))
        x_bar = x_bar.at[r.reshape(-1)].add(X_bar.reshape(-1, X_bar.shape[-1]).astype(jnp.float32))
        return x_bar, gate_bar, up_bar, down_bar

    G_steps = None if gate is None else G_all
    (x_bar, gate_bar, up_bar, down_bar), _ = jax.lax.scan(
        step, carry, (steps_rows, steps_experts, O_bar, G_steps, U_all))
    cast = lambda bar, w: None if w is None else _sum_to_vary_like(bar, w).astype(w.dtype)  # noqa: E731
    return (cast(x_bar, x), None, None, cast(gate_bar, gate), cast(up_bar, up), cast(down_bar, down))


def _sum_to_vary_like(bar, primal):
    """`bar` summed over the mesh axes it varies over and `primal` does not (inside shard_map:
    e.g. x̄'s terms from each `tensor` shard of the experts' width), as autodiff's transpose of
    the implicit broadcast would."""
    extra = tuple(sorted(varying_axes(bar) - varying_axes(primal)))
    return jax.lax.psum(bar, extra) if extra else bar


_block_ffn.defvjp(_block_ffn_forward, _block_ffn_backward)
