"""Short causal depthwise convolutions over time, with a decode buffer, packed sequences and the
token axis split over a device mesh: `recurrax.nn.ShortConvolution` and fla's `CausalConv1d`.

| symbol | meaning                                                     |
|--------|-------------------------------------------------------------|
| B, T   | batch rows, tokens per row (packed: B = 1, T = N)           |
| C      | channels                                                    |
| W      | kernel size (taps); the buffer keeps W − 1 tokens           |
| R      | buffer rows: B, or S packed sequences                       |
| P, L   | sequence shards (mesh axis of `length`), tokens per shard   |

    y_t = act(Σ_{l=0}^{W−1} w[W−1−l] ⊙ x_{t−l} (+ b))      act: SiLU (ShortConvolution), SiLU or none (CausalConv1d)

where `x_{t−l}` before the start of a sequence comes from its buffer (the sequence's last
W − 1 inputs so far, zeros for a fresh one). The new buffer holds the last W − 1 inputs of
each sequence, so convolving a sequence in pieces equals convolving it whole.

On a mesh whose rules map `length` to an axis of P > 1 devices (`recurrax.nn.use_mesh`),
each device convolves its L ≥ W − 1 tokens after the previous shard's last W − 1 inputs,
received in one neighbour exchange (`ppermute`, shard p → p + 1); shard 0 reads the buffer.
Packed sequences that cross a shard boundary read those inputs only where they belong to
the same sequence. The new buffer is assembled with one `psum` over the sequence axis.

Both layers store `kernel [W, C]` (fla's depthwise `Conv1d` weight `[C, 1, W]` is
`kernel[j] = weight[:, 0, j]`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as Spec
from jaxtyping import Array, Float, Int

from .._core.mesh import shard_map_unchecked
from ..kernels._driver import sum_to_vary_like, vary_over, varying_axes
from ._sharding import mesh_axis, param

Taps = Float[Array, "W B T C"]
Buffer = Float[Array, "R W_minus_1 C"]


class _Convolution(nnx.Module):
    """What both convolutions share: the kernel `[W, C]`, the buffer, the lagged inputs."""

    def _make_kernel(self, channels: int, kernel_size: int, dtype, axis: str, rngs: nnx.Rngs, name: str):
        if kernel_size < 2:
            raise ValueError(f"{name} must be at least 2, got {kernel_size}")
        bound = kernel_size**-0.5
        self.kernel = param(jax.random.uniform(rngs.params(), (kernel_size, channels), dtype, -bound, bound),
                            "conv", axis)
        self.channels, self.kernel_size = channels, kernel_size

    def __call__(
        self,
        x: Float[Array, "B T C"],
        buffer: Buffer | None = None,
        cu_seqlens: Int[Array, " S_plus_1"] | None = None,
    ) -> tuple[Float[Array, "B T C"], Buffer]:
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
        y, new_buffer = causal_conv(x, buffer.astype(x.dtype), cu_seqlens, self._kernel_by_lag())
        return self._finish(y, x), new_buffer

    def _kernel_by_lag(self) -> Float[Array, "W C"]:
        """The kernel with lag l at index l (`kernel[W − 1 − l]`)."""
        return self.kernel[...][::-1]

    def _finish(self, y: Float[Array, "B T C"], x: Float[Array, "B T C"]) -> Float[Array, "B T C"]:
        """The layer's output from the convolution `y` (float32 or wider)."""
        raise NotImplementedError

    def empty_buffer(self, rows: int, dtype=jnp.float32) -> Buffer:
        """Zeros `[rows, W − 1, C]`: the buffer of sequences with no tokens yet."""
        return jnp.zeros((rows, self.kernel_size - 1, self.channels), dtype)


class ShortConvolution(_Convolution):
    """Causal depthwise convolution of `kernel_size` taps followed by SiLU.

    **Arguments:**
    - `channels`: C; `kernel_size`: W ≥ 2.
    - `dtype`, `param_dtype`: computation and parameter dtypes; `rngs`: initialisation.
    """

    def __init__(self, channels: int, kernel_size: int, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self._make_kernel(channels, kernel_size, param_dtype, "inner", rngs, "kernel_size")
        self.dtype = dtype

    def _kernel_by_lag(self) -> Float[Array, "W C"]:
        return self.kernel[...].astype(self.dtype)[::-1]

    def _finish(self, y: Float[Array, "B T C"], x: Float[Array, "B T C"]) -> Float[Array, "B T C"]:
        return jax.nn.silu(y.astype(self.dtype))


class CausalConv1d(_Convolution):
    """fla's `ShortConvolution`: causal depthwise convolution of `kernel_size` taps, optional
    bias, optional SiLU; computes in float32 and returns the input's dtype.

    **Arguments:**
    - `channels`: C; `kernel_size`: W ≥ 2; `bias`: learn a bias `[C]`.
    - `activation`: `"silu"`/`"swish"` or `None`.
    - `axis`: the channels' logical axis name (`recurrax.nn`'s sharding table); the taps are `conv`.
    - `dtype`: parameter and computation dtype; `rngs`: initialisation.
    """

    def __init__(self, channels: int, kernel_size: int, *, bias: bool = False, activation: str | None = "silu",
                 axis: str = "inner", dtype=jnp.float32, rngs: nnx.Rngs):
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"activation must be 'silu', 'swish' or None, got {activation!r}")
        self._make_kernel(channels, kernel_size, dtype, axis, rngs, "conv_size")
        self.bias = param(jnp.zeros((channels,), dtype), axis) if bias else None
        self.activation = activation

    def _finish(self, y: Float[Array, "B T C"], x: Float[Array, "B T C"]) -> Float[Array, "B T C"]:
        if self.bias is not None:
            y = y + self.bias[...].astype(y.dtype)  # float32, or float64 in a float64 model
        if self.activation is not None:
            y = jax.nn.silu(y)
        return y.astype(x.dtype)


def depthwise(taps: Taps | list, kernel: Float[Array, "W C"]) -> Float[Array, "... C"]:
    """Σ_l taps[l] ⊙ kernel[l] in float32 or wider (taps[l] `[..., C]`: the inputs at lag l).

    An unrolled sum of W products, which XLA fuses into one elementwise pass; an `einsum`
    over the lag axis becomes C tiny batched matmuls on CPU (10× slower at [8, 512, 1792]).
    """
    taps = list(taps)  # `[W, …]` stacked, or W arrays (`_lags`)
    dtype = _accumulator(*taps, kernel)
    return sum(tap.astype(dtype) * kernel[lag].astype(dtype) for lag, tap in enumerate(taps))


def causal_conv(x: Float[Array, "B T C"], buffer: Buffer, cu_seqlens: Int[Array, " S_plus_1"] | None,
                kernel: Float[Array, "W C"]) -> tuple[Float[Array, "B T C"], Buffer]:
    """`Σ_l kernel[l] ⊙ x_{t−l}` (lag l at index l; float32 or wider), the lags never crossing
    a sequence start, and the new buffer; split over the mesh axis of `length` when there is
    one (module docstring)."""
    width, T = kernel.shape[0], x.shape[1]
    sequence = mesh_axis("length", T)
    if sequence is not None and T // jax.sharding.get_abstract_mesh().shape[sequence] >= width - 1:
        return _split_conv(x, buffer, cu_seqlens, kernel, sequence)
    if cu_seqlens is None:
        return _dense_conv(x, buffer, kernel)
    previous = jnp.zeros((width - 1, x.shape[-1]), x.dtype)
    y = depthwise(_packed_taps(x[0], buffer, cu_seqlens, width, previous, 0), kernel)[None]
    return y, _finish_buffer(_packed_buffer(x[0], cu_seqlens, width, 0), buffer, cu_seqlens, width)


def _dense_conv(x: Float[Array, "B T C"], previous: Float[Array, "B W_minus_1 C"], kernel: Float[Array, "W C"]):
    """`causal_conv` of rows `x` after `previous` (the W − 1 inputs before them), and their
    last W − 1 inputs."""
    window = jnp.concatenate([previous, x], axis=1)  # [B, W − 1 + T, C]
    return window_depthwise(window, kernel), window[:, x.shape[1]:]


@jax.custom_vjp
def window_depthwise(window: Float[Array, "B T_plus_W_minus_1 C"], kernel: Float[Array, "W C"]) -> Float[Array, "B T C"]:
    """`y_t = Σ_l kernel[l] ⊙ window[t + W − 1 − l]` (float32 or wider): the convolution of
    the last T rows of `window`, each after the W − 1 rows before it.

    Its VJP saves `window` (T + W − 1 rows), not the W lagged copies `[W, B, T, C]` that
    autodiff of `depthwise` keeps (W× the input: for W = 4 the largest buffer of a Mamba-2
    training step at 128k tokens, benchmarks/results/long_context.md):

        k̄[l] = Σ_{b,t} window[t + W − 1 − l] ⊙ ȳ_t
        w̄[s] = Σ_l kernel[l] ⊙ ȳ_{s − (W − 1 − l)}      (terms outside t = 0 … T − 1 absent)
    """
    return depthwise(_lags(window, kernel.shape[0]), kernel)


def _accumulator(*arrays):
    """The sums' dtype: float32, or the inputs' if wider."""
    return jnp.promote_types(jnp.result_type(*arrays), jnp.float32)


def _lags(window, width: int) -> list:
    """`x_{t − l}` for t = 0 … T − 1, for each lag l < W: rows `W − 1 − l …` (T of them) of `window`."""
    T = window.shape[1] - (width - 1)
    return [jax.lax.slice_in_dim(window, width - 1 - lag, width - 1 - lag + T, axis=1) for lag in range(width)]


def _window_depthwise_forward(window, kernel):
    return depthwise(_lags(window, kernel.shape[0]), kernel), (window, kernel)


def _window_depthwise_backward(residuals, y_bar):
    window, kernel = residuals
    dtype, width = _accumulator(window, kernel), kernel.shape[0]
    y_bar = y_bar.astype(dtype)
    kernel_bar = jnp.stack([jnp.sum(tap.astype(dtype) * y_bar, axis=(0, 1)) for tap in _lags(window, width)])
    window_bar = sum(jnp.pad(y_bar * kernel[lag].astype(dtype), ((0, 0), (width - 1 - lag, lag), (0, 0)))
                     for lag in range(width))
    (window_bar,) = vary_over(varying_axes(window), window_bar.astype(window.dtype))
    return window_bar, sum_to_vary_like(kernel_bar, kernel).astype(kernel.dtype)


window_depthwise.defvjp(_window_depthwise_forward, _window_depthwise_backward)


def _packed_taps(x: Float[Array, "L C"], buffer: Buffer, cu_seqlens: Int[Array, " S_plus_1"], width: int,
                 previous: Float[Array, "W_minus_1 C"], first) -> Float[Array, "W L C"]:
    """Lagged copies `[W, L, C]` of packed tokens `first … first + L − 1` that never cross a
    sequence start; `previous` holds the W − 1 tokens before `first`."""
    L = x.shape[0]
    tokens = first + jnp.arange(L)  # global indices
    seq = jnp.searchsorted(cu_seqlens[1:], tokens, side="right")  # [L]
    position = tokens - cu_seqlens[seq]  # offset inside the sequence
    window = jnp.concatenate([previous, x], axis=0)  # [W − 1 + L, C]
    taps = []
    for lag in range(width):
        from_x = window[width - 1 - lag : width - 1 - lag + L]
        from_buffer = buffer[seq, jnp.clip(width - 1 - lag + position, 0, width - 2)]
        taps.append(jnp.where((lag <= position)[:, None], from_x, from_buffer))
    return jnp.stack(taps)


def _packed_buffer(x: Float[Array, "L C"], cu_seqlens: Int[Array, " S_plus_1"], width: int, first) -> Buffer:
    """Each sequence's last W − 1 inputs that are among the tokens `first … first + L − 1` of
    `x`, zeros for the others (`_finish_buffer` fills those of short sequences)."""
    L = x.shape[0]
    offsets = _last_offsets(cu_seqlens, width)  # [S, W − 1]
    local = cu_seqlens[:-1, None] + offsets - first
    here = (offsets >= 0) & (local >= 0) & (local < L)
    return jnp.where(here[..., None], x[jnp.clip(local, 0, L - 1)], jnp.zeros((), x.dtype))


def _finish_buffer(from_x: Buffer, buffer: Buffer, cu_seqlens: Int[Array, " S_plus_1"], width: int) -> Buffer:
    """The new buffer: the last inputs `from_x`, and the old buffer's where a sequence is short."""
    offsets = _last_offsets(cu_seqlens, width)
    rows = jnp.arange(buffer.shape[0])[:, None]
    from_buffer = buffer[rows, jnp.clip(width - 1 + offsets, 0, width - 2)]
    return jnp.where((offsets >= 0)[..., None], from_x, from_buffer)


def _last_offsets(cu_seqlens: Int[Array, " S_plus_1"], width: int) -> Int[Array, "S W_minus_1"]:
    """Offsets inside each sequence of the W − 1 positions before its end (negative: before its start)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return lengths[:, None] - (width - 1) + jnp.arange(width - 1)


def _split_conv(x: Float[Array, "B T C"], buffer: Buffer, cu_seqlens, kernel: Float[Array, "W C"], sequence: str):
    """`causal_conv` with the token axis split over the mesh axis `sequence` (shard_map); each
    shard convolves its own tokens, so what the backward keeps is its window, not W lagged copies."""
    mesh = jax.sharding.get_abstract_mesh()
    P, width = mesh.shape[sequence], kernel.shape[0]
    packed = cu_seqlens is not None
    batch = None if packed else mesh_axis("batch", x.shape[0])
    batch = None if batch == sequence else batch

    def body(x, buffer, cu_seqlens, kernel):
        index = jax.lax.axis_index(sequence)
        tail = x[:, x.shape[1] - (width - 1):]  # [B, W − 1, C], this shard's last inputs
        received = jax.lax.ppermute(tail, sequence, [(p, p + 1) for p in range(P - 1)])  # zeros on shard 0
        if not packed:
            y, last = _dense_conv(x, jnp.where(index == 0, buffer, received), kernel)
            return y, jax.lax.psum(jnp.where(index == P - 1, last, jnp.zeros_like(last)), sequence)
        first = index * x.shape[1]
        y = depthwise(_packed_taps(x[0], buffer, cu_seqlens, width, received[0], first), kernel)[None]
        from_x = jax.lax.psum(_packed_buffer(x[0], cu_seqlens, width, first), sequence)
        return y, _finish_buffer(from_x, buffer, cu_seqlens, width)

    rows, tokens = Spec(batch, None, None), Spec(batch, sequence, None)
    split = shard_map_unchecked(body, mesh, (tokens, rows, Spec(), Spec()), (tokens, rows))
    return split(x, buffer, jnp.zeros((0,), jnp.int32) if cu_seqlens is None else cu_seqlens, kernel)
