"""OLMo-Hybrid (`recurrax.nn.pretrained.families._olmo_hybrid`) against `transformers` 5.25.

Every fixture's logits are checked with the other `transformers` families in
test_pretrained_transformers.py, and there, with `-m ""`, each fixture's decode, packing,
`generate` and saving too. Here, in the default tier, on OLMo-Hybrid with grouped value heads
(G = 2, K ≠ V), β in [0, 2] (negative eigenvalues allowed) and a post-norm attention layer with
grouped heads, through that file's compiled forward plus one packed prefill and one decode step:
a packed prefill then decoding equals the parallel forward (and `transformers`), greedy tokens
through that cache equal `transformers`' own, and `save_pretrained` writes `transformers`' names
and values. Without compiling the model: the Hub's checkpoint layout (q/k/v convolutions at their
own sizes, `mtp.*`) and the model's own names load the same parameters, the derived defaults of
absent or null config fields read as `transformers` derives them, unsupported options are
refused by name, and every parameter has logical axis names.

Error metric: max |ours − reference| / max |reference|.
"""

from __future__ import annotations


import numpy as np
import pytest

pytest.importorskip("flax", reason="recurrax.nn.pretrained needs flax")
pytest.importorskip("safetensors", reason="checkpoints need safetensors (pip install 'recurrax[pretrained]')")

import jax  # noqa: E402
from _pretrained import (check_greedy_tokens_through_the_cache, check_logical_axis_names,  # noqa: E402
                         check_packed_prefill_then_decoding, check_saved_as_transformers_writes, config_of)
from safetensors.numpy import load_file, save_file  # noqa: E402
from test_pretrained_transformers import FIXTURES, NAMES, _rewritten  # noqa: E402

from recurrax.nn.pretrained import CausalLM, from_pretrained, state_dict  # noqa: E402
from recurrax.nn.pretrained.families._olmo_hybrid import resolve  # noqa: E402

OLMO = [name for name in NAMES if name.startswith("olmo_hybrid")]
MAIN = "olmo_hybrid_grouped_negeig"
DERIVED = "olmo_hybrid_nope_derived_dims_bias_tied"
needs_fixture = pytest.mark.skipif(MAIN not in NAMES, reason=f"no fixture {MAIN} in tests/fixtures/transformers")



@needs_fixture
def test_packed_prefill_then_one_token_at_a_time_equals_the_parallel_forward():
    """Both rows' first 5 tokens packed into one cache (the conv buffer, the delta-rule state and
    the keys cut at the sequence boundary), then one token at a time: the parallel logits within
    `floor_tolerance` of their float32-vs-float64 error, and `transformers`' logits."""
    check_packed_prefill_then_decoding(MAIN)


@needs_fixture
def test_greedy_tokens_through_the_cache_equal_transformers():
    """Both prompts in one cache (rows of 5 and 9 tokens, one token per step), each row's next
    token its argmax once its prompt is in: `transformers`' greedy continuations."""
    check_greedy_tokens_through_the_cache(MAIN)


@needs_fixture
def test_save_pretrained_writes_transformers_names_and_reads_back(tmp_path):
    """The norms as `attention_layer_norm` / `feedforward_layer_norm` and the convolution cut as
    `transformers` 5.25 cuts it; `make_fixtures.py --check-saved` reads such a directory with
    `transformers` itself."""
    check_saved_as_transformers_writes(MAIN, tmp_path, {"model.layers.0.attention_layer_norm.weight",
                                                         "model.layers.0.linear_attn.q_conv1d.weight"})


def _fused_convolutions(weights: dict) -> dict:
    """Each layer's three convolution pieces concatenated (q, k, v order): `[2·Hk·K + H·V, 1, W]`."""
    layers = {name.rsplit(".", 2)[0] for name in weights if name.endswith(".q_conv1d.weight")}
    return {layer: np.concatenate([weights[f"{layer}.{p}_conv1d.weight"] for p in "qkv"]) for layer in layers}


@pytest.mark.parametrize("name", OLMO)
def test_the_hubs_layout_and_the_models_own_names_load_the_same_parameters(name, tmp_path):
    """Three checkpoints of one model: as `transformers` 5.25 saves it (the fixture: the fused
    convolution cut in three near-equal parts), as the Hub publishes it (q, k and v each at their
    own channels, plus `mtp.*`), and as `transformers`' model holds it (`conv1d`,
    `input_layernorm`, `post_attention_layernorm`): the same parameters."""
    weights = load_file(FIXTURES / name / "model.safetensors")
    spec = resolve(config_of(name))["linear_attention"]
    qk, v = spec["num_k_heads"] * spec["head_k_dim"], spec["num_v_heads"] * spec["head_v_dim"]
    fused = _fused_convolutions(weights)
    assert all(w.shape[0] == 2 * qk + v for w in fused.values())
    hub = {k: w for k, w in weights.items() if "_conv1d." not in k} | {"mtp.fc.weight": np.ones((4, 4), np.float32)}
    own = {k.replace(".attention_layer_norm.", ".input_layernorm.")
           .replace(".feedforward_layer_norm.", ".post_attention_layernorm."): w
           for k, w in weights.items() if "_conv1d." not in k}
    for layer, w in fused.items():
        hub.update({f"{layer}.{p}_conv1d.weight": piece for p, piece in zip("qkv", np.split(w, [qk, 2 * qk]))})
        own[f"{layer}.conv1d.weight"] = w
    if name == MAIN:  # the near-equal cut differs from the Hub's here (V·H ≠ K·Hk)
        assert weights["model.layers.0.linear_attn.q_conv1d.weight"].shape != hub[
            "model.layers.0.linear_attn.q_conv1d.weight"].shape
    for layout, tensors in (("hub", hub), ("own", own)):
        folder = _rewritten(name, tmp_path / layout)
        save_file(tensors, folder / "model.safetensors")
        saved = state_dict(from_pretrained(folder))
        assert sorted(saved) == sorted(weights), layout
        assert all(np.array_equal(saved[k], weights[k]) for k in weights), layout


@needs_fixture
def test_beta_reaches_past_one_only_with_negative_eigenvalues_allowed():
    """`linear_allow_neg_eigval`: β = 2 · sigmoid(x W_b) (up to 2), else sigmoid (below 1)."""
    x = jax.random.normal(jax.random.key(0), (1, 6, 32)) * 8
    for name, allowed in ((MAIN, True), (DERIVED, False)):
        layer = next(layer.linear_attn for layer in from_pretrained(FIXTURES / name).body.layers
                     if hasattr(layer, "linear_attn"))
        beta, _ = layer._gates(x)
        assert (float(beta.max()) > 1.0) == allowed and float(beta.max()) < 2.0, (name, float(beta.max()))


def test_absent_or_null_fields_are_derived_as_transformers_derives_them():
    """Null head counts and dims (`OlmoHybridConfig`'s defaults), an absent `layer_types`, and
    `rope_theta: null` (no rotary embedding) against an absent `rope_parameters` (the default one)."""
    config = config_of(DERIVED)
    derived = {k: v for k, v in config.items() if k not in ("linear_key_head_dim", "linear_value_head_dim")}
    derived.update(linear_num_key_heads=None, linear_num_value_heads=None)
    assert resolve(derived) == resolve(config)
    spec = resolve(config)
    assert spec["full_attention"] == dict(num_heads=2, num_kv_heads=1, head_dim=16, bias=True, rotary_dim=0,
                                          rope_theta=0.0, eps=1e-5)  # rope_theta null: NoPE
    assert spec["linear_attention"] == dict(num_k_heads=2, num_v_heads=2, head_k_dim=12, head_v_dim=24,
                                            conv_kernel=3, allow_neg_eigval=False)
    plain = {k: v for k, v in config_of(MAIN).items() if k != "layer_types"}
    assert resolve(plain)["layers"] == ["linear_attention"] * 3 + ["full_attention"]
    assert resolve({**plain, "num_hidden_layers": 2})["layers"] == ["linear_attention", "full_attention"]
    assert resolve({k: v for k, v in plain.items() if k != "rope_parameters"})["full_attention"][
        "rotary_dim"] == 8 == resolve(plain)["full_attention"]["rotary_dim"]


@pytest.mark.parametrize("edit, error, words", [
    (dict(hidden_act="gelu"), NotImplementedError, "hidden_act"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)), NotImplementedError, "rotary"),
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
     NotImplementedError, "sliding_attention"),
    (dict(layer_types=["linear_attention"] * 4), ValueError, "'layer_types' must be a list with both"),
    (dict(layer_types=["linear_attention"]), ValueError, "'layer_types' must be null or a list of 4"),
    (dict(linear_num_value_heads=3), ValueError, "'linear_num_value_heads' must be a multiple"),
    (dict(num_key_value_heads=3), ValueError, "'num_attention_heads' must be a multiple"),
    (dict(num_attention_heads=5, num_key_value_heads=5), ValueError, "'num_attention_heads' must be a divisor"),
    (dict(linear_conv_kernel_dim=1), ValueError, "'linear_conv_kernel_dim' must be at least 2"),
    (dict(linear_allow_neg_eigval="true"), ValueError, "'linear_allow_neg_eigval' must be true or false"),
    (dict(linear_key_head_dim=0), ValueError, "'linear_key_head_dim' must be a positive integer or null"),
    (dict(rms_norm_eps=0), ValueError, "'rms_norm_eps'"),
])
def test_unsupported_and_bad_options_are_refused_by_name(edit, error, words):
    with pytest.raises(error, match=words):
        CausalLM({**config_of(MAIN), **edit})


@pytest.mark.parametrize("name", OLMO)
def test_every_parameter_has_logical_axis_names(name):
    check_logical_axis_names(name)
