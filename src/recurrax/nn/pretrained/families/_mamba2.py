"""`transformers`' Mamba-2 family: Mamba2, Nemotron-H, Bamba, Granite 4.0-H, Falcon-H1, Zamba2 —
its config reading, its blocks and its body.

`resolve_hf(config)` returns a dict with the family, the widths, `layers` (one kind per layer:
`mamba`, `attention`, `mlp`, `moe`, Falcon-H1's `parallel` or Zamba2's `hybrid`) and the keyword
arguments of each layer kind, with the defaults of `transformers` 5.25's config classes for absent keys. Configs
are read as the Hub publishes them too: Nemotron-H's `hybrid_override_pattern` (`M * - E`) and
`mamba_*` aliases, the older `mamba` / `attention` layer names, a bare `Infinity` (json reads
it) and `transformers` 5's `{"__float__": "Infinity"}`.

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

import math

import jax.numpy as jnp
from flax import nnx

from ..._decoder import DecoderBody
from ..._sharding import partitioned
from .._config_checks import _rope, check_hf_config, decode_floats
from ..layers._attention import HFAttention, LayerCache
from ..layers._mamba2_mixer import Mamba2Mixer
from ..layers._mixer import run_mixer
from ..layers._mlp import GatedMLP, GraniteMoE, GraniteSharedMLP, NemotronMoE, PlainMLP
from ..layers._norm import RMSNorm
from ._zamba2 import zamba2_layers

HF_FAMILIES = ("mamba2", "nemotron_h", "bamba", "granitemoehybrid", "falcon_h1", "zamba2")

FLA_MAMBA2_KEYS = ("fuse_norm", "fuse_cross_entropy", "fuse_linear_cross_entropy", "fuse_swiglu", "attn")
"""Keys of fla's own `mamba2` config.json, which `transformers`' Mamba2Config never writes."""

DEFAULTS = {
    "mamba2": dict(num_heads=128, head_dim=64, vocab_size=32768, hidden_size=4096, state_size=128,
                   num_hidden_layers=64, layer_norm_epsilon=1e-5, expand=2, conv_kernel=4, n_groups=8,
                   use_bias=False, use_conv_bias=True, hidden_act="silu", residual_in_fp32=True,
                   time_step_limit=(0.0, math.inf), tie_word_embeddings=False),
    "nemotron_h": dict(vocab_size=131072, hidden_size=4096, tie_word_embeddings=False, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, intermediate_size=21504,
                       mlp_hidden_act="relu2", mlp_bias=False, ssm_state_size=128, mamba_num_heads=128,
                       mamba_head_dim=64, mamba_hidden_act="silu", n_groups=8, conv_kernel=4,
                       time_step_limit=(0.0, math.inf), use_conv_bias=True, n_routed_experts=8, n_shared_experts=1,
                       moe_intermediate_size=7688, moe_shared_expert_intermediate_size=7688, moe_latent_size=None,
                       num_experts_per_tok=2, routed_scaling_factor=1.0, n_group=1, topk_group=1,
                       norm_topk_prob=True, num_nextn_predict_layers=0, use_bias=False, layer_norm_epsilon=1e-5,
                       residual_in_fp32=False, sliding_window=None),
    "bamba": dict(vocab_size=128000, tie_word_embeddings=False, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
                  rms_norm_eps=1e-5, max_position_embeddings=262144, attn_layer_indices=None, mamba_n_heads=128,
                  mamba_d_head="auto", mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4, mamba_expand=2,
                  mamba_conv_bias=True, mamba_proj_bias=False, time_step_limit=(0.0, math.inf),
                  attention_bias=False, mlp_bias=False),
    "granitemoehybrid": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=None, hidden_act="silu",
                             max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                             attention_bias=False, embedding_multiplier=1.0, logits_scaling=1.0,
                             residual_multiplier=1.0, attention_multiplier=1.0, num_local_experts=8,
                             num_experts_per_tok=2, shared_intermediate_size=1024, position_embedding_type=None,
                             layer_types=None, mamba_n_heads=128, mamba_n_groups=1, mamba_d_state=256,
                             mamba_d_head="auto", mamba_d_conv=4, mamba_expand=2, mamba_conv_bias=True,
                             mamba_proj_bias=False, time_step_limit=(0.0, math.inf)),
    "falcon_h1": dict(vocab_size=128000, tie_word_embeddings=False, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
                      rms_norm_eps=1e-5, max_position_embeddings=8192, mamba_d_ssm=1024, mamba_n_heads=128,
                      mamba_d_head="auto", mamba_n_groups=1, mamba_d_state=256, mamba_d_conv=4, mamba_expand=2,
                      mamba_conv_bias=True, mamba_proj_bias=False, mamba_norm_before_gate=True,
                      mamba_rms_norm=False, time_step_limit=(0.0, math.inf), projectors_bias=False,
                      lm_head_multiplier=1.0, embedding_multiplier=1.0, mlp_multipliers=None, key_multiplier=1.0,
                      attention_out_multiplier=1.0, attention_in_multiplier=1.0, ssm_multipliers=None,
                      ssm_in_multiplier=1.0, ssm_out_multiplier=1.0, attention_bias=False, mlp_bias=False),
    "zamba2": dict(vocab_size=32000, max_position_embeddings=4096, hidden_size=2560, num_hidden_layers=54,
                   layers_block_type=None, mamba_d_state=64, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1,
                   time_step_min=0.001, n_mamba_heads=8, add_bias_linear=False, intermediate_size=None,
                   hidden_act="gelu", num_attention_heads=32, num_key_value_heads=None, num_mem_blocks=1,
                   use_shared_attention_adapter=False, adapter_rank=128, use_mem_rope=False, rms_norm_eps=1e-5,
                   use_long_context=False, tie_word_embeddings=True),
}
"""Defaults of `transformers` 5.25's config classes, per `model_type` (the keys read here)."""

NEMOTRON_ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_dt_limit": "time_step_limit",
                    "mamba_conv_bias": "use_conv_bias", "layer_types": "layers_block_type"}
PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
LAYER_NAMES = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention",
               "mlp": "mlp", "moe": "moe"}
ZAMBA2_LAYERS = ["mamba"] + (["mamba"] * 5 + ["hybrid"]) * 7 + ["mamba"] * 4 + ["hybrid"] + ["mamba"] * 3 + [
    "hybrid"] + ["mamba"] * 2
"""Zamba2Config's `layers_block_type` when a config has none (54 layers)."""


def is_hf_config(config: dict) -> bool:
    """Whether config.json is one of `transformers`' Mamba-2 families (refusing fla's own `mamba2`)."""
    if not isinstance(config, dict):
        return False  # resolve refuses it by name
    model_type = config.get("model_type")
    if model_type == "mamba2" and any(key in config for key in FLA_MAMBA2_KEYS):
        raise NotImplementedError(
            "this is fla's own mamba2 config (it has fla's fuse_* keys); only transformers' Mamba2 checkpoints "
            "(Mamba2ForCausalLM) are supported")
    return model_type in HF_FAMILIES


def _layer_kinds(c: dict, family: str) -> list[str]:
    if family == "mamba2":
        return ["mamba"] * c["num_hidden_layers"]
    if family == "falcon_h1":
        return ["parallel"] * c["num_hidden_layers"]
    if family == "bamba":
        attention = set(c["attn_layer_indices"] or ())
        return ["attention" if i in attention else "mamba" for i in range(c["num_hidden_layers"])]
    if family == "zamba2":
        names = c.get("layers_block_type") or c.get("layer_types") or ZAMBA2_LAYERS
        unknown = sorted(set(names) - {"linear_attention", "mamba", "hybrid"})
        if unknown:
            raise NotImplementedError(f"unsupported layer types {unknown} in a zamba2 config")
        return ["hybrid" if name == "hybrid" else "mamba" for name in names]
    if family == "nemotron_h":
        if c.get("layers_block_type") is not None:
            names = c["layers_block_type"]
        elif c.get("hybrid_override_pattern") is not None:
            return [PATTERN[ch] for ch in c["hybrid_override_pattern"]]
        else:
            names = ["linear_attention", "moe", "full_attention", "mlp"]
    else:
        names = c["layer_types"] or ["linear_attention"] * c["num_hidden_layers"]
    unknown = sorted(set(names) - set(LAYER_NAMES))
    if unknown:
        raise NotImplementedError(f"unsupported layer types {unknown} in a {family} config")
    return [LAYER_NAMES[name] for name in names]


def _mamba(c: dict, family: str) -> dict:
    """The Mamba2Mixer arguments of a family's Mamba layers."""
    limit = tuple(c["time_step_limit"] or (0.0, math.inf))
    if family in ("mamba2", "nemotron_h"):
        act = c["hidden_act"] if family == "mamba2" else c["mamba_hidden_act"]
        if family == "mamba2":
            heads, head_dim = c["num_heads"], c["head_dim"]
            if heads * head_dim != int(c["expand"] * c["hidden_size"]):
                raise ValueError(f"mamba2 needs num_heads·head_dim == expand·hidden_size, got {heads}·{head_dim} "
                                 f"and {c['expand']}·{c['hidden_size']}")
        else:
            heads, head_dim = c["mamba_num_heads"], c["mamba_head_dim"]
        spec = dict(num_heads=heads, head_dim=head_dim, state_size=c.get("state_size", c.get("ssm_state_size")),
                    n_groups=c["n_groups"], conv_kernel=c["conv_kernel"], use_conv_bias=c["use_conv_bias"],
                    use_bias=c["use_bias"], time_step_limit=limit, eps=c["layer_norm_epsilon"])
    else:
        width = c["mamba_expand"] * c["hidden_size"]
        if family == "falcon_h1" and c["mamba_d_ssm"] is not None:
            width = c["mamba_d_ssm"]
        head_dim = width // c["mamba_n_heads"] if c["mamba_d_head"] == "auto" else c["mamba_d_head"]
        act = c["hidden_act"]
        spec = dict(num_heads=c["mamba_n_heads"], head_dim=head_dim, state_size=c["mamba_d_state"],
                    n_groups=c["mamba_n_groups"], conv_kernel=c["mamba_d_conv"], use_conv_bias=c["mamba_conv_bias"],
                    use_bias=c["mamba_proj_bias"], time_step_limit=limit, eps=c["rms_norm_eps"])
        if family == "falcon_h1":
            spec.update(out_bias=c["projectors_bias"], gated_norm=c["mamba_rms_norm"],
                        norm_before_gate=c["mamba_norm_before_gate"], in_multiplier=c["ssm_in_multiplier"],
                        ssm_multipliers=tuple(c["ssm_multipliers"] or (1.0,) * 5))
    if act not in ("silu", "swish"):
        raise NotImplementedError(f"only a SiLU Mamba activation is supported, got {act!r}")
    return spec


def _attention(c: dict, family: str) -> dict:
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    spec = dict(num_heads=heads, num_kv_heads=c["num_key_value_heads"] or heads, head_dim=head_dim,
                bias=c.get("attention_bias", False) if family != "nemotron_h" else False)
    if family == "nemotron_h":
        if c.get("sliding_window"):
            raise NotImplementedError("Nemotron-H's sliding_window attention is not supported")
        return spec  # no positional encoding
    if family == "granitemoehybrid":
        spec["scale"] = float(c["attention_multiplier"])
        if c["position_embedding_type"] != "rope":
            return spec
    if family == "falcon_h1":
        spec["key_multiplier"] = float(c["key_multiplier"])
    spec["rotary_dim"], spec["rope_theta"] = _rope(c, head_dim, 0.5 if family == "bamba" else None)
    return spec


def _zamba2(c: dict) -> dict:
    """Zamba2's Mamba layers and its shared transformer blocks (their attention reads [h | embeddings], 2D wide)."""
    D, heads = c["hidden_size"], c["num_attention_heads"]
    width = int(c["mamba_expand"] * D)
    if width % c["n_mamba_heads"]:
        raise ValueError(f"zamba2 needs n_mamba_heads ({c['n_mamba_heads']}) to divide mamba_expand·hidden_size "
                         f"({width})")
    kv_heads = c["num_key_value_heads"] or heads
    head_dim = 2 * D // heads  # transformers' attention_head_dim (a config's head_dim is overwritten by it)
    if c["use_shared_attention_adapter"] and not heads * head_dim == kv_heads * head_dim == 2 * D:
        raise NotImplementedError(
            "zamba2's use_shared_attention_adapter needs num_key_value_heads == num_attention_heads dividing "
            f"2·hidden_size (its adapters are 2·hidden_size wide), got {kv_heads}, {heads}, {2 * D}; transformers "
            "cannot run this config either")
    rotary_dim, theta = _rope(c, head_dim, 1.0) if c["use_mem_rope"] else (0, 10000.0)
    return dict(
        mamba=dict(num_heads=c["n_mamba_heads"], head_dim=width // c["n_mamba_heads"], state_size=c["mamba_d_state"],
                   n_groups=c["mamba_ngroups"], conv_kernel=c["mamba_d_conv"], use_conv_bias=True,  # always, as in
                   use_bias=c["add_bias_linear"], time_step_limit=(float(c["time_step_min"]), math.inf),  # transformers
                   eps=1e-5),
        attention=dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rotary_dim=rotary_dim,
                       rope_theta=theta, scale=(head_dim / 2) ** -0.5),
        mlp=dict(width=c["intermediate_size"] or 4 * D, bias=c["add_bias_linear"], act=c["hidden_act"]),
        shared=dict(blocks=c["num_mem_blocks"], rank=c["adapter_rank"],
                    attention_adapters=bool(c["use_shared_attention_adapter"])))


def resolve_hf(config: dict) -> dict:
    """The layout spec of a `transformers` Mamba-2 family config (see the module docstring)."""
    family = config["model_type"]
    c = {**DEFAULTS[family], **decode_floats(config)}
    if family == "nemotron_h":
        for alias, name in NEMOTRON_ALIASES.items():
            if alias in config:
                c[name] = c.pop(alias)
        if c["num_nextn_predict_layers"]:
            c["num_nextn_predict_layers"] = 0  # the multi-token-prediction head is not part of causal LM logits
    check_hf_config(c)
    kinds = _layer_kinds(c, family)
    spec = dict(family=family, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], layers=kinds,
                tie_word_embeddings=bool(c["tie_word_embeddings"]) and family != "nemotron_h",  # it never ties
                eps=c.get("layer_norm_epsilon", c.get("rms_norm_eps")),
                residual_in_fp32=bool(c.get("residual_in_fp32", False)),
                max_position_embeddings=c.get("max_position_embeddings", 2048))
    if family == "zamba2":
        if c["use_long_context"]:
            spec["max_position_embeddings"] = 16384  # what transformers' config sets (its rope is unchanged)
        spec.update(_zamba2(c), embedding_multiplier=1.0, residual_multiplier=1.0, logits_multiplier=1.0)
        return spec
    if "mamba" in kinds or "parallel" in kinds:
        spec["mamba"] = _mamba(c, family)
    if "attention" in kinds or "parallel" in kinds:
        spec["attention"] = _attention(c, family)
    if family == "nemotron_h":
        spec["mlp"] = dict(width=c["intermediate_size"], bias=c["mlp_bias"], act=c["mlp_hidden_act"])
        spec["moe"] = dict(experts=c["n_routed_experts"], width=c["moe_intermediate_size"],
                           shared_width=c["moe_shared_expert_intermediate_size"], latent=c["moe_latent_size"],
                           bias=c["mlp_bias"], act=c["mlp_hidden_act"],
                           router=dict(top_k=c["num_experts_per_tok"], n_group=c["n_group"],
                                       topk_group=c["topk_group"], norm_topk_prob=bool(c["norm_topk_prob"]),
                                       routed_scaling_factor=c["routed_scaling_factor"]))
    elif family in ("bamba", "falcon_h1"):
        multipliers = tuple(c.get("mlp_multipliers") or (1.0, 1.0))
        spec["mlp"] = dict(width=c["intermediate_size"], bias=c["mlp_bias"], act=c["hidden_act"],
                           multipliers=multipliers)
    elif family == "granitemoehybrid":
        spec["shared_mlp"] = dict(width=c["shared_intermediate_size"], act=c["hidden_act"])
        if c["num_local_experts"]:
            spec["moe"] = dict(experts=c["num_local_experts"], width=c["intermediate_size"],
                               top_k=c["num_experts_per_tok"], act=c["hidden_act"])
    spec["embedding_multiplier"] = float(c.get("embedding_multiplier", 1.0))
    spec["residual_multiplier"] = float(c.get("residual_multiplier", 1.0))
    spec["logits_multiplier"] = (1.0 / float(c["logits_scaling"]) if family == "granitemoehybrid"
                                 else float(c.get("lm_head_multiplier", 1.0)))
    if family == "falcon_h1":
        spec["branch_multipliers"] = dict(attention_in=float(c["attention_in_multiplier"]),
                                          attention_out=float(c["attention_out_multiplier"]),
                                          ssm_out=float(c["ssm_out_multiplier"]))
    return spec


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


class HFBackbone(DecoderBody):
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
