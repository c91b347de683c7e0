"""Fixed per-head log decays (`g_gamma`) of published models, from their definitions.

| helper                     | model                         | `g_gamma[h]` (h = 0 … H−1, layer l of L)           |
|----------------------------|-------------------------------|-----------------------------------------------------|
| `retention_g_gamma`        | RetNet                        | `log(1 − 2^(−5−h))`                                 |
| `lightning_g_gamma`, `"ejkernel"` | Lightning Attention as ejKernel's `lightning_attn` defines it | `−(8 / H) · (1 − l / L) · h` |
| `lightning_g_gamma`, `"alibi"`    | Lightning Attention as MiniMax-01 / TransNormerLLM define it | `−s_h · (1 − l / (L − 1) + 1e-5)`, `s_h` the ALiBi slopes |

Sources: RetNet (Sun et al., 2023, "Retentive Network", §2.2: γ = 1 − 2^(−5−arange(H)));
ejKernel (`ejkernel/kernels/_*/lightning_attn`: `g_gamma = −(8 / num_heads · (1 − layer_idx /
num_layers)) · arange(num_heads)`, so head 0 does not decay); MiniMax-01 (MiniMax, 2025) and
TransNormerLLM (Qin et al., 2023): ALiBi slopes (Press et al., 2022) scaled by the layer's
remaining depth `1 − l / (L − 1)`, plus 1e-5 so the last layer still decays.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jaxtyping import Array, Float

LIGHTNING_FORMS = ("ejkernel", "alibi")


def retention_g_gamma(num_heads: int) -> Float[Array, " H"]:
    """RetNet's per-head log decays `log(1 − 2^(−5−h))`."""
    return jnp.log1p(-(2.0 ** (-5.0 - jnp.arange(num_heads, dtype=jnp.float32))))


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi's head slopes: a geometric sequence from 2^(−8/n) for the nearest power of two n
    below `num_heads`, completed by every other slope of the sequence for 2n."""
    power = 2 ** math.floor(math.log2(num_heads))
    geometric = lambda n: [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]  # noqa: E731
    return geometric(power) + geometric(2 * power)[0::2][: num_heads - power]


def lightning_g_gamma(num_heads: int, layer_idx: int, num_layers: int, form: str = "ejkernel") -> Float[Array, " H"]:
    """The `g_gamma` of Lightning Attention layer `layer_idx` (from 0) of `num_layers`.

    **Arguments:**
    - `num_heads`: H; `layer_idx`: l, in [0, L); `num_layers`: L.
    - `form`: `"ejkernel"`, `−(8 / H) · (1 − l / L) · h` (ejKernel's `lightning_attn`), or
      `"alibi"`, `−s_h · (1 − l / (L − 1) + 1e-5)` with ALiBi slopes s_h (MiniMax-01); see the
      module docstring for the sources.
    """
    if form not in LIGHTNING_FORMS:
        raise ValueError(f"form must be one of {LIGHTNING_FORMS}, got {form!r}")
    if not 0 <= layer_idx < num_layers:
        raise ValueError(f"layer_idx must be in [0, num_layers={num_layers}), got {layer_idx}")
    if form == "ejkernel":
        return -(8.0 / num_heads) * (1.0 - layer_idx / num_layers) * jnp.arange(num_heads, dtype=jnp.float32)
    depth = 1.0 - layer_idx / (num_layers - 1) if num_layers > 1 else 1.0
    return -jnp.asarray(alibi_slopes(num_heads), jnp.float32) * (depth + 1e-5)
