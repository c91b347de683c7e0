"""fla's `GatedLinearAttention` layer (GLA, Yang et al. 2023).

| symbol | meaning                                            |
|--------|----------------------------------------------------|
| r      | `gate_low_rank_dim`                                |
| n      | `gate_logit_normalizer`                            |

On top of the `QKVMixer` frame, a data-dependent decay per key channel:

    gk = log σ(x W_down W_up + b) / n                 [B, T, Hkv·K] → per kv head, repeated to H
    gk = max(gk, clamp_min)                           (when clamp_min is set)
    h_t = diag(exp(gk_t)) h_{t−1} + k_t v_tᵀ,   o_t = K^{−1/2} q_tᵀ h_t

fla's `gk_proj` is `Sequential(Linear(D, r, bias=False), Linear(r, Hkv·K))`; its two layers are
`gk_proj.layers[0]` and `gk_proj.layers[1]` here (state-dict names `gk_proj.0`, `gk_proj.1`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..layers._mixer import heads, linear, repeat_heads
from ..layers._qkv import QKVMixer


class GatedLinearAttention(QKVMixer):
    """fla's GLA layer: `QKVMixer` options plus the low-rank log-sigmoid key decay.

    **Arguments:** those of `QKVMixer`, plus `gate_logit_normalizer` (default 16),
    `gate_low_rank_dim` (default 16) and `clamp_min` (default `None`). fla's defaults:
    `expand_k=0.5`, `expand_v=1.0`.
    """

    def __init__(self, hidden_size: int, *, expand_k: float = 0.5, expand_v: float = 1.0, num_heads: int = 4,
                 gate_logit_normalizer: float = 16, gate_low_rank_dim: int = 16, clamp_min: float | None = None,
                 dtype=jnp.float32, rngs: nnx.Rngs, **options):
        super().__init__(hidden_size, expand_k=expand_k, expand_v=expand_v, num_heads=num_heads, dtype=dtype,
                         rngs=rngs, **options)
        self.gate_logit_normalizer, self.clamp_min = gate_logit_normalizer, clamp_min
        kv_key = self.num_kv_heads * self.head_k_dim
        low_rank = linear(hidden_size, gate_low_rank_dim, axes=("embed", None), dtype=dtype, rngs=rngs)
        up = linear(gate_low_rank_dim, kv_key, axes=(None, "kv_heads"), bias=True, dtype=dtype, rngs=rngs)
        self.gk_proj = nnx.Sequential(low_rank, up)

    def _mix(self, x, cache, cu_seqlens, positions, lower_bound):
        q, k, v, buffers = self._project(x, cache, cu_seqlens)
        gk = jax.nn.log_sigmoid(self.gk_proj(x).astype(jnp.float32)) / self.gate_logit_normalizer
        if self.clamp_min is not None:
            gk = jnp.maximum(gk, self.clamp_min)
        gk = repeat_heads(heads(gk, self.head_k_dim), self.groups)  # [B, T, H, K]
        o, state = self._recur(q, k, v, g=gk, state=None if cache is None else cache.state, cu_seqlens=cu_seqlens)
        new_cache = None if cache is None else cache._replace(state=state, conv=buffers)
        return self._output(o, x), new_cache
