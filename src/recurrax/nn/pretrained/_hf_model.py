"""The layers of `transformers`' Mamba-2 causal LMs: Mamba2, Nemotron-H, Bamba, Granite 4.0-H, Falcon-H1, Zamba2.

| symbol | meaning                                                           |
|--------|-------------------------------------------------------------------|
| B, T   | batch rows, tokens per row (packed: one row of N tokens)          |
| D      | `hidden_size`                                                     |
| m_*    | a config's multipliers (1 where a family has none)                |

    h = E[tokens] · m_embedding
    mamba2, nemotron_h:  h = h + mixer_l(norm(h))            mixer: Mamba / attention / MLP / MoE
    bamba:               h = h + (mamba | self_attn)(input_layernorm(h));  h = h + feed_forward(pre_ff_layernorm(h))
    granitemoehybrid:    h = h + m_res · (mamba | self_attn)(input_layernorm(h))
                         h = h + m_res · (block_sparse_moe(x) + shared_mlp(x)),  x = post_attention_layernorm(h)
    falcon_h1:           x = input_layernorm(h)
                         h = h + m_ssm_out · mamba(x) + m_attn_out · self_attn(m_attn_in · x)
                         h = h + feed_forward(pre_ff_layernorm(h))
    zamba2:              Mamba layers, and hybrid layers that first run a shared block on [h | E[tokens]]
                         (see `_zamba2`)
    logits = final_norm(h) W_head · m_logits        (W_head = Eᵀ with tie_word_embeddings)

`CausalLM` builds these from a `transformers` config.json. The module tree has the names of
the checkpoints `transformers` writes (`backbone.` for Mamba2 and Nemotron-H, `model.` for
the others), so weights load by name. With
`residual_in_fp32` the residual stream is float32 whatever the model's dtype.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from .._sharding import partitioned
from ._hf_layers import (GatedMLP, GraniteMoE, GraniteSharedMLP, HFAttention, LayerCache, NemotronMoE, PlainMLP,
                         run_mixer)
from ._mamba2 import Mamba2Mixer
from ._norm import RMSNorm
from ._zamba2 import zamba2_layers

NAMES = {  # family: (backbone, embedding, final norm)
    "mamba2": ("backbone", "embeddings", "norm_f"),
    "nemotron_h": ("backbone", "embeddings", "norm_f"),
    "bamba": ("model", "embed_tokens", "final_layernorm"),
    "granitemoehybrid": ("model", "embed_tokens", "norm"),
    "falcon_h1": ("model", "embed_tokens", "final_layernorm"),
    "zamba2": ("model", "embed_tokens", "final_layernorm"),
}


class HFBlock(nnx.Module):
    """One layer of a `transformers` Mamba-2 family, with that family's attribute names."""

    def __init__(self, spec: dict, kind: str, *, dtype=jnp.float32, rngs: nnx.Rngs):
        D, eps, family = spec["hidden_size"], spec["eps"], spec["family"]
        self.family, self.kind, self.dtype = family, kind, dtype
        self.residual_in_fp32, self.residual_multiplier = spec["residual_in_fp32"], spec["residual_multiplier"]
        self.branch_multipliers = tuple(sorted(spec.get("branch_multipliers", {}).items()))
        common = dict(dtype=dtype, rngs=rngs)
        make_mamba = lambda: Mamba2Mixer(D, **spec["mamba"], **common)  # noqa: E731
        make_attention = lambda: HFAttention(D, **spec["attention"], **common)  # noqa: E731
        if family in ("mamba2", "nemotron_h"):
            self.norm = RMSNorm(D, eps=eps, dtype=dtype)
            if kind == "mamba":
                self.mixer = make_mamba()
            elif kind == "attention":
                self.mixer = make_attention()
            elif kind == "mlp":
                self.mixer = PlainMLP(D, **spec["mlp"], **common)
            else:
                self.mixer = NemotronMoE(D, **spec["moe"], **common)
            return
        self.input_layernorm = RMSNorm(D, eps=eps, dtype=dtype)
        self.mamba = make_mamba() if kind in ("mamba", "parallel") else None
        self.self_attn = make_attention() if kind in ("attention", "parallel") else None
        if family == "granitemoehybrid":
            self.post_attention_layernorm = RMSNorm(D, eps=eps, dtype=dtype)
            self.block_sparse_moe = GraniteMoE(D, **spec["moe"], **common) if "moe" in spec else None
            self.shared_mlp = GraniteSharedMLP(D, **spec["shared_mlp"], **common)
        else:
            self.pre_ff_layernorm = RMSNorm(D, eps=eps, dtype=dtype)
            self.feed_forward = GatedMLP(D, **spec["mlp"], **common)

    def init_cache(self, rows: int, capacity: int) -> LayerCache:
        mamba = self.mixer if self.kind == "mamba" and hasattr(self, "mixer") else getattr(self, "mamba", None)
        attention = self.mixer if self.kind == "attention" and hasattr(self, "mixer") else getattr(self, "self_attn",
                                                                                                  None)
        return LayerCache(None if mamba is None else mamba.init_cache(rows),
                          None if attention is None else attention.init_cache(rows, capacity))

    def __call__(self, h, cache: LayerCache | None, **context):
        if self.family in ("mamba2", "nemotron_h"):
            return self._single(h, cache, context)
        x = self.input_layernorm(h.astype(self.dtype))
        mamba_cache = attention_cache = None
        if self.family == "falcon_h1":
            m = dict(self.branch_multipliers)
            y, mamba_cache = run_mixer(self.mamba, x, None if cache is None else cache.mamba, context)
            a, attention_cache = run_mixer(self.self_attn, x * m["attention_in"],
                                           None if cache is None else cache.attention, context)
            h = h + (y * m["ssm_out"] + a * m["attention_out"])
        elif self.mamba is not None:
            y, mamba_cache = run_mixer(self.mamba, x, None if cache is None else cache.mamba, context)
            h = h + y * self.residual_multiplier
        else:
            y, attention_cache = run_mixer(self.self_attn, x, None if cache is None else cache.attention, context)
            h = h + y * self.residual_multiplier
        if self.family == "granitemoehybrid":
            x = self.post_attention_layernorm(h)
            y = self.shared_mlp(x) if self.block_sparse_moe is None else self.block_sparse_moe(x) + self.shared_mlp(x)
            h = h + y * self.residual_multiplier
        else:
            h = h + self.feed_forward(self.pre_ff_layernorm(h))
        return h, None if cache is None else LayerCache(mamba_cache, attention_cache)

    def _single(self, h, cache, context):
        """Mamba2 / Nemotron-H: one pre-norm mixer per layer."""
        x = self.norm(h.astype(self.dtype))
        residual = h.astype(jnp.float32) if self.residual_in_fp32 else h
        if self.kind == "mamba":
            y, new = run_mixer(self.mixer, x, None if cache is None else cache.mamba, context)
            return residual + y, None if cache is None else cache._replace(mamba=new)
        if self.kind == "attention":
            y, new = run_mixer(self.mixer, x, None if cache is None else cache.attention, context)
            return residual + y, None if cache is None else cache._replace(attention=new)
        return residual + self.mixer(x), cache


class HFBackbone(nnx.Module):
    """Embedding, layers, final norm (named as the family's checkpoints name them): the body
    of a `CausalLM` built from a `transformers` config."""

    def __init__(self, spec: dict, *, dtype=jnp.float32, rngs: nnx.Rngs):
        _, embedding, final_norm = NAMES[spec["family"]]
        D = spec["hidden_size"]
        init = partitioned(nnx.initializers.normal(0.02), "vocab", "embed")
        setattr(self, embedding, nnx.Embed(spec["vocab_size"], D, embedding_init=init, dtype=dtype, param_dtype=dtype,
                                           rngs=rngs))
        if spec["family"] == "zamba2":
            self.layers = nnx.List(zamba2_layers(spec, dtype=dtype, rngs=rngs))
        else:
            self.layers = nnx.List([HFBlock(spec, kind, dtype=dtype, rngs=rngs) for kind in spec["layers"]])
        setattr(self, final_norm, RMSNorm(D, eps=spec["eps"], dtype=dtype))
        self.embedding_name, self.final_norm_name = embedding, final_norm
        self.embedding_multiplier, self.dtype = spec["embedding_multiplier"], dtype

    @property
    def embedding(self) -> nnx.Embed:
        return getattr(self, self.embedding_name)

    @property
    def final_norm(self) -> RMSNorm:
        return getattr(self, self.final_norm_name)

    def embed(self, tokens):
        """The embedded tokens, times the family's embedding multiplier."""
        h = self.embedding(tokens)
        return h * self.embedding_multiplier if self.embedding_multiplier != 1.0 else h

    def layer_context(self, embedded) -> list[dict]:
        """Zamba2's hybrid layers read the embedded tokens."""
        return [dict(embeddings=embedded) if block.kind == "hybrid" else {} for block in self.layers]

    def head_input(self, h):
        """The final norm, in the model's dtype (the residual stream may be float32)."""
        return self.final_norm(h).astype(self.dtype)

    def init_caches(self, rows: int, capacity: int) -> tuple:
        """One empty cache per layer; attention layers hold `capacity` tokens per row."""
        return tuple(block.init_cache(rows, capacity) for block in self.layers)
