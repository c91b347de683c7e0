"""recurrax.nn's mixture of experts: the routed path against every expert on every token.

References written here, independent of `recurrax.nn._moe`:
- the router in numpy float64: scores, group-limited choice, a stable descending sort (ties
  to the lower expert index, as `torch.topk`), weights;
- the experts in float64: every expert on every token, masked by the routing's dense
  weights, differentiated by `jax.grad` for the input, router and expert-weight gradients.
The routed float32 result is held to `floor_tolerance` of the floor measured here: the same
dense formula evaluated in float32 against float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cases import equations, float64, floor_tolerance

import recurrax.nn as rnn
from recurrax.nn import MixtureOfExperts
from recurrax.nn._moe import (
    ExpertWeights,
    Routing,
    dispatch,
    padded_rows,
    route,
    routed_experts,
)

nnx = pytest.importorskip("flax.nnx")


# --------------------------------------------------------------------------- router reference


def reference_route(logits, top_k, *, score="softmax", renormalize=False, select_on="scores", bias=None,
                    n_group=1, topk_group=None, routed_scaling=1.0):
    """Experts `[n, k]` and weights `[n, k]` in numpy float64."""
    logits = np.asarray(logits, np.float64)
    if score == "softmax":
        exp = np.exp(logits - logits.max(-1, keepdims=True))
        scores = exp / exp.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    choice = (scores if select_on == "scores" else logits) + (0 if bias is None else np.asarray(bias, np.float64))
    n, E = logits.shape
    if n_group > 1:
        size = E // n_group
        choice = choice.copy()
        for t in range(n):
            groups = choice[t].reshape(n_group, size)
            best_two = -np.sort(-groups, axis=-1)[:, : min(2, size)].sum(-1)
            kept = np.argsort(-best_two, kind="stable")[: topk_group or n_group]
            for g in range(n_group):
                if g not in kept:
                    choice[t, g * size:(g + 1) * size] = -np.inf
    experts = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(scores, experts, -1)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + (1e-20 if score == "sigmoid" else 0.0))
    return experts, weights * routed_scaling


def tied_logits(seed, n, E):
    """Logits on a coarse grid (multiples of 1/2 in [−2, 2]): many exact ties per row."""
    return jnp.asarray(np.random.default_rng(seed).integers(-4, 5, (n, E)) / 2, jnp.float32)


def test_top_k_breaks_ties_to_the_lower_index():
    values = jnp.array([[1.0, 3.0, 2.0, 3.0, 3.0, 2.0]])
    np.testing.assert_array_equal(jax.lax.top_k(values, 4)[1], [[1, 3, 4, 2]])
    np.testing.assert_array_equal(route(values, 4, select_on="logits").experts, [[1, 3, 4, 2]])


ROUTERS = [
    dict(score="softmax", renormalize=False),
    dict(score="softmax", renormalize=True),
    dict(score="softmax", renormalize=True, select_on="logits"),
    dict(score="sigmoid", renormalize=True, bias=True, routed_scaling=2.5),
    dict(score="sigmoid", renormalize=False, bias=True, n_group=4, topk_group=2),
    dict(score="softmax", renormalize=True, n_group=2, topk_group=1),
    dict(score="sigmoid", renormalize=True, bias=True, n_group=8, topk_group=3),  # one expert per group
]


@pytest.mark.parametrize("options", ROUTERS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_route_matches_reference_with_ties(options, top_k):
    options = dict(options)
    n, E = 48, 8
    if options.get("topk_group") and top_k > options["topk_group"] * E // options["n_group"]:
        top_k = options["topk_group"] * E // options["n_group"]  # at most the experts left
    logits = tied_logits(top_k, n, E)
    bias = tied_logits(100 + top_k, 1, E)[0] / 4 if options.pop("bias", False) else None
    got = jax.jit(lambda l, b: route(l, top_k, bias=b, **options))(logits, bias)
    experts, weights = reference_route(np.asarray(logits), top_k, bias=None if bias is None else np.asarray(bias),
                                       **options)
    np.testing.assert_array_equal(got.experts, experts)
    np.testing.assert_allclose(got.weights, weights, rtol=1e-6, atol=1e-7)


def test_route_refuses_bad_options():
    logits = jnp.zeros((2, 6))
    with pytest.raises(ValueError, match="top_k"):
        route(logits, 7)
    with pytest.raises(ValueError, match="n_group"):
        route(logits, 2, n_group=4)
    with pytest.raises(ValueError, match="score"):
        route(logits, 2, score="relu")


# ------------------------------------------------------------------------- dispatch invariants


@pytest.mark.parametrize("block", [1, 4, 16])
def test_dispatch_places_every_pair_once_within_the_bound(block):
    n, k, E = 23, 3, 7
    experts = jnp.asarray(np.random.default_rng(block).integers(0, E, (n, k)) * (np.arange(k) < 2) + 0)
    experts = experts.at[:, 2].set(6)  # a crowded expert
    routed = dispatch(experts, E, block)
    rows, positions = np.asarray(routed.rows), np.asarray(routed.positions)
    assert rows.shape == (padded_rows(n * k, E, block),)
    np.testing.assert_array_equal(rows[positions], np.repeat(np.arange(n)[:, None], k, 1))
    assert len(set(positions.ravel())) == n * k and (rows == n).sum() == rows.size - n * k
    blocks = np.asarray(routed.block_experts)
    for t in range(n):
        for j in range(k):
            assert blocks[positions[t, j] // block] == int(experts[t, j])
    np.testing.assert_array_equal(np.asarray(routed.group_sizes) % block, 0)


# -------------------------------------------------------------------------- experts reference


def reference_experts(x, dense, up, down, gate, *, act, transposed, limit=None):
    """Every expert on every token, `Σ_e dense[t, e] FFN_e(x_t)` (jax.numpy, the inputs' dtype);
    `limit` L: the gated FFN's `min(act(G), L) ⊙ clip(U, −L, L)`."""
    if transposed:
        up, down = jnp.swapaxes(up, 1, 2), jnp.swapaxes(down, 1, 2)
        gate = None if gate is None else jnp.swapaxes(gate, 1, 2)
    out = jnp.zeros_like(x)
    for e in range(up.shape[0]):
        hidden = act(x @ (up[e] if gate is None else gate[e]))
        if gate is not None and limit is not None:
            hidden = jnp.minimum(hidden, limit) * jnp.clip(x @ up[e], -limit, limit)
        elif gate is not None:
            hidden = hidden * (x @ up[e])
        out = out + dense[:, e, None] * (hidden @ down[e])
    return out


def dense_weights(experts, weights, E):
    n = experts.shape[0]
    return jnp.zeros((n, E), weights.dtype).at[jnp.arange(n)[:, None], experts].add(weights)


def layer_case(seed, n, D, F, E, *, gated, transposed):
    rng = np.random.default_rng(seed)
    f32 = lambda *shape, scale=1.0: jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)  # noqa: E731
    shape_in, shape_out = ((E, F, D), (E, D, F)) if transposed else ((E, D, F), (E, F, D))
    weights = ExpertWeights(f32(*shape_in, scale=D ** -0.5), f32(*shape_out, scale=F ** -0.5),
                            f32(*shape_in, scale=D ** -0.5) if gated else None)
    return f32(n, D), f32(D, E, scale=0.5 * D ** -0.5), weights


ACTS = {"silu": jax.nn.silu, "relu2": lambda v: jnp.square(jax.nn.relu(v))}

LAYERS = [  # (n, D, F, E, k, router options, method, block, gated, transposed, act, limit); "blocks" one block per step
    pytest.param(29, 8, 6, 6, 2, dict(renormalize=True), "blocks", 4, True, False, "silu", None, id="softmax-k2-B4"),
    pytest.param(29, 8, 6, 6, 6, dict(renormalize=True), "blocks", 8, True, False, "silu", None, id="k=E"),
    pytest.param(17, 8, 6, 8, 3, dict(score="sigmoid", renormalize=True, n_group=4, topk_group=2,
                                      routed_scaling=1.5), "blocks", 1, False, True, "relu2", None, id="groups-B1"),
    pytest.param(29, 8, 6, 6, 2, dict(select_on="logits", renormalize=True), "ragged", 1, True, True, "silu",
                 None, id="ragged"),
    pytest.param(64, 16, 12, 16, 4, dict(renormalize=False), None, None, True, False, "silu", None, id="defaults"),
    pytest.param(200, 32, 24, 32, 8, dict(score="sigmoid", renormalize=True, n_group=4, topk_group=2),
                 "blocks", 16, True, False, "silu", None, id="larger", marks=pytest.mark.slow),
    pytest.param(200, 32, 24, 32, 32, dict(renormalize=True), "blocks", 8, True, True, "silu", None,
                 id="larger-k=E", marks=pytest.mark.slow),
    pytest.param(29, 8, 6, 6, 2, dict(score="sigmoid", renormalize=True), "blocks", 4, True, True, "silu", 0.5,
                 id="clipped-blocks"),
    pytest.param(29, 8, 6, 6, 2, dict(renormalize=True), "ragged", 1, True, False, "silu", 0.5, id="clipped-ragged"),
]


def max_rel(a, b):
    """max |a − b| / max |b| (max |a| where b is all zero: the selection-only bias's gradient)."""
    scale = float(jnp.max(jnp.abs(b)))
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float64) - b))) / (scale or 1.0)


@pytest.mark.parametrize("n, D, F, E, k, options, method, block, gated, transposed, act, limit", LAYERS)
def test_routed_equals_all_experts_forward_and_gradients(n, D, F, E, k, options, method, block, gated,
                                                         transposed, act, limit):
    """The routed experts' output and gradients against every expert on every token (float64),
    within `floor_tolerance` of the reference's own float32 error; `limit`: clipped SwiGLU
    (Ling's): with G and U of unit scale, limit 0.5 clips about a fifth of act(G), three fifths of U."""
    x, router, weights = layer_case(n + E + k, n, D, F, E, gated=gated, transposed=transposed)
    x = x.at[: n // 3].set(x[n // 3: 2 * (n // 3)])  # repeated tokens: tied router rows
    act_fn = ACTS[act]
    chosen = route(x @ router, k, **options).experts  # the selection both sides use (it has no gradient)

    def routed(x, router, weights):
        return routed_experts(x, route(x @ router, k, **options), weights, act=act_fn, transposed=transposed,
                              method=method, block_size=block, limit=limit)

    def reference(x, router, weights):
        experts, w = reference_weights(x @ router, chosen, **options)
        return reference_experts(x, dense_weights(experts, w, E), weights.up, weights.down, weights.gate,
                                 act=act_fn, transposed=transposed, limit=limit)

    cotangent = jnp.asarray(np.random.default_rng(1).standard_normal((n, D)), jnp.float32)

    def both(fn, *args):
        y, pull = jax.vjp(fn, *args)
        return (y, *pull(cotangent.astype(y.dtype)))

    got = jax.jit(lambda *a: both(routed, *a))(x, router, weights)
    exact = both(reference, *float64((x, router, weights)))
    single = both(reference, x, router, weights)
    np.testing.assert_array_equal(route(x @ router, k, **options).experts, chosen)
    if method == "blocks" and block > 1:  # the bound P holds whole blocks of padding alone: steps skipped
        assert int(dispatch(chosen, E, block).group_sizes.sum()) <= padded_rows(n * k, E, block) - block
    names = ["output", "d x", "d router", "d weights"]
    for name, ours, ref, f32 in zip(names, got, exact, single):
        for leaf_ours, leaf_ref, leaf_f32 in zip(*(jax.tree.leaves(t) for t in (ours, ref, f32))):
            floor = max_rel(leaf_f32, leaf_ref)
            assert max_rel(leaf_ours, leaf_ref) <= floor_tolerance(floor), (name, max_rel(leaf_ours, leaf_ref), floor)


def test_routed_experts_refuse_a_limit_without_a_gate():
    x, router, weights = layer_case(0, 5, 8, 6, 4, gated=False, transposed=False)
    with pytest.raises(ValueError, match="limit=0.5 clips a gated FFN"):
        routed_experts(x, route(x @ router, 2), weights, limit=0.5)


def reference_weights(logits, experts, *, score="softmax", renormalize=False, select_on="scores",
                      n_group=1, topk_group=None, routed_scaling=1.0):
    """The routing weights of the chosen `experts` from `logits` (differentiable, any dtype)."""
    del select_on, n_group, topk_group  # the choice is given
    scores = jax.nn.softmax(logits, -1) if score == "softmax" else jax.nn.sigmoid(logits)
    w = jnp.take_along_axis(scores, experts, -1)
    if renormalize:
        w = w / (w.sum(-1, keepdims=True) + (1e-20 if score == "sigmoid" else 0.0))
    return experts, w * routed_scaling


# ----------------------------------------------------------------------------- the nnx module


def test_mixture_of_experts_module_with_shared_expert_under_vmap():
    D, E, F, S, k = 8, 8, 6, 5, 2
    layer = MixtureOfExperts(D, E, F, k, score="sigmoid", selection_bias=True, n_group=2, topk_group=1,
                             routed_scaling=2.0, shared_width=S, block_size=4, rngs=nnx.Rngs(0))
    layer.bias[...] = jnp.linspace(-0.1, 0.1, E, dtype=jnp.float32)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((3, 11, D)), jnp.float32)
    y = jax.jit(jax.vmap(lambda rows: layer(rows)))(x)
    p = float64({name: getattr(layer, name)[...] for name in
                 ("router", "bias", "gate", "up", "down", "shared_gate", "shared_up", "shared_down")})
    flat = float64(x.reshape(-1, D))
    experts, w = reference_route(np.asarray(flat @ p["router"]), k, score="sigmoid", renormalize=True,
                                 bias=np.asarray(p["bias"]), n_group=2, topk_group=1, routed_scaling=2.0)
    routed = reference_experts(flat, dense_weights(jnp.asarray(experts), jnp.asarray(w), E), p["up"], p["down"],
                               p["gate"], act=jax.nn.silu, transposed=False)
    shared = (jax.nn.silu(flat @ p["shared_gate"]) * (flat @ p["shared_up"])) @ p["shared_down"]
    np.testing.assert_allclose(y.reshape(-1, D), routed + shared, rtol=2e-5, atol=2e-6)


def test_expert_weights_carry_the_experts_axis():
    from recurrax.nn import logical_specs

    layer = MixtureOfExperts(8, 4, 6, 2, shared_width=4, rngs=nnx.Rngs(0))
    specs = logical_specs(layer)
    for name in ("gate", "up", "down"):
        assert tuple(specs[name])[0] == "experts"
    assert tuple(specs["router"]) == ("embed", "experts")


def test_routing_is_a_named_tuple_of_int32_and_float32():
    routing = route(tied_logits(0, 4, 5), 2)
    assert isinstance(routing, Routing)
    assert routing.experts.dtype == jnp.int32 and routing.weights.dtype == jnp.float32


# ------------------------------------------------------------- the pretrained families' layers


def pretrained_moe_layers():
    from recurrax.nn.pretrained.layers._mlp import GraniteMoE, NemotronMoE

    granite = GraniteMoE(8, experts=6, width=5, top_k=2, rngs=nnx.Rngs(1))
    kernel = granite.router.layer.kernel
    kernel[...] = kernel[...].at[:, 3].set(kernel[:, 1])  # experts 1 and 3 tie on every token
    router = dict(top_k=3, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.5)
    nemotron = NemotronMoE(8, experts=8, width=5, shared_width=4, latent=6, bias=False, act="relu2", router=router,
                           rngs=nnx.Rngs(2))
    gate = nemotron.gate.weight
    gate[...] = gate[...].at[5].set(gate[2]) * 20  # ties (2 and 5), and scores away from ½
    bias = jnp.linspace(-0.05, 0.05, 8, dtype=jnp.float32)
    nemotron.gate.e_score_correction_bias[...] = bias.at[5].set(bias[2])
    return {"granite": granite, "nemotron": nemotron}


@pytest.mark.parametrize("family", ["granite", "nemotron"])
def test_pretrained_moe_routed_equals_its_all_experts_oracle(family):
    layer = pretrained_moe_layers()[family]
    graph, state = nnx.split(layer)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 9, 8)), jnp.float32)
    cotangent = jnp.asarray(np.random.default_rng(5).standard_normal(x.shape), jnp.float32)

    def output_and_gradients(state, x, every):
        def loss(state, x):
            return jnp.vdot(nnx.merge(graph, state)(x, all_experts=every), cotangent.astype(x.dtype))
        y = nnx.merge(graph, state)(x, all_experts=every)
        return (y, *jax.grad(loss, argnums=(0, 1))(state, x))

    routed = jax.jit(output_and_gradients, static_argnums=2)(state, x, False)
    single = output_and_gradients(state, x, True)
    exact = output_and_gradients(float64(state), float64(x), True)
    for ours, ref, f32 in zip(*(jax.tree.leaves(t) for t in (routed, exact, single))):
        floor = max_rel(f32, ref)
        assert max_rel(ours, ref) <= floor_tolerance(floor), (max_rel(ours, ref), floor)


def copies_of_every_expert(fn, *args, experts: int, size: int) -> list[tuple[str, tuple]]:
    """(primitive, shape) of each array `fn`'s trace builds (sub-jaxprs included) whose
    leading axis is the `experts` and which holds at least `size` values: a copy of every
    expert's matrix (a stack, a split, a cast), where a routed call gathers single experts'."""
    return [(eqn.primitive.name, v.aval.shape) for eqn in equations(jax.make_jaxpr(fn)(*args).jaxpr)
            for v in eqn.outvars if v.aval.shape[:1] == (experts,) and np.prod(v.aval.shape) >= size]


def test_the_detector_sees_experts_stacked_or_split_per_call():
    """`copies_of_every_expert` reports what the per-call copies looked like: per-expert
    matrices stacked (Nemotron-H's former layer) and a fused `[E, 2F, D]` split (Granite's)."""
    per_expert = [jnp.ones((6, 5), jnp.float32)] * 8
    assert copies_of_every_expert(lambda ws: jnp.stack(ws), per_expert, experts=8, size=8 * 30)
    fused = jnp.ones((6, 10, 8), jnp.float32)
    assert copies_of_every_expert(lambda w: jnp.split(w, 2, axis=1)[0] + 0, fused, experts=6, size=6 * 40)


@pytest.mark.parametrize("family", ["granite", "nemotron"])
def test_pretrained_moe_one_token_call_copies_no_expert_matrices(family):
    """A decoding step (one token) reads the stacked expert weights in place: no array of
    every expert's matrices is built (those hold the layer's 3-D `[E, …]` parameters; the
    smallest sets the size looked for). Nemotron-H's experts carry the `experts` axis."""
    from recurrax.nn import logical_specs

    layer = pretrained_moe_layers()[family]
    graph, state = nnx.split(layer)
    stacked = [leaf for leaf in jax.tree.leaves(state) if leaf.ndim == 3]
    experts, size = stacked[0].shape[0], min(leaf.size for leaf in stacked)
    assert len(stacked) == 2 and all(leaf.shape[0] == experts for leaf in stacked)
    x = jnp.ones((1, 1, 8), jnp.float32)
    assert copies_of_every_expert(lambda state, x: nnx.merge(graph, state)(x), state, x, experts=experts,
                                  size=size) == []
    if family == "nemotron":
        specs = logical_specs(layer)
        for proj in ("up_proj", "down_proj"):
            assert tuple(specs["experts"][proj]["weight"])[0] == "experts"


@pytest.mark.slow
def test_benchmark_quick_run(tmp_path):
    pytest.importorskip("matplotlib")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "moe.py"
    spec = importlib.util.spec_from_file_location("moe_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--quick", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "moe.md").read_text()
    assert "| 64, top-8 | forward |" in text and (tmp_path / "moe.png").exists()


def test_grouped_matmul_follows_the_backend_calls_are_compiled_for():
    """Blocks on this CPU; `ragged_dot` when compiling for a GPU or TPU (`recurrax.target`,
    no toolchain needed to judge), as tests/test_compile.py compiles it for H100 and v5e."""
    import recurrax
    from recurrax.nn._moe import default_method

    assert jax.default_backend() == "cpu" and default_method() == "blocks"
    for chip in ("h100", "v5e"):
        with recurrax.target(chip):
            assert default_method() == "ragged"


def test_mismatched_routing_inputs_name_the_argument():
    """Routing, tokens and expert weights that do not fit together are a ValueError naming the
    argument (issue 49: they were accepted, computing from the wrong rows or experts)."""
    x = jnp.ones((5, 8))
    weights = rnn.ExpertWeights(jnp.ones((4, 8, 6)), jnp.ones((4, 6, 8)), jnp.ones((4, 8, 6)))
    routing = rnn.route(jnp.ones((5, 4)), 2)
    cases = [
        ((x[:4], routing, weights), {}, r"^routing must hold experts and weights of one shape \[tokens, top_k\] "
                                        r"with x's 4 tokens"),
        ((x, rnn.Routing(routing.experts, routing.weights[:, :1]), weights), {}, r"^routing must hold"),
        ((x, rnn.Routing(routing.experts + 3, routing.weights), weights), {},
         r"^routing.experts must be expert ids in \[0, 4\) \(weights' experts\), got 4"),
        ((x, rnn.Routing(routing.experts.astype(jnp.float32), routing.weights), weights), {},
         r"^routing.experts must be integer"),
        ((jnp.ones((5, 7)), routing, weights), {}, r"^weights must be \[E, in, out\] .* d_model 7"),
        ((x, routing, weights._replace(down=jnp.ones((4, 8, 6)))), {}, r"^weights must be .*down \(4, 8, 6\)"),
        ((x, routing, weights._replace(down=jnp.ones((3, 6, 8)))), {}, r"^weights must be .*down \(3, 6, 8\)"),
        ((x, routing, weights._replace(gate=jnp.ones((3, 8, 6)))), {}, r"^weights must be .*gate \(3, 8, 6\)"),
        ((x, routing, weights), dict(transposed=True), r"^weights must be \[E, out, in\] \(transposed\)"),
        ((x[None], routing, weights), {}, r"^x must be \[tokens, d_model\]"),
    ]
    for args, options, match in cases:
        for function in (rnn.routed_experts, rnn.all_experts):
            with pytest.raises(ValueError, match=match):
                function(*args, **options)
    with pytest.raises(ValueError, match=r"^bias must be \[experts\] = \(4,\)"):
        rnn.route(jnp.ones((5, 4)), 2, bias=jnp.ones(1))
    transposed = rnn.ExpertWeights(*(jnp.swapaxes(w, 1, 2) for w in weights))
    assert rnn.routed_experts(x, routing, transposed, transposed=True).shape == x.shape  # PyTorch's layout passes
