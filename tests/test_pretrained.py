"""recurrax.nn.pretrained against flash-linear-attention (fla) itself.

The fixtures in tests/fixtures/fla/<name>/ were made by fla 0.6.0 in PyTorch (see
make_fixtures.py there): fla's config.json + model.safetensors and fla's own float32 outputs
(expected.npz), the independent reference here. The default tier runs every check on one
fixture per family (FAST, about 2 minutes on this 2-core box: compiling dominates); `-m ""`
runs them on all fixtures. Self-made checks (windowed attention, sampling, checkpoint
errors and formats) use tiny layers and a tiny model built from a config dict.

Error metric: max |ours − fla| / max |fla| over all compared logits (float32 throughout).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flax", reason="recurrax.nn.pretrained needs flax")
pytest.importorskip("safetensors", reason="fla checkpoints need safetensors (pip install 'recurrax[pretrained]')")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from _cases import by_tier, max_rel_error  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from recurrax.nn import pretrained  # noqa: E402
from recurrax.nn.pretrained import CausalLM, from_pretrained, generate, save_pretrained  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "fla"
NAMES = sorted(d.name for d in FIXTURES.iterdir() if (d / "expected.npz").exists()) if FIXTURES.is_dir() else []
FAST = {"gla_gqa_conv_clamp", "gla_hybrid_attn", "retnet_gqa_nogate", "hgrn2_conv_nolb", "linear_attn_t2r_norm",
        "lightnet_basic", "gated_deltanet_gva_negeig"}
TOLERANCE = 1e-4


class Loaded:
    """A fixture's model, fla's outputs, and the model's compiled functions (built once)."""

    def __init__(self, name: str):
        self.folder = FIXTURES / name
        self.model = from_pretrained(self.folder)
        self.expected = dict(np.load(self.folder / "expected.npz"))
        graphdef, self.params = nnx.split(self.model)
        self.forward = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))
        self.packed = jax.jit(lambda params, tokens, cu: nnx.merge(graphdef, params)(tokens, cu_seqlens=cu))
        self.step = jax.jit(lambda params, tokens, cache: nnx.merge(graphdef, params)(tokens, cache))

    def prompts(self):
        return [self.expected["prompt_0"], self.expected["prompt_1"]]


@functools.lru_cache(maxsize=None)
def loaded(name: str) -> Loaded:
    return Loaded(name)


@pytest.mark.skipif(not NAMES, reason="no fla fixtures in tests/fixtures/fla")
@pytest.mark.parametrize("name", by_tier(NAMES, FAST))
def test_logits_match_fla(name):
    """Full forward (fla's fused_recurrent range, and 72 tokens: its chunk kernels) and a packed
    forward of two ragged prompts (cu_seqlens) equal fla's logits within 1e-4 relative."""
    fix = loaded(name)
    exp = fix.expected
    errors = {
        "logits": max_rel_error(fix.forward(fix.params, jnp.asarray(exp["input_ids"])), exp["logits"]),
        "long_logits": max_rel_error(fix.forward(fix.params, jnp.asarray(exp["long_input_ids"])), exp["long_logits"]),
    }
    prompts = fix.prompts()
    cu_seqlens = jnp.asarray(np.cumsum([0] + [len(p) for p in prompts]), jnp.int32)
    packed = np.asarray(fix.packed(fix.params, jnp.asarray(np.concatenate(prompts)), cu_seqlens))
    width = exp["padded_prompts"].shape[1]
    fla_rows = [exp["padded_logits"][row, width - len(p):] for row, p in enumerate(prompts)]
    errors["packed_vs_fla_padded"] = max_rel_error(packed, np.concatenate(fla_rows))
    print(name, {k: f"{v:.1e}" for k, v in errors.items()})
    assert max(errors.values()) < TOLERANCE, errors


@pytest.mark.skipif(not NAMES, reason="no fla fixtures in tests/fixtures/fla")
@pytest.mark.parametrize("name", by_tier(NAMES, FAST))
def test_cached_decode_matches_parallel_and_fla(name):
    """Feeding input_ids one token at a time through the cache gives the parallel logits, and
    fla's own cached-decode logits."""
    fix = loaded(name)
    tokens = jnp.asarray(fix.expected["input_ids"])
    cache = fix.model.init_cache(tokens.shape[0], tokens.shape[1])
    steps = []
    for t in range(tokens.shape[1]):
        logits, cache = fix.step(fix.params, tokens[:, t:t + 1], cache)
        steps.append(logits)
    steps = np.concatenate(steps, axis=1)
    vs_parallel = max_rel_error(steps, fix.forward(fix.params, tokens))
    vs_fla = max_rel_error(steps, fix.expected["decode_logits"])
    print(name, f"decode vs parallel {vs_parallel:.1e}, vs fla decode {vs_fla:.1e}")
    assert vs_parallel < 1e-5 and vs_fla < TOLERANCE


@pytest.mark.skipif(not NAMES, reason="no fla fixtures in tests/fixtures/fla")
@pytest.mark.parametrize("name", by_tier(NAMES, FAST))
def test_generation_matches_fla(name):
    """generate (one packed prefill, batched cached decoding) reproduces fla's greedy tokens,
    also with more prompts than slots (continuous batching) and with a stop token; sampling
    does not depend on the scheduling (one compiled decoder serves all of these)."""
    fix = loaded(name)
    want = [list(fix.expected["greedy_0"]), list(fix.expected["greedy_1"])]
    n = len(want[0])
    # fla's greedy tokens do not stop at eos_token_id (generate's default stop tokens)
    assert generate(fix.model, fix.prompts(), n, stop_tokens=()) == want
    queued = generate(fix.model, fix.prompts()[::-1] + fix.prompts(), n, num_slots=2, stop_tokens=())  # 4 on 2 slots
    assert queued == want[::-1] + want
    stop = want[1][2]
    cut = [w[: w.index(stop) + 1] if stop in w else w for w in want]
    assert generate(fix.model, fix.prompts(), n, stop_tokens=[stop]) == cut
    options = dict(temperature=1.3, top_k=20, top_p=0.95, seed=5, num_slots=2)
    sampled = generate(fix.model, fix.prompts() + fix.prompts(), n, **options)  # prompts 2, 3 waited
    alone = generate(fix.model, [[1], [1], list(fix.prompts()[0])], n, **options)[2]  # prompt id 2 again
    assert sampled[2] == alone and all(0 <= t < fix.model.vocab_size for seq in sampled for t in seq)


@pytest.mark.skipif(not NAMES, reason="no fla fixtures in tests/fixtures/fla")
@pytest.mark.parametrize("name", by_tier(NAMES, FAST))
def test_save_pretrained_round_trip(name, tmp_path):
    """save_pretrained writes fla's tensors back bit for bit (names, shapes, dtypes) and the
    same config; loading that again gives the same parameters."""
    fix = loaded(name)
    save_pretrained(fix.model, tmp_path)
    original, written = load_file(fix.folder / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert set(written) <= set(original) and set(original) - set(written) <= {"lm_head.weight"}
    for key, value in written.items():
        assert value.dtype == original[key].dtype and value.shape == original[key].shape, key
        np.testing.assert_array_equal(value, original[key], err_msg=key)
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((fix.folder / "config.json").read_text())
    again = pretrained.state_dict(from_pretrained(tmp_path))
    for key, value in pretrained.state_dict(fix.model).items():
        np.testing.assert_array_equal(again[key], value, err_msg=key)


# ------------------------------------------------------------------------------------------
# Self-made checks on a tiny model (no fixture needed)
# ------------------------------------------------------------------------------------------

TINY = dict(model_type="gla", vocab_size=32, hidden_size=16, num_hidden_layers=2, num_heads=2, hidden_ratio=2,
            use_short_conv=True, attn=dict(layers=[1], num_heads=2, num_kv_heads=1, window_size=4))


@functools.lru_cache(maxsize=None)
def tiny_model() -> CausalLM:
    """The TINY model with every parameter random (norm weights and biases included)."""
    model = nnx.eval_shape(lambda: CausalLM(TINY, rngs=nnx.Rngs(3)))
    rng = np.random.default_rng(3)
    weights = {name: rng.normal(0, 0.3, t.to_fla(np.zeros(t.variable.get_value().shape)).shape).astype(np.float32)
               for name, t in pretrained._checkpoint.tensors(model).items()}
    return pretrained.load_weights(model, weights)


def _greedy_by_parallel_forwards(model, prompts, n, repetition_penalty=None):
    """The reference: each next token is the argmax of one parallel forward over everything so
    far (right-padded to one length: a causal model's logits at t ignore what follows t); with
    a repetition penalty, `transformers`' rule applied in numpy to the tokens of the row so far."""
    rows = [list(p) for p in prompts]
    forward = jax.jit(lambda tokens: model(tokens))
    for _ in range(n):
        padded = np.zeros((len(rows), max(map(len, prompts)) + n), np.int32)
        for i, row in enumerate(rows):
            padded[i, : len(row)] = row
        logits = np.asarray(forward(jnp.asarray(padded)))
        for i, row in enumerate(rows):
            last = logits[i, len(row) - 1]
            if repetition_penalty is not None:
                seen = np.isin(np.arange(last.shape[-1]), row)
                last = np.where(seen, np.where(last > 0, last / repetition_penalty, last * repetition_penalty), last)
            row.append(int(np.argmax(last)))
    return [row[len(p):] for row, p in zip(rows, prompts)]


@pytest.mark.parametrize("mixer", ["gla", "lightning"])
def test_generate_on_a_language_model_equals_greedy_parallel_forwards(mixer):
    """generate takes any model with the protocol: a float64 recurrax.nn.LanguageModel (short
    convolution, grouped heads), ragged prompts, 3 prompts on 2 slots (one waits for a slot)."""
    from recurrax.nn import LanguageModel

    model = LanguageModel(32, 16, 2, 2, mixer=mixer, mlp_ratio=2, mixer_options=dict(num_kv_heads=1, conv_size=3),
                          dtype=jnp.float64, param_dtype=jnp.float64, rngs=nnx.Rngs(5))
    assert isinstance(model, pretrained.CachedLanguageModel)
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6], [5, 3, 5, 8]]
    want = _greedy_by_parallel_forwards(model, prompts, 5)
    assert generate(model, prompts, 5, num_slots=2) == want


def test_repetition_penalty_equals_greedy_parallel_forwards():
    """A repetition penalty (prompt and output tokens so far), 3 prompts on 2 slots, equals the
    numpy rule on parallel forwards of a float64 model, and changes the tokens."""
    from recurrax.nn import LanguageModel

    model = LanguageModel(32, 16, 2, 2, mixer="gla", mlp_ratio=2, mixer_options=dict(num_kv_heads=1, conv_size=3),
                          dtype=jnp.float64, param_dtype=jnp.float64, rngs=nnx.Rngs(5))
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6], [5, 3, 5, 8]]
    want = _greedy_by_parallel_forwards(model, prompts, 6, repetition_penalty=1.8)
    assert generate(model, prompts, 6, num_slots=2, repetition_penalty=1.8) == want
    assert generate(model, prompts, 6, num_slots=2) != want
    assert generate(model, prompts, 6, num_slots=2, repetition_penalty=1.0) == generate(model, prompts, 6, num_slots=2)


def test_penalize_repetitions_against_numpy():
    from recurrax.generation._generate import penalize_repetitions

    rng = np.random.default_rng(4)
    logits, seen = rng.normal(size=(3, 9)), rng.random((3, 9)) < 0.5
    want = np.where(seen, np.where(logits > 0, logits / 1.5, logits * 1.5), logits)
    got = penalize_repetitions(jnp.asarray(logits, jnp.float32), jnp.asarray(seen), 1.5)
    np.testing.assert_allclose(got, want, rtol=2 * np.finfo(np.float32).eps)


def test_generate_names_what_a_model_lacks():
    class HalfModel:
        vocab_size = 8

        def prefill(self, tokens, cu_seqlens, cache):
            return tokens, cache

    with pytest.raises(TypeError, match=r"HalfModel lacks generation_cache, decode_step$"):
        generate(HalfModel(), [[1]], 2)
    with pytest.raises(TypeError, match=r"int lacks vocab_size, generation_cache, prefill, decode_step$"):
        generate(3, [[1]], 2)

    class PlainModel(HalfModel):  # the whole protocol, but not an nnx.Module
        def generation_cache(self, slots, capacity):
            return ()

        def decode_step(self, tokens, cache):
            return tokens, cache

    with pytest.raises(TypeError, match=r"needs a flax.nnx.Module .*PlainModel is not one$"):
        generate(PlainModel(), [[1]], 2)


def test_tiny_save_load_round_trip(tmp_path):
    model = tiny_model()
    save_pretrained(model, tmp_path)
    again = from_pretrained(tmp_path)
    for key, value in pretrained.state_dict(model).items():
        np.testing.assert_array_equal(pretrained.state_dict(again)[key], value, err_msg=key)
    assert again.config == {**TINY, "dtype": "float32"}  # the saved dtype is recorded


def test_logits_to_keep_is_the_tail_of_the_full_logits():
    model = tiny_model()
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, TINY["vocab_size"], (2, 6)), jnp.int32)
    full, kept = model(tokens), model(tokens, logits_to_keep=2)
    assert kept.shape == (2, 2, TINY["vocab_size"])
    floor = np.finfo(np.float32).eps * TINY["hidden_size"] * float(jnp.abs(full).max())  # the head's dot order
    np.testing.assert_allclose(kept, full[:, -2:], rtol=0, atol=floor)
    with pytest.raises(ValueError, match="logits_to_keep must be in"):
        model(tokens, logits_to_keep=7)


def test_unknown_model_type_names_supported_ones():
    with pytest.raises(ValueError, match="unsupported model_type 'mamba'.*gla, retnet, hgrn2, linear_attn, lightnet"):
        CausalLM(dict(TINY, model_type="mamba"))


def test_missing_unexpected_and_misshapen_weights_are_named(tmp_path):
    model = tiny_model()
    weights = pretrained.state_dict(model)
    broken = dict(weights)
    del broken["model.layers.0.attn.q_proj.weight"]
    broken["model.layers.0.attn.extra.weight"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"missing weights \(1\): model\.layers\.0\.attn\.q_proj\.weight") as err:
        pretrained.load_weights(CausalLM(TINY), broken)
    assert "unexpected weights (1): model.layers.0.attn.extra.weight" in str(err.value)
    misshapen = dict(weights, **{"model.norm.weight": np.zeros(5, np.float32)})
    with pytest.raises(ValueError, match=r"shape mismatch for model\.norm\.weight: .*\[16\].*\[5\]"):
        pretrained.load_weights(CausalLM(TINY), misshapen)


def test_missing_safetensors_names_the_extra(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    with pytest.raises(ImportError, match=r"pip install 'recurrax\[pretrained\]'"):
        save_pretrained(tiny_model(), tmp_path)


def test_sharded_checkpoint_and_bfloat16_round_trip(tmp_path):
    """A sharded checkpoint (model.safetensors.index.json) loads; a bfloat16 model writes BF16
    tensors that load back bit for bit."""
    from safetensors.numpy import save_file

    model = tiny_model()
    weights = pretrained.state_dict(model)
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: weights[k] for k in keys}, tmp_path / shard, metadata={"format": "pt"})
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    sharded = pretrained.state_dict(from_pretrained(tmp_path))
    for key, value in weights.items():
        np.testing.assert_array_equal(sharded[key], value, err_msg=key)

    half = from_pretrained(tmp_path, dtype=jnp.bfloat16)
    save_pretrained(half, tmp_path / "bf16")
    written = load_file(tmp_path / "bf16" / "model.safetensors")
    assert {v.dtype.name for v in written.values()} == {"bfloat16"}
    again = pretrained.state_dict(from_pretrained(tmp_path / "bf16", dtype=jnp.bfloat16))
    for key, value in written.items():
        np.testing.assert_array_equal(again[key], value, err_msg=key)
        np.testing.assert_array_equal(value, weights[key].astype(value.dtype), err_msg=key)


def _numpy_attention(x, layer, window):
    """float64 reference of fla's softmax attention: RoPE (halves), GQA, causal window."""
    w = {n: np.asarray(getattr(layer, n).kernel.get_value(), np.float64)
         for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    b = {n: np.asarray(getattr(layer, n).bias.get_value(), np.float64) for n in ("q_proj", "k_proj", "v_proj")}
    T, H, Hkv, D = x.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
    q, k, v = ((x @ w[n] + b[n]).reshape(T, -1, D) for n in ("q_proj", "k_proj", "v_proj"))
    angles = np.arange(T)[:, None, None] * 10000.0 ** (-np.arange(0, D, 2) / D)
    rope = lambda a: np.concatenate([a[..., :D // 2] * np.cos(angles) - a[..., D // 2:] * np.sin(angles),  # noqa: E731
                                     a[..., D // 2:] * np.cos(angles) + a[..., :D // 2] * np.sin(angles)], -1)
    q, k = rope(q), np.repeat(rope(k), H // Hkv, axis=1)
    v = np.repeat(v, H // Hkv, axis=1)
    i, j = np.arange(T)[:, None], np.arange(T)[None]
    scores = np.where((j <= i) & (j > i - window), np.einsum("ihd,jhd->hij", q, k) * D**-0.5, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("hij,jhd->ihd", weights, v).reshape(T, -1) @ w["o_proj"]


def test_windowed_attention_parallel_packed_and_cached():
    """fla's Attention with a window (no fixture has one): parallel output against a float64
    numpy reference; packed (cu_seqlens) and token-by-token cached outputs equal it."""
    layer = pretrained.Attention(16, num_heads=4, num_kv_heads=2, qkv_bias=True, window_size=3, rngs=nnx.Rngs(1))
    for name in ("q_proj", "k_proj", "v_proj"):
        bias = getattr(layer, name).bias
        bias.set_value(0.1 * jax.random.normal(jax.random.key(len(name)), bias.get_value().shape))
    x = np.random.default_rng(0).normal(size=(2, 7, 16)).astype(np.float32)
    step = nnx.jit(lambda layer, x, cache, positions: layer(x, cache, positions=positions))
    parallel = np.asarray(layer(jnp.asarray(x)))
    for row in range(2):
        assert max_rel_error(parallel[row], _numpy_attention(x[row].astype(np.float64), layer, 3)) < 1e-5
    packed = np.asarray(layer(jnp.asarray(np.concatenate([x[0, :4], x[1]])), cu_seqlens=jnp.asarray([0, 4, 11])))
    assert max_rel_error(packed, np.concatenate([np.asarray(layer(jnp.asarray(x[:1, :4])))[0], parallel[1]])) < 1e-6
    cache, steps = layer.init_cache(2, 8), []
    for t in range(7):
        y, cache = step(layer, jnp.asarray(x[:, t:t + 1]), cache, jnp.full((2, 1), t))
        steps.append(np.asarray(y))
    assert max_rel_error(np.concatenate(steps, axis=1), parallel) < 1e-6


def test_tied_feature_map_loads_under_either_name():
    """tie_feature_map_qk: one map for q and k; PyTorch names it under feature_map_q and
    feature_map_k, and either spelling loads (transformers 5.6 cannot save such a model)."""
    config = dict(model_type="linear_attn", vocab_size=16, hidden_size=8, num_hidden_layers=1, num_heads=2,
                  feature_map="t2r", tie_feature_map_qk=True, intermediate_size=8)
    model = nnx.eval_shape(lambda: CausalLM(config))
    names = pretrained._checkpoint.tensors(model)
    weights = {n: np.full(t.to_fla(np.zeros(t.variable.get_value().shape)).shape, i, np.float32)
               for i, (n, t) in enumerate(names.items())}
    q_name = "model.layers.0.attn.feature_map_q.layer.weight"
    k_name = q_name.replace("feature_map_q", "feature_map_k")
    assert set(names) >= {q_name, k_name}
    for drop in (q_name, k_name):
        kept = {n: w for n, w in weights.items() if n != drop}
        loaded = pretrained.state_dict(pretrained.load_weights(nnx.eval_shape(lambda: CausalLM(config)), kept))
        expected = kept[k_name if drop == q_name else q_name]
        np.testing.assert_array_equal(loaded[q_name], expected)
        np.testing.assert_array_equal(loaded[k_name], expected)


@pytest.mark.parametrize("field, value, words", [
    ("d_model", "16", "config field 'd_model' must be a positive integer, got '16'"),
    ("num_layers", [1], "config field 'num_layers' must be a positive integer"),
    ("num_heads", 2.5, "config field 'num_heads' must be a positive integer"),
    ("mlp_ratio", {"x": 1}, "config field 'mlp_ratio' must be a positive integer"),
    ("mixer", ["gla"], "config field 'mixer' must be a mixer's name"),
    ("mixer_options", "x", "config field 'mixer_options' must be an object"),
    ("implementation", 3, "config field 'implementation' must be null or an implementation's name"),
    ("model_type", ["gla"], r"unsupported model_type \['gla'\]; supported:"),
])
def test_a_mistyped_language_model_config_names_the_file_and_field(tmp_path, field, value, words):
    """A saved LanguageModel's config.json with a field of the wrong kind is a ValueError naming
    the file and the field (issue 49: TypeErrors such as "unsupported operand type(s) for **",
    or an unhashable model_type without the file)."""
    from recurrax.nn import LanguageModel

    save_pretrained(LanguageModel(40, 16, 1, 2, rngs=nnx.Rngs(0)), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=rf"config.json: {words}"):
        from_pretrained(tmp_path)
