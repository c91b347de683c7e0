"""recurrax.nn.pretrained against Hugging Face `transformers` itself (Mamba-2 and its hybrids,
Qwen3-Next and Qwen3.5; their own checks are in test_pretrained_qwen3_next.py).

The fixtures in tests/fixtures/transformers/<name>/ were made by `transformers` 5.25 in PyTorch
(make_fixtures.py there): its config.json + model.safetensors, and its own float32 logits and
greedy continuations (each token chosen from a full parallel forward, since `transformers`'
cached step ignores `time_step_limit`). Logits are checked on every fixture; decode, packing,
generation and saving on Mamba2 (groups, dt limit, tied, biases) and Zamba2 (shared blocks,
adapters, rope, dt floor) in the default tier, on all fixtures with `-m ""` (the other hybrids'
decode, packing and generation too).

Error metric: max |ours − transformers| / max |transformers| (float32 throughout).
"""

from __future__ import annotations

import functools
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flax", reason="recurrax.nn.pretrained needs flax")
pytest.importorskip("safetensors", reason="checkpoints need safetensors (pip install 'recurrax[pretrained]')")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from _cases import by_tier, compile_once_quickly, float64, floor_tolerance, max_rel_error  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from recurrax.nn.pretrained import (  # noqa: E402
    CachedLanguageModel, from_pretrained, generate, save_pretrained, state_dict)

FIXTURES = Path(__file__).parent / "fixtures" / "transformers"
NAMES = sorted(d.name for d in FIXTURES.iterdir() if (d / "expected.npz").exists()) if FIXTURES.is_dir() else []
FAST = {"mamba2_groups_limit_tied_bias"}  # CI time: the others run with -m ""
FAST_DECODE = FAST | {"zamba2_shared_adapters_rope_tied"}  # its caches differ (a KV cache per shared-block use)
TOLERANCE = 1e-4
SAVED_AS_TEXT_MODEL = {"qwen3_5_vlm_text_untied"}  # a multimodal checkpoint: test_pretrained_qwen3_next.py
needs_fixtures = pytest.mark.skipif(not NAMES, reason="no fixtures in tests/fixtures/transformers")


class Loaded:
    """A fixture's model, `transformers`' outputs, and the model's compiled functions."""

    def __init__(self, folder: Path):
        self.model = from_pretrained(folder)
        self.expected = dict(np.load(folder / "expected.npz"))
        graphdef, self.params = nnx.split(self.model)
        self.forward = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))
        self.packed = jax.jit(lambda params, tokens, cu: nnx.merge(graphdef, params)(tokens, cu_seqlens=cu))
        self.step = jax.jit(lambda params, tokens, cache: nnx.merge(graphdef, params)(tokens, cache))
        self.folder = folder

    def logits_floor(self, tokens) -> float:
        """The rounding floor of the parallel logits: their error against the float64 model's
        (the same parameters cast up; its forward compiled at XLA's level 0)."""
        graphdef = nnx.split(from_pretrained(self.folder, dtype=jnp.float64))[0]
        params = float64(self.params)
        forward = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))
        forward = compile_once_quickly(forward, params, tokens)
        return max_rel_error(self.forward(self.params, tokens), forward(params, tokens))


@functools.lru_cache(maxsize=None)
def loaded(name: str) -> Loaded:
    return Loaded(FIXTURES / name)


PACKED_PREFILL_FIXTURES = {"bailing_hybrid_safe_gate_groups", "bailing_hybrid_swiglu_limits", "kimi_linear_moe_groups",
                           "minimax_gqa_rotary_dim_tied",
                           "olmo_hybrid_grouped_negeig", "qwen3_next_moe_grouped"}
"""Fixtures whose family file runs `_pretrained.check_packed_prefill_then_decoding` in the default
tier: it asserts this file's test_logits_match_transformers too, so here they run with -m slow."""


@needs_fixtures
@pytest.mark.parametrize("name", by_tier(NAMES, set(NAMES) - PACKED_PREFILL_FIXTURES))
def test_logits_match_transformers(name):
    fixture = loaded(name)
    logits = fixture.forward(fixture.params, jnp.asarray(fixture.expected["input_ids"]))
    assert max_rel_error(logits, fixture.expected["logits"]) < TOLERANCE


@needs_fixtures
@pytest.mark.parametrize("name", by_tier(NAMES, FAST_DECODE))
def test_cached_decode_equals_parallel(name):
    """Prefill 5 tokens through the cache, then one token at a time: the parallel logits within
    `floor_tolerance` of their float32-vs-float64 error (and `transformers`' parallel logits),
    with the dt clamp in both paths."""
    fixture = loaded(name)
    tokens = jnp.asarray(fixture.expected["input_ids"])
    B, T = tokens.shape
    cache = fixture.model.init_cache(B, 16)
    logits, cache = fixture.step(fixture.params, tokens[:, :5], cache)
    pieces = [logits]
    for t in range(5, T):
        logits, cache = fixture.step(fixture.params, tokens[:, t:t + 1], cache)
        pieces.append(logits)
    decoded = jnp.concatenate(pieces, axis=1)
    error, floor = max_rel_error(decoded, fixture.forward(fixture.params, tokens)), fixture.logits_floor(tokens)
    assert error <= floor_tolerance(floor), (error, floor)
    assert max_rel_error(decoded, fixture.expected["logits"]) < TOLERANCE


@needs_fixtures
@pytest.mark.parametrize("name", by_tier(NAMES, FAST))
def test_packed_batch_equals_each_sequence(name):
    fixture = loaded(name)
    prompts = [fixture.expected["prompt_0"], fixture.expected["prompt_1"]]
    packed = fixture.packed(fixture.params, jnp.asarray(np.concatenate(prompts)),
                            jnp.asarray([0, len(prompts[0]), len(prompts[0]) + len(prompts[1])]))
    alone = [fixture.forward(fixture.params, jnp.asarray(p)[None])[0] for p in prompts]
    assert max_rel_error(packed, jnp.concatenate(alone)) < 1e-5


@needs_fixtures
@pytest.mark.parametrize("name", by_tier(NAMES, FAST))
def test_greedy_generation_matches_transformers(name):
    fixture = loaded(name)
    prompts = [fixture.expected["prompt_0"], fixture.expected["prompt_1"]]
    assert isinstance(fixture.model, CachedLanguageModel)  # generate goes through its protocol
    outputs = generate(fixture.model, prompts, max_new_tokens=len(fixture.expected["greedy_0"]),
                       stop_tokens=())  # transformers' greedy tokens run past eos_token_id
    assert outputs == [fixture.expected["greedy_0"].tolist(), fixture.expected["greedy_1"].tolist()]


@needs_fixtures
@pytest.mark.parametrize("name", by_tier([name for name in NAMES if name not in SAVED_AS_TEXT_MODEL], FAST))
def test_save_pretrained_round_trip(name, tmp_path):
    """The saved checkpoint holds transformers' tensor names and values, and loads back equal."""
    fixture = loaded(name)
    save_pretrained(fixture.model, tmp_path)
    original, saved = load_file(FIXTURES / name / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert sorted(saved) == sorted(original)
    assert all(np.array_equal(saved[k], original[k]) for k in original)
    assert json.loads((tmp_path / "config.json").read_text(), parse_constant=float) == \
        json.loads((FIXTURES / name / "config.json").read_text(), parse_constant=float)
    again = nnx.split(from_pretrained(tmp_path))[1]  # through the fixture's compiled forward
    tokens = jnp.asarray(fixture.expected["input_ids"])
    assert max_rel_error(fixture.forward(again, tokens), fixture.forward(fixture.params, tokens)) < 1e-5


# ----------------------------------------------------------------------------------------------
# Configs as the Hub publishes them
# ----------------------------------------------------------------------------------------------

def _rewritten(name: str, tmp_path: Path, edit=None, rename=None) -> Path:
    """A copy of fixture `name` with its config.json edited and its tensors renamed."""
    shutil.copytree(FIXTURES / name, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    if edit is not None:
        edit(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    if rename is not None:
        weights = load_file(tmp_path / "model.safetensors")
        save_file({rename(k): v for k, v in weights.items()}, tmp_path / "model.safetensors")
    return tmp_path


def _logits_error(folder: Path, name: str) -> float:
    expected = np.load(FIXTURES / name / "expected.npz")
    return max_rel_error(from_pretrained(folder)(jnp.asarray(expected["input_ids"])), expected["logits"])


@needs_fixtures
def test_bare_infinity_and_old_embedding_name(tmp_path):
    """A bare Infinity in config.json (4.x) and Mamba-2's older `backbone.embedding.` name."""
    def mamba2(config):
        config["time_step_limit"] = [0.0, math.inf]  # json.dumps writes the bare Infinity of 4.x

    def old_embedding(name):
        return name.replace("backbone.embeddings.", "backbone.embedding.")

    folder = _rewritten("mamba2_basic", tmp_path, mamba2, old_embedding)
    assert "Infinity" in (folder / "config.json").read_text()
    assert _logits_error(folder, "mamba2_basic") < TOLERANCE


@needs_fixtures
@pytest.mark.slow
def test_hub_layer_spellings_load_the_same_model(tmp_path):
    """Nemotron-H's hybrid_override_pattern and mamba_* aliases, Granite's older layer names."""
    def nemotron(config):
        config["hybrid_override_pattern"] = "M-M*E"
        del config["layers_block_type"]
        config["mamba_n_groups"] = config.pop("n_groups")
        config["mamba_d_conv"] = config.pop("conv_kernel")

    def granite(config):
        config["layer_types"] = ["mamba", "attention", "mamba"]

    assert _logits_error(_rewritten("nemotron_h_pattern_moe", tmp_path / "n", nemotron),
                         "nemotron_h_pattern_moe") < TOLERANCE
    assert _logits_error(_rewritten("granite_moe_multipliers", tmp_path / "g", granite),
                         "granite_moe_multipliers") < TOLERANCE


@needs_fixtures
def test_fla_mamba2_config_is_refused_by_name(tmp_path):
    def fla(config):
        config.update(fuse_norm=True, fuse_cross_entropy=True)

    with pytest.raises(NotImplementedError, match="fla's own mamba2"):
        from_pretrained(_rewritten("mamba2_basic", tmp_path, fla))


@needs_fixtures
def test_state_dict_names_are_transformers_names():
    fixture = loaded("nemotron_h_pattern_moe")
    assert sorted(state_dict(fixture.model)) == sorted(load_file(FIXTURES / "nemotron_h_pattern_moe" /
                                                                 "model.safetensors"))


@needs_fixtures
def test_nemotron_experts_as_transformers_holds_them_load_the_same_weights(tmp_path):
    """`transformers` 5.x's in-memory state dict (`model.`, each MoE layer's experts fused as
    `mixer.experts.up_proj [E, F, D]`, `down_proj [E, D, F]`) loads the fixture's weights, and
    saves them back under the per-expert names."""
    name = "nemotron_h_pattern_moe"
    original = load_file(FIXTURES / name / "model.safetensors")
    fused, per_expert = {}, re.compile(r"^backbone\.(.+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")
    for key, value in original.items():
        if match := per_expert.match(key):
            fused.setdefault(f"model.{match[1]}.{match[3]}", {})[int(match[2])] = value
        else:
            fused[re.sub(r"^backbone\.", "model.", key)] = value  # lm_head.weight as it is
    fused = {key: np.stack([value[e] for e in sorted(value)]) if isinstance(value, dict) else value
             for key, value in fused.items()}
    assert any(key.endswith("mixer.experts.up_proj") and value.ndim == 3 for key, value in fused.items())
    shutil.copytree(FIXTURES / name, tmp_path, dirs_exist_ok=True)
    save_file(fused, tmp_path / "model.safetensors")
    saved = state_dict(from_pretrained(tmp_path))
    assert sorted(saved) == sorted(original)
    assert all(np.array_equal(saved[key], original[key]) for key in original)


# ----------------------------------------------------------------------------------------------
# Zamba2's shared blocks
# ----------------------------------------------------------------------------------------------

ZAMBA2_TIED = "zamba2_shared_adapters_rope_tied"  # hybrid layers 1, 2, 3 run blocks 0, 1, 0


@needs_fixtures
def test_zamba2_tied_block_copies_load_as_the_shared_block(tmp_path):
    """A checkpoint holding the tied block under every use (as PyTorch's own state_dict names it)
    loads the same parameters; a later use's copy alone stands in for the first's."""
    weights = load_file(FIXTURES / ZAMBA2_TIED / "model.safetensors")
    first, later = "model.layers.1.shared_transformer.", "model.layers.3.shared_transformer."
    copies = {later + k[len(first):]: v for k, v in weights.items() if k.startswith(first)}
    assert len(copies) == 26  # 2 norms, q/k/v/o, MLP with biases, its and q/k/v adapters of uses 0 and 2
    moved = {**weights, **copies}
    only_later = first + "self_attn.q_proj.weight"
    moved.pop(only_later)
    shutil.copytree(FIXTURES / ZAMBA2_TIED, tmp_path, dirs_exist_ok=True)
    save_file(moved, tmp_path / "model.safetensors")
    model = from_pretrained(tmp_path)
    layers = model.model.layers
    assert layers[1].shared_transformer is layers[3].shared_transformer is not layers[2].shared_transformer
    saved = state_dict(model)
    assert sorted(saved) == sorted(weights)
    assert all(np.array_equal(saved[k], weights[k]) for k in weights)


@needs_fixtures
def test_zamba2_untied_blocks_are_one_per_layer():
    """transformers 5.25 ties Zamba2's blocks only with tie_word_embeddings: here each hybrid
    layer loads its own block (the two differ in the checkpoint)."""
    model = loaded("zamba2_gqa_untied").model
    first, second = model.model.layers[0].shared_transformer, model.model.layers[2].shared_transformer
    assert first is not second
    assert not np.array_equal(first.self_attn.q_proj.kernel[...], second.self_attn.q_proj.kernel[...])


@needs_fixtures
@pytest.mark.parametrize("edit, refused", [
    (dict(use_shared_attention_adapter=True), "use_shared_attention_adapter"),  # with GQA
    (dict(hidden_act="gelu_fast"), "hidden_act"),
    (dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0)), "rotary"),
])
def test_zamba2_unsupported_options_are_refused_by_name(tmp_path, edit, refused):
    config = dict(edit, use_mem_rope=True) if "rope_parameters" in edit else edit
    with pytest.raises(NotImplementedError, match=refused):
        from_pretrained(_rewritten("zamba2_gqa_untied", tmp_path, lambda c: c.update(config)))


def test_transformers_gelu_is_the_exact_one():
    """`transformers`' `gelu` is erf-based (fla's is the tanh approximation): Bamba, Falcon-H1,
    Granite, Nemotron-H and Zamba2 MLPs take `transformers`' table."""
    from recurrax.nn.pretrained.layers._mlp import activation

    x = np.linspace(-4, 4, 33)
    exact = np.array([0.5 * t * (1 + math.erf(t / math.sqrt(2))) for t in x])
    tanh = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(np.asarray(activation("gelu", "hidden_act")(jnp.asarray(x, jnp.float64))), exact,
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(activation("gelu_pytorch_tanh", "hidden_act")(jnp.asarray(x))), tanh,
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(NotImplementedError, match="hidden_act"):
        activation("gelu_fast", "hidden_act")
