"""Kimi Delta Attention (KDA) as `transformers` computes it for Kimi Linear
(`KimiLinearDeltaAttention`) and Ling (`BailingHybridDeltaAttention`): Gated DeltaNet with a
decay per key channel. A shared part: the family modules build it from their configs.

| symbol | meaning                                                              |
|--------|----------------------------------------------------------------------|
| B, T   | batch rows, tokens per row (packed: one row of N tokens)             |
| D      | `hidden_size`                                                        |
| H, K   | heads `linear_num_heads` and their dim `linear_head_dim` (keys and values alike) |
| W      | taps of the short convolution                                        |
| λ      | Ling's `kda_lower_bound` (< 0)                                       |

    [q | k | v] = silu(conv1d([x W_q | x W_k | x W_v]))     one depthwise convolution over 3·H·K channels
    a  = x W_fa W_fb + dt_bias              (Kimi: a rank-K factorisation)   [B, T, H, K]
       = x W_f + dt_bias                    (Ling: `f_proj`)
    gk = −exp(A_log_h) · softplus(a)        (per head h, per key channel)
       = λ · sigmoid(exp(A_log_h) · a)      (Ling's `kda_safe_gate`: bounded in (λ, 0))
    β  = sigmoid(x W_b)                                                      [B, T, H]
    o  = delta_rule(q, k, v, β, gk, qk_l2norm=True)                          [B, T, H, K]
    y  = (o / rms(o) ⊙ w ⊙ sigmoid(z)) W_o,   z = x W_ga W_gb (Kimi) or x W_g (Ling), per head

On `recurrax.nn.GatedDeltaNet`'s delta rule and decode cache (a per-channel gate is passed as
the delta rule's `gk`). The decode cache is a `MixerCache`: the state `[R, H, K, K]` and the
convolution's last `W − 1` inputs `[R, W − 1, 3·H·K]`, as `transformers`' conv state.

Parameter names are `transformers`' model's: `q_proj`, `k_proj`, `v_proj`, `conv1d` (the three
convolutions stacked; checkpoints as published hold `q_conv1d`, `k_conv1d`, `v_conv1d`: the
family modules' `loaded_names`), `forget_gate.{f_a_proj, f_b_proj | f_proj, dt_bias, A_log}`,
`b_proj`, `g_a_proj` + `g_b_proj` or `g_proj`, `o_norm`, `o_proj`. `A_log` keeps its stored
shape (Kimi `[1, 1, H, 1]`, Ling `[H]`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from ..._conv import CausalConv1d
from ..._gated_deltanet import GatedDeltaNet as DeltaNetLayer
from ..._gated_deltanet import initial_A_log, initial_dt_bias
from ..._mixers import MixerCache
from ..._sharding import param
from ._mixer import linear
from ._norm import RMSNorm


class ForgetGate(nnx.Module):
    """The per-channel log decay `gk [B, T, H, K]` (module docstring): `f_a_proj` + `f_b_proj`
    (`low_rank`) or `f_proj`; `dt_bias [H·K]`; `A_log` of shape `a_log_shape` (`[1, 1, H, 1]` or
`[H]`); with
    `lower_bound` Ling's bounded gate `λ · sigmoid(exp(A_log) · a)`, else `−exp(A_log) · softplus(a)`."""

    checkpoint_params = ("dt_bias", "A_log")

    def __init__(self, hidden_size: int, *, num_heads: int, head_dim: int, low_rank: bool,
                 a_log_shape: tuple[int, ...], lower_bound: float | None, dtype=jnp.float32, rngs: nnx.Rngs):
        H, K = num_heads, head_dim
        self.num_heads, self.head_dim, self.lower_bound = H, K, lower_bound
        if low_rank:
            self.f_a_proj = linear(hidden_size, K, axes=("embed", None), dtype=dtype, rngs=rngs)
            self.f_b_proj = linear(K, H * K, axes=(None, "heads"), dtype=dtype, rngs=rngs)
            self.f_proj = None
        else:
            self.f_a_proj = self.f_b_proj = None
            self.f_proj = linear(hidden_size, H * K, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        dt = jnp.tile(initial_dt_bias(rngs.params(), H)[:, None], (1, K)).reshape(-1)
        self.dt_bias = param(dt.astype(dtype), "heads")
        a_log_axes = (None, None, "heads", None) if len(a_log_shape) == 4 else ("heads",)  # Kimi's, Ling's
        self.A_log = param(initial_A_log(rngs.params(), H).reshape(a_log_shape).astype(dtype), *a_log_axes)

    def __call__(self, x: Float[Array, "B T D"]) -> Float[Array, "B T H K"]:
        """The log decay per head and key channel, in float32 or wider."""
        a = self.f_proj(x) if self.f_proj is not None else self.f_b_proj(self.f_a_proj(x))
        wide = jnp.promote_types(a.dtype, jnp.float32)
        a = (a.astype(wide) + self.dt_bias[...].astype(wide)).reshape(*x.shape[:2], self.num_heads, self.head_dim)
        rate = jnp.exp(self.A_log[...].astype(wide).reshape(-1))[:, None]  # [H, 1]
        if self.lower_bound is None:
            return -rate * jax.nn.softplus(a)
        return self.lower_bound * jax.nn.sigmoid(rate * a)


class KimiDeltaAttention(DeltaNetLayer):
    """KDA (module docstring) on `recurrax.nn.GatedDeltaNet`'s delta rule and decode cache.

    **Arguments:** `hidden_size`; `num_heads` (H), `head_dim` (K); `conv_kernel` (W); `eps` (the
    output norm's); `low_rank_gates` (Kimi's `f_a_proj`/`f_b_proj` and `g_a_proj`/`g_b_proj`;
    else Ling's `f_proj` and `g_proj`); `a_log_shape`; `lower_bound` (Ling's bounded gate, or
    None); `dtype`, `rngs`.
    """

    def __init__(self, hidden_size: int, *, num_heads: int, head_dim: int, conv_kernel: int, eps: float,
                 low_rank_gates: bool, a_log_shape: tuple[int, ...], lower_bound: float | None = None,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        H, K = num_heads, head_dim
        self.d_model, self.num_heads, self.num_v_heads, self.head_dim, self.head_v_dim = hidden_size, H, H, K, K
        self.allow_neg_eigval, self.implementation, self.dtype = False, None, dtype
        self.channels = (H * K,) * 3
        project = lambda d_in, d_out, axes: linear(d_in, d_out, axes=axes, dtype=dtype, rngs=rngs)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj = (project(hidden_size, H * K, ("embed", "heads")) for _ in range(3))
        self.conv1d = CausalConv1d(3 * H * K, conv_kernel, activation="silu", axis="heads", dtype=dtype, rngs=rngs)
        self.forget_gate = ForgetGate(hidden_size, num_heads=H, head_dim=K, low_rank=low_rank_gates,
                                      a_log_shape=a_log_shape, lower_bound=lower_bound, dtype=dtype, rngs=rngs)
        self.b_proj = project(hidden_size, H, ("embed", "heads"))
        if low_rank_gates:
            self.g_a_proj, self.g_b_proj, self.g_proj = (project(hidden_size, K, ("embed", None)),
                                                         project(K, H * K, (None, "heads")), None)
        else:
            self.g_a_proj = self.g_b_proj = None
            self.g_proj = project(hidden_size, H * K, ("embed", "heads"))
        self.o_norm = RMSNorm(K, eps=eps, axis="head_dim", dtype=dtype)
        self.o_proj = project(H * K, hidden_size, ("heads", "embed"))

    def _mix(self, x: Float[Array, "B T D"], cache: MixerCache | None, cu_seqlens):
        B, T, _ = x.shape
        mixed = jnp.concatenate([proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj)], axis=-1)
        mixed, conv = self.conv1d(mixed.astype(self.dtype), None if cache is None else cache.conv, cu_seqlens)
        q, k, v = (part.reshape(B, T, self.num_heads, self.head_dim) for part in jnp.split(mixed, 3, axis=-1))
        wide = jnp.promote_types(self.dtype, jnp.float32)
        beta = jax.nn.sigmoid(self.b_proj(x).astype(wide))
        o, state = self._delta(q, k, v, beta, self.forget_gate(x), None if cache is None else cache.state,
                               cu_seqlens)
        gate = self.g_proj(x) if self.g_proj is not None else self.g_b_proj(self.g_a_proj(x))
        y = self.o_proj(self.o_norm(o, gate.reshape(o.shape), gate_fn="sigmoid").reshape(B, T, -1))
        return y, MixerCache(state, conv)

    def _cache_shapes(self, rows: int) -> MixerCache:
        return MixerCache((rows, self.num_heads, self.head_dim, self.head_dim),
                          (rows, self.conv1d.kernel_size - 1, sum(self.channels)))
