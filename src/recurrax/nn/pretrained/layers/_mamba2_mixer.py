"""The Mamba-2 mixer (state-space duality, SSD) of `transformers`' Mamba2 and its hybrids.

| symbol | meaning                                                        |
|--------|----------------------------------------------------------------|
| B, T   | batch rows, tokens per row (packed: B = 1, T = N)              |
| D      | `hidden_size`                                                  |
| H, P   | SSM heads, head dim; I = H·P the mixer width                   |
| G, N   | `n_groups` (B and C heads), state size                         |
| W      | conv taps                                                      |

    [z | xBC | dt] = (x·m_in) W_in (+b) ⊙ mup                        split [I | I + 2GN | H]
    xBC            = silu(causal_depthwise_conv(xBC) + b)           decode buffer: last W − 1 inputs
    [x | B | C]    = xBC                                            split [I | GN | GN]
    dt             = clamp(softplus(dt + dt_bias), time_step_limit)  [B, T, H]
    A              = −exp(A_log)                                    [H]
    h_t            = exp(dt_t A) h_{t−1} + B_t (dt_t x_t)ᵀ           [H, N, P]; head h reads group h // (H/G)
    y_t            = C_tᵀ h_t + D ⊙ x_t
    out            = GatedRMSNorm_G(y, z) W_out (+b)                 (or y ⊙ silu(z) without the norm)

The recurrence is `recurrax.recurrent` with `g = dt·A` per head, `q = C`, `k = B`,
`v = x·dt` and `softmax_scale = 1`; C and B go in with their G heads, as query and key shared
by groups of H / G heads (never repeated to H). q, k and v go in the convolution's dtype (a
bfloat16 model's recurrence runs on bfloat16 operands, as `transformers`' fused kernels do;
on a TPU float32 operands would take the float32-exact, several-pass product), dt, A, the
state and the D skip in float32. The dt clamp applies in the parallel
pass and in every decode step alike (`transformers`' one-token step skips it). `m_in` and
`mup` are Falcon-H1's `ssm_in_multiplier` and `ssm_multipliers` (1 elsewhere).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from ..._sharding import param
from ._mixer import FlaMixer, heads, linear, make_conv
from ._norm import GroupedGatedRMSNorm


class Mamba2Mixer(FlaMixer):
    """`transformers`' `Mamba2Mixer` (and the Mamba layers of Nemotron-H, Bamba, Granite 4.0-H,
    Falcon-H1), with its parameter names: `in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`,
    `norm`, `out_proj`.

    **Arguments:**
    - `hidden_size`: D; `num_heads`: H; `head_dim`: P; `state_size`: N; `n_groups`: G.
    - `conv_kernel`: W; `use_conv_bias`; `use_bias` (in_proj); `out_bias` (out_proj, default
      `use_bias`).
    - `time_step_limit`: `(low, high)` clamp of dt.
    - `eps`: the gated norm's ε; `gated_norm`: `False` for Falcon-H1's `mamba_rms_norm=False`
      (`y ⊙ silu(z)`); `norm_before_gate`: Falcon-H1's option.
    - `in_multiplier`, `ssm_multipliers`: Falcon-H1's input and `[z, x, B, C, dt]` multipliers.
    - `dtype`, `rngs`.
    """

    conv_names = ("conv1d",)
    checkpoint_params = ("dt_bias", "A_log", "D")

    def __init__(self, hidden_size: int, *, num_heads: int, head_dim: int, state_size: int, n_groups: int = 1,
                 conv_kernel: int = 4, use_conv_bias: bool = True, use_bias: bool = False, out_bias: bool | None = None,
                 time_step_limit=(0.0, math.inf), eps: float = 1e-6, gated_norm: bool = True,
                 norm_before_gate: bool = False, in_multiplier: float = 1.0,
                 ssm_multipliers: tuple[float, ...] | None = None, dtype=jnp.float32, rngs: nnx.Rngs):
        if num_heads % n_groups:
            raise ValueError(f"n_groups ({n_groups}) must divide the number of SSM heads ({num_heads})")
        self.num_heads, self.head_k_dim, self.head_v_dim = num_heads, state_size, head_dim
        self.n_groups, self.dtype = n_groups, dtype
        self.width = num_heads * head_dim
        self.conv_dim = self.width + 2 * n_groups * state_size
        low, high = (float(t) for t in time_step_limit)
        self.time_step_limit = (low, high)
        self.in_multiplier = float(in_multiplier)
        self.ssm_multipliers = None if ssm_multipliers is None else tuple(float(m) for m in ssm_multipliers)
        self.in_proj = linear(hidden_size, self.width + self.conv_dim + num_heads, axes=("embed", "inner"),
                              bias=use_bias, dtype=dtype, rngs=rngs)
        self.conv1d = make_conv(self.conv_dim, conv_kernel, use_conv_bias, "silu", dtype, rngs)
        self.dt_bias = param(jnp.zeros((num_heads,), dtype), "heads")
        self.A_log = param(jnp.log(jnp.arange(1, num_heads + 1, dtype=jnp.float32)).astype(dtype), "heads")
        self.D = param(jnp.ones((num_heads,), dtype), "heads")
        self.norm = GroupedGatedRMSNorm(self.width, groups=n_groups, eps=eps, norm_before_gate=norm_before_gate,
                                        dtype=dtype) if gated_norm else None
        self.out_proj = linear(self.width, hidden_size, axes=("heads", "embed"),
                               bias=use_bias if out_bias is None else out_bias, dtype=dtype, rngs=rngs)

    def _mup_vector(self):
        """Falcon-H1's per-channel multipliers of `[z | x | B | C | dt]`, rebuilt (never saved)."""
        I, GN = self.width, self.conv_dim - self.width
        sizes = (I, I, GN // 2, GN // 2, self.num_heads)
        return jnp.concatenate([jnp.full((n,), m, jnp.float32) for n, m in zip(sizes, self.ssm_multipliers)])

    def _mix(self, x, cache, cu_seqlens, positions, lower_bound):
        if self.in_multiplier != 1.0:
            x = x * self.in_multiplier
        projected = self.in_proj(x)
        if self.ssm_multipliers is not None:
            projected = (projected.astype(jnp.float32) * self._mup_vector()).astype(projected.dtype)
        z, xbc, dt = jnp.split(projected, [self.width, self.width + self.conv_dim], axis=-1)
        convolved, buffers = self._convolve({"conv1d": xbc}, cache, cu_seqlens)
        GN = self.n_groups * self.head_k_dim
        compute = convolved["conv1d"].dtype  # the recurrence's q, k, v: bfloat16 in a bfloat16 model
        xs, b, c = jnp.split(convolved["conv1d"], [self.width, self.width + GN], axis=-1)
        dt = jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        dt = jnp.clip(dt, *self.time_step_limit)  # [B, T, H]
        a = -jnp.exp(self.A_log[...].astype(jnp.float32))
        xs = heads(xs, self.head_v_dim).astype(jnp.float32)  # [B, T, H, P]
        q, k = heads(c, self.head_k_dim), heads(b, self.head_k_dim)  # [B, T, G, N]: shared by H / G heads
        v = (xs * dt[..., None]).astype(compute)
        o, state = self._recur(q, k, v, g=dt * a, state=None if cache is None else cache.state,
                               cu_seqlens=cu_seqlens, scale=1.0)
        y = o.astype(jnp.float32) + self.D[...].astype(jnp.float32)[:, None] * xs
        y = y.reshape(*y.shape[:-2], self.width)
        y = y * jax.nn.silu(z.astype(jnp.float32)) if self.norm is None else _materialised(self.norm(y, z))
        new_cache = None if cache is None else cache._replace(state=state, conv=buffers)
        return self.out_proj(y.astype(self.dtype)), new_cache


def _materialised(y):
    """The gated norm's output `y`, computed before the product that reads it. XLA on CPU
    otherwise fuses the norm (a reduction) into out_proj's matmul, where it is recomputed per
    tile of the output: in XLA's per-op trace the mamba2-130m prefill [8, 512] took 6.76 s
    with the fusion and 6.04 s without (the fused out_proj 1.88 s, alone 1.16 s). The barrier
    changes no value; on GPU and TPU, whose matmuls do not take a reduction as a fused
    operand, it should cost nothing (not measured there)."""
    return jax.lax.optimization_barrier(y)
