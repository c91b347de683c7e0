"""The matmul precision of the XLA algorithms: float32 calls computed to float32 accuracy.

XLA's default precision for a float32 product is the backend's: exact on a CPU, TensorFloat-32
on recent NVIDIA GPUs and one bfloat16 pass on a TPU (about three significant digits). The
XLA paths of `recurrent` and `delta_rule` therefore trace their products under an explicit
precision, chosen once at the public interface:

| `precision=` | float32 / float64 inputs | bfloat16 / float16 inputs |
|---|---|---|
| `None` (default) | `"highest"`: float32 accuracy on every backend | `"default"`: the backend's fastest |
| a name or `jax.lax.Precision` | that precision | that precision |

Names are those of `jax.default_matmul_precision` (`"default"`, `"high"`, `"highest"`,
`"bfloat16"`, `"tensorfloat32"`, `"float32"`). A custom VJP traces its backward after the
forward has returned, outside the caller's context; each of the algorithms' custom VJPs
therefore carries the forward's precision (`traced_precision()`) as a static argument and
re-enters it (`matmul_precision`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

NAMES = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32")
"""The precision names a call may give (`jax.default_matmul_precision`'s)."""

_OF_ENUM = {jax.lax.Precision.DEFAULT: "default", jax.lax.Precision.HIGH: "high", jax.lax.Precision.HIGHEST: "highest"}


def resolve(precision: Any, dtype: Any) -> str:
    """The precision name a call with inputs of `dtype` computes at (`precision` validated)."""
    if precision is None:
        return "highest" if jnp.dtype(dtype).itemsize >= 4 else "default"
    if isinstance(precision, jax.lax.Precision):
        return _OF_ENUM[precision]
    if isinstance(precision, str) and precision.lower() in NAMES:
        return precision.lower()
    raise ValueError(
        f"precision must be None (float32 accuracy for float32 inputs, the backend's default for "
        f"16-bit ones), a jax.lax.Precision or one of {list(NAMES)}, got {precision!r}"
    )


@contextlib.contextmanager
def matmul_precision(name: str | None) -> Iterator[None]:
    """Trace the products inside at `name` (a no-op for `None`)."""
    if name is None:
        yield
        return
    with jax.default_matmul_precision(name):
        yield


def traced_precision() -> str | None:
    """The matmul precision the current trace runs under (what a custom VJP's backward must
    re-enter)."""
    return jax.config.jax_default_matmul_precision
