"""A small causal language model: embedding, pre-norm residual blocks (mixer + MLP), tied head.

    h = E[tokens]
    for each block:  h = h + mixer(RMSNorm(h));  h = h + MLP(RMSNorm(h))
    logits = RMSNorm(h) Eᵀ

It is the shared decoder (`_decoder.py`) with these blocks, and a family of
`recurrax.nn.pretrained` (`model_type` `"recurrax_language_model"`, its row in the family table
`nn/pretrained/_config.FAMILIES`, module `families/_language_model.py`): `from_pretrained`,
`save_pretrained` and `model_from_config` build, load and save it as they do every family.
Its decode cache is the families' `ModelCache` (one mixer state per block, the tokens each row
has seen); `model(tokens, cache=cache)` continues every sequence from its cache and returns
`(logits, new_cache)`. It implements `recurrax.generation.generate`'s protocol
(`generation_cache`, `prefill`, `decode_step`), so `generate(model, prompts, max_new_tokens)`
continues ragged prompts with it.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from ._decoder import CausalDecoder, DecoderBody, ModelCache, pre_norm_residual
from ._gated_deltanet import GatedDeltaNet
from ._mixers import GatedLinearAttention, LightningAttention, LinearAttention, MixerCache, MultiScaleRetention
from ._mixers import default_kernel_init, ones
from ._remat import check_remat
from ._sharding import partitioned

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
        return pre_norm_residual(x, self.mixer_norm, self.mixer, self.mlp_norm, self.mlp, cache, cu_seqlens=cu_seqlens)


class LanguageModel(CausalDecoder, DecoderBody):
    """A causal language model over a stack of recurrent-attention blocks, with a decode cache:
    the shared decoder (`recurrax.nn._decoder`) with this model's blocks, tied head and cache.

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
    - `scan_layers`: run the blocks of a training call or a prefill (a call with a cache of more
      than one token a row) under one `jax.lax.scan` (traced and compiled once, whatever
      `num_layers`; a decode step runs them one by one) where they are identical (all mixers but
      Lightning Attention, whose decays differ per layer); parameters, their names and
      checkpoints are the same either way (`recurrax.nn.call_blocks`). False: one after another.
      A plain attribute, not part of `config`.
    - `rngs`: `flax.nnx.Rngs` for the initialisation.

    `recurrax.nn.pretrained.save_pretrained` writes it (config.json from `config`, the
    parameters by module path) and `from_pretrained` builds it back: it is the family
    `"recurrax_language_model"` of `recurrax.nn.pretrained`, whose model class is this one.
    """

    embedding_name, lm_head = "embed", None  # its own body; the head is tied
    model_type = CONFIG_MODEL_TYPE
    eos_token_ids: tuple[int, ...] = ()  # no stop token of its own (`generate`'s default)

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
    def body(self) -> LanguageModel:
        """The model is its own body: the embedding `embed`, the `blocks`, the final `norm`."""
        return self

    @property
    def layers(self) -> nnx.List:
        return self.blocks

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

    def __call__(self, tokens: Int[Array, "batch seq_len"] | Int[Array, " total_tokens"], cache: ModelCache | None = None,
                 *, cu_seqlens: Int[Array, " num_seqs_plus_one"] | None = None,
                 ) -> Float[Array, "... vocab"] | tuple[Float[Array, "... vocab"], ModelCache]:
        """Next-token logits for every position; with `cache`, continue from it.

        **Arguments:**
        - `tokens`: `[batch, seq_len]` ids in `[0, vocab_size)` (others are a `ValueError`;
          traced ones are checked inside `recurrax.runtime_checks()`), or packed
          `[total_tokens]` with `cu_seqlens`.
        - `cache`: a `ModelCache`, the per-block states after the previous tokens
          (`init_cache(batch)` for none).
        - `cu_seqlens`: `[num_seqs + 1]` boundaries of packed sequences.

        **Returns:** `logits` `[..., vocab_size]`, float32 (accumulated so for a bfloat16 model;
        float64 for a float64 one), or `(logits, new_cache)` with `cache`.
        """
        return self._forward(tokens, cache, cu_seqlens)

    def init_cache(self, batch_size: int, dtype=jnp.float32) -> ModelCache:
        """An empty decode cache: a `ModelCache` with one zero state (`MixerCache`) per block for
        `batch_size` sequences, at position 0.

        **Arguments:**
        - `batch_size`: sequences to decode; `dtype`: the state dtype (float64 for float64 models).
        """
        return ModelCache.empty((block.mixer.init_cache(batch_size, dtype) for block in self.blocks), batch_size)

    def generation_cache(self, slots: int, capacity: int | None = None) -> ModelCache:
        """An empty cache for `slots` sequences in the parameters' precision (float32, or
        float64 for float64 models); `capacity` is ignored (the states do not grow). Part of
        `recurrax.nn.pretrained.generate`'s protocol, with `prefill` and `decode_step`."""
        return self.init_cache(slots, jnp.promote_types(jnp.float32, self.embed.embedding.get_value().dtype))


def _arguments_json(**arguments) -> str | None:
    """`arguments` as JSON, or None where some value is not JSON-serialisable."""
    try:
        return json.dumps(arguments, sort_keys=True)
    except (TypeError, ValueError):
        return None
