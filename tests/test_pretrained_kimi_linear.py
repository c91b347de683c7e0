"""Kimi Linear (`recurrax.nn.pretrained._kimi_linear`, with the shared `_kda` and `_mla`) against
`transformers` 5.25.

Every fixture's logits are checked with the other `transformers` families in
test_pretrained_transformers.py (and there, with `-m ""`, each fixture's decode, packing,
`generate` and saving). Here, in the default tier, on `kimi_linear_moe_groups` (KDA with a
per-channel gate, NoPE latent attention, a sigmoid MoE limited to 2 of 4 groups with a
score-correction bias, two shared experts and a dense first layer; the Hub's config spellings),
through that file's compiled functions plus one packed prefill: a packed prefill then decoding
equals the parallel forward (and `transformers`), greedy tokens through that cache equal
`transformers`' own, `save_pretrained` writes `transformers`' names and values. Without
compiling the model: the checkpoints as the Hub publishes them (dense layers under `mlp.`) and
`transformers`' model state dict load the same, MLA's cache holds the latent, the routed
experts equal every expert masked by the routing, the published config reads as
`transformers` reads it, unsupported options are refused by name, every parameter has logical
axis names.

Error metric: max |ours − reference| / max |reference|.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flax", reason="recurrax.nn.pretrained needs flax")
pytest.importorskip("safetensors", reason="checkpoints need safetensors (pip install 'recurrax[pretrained]')")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _cases import max_rel_error  # noqa: E402
from _pretrained import (CAPACITY, check_greedy_tokens_through_the_cache, check_logical_axis_names,  # noqa: E402
                         check_packed_prefill_then_decoding, check_saved_as_transformers_writes, config_of)
from flax import nnx  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402
from test_pretrained_transformers import FIXTURES, NAMES, _rewritten, loaded  # noqa: E402

from recurrax.nn.pretrained import CausalLM, from_pretrained, state_dict  # noqa: E402
from recurrax.nn.pretrained.families._kimi_linear import resolve  # noqa: E402
from recurrax.nn.pretrained.layers._mla import MLACache  # noqa: E402

KIMI = [name for name in NAMES if name.startswith("kimi_linear")]
MAIN = "kimi_linear_moe_groups"
needs_fixture = pytest.mark.skipif(MAIN not in NAMES, reason=f"no fixture {MAIN} in tests/fixtures/transformers")

PUBLISHED = {  # moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json (its model fields)
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 163840,
    "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 27, "num_attention_heads": 32,
    "num_key_value_heads": 32, "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "rope_scaling": None, "tie_word_embeddings": False, "kv_lora_rank": 512, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "linear_attn_config": {"head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4,
                           "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
                           "full_attn_layers": [4, 8, 12, 16, 20, 24, 27]},
    "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 1024,
    "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 2.446,
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "num_nextn_predict_layers": 0, "model_max_length": 1048576, "head_dim": 72,
    "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839}


@needs_fixture
def test_packed_prefill_then_one_token_at_a_time_equals_the_parallel_forward():
    """Both rows' first 5 tokens packed into one cache (the conv buffer, the KDA state and the
    latents cut at the sequence boundary), then one token at a time: the parallel logits within
    `floor_tolerance` of their float32-vs-float64 error, and `transformers`' logits."""
    check_packed_prefill_then_decoding(MAIN)


@needs_fixture
def test_greedy_tokens_through_the_cache_equal_transformers():
    """Both prompts in one cache (rows of 5 and 9 tokens, one token per step), each row's next
    token its argmax once its prompt is in: `transformers`' greedy continuations."""
    check_greedy_tokens_through_the_cache(MAIN)


@needs_fixture
def test_save_pretrained_writes_transformers_names_and_reads_back(tmp_path):
    """MoE and dense layers under `block_sparse_moe.`, each expert's w1/w2/w3, the forget gate
    and the three convolutions under `self_attn.`, as `transformers` writes them;
    `make_fixtures.py --check-saved` reads such a directory with `transformers` itself."""
    check_saved_as_transformers_writes(MAIN, tmp_path, {
        "model.layers.1.block_sparse_moe.experts.3.w2.weight", "model.layers.0.block_sparse_moe.up_proj.weight",
        "model.layers.0.self_attn.q_conv1d.weight", "model.layers.0.self_attn.A_log"})


def _hub_names(name: str) -> str:
    """The Hub checkpoint's name of a tensor `transformers` 5.25 saves: the dense MLP under `mlp.`."""
    for proj in ("gate_proj", "up_proj", "down_proj"):
        name = name.replace(f".block_sparse_moe.{proj}.", f".mlp.{proj}.")
    return name


def _model_state_dict(weights: dict) -> dict:
    """`transformers`' model state dict: MoE under `mlp.`, fused experts, the forget gate's
    module, one stacked convolution."""
    out, E = {}, 8
    for name, value in weights.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        for part in ("f_a_proj.", "f_b_proj.", "dt_bias", "A_log"):
            name = name.replace(f".self_attn.{part}", f".self_attn.forget_gate.{part}")
        if ".experts." in name or "_conv1d" in name and not name.endswith(".q_conv1d.weight"):
            continue
        if name.endswith(".q_conv1d.weight"):
            prefix = name[: -len("q_conv1d.weight")]
            out[prefix + "conv1d.weight"] = np.concatenate([weights[name.replace(".mlp.", ".block_sparse_moe.")
                                                                    .replace("q_conv1d", c)] for c in
                                                            ("q_conv1d", "k_conv1d", "v_conv1d")])
            continue
        out[name] = value
    for layer in (1, 2, 3):
        expert = lambda e, w: weights[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"]  # noqa: E731
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([expert(e, "w1"), expert(e, "w3")]) for e in range(E)])
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = np.stack([expert(e, "w2") for e in range(E)])
    return out


@needs_fixture
@pytest.mark.parametrize("layout", ["hub", "model_state_dict"])
def test_the_hub_checkpoint_and_transformers_model_state_dict_load_the_same(layout, tmp_path):
    """The Hub's checkpoint names its dense layers' MLP `mlp.{gate,up,down}_proj` where
    `transformers`' save_pretrained writes `block_sparse_moe.`; `transformers`' model state
    dict holds fused experts, the forget gate module and one convolution. Both load, and save
    as `transformers` writes."""
    weights = load_file(FIXTURES / MAIN / "model.safetensors")
    if layout == "hub":
        renamed = {_hub_names(k): v for k, v in weights.items()}
        assert "model.layers.0.mlp.gate_proj.weight" in renamed
    else:
        renamed = _model_state_dict(weights)
        assert "model.layers.2.mlp.experts.gate_up_proj" in renamed and "model.layers.0.self_attn.conv1d.weight" in \
            renamed
    folder = _rewritten(MAIN, tmp_path)
    save_file(renamed, folder / "model.safetensors")
    saved = state_dict(from_pretrained(folder))
    assert sorted(saved) == sorted(weights)
    assert all(np.array_equal(saved[k], weights[k]) for k in weights)


@needs_fixture
def test_the_latent_attention_cache_holds_the_latent_not_keys_and_values():
    """An MLA layer's cache: the normalised latent `[R, L, kv_lora_rank]` and the rope key
    `[R, L, qk_rope_head_dim]` (16 + 4 numbers per token, not 2 · 2 heads · (12 + 12))."""
    fixture = loaded(MAIN)
    caches = fixture.model.init_cache(2, CAPACITY).layers
    config = config_of(MAIN)
    assert isinstance(caches[2], MLACache)
    assert caches[2].latent.shape == (2, CAPACITY, config["kv_lora_rank"])
    assert caches[2].rope_key.shape == (2, CAPACITY, config["qk_rope_head_dim"])


@needs_fixture
def test_routed_experts_equal_every_expert_masked_by_the_routing():
    """Only the routed (token, expert) pairs computed; the same sum as every expert on every
    token weighted by the routing (float64, so the two orders of summation agree to 1e-12)."""
    graphdef, params = nnx.split(from_pretrained(FIXTURES / MAIN, dtype=jnp.float64).model.layers[1].mlp)
    moe = jax.jit(lambda params, x, every: nnx.merge(graphdef, params)(x, all_experts=every), static_argnums=2)
    x = jax.random.normal(jax.random.key(0), (2, 7, 32), jnp.float64)
    assert max_rel_error(moe(params, x, False), moe(params, x, True)) < 1e-12


def test_the_published_config_reads_as_transformers_reads_it():
    """moonshotai/Kimi-Linear-48B-A3B-Instruct: its 1-indexed `kda_layers`/`full_attn_layers`,
    `first_k_dense_replace`, and the names `transformers` maps (`num_experts`, ...)."""
    spec = resolve(PUBLISHED)
    mixers, ffns = zip(*spec["layers"])
    assert [i for i, m in enumerate(mixers) if m == "full_attention"] == [3, 7, 11, 15, 19, 23, 26]
    assert ffns == ("dense",) + ("sparse",) * 26
    assert spec["linear_attention"]["num_heads"] == 32 and spec["linear_attention"]["head_dim"] == 128
    assert spec["moe"]["router"] == dict(top_k=8, n_group=1, topk_group=1, norm_topk_prob=True,
                                         routed_scaling_factor=2.446)
    assert spec["moe"]["shared_width"] == 1024 and spec["max_position_embeddings"] == 1048576


def test_transformers_spellings_read_the_same():
    """The fixture's config.json written with `transformers`' attribute names instead of the stored
    ones, and `layer_types`/`mlp_layer_types` left out (read from `linear_attn_config` and
    `first_k_dense_replace`)."""
    config = config_of(MAIN)
    renamed = dict(num_experts="num_local_experts", num_experts_per_token="num_experts_per_tok",
                   num_expert_group="n_group", num_shared_experts="n_shared_experts",
                   moe_renormalize="norm_topk_prob", model_max_length="max_position_embeddings")
    other = {renamed.get(k, k): v for k, v in config.items() if k not in ("layer_types", "mlp_layer_types")}
    assert resolve(other) == resolve(config)
    assert resolve(config)["layers"][2] == ("full_attention", "sparse")


@pytest.mark.parametrize("edit, error, words", [
    (dict(hidden_act="gelu"), NotImplementedError, "hidden_act"),
    (dict(mla_use_nope=False), NotImplementedError, "'mla_use_nope'"),
    (dict(moe_router_activation_func="softmax"), NotImplementedError, "'moe_router_activation_func'"),
    (dict(moe_layer_freq=2), NotImplementedError, "'moe_layer_freq'"),
    (dict(use_grouped_topk=False), NotImplementedError, "'use_grouped_topk'"),
    (dict(linear_attn_config=dict(gate_lower_bound=-5.0)), NotImplementedError, "'gate_lower_bound'"),
    (dict(linear_attn_config=dict(use_full_rank_gate=True)), NotImplementedError, "'use_full_rank_gate'"),
    (dict(linear_attn_config=dict(mla_use_output_gate=True)), NotImplementedError, "'mla_use_output_gate'"),
    (dict(num_key_value_heads=1), ValueError, "'num_key_value_heads' must be num_attention_heads"),
    (dict(num_expert_group=3), ValueError, "'num_expert_group' must be a divisor"),
    (dict(topk_group=5), ValueError, "'topk_group' must be at most"),
    (dict(num_experts_per_token=5, topk_group=1), ValueError, "'num_experts_per_token' must be at most"),
    (dict(linear_attn_config=dict(short_conv_kernel_size=1)), ValueError,
     "'short_conv_kernel_size' must be at least 2"),
    (dict(layer_types=["linear_attention"]), ValueError, "'layer_types' must be a list of 4"),
    (dict(layer_types=["linear_attention", "sliding_attention", "full_attention", "linear_attention"]),
     NotImplementedError, "sliding_attention"),
    (dict(mlp_layer_types=["dense", "moe", "sparse", "sparse"]), NotImplementedError, "'moe'"),
    (dict(rms_norm_eps=0), ValueError, "'rms_norm_eps'"),
])
def test_unsupported_and_bad_options_are_refused_by_name(edit, error, words):
    with pytest.raises(error, match=words):
        CausalLM({**config_of(MAIN), **edit})


@pytest.mark.parametrize("name", KIMI)
def test_every_parameter_has_logical_axis_names(name):
    check_logical_axis_names(name)
