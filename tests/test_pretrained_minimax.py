"""MiniMax (`recurrax.nn.pretrained.families._minimax`) against `transformers` 5.25.

Every fixture's logits are checked with the other `transformers` families in
test_pretrained_transformers.py, and there, with `-m ""`, each fixture's decode, packing,
`generate` and saving too. Here, in the default tier, on MiniMax with a Lightning layer first
(blocks of 4 tokens in `transformers`), grouped attention heads with an explicit head dim and
the Hub's `rotary_dim` (which `transformers` ignores), through that file's compiled forward plus
one packed prefill and one decode step: a packed prefill then decoding equals the parallel
forward (and `transformers`), greedy tokens through that cache equal `transformers`' own, and
`save_pretrained` writes `transformers`' names and values (the decay buffers bit for bit).
Without compiling the model (one small layer only): a Lightning layer (parallel and decoding)
equals a float64 numpy transcription of `transformers`' recurrence, its decay rates equal
`transformers`' saved `slope_rate`, the model's own tensor names (fused experts, no decay
buffers) load the same, the Hub's config spellings read the same, unsupported options are
refused by name, and every parameter has logical axis names. With `-m ""`: the
same packed prefill and decoding on the fixture with a sliding window and residual factors ≠ 1,
and the routed experts against every expert masked by the routing.

Error metric: max |ours − reference| / max |reference|.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flax", reason="recurrax.nn.pretrained needs flax")
pytest.importorskip("safetensors", reason="checkpoints need safetensors (pip install 'recurrax[pretrained]')")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _cases import floor_tolerance, max_rel_error  # noqa: E402
from _pretrained import (check_greedy_tokens_through_the_cache, check_logical_axis_names,  # noqa: E402
                         check_packed_prefill_then_decoding, check_saved_as_transformers_writes, config_of)
from flax import nnx  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402
from test_pretrained_transformers import FIXTURES, NAMES, _rewritten  # noqa: E402

from recurrax.nn.pretrained import CausalLM, from_pretrained, state_dict  # noqa: E402
from recurrax.nn.pretrained.families._minimax import MiniMaxLightningAttention, resolve, slope_rates  # noqa: E402

MINIMAX = [name for name in NAMES if name.startswith("minimax")]
MAIN = "minimax_gqa_rotary_dim_tied"
WINDOW = "minimax_pattern_factors_window"
needs_fixture = pytest.mark.skipif(MAIN not in NAMES, reason=f"no fixture {MAIN} in tests/fixtures/transformers")


@needs_fixture
def test_packed_prefill_then_one_token_at_a_time_equals_the_parallel_forward():
    """Both rows' first 5 tokens packed into one cache (the Lightning state and the keys cut at
    the sequence boundary), then one token at a time: the parallel logits within
    `floor_tolerance` of their float32-vs-float64 error, and `transformers`' logits."""
    check_packed_prefill_then_decoding(MAIN)


@pytest.mark.slow
@pytest.mark.skipif(WINDOW not in NAMES, reason=f"no fixture {WINDOW}")
def test_the_same_with_a_sliding_window_and_residual_factors():
    check_packed_prefill_then_decoding(WINDOW)


@needs_fixture
def test_greedy_tokens_through_the_cache_equal_transformers():
    """Both prompts in one cache (rows of 5 and 9 tokens, one token per step), each row's next
    token its argmax once its prompt is in: `transformers`' greedy continuations."""
    check_greedy_tokens_through_the_cache(MAIN)


@needs_fixture
def test_save_pretrained_writes_transformers_names_and_values(tmp_path):
    """Mixtral's expert names under `block_sparse_moe` and the Lightning decay buffers, bit for
    bit as `transformers` 5.25 saves them; `make_fixtures.py --check-saved` reads such a
    directory with `transformers` itself."""
    check_saved_as_transformers_writes(MAIN, tmp_path, {
        "model.layers.0.block_sparse_moe.experts.3.w2.weight", "model.layers.0.block_sparse_moe.gate.weight",
        "model.layers.2.self_attn.diagonal_decay"})


def _models_own_names(weights: dict) -> dict:
    """`transformers`' model state: `mlp.gate`, fused `mlp.experts.gate_up_proj [E, 2F, D]` and
    `down_proj [E, D, F]`; without the decay buffers (a checkpoint may lack them)."""
    own = {}
    for name, value in weights.items():
        if name.endswith(("slope_rate", "query_decay", "key_decay", "diagonal_decay")):
            continue
        if ".experts." not in name:
            own[name.replace(".block_sparse_moe.", ".mlp.")] = value
        elif name.endswith(".experts.0.w2.weight"):
            prefix = name[: -len(".block_sparse_moe.experts.0.w2.weight")]
            count = sum(1 for k in weights if k.startswith(prefix + ".") and k.endswith(".w2.weight"))
            expert = lambda e, w: weights[f"{prefix}.block_sparse_moe.experts.{e}.{w}.weight"]  # noqa: E731
            own[f"{prefix}.mlp.experts.gate_up_proj"] = np.stack(
                [np.concatenate([expert(e, "w1"), expert(e, "w3")]) for e in range(count)])
            own[f"{prefix}.mlp.experts.down_proj"] = np.stack([expert(e, "w2") for e in range(count)])
    return own


@pytest.mark.parametrize("name", MINIMAX)
def test_the_models_own_names_load_the_same_parameters(name, tmp_path):
    """The fixture's checkpoint with `transformers`' in-model names instead (fused experts, no
    decay buffers): the same parameters, saved back as `transformers` saves them."""
    weights = load_file(FIXTURES / name / "model.safetensors")
    own = _models_own_names(weights)
    assert "model.layers.0.mlp.experts.gate_up_proj" in own and not any("decay" in k for k in own)
    folder = _rewritten(name, tmp_path)
    save_file(own, folder / "model.safetensors")
    saved = state_dict(from_pretrained(folder))
    assert sorted(saved) == sorted(weights)
    assert all(np.array_equal(saved[k], weights[k]) for k in weights)


def _lightning_reference(x: np.ndarray, weights: dict, slopes: np.ndarray, H: int, d: int) -> np.ndarray:
    """`transformers`' `MiniMaxLightningAttention` on one row, token by token, in float64 numpy."""
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    qkv = silu(x @ weights["qkv_proj"]).reshape(len(x), H, 3 * d)
    q, k, v = qkv[..., :d], qkv[..., d:2 * d], qkv[..., 2 * d:]
    state, outputs = np.zeros((H, d, d)), []
    for t in range(len(x)):
        state = np.exp(-slopes)[:, None, None] * state + k[t][:, :, None] * v[t][:, None, :]
        outputs.append(np.einsum("hk,hkv->hv", q[t], state).reshape(-1))
    o = np.stack(outputs)
    o = o / np.sqrt(np.mean(o**2, axis=-1, keepdims=True) + 1e-6) * weights["norm"]
    gate = 1 / (1 + np.exp(-(x @ weights["output_gate"])))
    return (gate * o) @ weights["out_proj"]


def _lightning_layer(dtype, weights: dict, H: int, d: int, D: int) -> MiniMaxLightningAttention:
    """Layer 1 of 3 in `dtype`, holding `weights`."""
    layer = MiniMaxLightningAttention(D, num_heads=H, head_dim=d, layer_idx=1, num_layers=3, dtype=dtype,
                                      rngs=nnx.Rngs(0))
    for name in ("qkv_proj", "output_gate", "out_proj"):
        getattr(layer, name).kernel.set_value(jnp.asarray(weights[name], dtype))
    layer.norm.weight.set_value(jnp.asarray(weights["norm"], dtype))
    return layer


def test_a_lightning_layer_equals_transformers_recurrence():
    """Random weights (norm weight ≠ 1), 11 tokens, layer 1 of 3 with 4 heads of 6 channels:
    the layer's parallel forward in float64 and its float32 decoding token by token from a
    cache equal the numpy transcription (float64) within `floor_tolerance` of the float32
    layer's error against the float64 one (the output norm computes in float32 in both)."""
    H, d, D, T = 4, 6, 20, 11
    rng = np.random.default_rng(0)
    weights = {name: rng.normal(size=shape) * 0.4 for name, shape in
               (("qkv_proj", (D, 3 * H * d)), ("output_gate", (D, H * d)), ("out_proj", (H * d, D)))}
    weights["norm"] = 1 + 0.3 * rng.normal(size=H * d)
    x = rng.normal(size=(1, T, D))
    expected = _lightning_reference(x[0], weights, np.asarray(slope_rates(H, 1, 3), np.float64), H, d)
    wide, narrow = (_lightning_layer(dtype, weights, H, d, D) for dtype in (jnp.float64, jnp.float32))
    parallel = wide(jnp.asarray(x))[0]
    floor = max_rel_error(narrow(jnp.asarray(x, jnp.float32))[0], parallel)
    assert max_rel_error(parallel, expected) <= floor_tolerance(floor), floor
    graphdef, params = nnx.split(narrow)
    step = jax.jit(lambda params, x, cache: nnx.merge(graphdef, params)(x, cache))
    cache, pieces = narrow.init_cache(1), []
    for t in range(T):
        y, cache = step(params, jnp.asarray(x[:, t:t + 1], jnp.float32), cache)
        pieces.append(y[0])
    assert max_rel_error(jnp.concatenate(pieces), expected) <= floor_tolerance(floor), floor


@pytest.mark.parametrize("name", MINIMAX)
def test_decay_rates_equal_transformers_slope_rate(name):
    """`slope_rates` against the `slope_rate` buffers `transformers` saved: equal, bit for bit."""
    config, weights = config_of(name), load_file(FIXTURES / name / "model.safetensors")
    H, L = config["num_attention_heads"], config["num_hidden_layers"]
    found = 0
    for layer, kind in enumerate(config["layer_types"]):
        if kind == "linear_attention":
            saved = weights[f"model.layers.{layer}.self_attn.slope_rate"][:, 0, 0]
            assert np.array_equal(np.asarray(slope_rates(H, layer, L)), saved), layer
            found += 1
    assert found


@pytest.mark.slow
@needs_fixture
def test_routed_experts_equal_every_expert_masked_by_the_routing():
    """Only the routed (token, expert) pairs computed; the same sum as every expert on every
    token weighted by the renormalised top-k softmax (float64: the two sums agree to 1e-12)."""
    graphdef, params = nnx.split(from_pretrained(FIXTURES / MAIN, dtype=jnp.float64).model.layers[0].mlp)
    moe = jax.jit(lambda params, x, every: nnx.merge(graphdef, params)(x, all_experts=every), static_argnums=2)
    x = jax.random.normal(jax.random.key(0), (2, 7, 32), jnp.float64)
    assert max_rel_error(moe(params, x, False), moe(params, x, True)) < 1e-12


def test_the_hubs_config_spellings_read_the_same():
    """MiniMax-Text-01-hf's config.json: top-level `rope_theta`, `rotary_dim` (ignored, as by
    `transformers`), `postnorm: true`, `shared_intermediate_size: 0`, `shared_moe_mode`;
    MiniMax's own `attn_type_list` for `layer_types`; `num_experts` for `num_local_experts`;
    no `layer_types` at all: attention at even layers."""
    config = config_of(MAIN)
    hub = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types", "num_local_experts")}
    hub.update(rope_theta=config["rope_parameters"]["rope_theta"], rotary_dim=4, postnorm=True,
               shared_intermediate_size=0, shared_moe_mode="sigmoid", attn_type_list=[0, 1, 0],
               num_experts=config["num_local_experts"])
    assert resolve(hub) == resolve(config)
    spec = resolve(config)
    assert spec["layers"] == ["linear_attention", "full_attention", "linear_attention"]
    assert spec["full_attention"] == dict(num_heads=4, num_kv_heads=2, head_dim=12, rotary_dim=12,
                                          rope_theta=10000.0, window=None)
    both = {**config, "attn_type_list": [0, 1, 0]}
    assert resolve(both) == spec
    plain = {k: v for k, v in config_of(WINDOW).items() if k != "layer_types"}
    assert resolve(plain) == resolve(config_of(WINDOW))
    assert resolve(plain)["layers"] == ["full_attention", "linear_attention", "full_attention"]
    assert resolve(plain)["factors"]["full_attn_alpha_factor"] == 3.5


@pytest.mark.parametrize("edit, error, words", [
    (dict(hidden_act="gelu"), NotImplementedError, "hidden_act"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0)), NotImplementedError, "rotary"),
    (dict(postnorm=False), NotImplementedError, "postnorm"),
    (dict(shared_intermediate_size=16), NotImplementedError, "shared_intermediate_size"),
    (dict(layer_types=["linear_attention", "sliding_attention", "full_attention"]), NotImplementedError,
     "sliding_attention"),
    (dict(layer_types=["linear_attention"]), ValueError, "'layer_types' must be null or a list of 3"),
    (dict(attn_type_list=[0, 0, 1]), ValueError, "'attn_type_list' must be the layer_types"),
    (dict(attn_type_list=[0, 2, 1]), ValueError, "'attn_type_list' must be a list of 3 codes"),
    (dict(num_key_value_heads=3), ValueError, "'num_attention_heads' must be a multiple"),
    (dict(head_dim=None, num_attention_heads=5, num_key_value_heads=5), ValueError,
     "'num_attention_heads' must be a divisor"),
    (dict(num_experts_per_tok=5), ValueError, "'num_experts_per_tok' must be at most num_local_experts"),
    (dict(block_size=0), ValueError, "'block_size' must be a positive integer"),
    (dict(sliding_window=0), ValueError, "'sliding_window' must be a positive integer or null"),
    (dict(mlp_beta_factor="1"), ValueError, "'mlp_beta_factor'"),
    (dict(rms_norm_eps=0), ValueError, "'rms_norm_eps'"),
])
def test_unsupported_and_bad_options_are_refused_by_name(edit, error, words):
    with pytest.raises(error, match=words):
        CausalLM({**config_of(MAIN), **edit})


@pytest.mark.parametrize("name", MINIMAX)
def test_every_parameter_has_logical_axis_names(name):
    check_logical_axis_names(name)
