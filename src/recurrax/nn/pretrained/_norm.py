"""fla's RMS norms: plain, per head, and gated by an activation of a second input.

| symbol | meaning                                  |
|--------|------------------------------------------|
| D      | the normalised (last) axis               |
| ε      | `eps`                                    |

    RMSNorm(x)        = x / sqrt(mean(x²) + ε) ⊙ w                (w absent without affine)
    GatedRMSNorm(x,g) = RMSNorm(x) ⊙ act(g),  act = swish or sigmoid

Both compute in float32 and return the input's dtype, like fla's Triton kernels. The weight
is called `weight`, as in fla's state dict, so conversion is a renaming only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

ACTIVATIONS = {
    "swish": jax.nn.silu,
    "silu": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "logsigmoid": jax.nn.log_sigmoid,
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),
    "sqrelu": lambda x: jnp.square(jax.nn.relu(x)),
}
"""fla's `ACT2FN` names that the converted layers accept (gates and feature maps)."""


def activation(name: str, what: str):
    """The activation called `name`, or a ValueError that names `what` and the choices."""
    if name not in ACTIVATIONS:
        raise ValueError(f"{what} must be one of {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis, with an optional elementwise weight.

    **Arguments:**
    - `size`: D; `eps`: ε; `elementwise_affine`: learn a weight `[D]` (initialised to ones).
    - `dtype`: the weight's dtype.
    """

    def __init__(self, size: int, *, eps: float = 1e-5, elementwise_affine: bool = True, dtype=jnp.float32):
        self.size, self.eps = size, float(eps)
        self.weight = nnx.Param(jnp.ones((size,), dtype)) if elementwise_affine else None

    def __call__(self, x: Float[Array, "... D"], gate: Float[Array, "... D"] | None = None,
                 gate_fn: str = "swish") -> Float[Array, "... D"]:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight[...].astype(jnp.float32)
        if gate is not None:
            y = y * activation(gate_fn, "gate_fn")(gate.astype(jnp.float32))
        return y.astype(x.dtype)
