"""The routed experts' FFNs on the CPU: one pass over blocks of sorted rows, each block through
its expert's whole FFN and added, weighted, into its tokens' outputs; with a hand-written VJP.

| symbol | meaning                                                                  |
|--------|--------------------------------------------------------------------------|
| n, D   | tokens, model width (`x` carries one more row of zeros: the padding row) |
| F, E   | an expert's hidden width, experts                                        |
| B, c   | rows per block, blocks per step                                          |
| P      | padded rows, `P = blocks · B` (`recurrax.nn.dispatch`)                   |
| r_b    | the token of each row of block b (n for a padding row)                   |
| w_b    | each row's combine weight (0 for a padding row)                          |
| e_b    | block b's expert                                                         |

Forward, per block b (its rows gathered and its output added inside the step, so neither the
`[P, D]` rows nor their `[P, D]` outputs are ever held: the temporaries do not grow with E):

    X = x[r_b]                           [B, D]
    G = X Wg_e,  U = X Wu_e              [B, F]     (ungated: G absent, H = act(U))
    H = act(G) ⊙ U
    O_b = H Wd_e                         [B, D]
    y[r_b] += w_b · O_b                  (float32; y_t = Σ_{e∈S_t} w_{t,e} FFN_e(x_t))

Backward, from ȳ, per block, G and U saved (O_b recomputed: one more matmul, no `[P, D]` saved):

    Ō_b = w_b · ȳ[r_b],   w̄_b = Σ_D ȳ[r_b] ⊙ O_b
    H̄ = Ō_b Wd_eᵀ,   W̄d_e += Hᵀ Ō_b
    Ū = H̄ ⊙ act(G),  Ḡ = act'(G)ᵀ (H̄ ⊙ U)     (ungated: Ū = act'(U)ᵀ H̄)
    W̄u_e += Xᵀ Ū,    W̄g_e += Xᵀ Ḡ
    x̄[r_b] += Ū Wu_eᵀ + Ḡ Wg_eᵀ

The weight cotangents accumulate in float32 over the blocks (a scatter-add by expert: blocks
of one step may share an expert) and are cast to the weights' dtype at the end. Inside
`jax.shard_map` each cotangent is summed over the mesh axes its terms vary over and its
primal does not (x̄ and w̄ over the shards of the experts' width, W̄ over the shards of the
rows). A padding row gathers zeros and weighs 0, so it contributes nothing either way.
Weights in PyTorch's `[E, out, in]` layout (`transposed`) are used, and their cotangents
built, in that layout.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..kernels._driver import vary_over, varying_axes


def block_ffn(x: Float[Array, "n1 D"], rows: Int[Array, " P"], row_weights: Float[Array, " P"],
              block_experts: Int[Array, " blocks"], gate: Float[Array, "E D F"] | None, up: Float[Array, "E D F"],
              down: Float[Array, "E F D"], *, act: Callable, transposed: bool, chunk: int) -> Float[Array, "n D"]:
    """`y [n, D]`: `y_t = Σ_{p: rows[p] = t} row_weights[p] · FFN_{e(p)}(x_t)`, row p through
    the FFN of its block's expert (module docstring). `x` ends with a zero row that padding
    rows (`rows == n`) point to."""
    return _block_ffn(act, transposed, chunk, x, rows, row_weights, block_experts, gate, up, down)


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


def _split(rows, row_weights, block_experts, chunk: int, padding_row: int):
    """Rows and their weights `[steps, c, B]`, experts `[steps, c]`, the last step filled with
    padding rows, and how many rows were added."""
    blocks = block_experts.shape[0]
    block_size = rows.shape[0] // blocks
    chunk = min(chunk, blocks)  # a step no longer than the blocks (decoding: a few blocks in all)
    steps = -(-blocks // chunk)
    extra = steps * chunk - blocks
    shape = (steps, chunk, block_size)
    rows = jnp.pad(rows, (0, extra * block_size), constant_values=padding_row).reshape(shape)
    row_weights = jnp.pad(row_weights, (0, extra * block_size)).reshape(shape)
    experts = jnp.pad(block_experts, (0, extra)).reshape(steps, chunk)
    return rows, row_weights, experts, extra * block_size


def _hidden(X, gate, up, act, transposed, experts):
    """`(H, G, U)` of `c` blocks' rows `X [c, B, D]` (G None without a gate)."""
    U = jnp.einsum("cbd,cdf->cbf", X, _matrix(up, experts, transposed).astype(X.dtype))
    if gate is None:
        return act(U), None, U
    G = jnp.einsum("cbd,cdf->cbf", X, _matrix(gate, experts, transposed).astype(X.dtype))
    return act(G) * U, G, U


def _output(H, down, transposed, experts):
    """`O = H Wd_e [c, B, D]`."""
    return jnp.einsum("cbf,cfd->cbd", H, _matrix(down, experts, transposed).astype(H.dtype))


def _needed(step_rows, padding_row: int):
    """Whether a step holds any routed row. Every expert's blocks start with one of its rows
    (its < B padding rows come last), so the steps past the last expert's rows are padding
    alone (up to E(B − 1)/B blocks of the bound P): skipped, not computed."""
    return step_rows[0, 0] < padding_row


def _zeros_like(axes, compute):
    """Zeros shaped as `compute()`'s outputs, varying over `axes` (a skipped step's outputs)."""
    return lambda: vary_over(axes, *jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(compute)))


def _run_forward(act, transposed, chunk, x, rows, row_weights, block_experts, gate, up, down):
    padding_row = x.shape[0] - 1
    steps_rows, steps_weights, steps_experts, _ = _split(rows, row_weights, block_experts, chunk, padding_row)
    y = jnp.zeros(x.shape, jnp.float32)
    axes = varying_axes(x, row_weights, gate, up, down)
    (y,) = vary_over(axes, y)

    def step(y, inputs):
        r, w, e = inputs

        def compute():
            H, G, U = _hidden(x[r], gate, up, act, transposed, e)
            O = _output(H, down, transposed, e) * w[..., None].astype(H.dtype)
            return vary_over(axes, O, G, U)

        needed = _needed(r, padding_row)
        O, G, U = jax.lax.cond(needed, compute, _zeros_like(axes, compute))
        y = y.at[r.reshape(-1)].add(O.reshape(-1, O.shape[-1]).astype(jnp.float32))
        return y, (G, U)

    y, (G, U) = jax.lax.scan(step, y, (steps_rows, steps_weights, steps_experts))
    return y[:padding_row].astype(x.dtype), (G, U)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _block_ffn(act, transposed, chunk, x, rows, row_weights, block_experts, gate, up, down):
    return _run_forward(act, transposed, chunk, x, rows, row_weights, block_experts, gate, up, down)[0]


def _block_ffn_forward(act, transposed, chunk, x, rows, row_weights, block_experts, gate, up, down):
    y, (G, U) = _run_forward(act, transposed, chunk, x, rows, row_weights, block_experts, gate, up, down)
    return y, (x, rows, row_weights, block_experts, gate, up, down, G, U)


def _accumulate(total, experts, product, transposed: bool):
    """`total[e] += product` for each block's expert, `product [c, in, out]` turned to the layout."""
    product = jnp.swapaxes(product, 1, 2) if transposed else product
    return total.at[experts].add(product.astype(jnp.float32))


def _block_ffn_backward(act, transposed, chunk, residuals, y_bar):
    x, rows, row_weights, block_experts, gate, up, down, G_all, U_all = residuals
    padding_row = x.shape[0] - 1
    steps_rows, steps_weights, steps_experts, extra = _split(rows, row_weights, block_experts, chunk, padding_row)
    y_bar = jnp.concatenate([y_bar, jnp.zeros((1, y_bar.shape[1]), y_bar.dtype)])  # the padding row's
    zeros = lambda w: None if w is None else jnp.zeros(w.shape, jnp.float32)  # noqa: E731
    carry = (jnp.zeros(x.shape, jnp.float32), zeros(gate), zeros(up), zeros(down))
    # inside shard_map the sums vary over every axis their terms do (the rows, the experts' shards)
    axes = varying_axes(x, row_weights, gate, up, down, y_bar, G_all, U_all)
    carry = vary_over(axes, *carry)

    def step(carry, inputs):
        r = inputs[0]
        skip = lambda carry, _: (carry, vary_over(axes, jnp.zeros(r.shape, jnp.float32))[0])  # noqa: E731
        return jax.lax.cond(_needed(r, padding_row), _backward_step, skip, carry, inputs)

    def _backward_step(carry, inputs):
        x_bar, gate_bar, up_bar, down_bar = carry
        r, w, e, G, U = inputs
        X, Y_bar = x[r], y_bar[r]
        if gate is None:
            H, act_vjp = jax.vjp(act, U)
        else:
            A, act_vjp = jax.vjp(act, G)
            H = A * U
        O = _output(H, down, transposed, e)
        w_bar = jnp.sum(Y_bar * O, axis=-1).astype(jnp.float32)
        O_bar = Y_bar * w[..., None].astype(Y_bar.dtype)
        H_bar = jnp.einsum("cbd,cfd->cbf", O_bar, _matrix(down, e, transposed).astype(O_bar.dtype))
        if gate is None:
            U_bar = act_vjp(H_bar)[0]
        else:
            U_bar = H_bar * A
            G_bar = act_vjp(H_bar * U)[0]
        down_bar = _accumulate(down_bar, e, jnp.einsum("cbf,cbd->cfd", H, O_bar), transposed)
        up_bar = _accumulate(up_bar, e, jnp.einsum("cbd,cbf->cdf", X, U_bar), transposed)
        X_bar = jnp.einsum("cbf,cdf->cbd", U_bar, _matrix(up, e, transposed).astype(U_bar.dtype))
        if gate is not None:
            gate_bar = _accumulate(gate_bar, e, jnp.einsum("cbd,cbf->cdf", X, G_bar), transposed)
            X_bar = X_bar + jnp.einsum("cbf,cdf->cbd", G_bar, _matrix(gate, e, transposed).astype(G_bar.dtype))
        x_bar = x_bar.at[r.reshape(-1)].add(X_bar.reshape(-1, X_bar.shape[-1]).astype(jnp.float32))
        return (x_bar, gate_bar, up_bar, down_bar), w_bar

    G_steps = None if gate is None else G_all
    (x_bar, gate_bar, up_bar, down_bar), w_bar = jax.lax.scan(
        step, carry, (steps_rows, steps_weights, steps_experts, G_steps, U_all))
    w_bar = w_bar.reshape(-1)[: rows.shape[0]]
    cast = lambda bar, w: None if w is None else _sum_to_vary_like(bar, w).astype(w.dtype)  # noqa: E731
    return (cast(x_bar, x), None, cast(w_bar, row_weights), None, cast(gate_bar, gate), cast(up_bar, up),
            cast(down_bar, down))


def _sum_to_vary_like(bar, primal):
    """`bar` summed over the mesh axes it varies over and `primal` does not (inside shard_map:
    e.g. x̄'s terms from each `tensor` shard of the experts' width), as autodiff's transpose of
    the implicit broadcast would."""
    extra = tuple(sorted(varying_axes(bar) - varying_axes(primal)))
    return jax.lax.psum(bar, extra) if extra else bar


_block_ffn.defvjp(_block_ffn_forward, _block_ffn_backward)
