"""Rematerialisation of residual blocks: what a training step keeps for the backward.

| `remat`   | kept per block for the backward                          | recomputed in the backward         |
|-----------|----------------------------------------------------------|------------------------------------|
| `None`    | everything autodiff saves (every intermediate it needs)  | nothing                            |
| `"block"` | the block's input only                                   | the whole block, mixer included    |
| `"dots"`  | the outputs of matmuls without batch dimensions (the     | norms, activations, gates and the  |
|           | projections and MLPs: `x W`)                             | recurrent mixer's kernel           |

A block under `"dots"` runs inside `flax.nnx.remat` (`jax.checkpoint`) with the policy above
(`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`). A block under `"block"` is a
`jax.custom_vjp` whose forward keeps its inputs and whose backward is the backward of the
block under `jax.checkpoint` (`nothing_saveable`), run on those inputs after the input is
made to depend on the output's cotangent (`_after`): the recompute cannot start before the
backward reaches the block, whatever the compiler's scheduler does. (`jax.checkpoint` alone
holds it back by an optimization barrier; XLA's CPU compiler in jaxlib 0.10 removes the
barriers before it schedules, ran every block's recompute during the forward and kept as
much as without remat: 6 GLA blocks, d_model 512, 4,096 tokens, 2,406 MiB of temporaries
plain, 2,342 under `jax.checkpoint`, 1,001 now; jaxlib 0.12.1, which removes them after
scheduling: 2,374 plain, 881 either way. Compiled for a TPU v5e by libtpu (JAX 0.12), whose
scheduler keeps the barrier, the custom VJP and `jax.checkpoint` keep the same: 379 MiB of
temporaries, 1,140 plain.) The values and the gradients are those of the
plain block up to float rounding. A `"block"` model has no forward-mode derivative
(`jax.jvp`), as any `custom_vjp`. The recurrent kernels' `custom_vjp` residuals are
recomputed too: a kernel's batched chunk matmuls are not saved under `"dots"`.
Decoding (a call with a cache) runs the plain block: it has no backward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

REMAT_POLICIES = {
    "block": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}
"""The `remat=` values besides None, and the `jax.checkpoint` policy each runs a block under."""


def check_remat(remat: str | None) -> str | None:
    """`remat` if it is None or a key of `REMAT_POLICIES`, else a `ValueError` naming both."""
    if remat is not None and remat not in REMAT_POLICIES:
        raise ValueError(f"remat must be None, {' or '.join(repr(name) for name in REMAT_POLICIES)}, got {remat!r}")
    return remat


def call_block(block: nnx.Module, remat: str | None, h, cache=None, **context):
    """`block(h, cache, **context)`, under `jax.checkpoint` with `remat`'s policy when `remat`
    is set and there is no cache.

    **Arguments:**
    - `block`: a residual block called as `block(h, cache, **context)`.
    - `remat`: None, `"block"` or `"dots"` (`REMAT_POLICIES`).
    - `h`: the residual stream; `cache`: the block's decode cache (None to train).
    - `context`: the block's keyword arguments; JAX arrays among them are inputs of the
      checkpointed call, other values (None, ints, numpy arrays) stay fixed in it.
    """
    if remat is None or cache is not None:
        return block(h, cache, **context)
    arrays = {name: value for name, value in context.items() if isinstance(value, jax.Array)}
    fixed = {name: value for name, value in context.items() if name not in arrays}

    def run(block, h, arrays):
        return block(h, None, **arrays, **fixed)

    if remat == "dots":
        return nnx.remat(run, policy=REMAT_POLICIES[remat])(block, h, arrays)
    return _recomputed(block, h, arrays, fixed)


def _after(x: jax.Array, cotangent) -> jax.Array:
    """`x + 0·c`, c the cotangent's first number where finite (else 0): `x`'s values (up to
    the sign of a zero) made to depend on the cotangent. XLA keeps it (it folds `0·c` only for
    integers: `0·inf` is NaN), so nothing that reads the result runs before the cotangent exists."""
    first = jax.tree.leaves(cotangent)[0].ravel()[0]
    return x + (jnp.where(jnp.isfinite(first), first, 0) * 0).astype(x.dtype)


def _recomputed(block: nnx.Module, h, arrays: dict, fixed: dict):
    """`block(h, None, **arrays, **fixed)` keeping only its inputs for the backward, which
    recomputes the block once the output's cotangent exists. (The backward's `jax.vjp`
    computes the block's output too; unused, XLA drops it: the block runs once in the
    forward and once in the backward, as under `jax.checkpoint`.)"""
    graphdef, state = nnx.split(block)

    def run(state, h, arrays):
        return nnx.merge(graphdef, state)(h, None, **arrays, **fixed)

    @jax.custom_vjp
    def recomputed(state, h, arrays):
        return run(state, h, arrays)

    def forward(state, h, arrays):
        return run(state, h, arrays), (state, h, arrays)

    def backward(inputs, cotangent):
        state, h, arrays = inputs
        checkpointed = jax.checkpoint(run, policy=REMAT_POLICIES["block"])
        return jax.vjp(checkpointed, state, _after(h, cotangent), arrays)[1](cotangent)

    recomputed.defvjp(forward, backward)
    return recomputed(state, h, arrays)
