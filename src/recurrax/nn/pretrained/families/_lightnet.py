"""fla's `LightNetAttention` layer (LightNet, Qin et al. 2024): keys normalised by a running
log-sum-exp, whose increments are the decays.

| symbol | meaning                                                           |
|--------|-------------------------------------------------------------------|
| H, K   | heads and key head dim (`expand_ratio`); V = D / H                |
| u_t    | key logits `x W_k` per head and channel (float32)                 |
| z_t    | log normaliser: log Σ_{s≤t} exp(u_s), carried in the cache          |

    q   = silu(x W_q)                                   (short convs without activation, optional)
    z_t = logaddexp(z_{t−1}, u_t),   z_{−1} = −∞ (or the cache)
    k_t = exp(u_t − z_t),            g_t = z_{t−1} − z_t   (0 while z_{t−1} = −∞)
    h_t = diag(exp(g_t)) h_{t−1} + k_t v_tᵀ,   o_t = K^{−1/2} q_tᵀ h_t
    y   = (RMSNorm_D(o) ⊙ swish(x W_g1 W_g2)) W_o        one gated norm over all heads

so h_t = Σ_s softmax-over-the-prefix(u)_s v_s: a running softmax of the keys. fla applies the
gated norm through `rms_norm_swish_gate_linear` without its eps, so ε is 1e-6 whatever
`norm_eps` says (accepted and ignored, as in fla). fla's `g_proj` is
`Sequential(Linear(D, r), Linear(r, D))`, both without bias.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ...._core.varlen import segments
from ..layers._mixer import heads, linear
from ..layers._norm import RMSNorm
from ..layers._projected import ProjectedMixer


class LightNetAttention(ProjectedMixer):
    """fla's LightNet layer.

    **Arguments:** fla's names: `hidden_size`, `num_heads`, `expand_ratio` (one of the two
    suffices; with both, both are used), `use_short_conv`, `conv_size`, `conv_bias`,
    `gate_low_rank_dim` (128), `elementwise_affine`, `norm_eps`; `dtype`, `rngs`.
    """

    normalizer_fill = -jnp.inf

    def __init__(self, hidden_size: int, *, num_heads: int | None = None, expand_ratio: int | None = 128,
                 use_short_conv: bool = False, conv_size: int = 4, conv_bias: bool = False,
                 gate_low_rank_dim: int = 128, elementwise_affine: bool = True, norm_eps: float = 1e-5,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        if expand_ratio is None and num_heads is not None:
            expand_ratio = hidden_size // num_heads
        elif expand_ratio is not None and num_heads is None:
            num_heads = hidden_size // expand_ratio
        elif expand_ratio is None:
            raise ValueError("LightNet needs one of expand_ratio or num_heads")
        self._make_projections(("q", "k", "v"), hidden_size, num_heads, expand_ratio, use_short_conv=use_short_conv,
                               conv_size=conv_size, conv_bias=conv_bias, dtype=dtype, rngs=rngs)
        low_rank = linear(hidden_size, gate_low_rank_dim, axes=("embed", None), dtype=dtype, rngs=rngs)
        up = linear(gate_low_rank_dim, hidden_size, axes=(None, "heads"), dtype=dtype, rngs=rngs)
        self.g_proj = nnx.Sequential(low_rank, up)
        self.g_norm = RMSNorm(hidden_size, eps=1e-6, elementwise_affine=elementwise_affine, axis="heads",
                              dtype=dtype)
        self.o_proj = linear(hidden_size, hidden_size, axes=("heads", "embed"), dtype=dtype, rngs=rngs)

    def _mix(self, x, cache, cu_seqlens, positions, lower_bound):
        projected, buffers = self._projected(x, cache, cu_seqlens)
        q = heads(jax.nn.silu(projected["q"]), self.head_k_dim)
        logits = heads(projected["k"].astype(jnp.float32), self.head_k_dim)  # [B, T, H, K]
        v = heads(projected["v"], self.head_v_dim)
        z0 = None if cache is None else cache.normalizer
        k, g, z_last = softmax_keys(logits, z0, cu_seqlens)
        o, new_cache = self._recur_cached(q, k.astype(q.dtype), v, g, cache, buffers, cu_seqlens, normalizer=z_last)
        o = o.reshape(*o.shape[:-2], -1).astype(self.dtype)
        return self.o_proj(self.g_norm(o, self.g_proj(x), "swish")), new_cache


def softmax_keys(u, z0, cu_seqlens):
    """Keys `exp(u_t − z_t)`, decays `z_{t−1} − z_t` and each row's last `z` (see the module docstring).

    `u` is `[B, T, H, K]` float32 (packed: B = 1); `z0` `[R, H, K]` or `None` (−∞).
    """
    B, T = u.shape[:2]
    if cu_seqlens is None:
        rows, starts = B, jnp.zeros((B, T), bool).at[:, 0].set(True)
        seq = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    else:
        rows = cu_seqlens.shape[0] - 1
        seq_id = segments(cu_seqlens, T).seq_id  # [N]
        starts = (jnp.arange(T) == cu_seqlens[seq_id])[None]
        seq = seq_id[None]
    z0 = jnp.full((rows, *u.shape[2:]), -jnp.inf, u.dtype) if z0 is None else z0
    inside = segment_logcumsumexp(u, starts)  # [B, T, H, K], restarting at each sequence start
    z = jnp.logaddexp(inside, z0[seq])
    previous = jnp.where(starts[..., None, None], z0[seq], jnp.roll(z, 1, axis=1))
    g = jnp.where(jnp.isneginf(previous), 0.0, previous - z)
    k = jnp.exp(u - z)
    if cu_seqlens is None:
        last = z[:, -1] if T else z0
    else:
        ends = jnp.clip(cu_seqlens[1:] - 1, 0, max(T - 1, 0))
        last = jnp.where((cu_seqlens[1:] > cu_seqlens[:-1])[:, None, None], z[0, ends], z0)
    return k, g, last


def segment_logcumsumexp(u, starts):
    """log Σ exp(u) over each segment's prefix along axis 1; a segment begins where `starts`."""

    def combine(left, right):
        left_start, left_value = left
        right_start, right_value = right
        value = jnp.where(right_start[..., None, None], right_value, jnp.logaddexp(left_value, right_value))
        return left_start | right_start, value

    return jax.lax.associative_scan(combine, (starts, u), axis=1)[1]
