"""fla's `MultiScaleRetention` layer (RetNet, Sun et al. 2023).

| symbol | meaning                                      |
|--------|----------------------------------------------|
| h      | query head, 0 … H − 1                        |
| p      | a token's position inside its sequence       |

On top of the `QKVMixer` frame: rotary embedding of q and k (all K dims, base 10 000,
positions restart at each packed sequence and continue through the cache), then a fixed
decay per head:

    γ_h = 1 − 2^(−5−h),    h_t = γ_h h_{t−1} + rope(k_t) v_tᵀ,    o_t = K^{−1/2} rope(q_t)ᵀ h_t

fla's RetNet *model* never passes `use_short_conv` to this layer (the layer option exists).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ..._mixers import retention_log_decays
from ..layers._qkv import QKVMixer
from ..layers._rotary import apply_rotary, token_positions


class MultiScaleRetention(QKVMixer):
    """fla's RetNet layer: `QKVMixer` options with rotary q/k and fixed per-head decays.

    **Arguments:** those of `QKVMixer`; fla's defaults `expand_k=1.0`, `expand_v=2.0`,
    `num_heads=8`. K (= hidden·expand_k / H) must be even and at most 256.
    """

    def __init__(self, hidden_size: int, *, expand_k: float = 1.0, expand_v: float = 2.0, num_heads: int = 8,
                 dtype=jnp.float32, rngs: nnx.Rngs, **options):
        super().__init__(hidden_size, expand_k=expand_k, expand_v=expand_v, num_heads=num_heads, dtype=dtype,
                         rngs=rngs, **options)
        if self.head_k_dim > 256 or self.head_k_dim % 2:
            raise ValueError(f"RetNet's key head dim must be even and at most 256, got {self.head_k_dim}")

    def _mix(self, x, cache, cu_seqlens, positions, lower_bound):
        q, k, v, buffers = self._project(x, cache, cu_seqlens)
        if positions is None:
            if cache is not None:
                raise ValueError("MultiScaleRetention with a cache needs the tokens' positions (rotary embedding)")
            positions = token_positions(x, cu_seqlens)
        q, k = apply_rotary(q, positions), apply_rotary(k, positions)
        o, state = self._recur(q, k, v, g_gamma=retention_log_decays(self.num_heads),
                               state=None if cache is None else cache.state, cu_seqlens=cu_seqlens)
        new_cache = None if cache is None else cache._replace(state=state, conv=buffers)
        return self._output(o, x), new_cache
