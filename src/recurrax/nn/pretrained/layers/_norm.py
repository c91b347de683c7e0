"""fla's RMS norms: plain, per head, and gated by an activation of a second input.

| symbol | meaning                                  |
|--------|------------------------------------------|
| D      | the normalised (last) axis               |
| ε      | `eps`                                    |

    RMSNorm(x)        = x / sqrt(mean(x²) + ε) ⊙ w                (w absent without affine)
    ZeroCentredRMSNorm(x) = x / sqrt(mean(x²) + ε) ⊙ (1 + w)       (Gemma's, Qwen3-Next's; w starts at 0)
    GatedRMSNorm(x,g) = RMSNorm(x) ⊙ act(g),  act = swish or sigmoid
    GatedNorm(x, z)   = x / sqrt(mean(x²) + ε) ⊙ w ⊙ silu(z)      (`recurrax.nn`'s Gated DeltaNet norm)

Both compute in float32 and return the input's dtype, like fla's Triton kernels. The weight
is called `weight`, as in fla's state dict, so conversion is a renaming only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from ..._gated_deltanet import GatedRMSNorm
from ..._sharding import param

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
    - `axis`: the weight's logical axis name (`recurrax.nn`'s sharding table).
    - `dtype`: the weight's dtype.
    """

    def __init__(self, size: int, *, eps: float = 1e-5, elementwise_affine: bool = True, axis: str = "embed",
                 dtype=jnp.float32):
        self.size, self.eps = size, float(eps)
        self.weight = param(jnp.ones((size,), dtype), axis) if elementwise_affine else None

    def __call__(self, x: Float[Array, "... D"], gate: Float[Array, "... D"] | None = None,
                 gate_fn: str = "swish") -> Float[Array, "... D"]:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight[...].astype(jnp.float32)
        if gate is not None:
            y = y * activation(gate_fn, "gate_fn")(gate.astype(jnp.float32))
        return y.astype(x.dtype)


class GroupedGatedRMSNorm(nnx.Module):
    """Mamba-2's gated RMS norm over `groups` channel groups, as `transformers` computes it.

        gate first (default):  y = RMS_group(x ⊙ silu(z)) ⊙ w
        norm_before_gate:      y = RMS_group(x) ⊙ w ⊙ silu(z)        (Falcon-H1's option)

    where `RMS_group` normalises each of the `groups` contiguous slices of the last axis on
    its own. Computes in float32 and returns the input's dtype. Differs from `RMSNorm(gate=…)`,
    which normalises first and over the whole axis.

    **Arguments:**
    - `size`: channels D (a multiple of `groups`); `groups`: channel groups; `eps`: ε.
    - `norm_before_gate`: apply the gate after the norm instead of before it.
    - `dtype`: the weight's dtype.
    """

    checkpoint_params = ("weight",)

    def __init__(self, size: int, *, groups: int = 1, eps: float = 1e-6, norm_before_gate: bool = False,
                 dtype=jnp.float32):
        if size % groups:
            raise ValueError(f"the gated norm needs groups ({groups}) to divide its size ({size})")
        self.size, self.groups, self.eps, self.norm_before_gate = size, groups, float(eps), norm_before_gate
        self.weight = param(jnp.ones((size,), dtype), "heads")

    def __call__(self, x: Float[Array, "... D"], gate: Float[Array, "... D"] | None = None) -> Float[Array, "... D"]:
        y = x.astype(jnp.float32)
        silu_gate = None if gate is None else jax.nn.silu(gate.astype(jnp.float32))
        if silu_gate is not None and not self.norm_before_gate:
            y = y * silu_gate
        grouped = y.reshape(*y.shape[:-1], self.groups, self.size // self.groups)
        grouped = grouped * jax.lax.rsqrt(jnp.mean(jnp.square(grouped), axis=-1, keepdims=True) + self.eps)
        y = grouped.reshape(y.shape) * self.weight[...].astype(jnp.float32)
        if silu_gate is not None and self.norm_before_gate:
            y = y * silu_gate
        return y.astype(x.dtype)


class ZeroCentredRMSNorm(RMSNorm):
    """RMS norm whose stored weight is the scale's offset from one: `x / rms(x) ⊙ (1 + w)`
    (`transformers`' Gemma and Qwen3-Next norms), in float32, returning the input's dtype.
    Initialised (and stored) as `w = 0`.

    **Arguments:** `size`, `eps`, `axis`, `dtype`, as `RMSNorm`'s.
    """

    def __init__(self, size: int, *, eps: float = 1e-6, axis: str = "embed", dtype=jnp.float32):
        self.size, self.eps = size, float(eps)
        self.weight = param(jnp.zeros((size,), dtype), axis)

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (y * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)


class GatedNorm(GatedRMSNorm):
    """`recurrax.nn`'s Gated DeltaNet output norm `o / rms(o) ⊙ w ⊙ silu(z)` per value head
    (`transformers`' `Qwen3NextRMSNormGated`, `OlmoHybridRMSNormGated`), stored as `weight`."""

    checkpoint_params = ("weight",)
