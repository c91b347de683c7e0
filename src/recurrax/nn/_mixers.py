"""Token mixers built on `recurrax.recurrent`: GLA, RetNet, Lightning Attention, linear attention.

| symbol | meaning                                           |
|--------|---------------------------------------------------|
| B, T   | batch rows, tokens per row (packed: B = 1, T = N) |
| D      | model width `d_model`                             |
| H, Hkv | query heads, key/value heads                      |
| K, V   | key/query and value head dimensions               |

Every mixer does the same five things and differs only in two hooks:

    q, k, v = x W_q, x W_k, x W_v                  [B, T, H, K], [B, T, Hkv, K], [B, T, Hkv, V]
    q, k    = φ(q), φ(k)                           hook `_features`
    decays  = ...                                  hook `_decays`: g / g_gamma for `recurrent`
    o       = recurrent(q, k, v, **decays)         [B, T, H, V]
    y       = (RMSNorm_per_head(o) ⊙ gate(x W_g)) W_o

Optionally (`conv_size`), a short causal convolution runs over q, k and v before φ.
The decode cache is a `MixerCache`: the recurrent state `[B, H, K, V]` (float32) and the
convolution's last inputs. `layer(x, cache=cache)` returns `(y, new_cache)`, whatever the
number of tokens in `x`, and the parallel forward equals decoding token by token from
`layer.init_cache(B)`.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from ..decays import alibi_slopes, lightning_g_gamma, retention_g_gamma
from ..recurrence._step import recurrent_step
from .._core.registry import kernel_registry
from ._conv import ShortConvolution
from ._sharding import partitioned, recurrent_on_mesh

default_kernel_init = nnx.initializers.lecun_normal()  # nnx.Linear's default
ones = nnx.initializers.ones_init()

GATES = {
    None: None,
    "swish": jax.nn.swish,
    "sigmoid": jax.nn.sigmoid,
}
FEATURE_MAPS = {
    "identity": lambda x: x,
    "elu_plus_one": lambda x: jax.nn.elu(x) + 1.0,
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}

State = Float[Array, "rows num_heads qk_head_dim v_head_dim"]


class MixerCache(NamedTuple):
    """What a mixer carries from one call to the next while decoding.

    **Arguments:**
    - `state`: the recurrent state `[rows, H, K, V]`, float32 (float64 for float64 models).
    - `conv`: the short convolution's last inputs `[rows, conv_size − 1, C]`, or `None` when
      the mixer has no short convolution.
    """

    state: State
    conv: Float[Array, "rows taps channels"] | None


class CachedMixer(nnx.Module):
    """What every token mixer with a `MixerCache` shares: the call (input and cache checks, packed
    inputs; subclasses implement `_mix` on `[B, T, D]`), an empty cache, and the check of a
    given one, from the cache shapes the mixer declares (`_cache_shapes(rows)`) and the dtype of
    its convolution inputs (`self.dtype`)."""

    def __call__(
        self,
        x: Float[Array, "batch seq_len d_model"] | Float[Array, "total_tokens d_model"],
        cache: MixerCache | None = None,
        *,
        cu_seqlens: Int[Array, " num_seqs_plus_one"] | None = None,
    ) -> Float[Array, "... d_model"] | tuple[Float[Array, "... d_model"], MixerCache]:
        """Mix the tokens of `x`; with `cache`, continue from it and return the new one too.

        **Arguments:**
        - `x`: `[batch, seq_len, d_model]`, or packed `[total_tokens, d_model]` /
          `[1, total_tokens, d_model]` with `cu_seqlens`.
        - `cache`: a `MixerCache` for the tokens before `x` (rows: `batch`, or `num_seqs`
          when packed), e.g. `init_cache(batch)`; `None` for a parallel forward from nothing.
        - `cu_seqlens`: `[num_seqs + 1]` boundaries of packed sequences.

        **Returns:** `y` shaped like `x`, or `(y, new_cache)` when `cache` is given.
        """
        check_width("x", x, self.d_model, cu_seqlens)
        x3 = x[None] if x.ndim == 2 else x
        if cache is not None:
            self._check_cache(cache, x3.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1)
        y, new_cache = self._mix(x3, cache, cu_seqlens)
        y = y[0] if x.ndim == 2 else y
        return y if cache is None else (y, new_cache)

    def _mix(self, x: Float[Array, "B T D"], cache: MixerCache | None, cu_seqlens
             ) -> tuple[Float[Array, "B T D"], MixerCache]:
        """The mixer on `[B, T, D]` inputs (checked): `y` and the new cache (the state and
        convolution buffer after `x`, whether or not `cache` was given)."""
        raise NotImplementedError

    def init_cache(self, batch_size: int, dtype=jnp.float32) -> MixerCache:
        """An empty decode cache for `batch_size` sequences (zero state and convolution buffer).

        **Arguments:**
        - `batch_size`: sequences to decode (or packed sequences `num_seqs`).
        - `dtype`: the state dtype: float32, or float64 for float64 models under x64.
        """
        state_shape, conv_shape = self._cache_shapes(batch_size)
        conv = None if conv_shape is None else jnp.zeros(conv_shape, self.dtype)
        return MixerCache(jnp.zeros(state_shape, dtype), conv)

    def _cache_shapes(self, rows: int) -> MixerCache:
        """The shapes of a cache for `rows` sequences (None for an absent buffer)."""
        raise NotImplementedError

    def _check_cache(self, cache, rows: int) -> None:
        if not isinstance(cache, MixerCache):
            raise TypeError(f"cache must be a MixerCache (see init_cache), got {type(cache).__name__}")
        for field, want in zip(MixerCache._fields, self._cache_shapes(rows)):
            got = getattr(cache, field)
            if (want is None) != (got is None) or (want is not None and tuple(want) != got.shape):
                expected = "None" if want is None else list(want)
                raise ValueError(f"cache.{field} must be {expected} for {rows} rows, got {getattr(got, 'shape', got)}")


class RecurrentMixer(CachedMixer):
    """Projections, grouped heads, the recurrence, per-head RMS norm, output gate and projection.

    Subclasses choose the decays (`_decays`) and the query/key feature map (`_features`).

    **Arguments:**
    - `d_model`: width of the input and output.
    - `num_heads`: query heads H.
    - `num_kv_heads`: key/value heads (grouped heads); must divide `num_heads`. Default H.
    - `qk_head_dim`, `v_head_dim`: head dimensions K and V; default `d_model // num_heads`.
    - `output_gate`: `"swish"`, `"sigmoid"` or `None` (no gate projection).
    - `conv_size`: taps of a short causal convolution (with SiLU) on q, k and v before the
      feature map, or `0` for none (the default).
    - `softmax_scale`: scale of `qᵀh`; default `qk_head_dim ** -0.5`.
    - `dtype`: computation dtype of projections and the recurrence inputs; `param_dtype`: of
      the parameters.
    - `implementation`: the registered implementation of the parallel forward
      (`recurrax.recurrent`'s `implementation`); None for the best one on this backend.
    - `rngs`: `flax.nnx.Rngs` for the initialisation.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        qk_head_dim: int | None = None,
        v_head_dim: int | None = None,
        output_gate: str | None = "swish",
        conv_size: int = 0,
        softmax_scale: float | None = None,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        implementation: str | None = None,
        rngs: nnx.Rngs,
    ):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1:
            raise ValueError(f"num_heads must be a positive int, got {num_heads}")
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_kv_heads must divide num_heads={num_heads}, got {num_kv_heads}")
        if (qk_head_dim is None or v_head_dim is None) and d_model % num_heads:
            raise ValueError(
                f"num_heads must divide d_model={d_model} when qk_head_dim or v_head_dim is not given "
                f"(heads of d_model // num_heads), got num_heads={num_heads}"
            )
        if implementation is not None and implementation not in kernel_registry.names():
            raise ValueError(f"implementation must be one of {kernel_registry.names()} or None, got {implementation!r}")
        self.implementation = implementation
        if output_gate not in GATES:
            raise ValueError(f"output_gate must be one of {list(GATES)}, got {output_gate!r}")
        self.d_model, self.num_heads, self.num_kv_heads = d_model, num_heads, num_kv_heads
        self.qk_head_dim = qk_head_dim or d_model // num_heads
        self.v_head_dim = v_head_dim or d_model // num_heads
        self.output_gate, self.softmax_scale = output_gate, softmax_scale
        self.dtype = dtype
        K, V, H, Hkv = self.qk_head_dim, self.v_head_dim, num_heads, num_kv_heads
        self.qkv_sizes = (H * K, Hkv * K, Hkv * V)
        linear = _linear_factory(dtype, param_dtype, rngs)
        self.qkv_proj = linear(d_model, sum(self.qkv_sizes), ("embed", "inner"))
        self.conv = (
            ShortConvolution(sum(self.qkv_sizes), conv_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            if conv_size else None
        )
        self.g_proj = linear(d_model, H * V, ("embed", "heads")) if output_gate else None
        self.o_proj = linear(H * V, d_model, ("heads", "embed"))
        self.norm = nnx.RMSNorm(V, dtype=dtype, param_dtype=param_dtype, scale_init=partitioned(ones, "head_dim"),
                                rngs=rngs)

    def _mix(self, x: Float[Array, "B T D"], cache: MixerCache | None, cu_seqlens):
        q, k, v, conv = self._project(x, None if cache is None else cache.conv, cu_seqlens)
        o, state = self._recur(q, k, v, self._decays(x), None if cache is None else cache.state, cu_seqlens)
        return self._output(o, x), MixerCache(state, conv)

    def _cache_shapes(self, rows: int) -> MixerCache:
        """The shapes of a cache for `rows` sequences."""
        state = (rows, self.num_heads, self.qk_head_dim, self.v_head_dim)
        conv = None if self.conv is None else (rows, self.conv.kernel_size - 1, self.conv.channels)
        return MixerCache(state, conv)

    def _project(self, x: Float[Array, "B T D"], conv_buffer, cu_seqlens):
        """q [B, T, H, K], k [B, T, Hkv, K], v [B, T, Hkv, V] and the new convolution buffer."""
        B, T, _ = x.shape
        qkv = self.qkv_proj(x)  # [B, T, H·K + Hkv·K + Hkv·V]
        new_buffer = None
        if self.conv is not None:
            qkv, new_buffer = self.conv(qkv, conv_buffer, cu_seqlens)
        q, k, v = jnp.split(qkv, np.cumsum(self.qkv_sizes)[:-1], axis=-1)
        q = self._features(q.reshape(B, T, self.num_heads, -1))
        k = self._features(k.reshape(B, T, self.num_kv_heads, -1))
        v = v.reshape(B, T, self.num_kv_heads, -1)
        return q.astype(self.dtype), k.astype(self.dtype), v.astype(self.dtype), new_buffer

    def _recur(self, q, k, v, decays: dict, state: State | None, cu_seqlens):
        """The recurrence: parallel from nothing, or continuing from `state` (decoding)."""
        scale = self.softmax_scale
        if state is None or cu_seqlens is not None:
            return recurrent_on_mesh(q, k, v, **decays, softmax_scale=scale, initial_state=state,
                                     cu_seqlens=cu_seqlens, implementation=self.implementation)
        return recurrent_step(q, k, v, state, **decays, softmax_scale=scale)

    def _output(self, o: Float[Array, "B T H V"], x: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
        B, T = o.shape[:2]
        o = self.norm(o)
        if self.g_proj is not None:
            o = o * GATES[self.output_gate](self.g_proj(x).reshape(o.shape))
        return self.o_proj(o.reshape(B, T, -1))

    def _features(self, x: Array) -> Array:
        return x

    def _decays(self, x: Float[Array, "B T D"]) -> dict:
        return {}


def check_width(name: str, x, d_model: int, cu_seqlens) -> None:
    """`x` must be [batch, seq_len, d_model], or packed [total_tokens, d_model] with cu_seqlens,
    with at least one token (recurrax's operations take no empty input)."""
    packed = cu_seqlens is not None
    if hasattr(x, "ndim") and x.ndim in ((2, 3) if packed else (3,)) and x.shape[-1] == d_model:
        if 0 in x.shape[:-1]:
            raise ValueError(f"{name} must have at least one batch row and one token (the layers take "
                             f"no empty input), got shape {x.shape}")
        return
    words = f"[batch, seq_len, {d_model}]" + (f" or [total_tokens, {d_model}] (packed)" if packed else "")
    hint = ""
    if not packed and getattr(x, "ndim", None) == 2 and x.shape[-1] == d_model:
        hint = f" (a 2-D [total_tokens, {d_model}] input is packed sequences: pass cu_seqlens)"
    raise ValueError(f"{name} must be {words}, got {getattr(x, 'shape', type(x).__name__)}{hint}")


def full_signature(cls: type) -> type:
    """Show a layer's real signature in `help()` and `inspect.signature`: its own arguments
    followed by those it passes on to its base (instead of `**options`; and instead of the
    `(*args, **kwargs)` that `nnx.Module`'s metaclass shows)."""
    own = inspect.signature(cls.__init__).parameters.values()
    base = inspect.signature(RecurrentMixer.__init__).parameters
    parameters = [p for p in own if p.kind is not p.VAR_KEYWORD]
    names = {p.name for p in parameters}
    parameters += [p for name, p in base.items() if name not in names and p.kind is p.KEYWORD_ONLY]
    rngs = [p for p in parameters if p.name == "rngs"]
    parameters = [p for p in parameters if p.name != "rngs"] + rngs
    cls.__signature__ = inspect.Signature(parameters[1:])  # without self
    base_doc = RecurrentMixer.__doc__.split("**Arguments:**", 1)[1]
    cls.__doc__ = cls.__doc__.rstrip() + "\n\n    Arguments of every `RecurrentMixer`:" + base_doc
    return cls


@full_signature
class GatedLinearAttention(RecurrentMixer):
    """Gated linear attention (GLA): a data-dependent decay per key channel.

    The log decay is `log_sigmoid(x W_down W_up + b) / gate_logit_normalizer`, per head and key
    channel, so decays stay in (0, 1) and close to 1 at initialisation.

    **Arguments:** those of `RecurrentMixer`, plus
    - `gate_low_rank_dim`: rank of the decay projection (default 16).
    - `gate_logit_normalizer`: divides the log-sigmoid (default 16).
    """

    def __init__(self, d_model: int, num_heads: int, *, gate_low_rank_dim: int = 16,
                 gate_logit_normalizer: float = 16.0, rngs: nnx.Rngs, **options):
        super().__init__(d_model, num_heads, rngs=rngs, **options)
        self.gate_logit_normalizer = float(gate_logit_normalizer)
        param_dtype = options.get("param_dtype", jnp.float32)
        self.gk_down = nnx.Linear(d_model, gate_low_rank_dim, use_bias=False, param_dtype=param_dtype,
                                  kernel_init=partitioned(default_kernel_init, "embed", None), rngs=rngs)
        self.gk_up = nnx.Linear(gate_low_rank_dim, num_heads * self.qk_head_dim, param_dtype=param_dtype,
                                kernel_init=partitioned(default_kernel_init, None, "heads"),
                                bias_init=partitioned(nnx.initializers.zeros_init(), "heads"), rngs=rngs)

    def _decays(self, x: Float[Array, "B T D"]) -> dict:
        B, T, _ = x.shape
        logits = self.gk_up(self.gk_down(x.astype(self.gk_down.kernel.dtype)))
        gk = jax.nn.log_sigmoid(logits) / self.gate_logit_normalizer  # [B, T, H * K]
        return {"g": gk.reshape(B, T, self.num_heads, self.qk_head_dim)}


@full_signature
class MultiScaleRetention(RecurrentMixer):
    """Retention (RetNet): a fixed decay per head, `log(1 − 2^(−5−h))` for head h.

    Positions enter only through the decays (no xPos/rotary rotation of q and k).

    **Arguments:** those of `RecurrentMixer`.
    """

    def _decays(self, x: Float[Array, "B T D"]) -> dict:
        return {"g_gamma": retention_log_decays(self.num_heads)}


@full_signature
class LightningAttention(RecurrentMixer):
    """Lightning Attention: fixed per-head decays that depend on depth. q and k go through SiLU.

    The decay form (`recurrax.decays.lightning_g_gamma`): `"alibi"` (MiniMax-01 /
    TransNormerLLM: head h of layer l decays by `exp(−s_h · (1 − l / (L − 1) + 1e-5))`, s_h the
    ALiBi slopes) or `"ejkernel"` (ejKernel's `lightning_attn`: `exp(−(8 / H) · (1 − l / L) · h)`).

    **Arguments:** those of `RecurrentMixer`, plus
    - `layer_idx`: this layer's index l (from 0); `num_layers`: L, the depth of the model.
    - `feature_map`: applied to q and k (default `"silu"`).
    - `decay_form`: `"alibi"` (default) or `"ejkernel"`.
    """

    def __init__(self, d_model: int, num_heads: int, *, layer_idx: int = 0, num_layers: int = 1,
                 feature_map: str = "silu", decay_form: str = "alibi", rngs: nnx.Rngs, **options):
        lightning_g_gamma(num_heads, layer_idx, num_layers, decay_form)  # validates before building
        super().__init__(d_model, num_heads, rngs=rngs, **options)
        self.layer_idx, self.num_layers, self.decay_form = layer_idx, num_layers, decay_form
        self.feature_map = _feature_map_name(feature_map)

    def _features(self, x: Array) -> Array:
        return FEATURE_MAPS[self.feature_map](x)

    def _decays(self, x: Float[Array, "B T D"]) -> dict:
        return {"g_gamma": lightning_g_gamma(self.num_heads, self.layer_idx, self.num_layers, self.decay_form)}


@full_signature
class LinearAttention(RecurrentMixer):
    """Linear attention without decay: `o_t = φ(q_t)ᵀ Σ_{s≤t} φ(k_s) v_sᵀ`, then per-head RMS norm.

    The RMS norm takes the place of the classic `φ(q)ᵀ Σ φ(k)` denominator.

    **Arguments:** those of `RecurrentMixer` (`output_gate` defaults to `None`), plus
    - `feature_map`: `"identity"`, `"elu_plus_one"`, `"relu"` or `"silu"` (default
      `"elu_plus_one"`).
    """

    def __init__(self, d_model: int, num_heads: int, *, feature_map: str = "elu_plus_one",
                 output_gate: str | None = None, rngs: nnx.Rngs, **options):
        super().__init__(d_model, num_heads, output_gate=output_gate, rngs=rngs, **options)
        self.feature_map = _feature_map_name(feature_map)

    def _features(self, x: Array) -> Array:
        return FEATURE_MAPS[self.feature_map](x)


def retention_log_decays(num_heads: int) -> Float[Array, " H"]:
    """RetNet's per-head log decays `log(1 − 2^(−5−h))` (`recurrax.decays.retention_g_gamma`)."""
    return retention_g_gamma(num_heads)


def lightning_log_decays(num_heads: int, layer_idx: int, num_layers: int) -> Float[Array, " H"]:
    """Lightning Attention's ALiBi-slope log decays `−s_h · (1 − l / (L − 1) + 1e-5)`
    (`recurrax.decays.lightning_g_gamma(..., form="alibi")`)."""
    return lightning_g_gamma(num_heads, layer_idx, num_layers, form="alibi")


def _feature_map_name(name: str) -> str:
    if name not in FEATURE_MAPS:
        raise ValueError(f"feature_map must be one of {list(FEATURE_MAPS)}, got {name!r}")
    return name


def _linear_factory(dtype, param_dtype, rngs: nnx.Rngs):
    def linear(d_in: int, d_out: int, axes: tuple[str, str]) -> nnx.Linear:
        return nnx.Linear(d_in, d_out, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                          kernel_init=partitioned(default_kernel_init, *axes), rngs=rngs)

    return linear
