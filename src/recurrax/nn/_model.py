"""A small causal language model: embedding, pre-norm residual blocks (mixer + MLP), tied head.

    h = E[tokens]
    for each block:  h = h + mixer(RMSNorm(h));  h = h + MLP(RMSNorm(h))
    logits = RMSNorm(h) Eᵀ

Its decode cache is a tuple with one mixer state per block; `model(tokens, cache=cache)`
continues every sequence from its cache and returns `(logits, new_cache)`. It implements
`recurrax.nn.pretrained.generate`'s protocol (`generation_cache`, `prefill`, `decode_step`),
so `generate(model, prompts, max_new_tokens)` continues ragged prompts with it.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from ._cross_entropy import DEFAULT_CHUNK_SIZE, chunked_cross_entropy
from ._gated_deltanet import GatedDeltaNet
from ._mixers import GatedLinearAttention, LightningAttention, LinearAttention, MixerCache, MultiScaleRetention
from ._mixers import default_kernel_init, ones
from ._layer_scan import call_blocks
from ._remat import check_remat
from ._sharding import RESIDUAL, constrain, partitioned
from ._tokens import check_token_ids
from ._tied import tied_logits

MIXERS = {
    "gla": GatedLinearAttention,
    "retnet": MultiScaleRetention,
    "lightning": LightningAttention,
    "linear": LinearAttention,
    "gated_deltanet": GatedDeltaNet,
}
"""Mixer names accepted by `LanguageModel` and `make_mixer`."""
CONFIG_MODEL_TYPE = "recurrax_language_model"
"""The `model_type` of a `LanguageModel`'s config.json (`LanguageModel.config`)."""


def embed_norm(d_model: int, **options) -> nnx.RMSNorm:
    """An RMS norm over the model width (its scale's logical axis is `embed`)."""
    return nnx.RMSNorm(d_model, scale_init=partitioned(ones, "embed"), **options)


def make_mixer(name: str, d_model: int, num_heads: int, *, layer_idx: int, num_layers: int,
               rngs: nnx.Rngs, **options):
    """Build the mixer called `name` (a key of `MIXERS`) for layer `layer_idx` of `num_layers`.

    **Arguments:**
    - `name`: `"gla"`, `"retnet"`, `"lightning"`, `"linear"` or `"gated_deltanet"`.
    - `d_model`, `num_heads`: width and query heads.
    - `layer_idx`, `num_layers`: position in the stack (used by Lightning Attention's decays).
    - `rngs`: initialisation randomness; `options`: the mixer's keyword arguments.
    """
    if name not in MIXERS:
        raise ValueError(f"mixer must be one of {list(MIXERS)}, got {name!r}")
    if name == "lightning":
        options = dict(options, layer_idx=layer_idx, num_layers=num_layers)
    return MIXERS[name](d_model, num_heads, rngs=rngs, **options)


class MLP(nnx.Module):
    """Two-layer GELU feed-forward network `W_2 gelu(x W_1)`.

    **Arguments:**
    - `d_model`: width; `hidden`: inner width.
    - `dtype`, `param_dtype`: computation and parameter dtypes; `rngs`: initialisation.
    """

    def __init__(self, d_model: int, hidden: int, *, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        types = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.up = nnx.Linear(d_model, hidden, kernel_init=partitioned(default_kernel_init, "embed", "mlp"), **types)
        self.down = nnx.Linear(hidden, d_model, kernel_init=partitioned(default_kernel_init, "mlp", "embed"), **types)

    def __call__(self, x: Float[Array, "... d_model"]) -> Float[Array, "... d_model"]:
        return self.down(jax.nn.gelu(self.up(x)))


class Block(nnx.Module):
    """Pre-norm residual block: `x + mixer(norm(x))`, then `x + mlp(norm(x))`.

    **Arguments:**
    - `mixer`: a token mixer from `recurrax.nn`; `d_model`: width; `mlp_hidden`: MLP width.
    - `dtype`, `param_dtype`: computation and parameter dtypes; `rngs`: initialisation.
    """

    def __init__(self, mixer: nnx.Module, d_model: int, mlp_hidden: int, *, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        norm = lambda: embed_norm(d_model, dtype=dtype, param_dtype=param_dtype, rngs=rngs)  # noqa: E731
        self.mixer_norm, self.mixer = norm(), mixer
        self.mlp_norm = norm()
        self.mlp = MLP(d_model, mlp_hidden, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, cache: MixerCache | None = None, *, cu_seqlens=None):
        mixed = self.mixer(self.mixer_norm(x), cache, cu_seqlens=cu_seqlens)
        mixed, new_cache = mixed if cache is not None else (mixed, None)
        x = x + mixed
        x = x + self.mlp(self.mlp_norm(x))
        return x, new_cache


class LanguageModel(nnx.Module):
    """A causal language model over a stack of recurrent-attention blocks, with a decode cache.

    **Arguments:**
    - `vocab_size`: number of token ids.
    - `d_model`: width; `num_layers`: blocks; `num_heads`: query heads per mixer.
    - `mixer`: `"gla"`, `"retnet"`, `"lightning"`, `"linear"` or `"gated_deltanet"`.
    - `mlp_ratio`: MLP width as a multiple of `d_model`.
    - `mixer_options`: extra keyword arguments of the mixer (e.g. `num_kv_heads`, `qk_head_dim`;
      `num_v_heads`, `head_dim`, `expand_v` for `"gated_deltanet"`).
    - `implementation`: the registered implementation every mixer's parallel forward uses
      (None: the best one on this backend; `recurrax.kernel_registry.select` tells which;
      for `"gated_deltanet"` a name of `recurrax.delta.IMPLEMENTATIONS`).
    - `dtype`, `param_dtype`: computation and parameter dtypes.
    - `remat`: what a training step keeps of each block for the backward: None (everything
      autodiff saves), `"block"` (the block's input; the block is recomputed) or `"dots"`
      (its projections' and MLP's matmul outputs); gradients are the same up to rounding.
      A plain attribute, not part of `config`: set `model.remat` to change it.
    - `scan_layers`: run the blocks of a call without a cache under one `jax.lax.scan` (traced
      and compiled once, whatever `num_layers`) where they are identical (all mixers but
      Lightning Attention, whose decays differ per layer); parameters, their names and
      checkpoints are the same either way (`recurrax.nn.call_blocks`). False: one after another.
      A plain attribute, not part of `config`.
    - `rngs`: `flax.nnx.Rngs` for the initialisation.

    `recurrax.nn.pretrained.save_pretrained` writes it (config.json from `config`, the
    parameters by module path) and `from_pretrained` builds it back.
    """

    def __init__(self, vocab_size: int, d_model: int, num_layers: int, num_heads: int, *, mixer: str = "gla",
                 mlp_ratio: int = 4, mixer_options: dict | None = None, implementation: str | None = None,
                 dtype=jnp.float32, param_dtype=jnp.float32, remat: str | None = None, scan_layers: bool = True,
                 rngs: nnx.Rngs):
        self.vocab_size, self.mixer_name, self.remat = vocab_size, mixer, check_remat(remat)
        self.scan_layers = bool(scan_layers)
        self.arguments_json = _arguments_json(vocab_size=vocab_size, d_model=d_model, num_layers=num_layers,
                                              num_heads=num_heads, mixer=mixer, mlp_ratio=mlp_ratio,
                                              mixer_options=mixer_options or {}, implementation=implementation)
        types = dict(dtype=dtype, param_dtype=param_dtype)
        init = partitioned(nnx.initializers.normal(stddev=d_model**-0.5), "vocab", "embed")
        self.embed = nnx.Embed(vocab_size, d_model, embedding_init=init, rngs=rngs, **types)
        blocks = []
        for layer_idx in range(num_layers):
            options = {"implementation": implementation, **(mixer_options or {})}
            mix = make_mixer(mixer, d_model, num_heads, layer_idx=layer_idx, num_layers=num_layers, rngs=rngs,
                             **types, **options)
            blocks.append(Block(mix, d_model, mlp_ratio * d_model, rngs=rngs, **types))
        self.blocks = nnx.List(blocks)
        self.norm = embed_norm(d_model, rngs=rngs, **types)

    @property
    def config(self) -> dict:
        """The constructor's arguments (all but dtypes, `remat`, `scan_layers` and `rngs`) as a config.json dict, with
        `model_type` `"recurrax_language_model"`: what `recurrax.nn.pretrained.save_pretrained`
        writes and `from_pretrained` builds the model back from. A `ValueError` when
        `mixer_options` hold something JSON cannot write."""
        if self.arguments_json is None:
            raise ValueError("this LanguageModel's mixer_options are not JSON-serialisable (only numbers, strings, "
                             "booleans, lists and dicts are), so it has no config.json")
        return {"model_type": CONFIG_MODEL_TYPE, "architectures": ["recurrax.nn.LanguageModel"],
                **json.loads(self.arguments_json)}

    def __call__(
        self,
        tokens: Int[Array, "batch seq_len"] | Int[Array, " total_tokens"],
        cache: tuple[MixerCache, ...] | None = None,
        *,
        cu_seqlens: Int[Array, " num_seqs_plus_one"] | None = None,
    ) -> Float[Array, "... vocab"] | tuple[Float[Array, "... vocab"], tuple[MixerCache, ...]]:
        """Next-token logits for every position; with `cache`, continue from it.

        **Arguments:**
        - `tokens`: `[batch, seq_len]` ids in `[0, vocab_size)` (others are a `ValueError`;
          traced ones are checked inside `recurrax.runtime_checks()`), or packed
          `[total_tokens]` with `cu_seqlens`.
        - `cache`: per-block states after the previous tokens (`init_cache(batch)` for none).
        - `cu_seqlens`: `[num_seqs + 1]` boundaries of packed sequences.

        **Returns:** `logits` `[..., vocab_size]`, float32 (accumulated so for a bfloat16 model;
        float64 for a float64 one), or `(logits, new_cache)` with `cache`.
        """
        h, new_caches = self._head_input(tokens, cache, cu_seqlens)
        logits = constrain(tied_logits(self.embed, h), "batch", "length", "vocab")
        return logits if cache is None else (logits, new_caches)

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
        `recurrax.nn.chunked_cross_entropy` over the final hidden states and the tied head.

        **Arguments:**
        - `tokens`, `cu_seqlens`: as for a call without a cache.
        - `targets`: the ids to predict, shaped like `tokens` (outside `[0, vocab_size)`: ignored).
        - `where`: booleans shaped like `tokens`, False to ignore a position.
        - `chunk_size`, `with_predictions`: as for `chunked_cross_entropy`.

        **Returns:** float32 losses shaped like `tokens` (0 where ignored), and with
        `with_predictions` the argmax ids too.
        """
        h, _ = self._head_input(tokens, None, cu_seqlens)
        table = self.embed.embedding[...]
        return chunked_cross_entropy(h, table.astype(self.embed.dtype or table.dtype), targets, where=where, tied=True,
                                     chunk_size=chunk_size, with_predictions=with_predictions)

    def _head_input(self, tokens, cache, cu_seqlens):
        """The final norm's output `[..., d_model]`, and the new caches (None without `cache`)."""
        _check_tokens(tokens, cu_seqlens)
        check_token_ids(tokens, self.vocab_size)
        x = constrain(self.embed(tokens), *RESIDUAL)
        if cache is not None and len(cache) != len(self.blocks):
            raise ValueError(f"cache must hold one state per block ({len(self.blocks)}), got {len(cache)}")
        x, new_caches = call_blocks(self.blocks, self.remat, x, cache, scan=self.scan_layers, cu_seqlens=cu_seqlens)
        return self.norm(x), None if cache is None else tuple(new_caches)

    def init_cache(self, batch_size: int, dtype=jnp.float32) -> tuple[MixerCache, ...]:
        """An empty decode cache: one zero state per block for `batch_size` sequences.

        **Arguments:**
        - `batch_size`: sequences to decode; `dtype`: the state dtype (float64 for float64 models).
        """
        return tuple(block.mixer.init_cache(batch_size, dtype) for block in self.blocks)

    def generation_cache(self, slots: int, capacity: int | None = None) -> tuple[MixerCache, ...]:
        """An empty cache for `slots` sequences in the parameters' precision (float32, or
        float64 for float64 models); `capacity` is ignored (the states do not grow). Part of
        `recurrax.nn.pretrained.generate`'s protocol, with `prefill` and `decode_step`."""
        return self.init_cache(slots, jnp.promote_types(jnp.float32, self.embed.embedding.get_value().dtype))

    def prefill(self, tokens: Int[Array, " total_tokens"], cu_seqlens: Int[Array, " num_seqs_plus_one"],
                cache: tuple[MixerCache, ...]) -> tuple[Float[Array, "total_tokens vocab"], tuple[MixerCache, ...]]:
        """Continue `num_seqs` packed sequences (empty ones allowed) from the rows of `cache`:
        `model(tokens, cache, cu_seqlens=cu_seqlens)`."""
        return self(tokens, cache, cu_seqlens=cu_seqlens)

    def decode_step(self, tokens: Int[Array, " batch"], cache: tuple[MixerCache, ...]
                    ) -> tuple[Float[Array, "batch vocab"], tuple[MixerCache, ...]]:
        """Advance every row of `cache` by its one token: logits `[batch, vocab]`."""
        logits, cache = self(tokens[:, None], cache)
        return logits[:, 0], cache


def _arguments_json(**arguments) -> str | None:
    """`arguments` as JSON, or None where some value is not JSON-serialisable."""
    try:
        return json.dumps(arguments, sort_keys=True)
    except (TypeError, ValueError):
        return None


def _check_tokens(tokens, cu_seqlens) -> None:
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
