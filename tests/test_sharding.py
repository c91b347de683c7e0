"""Models on a mesh (`recurrax.nn`'s logical axes, rules, `shard_model`, `use_mesh`) against one
device, on the 8 simulated CPU devices of conftest.py, in float32.

Each case compares the logits and the gradient of a fixed random projection of them with
respect to every parameter, computed on one device, with the same computation on a mesh
(parameters placed by `shard_model`, forward under `use_mesh`), within `floor_tolerance` of
the rounding floor measured here: one device's float32 computation against float64.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cases import compile_once_quickly, floor_tolerance
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import recurrax.nn as rnn
from recurrax.nn.pretrained import from_pretrained

FIXTURES = Path(__file__).parent / "fixtures"
GLA = FIXTURES / "fla" / "gla_gqa_conv_clamp"          # GLA, grouped heads, short convolutions
BAMBA = FIXTURES / "transformers" / "bamba_basic"                  # Mamba-2 (short conv) and attention layers
NEMOTRON = FIXTURES / "transformers" / "nemotron_h_pattern_moe"   # Mamba-2, attention, MLP, MoE
QWEN3_NEXT = FIXTURES / "transformers" / "qwen3_next_moe_grouped"  # Gated DeltaNet, gated attention, MoE
OLMO_HYBRID = FIXTURES / "transformers" / "olmo_hybrid_grouped_negeig"  # Gated DeltaNet (β ≤ 2), post-norm attention
MINIMAX = FIXTURES / "transformers" / "minimax_gqa_rotary_dim_tied"  # Lightning attention, GQA attention, MoE
TOLERANCE = 1e-5
"""Relative error of the serving tests' logits (float32 against float32, slow tier)."""


def mesh(data: int, tensor: int, sequence: int):
    devices = np.array(jax.devices()[: data * tensor * sequence]).reshape(data, tensor, sequence)
    return jax.sharding.Mesh(devices, ("data", "tensor", "sequence"), axis_types=(AxisType.Auto,) * 3)


def relative_error(got, want) -> float:
    """‖got − want‖ / ‖want‖ (float32 sums reordered by sharding differ in their last bits)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def test_rules_tables():
    rules = dict(rnn.logical_rules("fsdp", "tensor", "sequence"))
    assert rules["batch"] == "data" and rules["embed"] == "data" and rules["length"] == "sequence"
    assert all(rules[name] == "tensor" for name in ("heads", "kv_heads", "mlp", "vocab", "inner"))
    assert rules["head_dim"] is None and rules["conv"] is None and rules["experts"] is None
    assert dict(rnn.logical_rules("tensor", "expert"))["experts"] == "expert" == dict(rnn.EXPERT_PARALLEL)["experts"]
    assert dict(rnn.logical_rules("expert", expert="data"))["experts"] == "data"
    assert dict(rnn.DATA_PARALLEL)["embed"] is None and dict(rnn.DATA_PARALLEL)["batch"] == "data"
    assert set(dict(rnn.TENSOR_PARALLEL).values()) == {None, "tensor"}
    assert dict(rnn.SEQUENCE_PARALLEL)["length"] == "sequence"
    assert [name for name, _ in rnn.FSDP] == list(rnn.LOGICAL_AXES)
    with pytest.raises(ValueError, match="layouts"):
        rnn.logical_rules("pipeline")


def test_creation_does_not_shard_and_names_every_parameter():
    """No mesh needed to build; every parameter has one logical name per dimension."""
    model = from_pretrained(GLA)
    for path, spec in nnx.to_flat_state(rnn.logical_specs(model)):
        assert isinstance(spec.get_value(), PartitionSpec), path
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        names = variable.get_metadata()["out_sharding"]
        assert len(names) == variable.get_value().ndim, path
        assert set(names) <= set(rnn.LOGICAL_AXES) | {None}, path
        assert len(variable.get_value().sharding.device_set) == 1, path


def test_placed_parameters_are_sharded_as_the_rules_say():
    model = from_pretrained(GLA)
    layer = model.model.layers[0].attn
    rnn.shard_model(model, mesh(2, 2, 2), rnn.logical_rules("fsdp", "tensor"))
    expected = [  # by hand from the table: embed → data, heads/kv_heads/vocab → tensor
        (model.model.embeddings.embedding, ("tensor", "data")),        # [vocab, embed]
        (layer.q_proj.kernel, ("data", "tensor")),                     # [embed, heads]
        (layer.k_proj.kernel, ("data", "tensor")),                     # [embed, kv_heads]
        (layer.o_proj.kernel, ("tensor", "data")),                     # [heads, embed]
        (layer.q_conv1d.kernel, (None, "tensor")),                     # [conv, heads]
        (layer.gk_proj.layers[0].kernel, ("data", None)),              # [embed, low rank]
        (model.model.norm.weight, ("data",)),                          # [embed]
        (layer.g_norm_swish_gate.weight, (None,)),                     # [head_dim]
    ]
    for variable, spec in expected:
        value = variable.get_value()
        assert value.sharding.spec == PartitionSpec(*spec)
        shard = value.addressable_shards[0].data.shape
        assert shard == tuple(n // (2 if axis else 1) for n, axis in zip(value.shape, spec))



@partial(jax.jit, static_argnames="graphdef")
def logits_and_grads(graphdef, params, tokens, cu_seqlens):
    """Logits, and the gradient of a fixed random projection of them for every parameter."""

    def loss(params):
        logits = nnx.merge(graphdef, params)(tokens, cu_seqlens=cu_seqlens)
        weights = jax.random.normal(jax.random.key(7), logits.shape, logits.dtype)
        return jnp.sum(logits * weights), logits

    (_, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return logits, grads


def run(model, inputs):
    graphdef, params = nnx.split(model)
    return logits_and_grads(graphdef, params, *inputs)


def inputs_of(model, packed: bool):
    """[4, 16] token rows, or 64 packed tokens in sequences of 5, 0, 30, 29 crossing every shard boundary."""
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.vocab_size, (4, 16)), jnp.int32)
    if not packed:
        return tokens, None
    return tokens.reshape(-1), jnp.array([0, 5, 5, 35, 64], jnp.int32)


MODELS = {"gla": GLA, "bamba": BAMBA, "nemotron_h": NEMOTRON, "qwen3_next": QWEN3_NEXT, "olmo_hybrid": OLMO_HYBRID,
          "minimax": MINIMAX}
LAYOUTS = {
    "data2-tensor4": ((2, 4, 1), ("data", "tensor")),
    "fsdp2-tensor2-seq2": ((2, 2, 2), ("fsdp", "tensor", "sequence")),
    "data2-tensor2-seq2": ((2, 2, 2), ("data", "tensor", "sequence")),
    "tensor2-seq4": ((1, 2, 4), ("tensor", "sequence")),
}
FAST = {("gla", "fsdp2-tensor2-seq2", True), ("bamba", "data2-tensor2-seq2", False)}
"""The default tier's cases (each compiles a model's forward and backward for a mesh)."""


def cases():
    for family in MODELS:
        for layout in LAYOUTS:
            for packed in (False, True):
                slow = (family, layout, packed) not in FAST
                yield pytest.param(family, layout, packed, id=f"{family}-{layout}-{'packed' if packed else 'dense'}",
                                   marks=pytest.mark.slow if slow else ())


def flat_gradients(grads) -> dict:
    """{path: float64 array} of an nnx gradient state."""
    return {path: np.asarray(value.get_value(), np.float64) for path, value in nnx.to_flat_state(grads)}


def concatenated(flat: dict):
    return np.concatenate([np.ravel(value) for value in flat.values()])


@pytest.fixture(scope="module")
def one_device():
    """Each model's single-device logits and gradients, with their rounding floors: the
    errors of that float32 computation against the same one in float64 (same parameters,
    cast up; compiled at XLA's level 0). `(logits, gradients by path, floors)`, floors =
    (logits, all gradients together, {path: gradient}). Computed when first asked for."""
    results = {}

    def get(family, packed):
        if (family, packed) not in results:
            model = from_pretrained(MODELS[family])
            inputs = inputs_of(model, packed)
            logits, grads = run(model, inputs)
            graphdef, params = nnx.split(from_pretrained(MODELS[family], dtype=jnp.float64))
            exact = compile_once_quickly(logits_and_grads, graphdef, params, *inputs)
            exact_logits, exact_grads = exact(params, *inputs)
            grads, exact_grads = flat_gradients(grads), flat_gradients(exact_grads)
            floors = (relative_error(logits, exact_logits),
                      relative_error(concatenated(grads), concatenated(exact_grads)),
                      {path: relative_error(grads[path], exact_grads[path]) for path in grads})
            results[family, packed] = logits, grads, floors
        return results[family, packed]

    return get


@pytest.mark.parametrize("family, layout, packed", list(cases()))
def test_forward_and_gradients_equal_one_device(one_device, family, layout, packed):
    sizes, layouts = LAYOUTS[layout]
    check_against_one_device(one_device, family, mesh(*sizes), rnn.logical_rules(*layouts), packed)


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_expert_parallel_model_equals_one_device(one_device, packed):
    """Nemotron-H's MoE layers with their 4 experts over the 4 devices of the mesh axis
    `tensor`, named as the expert axis (all-to-all dispatch), batch rows over `data`."""
    rules = rnn.logical_rules("data", "expert", expert="tensor")
    check_against_one_device(one_device, "nemotron_h", mesh(2, 4, 1), rules, packed, expect="all_to_all")


def check_against_one_device(one_device, family, device_mesh, rules, packed, expect=None):
    """The logits and every gradient on the mesh within `floor_tolerance` of one device's;
    `expect`: a name the sharded program's text must contain."""
    model = rnn.shard_model(from_pretrained(MODELS[family]), device_mesh, rules)
    inputs = inputs_of(model, packed)
    with rnn.use_mesh(device_mesh, rules):
        logits, grads = run(model, inputs)
        assert expect is None or expect in logits_and_grads.lower(*nnx.split(model), *inputs).as_text()
    want_logits, want_grads, (logits_floor, grads_floor, floors) = one_device(family, packed)
    grads = flat_gradients(grads)
    assert grads.keys() == want_grads.keys()
    error = relative_error(logits, want_logits)
    assert error <= floor_tolerance(logits_floor), ("logits", error, logits_floor)
    error = relative_error(concatenated(grads), concatenated(want_grads))
    assert error <= floor_tolerance(grads_floor), ("all gradients", error, grads_floor)
    for path, got in grads.items():  # small reductions (Mamba-2's D, dt_bias) have floors of ~1e-5
        error = relative_error(got, want_grads[path])
        assert error <= floor_tolerance(floors[path]), (path, error, floors[path])


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_short_convolution_split_over_the_sequence_axis(packed):
    """Outputs, new buffer and their gradients (inputs, buffer, kernel) with the tokens over 4
    devices equal one device's, from a non-zero buffer (a prefill continuing a cache), packed
    sequences crossing shard boundaries."""
    from recurrax.nn._conv import causal_conv

    keys = jax.random.split(jax.random.key(3), 5)
    width, C = 4, 3
    x = jax.random.normal(keys[0], (1, 16, C) if packed else (2, 16, C), jnp.float32)
    cu = jnp.array([0, 2, 2, 9, 16], jnp.int32) if packed else None
    buffer = jax.random.normal(keys[1], (4 if packed else 2, width - 1, C), jnp.float32)
    kernel = jax.random.normal(keys[2], (width, C), jnp.float32)

    @jax.jit
    def outputs_and_gradients(x, buffer, kernel):
        out, pull = jax.vjp(lambda *a: causal_conv(a[0], a[1], cu, a[2]), x, buffer, kernel)
        cotangents = tuple(jax.random.normal(key, o.shape, o.dtype) for key, o in zip(keys[3:], out))
        return out, pull(cotangents)

    want = outputs_and_gradients(x, buffer, kernel)
    with rnn.use_mesh(mesh(2, 1, 4), rnn.logical_rules("data", "sequence")):
        got = outputs_and_gradients(x, buffer, kernel)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # the kernel's sums split over shards
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


HYBRID = FIXTURES / "fla" / "gla_hybrid_attn"   # GLA layers and one softmax-attention layer (a KV cache)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5], [8, 9, 7, 9, 3, 2, 3, 8, 4, 6], [2, 6, 4]]


def serving_mesh():
    return mesh(2, 4, 1), rnn.logical_rules("fsdp", "tensor")  # weights over data × tensor, pool rows over data


def test_cache_pool_is_sharded():
    """generate's slot pool: rows over data, a recurrent state's heads over tensor (4 of 4),
    an attention buffer's rows over data (its 2 kv heads do not divide over 4)."""
    from recurrax.generation._generate import _empty_pool

    device_mesh, rules = serving_mesh()
    model = rnn.shard_model(from_pretrained(HYBRID), device_mesh, rules)
    with rnn.use_mesh(device_mesh, rules):
        pool = _empty_pool(model, 4, 32)
    state, keys = pool.layers[0].state, pool.layers[1].keys
    assert state.sharding.is_equivalent_to(NamedSharding(device_mesh, PartitionSpec("data", "tensor", None, None)), 4)
    assert state.addressable_shards[0].data.shape == (2, 1, *state.shape[2:])
    assert keys.sharding.spec[0] == "data" and keys.addressable_shards[0].data.shape[0] == 2


@pytest.mark.slow
def test_generate_on_a_mesh_equals_one_device():
    """Greedy tokens of 4 prompts in 4 slots, weights and cache pool sharded, equal one device's."""
    from recurrax.nn.pretrained import generate

    want = generate(from_pretrained(HYBRID), PROMPTS, 6, num_slots=4)
    device_mesh, rules = serving_mesh()
    model = rnn.shard_model(from_pretrained(HYBRID), device_mesh, rules)
    with rnn.use_mesh(device_mesh, rules):
        got = generate(model, PROMPTS, 6, num_slots=4)
    assert got == want and all(len(tokens) == 6 for tokens in got)


@partial(jax.jit, static_argnames="graphdef")
def prefill_then_step(graphdef, params, tokens, cu_seqlens, next_tokens):
    """Logits of a packed prefill into a 4-slot cache and of one decode step after it."""
    from recurrax.generation._generate import constrain_cache

    model = nnx.merge(graphdef, params)
    prefill_logits, cache = model.prefill(tokens, cu_seqlens, constrain_cache(model.generation_cache(4, 32)))
    step_logits, _ = model.decode_step(next_tokens, constrain_cache(cache))
    return prefill_logits, step_logits


@pytest.mark.slow
def test_prefill_and_decode_logits_on_a_mesh_equal_one_device():
    tokens = jnp.array([t for prompt in PROMPTS for t in prompt], jnp.int32)
    cu_seqlens = jnp.array(np.cumsum([0] + [len(p) for p in PROMPTS]), jnp.int32)
    next_tokens = jnp.array([1, 2, 3, 4], jnp.int32)
    want = prefill_then_step(*nnx.split(from_pretrained(HYBRID)), tokens, cu_seqlens, next_tokens)
    device_mesh, rules = serving_mesh()
    model = rnn.shard_model(from_pretrained(HYBRID), device_mesh, rules)
    with rnn.use_mesh(device_mesh, rules):
        got = prefill_then_step(*nnx.split(model), tokens, cu_seqlens, next_tokens)
    for g, w in zip(got, want):
        assert relative_error(g, w) < TOLERANCE
