"""Training on a mesh (examples/train_sharded.py's step and checkpoints): one optax step on 8
simulated devices equals the step on one device, a checkpoint saved with orbax resumes
bit-identically and restores onto another mesh layout, and `save_pretrained` of a sharded
model writes the single-host checkpoint of the same values.

The step, its shardings and the orbax calls are the example's own (imported by path), so the
example is what is tested; the references are the same step jitted on one device. Mesh and
one device round float32 sums in different orders, so they are held to `floor_tolerance` of
the rounding floor measured here: one device's float32 step against the same step in float64."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("safetensors")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from _cases import compile_once_quickly, float64, floor_tolerance  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import recurrax.nn as rnn  # noqa: E402
from recurrax.nn.pretrained import from_pretrained, save_pretrained  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = {"gla": ROOT / "tests/fixtures/fla/gla_basic", "mamba2": ROOT / "tests/fixtures/transformers/mamba2_basic"}
LAYOUTS = {  # name: (mesh, fsdp)
    "data8": ("data=8", False),
    "2x2x2": ("data=2,tensor=2,sequence=2", False),
    "fsdp4_tensor2": ("data=4,tensor=2", True),
}
B, T, LEARNING_RATE, B1 = 8, 16, 1e-2, 0.9


def _example():
    spec = importlib.util.spec_from_file_location("train_sharded", ROOT / "examples" / "train_sharded.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _example()
OPTIMIZER = optax.adamw(LEARNING_RATE, b1=B1)


@functools.cache
def _model(family: str):
    """(model, graphdef, host params) of a fixture, float32."""
    model = from_pretrained(FIXTURES[family], dtype=jnp.float32)
    return model, *nnx.split(model)


def _batch(family: str, step: int):
    return example.make_batch(0, step, B, T, _model(family)[0].vocab_size)


@functools.cache
def _one_device(family: str):
    """The step jitted on one device (compiled once per family)."""
    return jax.jit(example.train_step(_model(family)[1], OPTIMIZER))


@functools.cache
def _reference(family: str):
    """The first step on one device: (loss, params, opt_state)."""
    params = _model(family)[2]
    new_params, opt_state, loss = _one_device(family)(params, OPTIMIZER.init(params), *_batch(family, 0))
    return loss, new_params, opt_state


@functools.cache
def _graphdef_float64(family: str):
    return nnx.split(from_pretrained(FIXTURES[family], dtype=jnp.float64))[0]


@functools.cache
def _float64(family: str):
    """(loss and gradients, adamw step) on one device for the float64 model of `family`, each
    compiled once, at XLA's level 0. The loss casts the logits to float64 before the cross
    entropy: the model's logits are float32 at any parameter dtype."""
    graphdef = nnx.split(from_pretrained(FIXTURES[family], dtype=jnp.float64))[0]
    params = float64(_model(family)[2])

    def loss(params, inputs, targets):
        logits = nnx.merge(graphdef, params)(inputs).astype(jnp.float64)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    def update(grads, opt_state, params):
        updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = OPTIMIZER.init(params)
    return (compile_once_quickly(jax.jit(jax.value_and_grad(loss)), params, *_batch(family, 0)),
            compile_once_quickly(jax.jit(update), params, opt_state, params))


def _relative(x, exact) -> float:
    return abs(float(x) - float(exact)) / abs(float(exact))


@functools.cache
def _first_step_floors(family: str):
    """Rounding floors of the first step on one device: float32's relative errors against the
    same step in float64 from the same parameters, for (loss, gradients, squared gradients)."""
    loss_1, _, opt_1 = _reference(family)
    loss_64, grads_64 = _float64(family)[0](float64(_model(family)[2]), *_batch(family, 0))
    grads_1, squares_1 = _moments(opt_1)
    grads_64 = jax.tree.map(np.asarray, grads_64)
    return (_relative(loss_1, loss_64), _tree_error(grads_1, grads_64),
            _tree_error(squares_1, jax.tree.map(np.square, grads_64)))


def _step_floors(family: str, params, opt_state, step: int):
    """Rounding floors of step `step` on one device from a float32 state: float32's relative
    errors against the same step in float64, for (loss, new parameters)."""
    params, opt_state = jax.device_get((params, opt_state))
    new_params, _, loss = _one_device(family)(params, opt_state, *_batch(family, step))
    value_and_grad, update = _float64(family)
    loss_64, grads_64 = value_and_grad(float64(params), *_batch(family, step))
    new_params_64, _ = update(grads_64, float64(opt_state), float64(params))
    return _relative(loss, loss_64), _tree_error(new_params, new_params_64)


@functools.cache
def _sharded(family: str, layout: str):
    """(jitted step, params sharding, opt sharding, batch sharding, mesh, rules) of `layout`."""
    model, graphdef, _ = _model(family)
    mesh_text, fsdp = LAYOUTS[layout]
    mesh = example.make_mesh(example.parse_mesh(mesh_text))
    params_sharding, opt_sharding = example.state_shardings(model, OPTIMIZER, mesh, fsdp)
    step = example.jit_step(graphdef, OPTIMIZER, mesh, params_sharding, opt_sharding)
    batch_sharding = NamedSharding(mesh, PartitionSpec("data", "sequence"))
    return step, params_sharding, opt_sharding, batch_sharding, mesh, example.rules(fsdp)


def _start(family: str, layout: str):
    """Params and optimizer state placed on `layout`'s mesh, before any step."""
    _, params_sharding, opt_sharding, *_ = _sharded(family, layout)
    placed = example.to_mesh(_model(family)[2], params_sharding)
    return placed, jax.jit(OPTIMIZER.init, out_shardings=opt_sharding)(placed)


def _step(family: str, layout: str, params, opt_state, step: int):
    run, _, _, batch_sharding, mesh, rules = _sharded(family, layout)
    inputs, targets = (example.to_mesh(x, batch_sharding) for x in _batch(family, step))
    with rnn.use_mesh(mesh, rules):
        return run(params, opt_state, inputs, targets)


def _tree_error(tree, reference) -> float:
    """max |Δ| over every leaf / max |reference| over every leaf."""
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]
    refs = [np.asarray(x, np.float64) for x in jax.tree.leaves(reference)]
    return max(np.abs(x - r).max() for x, r in zip(leaves, refs)) / max(np.abs(r).max() for r in refs)


def _moments(opt_state):
    """(gradients, squared gradients) of adamw's state after one step: mu/(1−b1), nu/(1−b2)."""
    adam = opt_state[0]
    return (jax.tree.map(lambda m: np.asarray(m) / (1 - B1), adam.mu),
            jax.tree.map(lambda v: np.asarray(v) / (1 - 0.999), adam.nu))


FAST = {("gla", "2x2x2"), ("gla", "fsdp4_tensor2"), ("mamba2", "data8")}
"""The default tier: 3 layouts, 2 families (the checkpoint tests reuse the two GLA steps); the
other three pairs are slow."""


@pytest.mark.parametrize(("family", "layout"), [
    pytest.param(family, layout, marks=() if (family, layout) in FAST else pytest.mark.slow)
    for family in sorted(FIXTURES) for layout in sorted(LAYOUTS)])
def test_step_equals_one_device(family, layout):
    """Loss and gradients (adamw's moments after its first step: mu = (1 − b1)·g,
    nu = (1 − b2)·g²) of one step on the mesh equal one device's within `floor_tolerance` of
    one device's float32-vs-float64 error on the same step (each quantity its own floor)."""
    loss_1, _, opt_1 = _reference(family)
    _, opt_state, loss = _step(family, layout, *_start(family, layout), 0)
    grads, squares = _moments(opt_state)
    grads_1, squares_1 = _moments(opt_1)
    errors = (abs(float(loss) - float(loss_1)) / abs(float(loss_1)),
              _tree_error(grads, grads_1), _tree_error(squares, squares_1))
    floors = _first_step_floors(family)
    for name, error, floor in zip(("loss", "gradients", "squared gradients"), errors, floors):
        assert error <= floor_tolerance(floor), (name, error, floor)


def _equal(tree, reference) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(r)) for x, r in zip(jax.tree.leaves(tree), jax.tree.leaves(reference)))


def test_checkpoint_resumes_bit_identically_and_onto_another_layout(tmp_path):
    """Two steps on 2×2×2, save with orbax, a third step. Restored onto the same layout, the
    third step is bit-identical; restored onto FSDP 4 × tensor 2, the values are the saved ones
    exactly, laid out on the new mesh, and the third step's loss and parameters agree within
    `floor_tolerance` of that step's float32-vs-float64 error on one device from the saved state."""
    pytest.importorskip("orbax.checkpoint")
    family, saved_layout, other_layout = "gla", "2x2x2", "fsdp4_tensor2"
    params, opt_state = _start(family, saved_layout)
    for step in range(2):
        params, opt_state, _ = _step(family, saved_layout, params, opt_state, step)
    example.save_checkpoint(str(tmp_path), 2, params, opt_state)
    saved = {"params": params, "opt_state": opt_state}
    continued = _step(family, saved_layout, params, opt_state, 2)
    loss_floor, params_floor = _step_floors(family, params, opt_state, 2)

    host_params = _model(family)[2]
    host_state = {"params": host_params, "opt_state": jax.eval_shape(OPTIMIZER.init, host_params)}
    for layout in (saved_layout, other_layout):
        _, params_sharding, opt_sharding, *_ = _sharded(family, layout)
        step, restored = example.restore_checkpoint(str(tmp_path), example.abstract(
            host_state, {"params": params_sharding, "opt_state": opt_sharding}))
        assert step == 2 and _equal(restored, saved)
        assert all(x.sharding == s for x, s in zip(jax.tree.leaves(restored["params"]), jax.tree.leaves(params_sharding)))
        resumed = _step(family, layout, restored["params"], restored["opt_state"], 2)
        if layout == saved_layout:
            assert _equal(resumed, continued)
        else:
            errors = _tree_error(resumed[2], continued[2]), _tree_error(resumed[0], continued[0])
            assert errors[0] <= floor_tolerance(loss_floor), (errors[0], loss_floor)
            assert errors[1] <= floor_tolerance(params_floor), (errors[1], params_floor)


def test_save_pretrained_of_a_sharded_model_is_the_single_host_checkpoint(tmp_path):
    """A model whose parameters are sharded over FSDP 4 × tensor 2 saves as config.json +
    model.safetensors; read back unsharded, every parameter equals the sharded one."""
    family, layout = "mamba2", "fsdp4_tensor2"
    model = from_pretrained(FIXTURES[family], dtype=jnp.float32)
    params = example.to_mesh(nnx.state(model), _sharded(family, layout)[1])
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(params))
    nnx.update(model, params)
    save_pretrained(model, tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "generation_config.json", "model.safetensors"}
    reloaded = nnx.state(from_pretrained(tmp_path, dtype=jnp.float32))
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(reloaded))
    assert _equal(reloaded, params)
