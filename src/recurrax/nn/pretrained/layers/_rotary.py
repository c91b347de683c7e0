"""Rotary position embedding as fla's `RotaryEmbedding` applies it (GPT-NeoX halves, no xPos).

| symbol | meaning                                      |
|--------|----------------------------------------------|
| D      | head dimension (even), rotated in full       |
| p      | a token's position inside its sequence       |
| θ      | `base` (10 000 unless a config says else)    |

    f_i      = θ^(−2i / D),  i = 0 … D/2 − 1
    x = [x₁, x₂] (halves):   rope(x, p) = [x₁ cos(p f) − x₂ sin(p f),  x₂ cos(p f) + x₁ sin(p f)]

Angles are computed in float32 from integer positions, so positions never round.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ...._core.varlen import segments


def token_positions(x: Float[Array, "B T ..."], cu_seqlens: Int[Array, " S_plus_1"] | None) -> Int[Array, "B T"]:
    """Positions of a pass from an empty history: `0 … T−1` per row, restarting at each packed sequence."""
    B, T = x.shape[:2]
    if cu_seqlens is None:
        return jnp.broadcast_to(jnp.arange(T), (B, T))
    seq = segments(cu_seqlens, T).seq_id  # [N]
    return (jnp.arange(T) - cu_seqlens[seq])[None]


def apply_rotary(x: Float[Array, "*tokens heads D"], positions: Int[Array, "*tokens"],
                 base: float = 10000.0) -> Float[Array, "*tokens heads D"]:
    """Rotate every head of `x` by the angle of its token's position."""
    D = x.shape[-1]
    if D % 2:
        raise ValueError(f"rotary embedding needs an even head dimension, got {D}")
    inv_freq = 1.0 / (base ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))  # [D/2]
    angles = positions.astype(jnp.float32)[..., None, None] * inv_freq  # [*tokens, 1, D/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)
