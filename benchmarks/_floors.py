"""This CPU's floors for XLA: float32 matmul throughput at given shapes, streaming-read bandwidth.

| symbol | meaning                                   |
|--------|-------------------------------------------|
| M, K, N| a matmul [M, K] @ [K, N]: 2·M·K·N FLOPs    |

Each figure is the median of `repeats` timed calls after a warm-up (`_timing.timed`). The
bandwidth is a `jnp.sum` over one float32 array of the given size (each byte read once).
`mamba2_130m_torch.py` measures the same for PyTorch.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np

from _timing import timed


def matmul_gflops(shapes: list[tuple[int, int, int]], repeats: int) -> dict[str, float]:
    """GFLOP/s of a jitted float32 `x @ w` for each (M, K, N), keyed 'MxKxN'."""
    rng = np.random.default_rng(0)
    rates = {}
    for M, K, N in shapes:
        x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((K, N)), jnp.float32)
        matmul = jax.jit(jnp.matmul)
        rates[f"{M}x{K}x{N}"] = 2 * M * K * N / statistics.median(timed(lambda: matmul(x, w), repeats)) / 1e9
    return rates


def read_gbps(num_bytes: int, repeats: int) -> float:
    """GB/s of a jitted `jnp.sum` over a float32 array of `num_bytes`."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    return x.nbytes / statistics.median(timed(lambda: total(x), repeats)) / 1e9
