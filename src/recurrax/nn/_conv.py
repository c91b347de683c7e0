"""A short causal depthwise convolution over time, with a decode buffer and packed sequences.

| symbol | meaning                                            |
|--------|----------------------------------------------------|
| B, T   | batch rows, tokens per row (packed: B = 1, T = N)  |
| C      | channels                                           |
| W      | kernel size (taps); the buffer keeps W − 1 tokens  |
| R      | buffer rows: B, or S packed sequences              |

    y_t = silu(Σ_{l=0}^{W−1} w[W−1−l] ⊙ x_{t−l})

where `x_{t−l}` before the start of a sequence comes from its buffer (the sequence's last
W − 1 inputs so far, zeros for a fresh one). The new buffer holds the last W − 1 inputs of
each sequence, so convolving a sequence in pieces equals convolving it whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from ..varlen import segments


class ShortConvolution(nnx.Module):
    """Causal depthwise convolution of `kernel_size` taps followed by SiLU.

    **Arguments:**
    - `channels`: C; `kernel_size`: W ≥ 2.
    - `dtype`, `param_dtype`: computation and parameter dtypes; `rngs`: initialisation.
    """

    def __init__(self, channels: int, kernel_size: int, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        if kernel_size < 2:
            raise ValueError(f"kernel_size must be at least 2, got {kernel_size}")
        bound = kernel_size**-0.5
        init = jax.random.uniform(rngs.params(), (kernel_size, channels), param_dtype, -bound, bound)
        self.kernel = nnx.Param(init)
        self.channels, self.kernel_size, self.dtype = channels, kernel_size, dtype

    def __call__(
        self,
        x: Float[Array, "B T C"],
        buffer: Float[Array, "R W_minus_1 C"] | None = None,
        cu_seqlens: Int[Array, " S_plus_1"] | None = None,
    ) -> tuple[Float[Array, "B T C"], Float[Array, "R W_minus_1 C"]]:
        """Convolve `x` after `buffer`; returns `(y, new_buffer)`.

        **Arguments:**
        - `x`: `[B, T, C]`, or packed `[1, N, C]` with `cu_seqlens`.
        - `buffer`: the previous W − 1 inputs of each row (or sequence), or `None` for zeros.
        - `cu_seqlens`: `[S + 1]` boundaries of packed sequences.
        """
        rows = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        if buffer is None:
            buffer = self.empty_buffer(rows, x.dtype)
        elif buffer.shape != (rows, self.kernel_size - 1, self.channels):
            raise ValueError(f"buffer must be [{rows}, {self.kernel_size - 1}, {self.channels}], got {buffer.shape}")
        buffer = buffer.astype(x.dtype)
        if cu_seqlens is None:
            taps, new_buffer = _dense_taps(x, buffer, self.kernel_size)
        else:
            taps, new_buffer = _packed_taps(x[0], buffer, cu_seqlens, self.kernel_size)
            taps = [tap[None] for tap in taps]
        kernel = self.kernel[...].astype(self.dtype)[::-1]  # [W, C], lag l ↦ w[W−1−l]
        return jax.nn.silu(depthwise(taps, kernel).astype(self.dtype)), new_buffer

    def empty_buffer(self, rows: int, dtype=jnp.float32) -> Float[Array, "R W_minus_1 C"]:
        """Zeros `[rows, W − 1, C]`: the buffer of sequences with no tokens yet."""
        return jnp.zeros((rows, self.kernel_size - 1, self.channels), dtype)


def depthwise(taps: list[Array], kernel: Float[Array, "W C"]) -> Float[Array, "... C"]:
    """Σ_l taps[l] ⊙ kernel[l] in float32 or wider (taps[l] `[..., C]`: the inputs at lag l).

    An unrolled sum of W products, which XLA fuses into one elementwise pass; an `einsum`
    over the lag axis becomes C tiny batched matmuls on CPU (10× slower at [8, 512, 1792]).
    """
    dtype = jnp.promote_types(jnp.result_type(taps[0], kernel), jnp.float32)
    return sum(tap.astype(dtype) * kernel[lag].astype(dtype) for lag, tap in enumerate(taps))


def _dense_taps(x: Float[Array, "B T C"], buffer: Float[Array, "B P C"], width: int):
    """Lagged copies (W arrays `[B, T, C]`, lag l at index l) and the last W − 1 inputs per row."""
    T = x.shape[1]
    window = jnp.concatenate([buffer, x], axis=1)  # [B, W − 1 + T, C]
    taps = [window[:, width - 1 - lag : width - 1 - lag + T] for lag in range(width)]
    return taps, window[:, window.shape[1] - (width - 1) :]


def _packed_taps(x: Float[Array, "N C"], buffer: Float[Array, "S P C"], cu_seqlens: Int[Array, " S_plus_1"],
                 width: int):
    """Lagged copies (W arrays `[N, C]`) that never cross a sequence start, and the new buffers."""
    N = x.shape[0]
    seq = segments(cu_seqlens, N).seq_id  # [N]
    tokens = jnp.arange(N)
    position = tokens - cu_seqlens[seq]  # [N] offset inside the sequence
    taps = []
    for lag in range(width):
        inside = lag <= position
        from_x = x[jnp.clip(tokens - lag, 0, N - 1)]
        from_buffer = buffer[seq, jnp.clip(width - 1 - lag + position, 0, width - 2)]
        taps.append(jnp.where(inside[:, None], from_x, from_buffer))
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # [S]
    offsets = lengths[:, None] - (width - 1) + jnp.arange(width - 1)  # [S, W − 1] offsets in each sequence
    from_x = x[jnp.clip(cu_seqlens[:-1, None] + offsets, 0, N - 1)]
    rows = jnp.arange(buffer.shape[0])[:, None]
    from_buffer = buffer[rows, jnp.clip(width - 1 + offsets, 0, width - 2)]
    new_buffer = jnp.where((offsets >= 0)[..., None], from_x, from_buffer)
    return taps, new_buffer
