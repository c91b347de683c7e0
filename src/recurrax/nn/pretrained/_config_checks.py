"""Checks of config.json's values, before a model is built from them.

A bad value is a `ValueError` (a wrong type a `TypeError`) naming the field, what it got and
what is accepted, never a `KeyError` or an error from deep inside the layers. Values that
would build a model computing NaN are refused here too: an attention window of 0, a
`rope_theta` ≤ 0, a positive `clamp_min` (a log-decay floor above 0), heads ≤ 0.
`from_pretrained` adds the file's name.
"""

from __future__ import annotations

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


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _refuse(field: str, accepted: str, value) -> None:
    raise ConfigError(f"config field {field!r} must be {accepted}, got {value!r}")


def check_config(config: dict) -> None:
    """Refuse values of the (default-filled) `config` that are of the wrong kind or make NaN.

    **Arguments:** `config`: config.json as a dict with fla's defaults filled in.
    """
    for field in POSITIVE_INTS + OPTIONAL_POSITIVE_INTS:
        value = config.get(field)
        if field in config and not (value is None and field in OPTIONAL_POSITIVE_INTS):
            if not (_is_int(value) and value > 0):
                _refuse(field, "a positive integer" + (" or null" if field in OPTIONAL_POSITIVE_INTS else ""), value)
    for field in POSITIVE_NUMBERS + OPTIONAL_POSITIVE_NUMBERS:
        value = config.get(field)
        if field in config and not (value is None and field in OPTIONAL_POSITIVE_NUMBERS):
            if not (_is_number(value) and value > 0):
                _refuse(field, "a finite positive number", value)
    for field in BOOLS:
        if field in config and not isinstance(config[field], bool):
            _refuse(field, "true or false", config[field])
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
