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
entries of a reused row are never read. The capacity L must exceed the last position
(`CausalLM` checks it).

Memory: dense rows read their own buffer in place (scores `[B, H, T, L]`). A packed call
(S sequences in one row of N tokens) attends among its own tokens as the parallel pass does
(scores `[H, N, N]`), and to the entries written before the call one row and one block of
positions at a time (scores `[H, N, 256]`; skipped when every sequence starts empty, as in
a prefill); the parts merge by their log-sum-exp. No token copies its row's buffer.

Sequence parallelism (`length` over P devices, `recurrax.nn.use_mesh`): a parallel pass is
ring attention (`recurrax.nn._ring_attention`): each device keeps its T/P queries, keys and
values and the key/value blocks go round the mesh axis, so attention crosses shard boundaries
and packed sequences alike with O(T/P) memory per device (scores in tiles `[B, 512, H, 512]`).

`HFAttention` is the same layer with `transformers`' options: an explicit head_dim, biases on
all four projections, rotary on the first `rotary_dim` channels (or none), a score scale
(Granite's `attention_multiplier`), a key multiplier (Falcon-H1).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from ...._core.varlen import segments
from ..._ring_attention import ring_attention
from ..._sharding import mesh_axis
from ._mixer import RecurrentCache, TokenLayer, heads, linear
from ._rotary import apply_rotary, token_positions


EARLIER_BLOCK = 256
"""Cache positions a packed call reads at a time from the entries written before it."""


class KVCache(NamedTuple):
    """Keys and values of every row so far, at their positions: two `[R, L, Hkv, D]` buffers."""

    keys: Float[Array, "R L Hkv D"]
    values: Float[Array, "R L Hkv D"]


class LayerCache(NamedTuple):
    """One layer's decode cache: its Mamba layer's and its attention's (`None` where absent)."""

    mamba: RecurrentCache | None
    attention: KVCache | None


class Attention(TokenLayer):
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
        self.q_proj = linear(hidden_size, hidden_size, axes=("embed", "heads"), bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.k_proj = linear(hidden_size, kv_dim, axes=("embed", "kv_heads"), bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.v_proj = linear(hidden_size, kv_dim, axes=("embed", "kv_heads"), bias=qkv_bias, dtype=dtype, rngs=rngs)
        self.o_proj = linear(hidden_size, hidden_size, axes=("heads", "embed"), dtype=dtype, rngs=rngs)

    def _mix(self, x, cache, cu_seqlens, positions, lower_bound):
        return self._attended(x, cache, cu_seqlens, positions, self._project)

    def _attention(self, x, cache, cu_seqlens, positions, project, output=None):
        """The call, with `project(x [B, T, ·], positions)` giving q, k, v and `output(o [B, T, H·D])`
        the layer's output (default `o_proj`; a subclass may pass its own of either)."""
        y, new_cache = self._attended(x[None] if x.ndim == 2 else x, cache, cu_seqlens, positions, project, output)
        y = y[0] if x.ndim == 2 else y
        return y if cache is None else (y, new_cache)

    def _attended(self, x3, cache, cu_seqlens, positions, project, output=None):
        """`_attention` on `x3 [B, T, ·]`: `(y, new_cache)` (None without `cache`)."""
        B, T, _ = x3.shape
        if positions is None:
            if cache is not None:
                raise ValueError("attention with a cache needs the tokens' positions")
            positions = token_positions(x3, cu_seqlens)
        q, k, v = project(x3, positions)
        seq = None if cu_seqlens is None else segments(cu_seqlens, T).seq_id[None]  # [1, N]
        sequence = mesh_axis("length", T) if cache is None else None
        if sequence is not None:  # sequence-parallel: the keys and values go round the ring
            o = ring_attention(q, k, v, positions, seq, sequence=sequence, window=self.window_size, scale=self.scale)
            new_cache = None
        elif cache is None:
            o = self._attend(q, k, v, positions, positions, seq, seq)
            new_cache = None
        else:
            rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T)) if seq is None else seq
            keys = cache.keys.at[rows, positions].set(k.astype(cache.keys.dtype), mode="drop")
            values = cache.values.at[rows, positions].set(v.astype(cache.values.dtype), mode="drop")
            new_cache = KVCache(keys, values)
            if seq is None:
                o = self._attend(q, keys, values, positions, jnp.arange(keys.shape[1])[None], None, None)
            else:
                o = self._attend_packed(q, k, v, keys, values, positions, seq, cu_seqlens)
        return (output or self.o_proj)(o.reshape(B, T, -1).astype(self.dtype)), new_cache

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

    def _attend_packed(self, q, k, v, keys, values, positions, seq, cu_seqlens):
        """Packed tokens `[1, N]` with a cache: their own tokens, then their rows' earlier entries."""
        own = self._partial(q, k, v, self._visible(positions[:, :, None], positions[:, None, :])
                            & (seq[:, :, None] == seq[:, None, :]))
        starts = positions - (jnp.arange(q.shape[1]) - cu_seqlens[seq])  # each sequence's first position
        earlier = jax.lax.cond(jnp.any(starts > 0), self._earlier, self._nothing_earlier,
                               q, keys, values, positions, seq, starts)
        return _finish(*_merge(own, earlier), q.dtype)

    def _earlier(self, q, keys, values, positions, seq, starts):
        """Partial attention of packed tokens to their row's entries before `starts`, one row
        and one block of `EARLIER_BLOCK` positions at a time (scores `[N, H, block]`). A block
        that no token of the call reads (a row not in the call, or positions at or past every
        start of its row's tokens) is skipped: a prefill piece costs what its rows have seen,
        not the cache's capacity times its rows."""
        R, L = keys.shape[:2]
        width = min(L, EARLIER_BLOCK)
        blocks = -(-L // width)

        def step(carry, index):
            row, block = index // blocks, index % blocks
            first = jnp.minimum(block * width, L - width)  # the last block overlaps; its repeats are masked

            def read():
                k, v = (jax.lax.dynamic_slice(a, (row, first, 0, 0), (1, width, *a.shape[2:])) for a in (keys, values))
                key_pos = (first + jnp.arange(width))[None, None, :]
                visible = self._visible(positions[:, :, None], key_pos) & (key_pos < starts[:, :, None])
                visible &= (key_pos >= block * width) & (seq == row)[:, :, None]
                return _merge(carry, self._partial(q, k, v, visible))

            read_by_some = jnp.any((seq == row) & (starts > block * width))
            return jax.lax.cond(read_by_some, read, lambda: carry), None

        return jax.lax.scan(step, self._nothing_earlier(q, keys, values), jnp.arange(R * blocks))[0]

    def _nothing_earlier(self, q, keys, values, *_):
        """No partial attention: zeros of the values' head size (MLA's differs from the keys')."""
        B, T, H, _ = q.shape
        shape = (B, T, self.num_kv_heads, H // self.num_kv_heads)
        nothing = jnp.zeros((*shape, values.shape[-1]), jnp.float32)
        return nothing, jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32)

    def _softmax_attention(self, q, k, v, visible):
        """`softmax(D^{−1/2} q kᵀ, masked) v` with grouped heads, in float32."""
        return _finish(*self._partial(q, k, v, visible), q.dtype)

    def _partial(self, q, k, v, visible):
        """Unnormalised attention `(Σ_j e^{s_j − m} v_j, m, Σ_j e^{s_j − m})`, m the largest
        visible score (−inf where none): q `[B, T, H, D]`, k/v `[B, S, Hkv, D]`, visible `[B, T, S]`."""
        B, T, H, D = q.shape
        G = H // self.num_kv_heads
        qg = q.reshape(B, T, self.num_kv_heads, G, D).astype(jnp.float32)
        scale = D**-0.5 if self.scale is None else self.scale
        scores = jnp.einsum("btkgd,bskd->btkgs", qg, k.astype(jnp.float32)) * scale
        scores = jnp.where(visible[:, :, None, None], scores, -jnp.inf)
        top = jnp.max(scores, axis=-1)
        weights = jnp.exp(scores - jnp.where(jnp.isfinite(top), top, 0.0)[..., None])
        acc = jnp.einsum("btkgs,bskd->btkgd", weights, v.astype(jnp.float32))
        return acc, top, jnp.sum(weights, axis=-1)


def _merge(a, b):
    """Combine two partial attentions over disjoint keys."""
    (acc_a, top_a, sum_a), (acc_b, top_b, sum_b) = a, b
    top = jnp.maximum(top_a, top_b)
    safe = jnp.where(jnp.isfinite(top), top, 0.0)
    wa, wb = jnp.exp(top_a - safe), jnp.exp(top_b - safe)
    return acc_a * wa[..., None] + acc_b * wb[..., None], top, sum_a * wa + sum_b * wb


def _finish(acc, top, total, dtype):
    """`acc / total` as `[B, T, H, D]`."""
    o = acc / total[..., None]
    return o.reshape(*o.shape[:2], -1, o.shape[-1]).astype(dtype)


class HFAttention(Attention):
    """Causal GQA softmax attention as `transformers`' Llama-style layers compute it.

    **Arguments:** `hidden_size`, `num_heads`, `num_kv_heads`, `head_dim`; `bias` (all four
    projections); `rotary_dim` (rotated leading channels of each head, 0 for no positional
    encoding); `rope_theta`; `scale` (default `head_dim^{−1/2}`); `key_multiplier`; `out_size`
    (o_proj's output width, default `hidden_size`); `dtype`, `rngs`.
    """

    def __init__(self, hidden_size: int, *, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool = False,
                 rotary_dim: int = 0, rope_theta: float = 10000.0, scale: float | None = None,
                 key_multiplier: float = 1.0, out_size: int | None = None, dtype=jnp.float32, rngs: nnx.Rngs):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) must divide num_attention_heads ({num_heads})")
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary dims must be even and at most head_dim={head_dim}, got {rotary_dim}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.window_size, self.rope_theta, self.dtype = None, float(rope_theta), dtype
        self.rotary_dim, self.scale, self.key_multiplier = rotary_dim, scale, float(key_multiplier)
        q_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
        self.q_proj = linear(hidden_size, q_dim, axes=("embed", "heads"), bias=bias, dtype=dtype, rngs=rngs)
        self.k_proj = linear(hidden_size, kv_dim, axes=("embed", "kv_heads"), bias=bias, dtype=dtype, rngs=rngs)
        self.v_proj = linear(hidden_size, kv_dim, axes=("embed", "kv_heads"), bias=bias, dtype=dtype, rngs=rngs)
        self.o_proj = linear(q_dim, out_size or hidden_size, axes=("heads", "embed"), bias=bias, dtype=dtype,
                             rngs=rngs)

    def _rotate(self, x, positions):
        if not self.rotary_dim:
            return x
        rotated = apply_rotary(x[..., : self.rotary_dim], positions, self.rope_theta)
        return jnp.concatenate([rotated, x[..., self.rotary_dim:]], axis=-1)

    def _project(self, x, positions):
        return self._split_heads(self.q_proj(x), self.k_proj(x), self.v_proj(x), positions)

    def _split_heads(self, q, k, v, positions):
        """Projected q, k, v as heads, k multiplied, q and k rotated."""
        k = heads(k, self.head_dim)
        if self.key_multiplier != 1.0:
            k = k * self.key_multiplier
        q = self._rotate(heads(q, self.head_dim), positions)
        return q, self._rotate(k, positions), heads(v, self.head_dim)
