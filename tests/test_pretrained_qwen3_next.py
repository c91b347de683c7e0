"""Qwen3-Next and Qwen3.5 (`recurrax.nn.pretrained.families._qwen3_next`) against `transformers` 5.25.

Every fixture's logits are checked with the other `transformers` families in
test_pretrained_transformers.py, and there, with `-m ""`, each fixture's decode, packing,
`generate` and saving too. Here, in the default tier, on Qwen3-Next with grouped value heads
(G = 2, K ≠ V), a MoE with a shared expert in three of its four layers and gated attention with
partial rotary, through that file's compiled forward plus one packed prefill and one decode
step: a packed prefill then decoding equals the parallel forward (and `transformers`), greedy
tokens through that cache equal `transformers`' own, and `save_pretrained` writes
`transformers`' names and values. Without compiling the model: the routed experts
equal every expert masked by the routing, the fused expert tensors of `transformers`' models
load the same, the Hub's multimodal Qwen3.5 checkpoints load (and save) as their text model,
older config spellings read the same, unsupported options are refused by name,
and every parameter has logical axis names.

Error metric: max |ours − reference| / max |reference|.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("flax", reason="recurrax.nn.pretrained needs flax")
pytest.importorskip("safetensors", reason="checkpoints need safetensors (pip install 'recurrax[pretrained]')")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _cases import max_rel_error  # noqa: E402
from _pretrained import (check_greedy_tokens_through_the_cache, check_logical_axis_names,  # noqa: E402
                         check_packed_prefill_then_decoding, check_saved_as_transformers_writes, config_of)
from flax import nnx  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402
from test_pretrained_transformers import FIXTURES, NAMES, _rewritten  # noqa: E402

from recurrax.nn.pretrained import CausalLM, from_pretrained, save_pretrained, state_dict  # noqa: E402
from recurrax.nn.pretrained.families._qwen3_next import resolve  # noqa: E402

QWEN = [name for name in NAMES if name.startswith("qwen3") and "vlm" not in name]
MAIN = "qwen3_next_moe_grouped"
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
    """Each expert's matrices on their own, as `transformers` writes them; `make_fixtures.py
    --check-saved` reads such a directory with `transformers` itself."""
    check_saved_as_transformers_writes(MAIN, tmp_path, {"model.layers.0.mlp.experts.3.down_proj.weight"})


@needs_fixture
def test_fused_expert_tensors_and_mtp_weights_load_the_same(tmp_path):
    """`transformers`' models hold `mlp.experts.gate_up_proj [E, 2F, D]` and `down_proj [E, D, F]`
    (their state_dict); published checkpoints carry `mtp.*`, which the causal LM ignores."""
    weights = load_file(FIXTURES / MAIN / "model.safetensors")
    fused = {"mtp.fc.weight": np.ones((4, 4), np.float32)}
    for name, value in weights.items():
        if ".mlp.experts." not in name:
            fused[name] = value
        elif name.endswith(".0.down_proj.weight"):
            prefix = name[: -len(".0.down_proj.weight")]
            count = sum(1 for k in weights if k.startswith(prefix + ".") and k.endswith(".down_proj.weight"))
            expert = lambda e, proj: weights[f"{prefix}.{e}.{proj}.weight"]  # noqa: E731
            fused[prefix + ".gate_up_proj"] = np.stack(
                [np.concatenate([expert(e, "gate_proj"), expert(e, "up_proj")]) for e in range(count)])
            fused[prefix + ".down_proj"] = np.stack([expert(e, "down_proj") for e in range(count)])
    folder = _rewritten(MAIN, tmp_path)
    save_file(fused, folder / "model.safetensors")
    saved = state_dict(from_pretrained(folder))
    assert sorted(saved) == sorted(weights)
    assert all(np.array_equal(saved[k], weights[k]) for k in weights)


def test_a_multimodal_checkpoint_loads_and_saves_as_its_text_model(tmp_path):
    """The Hub's Qwen3.5 checkpoints (`Qwen3_5ForConditionalGeneration`): the text model from
    `text_config` and `model.language_model.*`, the vision tower left out; saved as the
    `Qwen3_5ForCausalLM` it is (`make_fixtures.py --check-saved` reads it with `transformers`)."""
    name = "qwen3_5_vlm_text_untied"
    weights = load_file(FIXTURES / name / "model.safetensors")
    save_pretrained(from_pretrained(FIXTURES / name), tmp_path)
    saved, config = load_file(tmp_path / "model.safetensors"), json.loads((tmp_path / "config.json").read_text())
    text = {k.replace("model.language_model.", "model."): v for k, v in weights.items()
            if not k.startswith("model.visual.")}
    assert any(k.startswith("model.visual.") for k in weights) and "lm_head.weight" in text
    assert sorted(saved) == sorted(text) and all(np.array_equal(saved[k], text[k]) for k in text)
    assert config == config_of(name)["text_config"] | {"tie_word_embeddings": False, "dtype": "float32",
                                                      "architectures": ["Qwen3_5ForCausalLM"]}
    assert config["model_type"] == "qwen3_5_text"


@needs_fixture
def test_routed_experts_equal_every_expert_masked_by_the_routing():
    """Only the routed (token, expert) pairs computed; the same sum as every expert on every
    token weighted by the routing (float64, so the two orders of summation agree to 1e-12)."""
    graphdef, params = nnx.split(from_pretrained(FIXTURES / MAIN, dtype=jnp.float64).model.layers[0].mlp)
    moe = jax.jit(lambda params, x, every: nnx.merge(graphdef, params)(x, all_experts=every), static_argnums=2)
    x = jax.random.normal(jax.random.key(0), (2, 7, 32), jnp.float64)
    assert max_rel_error(moe(params, x, False), moe(params, x, True)) < 1e-12


def test_older_config_spellings_read_the_same():
    """`full_attention_interval` instead of `layer_types`, top-level `rope_theta` and
    `partial_rotary_factor` with `rope_scaling: null` (configs published before transformers 5)."""
    config = config_of(MAIN)
    older = {k: v for k, v in config.items() if k not in ("layer_types", "rope_parameters")}
    rope = config["rope_parameters"]
    older.update(full_attention_interval=2, rope_theta=rope["rope_theta"], rope_scaling=None,
                 partial_rotary_factor=rope["partial_rotary_factor"])
    assert resolve(older) == resolve(config)
    assert resolve(config)["full_attention"]["rotary_dim"] == 8 and resolve(config)["layers"][3] == (
        "full_attention", "moe")


@pytest.mark.parametrize("edit, error, words", [
    (dict(hidden_act="gelu"), NotImplementedError, "hidden_act"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)), NotImplementedError, "rotary"),
    (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
     NotImplementedError, "sliding_attention"),
    (dict(linear_num_value_heads=3), ValueError, "'linear_num_value_heads' must be a multiple"),
    (dict(num_experts_per_tok=5), ValueError, "'num_experts_per_tok' must be at most num_experts"),
    (dict(linear_conv_kernel_dim=1), ValueError, "'linear_conv_kernel_dim' must be at least 2"),
    (dict(layer_types=["linear_attention"]), ValueError, "'layer_types' must be null or a list of 4"),
    (dict(rms_norm_eps=0), ValueError, "'rms_norm_eps'"),
    (dict(rope_parameters="x"), ValueError, "'rope_parameters' must be null or an object"),  # was AttributeError
])
def test_unsupported_and_bad_options_are_refused_by_name(edit, error, words):
    with pytest.raises(error, match=words):
        CausalLM({**config_of(MAIN), **edit})


def test_a_moe_text_model_without_experts_is_refused_by_name():
    with pytest.raises(ValueError, match="'num_experts' must be a positive integer, got 0"):
        CausalLM({**config_of("qwen3_5_moe_text"), "num_experts": 0})


@pytest.mark.parametrize("name", QWEN)
def test_every_parameter_has_logical_axis_names(name):
    check_logical_axis_names(name)
