"""`CausalLM`, one class for every supported family; the layers of fla's `...ForCausalLM`
models: embedding, pre-norm blocks (mixer + SwiGLU MLP), norm, head.

| symbol | meaning                                                      |
|--------|--------------------------------------------------------------|
| B, T   | batch rows, tokens per row (packed: one row of N tokens)     |
| R      | cache rows (B, or S packed sequences)                        |
| D, F   | `hidden_size`, the MLP width (`intermediate_size`)           |

    h = E[tokens]
    for each block l:  h = h + mixer_l(RMSNorm(h));  h = h + W_down(silu(h' W_gate) ⊙ h' W_up), h' = RMSNorm(h)
    logits = RMSNorm(h) W_head            (W_head = Eᵀ with tie_word_embeddings)

The module tree mirrors fla's names (`model.embeddings`, `model.layers[l].attn`,
`model.layers[l].mlp.gate_proj`, `model.norm`, `lm_head`, HGRN2's `model.lower_bounds`),
so a checkpoint converts by renaming and transposing. The mixer of layer l is the family's
own layer, or fla's softmax `Attention` where the config's `attn` lists l. A `transformers`
config (Mamba-2 and its hybrids) builds the body of `families/_mamba2.py` instead, with its own names.

Decoding: `model.init_cache(rows, capacity)` and `logits, cache = model(tokens, cache)`
(`generation_cache`, `prefill` and `decode_step` wrap them for `generate`); the
cache holds each layer's cache and every row's position (tokens seen so far). Softmax-attention
layers keep `capacity` tokens per row: a call that would write a position ≥ capacity is a
`ValueError` naming both (concrete positions), a failed check inside
`recurrax.runtime_checks()` (traced), and otherwise NaN logits for the tokens past it.
"""

from __future__ import annotations

import json
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from ..._core.problem import runtime_checks_enabled
from .._decoder import CausalDecoder, DecoderBody, ModelCache, pre_norm_residual
from .._precision import compute_view, store_params
from .._remat import check_remat
from .._sharding import constrain, param, partitioned
from ._config import FAMILY_MODULES, attention_spec, intermediate_size, native_mixer, resolve
from ._config_checks import ConfigError, eos_token_ids
from .families._mamba2 import HFBackbone, is_hf_config, resolve_hf
from .families._mamba2 import NAMES as HF_NAMES
from .layers._attention import Attention, KVCache
from .layers._mixer import linear
from .layers._norm import RMSNorm


class GatedMLP(nnx.Module):
    """fla's `GatedMLP` with SwiGLU: `W_down(silu(x W_gate) ⊙ x W_up)`, no biases."""

    def __init__(self, hidden_size: int, width: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.gate_proj = linear(hidden_size, width, axes=("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.up_proj = linear(hidden_size, width, axes=("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.down_proj = linear(width, hidden_size, axes=("mlp", "embed"), dtype=dtype, rngs=rngs)

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """fla's block: `h + attn(attn_norm(h))`, then `h + mlp(mlp_norm(h))`."""

    def __init__(self, config: dict, layer_idx: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        D, eps = config["hidden_size"], config["norm_eps"]
        self.attn_norm = RMSNorm(D, eps=eps, dtype=dtype)
        spec = attention_spec(config, layer_idx)
        if spec is None:
            self.attn = native_mixer(config, layer_idx, dtype=dtype, rngs=rngs)
        else:
            self.attn = Attention(D, **spec, dtype=dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(D, eps=eps, dtype=dtype)
        self.mlp = GatedMLP(D, intermediate_size(config), dtype=dtype, rngs=rngs)

    def __call__(self, h, cache=None, **context):
        return pre_norm_residual(h, self.attn_norm, self.attn, self.mlp_norm, self.mlp, cache, **context)


class Backbone(DecoderBody):
    """fla's `...Model`: embeddings, blocks, final norm (and HGRN2's lower bounds)."""

    embedding_name = "embeddings"

    def __init__(self, config: dict, *, dtype=jnp.float32, rngs: nnx.Rngs):
        D = config["hidden_size"]
        init = partitioned(nnx.initializers.normal(0.02), "vocab", "embed")
        self.embeddings = nnx.Embed(config["vocab_size"], D, embedding_init=init, dtype=dtype, param_dtype=dtype,
                                    rngs=rngs)
        self.layers = nnx.List([Block(config, l, dtype=dtype, rngs=rngs) for l in range(config["num_hidden_layers"])])
        self.norm = RMSNorm(D, eps=config["norm_eps"], dtype=dtype)
        has_bounds = config["model_type"] == "hgrn2" and config["use_lower_bound"]
        bounds = jnp.zeros((config["num_hidden_layers"], D), dtype)
        self.lower_bounds = param(bounds, "layers", "embed") if has_bounds else None

    def layer_lower_bounds(self):
        """HGRN2's per-layer lower bounds `cumsum(softmax(β, layers)) − first`, or `None`s."""
        if self.lower_bounds is None:
            return [None] * len(self.layers)
        probs = jax.nn.softmax(self.lower_bounds[...].astype(jnp.float32), axis=0)
        bounds = jnp.cumsum(probs, axis=0) - probs[0]
        return [bounds[l] for l in range(len(self.layers))]

    def layer_context(self, embedded) -> list[dict]:
        """Per-layer keyword arguments of the blocks: HGRN2's lower bounds."""
        return [dict(lower_bound=bound) for bound in self.layer_lower_bounds()]

    def init_caches(self, rows: int, capacity: int) -> tuple:
        """One empty cache per layer; softmax-attention layers hold `capacity` tokens per row."""
        return tuple(block.attn.init_cache(rows, capacity) if isinstance(block.attn, Attention)
                     else block.attn.init_cache(rows) for block in self.layers)


class CausalLM(CausalDecoder):
    """A causal language model of any supported family (`SUPPORTED`), built from its
    config.json: fla's `...ForCausalLM` (GLA, RetNet, HGRN2, LinearAttention, LightNet,
    Gated DeltaNet; hybrids via `attn`) or `transformers`' `Mamba2ForCausalLM`, `NemotronHForCausalLM`,
    `BambaForCausalLM`, `GraniteMoeHybridForCausalLM`, `FalconH1ForCausalLM`,
    `Zamba2ForCausalLM`, `Qwen3NextForCausalLM`, `Qwen3_5ForCausalLM`, the Qwen3.5 MoE
    text model (`_qwen3_next`), `OlmoHybridForCausalLM` (`_olmo_hybrid`),
    `KimiLinearForCausalLM` (`_kimi_linear`) and `BailingHybridForCausalLM` (Ling,
    `_bailing_hybrid`). Freshly
    initialised (to train from scratch), or filled by `from_pretrained`.

    **Arguments:**
    - `config`: the config.json as a dict (its `model_type` chooses the family; a bad value is
      a `ValueError` naming the field).
    - `dtype`: computation dtype (default float32).
    - `param_dtype`: the parameters' dtype (default `dtype`). Mixed precision is
      `dtype=jnp.bfloat16, param_dtype=jnp.float32`: each call computes on the parameters cast
      to `dtype` (`recurrax.nn`'s `_precision`), so it equals the model built in `dtype` with
      rounded weights; recurrent states, gate cumsums, norms' variance, softmax statistics and
      the logits stay float32, and the gradients are `param_dtype`'s.
    - `remat`: what a training step keeps of each layer for the backward: None (everything
      autodiff saves), `"block"` (the layer's input; the layer is recomputed) or `"dots"` (its
      projections' matmul outputs); gradients are the same up to rounding. A plain attribute:
      set `model.remat` to change it.
    - `scan_layers`: run the layers of a training call or a prefill (more than one token a row)
      under one `jax.lax.scan` (traced and compiled once, whatever the depth; a decode step runs
      them one by one) where they repeat: identical layers, or identical groups
      of layers in a hybrid (three linear-attention layers and one softmax-attention layer, say);
      parameter names and checkpoints do not change (`recurrax.nn.call_blocks`). False: one after
      another. A plain attribute.
    - `rngs`: initialisation (`from_pretrained` overwrites every parameter).

    It is the shared decoder (`recurrax.nn._decoder`, as `recurrax.nn.LanguageModel` is) with
    the family's body, head and cache. The body (embedding, layers, final norm) is `model.body`,
    under the name the family's checkpoints use (`model`, or `backbone` for Mamba2 and
    Nemotron-H). `eos_token_ids` (from `eos_token_id`, an id or a list) are `generate`'s default
    stop tokens.
    """

    logits_dtype = jnp.float32

    def __init__(self, config: dict, *, dtype=jnp.float32, param_dtype=None, remat: str | None = None,
                 scan_layers: bool = True, rngs: nnx.Rngs | None = None):
        rngs = nnx.Rngs(0) if rngs is None else rngs
        self.remat, self.scan_layers = check_remat(remat), bool(scan_layers)
        model_type = config.get("model_type") if isinstance(config, dict) else None
        family_module = FAMILY_MODULES.get(model_type) if isinstance(model_type, str) else None
        if hasattr(family_module, "MODEL"):
            raise ValueError(f"a {model_type!r} config builds a {family_module.MODEL.__qualname__}, not a CausalLM: "
                             "build it with recurrax.nn.pretrained.model_from_config(config) (or from_pretrained)")
        if family_module is not None:
            spec = family_module.resolve(config)
            family, hidden_size = config["model_type"], spec["hidden_size"]
            self.body_name = family_module.BODY_NAME
            make_body = lambda: family_module.Body(spec, dtype=dtype, rngs=rngs)  # noqa: E731
            self.logits_multiplier, self.tie_word_embeddings = 1.0, spec["tie_word_embeddings"]
        elif is_hf_config(config):
            spec = resolve_hf(config)
            family, hidden_size = spec["family"], spec["hidden_size"]
            self.body_name, make_body = HF_NAMES[family][0], lambda: HFBackbone(spec, dtype=dtype, rngs=rngs)
            self.logits_multiplier = spec["logits_multiplier"]
            self.tie_word_embeddings = spec["tie_word_embeddings"]
        else:
            full = resolve(config)
            family, hidden_size, spec = full["model_type"], full["hidden_size"], full
            self.body_name, make_body = "model", lambda: Backbone(full, dtype=dtype, rngs=rngs)
            self.logits_multiplier, self.tie_word_embeddings = 1.0, bool(full["tie_word_embeddings"])
        self.config_json = json.dumps(config, sort_keys=True)  # as given: save_pretrained writes it back
        self.model_type, self.dtype = family, dtype
        self.param_dtype = dtype if param_dtype is None else param_dtype
        self.vocab_size, self.max_position_embeddings = spec["vocab_size"], spec["max_position_embeddings"]
        self.eos_token_ids = eos_token_ids(config.get("eos_token_id"), "eos_token_id")
        try:
            setattr(self, self.body_name, make_body())
        except (KeyError, AttributeError, ZeroDivisionError, TypeError) as error:  # a value the checks missed
            raise ConfigError(f"cannot build a {family!r} model from this config: "
                              f"{type(error).__name__}: {error}") from error
        self.lm_head = None if self.tie_word_embeddings else linear(hidden_size, spec["vocab_size"],
                                                                    axes=("embed", "vocab"), dtype=dtype, rngs=rngs)
        if self.param_dtype != dtype:  # built (and initialised) in dtype, stored in param_dtype
            store_params(self, self.param_dtype)

    @property
    def config(self) -> dict:
        """The config.json dict this model was built from."""
        return json.loads(self.config_json)

    @property
    def body(self) -> Backbone | HFBackbone:
        """The embedding, layers and final norm (`model` or `backbone`, as the family names it)."""
        return getattr(self, self.body_name)

    def __call__(
        self,
        tokens: Int[Array, "B T"] | Int[Array, " N"],
        cache: ModelCache | None = None,
        *,
        cu_seqlens: Int[Array, " S_plus_1"] | None = None,
        logits_to_keep: int | None = None,
    ):
        """Next-token logits for every token; with `cache`, continue from it and return it too.

        **Arguments:**
        - `tokens`: `[B, T]` ids in `[0, vocab_size)`, or packed `[N]` with `cu_seqlens` (ids
          outside are a `ValueError`; traced ones are checked inside `recurrax.runtime_checks()`).
        - `cache`: a `ModelCache` (`init_cache(rows, capacity)`), rows = B or S; `None` for a
          parallel pass from an empty history. Its softmax-attention layers hold `capacity`
          positions per row: writing past them is refused (see the module's docstring).
        - `cu_seqlens`: `[S + 1]` boundaries of packed sequences.
        - `logits_to_keep`: the head on the last `logits_to_keep` positions only (as
          `transformers`' option of that name): `[B, logits_to_keep, vocab]`; not with `cu_seqlens`.

        **Returns:** `logits` `[B, T, vocab]` (packed: `[N, vocab]`), float32, or
        `(logits, new_cache)`.
        """
        return self._forward(tokens, cache, cu_seqlens, logits_to_keep)

    def _computing(self) -> CausalLM:
        """The model to run the forward with: itself, or (parameters stored in another dtype
        than `dtype`) a view with its parameters cast to `dtype`."""
        if self.param_dtype == self.dtype:
            return self
        view = compute_view(self, self.dtype)
        view.param_dtype = self.dtype
        return view

    def _block_inputs(self, tokens, h, cache, cu_seqlens) -> dict:
        """Every token's position (refused past the cache's attention capacity)."""
        if cu_seqlens is not None and tokens.ndim != 1:
            raise ValueError(f"packed tokens must be [total_tokens], got shape {tokens.shape}")
        positions = self._positions(h, cache, cu_seqlens)
        _refuse_past_capacity(positions, None if cache is None else self._capacity(cache))
        return dict(positions=positions)

    def init_cache(self, rows: int, capacity: int | None = None) -> ModelCache:
        """An empty cache for `rows` sequences; softmax-attention layers hold `capacity` tokens
        per row (default `max_position_embeddings`): size it to the longest sequence you will
        feed (prompt + new tokens). Layers without softmax attention ignore it."""
        capacity = self.max_position_embeddings if capacity is None else capacity
        return ModelCache.empty(self.body.init_caches(rows, capacity), rows)

    def generation_cache(self, slots: int, capacity: int) -> ModelCache:
        """`init_cache(slots, capacity)`: `generate`'s protocol (`CachedLanguageModel`)."""
        return self.init_cache(slots, capacity)

    def _capacity(self, cache: ModelCache) -> int | None:
        """Positions per row the cache's softmax-attention layers hold (None: no such layer)."""
        kv = [layer if isinstance(layer, KVCache) else getattr(layer, "attention", None) for layer in cache.layers]
        sizes = [layer.keys.shape[1] for layer in kv if isinstance(layer, KVCache)]  # a hybrid's LayerCache too
        return min(sizes) if sizes else None


def _refuse_past_capacity(positions, capacity: int | None) -> None:
    """Refuse tokens at positions ≥ `capacity` (their keys and values cannot be stored):
    concrete positions at once, traced ones inside `recurrax.runtime_checks()`."""
    if capacity is None:
        return
    if not isinstance(positions, jax.core.Tracer):
        past = np.argwhere(np.asarray(positions) >= capacity)
        if past.size:
            row, column = (int(i) for i in past[0])
            raise ValueError(f"the cache's attention capacity is {capacity} positions per row "
                             f"(init_cache(rows, capacity)); token {column} of row {row} would be written at "
                             f"position {int(np.asarray(positions)[row, column])}: size the cache to the prompt "
                             "plus the new tokens")
    elif runtime_checks_enabled():
        from jax.experimental import checkify

        checkify.check(jnp.max(positions) < capacity, f"the cache's attention capacity is {capacity} positions per "
                       "row, a token would be written at position {}", jnp.max(positions))
