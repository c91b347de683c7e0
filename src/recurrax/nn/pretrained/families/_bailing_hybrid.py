"""Ling (`bailing_hybrid`) as `transformers` 5.25 computes it: `BailingHybridForCausalLM`. This
module is the family's config reading and checkpoint names; its blocks are Kimi Linear's
(`families/_kimi_linear.Body`, on the shared `layers/_kda.py` and `layers/_mla.py`), built with Ling's options.
`_config.FAMILY_MODULES` registers it by `model_type`.

| symbol | meaning                                                                 |
|--------|-------------------------------------------------------------------------|
| D      | `hidden_size`                                                           |
| H, K   | KDA heads `num_attention_heads`, their dim `head_dim` (as config.json has it) |
| r      | `qk_rope_head_dim`: the rotated channels of MLA's queries and rope key  |
| λ      | `kda_lower_bound`                                                       |

    as Kimi Linear (`_kimi_linear`), with
    KDA:  a full-rank forget gate `f_proj`, `A_log [H]`; with `kda_safe_gate` (default)
          gk = λ · sigmoid(exp(A_log) · (x W_f + dt_bias)) ∈ (λ, 0), else −exp(A_log) · softplus(·);
          the output norm gated by a full-rank `g_proj`
    MLA:  q_r and k_r rotated in interleaved pairs, θ = `rope_theta` (`rope_parameters`), over r
          channels; the output gated per head by sigmoid(x W_g) before `o_proj`
    MoE:  with a nonzero limit L of layer i (`expert_swiglu_limit_list[i]` for the routed experts,
          `share_expert_swiglu_limit_list[i]` for the shared ones; 0 or absent: none), each SwiGLU
          clipped after its activation: W_down(min(silu(x W_gate), L) ⊙ clip(x W_up, −L, L))
          (`transformers`' `limit_after_act`, fixed); the dense layers' MLPs are never clipped

Which layers are what: `layer_types`, else every `layer_group_size`-th layer (default 6) MLA;
`mlp_layer_types`, else the first `first_k_dense_replace` (default 2) layers dense. The Hub's
config names are read as `transformers` maps them (`num_experts`, `num_experts_per_token`,
`moe_renormalize`, `num_expert_group`, `num_shared_experts`, `model_max_length`, ...).
`tie_word_embeddings` is ignored, as `transformers` ignores it (no tied weights declared).

Refused by name at load time: a `hidden_act` other than SiLU; `num_key_value_heads` other
than `num_attention_heads`; rotary other than the default (`rope_type`, `rope_scaling`:
`transformers` also rescales the softmax under YaRN); `kda_lower_bound` ≥ 0 with the bounded
gate; fields of Ling's own configs that `transformers` 5.25 ignores or fixes, where they ask for
another model: `rope_interleave: false`, `no_kda_lora: false`,
`gated_attention_proj_granularity_type` other than `head_wise`, `limit_after_act: false`, a
`moe_shared_expert_intermediate_size` other than `moe_intermediate_size × num_shared_experts`.
SwiGLU limit lists must hold one finite number ≥ 0 per layer.

Decoding: as Kimi Linear's, MLA caching the latent and the rotated rope key.

Checkpoints: the Hub's names, which `transformers` 5.25's `save_pretrained` writes too:
`model.word_embeddings`, `attention.` (for `self_attn.`), `attention.dense` (for `o_proj`), the
forget gate's `f_proj`, `dt_bias`, `A_log` under `attention.`, three short convolutions
`q_conv1d`, `k_conv1d`, `v_conv1d`, `mlp.gate.expert_bias` (for `e_score_correction_bias`),
each expert's `mlp.experts.{e}.{gate,up,down}_proj`. They are read (`loaded_names`), as are
`transformers`' model names (fused experts included), into `transformers`' model names with
the experts stacked, and written as the Hub's (`saved_names`). Multi-token-prediction layers
stored after the decoder (a layer holding `eh_proj`, `enorm` or `hnorm`) are dropped, as
`transformers` ignores them.
"""

from __future__ import annotations

import re

from .._config_checks import _check_fields, _is_int, _is_number, _refuse, _rope
from ..layers._mlp import per_expert, stacked_experts
from . import _kimi_linear as kimi

MODEL_TYPES = ("bailing_hybrid",)
BODY_NAME = "model"
MULTIMODAL: dict = {}
Body = kimi.Body

DEFAULTS = dict(
    vocab_size=157184, hidden_size=2560, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=42,
    num_attention_heads=32, num_key_value_heads=None, num_shared_experts=1, routed_scaling_factor=2.5,
    kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
    num_expert_group=8, topk_group=4, num_experts_per_token=8, first_k_dense_replace=2, moe_renormalize=True,
    hidden_act="silu", model_max_length=262144, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=None,
    rope_theta=6_000_000.0, attention_bias=False, num_experts=512, head_dim=128, short_conv_kernel_size=4,
    layer_group_size=6, kda_safe_gate=True, kda_lower_bound=-5.0, layer_types=None, mlp_layer_types=None,
    expert_swiglu_limit_list=None, share_expert_swiglu_limit_list=None, linear_attn_config=None)
"""Defaults of `transformers` 5.25's `BailingHybridConfig` (the keys read here, by their stored names)."""

ALIASES = {**kimi.ALIASES, "num_mtp_layers": "num_nextn_predict_layers", "swiglu_limits": "expert_swiglu_limit_list",
           "swiglu_limits_shared": "share_expert_swiglu_limit_list"}
"""`BailingHybridConfig.attribute_map`: a name `transformers` also accepts → the name it stores."""

POSITIVE_INTS = ("head_dim", "short_conv_kernel_size", "layer_group_size")
BOOLS = ("kda_safe_gate",)
SWIGLU_LIMITS = ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list")
IGNORED_BY_TRANSFORMERS = {  # field of Ling's own configs: the only value accepted (what transformers computes)
    "rope_interleave": True, "no_kda_lora": True, "gated_attention_proj_granularity_type": "head_wise",
    "limit_after_act": True}


def _check(c: dict) -> None:
    """Ling's own fields; the shared ones are checked as Kimi Linear's."""
    _check_fields(c, POSITIVE_INTS, bools=BOOLS, finite=("kda_lower_bound",))
    kimi.refuse_ignored(c, IGNORED_BY_TRANSFORMERS, "bailing_hybrid")
    shared = c.get("moe_shared_expert_intermediate_size")
    if shared is not None and shared != c["moe_intermediate_size"] * c["num_shared_experts"]:
        _refuse("moe_shared_expert_intermediate_size", f"moe_intermediate_size × num_shared_experts "
                f"({c['moe_intermediate_size'] * c['num_shared_experts']}), the width transformers gives the "
                "shared experts", shared)
    if c["kda_safe_gate"] and c["kda_lower_bound"] >= 0:
        _refuse("kda_lower_bound", "negative with kda_safe_gate (the log decay's lower bound)", c["kda_lower_bound"])


def resolve(config: dict) -> dict:
    """The layout spec of a Ling config, in Kimi Linear's form (its `Body` builds it)."""
    c = kimi.canonical(config, ALIASES, DEFAULTS)
    if c["num_key_value_heads"] is None:
        c["num_key_value_heads"] = c["num_attention_heads"]
    _check(c)
    c.update(linear_num_heads=c["num_attention_heads"], linear_head_dim=c["head_dim"],
             linear_conv_kernel_dim=c["short_conv_kernel_size"])
    kimi._check(c)
    limits = swiglu_limits(c)
    if c["layer_types"] is None:
        every = c["layer_group_size"]
        c["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                            for i in range(c["num_hidden_layers"])]
    if not (_is_int(c["qk_rope_head_dim"]) and c["qk_rope_head_dim"] % 2 == 0):
        _refuse("qk_rope_head_dim", "an even integer (rotated in pairs)", c["qk_rope_head_dim"])
    _, theta = _rope(c, c["qk_rope_head_dim"], 1.0)
    mixers, ffns = kimi.layer_types(c), kimi.mlp_types(c)
    H, K = c["num_attention_heads"], c["head_dim"]
    spec = dict(
        family="bailing_hybrid", vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        eps=float(c["rms_norm_eps"]), tie_word_embeddings=False, max_position_embeddings=c["model_max_length"],
        layers=list(zip(mixers, ffns)),
        linear_attention=dict(num_heads=H, head_dim=K, conv_kernel=c["short_conv_kernel_size"],
                              eps=float(c["rms_norm_eps"]), low_rank_gates=False, a_log_shape=(H,),
                              lower_bound=float(c["kda_lower_bound"]) if c["kda_safe_gate"] else None),
        full_attention=dict(num_heads=H, q_lora_rank=c["q_lora_rank"], kv_lora_rank=c["kv_lora_rank"],
                            qk_nope_head_dim=c["qk_nope_head_dim"], qk_rope_head_dim=c["qk_rope_head_dim"],
                            v_head_dim=c["v_head_dim"], bias=bool(c["attention_bias"]), rotary="interleaved",
                            rope_theta=theta, output_gate=True),
        mlp=dict(width=c["intermediate_size"]),
        swiglu_limits=[pair if ffn == "sparse" else (None, None) for pair, ffn in zip(limits, ffns)])
    if "sparse" in ffns:
        spec["moe"] = kimi.moe_spec(c)
    return spec


def swiglu_limits(c: dict) -> list[tuple[float | None, float | None]]:
    """Each layer's `(routed, shared)` SwiGLU clipping limits, None where 0 or absent (no clipping)."""
    layers, columns = c["num_hidden_layers"], []
    for field in SWIGLU_LIMITS:
        limits = c[field]
        if limits is None:
            limits = [0] * layers
        if not (isinstance(limits, (list, tuple)) and len(limits) == layers
                and all(_is_number(limit) and limit >= 0 for limit in limits)):
            _refuse(field, f"null or a list of num_hidden_layers ({layers}) finite numbers ≥ 0 (0: no clipping)",
                    limits)
        columns.append([float(limit) if limit else None for limit in limits])
    return list(zip(*columns))


# ----------------------------------------------------------------------------------------------
# Checkpoint names
# ----------------------------------------------------------------------------------------------

HUB_NAMES = (  # (the Hub's, transformers' model's): renamed in this order when loading, reversed when saving
    (re.compile(r"^model\.word_embeddings\."), "model.embed_tokens."),
    (re.compile(r"\.attention\."), ".self_attn."),
    (re.compile(r"\.self_attn\.dense\."), ".self_attn.o_proj."),
    (re.compile(r"\.mlp\.gate\.expert_bias$"), ".mlp.gate.e_score_correction_bias"),
)
SAVED_NAMES = (
    (re.compile(r"\.self_attn\.o_proj\."), ".self_attn.dense."),
    (re.compile(r"\.self_attn\."), ".attention."),
    (re.compile(r"^model\.embed_tokens\."), "model.word_embeddings."),
    (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), ".mlp.gate.expert_bias"),
)
LAYER = re.compile(r"^model\.layers\.(\d+)\.")
MTP_PARTS = (".eh_proj.", ".enorm.", ".hnorm.")


def _mtp_layers(names) -> set[str]:
    """The `model.layers.{i}.` prefixes of multi-token-prediction layers (holding `MTP_PARTS`)."""
    return {match.group(0) for name in names if any(part in name for part in MTP_PARTS)
            if (match := LAYER.match(name))}


def loaded_names(weights: dict) -> dict:
    """A checkpoint's tensors (the Hub's, or `transformers`' model's) under this module tree's names."""
    mtp, renamed = _mtp_layers(weights), {}
    for name, value in weights.items():
        if (match := LAYER.match(name)) and match.group(0) in mtp:
            continue
        for pattern, replacement in HUB_NAMES:
            name = pattern.sub(replacement, name)
        renamed[kimi.forget_gate_names(name)] = value
    return stacked_experts(kimi.stack_convolutions(renamed))


def saved_names(weights: dict) -> dict:
    """The state dict under the Hub's names, as `transformers` 5.25 writes it."""
    out = {}
    for name, value in kimi.split_convolutions(per_expert(weights)).items():
        name = name.replace(".self_attn.forget_gate.", ".self_attn.")
        for pattern, replacement in SAVED_NAMES:
            name = pattern.sub(replacement, name)
        out[name] = value
    return out
