"""fla's `ShortConvolution`: a causal depthwise convolution with optional bias and SiLU.

| symbol | meaning                                            |
|--------|----------------------------------------------------|
| B, T   | batch rows, tokens per row (packed: B = 1, T = N)  |
| C      | channels                                           |
| W      | taps; the decode buffer keeps the last W − 1 inputs |
| R      | buffer rows: B, or S packed sequences              |

    y_t = act(Σ_{l=0}^{W−1} kernel[W−1−l] ⊙ x_{t−l} + bias),   act = SiLU or identity

fla stores the weight as a depthwise `Conv1d` weight `[C, 1, W]`; here it is `kernel [W, C]`
(`kernel[j] = weight[:, 0, j]`), the layout of `recurrax.nn.ShortConvolution`, whose lag
gathering (dense and packed, never crossing a sequence start) this module reuses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from .._conv import _dense_taps, _packed_taps, depthwise


class CausalConv1d(nnx.Module):
    """Causal depthwise convolution of `kernel_size` taps, optional bias, optional SiLU.

    **Arguments:**
    - `channels`: C; `kernel_size`: W ≥ 2; `bias`: learn a bias `[C]`.
    - `activation`: `"silu"`/`"swish"` or `None`.
    - `dtype`: parameter and computation dtype; `rngs`: initialisation.
    """

    def __init__(self, channels: int, kernel_size: int, *, bias: bool = False, activation: str | None = "silu",
                 dtype=jnp.float32, rngs: nnx.Rngs):
        if kernel_size < 2:
            raise ValueError(f"conv_size must be at least 2, got {kernel_size}")
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"activation must be 'silu', 'swish' or None, got {activation!r}")
        bound = kernel_size**-0.5
        self.kernel = nnx.Param(jax.random.uniform(rngs.params(), (kernel_size, channels), dtype, -bound, bound))
        self.bias = nnx.Param(jnp.zeros((channels,), dtype)) if bias else None
        self.channels, self.kernel_size, self.activation = channels, kernel_size, activation

    def __call__(
        self,
        x: Float[Array, "B T C"],
        buffer: Float[Array, "R W_minus_1 C"] | None = None,
        cu_seqlens: Int[Array, " S_plus_1"] | None = None,
    ) -> tuple[Float[Array, "B T C"], Float[Array, "R W_minus_1 C"]]:
        """Convolve `x` after `buffer` (zeros when `None`); returns `(y, new_buffer)`."""
        rows = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        if buffer is None:
            buffer = self.empty_buffer(rows, x.dtype)
        buffer = buffer.astype(x.dtype)
        if cu_seqlens is None:
            taps, new_buffer = _dense_taps(x, buffer, self.kernel_size)  # W × [B, T, C]
        else:
            taps, new_buffer = _packed_taps(x[0], buffer, cu_seqlens, self.kernel_size)
            taps = [tap[None] for tap in taps]  # W × [1, N, C]
        y = depthwise(taps, self.kernel[...][::-1])  # lag l ↦ kernel[W−1−l]
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        if self.activation is not None:
            y = jax.nn.silu(y)
        return y.astype(x.dtype), new_buffer

    def empty_buffer(self, rows: int, dtype=jnp.float32) -> Float[Array, "R W_minus_1 C"]:
        """Zeros `[rows, W − 1, C]`: the buffer of sequences with no tokens yet."""
        return jnp.zeros((rows, self.kernel_size - 1, self.channels), dtype)
