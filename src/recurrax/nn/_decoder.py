"""The decoder every causal language model here is built on (`recurrax.nn.LanguageModel`, and
each family of `recurrax.nn.pretrained.CausalLM`): its blocks, its body and its head.

    h = embed(tokens)                                                  body.embed
    h, caches = block_L(… block_1(h, cache_1) …, cache_L)              body.layers, body.layer_context(h)
    logits = s · head(head_input(h))        head: Eᵀ (tied) or W (lm_head);  s: the logits multiplier
    block:  h + mixer(norm(h)), then h + mlp(norm(h))                  `pre_norm_residual`

The stack runs through `call_blocks` (remat, scan over layers, the residual sharding), the
loss through `chunked_cross_entropy` on the head's input (never the full logits), and the
generation protocol (`prefill`, `decode_step`) is the model's call with a cache. Every model's
cache is a `ModelCache`: one cache per layer and the tokens each row has seen. A model names
its body (`body`: `embedding`, `embed`, `layers`, `layer_context`, `head_input`), its untied
head (`lm_head`, None when tied) and how it makes an empty cache; the rest is here, once.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from .._core.varlen import segments
from ._cross_entropy import DEFAULT_CHUNK_SIZE, chunked_cross_entropy
from ._layer_scan import call_blocks
from ._sharding import RESIDUAL, constrain
from ._tied import tied_logits, untied_logits
from ._tokens import check_token_ids


class ModelCache(NamedTuple):
    """A model's decode cache: one cache per layer and the positions `[R]` (tokens seen per row)."""

    layers: tuple
    positions: Int[Array, " R"]

    @classmethod
    def empty(cls, layers, rows: int) -> ModelCache:
        """`layers` (each layer's empty cache for `rows` sequences) at position 0."""
        return cls(tuple(layers), jnp.zeros((rows,), jnp.int32))


def pre_norm_residual(h, mixer_norm, mixer, mlp_norm, mlp, cache=None, **context):
    """One pre-norm residual block: `h + mixer(mixer_norm(h))`, then `h + mlp(mlp_norm(h))`.

    **Arguments:** the residual stream `h`; the block's four modules; `cache`, the mixer's decode
    cache (None to train); `context`, the mixer's keyword arguments (`cu_seqlens`, …).

    **Returns:** `(h, new_cache)` (`new_cache` None without `cache`).
    """
    mixed = mixer(mixer_norm(h), cache, **context)
    mixed, new_cache = mixed if cache is not None else (mixed, None)
    h = h + mixed
    return h + mlp(mlp_norm(h)), new_cache


class DecoderBody(nnx.Module):
    """The calls a decoder makes on its body (embedding, layers, final norm): `embedding` (the
    `nnx.Embed` named `embedding_name`), `embed`, `layer_context` (none), `head_input` (the
    final norm `norm`) and `init_caches`. A body subclasses it and overrides what differs."""

    embedding_name = "embed_tokens"

    @property
    def embedding(self) -> nnx.Embed:
        return getattr(self, self.embedding_name)

    def embed(self, tokens):
        return self.embedding(tokens)

    def layer_context(self, embedded) -> list[dict]:
        """Per-layer keyword arguments of the blocks (besides those every block gets)."""
        return [{} for _ in self.layers]

    def head_input(self, h):
        return self.norm(h)

    def init_caches(self, rows: int, capacity: int) -> tuple:
        """One empty cache per layer; attention layers hold `capacity` tokens per row."""
        return tuple(layer.init_cache(rows, capacity) for layer in self.layers)


class CausalDecoder(nnx.Module):
    """What a causal language model shares (module docstring). A subclass sets `vocab_size`,
    `remat`, `scan_layers` and `lm_head` (None: the head is the embedding, tied), and provides
    `body`; `logits_multiplier` (default 1) scales the logits, `logits_dtype` (default: the
    head's float32-or-wider accumulation) is the logits' dtype."""

    logits_multiplier = 1.0
    logits_dtype = None

    @property
    def body(self) -> DecoderBody:
        raise NotImplementedError

    def token_losses(
        self,
        tokens: Int[Array, "batch seq_len"] | Int[Array, " total_tokens"],
        targets: Int[Array, "batch seq_len"] | Int[Array, " total_tokens"],
        *,
        where: Bool[Array, "batch seq_len"] | Bool[Array, " total_tokens"] | None = None,
        cu_seqlens: Int[Array, " num_seqs_plus_one"] | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        with_predictions: bool = False,
    ) -> Float[Array, "..."] | tuple[Float[Array, "..."], Int[Array, "..."]]:
        """The cross entropy of each position's logits against `targets`, without the logits:
        `recurrax.nn.chunked_cross_entropy` over the head's input and the head (times the
        logits multiplier).

        **Arguments:**
        - `tokens`, `cu_seqlens`: as for a call without a cache.
        - `targets`: the ids to predict, shaped like `tokens` (outside `[0, vocab_size)`: ignored).
        - `where`: booleans shaped like `tokens`, False to ignore a position.
        - `chunk_size`, `with_predictions`: as for `chunked_cross_entropy`.

        **Returns:** float32 losses shaped like `tokens` (0 where ignored), and with
        `with_predictions` the argmax ids too.
        """
        model = self._computing()
        h, _ = model._decode(tokens, None, cu_seqlens)
        h = model.body.head_input(h)
        h = h[0] if _packed(tokens, cu_seqlens) else h
        if model.lm_head is not None:
            head, tied, dtype = model.lm_head.kernel[...], False, model.lm_head.dtype
        else:
            head, tied, dtype = model.body.embedding.embedding[...], True, model.body.embedding.dtype
        return chunked_cross_entropy(h, head.astype(dtype or head.dtype), targets, where=where, tied=tied,
                                     logits_scale=self.logits_multiplier, chunk_size=chunk_size,
                                     with_predictions=with_predictions)

    def _forward(self, tokens, cache, cu_seqlens, logits_to_keep: int | None = None, kept_tokens=None):
        """The model's call: next-token logits for every token (float32 or wider; packed `[N]`
        tokens: `[N, vocab]`), or with `cache` (a `ModelCache`) `(logits, new_cache)`, its
        positions advanced by the tokens each row saw; `logits_to_keep`: the head on the last
        positions only; `kept_tokens` (packed): on the tokens at these indices only. Past a
        cache's attention capacity (`_capacity`) the logits are NaN."""
        model = self._computing()
        h, layer_caches = model._decode(tokens, cache, cu_seqlens)
        capacity = None if cache is None else self._capacity(cache)
        positions = None if capacity is None else self._positions(h, cache, cu_seqlens)
        if logits_to_keep is not None:
            if cu_seqlens is not None or not 1 <= logits_to_keep <= tokens.shape[1]:
                raise ValueError(f"logits_to_keep must be in [1, seq_len = {tokens.shape[-1]}] and unpacked, got "
                                 f"{logits_to_keep}" + (" with cu_seqlens" if cu_seqlens is not None else ""))
            h = h[:, -logits_to_keep:]
            positions = None if positions is None else positions[:, -logits_to_keep:]
        if kept_tokens is not None:
            h = h[:, kept_tokens]
            positions = None if positions is None else positions[:, kept_tokens]
        logits = constrain(model._head(h), "batch", "length", "vocab")
        if capacity is not None:  # traced positions: the tokens past it get NaN logits
            logits = jnp.where((positions < capacity)[..., None], logits, jnp.nan)
        logits = logits[0] if _packed(tokens, cu_seqlens) else logits
        if cache is None:
            return logits
        seen = tokens.shape[1] if cu_seqlens is None else cu_seqlens[1:] - cu_seqlens[:-1]
        return logits, ModelCache(layer_caches, cache.positions + seen)

    def prefill(self, tokens: Int[Array, " total_tokens"], cu_seqlens: Int[Array, " num_seqs_plus_one"], cache):
        """Continue `num_seqs` packed sequences (empty ones allowed) from the rows of `cache`: the
        next-token logits after each sequence's last token `[num_seqs, vocab]` (an empty
        sequence's row is the token before it's, meaningless) and the new cache, as
        `model(tokens, cache, cu_seqlens=cu_seqlens)` gives them, with the head run on those
        tokens only. Part of `recurrax.generate`'s protocol, with `generation_cache` and
        `decode_step`."""
        return self._forward(tokens, cache, cu_seqlens, kept_tokens=jnp.maximum(cu_seqlens[1:] - 1, 0))

    def decode_step(self, tokens: Int[Array, " batch"], cache):
        """Advance every row of `cache` by its one token: logits `[batch, vocab]` and the new cache."""
        logits, cache = self(tokens[:, None], cache)
        return logits[:, 0], cache

    def _computing(self) -> CausalDecoder:
        """The model to run the forward with (itself; a mixed-precision model: a cast view)."""
        return self

    def _decode(self, tokens, cache, cu_seqlens):
        """The checked `tokens` embedded (packed `[N]`: as one row `[1, N]`) and run through the
        blocks from `cache` (None: from nothing): the last block's output and the new layer
        caches (None without `cache`)."""
        check_tokens(tokens, cu_seqlens)
        check_token_ids(tokens, self.vocab_size)
        h = constrain(self.body.embed(tokens[None] if _packed(tokens, cu_seqlens) else tokens), *RESIDUAL)
        layers, caches = self.body.layers, None if cache is None else self._layer_caches(cache)
        if caches is not None and len(caches) != len(layers):
            raise ValueError(f"cache must hold one cache per layer ({len(layers)}), got {len(caches)}")
        shared = self._block_inputs(tokens, h, cache, cu_seqlens)
        h, new_caches = call_blocks(layers, self.remat, h, caches, self.body.layer_context(h), scan=self.scan_layers,
                                    cu_seqlens=cu_seqlens, **shared)
        return h, None if caches is None else tuple(new_caches)

    @staticmethod
    def _layer_caches(cache: ModelCache) -> tuple:
        """The per-layer caches of `cache` (a `TypeError` for anything but a `ModelCache`)."""
        if not isinstance(cache, ModelCache):
            raise TypeError(f"cache must be a ModelCache (from model.init_cache), got {type(cache).__name__}; "
                            "per-layer caches are ModelCache(layers, positions), positions the tokens each row "
                            "has seen")
        return cache.layers

    def _capacity(self, cache: ModelCache) -> int | None:
        """Positions per row the cache's layers hold (here: None, no limit)."""
        return None

    @staticmethod
    def _positions(h, cache, cu_seqlens) -> Int[Array, "B T"]:
        """Every token's position in its sequence `[B, T]`, counting the cached tokens."""
        B, T = h.shape[:2]
        offsets = jnp.zeros((B if cu_seqlens is None else cu_seqlens.shape[0] - 1,), jnp.int32)
        if cache is not None:
            offsets = cache.positions
        if cu_seqlens is None:
            return offsets[:, None] + jnp.arange(T)[None]
        seq = segments(cu_seqlens, T).seq_id  # [N]
        return (offsets[seq] + jnp.arange(T) - cu_seqlens[seq])[None]

    def _block_inputs(self, tokens, h, cache, cu_seqlens) -> dict:
        """Keyword arguments every block gets besides `cu_seqlens` (here: none)."""
        return {}

    def _head(self, h):
        """Final norm, then the (tied) head: float32-or-wider logits (as `logits_dtype`), times
        the logits multiplier."""
        h = self.body.head_input(h)
        logits = untied_logits(self.lm_head, h) if self.lm_head is not None else tied_logits(self.body.embedding, h)
        logits = logits if self.logits_dtype is None else logits.astype(self.logits_dtype)
        return logits * self.logits_multiplier if self.logits_multiplier != 1.0 else logits


def _packed(tokens, cu_seqlens) -> bool:
    """Whether `tokens` are packed sequences as one `[total_tokens]` row."""
    return cu_seqlens is not None and tokens.ndim == 1


def check_tokens(tokens, cu_seqlens) -> None:
    """`tokens` must be integer ids [batch, seq_len], or packed [total_tokens] with cu_seqlens."""
    shape = getattr(tokens, "shape", None)
    if shape is None or not jnp.issubdtype(tokens.dtype, jnp.integer):
        what = type(tokens).__name__ if shape is None else f"dtype {tokens.dtype}"
        raise TypeError(f"tokens must be an integer array of token ids, got {what}")
    packed = cu_seqlens is not None
    if len(shape) == 2 or (packed and len(shape) == 1):
        if 0 in shape:
            raise ValueError(f"tokens must have at least one batch row and one token (the model takes "
                             f"no empty input), got shape {tuple(shape)}")
        return
    words = "[batch, seq_len]" + (" or packed [total_tokens]" if packed else "")
    hint = " (a 1-D input is packed sequences: pass cu_seqlens)" if len(shape) == 1 else ""
    raise ValueError(f"tokens must be {words} token ids, got shape {tuple(shape)}{hint}")
