"""The frame fla's GLA and RetNet layers share: q/k/v projections, short convolutions, and the
per-head RMS norm with an optional output gate.

| symbol | meaning                                                  |
|--------|----------------------------------------------------------|
| B, T   | batch rows, tokens per row (packed: B = 1, T = N)        |
| D      | `hidden_size`                                            |
| H, Hkv | `num_heads`, `num_kv_heads` (grouped heads: G = H / Hkv) |
| K, V   | head dims: `hidden_size·expand_k / H`, `hidden_size·expand_v / H` |

    q, k, v = conv_q(x W_q), conv_k(x W_k), conv_v(x W_v)     (conv: SiLU, when use_short_conv)
    q, k    = φ(q), φ(k)                                       (feature_map, optional)
    o       = recurrence(q, k, v, decays)                      [B, T, H, V]
    y       = (RMSNorm_head(o) ⊙ gate_fn(x W_g)) W_o           (gate only with use_output_gate)

W_k and W_v have Hkv heads; query head h reads kv head h // G (fla repeats k and v; the
recurrence here reads the grouped heads directly). With a swish gate and `fuse_norm`, fla
calls the norm `g_norm_swish_gate`, otherwise `g_norm`; the attribute names follow, so that
weights convert by name.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from ._mixer import FlaMixer, heads, linear, make_conv
from ._norm import RMSNorm, activation


def head_dims(hidden_size: int, expand_k: float, expand_v: float, num_heads: int, num_kv_heads: int | None):
    """fla's dimension rules: key/value widths, per-group widths and head dims."""
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide num_heads ({num_heads})")
    key_dim, value_dim = round(hidden_size * expand_k), round(hidden_size * expand_v)
    if not (math.isclose(key_dim, hidden_size * expand_k) and math.isclose(value_dim, hidden_size * expand_v)):
        raise ValueError(f"hidden_size * expand_k and hidden_size * expand_v must be integers, got "
                         f"{hidden_size * expand_k} and {hidden_size * expand_v}")
    if key_dim % num_heads or value_dim % num_heads:
        raise ValueError(f"key dim {key_dim} and value dim {value_dim} must be divisible by num_heads={num_heads}")
    groups = num_heads // num_kv_heads
    return num_kv_heads, groups, key_dim, value_dim, key_dim // num_heads, value_dim // num_heads


class QKVMixer(FlaMixer):
    """Projections, short convolutions and gated output of fla's GLA and RetNet layers.

    **Arguments:** fla's names: `hidden_size`, `expand_k`, `expand_v`, `num_heads`,
    `num_kv_heads`, `feature_map` (an activation name or `None`), `use_short_conv`,
    `conv_size`, `conv_bias`, `use_output_gate`, `gate_fn`, `elementwise_affine`, `norm_eps`,
    `fuse_norm`; plus `dtype` (parameters and computation) and `rngs`.
    """

    conv_names = ()

    def __init__(self, hidden_size: int, *, expand_k: float, expand_v: float, num_heads: int,
                 num_kv_heads: int | None = None, feature_map: str | None = None, use_short_conv: bool = False,
                 conv_size: int = 4, conv_bias: bool = False, use_output_gate: bool = True, gate_fn: str = "swish",
                 elementwise_affine: bool = True, norm_eps: float = 1e-5, fuse_norm: bool = True,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        (self.num_kv_heads, self.groups, key_dim, value_dim,
         self.head_k_dim, self.head_v_dim) = head_dims(hidden_size, expand_k, expand_v, num_heads, num_kv_heads)
        self.hidden_size, self.num_heads, self.dtype = hidden_size, num_heads, dtype
        self.feature_map = feature_map
        if feature_map is not None:
            activation(feature_map, "feature_map")
        self.gate_fn = gate_fn
        activation(gate_fn, "gate_fn")
        kv_key, kv_value = key_dim // self.groups, value_dim // self.groups
        self.q_proj = linear(hidden_size, key_dim, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        self.k_proj = linear(hidden_size, kv_key, axes=("embed", "kv_heads"), dtype=dtype, rngs=rngs)
        self.v_proj = linear(hidden_size, kv_value, axes=("embed", "kv_heads"), dtype=dtype, rngs=rngs)
        gate = linear(hidden_size, value_dim, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        self.g_proj = gate if use_output_gate else None
        if use_short_conv:
            self.conv_names = ("q_conv1d", "k_conv1d", "v_conv1d")
            self.q_conv1d = make_conv(key_dim, conv_size, conv_bias, "silu", dtype, rngs, "heads")
            self.k_conv1d = make_conv(kv_key, conv_size, conv_bias, "silu", dtype, rngs, "kv_heads")
            self.v_conv1d = make_conv(kv_value, conv_size, conv_bias, "silu", dtype, rngs, "kv_heads")
        self.o_proj = linear(value_dim, hidden_size, axes=("heads", "embed"), dtype=dtype, rngs=rngs)
        norm = RMSNorm(self.head_v_dim, eps=norm_eps, elementwise_affine=elementwise_affine, axis="head_dim",
                       dtype=dtype)
        if gate_fn == "swish" and fuse_norm and use_output_gate:
            self.g_norm_swish_gate = norm
        else:
            self.g_norm = norm

    def _project(self, x, cache, cu_seqlens):
        """q `[B, T, H, K]`, k `[B, T, Hkv, K]`, v `[B, T, Hkv, V]` (after φ) and the conv buffers."""
        inputs = {"q_conv1d": self.q_proj(x), "k_conv1d": self.k_proj(x), "v_conv1d": self.v_proj(x)}
        outputs, buffers = self._convolve(inputs, cache, cu_seqlens) if self.conv_names else (inputs, None)
        q = heads(outputs["q_conv1d"], self.head_k_dim)
        k = heads(outputs["k_conv1d"], self.head_k_dim)
        v = heads(outputs["v_conv1d"], self.head_v_dim)
        if self.feature_map is not None:
            q, k = (activation(self.feature_map, "feature_map")(t) for t in (q, k))
        return q, k, v, buffers

    def _output(self, o, x):
        """`(RMSNorm_head(o) ⊙ gate) W_o` for `o [B, T, H, V]`."""
        norm = getattr(self, "g_norm_swish_gate", None) or self.g_norm
        gate = None if self.g_proj is None else heads(self.g_proj(x), self.head_v_dim)
        o = norm(o.astype(self.dtype), gate, self.gate_fn)
        return self.o_proj(o.reshape(*o.shape[:-2], -1))
