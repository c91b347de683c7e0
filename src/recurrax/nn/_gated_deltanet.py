"""Gated DeltaNet (GDN; Yang et al., *Gated Delta Networks*), the token mixer of Qwen3-Next,
Qwen3.5 and OLMo-Hybrid, on `recurrax.delta_rule`.

| symbol | meaning                                                          |
|--------|------------------------------------------------------------------|
| B, T   | batch rows, tokens per row (packed: B = 1, T = N)                |
| D      | model width `d_model`                                            |
| Hk, H  | query/key heads `num_heads`, value heads `num_v_heads` (Hk | H)  |
| K, V   | query/key head dimension `head_dim`, value head dimension `K · expand_v` |
| W      | taps of the short convolutions                                   |

    q = silu(conv_q(x W_q))          [B, T, Hk, K]     (l2-normalised per head inside delta_rule)
    k = silu(conv_k(x W_k))          [B, T, Hk, K]
    v = silu(conv_v(x W_v))          [B, T, H, V]
    β = sigmoid(x W_b)               [B, T, H]         (× 2 with allow_neg_eigval)
    g = −exp(A_log) · softplus(x W_a + dt_bias)        [B, T, H], a log decay ≤ 0
    o, S = delta_rule(q, k, v, β, g, qk_l2norm=True)   value head h reads q/k head h // (H / Hk)
    y = (RMSNorm_per_head(o) ⊙ w ⊙ silu(x W_g)) W_o

The parameter names are fla's (`fla.layers.GatedDeltaNet`): `q_proj`, `k_proj`, `v_proj`,
`a_proj`, `b_proj`, `A_log`, `dt_bias`, `q_conv1d`, `k_conv1d`, `v_conv1d`, `g_proj`,
`o_norm` (its `weight`), `o_proj`; a projection's `kernel` is fla's weight transposed, a
convolution's `kernel [W, C]` is fla's `weight[:, 0, :]` transposed.

The decode cache is a `MixerCache`: the delta-rule state `[B, H, K, V]` and the three
convolutions' last inputs side by side, `[B, W − 1, 2·Hk·K + H·V]` (q, k, v in that order).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from ..delta import IMPLEMENTATIONS, delta_rule_step
from ._conv import CausalConv1d
from ._mixers import CachedMixer, MixerCache, _linear_factory
from ._sharding import delta_rule_on_mesh, param

A_RANGE = (1.0, 16.0)
"""`A = exp(A_log)` is drawn uniformly from this range at initialisation."""
DT_RANGE = (1e-3, 0.1)
"""`softplus(dt_bias)` is drawn log-uniformly from this range at initialisation (floored at 1e-4)."""
DT_FLOOR = 1e-4


class GatedRMSNorm(nnx.Module):
    """RMS norm over the last axis, scaled by `weight` and gated: `x / rms(x) ⊙ w ⊙ silu(gate)`
    (fla's `FusedRMSNormGated`); computes in float32 or wider, returns `x`'s dtype.

    **Arguments:**
    - `size`: the normalised axis; `eps`: added to the mean square.
    - `dtype`: the weight's dtype (initialised to ones).
    """

    def __init__(self, size: int, *, eps: float = 1e-5, dtype=jnp.float32):
        self.eps = check_eps("eps", eps)
        self.weight = param(jnp.ones((size,), dtype), "head_dim")

    def __call__(self, x: Float[Array, "... V"], gate: Float[Array, "... V"] | None = None) -> Float[Array, "... V"]:
        wide = jnp.promote_types(x.dtype, jnp.float32)
        y = x.astype(wide)
        y = y * jax.lax.rsqrt(jnp.mean(jnp.square(y), axis=-1, keepdims=True) + self.eps)
        y = y * self.weight[...].astype(wide)
        if gate is not None:
            y = y * jax.nn.silu(gate.astype(wide))
        return y.astype(x.dtype)


class GatedDeltaNet(CachedMixer):
    """Gated DeltaNet: projections, short convolutions over q/k/v with SiLU, the gated delta
    rule (β = sigmoid, g = −exp(A_log) · softplus(a + dt_bias)), a gated RMS norm per head
    and an output projection (module docstring).

    **Arguments:**
    - `d_model`: width of the input and output.
    - `num_heads`: query/key heads Hk.
    - `num_v_heads`: value heads H, a multiple of `num_heads` (grouped value heads, as in
      Qwen3-Next); default `num_heads`.
    - `head_dim`: query/key head dimension K; default `d_model // num_heads`.
    - `expand_v`: value head dimension as a multiple of K (default 2, fla's); K · expand_v
      must be a whole number.
    - `conv_size`: taps of the short convolutions (default 4), or `0` for none (SiLU only).
    - `conv_bias`: learn a bias in the short convolutions.
    - `use_gate`: gate the normalised output with `silu(x W_g)` (default); without it the
      norm is ungated and there is no `g_proj`.
    - `allow_neg_eigval`: β = 2 · sigmoid (in [0, 2]: transitions with negative eigenvalues).
    - `norm_eps`: ε of the output norm.
    - `dtype`: computation dtype of projections and the delta rule's inputs; `param_dtype`:
      of the parameters.
    - `implementation`: the delta rule's algorithm (`recurrax.delta.IMPLEMENTATIONS`: `"chunk"`
      or `"reference"`), None for the default.
    - `rngs`: `flax.nnx.Rngs` for the initialisation.
    """

    def __init__(self, d_model: int, num_heads: int, *, num_v_heads: int | None = None, head_dim: int | None = None,
                 expand_v: float = 2.0, conv_size: int = 4, conv_bias: bool = False, use_gate: bool = True,
                 allow_neg_eigval: bool = False, norm_eps: float = 1e-5, dtype=jnp.float32, param_dtype=jnp.float32,
                 implementation: str | None = None, rngs: nnx.Rngs):
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        check_eps("norm_eps", norm_eps)
        _check_heads(d_model, num_heads, num_v_heads, head_dim)
        K = head_dim or d_model // num_heads
        if not float(K * expand_v).is_integer() or K * expand_v < 1:
            raise ValueError(f"expand_v must make head_dim * expand_v a positive whole number (the value head "
                             f"dimension), got head_dim={K}, expand_v={expand_v}")
        if conv_size == 1 or conv_size < 0:
            raise ValueError(f"conv_size must be 0 (no short convolution) or at least 2, got {conv_size}")
        if implementation is not None and implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation must be one of {sorted(IMPLEMENTATIONS)} or None, got {implementation!r}")
        V, Hk, H = int(K * expand_v), num_heads, num_v_heads
        self.d_model, self.num_heads, self.num_v_heads, self.head_dim, self.head_v_dim = d_model, Hk, H, K, V
        self.allow_neg_eigval, self.implementation, self.dtype = allow_neg_eigval, implementation, dtype
        self.channels = (Hk * K, Hk * K, H * V)  # q, k, v

        make_linear = _linear_factory(dtype, param_dtype, rngs)
        linear = lambda d_out: make_linear(d_model, d_out, ("embed", "heads"))  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj = linear(Hk * K), linear(Hk * K), linear(H * V)
        self.a_proj, self.b_proj = linear(H), linear(H)
        self.A_log = param(initial_A_log(rngs.params(), H).astype(param_dtype), "heads")
        self.dt_bias = param(initial_dt_bias(rngs.params(), H).astype(param_dtype), "heads")
        conv = lambda channels: CausalConv1d(channels, conv_size, bias=conv_bias, activation="silu",  # noqa: E731
                                             axis="heads", dtype=param_dtype, rngs=rngs)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            (conv(Hk * K), conv(Hk * K), conv(H * V)) if conv_size else (None, None, None)
        )
        self.g_proj = linear(H * V) if use_gate else None
        self.o_norm = GatedRMSNorm(V, eps=norm_eps, dtype=param_dtype)
        self.o_proj = make_linear(H * V, d_model, ("heads", "embed"))

    def _mix(self, x: Float[Array, "B T D"], cache: MixerCache | None, cu_seqlens):
        q, k, v, conv = self._qkv(x, None if cache is None else cache.conv, cu_seqlens)
        beta, g = self._gates(x)
        o, state = self._delta(q, k, v, beta, g, None if cache is None else cache.state, cu_seqlens)
        return self._output(o, x), MixerCache(state, conv)

    def _cache_shapes(self, rows: int) -> MixerCache:
        state = (rows, self.num_v_heads, self.head_dim, self.head_v_dim)
        conv = None if self.q_conv1d is None else (rows, self.q_conv1d.kernel_size - 1, sum(self.channels))
        return MixerCache(state, conv)

    def _qkv(self, x: Float[Array, "B T D"], conv_buffer, cu_seqlens):
        """q, k `[B, T, Hk, K]`, v `[B, T, H, V]` (after convolution and SiLU) and the new buffer."""
        B, T, _ = x.shape
        projected = [proj(x).astype(self.dtype) for proj in (self.q_proj, self.k_proj, self.v_proj)]
        if self.q_conv1d is None:
            q, k, v = (jax.nn.silu(p) for p in projected)
            new_buffer = None
        else:
            convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
            buffers = (None,) * 3 if conv_buffer is None else split_channels(conv_buffer, self.channels)
            (q, bq), (k, bk), (v, bv) = (conv(p, b, cu_seqlens) for conv, p, b in zip(convs, projected, buffers))
            new_buffer = jnp.concatenate([bq, bk, bv], axis=-1)  # [R, W − 1, 2·Hk·K + H·V]
        heads = lambda y, n: y.reshape(B, T, n, -1)  # noqa: E731
        return heads(q, self.num_heads), heads(k, self.num_heads), heads(v, self.num_v_heads), new_buffer

    def _gates(self, x: Float[Array, "B T D"]) -> tuple[Float[Array, "B T H"], Float[Array, "B T H"]]:
        """β (write strength) and g (log decay), in float32 or wider."""
        wide = jnp.promote_types(self.dtype, jnp.float32)
        beta = jax.nn.sigmoid(self.b_proj(x).astype(wide))
        if self.allow_neg_eigval:
            beta = 2 * beta
        A = jnp.exp(self.A_log[...].astype(wide))  # [H]
        g = -A * jax.nn.softplus(self.a_proj(x).astype(wide) + self.dt_bias[...].astype(wide))
        return beta, g

    def _delta(self, q, k, v, beta, g, state, cu_seqlens):
        """The delta rule: parallel (or prefill) with `delta_rule` (`parallel.delta_rule` when the
        mesh rules split the tokens), one token with `delta_rule_step`."""
        if state is None or cu_seqlens is not None or q.shape[1] > 1:
            return delta_rule_on_mesh(q, k, v, beta, g=g, initial_state=state, cu_seqlens=cu_seqlens,
                                      qk_l2norm=True, implementation=self.implementation)
        o, state = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], state, g=g[:, 0], qk_l2norm=True)
        return o[:, None], state

    def _output(self, o: Float[Array, "B T H V"], x: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
        B, T = o.shape[:2]
        gate = None if self.g_proj is None else self.g_proj(x).reshape(o.shape)
        return self.o_proj(self.o_norm(o, gate).reshape(B, T, -1))


def initial_A_log(key, num_heads: int) -> Float[Array, " H"]:
    """`log A` with A uniform in `A_RANGE` (fla's and Qwen3-Next's initialisation, per value head)."""
    return jnp.log(jax.random.uniform(key, (num_heads,), jnp.float32, *A_RANGE))


def initial_dt_bias(key, num_heads: int) -> Float[Array, " H"]:
    """The inverse softplus of a step `dt`, log-uniform in `DT_RANGE` and at least `DT_FLOOR`,
    so `softplus(dt_bias) = dt` at initialisation."""
    low, high = (math.log(bound) for bound in DT_RANGE)
    dt = jnp.maximum(jnp.exp(jax.random.uniform(key, (num_heads,), jnp.float32, low, high)), DT_FLOOR)
    return dt + jnp.log(-jnp.expm1(-dt))  # softplus⁻¹(dt) = log(exp(dt) − 1)


def split_channels(buffer: Float[Array, "R W_minus_1 C"], sizes: tuple[int, ...]) -> list[Array]:
    """The convolution buffer side by side → one buffer per convolution."""
    return jnp.split(buffer, np.cumsum(sizes)[:-1], axis=-1)


def _check_heads(d_model: int, num_heads: int, num_v_heads: int, head_dim: int | None) -> None:
    if num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads}")
    if num_v_heads < 1 or num_v_heads % num_heads:
        raise ValueError(f"num_v_heads must be a multiple of num_heads={num_heads} (grouped value heads), "
                         f"got {num_v_heads}")
    if head_dim is None and d_model % num_heads:
        raise ValueError(f"num_heads must divide d_model={d_model} when head_dim is not given (heads of "
                         f"d_model // num_heads), got num_heads={num_heads}")


def check_eps(name: str, eps) -> float:
    """A norm's ε as a float: a finite number > 0 (≤ 0 or NaN makes the norm of a zero row NaN)."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float, np.floating, np.integer)) or not (
            math.isfinite(eps) and eps > 0):
        raise ValueError(f"{name} must be a finite number > 0 (added to the mean square before its root), "
                         f"got {eps!r}")
    return float(eps)
