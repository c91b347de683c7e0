"""The table of families (`FAMILIES`: the modules of `families/`, by `model_type` in
`FAMILY_MODULES`), and fla's config.json, read the way fla's config classes and blocks read it.

Each supported `model_type` has its config class's defaults (for keys a config.json leaves
out) and a builder of its native mixer with the arguments fla's block passes (options fla's
block does not pass, such as GLA's `gate_logit_normalizer`, keep the layer's defaults here
too). `attn` (a dict or a list of dicts) puts fla's softmax `Attention` at the listed layers.
"""

from __future__ import annotations

from ._config_checks import check_config
from .families import _bailing_hybrid, _gated_deltanet, _kimi_linear, _language_model, _minimax, _olmo_hybrid
from .families import _qwen3_next
from .families._gla import GatedLinearAttention
from .families._hgrn2 import HGRN2Attention
from .families._lightnet import LightNetAttention
from .families._linear_attn import LinearAttention
from .families._mamba2 import HF_FAMILIES
from .families._retnet import MultiScaleRetention

COMMON_DEFAULTS = dict(
    vocab_size=32000, hidden_size=2048, num_hidden_layers=24, hidden_ratio=4, intermediate_size=None,
    hidden_act="swish", max_position_embeddings=2048, elementwise_affine=True, norm_eps=1e-6, attn=None,
    tie_word_embeddings=False, fuse_norm=True, attnres_block_size=None,
)

FAMILY_DEFAULTS = {
    "gla": dict(expand_k=0.5, expand_v=1.0, num_heads=4, num_kv_heads=None, feature_map=None,
                use_short_conv=False, conv_size=4, use_output_gate=True, clamp_min=None),
    "retnet": dict(expand_k=1.0, expand_v=2.0, hidden_ratio=2, num_heads=8, num_kv_heads=None, feature_map=None,
                   use_output_gate=True),
    "hgrn2": dict(num_heads=None, expand_ratio=128, use_short_conv=False, conv_size=4, use_lower_bound=True),
    "linear_attn": dict(expand_k=1.0, expand_v=1.0, num_heads=4, num_kv_heads=None,
                        feature_map="elementwise_product", tie_feature_map_qk=False, norm_q=False, norm_k=False,
                        norm_feature_map=False),
    "lightnet": dict(num_heads=None, expand_ratio=128, use_short_conv=False, conv_size=4, gate_low_rank_dim=128),
    "gated_deltanet": _gated_deltanet.DEFAULTS,
}
"""Defaults of fla 0.6.0's config classes, per `model_type`."""

ARCHITECTURES = {
    "gla": "GLAForCausalLM",
    "retnet": "RetNetForCausalLM",
    "hgrn2": "HGRN2ForCausalLM",
    "linear_attn": "LinearAttentionForCausalLM",
    "lightnet": "LightNetForCausalLM",
    "gated_deltanet": "GatedDeltaNetForCausalLM",
}
FAMILIES = (
    _qwen3_next,
    _olmo_hybrid,
    _minimax,
    _kimi_linear,
    _bailing_hybrid,
    _language_model,
)
"""The family modules of `families/`: adding a family is one module there and one row here."""
FAMILY_MODULES = {model_type: module for module in FAMILIES for model_type in module.MODEL_TYPES}
"""`transformers` families that are one module each, by `model_type`. A family module defines
`MODEL_TYPES`, `resolve(config)` (config.json → a spec with `vocab_size`, `hidden_size`,
`tie_word_embeddings`, `max_position_embeddings`), `Body(spec, dtype=, rngs=)` (the embedding,
layers and final norm, held as `BODY_NAME`), and `loaded_names(weights)` / `saved_names(weights)`
(a checkpoint's tensor names to the module tree's and back, as `transformers` writes them),
optionally `saved_buffers(config, weights)` (tensors `transformers` saves that are functions of the
config, such as MiniMax's Lightning decays); `MULTIMODAL` (multimodal `model_type`s whose text model it reads) and `text_model_config`.
A family whose model is its own class (`recurrax.nn.LanguageModel`'s, `families/_language_model.py`)
names it `MODEL` instead of `Body` (`resolve` then gives `MODEL`'s constructor arguments) and
`stored_params(model)` (its checkpoint's tensors, stored as they are) instead of the module walk's."""
MULTIMODAL = {model_type: module for module in FAMILIES for model_type in module.MULTIMODAL}
"""Multimodal `model_type`s whose text model a family module reads (`text_model_config`)."""
SUPPORTED = tuple(FAMILY_DEFAULTS) + HF_FAMILIES + tuple(t for t, m in FAMILY_MODULES.items() if not hasattr(m, "MODEL"))
"""Every `model_type` `CausalLM` and `from_pretrained` accept: fla's families (gated_deltanet among them), then `transformers`' Mamba-2
family (mamba2, nemotron_h, bamba, granitemoehybrid, falcon_h1, zamba2), then the family modules
(qwen3_next, qwen3_5_text, qwen3_5_moe_text, olmo_hybrid, minimax, kimi_linear, bailing_hybrid).
`from_pretrained` and `model_from_config` accept `recurrax_language_model` too (`OWN_MODELS`)."""
OWN_MODELS = {t: m.MODEL for t, m in FAMILY_MODULES.items() if hasattr(m, "MODEL")}
"""The families whose model class is their own, not `CausalLM`, by `model_type`: `recurrax.nn.LanguageModel`'s."""


def resolve(config: dict) -> dict:
    """config.json with fla's defaults filled in; rejects what this port does not implement."""
    if not isinstance(config, dict):
        raise TypeError(f"the config must be a dict (config.json's object), got {type(config).__name__}")
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILY_DEFAULTS:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED)}")
    full = {**COMMON_DEFAULTS, **FAMILY_DEFAULTS[model_type], **config}
    check_config(full)
    if full["attnres_block_size"] is not None:
        raise NotImplementedError("attention residuals (attnres_block_size) are not supported")
    if full["hidden_act"] != "swish":
        raise NotImplementedError(f"only hidden_act='swish' (SwiGLU MLP) is supported, got {full['hidden_act']!r}")
    if model_type == "gated_deltanet":
        _gated_deltanet.check(full)
    if model_type == "hgrn2" and full["expand_ratio"] is None:
        full["expand_ratio"] = full["hidden_size"] // full["num_heads"]
    return full


def attention_spec(config: dict, layer_idx: int) -> dict | None:
    """The `attn` entry that covers `layer_idx`, with fla's defaults, or `None`."""
    specs = config["attn"]
    if specs is None:
        return None
    for spec in [specs] if isinstance(specs, dict) else specs:
        if layer_idx in spec["layers"]:
            num_kv_heads = spec.get("num_kv_heads") or spec["num_heads"]
            rope_theta = 10000.0 if config["model_type"] == "lightnet" else spec.get("rope_theta", 10000.0)
            return dict(num_heads=spec["num_heads"], num_kv_heads=num_kv_heads, qkv_bias=spec.get("qkv_bias", False),
                        window_size=spec.get("window_size"), rope_theta=rope_theta)
    return None


def native_mixer(config: dict, layer_idx: int, *, dtype, rngs):
    """The family's own layer for `layer_idx`, built with the arguments fla's block passes."""
    c, common = config, dict(dtype=dtype, rngs=rngs)
    model_type = c["model_type"]
    if model_type == "gla":
        return GatedLinearAttention(
            c["hidden_size"], expand_k=c["expand_k"], expand_v=c["expand_v"], num_heads=c["num_heads"],
            num_kv_heads=c["num_kv_heads"], feature_map=c["feature_map"], use_short_conv=c["use_short_conv"],
            conv_size=c["conv_size"], use_output_gate=c["use_output_gate"], gate_fn=c["hidden_act"],
            elementwise_affine=c["elementwise_affine"], norm_eps=c["norm_eps"], clamp_min=c["clamp_min"],
            fuse_norm=c["fuse_norm"], **common)
    if model_type == "retnet":
        return MultiScaleRetention(
            c["hidden_size"], expand_k=c["expand_k"], expand_v=c["expand_v"], num_heads=c["num_heads"],
            num_kv_heads=c["num_kv_heads"], feature_map=c["feature_map"], use_output_gate=c["use_output_gate"],
            gate_fn=c["hidden_act"], elementwise_affine=c["elementwise_affine"], norm_eps=c["norm_eps"],
            fuse_norm=c["fuse_norm"], **common)
    if model_type == "hgrn2":
        return HGRN2Attention(
            c["hidden_size"], num_heads=c["num_heads"], expand_ratio=c["expand_ratio"],
            use_short_conv=c["use_short_conv"], conv_size=c["conv_size"], elementwise_affine=c["elementwise_affine"],
            norm_eps=c["norm_eps"], layer_idx=layer_idx, **common)
    if model_type == "gated_deltanet":
        return _gated_deltanet.gated_deltanet_mixer(c, **common)
    if model_type == "linear_attn":
        return LinearAttention(
            c["hidden_size"], expand_k=c["expand_k"], expand_v=c["expand_v"], num_heads=c["num_heads"],
            num_kv_heads=c["num_kv_heads"], feature_map=c["feature_map"], tie_feature_map_qk=c["tie_feature_map_qk"],
            norm_q=c["norm_q"], norm_k=c["norm_k"], do_feature_map_norm=c["norm_feature_map"],
            elementwise_affine=c["elementwise_affine"], norm_eps=c["norm_eps"], **common)
    return LightNetAttention(
        c["hidden_size"], num_heads=c["num_heads"], expand_ratio=c["expand_ratio"],
        use_short_conv=c["use_short_conv"], conv_size=c["conv_size"], gate_low_rank_dim=c["gate_low_rank_dim"],
        elementwise_affine=c["elementwise_affine"], norm_eps=c["norm_eps"], **common)


def intermediate_size(config: dict) -> int:
    """fla's GatedMLP width: `intermediate_size`, else 2/3 · hidden · ratio rounded up to 256."""
    if config["intermediate_size"] is not None:
        return config["intermediate_size"]
    ratio = 4 if config["hidden_ratio"] is None else config["hidden_ratio"]
    width = int(config["hidden_size"] * ratio * 2 / 3)
    return 256 * ((width + 255) // 256)



def text_model_config(config: dict) -> dict:
    """`config`, or the text model's config of a multimodal config whose text model a family
    module reads (Qwen3.5's `qwen3_5`, `qwen3_5_moe`)."""
    model_type = config.get("model_type") if isinstance(config, dict) else None
    module = MULTIMODAL.get(model_type) if isinstance(model_type, str) else None
    return config if module is None else module.text_model_config(config)
