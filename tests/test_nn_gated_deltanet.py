"""`recurrax.nn.GatedDeltaNet` against a float64 numpy token loop of the same layer, decoding,
packed sequences, gradients, and `LanguageModel(mixer="gated_deltanet")`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cases import floor_tolerance, max_rel_error
from flax import nnx

from recurrax import nn as rnn
from recurrax.nn.pretrained import CachedLanguageModel

F64 = dict(dtype=jnp.float64, param_dtype=jnp.float64)
D, HK, H, K = 12, 2, 4, 4  # width, query/key heads, value heads (grouped), key head dim
TOL = 1e-10  # float64 layer against float64 loops
LOOP = dict(implementation="reference")
"""The delta rule's token loop: it compiles faster than the chunk algorithm (the default), which
`recurrax.delta_rule`'s own tests hold to it; tests that run the chunk algorithm say so."""


def make(conv_size=3, seed=0, **options):
    """A float64 layer whose parameters are all random (also the norm weight and conv biases,
    ones and zeros at initialisation), so that each one shows in the output."""
    options = {**dict(num_v_heads=H, head_dim=K, expand_v=1.5, conv_size=conv_size, **LOOP, **F64), **options}
    layer = rnn.GatedDeltaNet(D, HK, rngs=nnx.Rngs(seed), **options)
    rng = np.random.default_rng(seed + 100)
    layer.o_norm.weight[...] = jnp.asarray(1 + 0.3 * rng.standard_normal(layer.o_norm.weight.shape))
    for conv in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d):
        if conv is not None and conv.bias is not None:
            conv.bias[...] = jnp.asarray(0.2 * rng.standard_normal(conv.bias.shape), jnp.float64)
    return layer


@nnx.jit
def forward(layer, x, cache=None, cu_seqlens=None):
    """`layer(x, cache, cu_seqlens=cu_seqlens)` compiled whole: on a CPU one compilation costs
    less than running the layer op by op (the first test runs it eagerly)."""
    return layer(x, cache, cu_seqlens=cu_seqlens)


def inputs(*shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape))


# ----------------------------------------------------------------------------- the numpy token loop


def numpy_parameters(layer) -> dict:
    """The layer's parameters as float64 numpy arrays, by fla's names."""

    def get(module, name="kernel"):
        return None if module is None else np.asarray(getattr(module, name)[...], np.float64)

    convs = ("q_conv1d", "k_conv1d", "v_conv1d")
    return {
        **{name: get(getattr(layer, name)) for name in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "o_proj")},
        "g_proj": get(layer.g_proj),
        "A_log": np.asarray(layer.A_log[...], np.float64),
        "dt_bias": np.asarray(layer.dt_bias[...], np.float64),
        "norm_weight": get(layer.o_norm, "weight"),
        **{name: get(getattr(layer, name)) for name in convs},
        **{name + "_bias": None if getattr(layer, name) is None or getattr(layer, name).bias is None
           else get(getattr(layer, name), "bias") for name in convs},
    }


def silu(x):
    return x / (1 + np.exp(-x))


def numpy_gated_deltanet(p: dict, x: np.ndarray, *, num_heads: int, head_dim: int, allow_neg_eigval=False,
                         eps=1e-5, dtype=np.float64) -> np.ndarray:
    """One sequence `x [T, D]` through Gated DeltaNet, token by token, in `dtype`."""
    p = {name: None if value is None else value.astype(dtype) for name, value in p.items()}
    x = np.asarray(x, dtype)
    T = x.shape[0]
    Hv = p["A_log"].shape[0]
    groups = Hv // num_heads

    def conv_silu(y, name):  # causal depthwise convolution: y_t = Σ_j w[j] y_{t − (W − 1 − j)}
        if p[name] is None:
            return silu(y)
        w = p[name]
        W = w.shape[0]
        padded = np.concatenate([np.zeros((W - 1, y.shape[1]), dtype), y])
        out = np.stack([sum(w[j] * padded[t + j] for j in range(W)) for t in range(T)])
        if p[name + "_bias"] is not None:
            out = out + p[name + "_bias"]
        return silu(out)

    q = conv_silu(x @ p["q_proj"], "q_conv1d").reshape(T, num_heads, head_dim)
    k = conv_silu(x @ p["k_proj"], "k_conv1d").reshape(T, num_heads, head_dim)
    v = conv_silu(x @ p["v_proj"], "v_conv1d").reshape(T, Hv, -1)
    l2 = lambda y: y / np.sqrt(np.sum(y * y, axis=-1, keepdims=True) + 1e-6)  # noqa: E731
    q, k = l2(q), l2(k)
    beta = 1 / (1 + np.exp(-(x @ p["b_proj"])))
    beta = 2 * beta if allow_neg_eigval else beta
    g = -np.exp(p["A_log"]) * np.log1p(np.exp(x @ p["a_proj"] + p["dt_bias"]))  # [T, Hv]
    V = v.shape[-1]
    state = np.zeros((Hv, head_dim, V), dtype)
    o = np.zeros((T, Hv, V), dtype)
    for t in range(T):
        for h in range(Hv):
            qh, kh = q[t, h // groups], k[t, h // groups]
            s = np.exp(g[t, h]) * state[h]
            s = s + np.outer(kh, beta[t, h] * (v[t, h] - s.T @ kh))
            state[h] = s
            o[t, h] = head_dim**-0.5 * (s.T @ qh)
    o = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + eps) * p["norm_weight"]
    if p["g_proj"] is not None:
        o = o * silu((x @ p["g_proj"]).reshape(T, Hv, V))
    return o.reshape(T, -1) @ p["o_proj"]


def loop_of(layer, x, dtype=np.float64, **options):
    """The numpy loop over every row of `x [B, T, D]`."""
    p = numpy_parameters(layer)
    return np.stack([numpy_gated_deltanet(p, row, num_heads=layer.num_heads, head_dim=layer.head_dim,
                                          allow_neg_eigval=layer.allow_neg_eigval, dtype=dtype, **options)
                     for row in np.asarray(x, np.float64)])


# ----------------------------------------------------------------------------- the layer


LAYERS = {
    "grouped_value_heads_chunk": dict(implementation=None),
    "one_value_head_per_qk_head_no_conv_no_gate": dict(num_v_heads=HK, conv_size=0, use_gate=False),
    "conv_bias_negative_eigenvalues": dict(conv_size=2, conv_bias=True, allow_neg_eigval=True),
}


@pytest.mark.parametrize("options", LAYERS.values(), ids=LAYERS.keys())
def test_layer_equals_a_float64_token_loop(options):
    layer = make(**options)
    x = inputs(2, 7, D, seed=1)
    assert max_rel_error(forward(layer, x), loop_of(layer, x)) < TOL


def test_an_eager_call_equals_the_compiled_one():
    layer = make(**LAYERS["one_value_head_per_qk_head_no_conv_no_gate"])
    x = inputs(2, 7, D, seed=1)
    assert max_rel_error(layer(x), forward(layer, x)) < TOL


def test_float32_layer_is_as_close_to_float64_as_a_float32_token_loop():
    layer32 = rnn.GatedDeltaNet(D, HK, num_v_heads=H, head_dim=K, expand_v=1.5, conv_size=3, rngs=nnx.Rngs(3))
    x = inputs(2, 7, D, seed=2)  # the chunk algorithm (the default)
    exact = loop_of(layer32, x)
    floor = max_rel_error(loop_of(layer32, x, dtype=np.float32), exact)
    y = forward(layer32, x.astype(jnp.float32))
    assert y.dtype == jnp.float32
    assert max_rel_error(y, exact) < floor_tolerance(floor)


def decode(layer, x, cache, chunks):
    """Run `x [B, T, D]` through `layer` in pieces of the given lengths, carrying the cache."""
    outputs, start = [], 0
    for length in chunks:
        y, cache = forward(layer, x[:, start : start + length], cache)
        outputs.append(y)
        start += length
    return jnp.concatenate(outputs, axis=1), cache


def assert_close(x, y, tol=TOL):
    assert jax.tree.structure(x) == jax.tree.structure(y)
    for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
        assert a.shape == b.shape and max_rel_error(a, b) < tol


@pytest.mark.parametrize("conv_size", [3, pytest.param(0, marks=pytest.mark.slow)])
def test_decoding_token_by_token_equals_the_parallel_forward(conv_size):
    layer = make(conv_size)
    x = inputs(2, 7, D, seed=4)
    parallel = forward(layer, x)
    empty = layer.init_cache(2, jnp.float64)
    assert empty.state.shape == (2, H, K, 6) and empty.state.dtype == jnp.float64
    assert (empty.conv is None) == (conv_size == 0)
    if conv_size:
        assert empty.conv.shape == (2, conv_size - 1, 2 * HK * K + H * 6)
    one_by_one, final = decode(layer, x, empty, [1] * 7)
    assert max_rel_error(one_by_one, parallel) < TOL
    prefilled, final_prefill = decode(layer, x, empty, [4, 1, 2])
    assert max_rel_error(prefilled, parallel) < TOL
    assert_close(final_prefill, final)
    _, from_whole = forward(layer, x, empty)
    assert_close(from_whole, final)


def test_packed_sequences_equal_separate_rows():
    """Sequences of 4, 0, 1 and 4 tokens packed: the two long ones equal two rows of a batch,
    the one-token one equals decoding it alone, the empty one leaves its cache row empty; the
    convolution does not reach across sequence starts (the numpy loop starts each one afresh)."""
    layer = make()
    lengths = [4, 0, 1, 4]
    cu_seqlens = jnp.asarray(np.cumsum([0, *lengths]), jnp.int32)
    x = inputs(int(cu_seqlens[-1]), D, seed=6)
    packed = forward(layer, x, None, cu_seqlens)
    assert packed.shape == x.shape
    assert max_rel_error(forward(layer, x[None], None, cu_seqlens)[0], packed) < TOL
    packed_cached, cache = forward(layer, x, layer.init_cache(len(lengths), jnp.float64), cu_seqlens)
    assert max_rel_error(packed_cached, packed) < TOL
    rows, rows_cache = forward(layer, jnp.stack([x[0:4], x[5:9]]), layer.init_cache(2, jnp.float64))
    one, one_cache = forward(layer, x[None, 4:5], layer.init_cache(1, jnp.float64))
    for s, y, row_cache in [(0, rows[0], take(rows_cache, 0)), (2, one[0], take(one_cache, 0)),
                            (3, rows[1], take(rows_cache, 1))]:
        start, end = cu_seqlens[s], cu_seqlens[s + 1]
        assert max_rel_error(packed[start:end], y) < TOL
        assert max_rel_error(packed[start:end], loop_of(layer, x[None, start:end])[0]) < TOL
        assert_close(take(cache, s), row_cache)
    assert not jnp.any(cache.state[1]) and not jnp.any(cache.conv[1])


def take(cache, row):
    return jax.tree.map(lambda c: c[row], cache)


def nonzero_gradients(module, loss) -> dict:
    """Which parameter leaves get a nonzero, finite gradient from `loss(module)`."""
    grads = nnx.jit(nnx.grad(loss))(module)
    flat = jax.tree_util.tree_flatten_with_path(nnx.state(grads, nnx.Param))[0]
    return {jax.tree_util.keystr(path): bool(jnp.all(jnp.isfinite(g)) and jnp.any(g != 0)) for path, g in flat}


@pytest.mark.parametrize("implementation", ["reference", pytest.param(None, marks=pytest.mark.slow)])
def test_gradient_reaches_every_parameter(implementation):
    layer = make(conv_bias=True, implementation=implementation)  # None: the chunk algorithm's backward
    x, weights = inputs(2, 7, D, seed=7), inputs(2, 7, D, seed=8)
    reached = nonzero_gradients(layer, lambda layer: jnp.sum(layer(x) * weights))
    assert len(reached) == 16 and all(reached.values()), reached  # 7 projections, A_log, dt_bias, norm, 3 convs × 2


def test_initialisation_and_parameter_names():
    layer = rnn.GatedDeltaNet(64, 4, num_v_heads=8, rngs=nnx.Rngs(0))
    assert (layer.head_dim, layer.head_v_dim) == (16, 32)  # d_model // num_heads, × expand_v = 2
    A = np.exp(np.asarray(layer.A_log[...]))
    dt = np.log1p(np.exp(np.asarray(layer.dt_bias[...])))  # softplus
    assert A.shape == dt.shape == (8,)
    assert np.all((A >= 1) & (A <= 16)) and np.all((dt >= 1e-3 * (1 - 1e-5)) & (dt <= 0.1 * (1 + 1e-5)))
    names = {".".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
    assert names == {"A_log", "dt_bias", "o_norm.weight"} | {
        f"{name}.kernel" for name in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj",
                                      "q_conv1d", "k_conv1d", "v_conv1d")}
    assert layer.q_proj.kernel.shape == (64, 64) and layer.v_proj.kernel.shape == (64, 256)
    assert layer.v_conv1d.kernel.shape == (4, 256) and layer.o_proj.kernel.shape == (256, 64)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(num_v_heads=3), "num_v_heads"),
        (dict(expand_v=0.3), "expand_v"),
        (dict(conv_size=1), "conv_size"),
        (dict(implementation="triton"), "implementation"),
        (dict(norm_eps=-1.0), "norm_eps must be a finite number > 0"),  # issue 49: these gave NaN outputs
        (dict(norm_eps=float("nan")), "norm_eps must be a finite number > 0"),
        (dict(norm_eps=0.0), "norm_eps must be a finite number > 0"),
        (dict(norm_eps="1e-5"), "norm_eps must be a finite number > 0"),
    ],
)
def test_configuration_errors_name_the_option(options, match):
    with pytest.raises(ValueError, match=match):
        rnn.GatedDeltaNet(D, HK, **{**dict(num_v_heads=H, head_dim=K), **options}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="num_heads must divide d_model"):
        rnn.GatedDeltaNet(D, 5, rngs=nnx.Rngs(0))


def test_input_and_cache_errors_name_the_argument():
    layer = make()
    with pytest.raises(ValueError, match="^x "):
        layer(inputs(2, 3, D + 1))
    with pytest.raises(ValueError, match=r"^cache\.state "):
        layer(inputs(2, 3, D), cache=layer.init_cache(3, jnp.float64))
    with pytest.raises(ValueError, match=r"^cache\.conv "):
        layer(inputs(2, 3, D), cache=make(conv_size=2).init_cache(2, jnp.float64))
    with pytest.raises(TypeError, match="^cache "):
        layer(inputs(2, 3, D), cache=jnp.zeros((2, H, K, 6)))


@pytest.mark.parametrize("shape, packed", [((2, 0, D), False), ((0, 3, D), False), ((0, D), True)])
def test_an_empty_input_names_the_argument(shape, packed):
    """Zero tokens or rows are a ValueError naming `x` / `tokens` (issue 49: ZeroDivisionError
    from a reshape), in the layer and in the language model."""
    cu_seqlens = jnp.array([0, 0, 0]) if packed else None
    with pytest.raises(ValueError, match=r"^x must have at least one batch row and one token .*got shape"):
        make()(jnp.zeros(shape), cu_seqlens=cu_seqlens)
    with pytest.raises(ValueError, match=r"^tokens must have at least one batch row and one token .*got shape"):
        small_model()(jnp.zeros(shape[:-1], jnp.int32), cu_seqlens=cu_seqlens)


# ----------------------------------------------------------------------------- the language model


def small_model(num_layers: int = 1):
    return rnn.LanguageModel(32, D, num_layers, HK, mixer="gated_deltanet", mlp_ratio=2, rngs=nnx.Rngs(1),
                             mixer_options=dict(num_v_heads=H, head_dim=K, conv_size=2), **LOOP, **F64)


def test_language_model_forward_decode_packed_and_gradients():
    model = small_model()
    assert isinstance(model.blocks[0].mixer, rnn.GatedDeltaNet) and isinstance(model, CachedLanguageModel)
    assert model.config["mixer"] == "gated_deltanet"
    tokens = jnp.asarray(np.random.default_rng(9).integers(0, 32, (2, 6)), jnp.int32)
    logits = forward(model, tokens)
    assert logits.shape == (2, 6, 32)
    # generate's protocol: one-token steps from an empty cache, a packed prefill of ragged prompts
    step = nnx.jit(lambda model, *args: model.decode_step(*args))
    cache, outputs = model.generation_cache(2), []
    assert cache.layers[0].state.dtype == jnp.float64
    for t in range(6):
        step_logits, cache = step(model, tokens[:, t], cache)
        outputs.append(step_logits)
    assert max_rel_error(jnp.stack(outputs, axis=1), logits) < TOL
    prompts = jnp.concatenate([tokens[0, :4], tokens[1, :2]])
    prefill = nnx.jit(lambda model, *args: model.prefill(*args))
    prefill_logits, cache = prefill(model, prompts, jnp.asarray([0, 4, 6], jnp.int32), model.generation_cache(2))
    assert prefill_logits.shape == (2, 32)  # each prompt's last token's
    assert max_rel_error(prefill_logits, jnp.stack([logits[0, 3], logits[1, 1]])) < TOL
    step_logits, _ = step(model, jnp.asarray([tokens[0, 4], tokens[1, 2]]), cache)
    assert max_rel_error(step_logits, jnp.stack([logits[0, 4], logits[1, 2]])) < TOL
    weights = inputs(2, 6, 32, seed=10)
    reached = nonzero_gradients(model, lambda model: jnp.sum(model(tokens) * weights))
    assert len(reached) == 19 and all(reached.values()), reached  # 13 in the mixer, 2 norms, MLP, embedding, norm


def test_the_demo_offers_the_mixer():
    from recurrax.tools import demo

    assert "gated_deltanet" in demo.mixer_names()
    [config] = demo.configs_from(demo.parse_args(["--mixer", "gated_deltanet", "--quick"]))
    assert config.mixer == "gated_deltanet"


@pytest.mark.slow
def test_the_demo_trains_it_and_decodes_exactly():
    from recurrax.tools import demo
    from recurrax.tools.mqar import MQARConfig

    config = demo.TrainConfig(task=MQARConfig(vocab_size=16, seq_len=12, num_pairs=3), mixer="gated_deltanet",
                              d_model=16, num_layers=1, num_heads=2, mlp_ratio=1, steps=40, batch_size=16,
                              learning_rate=1e-2, warmup=5)
    graphdef, params, history, _ = demo.train(config, evals=2, progress=False)
    assert history.loss[-1] < 0.85 * history.loss[0]
    assert demo.decode_check(graphdef, params, config, batch_size=4).matches


def test_sequence_parallel_rules_run_parallel_delta_rule():
    """Under rules that put `length` on a mesh axis the layer runs `parallel.delta_rule` (one
    all-gather of the shards' transfers) and equals one device (float64)."""
    model = small_model()
    tokens = jnp.asarray(np.random.default_rng(11).integers(0, 32, (2, 8)), jnp.int32)
    want = forward(model, tokens)
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ("data", "sequence"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with rnn.use_mesh(mesh, rnn.logical_rules("data", "sequence")):
        got = forward(model, tokens)
        program = jax.jit(lambda tokens: nnx.merge(*nnx.split(model))(tokens)).lower(tokens).as_text()
    assert "all-gather" in program or "all_gather" in program
    assert max_rel_error(got, want) < TOL
