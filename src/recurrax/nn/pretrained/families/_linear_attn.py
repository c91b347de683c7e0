"""fla's `LinearAttention` layer (Katharopoulos et al. 2020 and its learnable feature maps).

| symbol | meaning                                                      |
|--------|--------------------------------------------------------------|
| K, K'  | key head dim, and its size after the feature map φ           |
| z_t    | running key sum Σ_{s≤t} φ(k_s)  `[H, K']` (with normalisation) |
| c      | the scale, K'^{−1/2}                                         |

    q, k, v = x W_q, x W_k, x W_v;   q, k = φ_q(q), φ_k(k)          (per head)
    q ← q / (Σq + 1e-4), k ← k / (Σk + 1e-4)                        (norm_q, norm_k)
    o_t = c φ(q_t)ᵀ Σ_{s≤t} φ(k_s) v_sᵀ                              no decay
    o_t ← o_t / (c φ(q_t)·z_t + 1e-10)                              (norm_feature_map)
    y   = RMSNorm_head(o) W_o

Feature maps (fla's names): `identity`, `elu` (elu + 1), `relu`, `elementwise_product`
(`layer1(x) ⊙ layer2(x)`, two biased K×K linears), `hedgehog` (`softmax([2Lx, −2Lx])`,
K' = 2K), `t2r` (`relu(Lx)`, no bias), `dpfp` (parameter-free, ν = 4, K' = 8K). With
`tie_feature_map_qk` one map serves q and k; it lives in `feature_map_q`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ...._core.varlen import segments
from ..layers._mixer import FlaMixer, heads, linear, repeat_heads
from ..layers._norm import RMSNorm
from ..layers._qkv import head_dims

LEARNED_MAPS = ("elementwise_product", "hedgehog", "t2r")
FEATURE_MAPS = ("identity", "elu", "relu", "dpfp", *LEARNED_MAPS)


class FeatureMap(nnx.Module):
    """One of fla's feature maps over a head's last axis (see the module docstring)."""

    def __init__(self, name: str, head_dim: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        if name not in FEATURE_MAPS:
            raise ValueError(f"feature_map must be one of {list(FEATURE_MAPS)}, got {name!r}")
        self.name = name
        if name == "elementwise_product":
            self.layer1 = linear(head_dim, head_dim, axes=(None, None), bias=True, dtype=dtype, rngs=rngs)
            self.layer2 = linear(head_dim, head_dim, axes=(None, None), bias=True, dtype=dtype, rngs=rngs)
        elif name in ("hedgehog", "t2r"):
            self.layer = linear(head_dim, head_dim, axes=(None, None), bias=name == "hedgehog", dtype=dtype, rngs=rngs)
        self.out_dim = {"hedgehog": 2 * head_dim, "dpfp": 8 * head_dim}.get(name, head_dim)

    def __call__(self, x):
        if self.name == "identity":
            return x
        if self.name == "elu":
            return jax.nn.elu(x) + 1.0
        if self.name == "relu":
            return jax.nn.relu(x)
        if self.name == "elementwise_product":
            return self.layer1(x) * self.layer2(x)
        if self.name == "t2r":
            return jax.nn.relu(self.layer(x))
        if self.name == "hedgehog":
            y = 2.0 * self.layer(x)
            return jax.nn.softmax(jnp.concatenate([y, -y], axis=-1).astype(jnp.float32), axis=-1).astype(x.dtype)
        signs = jnp.concatenate([jax.nn.relu(x), jax.nn.relu(-x)], axis=-1)  # dpfp, ν = 4
        rolled = jnp.concatenate([jnp.roll(signs, j, axis=-1) for j in range(1, 5)], axis=-1)
        return jnp.concatenate([signs] * 4, axis=-1) * rolled


class LinearAttention(FlaMixer):
    """fla's linear-attention layer.

    **Arguments:** fla's names: `hidden_size`, `expand_k` (1.0), `expand_v` (1.0),
    `num_heads` (8), `num_kv_heads`, `feature_map` (`"elementwise_product"`),
    `tie_feature_map_qk`, `output_norm` (`"rmsnorm"` or `"identity"`), `norm_q`, `norm_k`,
    `do_feature_map_norm`, `elementwise_affine`, `norm_eps`; `dtype`, `rngs`.
    """

    def __init__(self, hidden_size: int, *, expand_k: float = 1.0, expand_v: float = 1.0, num_heads: int = 8,
                 num_kv_heads: int | None = None, feature_map: str = "elementwise_product",
                 tie_feature_map_qk: bool = False, output_norm: str = "rmsnorm", norm_q: bool = False,
                 norm_k: bool = False, do_feature_map_norm: bool = False, elementwise_affine: bool = True,
                 norm_eps: float = 1e-5, dtype=jnp.float32, rngs: nnx.Rngs):
        (self.num_kv_heads, self.groups, key_dim, value_dim,
         key_head, self.head_v_dim) = head_dims(hidden_size, expand_k, expand_v, num_heads, num_kv_heads)
        if output_norm not in ("rmsnorm", "identity"):
            raise ValueError(f"output_norm must be 'rmsnorm' or 'identity', got {output_norm!r}")
        self.hidden_size, self.num_heads, self.dtype = hidden_size, num_heads, dtype
        self.norm_q, self.norm_k, self.do_feature_map_norm = norm_q, norm_k, do_feature_map_norm
        self.tie_feature_map_qk = tie_feature_map_qk and feature_map in LEARNED_MAPS
        self.feature_map_q = FeatureMap(feature_map, key_head, dtype=dtype, rngs=rngs)
        if not self.tie_feature_map_qk:
            self.feature_map_k = FeatureMap(feature_map, key_head, dtype=dtype, rngs=rngs)
        self.key_head, self.head_k_dim = key_head, self.feature_map_q.out_dim
        self.normalizer_fill = 0.0 if do_feature_map_norm else None
        self.q_proj = linear(hidden_size, key_dim, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        self.k_proj = linear(hidden_size, key_dim // self.groups, axes=("embed", "kv_heads"), dtype=dtype, rngs=rngs)
        self.v_proj = linear(hidden_size, value_dim // self.groups, axes=("embed", "kv_heads"), dtype=dtype, rngs=rngs)
        self.norm = (RMSNorm(self.head_v_dim, eps=norm_eps, elementwise_affine=elementwise_affine,
                             axis="head_dim", dtype=dtype)
                     if output_norm == "rmsnorm" else None)
        self.o_proj = linear(value_dim, hidden_size, axes=("heads", "embed"), dtype=dtype, rngs=rngs)

    def _mix(self, x, cache, cu_seqlens, positions, lower_bound):
        q = heads(self.q_proj(x), self.key_head)
        k = repeat_heads(heads(self.k_proj(x), self.key_head), self.groups)
        v = repeat_heads(heads(self.v_proj(x), self.head_v_dim), self.groups)
        q = self.feature_map_q(q)
        k = (self.feature_map_q if self.tie_feature_map_qk else self.feature_map_k)(k)
        if self.norm_q:
            q = q / (q.sum(-1, keepdims=True) + 1e-4)
        if self.norm_k:
            k = k / (k.sum(-1, keepdims=True) + 1e-4)
        scale = self.head_k_dim**-0.5
        o, state = self._recur(q, k, v, state=None if cache is None else cache.state, cu_seqlens=cu_seqlens,
                               scale=scale)
        z = None
        if self.do_feature_map_norm:
            z0 = None if cache is None else cache.normalizer
            key_sums, z = running_key_sum(k.astype(jnp.float32), z0, cu_seqlens)  # [B, T, H, K']
            denom = scale * jnp.sum(q.astype(jnp.float32) * key_sums, axis=-1, keepdims=True) + 1e-10
            o = (o.astype(jnp.float32) / denom).astype(o.dtype)
        new_cache = None if cache is None else cache._replace(state=state, normalizer=z)
        if self.norm is not None:
            o = self.norm(o.astype(self.dtype))
        return self.o_proj(o.reshape(*o.shape[:-2], -1).astype(self.dtype)), new_cache


def running_key_sum(k, z0, cu_seqlens):
    """`z_t = z0 + Σ_{s≤t} k_s` per row or packed sequence, and each row's last `z` `[R, H, K']`.

    k is `[B, T, H, K']`; `z0` `[R, H, K']` or `None` (zeros).
    """
    B, T = k.shape[:2]
    totals = jnp.cumsum(k, axis=1)
    if cu_seqlens is None:
        z = totals if z0 is None else totals + z0[:, None]
        last = z[:, -1] if T else (jnp.zeros((B, *k.shape[2:]), k.dtype) if z0 is None else z0)
        return z, last
    S = cu_seqlens.shape[0] - 1
    z0 = jnp.zeros((S, *k.shape[2:]), k.dtype) if z0 is None else z0
    seq = segments(cu_seqlens, T).seq_id  # [N]
    before = jnp.concatenate([jnp.zeros_like(totals[0, :1]), totals[0]], axis=0)  # [N + 1, H, K']: sum before index
    z = totals[0] - before[cu_seqlens[seq]] + z0[seq]  # [N, H, K']
    last = before[cu_seqlens[1:]] - before[cu_seqlens[:-1]] + z0  # [S, H, K']
    return z[None], last
