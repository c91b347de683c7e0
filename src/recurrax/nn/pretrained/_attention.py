"""fla's softmax `Attention` layer, used by hybrid configs (`attn: {layers: [...], ...}`).

| symbol | meaning                                                       |
|--------|---------------------------------------------------------------|
| B, T   | batch rows, tokens per row (packed: B = 1, T = N)             |
| H, Hkv | query heads, key/value heads (G = H / Hkv)                    |
| D      | head dim = hidden_size / H                                    |
| L      | cache capacity (tokens per row)                               |
| w      | `window_size` (None: unbounded)                               |

    q, k, v = x W_q (+b), x W_k (+b), x W_v (+b);  q, k = rope(q, p), rope(k, p)
    o_i     = Σ_{j: p_i − w < p_j ≤ p_i, same sequence} softmax_j(D^{−1/2} q_i·k_j) v_j
    y       = o W_o

as flash-attn computes it for fla (causal, `window_size=(w − 1, 0)`). Decoding keeps every
row's keys and values in a fixed buffer `[R, L, Hkv, D]`: new ones are written at their
positions, and a query reads the positions `≤` its own (and inside the window), so stale
entries of a reused row are never read. The capacity L must exceed the last position.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from ...varlen import segments
from ._mixer import heads, linear
from ._rotary import apply_rotary, token_positions


class KVCache(NamedTuple):
    """Keys and values of every row so far, at their positions: two `[R, L, Hkv, D]` buffers."""

    keys: Float[Array, "R L Hkv D"]
    values: Float[Array, "R L Hkv D"]


class Attention(nnx.Module):
    """fla's causal softmax attention with rotary embedding, grouped heads and an optional window.

    **Arguments:** `hidden_size`, `num_heads`, `num_kv_heads`, `qkv_bias`, `window_size`,
    `rope_theta` (fla's names); `dtype`, `rngs`.
    """

    scale: float | None = None  # the score scale; None: D^{−1/2}

    def __init__(self, hidden_size: int, *, num_heads: int, num_kv_heads: int | None = None, qkv_bias: bool = False,
                 window_size: int | None = None, rope_theta: float = 10000.0, dtype=jnp.float32, rngs: nnx.Rngs):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads or hidden_size % num_heads:
            raise ValueError(f"attention needs num_kv_heads | num_heads | hidden_size, got {num_kv_heads}, "
                             f"{num_heads}, {hidden_size}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, hidden_size // num_heads
        self.window_size, self.rope_theta, self.dtype = window_size, float(rope_theta), dtype
        kv_dim = num_kv_heads * self.head_dim
        self.q_proj = linear(hidden_size, hidden_size, bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.k_proj = linear(hidden_size, kv_dim, bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.v_proj = linear(hidden_size, kv_dim, bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.o_proj = linear(hidden_size, hidden_size, dtype=dtype, rngs=rngs)

    def __call__(
        self,
        x: Float[Array, "B T D"] | Float[Array, "N D"],
        cache: KVCache | None = None,
        *,
        cu_seqlens: Int[Array, " S_plus_1"] | None = None,
        positions: Int[Array, "B T"] | None = None,
        lower_bound=None,
    ):
        """Like the recurrent layers: `y = attn(x)` or `y, cache = attn(x, cache, positions=...)`."""
        x3 = x[None] if x.ndim == 2 else x
        B, T, _ = x3.shape
        if positions is None:
            if cache is not None:
                raise ValueError("attention with a cache needs the tokens' positions")
            positions = token_positions(x3, cu_seqlens)
        q, k, v = self._project(x3, positions)
        seq = None if cu_seqlens is None else segments(cu_seqlens, T).seq_id[None]  # [1, N]
        if cache is None:
            o = self._attend(q, k, v, positions, positions, seq, seq)
            new_cache = None
        else:
            rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T)) if seq is None else seq
            keys = cache.keys.at[rows, positions].set(k.astype(cache.keys.dtype), mode="drop")
            values = cache.values.at[rows, positions].set(v.astype(cache.values.dtype), mode="drop")
            new_cache = KVCache(keys, values)
            o = self._attend_cache(q, keys, values, positions, rows)
        y = self.o_proj(o.reshape(B, T, -1).astype(self.dtype))
        y = y[0] if x.ndim == 2 else y
        return y if cache is None else (y, new_cache)

    def _project(self, x, positions):
        """q `[B, T, H, D]`, k and v `[B, T, Hkv, D]`, rotated (a subclass may change this)."""
        q = apply_rotary(heads(self.q_proj(x), self.head_dim), positions, self.rope_theta)
        k = apply_rotary(heads(self.k_proj(x), self.head_dim), positions, self.rope_theta)
        return q, k, heads(self.v_proj(x), self.head_dim)

    def init_cache(self, rows: int, capacity: int) -> KVCache:
        """Zero buffers for `rows` sequences of up to `capacity` tokens."""
        shape = (rows, capacity, self.num_kv_heads, self.head_dim)
        return KVCache(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))

    def _visible(self, query_pos, key_pos):
        """Causal (and windowed) visibility of keys from queries, by position."""
        visible = key_pos <= query_pos
        if self.window_size is not None:
            visible &= key_pos > query_pos - self.window_size
        return visible

    def _attend(self, q, k, v, q_pos, k_pos, q_seq, k_seq):
        """Attention among the tokens of each row: q `[B, T, H, D]`, k/v `[B, S, Hkv, D]`."""
        visible = self._visible(q_pos[:, :, None], k_pos[:, None, :])  # [B, T, S]
        if q_seq is not None:
            visible &= q_seq[:, :, None] == k_seq[:, None, :]
        return self._softmax_attention(q, k, v, visible)

    def _attend_cache(self, q, keys, values, positions, rows):
        """Each query token reads its row's buffer: q `[B, T, H, D]`, buffers `[R, L, Hkv, D]`."""
        B, T = q.shape[:2]
        L = keys.shape[1]
        flat = lambda a: a.reshape(B * T, 1, *a.shape[2:])  # noqa: E731  one token per "row"
        k_rows, v_rows = keys[rows.reshape(-1)], values[rows.reshape(-1)]  # [B·T, L, Hkv, D]
        visible = self._visible(positions.reshape(-1, 1, 1), jnp.arange(L)[None, None, :])  # [B·T, 1, L]
        o = self._softmax_attention(flat(q), k_rows, v_rows, visible)
        return o.reshape(B, T, *o.shape[2:])

    def _softmax_attention(self, q, k, v, visible):
        """`softmax(D^{−1/2} q kᵀ, masked) v` with grouped heads, in float32."""
        B, T, H, D = q.shape
        G = H // self.num_kv_heads
        qg = q.reshape(B, T, self.num_kv_heads, G, D).astype(jnp.float32)
        scale = D**-0.5 if self.scale is None else self.scale
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) * scale
        scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
        weights = jax.nn.softmax(scores, axis=-1)
        o = jnp.einsum("bkgts,bskd->btkgd", weights, v.astype(jnp.float32))
        return o.reshape(B, T, H, D).astype(q.dtype)
