"""Mixed precision for a model built in one dtype: parameters stored in `param_dtype`, the
forward computed in `dtype` (Flax's convention, e.g. float32 parameters, bfloat16 compute).

| name          | meaning                                                             |
|---------------|---------------------------------------------------------------------|
| `param_dtype` | the dtype the floating-point `nnx.Param`s are stored (and trained) in |
| `dtype`       | the computation dtype: the layers' own (`nnx.Linear(dtype=…)`)      |

    stored:    θ                       (param_dtype)
    forward:   f(x; cast(θ, dtype))    (a view of the module; gradients reach θ through the cast)

The forward is exactly that of the model built in `dtype` with the parameters rounded to it;
what the layers keep wide (recurrent states, gate cumsums, norms' variance, softmax
statistics, the logits) stays wide, as it does in a model built in `dtype`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def cast_floating(tree, dtype):
    """Every floating-point leaf of `tree` cast to `dtype`; other leaves as they are."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def store_params(module: nnx.Module, param_dtype) -> None:
    """Cast `module`'s floating-point parameters in place to `param_dtype`."""
    nnx.update(module, cast_floating(nnx.state(module, nnx.Param), param_dtype))


def compute_view(module: nnx.Module, dtype) -> nnx.Module:
    """A copy of `module` whose floating-point parameters are cast to `dtype` (the rest shared):
    call it inside the forward; the gradients reach `module`'s parameters through the cast."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    return nnx.merge(graphdef, cast_floating(params, dtype), rest)
