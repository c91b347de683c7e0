"""Rematerialisation of residual blocks: what a training step keeps for the backward.

| `remat`   | kept per block for the backward                          | recomputed in the backward         |
|-----------|----------------------------------------------------------|------------------------------------|
| `None`    | everything autodiff saves (every intermediate it needs)  | nothing                            |
| `"block"` | the block's input only                                   | the whole block, mixer included    |
| `"dots"`  | the outputs of matmuls without batch dimensions (the     | norms, activations, gates and the  |
|           | projections and MLPs: `x W`)                             | recurrent mixer's kernel           |

A block under `"block"` or `"dots"` runs inside `flax.nnx.remat` (`jax.checkpoint`) with the
policy above (`jax.checkpoint_policies.nothing_saveable`,
`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`); the values and the gradients
are those of the plain block up to float rounding. The recurrent kernels' `custom_vjp`
residuals are recomputed too: a kernel's batched chunk matmuls are not saved under `"dots"`.
Decoding (a call with a cache) runs the plain block: it has no backward.
"""

from __future__ import annotations

import jax
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

    return nnx.remat(run, policy=REMAT_POLICIES[remat])(block, h, arrays)
