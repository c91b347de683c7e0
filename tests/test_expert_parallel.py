"""Mixtures of experts with the experts split over a mesh axis (`recurrax.nn._expert_parallel`)
against one device, on the 8 simulated CPU devices of conftest.py, in float32.

Each case compares a layer's output and its gradients (every parameter and the input, for a
fixed random cotangent) computed on one device with the same computation under `use_mesh`
(parameters placed by `shard_model`), within `floor_tolerance` of the rounding floor measured
here: one device's float32 computation against float64. Routers have exact ties (two experts
with the same router column, repeated tokens), and top-k reaches the number of experts.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cases import float64, floor_tolerance
from flax import nnx
from jax.sharding import AxisType, PartitionSpec

import recurrax.nn as rnn
from recurrax.nn._expert_parallel import expert_axis


def mesh(**sizes: int):
    """A mesh with the named axes and sizes, on the first devices."""
    devices = np.array(jax.devices()[: int(np.prod(list(sizes.values())))]).reshape(tuple(sizes.values()))
    return jax.sharding.Mesh(devices, tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))


def mixture(k, **options):
    layer = rnn.MixtureOfExperts(8, 8, 6, k, shared_width=4, rngs=nnx.Rngs(0), **options)
    router = layer.router[...] * 20  # scores away from uniform
    layer.router[...] = router.at[:, 5].set(router[:, 2])  # experts 2 and 5 tie on every token
    return layer


def granite(k):
    from recurrax.nn.pretrained.layers._mlp import GraniteMoE

    layer = GraniteMoE(8, experts=6, width=6, top_k=k, rngs=nnx.Rngs(1))  # [E, out, in] weights
    kernel = layer.router.layer.kernel
    kernel[...] = kernel[...].at[:, 3].set(kernel[:, 1]) * 20  # experts 1 and 3 tie on every token
    return layer


def nemotron():
    from recurrax.nn.pretrained.layers._mlp import NemotronMoE

    router = dict(top_k=3, n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.5)
    layer = NemotronMoE(8, experts=8, width=6, shared_width=4, latent=6, bias=False, act="relu2", router=router,
                        rngs=nnx.Rngs(2))  # experts without a gate, behind a latent projection
    weight = layer.gate.weight
    weight[...] = weight[...].at[5].set(weight[2]) * 20  # experts 2 and 5 tie on every token
    return layer


CASES = [  # layer, mesh axes, layouts; the default tier's two cases cover data, FSDP, tensor and
    # expert parallelism, k = E, and one expert per device (slots bounded by min(k, E/X) = 1)
    pytest.param(lambda: granite(6), dict(data=2, expert=2, tensor=2), ("fsdp", "expert", "tensor"),
                 id="fsdp2-expert2-tensor2-granite-k=E"),
    pytest.param(lambda: mixture(2), dict(expert=8), ("expert",), id="expert8-k2"),
    pytest.param(lambda: mixture(2), dict(data=2, expert=4), ("data", "expert"), id="data2-expert4-k2",
                 marks=pytest.mark.slow),
    pytest.param(lambda: mixture(8, score="sigmoid", selection_bias=True), dict(expert=8), ("expert",),
                 id="expert8-k=E-sigmoid", marks=pytest.mark.slow),
    pytest.param(lambda: mixture(3), dict(data=4, tensor=2), ("data", "expert", "tensor"),
                 id="expert-over-data4-tensor2-k3", marks=pytest.mark.slow),
    pytest.param(nemotron, dict(data=2, expert=2, tensor=2), ("data", "expert", "tensor"),
                 id="data2-expert2-tensor2-nemotron", marks=pytest.mark.slow),
]


@partial(jax.jit, static_argnames="graphdef")
def output_and_gradients(graphdef, state, x, cotangent):
    """The layer's output, and the gradients of `⟨output, cotangent⟩` for its state and `x`."""
    y, pull = jax.vjp(lambda state, x: nnx.merge(graphdef, state)(x), state, x)
    return (y, *pull(cotangent.astype(y.dtype)))


def run_quickly(graphdef, state, x, cotangent, expect: str | None = None):
    """`output_and_gradients` compiled at XLA's optimisation level 0 (every case compiles three
    programs once: one device in float32 and float64, and the mesh's); `expect`: a name its
    lowered text must contain."""
    lowered = output_and_gradients.lower(graphdef, state, x, cotangent)
    assert expect is None or expect in lowered.as_text()
    compiled = lowered.compile(compiler_options={"xla_backend_optimization_level": 0})
    return compiled(state, x, cotangent)


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def inputs():
    """[2, 5, 8]: 10 tokens (not a multiple of 8 devices), the first three repeated."""
    x = np.random.default_rng(2).standard_normal((2, 5, 8))
    x[1, :3] = x[0, :3]
    cotangent = np.random.default_rng(3).standard_normal((2, 5, 8))
    return jnp.asarray(x, jnp.float32), jnp.asarray(cotangent, jnp.float32)


@pytest.mark.parametrize("make, sizes, layouts", CASES)
def test_forward_and_gradients_on_a_mesh_equal_one_device(make, sizes, layouts):
    x, cotangent = inputs()
    graphdef, state = nnx.split(make())
    want = run_quickly(graphdef, state, x, cotangent)
    exact = run_quickly(graphdef, *float64((state, x, cotangent)))
    expert = "data" if "expert" not in sizes else "expert"
    device_mesh, rules = mesh(**sizes), rnn.logical_rules(*layouts, expert=expert)
    layer = rnn.shard_model(nnx.merge(graphdef, state), device_mesh, rules)
    graphdef, placed = nnx.split(layer)
    with rnn.use_mesh(device_mesh, rules):
        got = run_quickly(graphdef, placed, x, cotangent, expect="all_to_all")  # the expert-parallel path
    leaves = [jax.tree.leaves(tree) for tree in (got, want, exact)]
    assert len(leaves[0]) == len(leaves[1])
    for ours, single, ref in zip(*leaves):
        floor = relative_error(single, ref)
        error = relative_error(ours, single)
        assert error <= floor_tolerance(floor), (error, floor)


def test_expert_weights_are_placed_over_the_expert_axis():
    device_mesh = mesh(data=2, expert=4)
    layer = rnn.shard_model(mixture(2), device_mesh, rnn.logical_rules("fsdp", "expert"))
    assert layer.up.get_value().sharding.spec == PartitionSpec("expert", "data", None)  # [experts, embed, mlp]
    assert layer.up.get_value().addressable_shards[0].data.shape == (2, 4, 6)


def test_expert_axis_only_when_the_rules_name_one_that_divides_the_experts():
    device_mesh = mesh(data=2, expert=4)
    assert expert_axis(8) is None  # no mesh
    with rnn.use_mesh(device_mesh, rnn.logical_rules("data", "expert")):
        assert expert_axis(8) == "expert" and expert_axis(6) is None
    with rnn.use_mesh(device_mesh, rnn.logical_rules("data", "tensor", tensor="expert")):
        assert expert_axis(8) is None  # tensor parallelism alone splits each expert's width, not the experts
    with rnn.use_mesh(device_mesh, rnn.logical_rules("data", "expert", expert="data")):
        assert expert_axis(8) == "data"  # expert parallelism over the data-parallel devices
