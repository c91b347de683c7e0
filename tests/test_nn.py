"""`recurrax.nn`: the mixers and the language model, in float64 so equalities are exact."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cases import max_rel_error
from flax import nnx

from recurrax import nn as rnn
from recurrax.nn.pretrained import ModelCache

F64 = dict(dtype=jnp.float64, param_dtype=jnp.float64)
D, H, HKV, K, V = 16, 4, 2, 6, 4
TOL = 1e-12
MIXERS = sorted(set(rnn.MIXERS) - {"gated_deltanet"})  # RecurrentMixer's options; GDN: test_nn_gated_deltanet.py


def make(name: str, conv_size: int = 3, **options):
    options = {**dict(num_kv_heads=HKV, qk_head_dim=K, v_head_dim=V, conv_size=conv_size, **F64), **options}
    return rnn.make_mixer(name, D, H, layer_idx=1, num_layers=3, rngs=nnx.Rngs(0), **options)


def inputs(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape))


def decode(layer, x, cache, chunks):
    """Run `x` [B, T, D] through `layer` in pieces of the given lengths, carrying the cache."""
    outputs, start = [], 0
    for length in chunks:
        y, cache = layer(x[:, start : start + length], cache=cache)
        outputs.append(y)
        start += length
    return jnp.concatenate(outputs, axis=1), cache


def assert_close(x, y, tol=TOL):
    assert jax.tree.structure(x) == jax.tree.structure(y)
    for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
        assert a.shape == b.shape and max_rel_error(a, b) < tol


@pytest.mark.parametrize("name", MIXERS)
def test_output_and_cache_shapes(name):
    layer = make(name)
    x = inputs(2, 5, D)
    assert layer(x).shape == (2, 5, D)
    y, cache = layer(x, cache=layer.init_cache(2, jnp.float64))
    assert y.shape == (2, 5, D)
    assert cache.state.shape == (2, H, K, V) and cache.state.dtype == jnp.float64
    assert cache.conv.shape == (2, 2, H * K + HKV * K + HKV * V)
    cu_seqlens = jnp.asarray([0, 2, 2, 3, 7], jnp.int32)  # test_packed_sequences_equal_separate_sequences' shapes
    assert layer(x.reshape(10, D)[:7], cu_seqlens=cu_seqlens).shape == (7, D)
    assert layer(x.reshape(1, 10, D)[:, :7], cu_seqlens=cu_seqlens).shape == (1, 7, D)
    assert make(name, conv_size=0).init_cache(3).conv is None


@pytest.mark.parametrize("conv_size", [0, 3])
@pytest.mark.parametrize("name", MIXERS)
def test_parallel_forward_equals_token_by_token_decoding(name, conv_size):
    layer = make(name, conv_size)
    x = inputs(2, 5, D, seed=1)  # test_output_and_cache_shapes' shapes: its compiled calls serve here
    parallel = layer(x)
    empty = layer.init_cache(2, jnp.float64)
    one_by_one, final = decode(layer, x, empty, [1] * 5)
    assert max_rel_error(one_by_one, parallel) < TOL
    prefilled, final_prefill = decode(layer, x, empty, [3, 1, 1])
    assert max_rel_error(prefilled, parallel) < TOL
    assert_close(final_prefill, final)
    _, from_whole = layer(x, cache=empty)
    assert_close(from_whole, final)


@pytest.mark.parametrize("name", MIXERS)
def test_packed_sequences_equal_separate_sequences(name):
    layer = make(name)
    lengths = [2, 0, 1, 4]
    cu_seqlens = jnp.asarray(np.cumsum([0, *lengths]), jnp.int32)
    x = inputs(int(cu_seqlens[-1]), D, seed=2)
    packed = layer(x, cu_seqlens=cu_seqlens)
    packed_cached, cache = layer(x, cache=layer.init_cache(len(lengths), jnp.float64), cu_seqlens=cu_seqlens)
    assert max_rel_error(packed_cached, packed) < TOL
    for s, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        if end == start:
            assert not jnp.any(cache.state[s]) and not jnp.any(cache.conv[s])
            continue
        alone, alone_cache = layer(x[None, start:end], cache=layer.init_cache(1, jnp.float64))
        assert max_rel_error(packed[start:end], alone[0]) < TOL
        assert_close(jax.tree.map(lambda c: c[s], cache), jax.tree.map(lambda c: c[0], alone_cache))


@pytest.mark.parametrize("name", ["gla", "linear"])
def test_packed_prefill_continues_in_packed_pieces(name):
    """Two packed calls carrying the cache equal one packed call over the joined sequences."""
    layer = make(name)
    first, second = [2, 0, 3], [1, 2, 1]
    x = inputs(3, 5, D, seed=3)  # sequence s is x[s, :first[s] + second[s]]
    pack = lambda piece: jnp.concatenate([x[s, a:b] for s, (a, b) in enumerate(piece)])  # noqa: E731
    cu = lambda lengths: jnp.asarray(np.cumsum([0, *lengths]), jnp.int32)  # noqa: E731
    empty = layer.init_cache(3, jnp.float64)
    y1, cache = layer(pack([(0, n) for n in first]), cache=empty, cu_seqlens=cu(first))
    y2, cache = layer(pack([(n, n + m) for n, m in zip(first, second)]), cache=cache, cu_seqlens=cu(second))
    whole = [n + m for n, m in zip(first, second)]
    y, whole_cache = layer(pack([(0, n) for n in whole]), cache=empty, cu_seqlens=cu(whole))
    starts1, starts2, starts = np.cumsum([0, *first]), np.cumsum([0, *second]), np.cumsum([0, *whole])
    for s in range(3):
        joined = jnp.concatenate([y1[starts1[s] : starts1[s + 1]], y2[starts2[s] : starts2[s + 1]]])
        assert max_rel_error(joined, y[starts[s] : starts[s + 1]]) < TOL
    assert_close(cache, whole_cache)


def nonzero_gradients(module, loss) -> dict:
    """Which parameter leaves get a nonzero, finite gradient from `loss(module)` (compiled as one
    program: op by op, the backward pass re-traces and compiles every scan)."""
    grads = nnx.jit(nnx.grad(loss))(module)
    flat = jax.tree_util.tree_flatten_with_path(nnx.state(grads, nnx.Param))[0]
    return {jax.tree_util.keystr(path): bool(jnp.all(jnp.isfinite(g)) and jnp.any(g != 0)) for path, g in flat}


@pytest.mark.parametrize("name", MIXERS)
def test_gradient_reaches_every_parameter(name):
    layer = make(name)
    x = inputs(2, 5, D, seed=4)
    weights = inputs(2, 5, D, seed=5)
    reached = nonzero_gradients(layer, lambda layer: jnp.sum(layer(x) * weights))
    assert reached and all(reached.values()), reached


@pytest.mark.parametrize("name", ["gla", "lightning"])
def test_under_jit(name):
    layer = make(name)
    x = inputs(2, 4, D, seed=6)
    eager = layer(x)
    assert max_rel_error(nnx.jit(lambda layer, x: layer(x))(layer, x), eager) < TOL
    step = nnx.jit(lambda layer, x, cache: layer(x, cache=cache))
    cache, outputs = layer.init_cache(2, jnp.float64), []
    for t in range(4):
        y, cache = step(layer, x[:, t : t + 1], cache)
        outputs.append(y)
    assert max_rel_error(jnp.concatenate(outputs, axis=1), eager) < TOL


def test_float32_and_bfloat16_layers():
    x = inputs(2, 4, D, seed=7)
    for dtype in (jnp.float32, jnp.bfloat16):
        layer = rnn.GatedLinearAttention(D, H, num_kv_heads=HKV, conv_size=2, dtype=dtype, rngs=nnx.Rngs(0))
        y = layer(x.astype(dtype))
        assert y.dtype == dtype and bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))
        _, cache = layer(x.astype(dtype), cache=layer.init_cache(2))
        assert cache.state.dtype == jnp.float32


def test_fixed_decays():
    assert np.allclose(rnn.retention_log_decays(3), np.log(1 - 2.0 ** -np.arange(5, 8)))
    assert np.allclose(rnn.alibi_slopes(4), [2**-2, 2**-4, 2**-6, 2**-8])
    assert np.allclose(rnn.alibi_slopes(6), [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])
    slopes = np.asarray(rnn.alibi_slopes(4))
    assert np.allclose(rnn.lightning_log_decays(4, 0, 3), -slopes * (1 + 1e-5))
    assert np.allclose(rnn.lightning_log_decays(4, 1, 3), -slopes * (0.5 + 1e-5))
    assert np.allclose(rnn.lightning_log_decays(4, 2, 3), -slopes * 1e-5)
    assert np.allclose(rnn.lightning_log_decays(4, 0, 1), -slopes * (1 + 1e-5))


def test_lightning_decay_form_option():
    from recurrax.decays import lightning_g_gamma

    for form in ("alibi", "ejkernel"):
        layer = rnn.LightningAttention(D, 4, layer_idx=1, num_layers=3, decay_form=form, rngs=nnx.Rngs(0))
        assert np.allclose(layer._decays(inputs(2, 3, D))["g_gamma"], lightning_g_gamma(4, 1, 3, form))
    assert np.allclose(rnn.LightningAttention(D, 4, layer_idx=1, num_layers=3, rngs=nnx.Rngs(0))._decays(None)["g_gamma"],
                       rnn.lightning_log_decays(4, 1, 3))  # the default stays the ALiBi form
    with pytest.raises(ValueError, match="form"):
        rnn.LightningAttention(D, 4, decay_form="minimax", rngs=nnx.Rngs(0))


def test_gla_decays_are_per_key_channel_and_non_positive():
    layer = make("gla")
    decays = layer._decays(inputs(2, 3, D))["g"]
    assert decays.shape == (2, 3, H, K) and bool(jnp.all(decays <= 0))


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: make("gla", num_kv_heads=3), "num_kv_heads"),
        (lambda: make("linear", feature_map="tanh"), "feature_map"),
        (lambda: make("retnet", output_gate="gelu"), "output_gate"),
        (lambda: make("gla", conv_size=1), "kernel_size"),
        (lambda: make("mamba"), "mixer"),
        (lambda: rnn.LightningAttention(D, H, layer_idx=2, num_layers=2, rngs=nnx.Rngs(0)), "layer_idx"),
    ],
)
def test_configuration_errors_name_the_option(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_input_errors_name_the_argument():
    layer = make("gla")
    with pytest.raises(ValueError, match="^x "):
        layer(inputs(2, 3, D + 1))
    with pytest.raises(ValueError, match="^x "):
        layer(inputs(6, D))
    with pytest.raises(ValueError, match=r"^cache\.state "):
        layer(inputs(2, 3, D), cache=layer.init_cache(3, jnp.float64))
    with pytest.raises(ValueError, match=r"^cache\.conv "):
        layer(inputs(2, 3, D), cache=make("gla", conv_size=2).init_cache(2, jnp.float64))
    with pytest.raises(TypeError, match="^cache "):
        layer(inputs(2, 3, D), cache=jnp.zeros((2, H, K, V)))
    for empty in (inputs(2, 0, D), inputs(0, 3, D)):  # issue 49: ZeroDivisionError from a reshape
        with pytest.raises(ValueError, match="^x must have at least one batch row and one token"):
            layer(empty)


def small_model(mixer: str, num_layers: int = 2, **options):
    return rnn.LanguageModel(
        32, D, num_layers, H, mixer=mixer, mlp_ratio=2, rngs=nnx.Rngs(1),
        mixer_options=dict(num_kv_heads=HKV, conv_size=2, **options), **F64,
    )


@pytest.mark.parametrize("mixer", ["gla", "retnet"])
def test_language_model_decodes_like_its_parallel_forward(mixer):
    model = small_model(mixer)
    tokens = jnp.asarray(np.random.default_rng(8).integers(0, 32, (2, 6)), jnp.int32)
    logits = model(tokens)
    assert logits.shape == (2, 6, 32)
    cache, outputs = model.init_cache(2, jnp.float64), []
    for t in range(6):
        step_logits, cache = model(tokens[:, t : t + 1], cache=cache)
        outputs.append(step_logits)
    assert max_rel_error(jnp.concatenate(outputs, axis=1), logits) < TOL
    assert type(cache) is ModelCache and np.array_equal(cache.positions, [6, 6])  # the families' cache type
    assert len(cache.layers) == 2 and all(isinstance(c, rnn.MixerCache) for c in cache.layers)


def test_language_model_packed_and_gradients():
    model = small_model("lightning", num_layers=1)
    tokens = jnp.asarray(np.random.default_rng(9).integers(0, 32, 7), jnp.int32)
    cu_seqlens = jnp.asarray([0, 4, 7], jnp.int32)
    packed = model(tokens, cu_seqlens=cu_seqlens)
    assert max_rel_error(packed[:4], model(tokens[None, :4])[0]) < TOL
    assert max_rel_error(packed[4:], model(tokens[None, 4:])[0]) < TOL
    weights = inputs(7, 32, seed=10)
    reached = nonzero_gradients(model, lambda model: jnp.sum(model(tokens, cu_seqlens=cu_seqlens) * weights))
    assert len(reached) > 8 and all(reached.values()), reached
    cache = model.init_cache(1)
    with pytest.raises(ValueError, match="^cache must hold one cache per layer"):
        model(tokens[None], cache=cache._replace(layers=cache.layers * 2))
    with pytest.raises(TypeError, match="^cache must be a ModelCache"):
        model(tokens[None], cache=cache.layers)  # a tuple of per-block states (its cache until now)


def test_head_counts_must_divide_the_width():
    with pytest.raises(ValueError, match=r"num_heads must divide d_model=64.*got num_heads=5"):
        rnn.GatedLinearAttention(64, num_heads=5, rngs=nnx.Rngs(0))
    layer = rnn.GatedLinearAttention(64, num_heads=5, qk_head_dim=8, v_head_dim=8, rngs=nnx.Rngs(0))
    assert layer(inputs(1, 3, 64)).shape == (1, 3, 64)  # explicit head dims: any head count


def test_a_one_dimensional_input_hints_at_cu_seqlens():
    with pytest.raises(ValueError, match=r"^tokens must be \[batch, seq_len\].*pass cu_seqlens"):
        small_model("gla")(jnp.zeros((32,), jnp.int32))
    with pytest.raises(TypeError, match="^tokens must be an integer array"):
        small_model("gla")(jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match=r"^x must be .*pass cu_seqlens"):
        make("gla")(inputs(6, D))


@pytest.mark.parametrize("cls", [rnn.GatedLinearAttention, rnn.MultiScaleRetention, rnn.LightningAttention,
                                 rnn.LinearAttention])
def test_help_shows_the_real_signature_and_arguments(cls):
    import inspect
    import pydoc

    parameters = inspect.signature(cls).parameters
    assert list(parameters)[:2] == ["d_model", "num_heads"]
    assert {"num_kv_heads", "conv_size", "implementation", "rngs"} <= set(parameters)
    assert "options" not in parameters and "args" not in parameters
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    assert "num_kv_heads" in text and "`implementation`" in text


def test_implementation_is_passed_through():
    x = inputs(2, 5, D)
    layer = make("gla", implementation="scan")
    assert max_rel_error(layer(x), make("gla")(x)) < TOL
    with pytest.raises(ValueError, match="implementation='pallas_gpu' cannot run this call"):
        make("gla", implementation="pallas_gpu")(x)
    with pytest.raises(ValueError, match="implementation must be one of"):
        make("gla", implementation="no-such")
    model = rnn.LanguageModel(32, D, 1, H, implementation="pallas_gpu", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="pallas_gpu"):
        model(jnp.zeros((1, 4), jnp.int32))


def test_missing_flax_names_the_extra(monkeypatch):
    import importlib
    import sys

    for module in [m for m in sys.modules if m.startswith("flax.") or m.startswith("recurrax.nn")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "flax", None)  # `import flax` now fails as if it were not installed
    with pytest.raises(ImportError, match=r"pip install 'recurrax\[nn\]'"):
        importlib.import_module("recurrax.nn")
