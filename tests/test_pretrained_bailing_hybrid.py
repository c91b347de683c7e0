"""Ling (`recurrax.nn.pretrained._bailing_hybrid`, on Kimi Linear's blocks and the shared `_kda`
and `_mla`) against `transformers` 5.25.

Every fixture's logits are checked in test_pretrained_transformers.py (and there, with
`-m ""`, each fixture's decode, packing, `generate` and saving). Here, in the default tier, on
`bailing_hybrid_safe_gate_groups` (KDA with the bounded gate, MLA with interleaved rotary and
its per-head output gate, a group-limited sigmoid MoE, a dense first layer; the Hub's config
spellings), through that file's compiled functions plus one packed prefill: a packed prefill
then decoding equals the parallel forward (and `transformers`), greedy tokens through that
cache equal `transformers`' own, `save_pretrained` writes the Hub's names and values. Without
compiling the model: `transformers`' model state dict loads the same, multi-token-prediction
layers are dropped, MLA's cache holds the latent, the layer pattern reads as `transformers`
reads it, unsupported options are refused by name, every parameter has logical axis names.
On `bailing_hybrid_swiglu_limits` (SwiGLU clipping nonzero in some layers, zero in others): the
packed prefill and decoding as above, `transformers`' logits with each limit exercised, and the
clipped MoE layers against an independent float64 computation.

Error metric: max |ours − reference| / max |reference|.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax", reason="recurrax.nn.pretrained needs flax")
pytest.importorskip("safetensors", reason="checkpoints need safetensors (pip install 'recurrax[pretrained]')")

from _pretrained import (CAPACITY, check_greedy_tokens_through_the_cache, check_logical_axis_names,  # noqa: E402
                         check_packed_prefill_then_decoding, check_saved_as_transformers_writes, config_of)
from safetensors.numpy import load_file, save_file  # noqa: E402
from _cases import max_rel_error  # noqa: E402
from test_pretrained_transformers import FIXTURES, NAMES, TOLERANCE, _rewritten, loaded  # noqa: E402

from recurrax.nn.pretrained import CausalLM, from_pretrained, state_dict  # noqa: E402
from recurrax.nn.pretrained.families._bailing_hybrid import resolve  # noqa: E402
from recurrax.nn.pretrained.layers._mla import MLACache  # noqa: E402

LING = [name for name in NAMES if name.startswith("bailing_hybrid")]
MAIN = "bailing_hybrid_safe_gate_groups"
CLIPPED = "bailing_hybrid_swiglu_limits"
needs_fixture = pytest.mark.skipif(MAIN not in NAMES, reason=f"no fixture {MAIN} in tests/fixtures/transformers")
needs_clipped = pytest.mark.skipif(CLIPPED not in NAMES, reason=f"no fixture {CLIPPED} in tests/fixtures/transformers")


@pytest.mark.parametrize("name", [pytest.param(MAIN, marks=needs_fixture), pytest.param(CLIPPED, marks=needs_clipped)])
def test_packed_prefill_then_one_token_at_a_time_equals_the_parallel_forward(name):
    """Both rows' first 5 tokens packed into one cache (the conv buffer, the KDA state, the
    latents and the rotated rope keys cut at the sequence boundary), then one token at a time:
    the parallel logits within `floor_tolerance` of their float32-vs-float64 error, and
    `transformers`' logits."""
    check_packed_prefill_then_decoding(name)


@needs_fixture
def test_greedy_tokens_through_the_cache_equal_transformers():
    """Both prompts in one cache (rows of 5 and 9 tokens, one token per step): `transformers`'
    greedy continuations."""
    check_greedy_tokens_through_the_cache(MAIN)


@needs_fixture
def test_save_pretrained_writes_the_hub_names_and_reads_back(tmp_path):
    """`model.word_embeddings`, `attention.dense`, the forget gate and three convolutions under
    `attention.`, `mlp.gate.expert_bias`, each expert's matrices: what `transformers` writes
    (`make_fixtures.py --check-saved` reads such a directory with `transformers` itself)."""
    check_saved_as_transformers_writes(MAIN, tmp_path, {
        "model.word_embeddings.weight", "model.layers.1.attention.dense.weight", "model.layers.0.attention.A_log",
        "model.layers.1.mlp.gate.expert_bias", "model.layers.2.mlp.experts.7.up_proj.weight"})


def _model_state_dict(weights: dict) -> dict:
    """`transformers`' model state dict: its own names, fused experts, one stacked convolution."""
    out, E = {}, 8
    for name, value in weights.items():
        if ".experts." in name or "_conv1d" in name:
            continue
        name = name.replace("model.word_embeddings.", "model.embed_tokens.").replace(".attention.", ".self_attn.")
        name = name.replace(".self_attn.dense.", ".self_attn.o_proj.").replace("expert_bias", "e_score_correction_bias")
        for part in ("f_proj.", "dt_bias", "A_log"):
            name = name.replace(f".self_attn.{part}", f".self_attn.forget_gate.{part}")
        out[name] = value
    for layer in (0, 2):
        out[f"model.layers.{layer}.self_attn.conv1d.weight"] = np.concatenate(
            [weights[f"model.layers.{layer}.attention.{c}_conv1d.weight"] for c in "qkv"])
    for layer in (1, 2, 3):
        expert = lambda e, p: weights[f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight"]  # noqa: E731
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([expert(e, "gate"), expert(e, "up")]) for e in range(E)])
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = np.stack([expert(e, "down") for e in range(E)])
    return out


@needs_fixture
def test_transformers_model_state_dict_and_a_multi_token_prediction_layer_load_the_same(tmp_path):
    """`transformers`' model names (fused experts, the forget gate module, one convolution) load
    as the Hub's do; a multi-token-prediction layer stored after the decoder is dropped."""
    weights = load_file(FIXTURES / MAIN / "model.safetensors")
    renamed = _model_state_dict(weights)
    renamed.update({"model.layers.4.eh_proj.weight": np.ones((32, 64), np.float32),
                    "model.layers.4.enorm.weight": np.ones((32,), np.float32),
                    "model.layers.4.mlp.gate_proj.weight": np.ones((40, 32), np.float32)})
    folder = _rewritten(MAIN, tmp_path)
    save_file(renamed, folder / "model.safetensors")
    saved = state_dict(from_pretrained(folder))
    assert sorted(saved) == sorted(weights)
    assert all(np.array_equal(saved[k], weights[k]) for k in weights)


@needs_fixture
def test_the_latent_attention_cache_holds_the_latent_and_the_rotated_rope_key():
    fixture = loaded(MAIN)
    caches = fixture.model.init_cache(2, CAPACITY).layers
    config = config_of(MAIN)
    assert [type(c) is MLACache for c in caches] == [False, True, False, True]
    assert caches[1].latent.shape == (2, CAPACITY, config["kv_lora_rank"])
    assert caches[1].rope_key.shape == (2, CAPACITY, config["qk_rope_head_dim"])


def test_the_layer_pattern_and_transformers_spellings_read_the_same():
    """`layer_group_size` and `first_k_dense_replace` instead of the listed types; `transformers`'
    attribute names instead of the stored ones; a top-level `rope_theta` instead of `rope_parameters`."""
    config = config_of(MAIN)
    renamed = dict(num_experts="num_local_experts", num_experts_per_token="num_experts_per_tok",
                   num_expert_group="n_group", num_shared_experts="n_shared_experts",
                   moe_renormalize="norm_topk_prob", model_max_length="max_position_embeddings")
    other = {renamed.get(k, k): v for k, v in config.items()
             if k not in ("layer_types", "mlp_layer_types", "rope_parameters")}
    assert resolve(other) == resolve(config)
    spec = resolve(config)
    assert spec["layers"] == [("linear_attention", "dense"), ("full_attention", "sparse"),
                              ("linear_attention", "sparse"), ("full_attention", "sparse")]
    assert spec["full_attention"]["rope_theta"] == 500.0 and spec["linear_attention"]["lower_bound"] == -5.0


# --------------------------------------------------------------------------- SwiGLU clipping

CLIPPED_LIMITS = {"experts": [0.5, 0, 0.8, 1.2], "shared_experts": [0.7, 0.6, 0, 1.0]}
"""The fixture's `expert_swiglu_limit_list` and `share_expert_swiglu_limit_list` (layer 0 is dense)."""


def _clipped_logits_error(edit) -> float:
    """The clipped fixture's logits (a fresh model, `edit`ed, run eagerly) against `transformers`'."""
    model = from_pretrained(FIXTURES / CLIPPED)
    edit(model.model.layers)
    expected = np.load(FIXTURES / CLIPPED / "expected.npz")
    return max_rel_error(model(jnp.asarray(expected["input_ids"])), expected["logits"])


@needs_clipped
def test_swiglu_limits_match_transformers_and_each_one_moves_the_logits():
    """Per layer, routed and shared apart, zero disabling: `transformers`' logits (its clipping
    moves them by up to 3.1, summary.json). Each nonzero limit of a MoE layer lifted alone moves
    ours far from them, and so would the dense layer's limits if applied (`transformers` ignores
    them): every limit of the fixture is exercised."""
    config = config_of(CLIPPED)
    assert resolve(config)["swiglu_limits"] == [(None, None), (None, 0.6), (0.8, None), (1.2, 1.0)]
    spelled = {{"expert_swiglu_limit_list": "swiglu_limits", "share_expert_swiglu_limit_list": "swiglu_limits_shared"}
               .get(k, k): v for k, v in config.items()}  # transformers' attribute names
    assert resolve(spelled) == resolve(config)
    assert _clipped_logits_error(lambda layers: None) < TOLERANCE

    def lifted(layer, part):
        return lambda layers: setattr(getattr(layers[layer].mlp, part), "limit", None)

    for part, limits in CLIPPED_LIMITS.items():
        for layer in [i for i, limit in enumerate(limits) if limit and i > 0]:
            assert _clipped_logits_error(lifted(layer, part)) > 100 * TOLERANCE, (layer, part)
    assert _clipped_logits_error(lambda layers: setattr(layers[0].mlp, "limit", 0.5)) > 100 * TOLERANCE


def _swiglu_float64(x, weights: dict, prefix: str, limit: float) -> np.ndarray:
    """`W_down(min(silu(x W_gate), L) ⊙ clip(x W_up, −L, L))` in numpy float64 (L = 0: unclipped)."""
    matrix = lambda proj: np.asarray(weights[f"{prefix}.{proj}_proj.weight"], np.float64)  # noqa: E731
    gate, up = x @ matrix("gate").T, x @ matrix("up").T
    activated = gate / (1 + np.exp(-gate))
    if limit:
        activated, up = np.minimum(activated, limit), np.clip(up, -limit, limit)
    return (activated * up) @ matrix("down").T


@needs_clipped
@pytest.mark.parametrize("layer", [1, 2, 3])
def test_clipped_moe_layer_equals_an_independent_float64_computation(layer):
    """The float64 model's MoE layer, routed and every-expert paths: the shared expert plus each
    token's routed experts weighted by its routing, each SwiGLU clipped by the config's limits,
    computed in numpy from the checkpoint (the routing taken from the layer's own router)."""
    weights = load_file(FIXTURES / CLIPPED / "model.safetensors")
    moe = from_pretrained(FIXTURES / CLIPPED, dtype=jnp.float64).model.layers[layer].mlp
    x = np.asarray(jax.random.normal(jax.random.key(layer), (2, 7, 32), jnp.float64))
    flat, mlp = x.reshape(-1, 32), f"model.layers.{layer}.mlp"
    routing = moe.gate(jnp.asarray(flat))
    expected = _swiglu_float64(flat, weights, f"{mlp}.shared_experts", CLIPPED_LIMITS["shared_experts"][layer])
    for t, (experts, gains) in enumerate(zip(np.asarray(routing.experts), np.asarray(routing.weights))):
        for e, gain in zip(experts, gains):
            expected[t] += gain * _swiglu_float64(flat[t], weights, f"{mlp}.experts.{e}",
                                                  CLIPPED_LIMITS["experts"][layer])
    for every in (False, True):
        assert max_rel_error(moe(jnp.asarray(x), all_experts=every).reshape(-1, 32), expected) < 1e-12, every


@pytest.mark.parametrize("edit, error, words", [
    (dict(hidden_act="gelu"), NotImplementedError, "hidden_act"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)), NotImplementedError, "rotary"),
    (dict(expert_swiglu_limit_list=[0, 7.0, 7.0]), ValueError,
     r"'expert_swiglu_limit_list' must be null or a list of num_hidden_layers \(4\) finite numbers ≥ 0"),
    (dict(share_expert_swiglu_limit_list=[0, 0, -1.0, 7.0]), ValueError, "'share_expert_swiglu_limit_list' must"),
    (dict(expert_swiglu_limit_list=[0, 0, float("nan"), 7.0]), ValueError, "'expert_swiglu_limit_list' must"),
    (dict(limit_after_act=False), NotImplementedError, "'limit_after_act'"),
    (dict(rope_interleave=False), NotImplementedError, "'rope_interleave'"),
    (dict(no_kda_lora=False), NotImplementedError, "'no_kda_lora'"),
    (dict(gated_attention_proj_granularity_type="element_wise"), NotImplementedError,
     "'gated_attention_proj_granularity_type'"),
    (dict(moe_shared_expert_intermediate_size=24), ValueError, "'moe_shared_expert_intermediate_size'"),
    (dict(kda_lower_bound=0.5), ValueError, "'kda_lower_bound' must be negative"),
    (dict(num_key_value_heads=1), ValueError, "'num_key_value_heads' must be num_attention_heads"),
    (dict(qk_rope_head_dim=5), ValueError, "'qk_rope_head_dim' must be an even integer"),
    (dict(short_conv_kernel_size=1), ValueError, "'short_conv_kernel_size' must be at least 2"),
    (dict(num_expert_group=3), ValueError, "'num_expert_group' must be a divisor"),
    (dict(rope_parameters="x"), ValueError, "'rope_parameters' must be null or an object"),  # was AttributeError
])
def test_unsupported_and_bad_options_are_refused_by_name(edit, error, words):
    with pytest.raises(error, match=words):
        CausalLM({**config_of(MAIN), **edit})


@pytest.mark.parametrize("name", LING)
def test_every_parameter_has_logical_axis_names(name):
    check_logical_axis_names(name)
