"""What fla's recurrent layers share here: the decode cache, the call contract, the recurrence.

| symbol | meaning                                                   |
|--------|-----------------------------------------------------------|
| B, T   | batch rows, tokens per row (packed: B = 1, T = N tokens)  |
| R      | cache rows: B, or S packed sequences                      |
| D      | model width `hidden_size`                                 |
| H, Hkv | query heads, key/value heads                              |
| K, V   | key and value head dimensions                             |

Every layer maps `[B, T, D]` (or packed `[N, D]` with `cu_seqlens`) to the same shape:

    y = layer(x)                                   parallel, from an empty history
    y, cache = layer(x, cache, positions=...)      continue each row (or packed sequence)

and running a sequence whole equals running it in pieces through the cache (token by token
included). `positions` are the tokens' positions in their sequences (needed only by layers
with rotary embeddings); the model computes them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from ....recurrence._step import recurrent_step
from ..._conv import CausalConv1d
from ..._sharding import partitioned, recurrent_on_mesh


class RecurrentCache(NamedTuple):
    """A recurrent layer's decode cache.

    **Arguments:**
    - `state`: the recurrent state `[R, H, K, V]`, float32.
    - `conv`: the short convolutions' last inputs, one `[R, W − 1, C]` per convolution (in the
      order of the layer's `conv_names`), or `None` without short convolutions.
    - `normalizer`: a per-key running quantity `[R, H, K]` (LinearAttention's key sum with
      `norm_feature_map`, LightNet's log normaliser), or `None`.
    """

    state: Float[Array, "R H K V"]
    conv: tuple[Float[Array, "R W_minus_1 C"], ...] | None
    normalizer: Float[Array, "R H K"] | None


class TokenLayer(nnx.Module):
    """The call every converted layer shares (recurrent or softmax attention): input checks,
    packed inputs, and `_mix` on `[B, T, D]`, which subclasses implement."""

    def __call__(
        self,
        x: Float[Array, "B T D"] | Float[Array, "N D"],
        cache=None,
        *,
        cu_seqlens: Int[Array, " S_plus_1"] | None = None,
        positions: Int[Array, "B T"] | None = None,
        lower_bound: Float[Array, " D"] | None = None,
    ):
        """Mix the tokens of `x`; with `cache`, continue from it and return `(y, new_cache)`.

        **Arguments:**
        - `x`: `[B, T, D]`, or packed `[N, D]` / `[1, N, D]` with `cu_seqlens`.
        - `cache`: the cache after the previous tokens of each row (sequence), or `None`.
        - `cu_seqlens`: `[S + 1]` boundaries of packed sequences.
        - `positions`: `[B, T]` positions of the tokens in their sequences (rotary layers).
        - `lower_bound`: HGRN2's forget-gate lower bound for this layer (HGRN2 only).
        """
        if x.ndim not in (2, 3) or (x.ndim == 2 and cu_seqlens is None):
            raise ValueError(f"x must be [batch, seq_len, hidden] or packed [total_tokens, hidden] with "
                             f"cu_seqlens, got shape {x.shape}")
        x3 = x[None] if x.ndim == 2 else x
        if cu_seqlens is not None and x3.shape[0] != 1:
            raise ValueError(f"packed input must be [total_tokens, hidden] or [1, total_tokens, hidden], got {x.shape}")
        y, new_cache = self._mix(x3, cache, cu_seqlens, positions, lower_bound)
        y = y[0] if x.ndim == 2 else y
        return y if cache is None else (y, new_cache)

    def _mix(self, x, cache, cu_seqlens, positions, lower_bound):
        """`(y [B, T, D], new_cache)` for the checked `x [B, T, D]` (`new_cache` None without `cache`)."""
        raise NotImplementedError


class FlaMixer(TokenLayer):
    """Base of the converted fla recurrent layers: the call (`TokenLayer`), short convolutions,
    the recurrence.

    Subclasses set `num_heads`, `head_k_dim`, `head_v_dim`, `dtype`, `conv_names` (attribute
    names of their `CausalConv1d`s, possibly empty) and implement `_mix`.
    """

    conv_names: tuple[str, ...] = ()
    normalizer_fill: float | None = None  # initial value of `RecurrentCache.normalizer`, or None

    def init_cache(self, rows: int) -> RecurrentCache:
        """An empty cache for `rows` sequences: zero state, zero convolution inputs."""
        state = jnp.zeros((rows, self.num_heads, self.head_k_dim, self.head_v_dim), jnp.float32)
        conv = tuple(getattr(self, name).empty_buffer(rows, self.dtype) for name in self.conv_names) or None
        normalizer = None
        if self.normalizer_fill is not None:
            normalizer = jnp.full((rows, self.num_heads, self.head_k_dim), self.normalizer_fill, jnp.float32)
        return RecurrentCache(state, conv, normalizer)

    def _convolve(self, inputs: dict[str, Array], cache: RecurrentCache | None, cu_seqlens):
        """Run each named convolution on its input; returns outputs and the new buffers."""
        buffers = [None] * len(self.conv_names) if cache is None or cache.conv is None else list(cache.conv)
        outputs, new_buffers = {}, []
        for name, buffer in zip(self.conv_names, buffers):
            outputs[name], new_buffer = getattr(self, name)(inputs[name], buffer, cu_seqlens)
            new_buffers.append(new_buffer)
        return outputs, tuple(new_buffers) or None

    def _recur(self, q, k, v, *, state, cu_seqlens, scale: float | None = None, **decays):
        """`recurrent` for a parallel pass or a prefill, `recurrent_step` for dense decoding."""
        if state is None or cu_seqlens is not None or q.shape[1] > 1:
            return recurrent_on_mesh(q, k, v, **decays, softmax_scale=scale, initial_state=state,
                                     cu_seqlens=cu_seqlens)
        return recurrent_step(q, k, v, state, **decays, softmax_scale=scale)


def make_conv(channels: int, conv_size: int, conv_bias: bool, activation: str | None, dtype, rngs,
              axis: str = "inner") -> CausalConv1d:
    """One of a layer's short convolutions; `axis` is its channels' logical axis name."""
    return CausalConv1d(channels, conv_size, bias=conv_bias, activation=activation, axis=axis, dtype=dtype,
                        rngs=rngs)


def linear(d_in: int, d_out: int, *, axes: tuple[str | None, str | None], bias: bool = False, dtype,
           rngs: nnx.Rngs) -> nnx.Linear:
    """A projection with fla's layout once transposed: `kernel [d_in, d_out]`, optional bias;
    `axes` are the logical axis names of `d_in` and `d_out` (`recurrax.nn`'s sharding table)."""
    kernel = partitioned(nnx.initializers.normal(0.02), *axes)
    bias_init = partitioned(nnx.initializers.zeros_init(), axes[1])
    return nnx.Linear(d_in, d_out, use_bias=bias, kernel_init=kernel, bias_init=bias_init, dtype=dtype,
                      param_dtype=dtype, rngs=rngs)


def heads(x: Float[Array, "B T HD"], head_dim: int) -> Float[Array, "B T H d"]:
    """Split the last axis into heads of `head_dim`."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // head_dim, head_dim)


def repeat_heads(x: Float[Array, "B T Hkv d"], groups: int) -> Float[Array, "B T H d"]:
    """fla's `repeat(x, '... h d -> ... (h g) d')`: query head h reads kv head h // groups."""
    return x if groups == 1 else jnp.repeat(x, groups, axis=-2)


def run_mixer(layer, x, cache, context):
    """A mixer called with or without its cache: `(y, new_cache)`."""
    if cache is None:
        return layer(x, **context), None
    return layer(x, cache, **context)
