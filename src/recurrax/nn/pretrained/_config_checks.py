"""Checks of config.json's values, before a model is built from them.

A bad value is a `ValueError` naming the field, what it got and what is accepted, never a
`KeyError` or an error from deep inside the layers. Values that would build a model computing
NaN are refused here too: an attention window of 0, a `rope_theta` ≤ 0, a positive `clamp_min`
(a log-decay floor above 0), heads ≤ 0, a NaN `time_step_limit`. `check_config` checks fla's
configs, `check_hf_config` those of `transformers`' Mamba-2 family, with the same field
tables; `from_pretrained` adds the file's name.
"""

from __future__ import annotations

import json
import math
import numbers

POSITIVE_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings", "conv_size")
OPTIONAL_POSITIVE_INTS = ("num_heads", "num_kv_heads", "intermediate_size", "expand_ratio", "gate_low_rank_dim")
POSITIVE_NUMBERS = ("norm_eps", "expand_k", "expand_v")
OPTIONAL_POSITIVE_NUMBERS = ("hidden_ratio",)
BOOLS = ("tie_word_embeddings", "use_short_conv", "use_output_gate", "fuse_norm", "elementwise_affine",
         "use_lower_bound", "tie_feature_map_qk", "norm_q", "norm_k", "norm_feature_map")


class ConfigError(ValueError):
    """A config.json value that cannot build a working model."""


def read_json(file: str) -> dict:
    """A JSON object from `file` (UTF-8); anything else is a `ValueError` naming the file."""
    try:
        with open(file, encoding="utf-8") as f:
            value = json.load(f)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{file} is not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise ConfigError(f"{file} must hold a JSON object (field: value pairs), got a {type(value).__name__}")
    return value


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _refuse(field: str, accepted: str, value) -> None:
    raise ConfigError(f"config field {field!r} must be {accepted}, got {value!r}")


def _check_fields(config: dict, ints=(), optional_ints=(), numbers=(), optional_numbers=(), bools=(),
                  finite=()) -> None:
    """The fields of `config` listed in each table: positive integers, finite positive numbers
    (the `optional_` ones may be null), booleans, finite numbers. Absent fields are not checked."""
    for field in ints + optional_ints:
        value = config.get(field)
        if field in config and not (value is None and field in optional_ints):
            if not (_is_int(value) and value > 0):
                _refuse(field, "a positive integer" + (" or null" if field in optional_ints else ""), value)
    for field in numbers + optional_numbers:
        value = config.get(field)
        if field in config and not (value is None and field in optional_numbers):
            if not (_is_number(value) and value > 0):
                _refuse(field, "a finite positive number", value)
    for field in bools:
        if field in config and not isinstance(config[field], bool):
            _refuse(field, "true or false", config[field])
    for field in finite:
        if field in config and not _is_number(config[field]):
            _refuse(field, "a finite number", config[field])


def check_config(config: dict) -> None:
    """Refuse values of the (default-filled) `config` that are of the wrong kind or make NaN.

    **Arguments:** `config`: config.json as a dict with fla's defaults filled in.
    """
    _check_fields(config, POSITIVE_INTS, OPTIONAL_POSITIVE_INTS, POSITIVE_NUMBERS, OPTIONAL_POSITIVE_NUMBERS, BOOLS)
    clamp_min = config.get("clamp_min")
    if clamp_min is not None and not (_is_number(clamp_min) and clamp_min <= 0):
        _refuse("clamp_min", "null or a finite number ≤ 0 (a floor of the log decays; > 0 makes them grow)",
                clamp_min)
    _check_attn(config)


def _check_attn(config: dict) -> None:
    """`attn`: null, or one or a list of `{layers, num_heads, ...}` for fla's softmax attention."""
    specs = config.get("attn")
    if specs is None:
        return
    if isinstance(specs, dict):
        specs = [specs]
    if not isinstance(specs, list) or not all(isinstance(spec, dict) for spec in specs):
        _refuse("attn", "null, an object or a list of objects", specs)
    layers = config.get("num_hidden_layers")
    for spec in specs:
        field = lambda name: f"attn.{name}"  # noqa: E731
        listed = spec.get("layers")
        if not isinstance(listed, list) or not all(_is_int(l) and 0 <= l < layers for l in listed):
            _refuse(field("layers"), f"a list of layer indices in [0, {layers})", listed)
        heads = spec.get("num_heads")
        if not (_is_int(heads) and heads > 0):
            _refuse(field("num_heads"), "a positive integer", heads)
        kv_heads = spec.get("num_kv_heads")
        if kv_heads is not None and not (_is_int(kv_heads) and kv_heads > 0 and heads % kv_heads == 0):
            _refuse(field("num_kv_heads"), f"null or a positive divisor of num_heads ({heads})", kv_heads)
        if config["hidden_size"] % heads:
            _refuse(field("num_heads"), f"a divisor of hidden_size ({config['hidden_size']})", heads)
        window = spec.get("window_size")
        if window is not None and not (_is_int(window) and window > 0):
            _refuse(field("window_size"), "null or a positive integer (0 sees no token: NaN)", window)
        theta = spec.get("rope_theta", 10000.0)
        if not (_is_number(theta) and theta > 0):
            _refuse(field("rope_theta"), "a finite positive number (≤ 0 makes NaN rotations)", theta)
        if not isinstance(spec.get("qkv_bias", False), bool):
            _refuse(field("qkv_bias"), "true or false", spec.get("qkv_bias"))


def eos_token_ids(value, field: str) -> tuple[int, ...]:
    """`eos_token_id` (null, a token id or a list of them) as a tuple of ids."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(_is_int(token) and token >= 0 for token in ids):
        _refuse(field, "null, a token id (an integer ≥ 0) or a list of them", value)
    return tuple(ids)


HF_POSITIVE_INTS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings", "num_heads", "state_size",
    "n_groups", "conv_kernel", "num_attention_heads", "mamba_num_heads", "mamba_head_dim", "ssm_state_size",
    "mamba_n_heads", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "n_mamba_heads", "mamba_ngroups",
    "num_mem_blocks", "adapter_rank", "n_routed_experts", "moe_intermediate_size",
    "moe_shared_expert_intermediate_size", "shared_intermediate_size", "num_experts_per_tok", "n_group",
    "topk_group")
HF_OPTIONAL_POSITIVE_INTS = ("head_dim", "num_key_value_heads", "intermediate_size", "mamba_d_ssm", "moe_latent_size")
HF_POSITIVE_NUMBERS = ("layer_norm_epsilon", "rms_norm_eps", "expand", "mamba_expand", "logits_scaling")
HF_FINITE_NUMBERS = (
    "embedding_multiplier", "residual_multiplier", "attention_multiplier", "lm_head_multiplier", "key_multiplier",
    "attention_in_multiplier", "attention_out_multiplier", "ssm_in_multiplier", "ssm_out_multiplier",
    "routed_scaling_factor")
HF_BOOLS = (
    "tie_word_embeddings", "residual_in_fp32", "use_bias", "use_conv_bias", "mlp_bias", "attention_bias",
    "mamba_conv_bias", "mamba_proj_bias", "mamba_norm_before_gate", "mamba_rms_norm", "projectors_bias",
    "add_bias_linear", "use_shared_attention_adapter", "use_mem_rope", "use_long_context", "norm_topk_prob")
FALCON_MULTIPLIERS = {"mlp_multipliers": 2, "ssm_multipliers": 5}
"""Falcon-H1's lists of multipliers and their lengths."""
NEMOTRON_LETTERS = "M*-E"
"""The layer letters of Nemotron-H's `hybrid_override_pattern` (Mamba, attention, MLP, MoE)."""


def check_hf_config(config: dict) -> None:
    """Refuse values of a `transformers` Mamba-2 family config (defaults filled in, Nemotron-H's
    aliases renamed) that are of the wrong kind or would divide by zero or make NaN.

    **Arguments:** `config`: config.json as a dict with `transformers`' defaults filled in.
    """
    _check_fields(config, HF_POSITIVE_INTS, HF_OPTIONAL_POSITIVE_INTS, HF_POSITIVE_NUMBERS, (), HF_BOOLS,
                  HF_FINITE_NUMBERS)
    head = config.get("mamba_d_head", "auto")
    if head != "auto" and not (_is_int(head) and head > 0):
        _refuse("mamba_d_head", '"auto" or a positive integer', head)
    experts = config.get("num_local_experts")
    if experts is not None and not (_is_int(experts) and experts >= 0):
        _refuse("num_local_experts", "an integer ≥ 0 (0: a dense MLP)", experts)
    routed = config.get("n_routed_experts") or experts
    if routed and config.get("num_experts_per_tok", 1) > routed:
        _refuse("num_experts_per_tok", f"at most the number of experts ({routed})", config["num_experts_per_tok"])
    step_min = config.get("time_step_min")
    if config.get("model_type") == "zamba2" and not (_is_number(step_min) and step_min >= 0):
        _refuse("time_step_min", "a finite number ≥ 0 (Zamba2's floor of dt)", step_min)
    _check_time_step_limit(config.get("time_step_limit"))
    for field, length in FALCON_MULTIPLIERS.items():
        value = config.get(field)
        if value is not None and not (isinstance(value, (list, tuple)) and len(value) == length
                                      and all(_is_number(m) for m in value)):
            _refuse(field, f"null or a list of {length} finite numbers", value)
    _check_layer_lists(config)


def _check_time_step_limit(limit) -> None:
    """null, or `[low, high]` with 0 ≤ low ≤ high (high may be Infinity)."""
    pair = isinstance(limit, (list, tuple)) and len(limit) == 2
    numbers_ = pair and all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in limit)
    if limit is not None and not (numbers_ and math.isfinite(limit[0]) and 0 <= limit[0] <= limit[1]):
        _refuse("time_step_limit", "null or [low, high] with 0 ≤ low ≤ high (high may be Infinity)", limit)


def _check_layer_lists(config: dict) -> None:
    """Nemotron-H's `hybrid_override_pattern` letters and Bamba's `attn_layer_indices`."""
    pattern = config.get("hybrid_override_pattern")
    if pattern is not None and config.get("layers_block_type") is None:
        if not (isinstance(pattern, str) and pattern and set(pattern) <= set(NEMOTRON_LETTERS)):
            _refuse("hybrid_override_pattern", f"a string of the layer letters {' '.join(NEMOTRON_LETTERS)} "
                    "(Mamba, attention, MLP, MoE)", pattern)
    indices, layers = config.get("attn_layer_indices"), config.get("num_hidden_layers")
    if indices is not None and not (isinstance(indices, list) and all(_is_int(i) and 0 <= i < layers
                                                                      for i in indices)):
        _refuse("attn_layer_indices", f"null or a list of layer indices in [0, {layers})", indices)


def check_rope_theta(theta) -> None:
    """A rotary embedding's `rope_theta`: a finite positive number (≤ 0 makes NaN rotations)."""
    if not (_is_number(theta) and theta > 0):
        _refuse("rope_theta", "a finite positive number (≤ 0 makes NaN rotations)", theta)


def decode_floats(value):
    """`transformers` 5's `{"__float__": "Infinity"}` (and -Infinity, NaN) as floats, anywhere in a config."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"].replace("Infinity", "inf"))
        return {k: decode_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_floats(v) for v in value]
    return value


def rope_parameters(c: dict) -> dict:
    """`c["rope_parameters"]`: null (as {}) or an object; a ConfigError naming it otherwise."""
    params = c.get("rope_parameters") or {}
    if not isinstance(params, dict):
        _refuse("rope_parameters", "null or an object (rope_theta, rope_type, partial_rotary_factor, ...)", params)
    return params


def _rope(c: dict, head_dim: int, factor: float | None = None) -> tuple[int, float]:
    """(rotated channels per head, θ) from `rope_parameters` or the older top-level keys."""
    params = rope_parameters(c)
    if params.get("rope_type", "default") != "default" or c.get("rope_scaling"):
        raise NotImplementedError(f"only the default rotary embedding is supported, got {params or c['rope_scaling']}")
    theta = params.get("rope_theta", c.get("rope_theta", 10000.0))
    check_rope_theta(theta)
    if factor is None:
        factor = params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    return int(head_dim * factor), float(theta)


def check_layer_types(config: dict, supported: tuple[str, ...]) -> None:
    """`config["layer_types"]`: null, or a list of one of `supported` per layer
    (`num_hidden_layers`). A wrong type or length is refused by field (ConfigError), a name not
    in `supported` by name (NotImplementedError)."""
    types = config["layer_types"]
    if types is None:
        return
    if not isinstance(types, list) or len(types) != config["num_hidden_layers"]:
        _refuse("layer_types", f"null or a list of {config['num_hidden_layers']} layer types", types)
    unknown = sorted(set(types) - set(supported))
    if unknown:
        raise NotImplementedError(f"unsupported layer types {unknown} in a {config['model_type']!r} config "
                                  f"(supported: {', '.join(supported)})")
