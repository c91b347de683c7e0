"""Multi-head latent attention (MLA; DeepSeek-V2) as `transformers` computes it for Kimi Linear
(`KimiLinearAttention`, no rotary) and Ling (`BailingHybridAttention`, interleaved rotary and a
per-head output gate). A shared part: the family modules build it from their configs.

| symbol | meaning                                                              |
|--------|----------------------------------------------------------------------|
| B, T   | batch rows, tokens per row (packed: one row of N tokens)             |
| D      | `hidden_size`                                                        |
| H      | attention heads `num_attention_heads`                                |
| n, r   | `qk_nope_head_dim`, `qk_rope_head_dim`; a query/key head has n + r channels |
| dv     | `v_head_dim`                                                         |
| C, Cq  | `kv_lora_rank`, `q_lora_rank` (None: one query projection)           |
| L      | cache capacity (tokens per row)                                      |
| N(x)   | RMS norm `x / rms(x) ⊙ w`, ε = 1e-6 (`transformers` leaves it at its default) |

    q            = x W_q                         or  N(x W_qa (+b)) W_qb        [B, T, H, n + r]
    [c | k_r]    = x W_kva (+b);  c = N(c)                                      [B, T, C], [B, T, r]
    q_r, k_r     = rope(q_r, p), rope(k_r, p)    (Ling: interleaved pairs; Kimi: none, NoPE)
    [k_n | v]_h  = (c W_kvb)_h                                                  [n | dv] per head
    k_h          = [k_n,h | k_r]                 (the rope key shared by every head)
    o            = softmax((n + r)^{−1/2} q kᵀ, causal) v                       [B, T, H, dv]
    y            = (o ⊙ sigmoid(x W_g)) W_o (+b)   (the gate per head: Ling only)

Decoding caches the compressed latent and the (rotated) rope key, `MLACache`: `[R, L, C]` and
`[R, L, r]` per layer instead of full keys and values `2 · [R, L, H, n + r | dv]`. Each call
expands the cache it reads through `W_kvb` (C · H · (n + dv) multiply-adds per cached token),
as `transformers` does; the matrix-absorbed form (q folded into `W_kvb`) is not used. Reads are
`Attention`'s: the buffer in place for dense rows, and for packed rows their own tokens plus
the entries written before the call.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from ...._core.varlen import segments
from ._attention import Attention
from ._mixer import heads, linear
from ._norm import RMSNorm
from ._rotary import apply_rotary, token_positions

LATENT_NORM_EPS = 1e-6
"""ε of `q_a_layernorm` and `kv_a_layernorm`: `transformers` builds them with its RMS norm's default."""
ROTARY = ("none", "interleaved")
"""How the rope channels are rotated: not at all (Kimi Linear's NoPE) or in interleaved pairs (Ling)."""


class MLACache(NamedTuple):
    """The normalised latent `[R, L, C]` and the rotated rope key `[R, L, r]` of every row so far."""

    latent: Float[Array, "R L C"]
    rope_key: Float[Array, "R L r"]


class LatentAttention(Attention):
    """Multi-head latent attention (module docstring), with `transformers`' parameter names:
    `q_proj` (or `q_a_proj`, `q_a_layernorm`, `q_b_proj`), `kv_a_proj_with_mqa`,
    `kv_a_layernorm`, `kv_b_proj`, `o_proj`, and Ling's `g_proj`.

    **Arguments:** `hidden_size`; `num_heads` (H); `q_lora_rank` (Cq or None), `kv_lora_rank`
    (C); `qk_nope_head_dim` (n), `qk_rope_head_dim` (r), `v_head_dim` (dv); `bias` (on
    `q_a_proj`, `kv_a_proj_with_mqa`, `o_proj`, as `attention_bias`); `rotary` (`ROTARY`);
    `rope_theta`; `output_gate` (Ling's `g_proj`); `dtype`, `rngs`.
    """

    def __init__(self, hidden_size: int, *, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, bias: bool = False,
                 rotary: str = "none", rope_theta: float = 10000.0, output_gate: bool = False, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        if rotary not in ROTARY:
            raise ValueError(f"rotary must be one of {ROTARY}, got {rotary!r}")
        if rotary != "none" and qk_rope_head_dim % 2:
            raise ValueError(f"rotary channels must be even, got qk_rope_head_dim={qk_rope_head_dim}")
        H, n, r, dv = num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.num_heads = self.num_kv_heads = H
        self.nope_dim, self.rope_dim, self.value_dim, self.head_dim = n, r, dv, n + r
        self.kv_lora_rank, self.rotary, self.rope_theta = kv_lora_rank, rotary, float(rope_theta)
        self.window_size, self.scale, self.dtype = None, (n + r) ** -0.5, dtype
        project = lambda d_in, d_out, axes, bias=False: linear(d_in, d_out, axes=axes, bias=bias, dtype=dtype,  # noqa
                                                               rngs=rngs)
        if q_lora_rank is None:
            self.q_proj = project(hidden_size, H * (n + r), ("embed", "heads"))
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = project(hidden_size, q_lora_rank, ("embed", None), bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps=LATENT_NORM_EPS, axis=None, dtype=dtype)
            self.q_b_proj = project(q_lora_rank, H * (n + r), (None, "heads"))
        self.kv_a_proj_with_mqa = project(hidden_size, kv_lora_rank + r, ("embed", None), bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=LATENT_NORM_EPS, axis=None, dtype=dtype)
        self.kv_b_proj = project(kv_lora_rank, H * (n + dv), (None, "heads"))
        self.o_proj = project(H * dv, hidden_size, ("heads", "embed"), bias)
        self.g_proj = project(hidden_size, H, ("embed", "heads")) if output_gate else None

    def _mix(self, x3, cache, cu_seqlens, positions, lower_bound):
        B, T, _ = x3.shape
        if positions is None:
            if cache is not None:
                raise ValueError("attention with a cache needs the tokens' positions")
            positions = token_positions(x3, cu_seqlens)
        q = self._queries(x3, positions)
        latent, rope_key = self._latent(x3, positions)
        seq = None if cu_seqlens is None else segments(cu_seqlens, T).seq_id[None]
        if cache is None:
            k, v = self._expand(latent, rope_key)
            o, new_cache = self._attend(q, k, v, positions, positions, seq, seq), None
        else:
            rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T)) if seq is None else seq
            new_cache = MLACache(cache.latent.at[rows, positions].set(latent.astype(cache.latent.dtype), mode="drop"),
                                 cache.rope_key.at[rows, positions].set(rope_key.astype(cache.rope_key.dtype),
                                                                         mode="drop"))
            keys, values = self._expand(*new_cache)
            if seq is None:
                o = self._attend(q, keys, values, positions, jnp.arange(keys.shape[1])[None], None, None)
            else:
                o = self._attend_packed(q, *self._expand(latent, rope_key), keys, values, positions, seq, cu_seqlens)
        return self._output(o.astype(self.dtype), x3), new_cache

    def init_cache(self, rows: int, capacity: int) -> MLACache:
        """Zero buffers for `rows` sequences of up to `capacity` tokens."""
        return MLACache(jnp.zeros((rows, capacity, self.kv_lora_rank), self.dtype),
                        jnp.zeros((rows, capacity, self.rope_dim), self.dtype))

    def _rope(self, x: Float[Array, "B T h r"], positions) -> Float[Array, "B T h r"]:
        """The rope channels rotated (`ROTARY`); interleaved pairs `(x₀, x₁), (x₂, x₃), …` are the
        GPT-NeoX halves of `[x₀, x₂, … | x₁, x₃, …]`, the layout `transformers`' output has."""
        if self.rotary == "none":
            return x
        halves = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return apply_rotary(halves, positions, self.rope_theta)

    def _queries(self, x: Float[Array, "B T D"], positions) -> Float[Array, "B T H n_plus_r"]:
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = heads(q, self.head_dim)
        return jnp.concatenate([q[..., : self.nope_dim], self._rope(q[..., self.nope_dim:], positions)], axis=-1)

    def _latent(self, x: Float[Array, "B T D"], positions) -> tuple[Float[Array, "B T C"], Float[Array, "B T r"]]:
        """The normalised latent and the rotated rope key of each token (what the cache holds)."""
        latent, rope_key = jnp.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank], axis=-1)
        return self.kv_a_layernorm(latent), self._rope(rope_key[..., None, :], positions)[..., 0, :]

    def _expand(self, latent: Float[Array, "B S C"], rope_key: Float[Array, "B S r"]):
        """Keys `[B, S, H, n + r]` and values `[B, S, H, dv]` from the latent and the rope key."""
        k_nope, v = jnp.split(heads(self.kv_b_proj(latent.astype(self.dtype)), self.nope_dim + self.value_dim),
                              [self.nope_dim], axis=-1)
        shared = jnp.broadcast_to(rope_key[..., None, :].astype(k_nope.dtype), (*k_nope.shape[:-1], self.rope_dim))
        return jnp.concatenate([k_nope, shared], axis=-1), v

    def _output(self, o: Float[Array, "B T H dv"], x: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
        if self.g_proj is not None:
            o = o * jax.nn.sigmoid(self.g_proj(x).astype(jnp.float32)).astype(o.dtype)[..., None]
        return self.o_proj(o.reshape(*o.shape[:2], -1))
