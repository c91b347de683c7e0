"""The Pallas kernels inside `jax.shard_map` with `check_vma=True` (the default), on two host
CPU devices: outputs and every gradient equal to the unsharded call of the same kernels.

The driver makes a kernel's inputs vary over the same mesh axes (`kernels._driver.vary_alike`,
whose transpose sums the gradient of a replicated input such as `g_gamma`) and every kernel
declares its outputs with those axes (`output_type`). What each interpret mode allows:

- TPU kernels (TPU interpret mode): run sharded, forward and backward; the delta rule's
  kernels too.
- Mosaic GPU kernels (Mosaic GPU interpret mode, JAX ≥ 0.12): traced and lowered on the
  two-device mesh; run on a one-device mesh (its interpreter simulates the devices of a mesh
  as one multi-GPU launch and stops on two: "Barrier remains allocated", with or without
  `check_vma`).
- Triton kernels (Pallas's generic interpret mode): traced on the mesh with `check_vma=True`
  (the declared output types are checked there); run with `check_vma=False`, because that
  interpreter re-traces the kernel's loops at lowering under the mesh's `check_vma` and
  JAX then rejects its own loop carries ("Scan carry input and output got mismatched varying
  manual axes", JAX 0.10 and 0.12). The compiled Triton lowering has no such step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cases import DIFF_ARGS, Case, equations, floor_tolerance, make_inputs, max_rel_error, split_args
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from recurrax.kernels.mosaic_gpu import has_interpret_mode, mosaic_gpu_interpret
from recurrax.delta import canonicalize_delta, reference_delta
from recurrax.kernels.tpu import TpuTiles, tpu_delta_interpret, tpu_interpret
from recurrax.kernels.triton import triton_interpret
from recurrax.tools.cases import DeltaCase, call, make_delta_inputs

TILES = TpuTiles(chunk=16, sub=8, block_v=64)
TPU = functools.partial(tpu_interpret, tiles=TILES)
SMALL = dict(H=2, Hkv=2, K=16, V=16, dtype="float32")
TOL = 1e-5
"""bfloat16 (the Mosaic GPU case, run on one device): sharded and unsharded round alike."""

BATCH = Case(B=2, T=16, gates=("g_gamma", "g_head"), **SMALL)
"""Rows split over the mesh; `g_gamma` replicated (its gradient is summed over shards)."""
PACKED = Case(T=20, gates=("g_channel",), cu_seqlens=(0, 3, 3, 20), reverse=True, **SMALL)
"""Packed sequences, heads split over the mesh; `cu_seqlens` replicated."""


def _specs(kwargs: dict, packed: bool, axis: str) -> dict:
    """Partition spec per argument: rows (dense) or heads (packed) split over `axis`."""
    if packed:
        return {"query": P(None, None, axis), "key": P(None, None, axis), "value": P(None, None, axis),
                "g": P(None, None, axis), "initial_state": P(None, axis), "cu_seqlens": P()}
    specs = {name: P(axis) for name in kwargs}
    specs["g_gamma"] = P()
    return specs


def _vjp(fn, kwargs: dict, mesh: Mesh | None, check_vma: bool = True):
    """(output, final state, gradients) of `fn`, under `shard_map` when `mesh` is given; the
    cotangents are drawn from the unsharded output shapes, the same for both."""
    diff, rest = split_args(kwargs)
    rest = {k: v for k, v in rest.items() if v is not None}
    static = {k: rest.pop(k) for k in ("reverse", "softmax_scale") if k in rest}
    local = lambda diff, rest: call(fn, **diff, **rest, **static)  # noqa: E731
    if mesh is not None:
        specs = _specs(kwargs, "cu_seqlens" in rest, mesh.axis_names[0])
        in_specs = ({k: specs[k] for k in diff}, {k: specs[k] for k in rest})
        out_specs = (specs["query"], specs["initial_state"])
        local = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
    o_shape, s_shape = jax.eval_shape(lambda d, r: call(fn, **d, **r, **static), diff, rest)
    rng = np.random.default_rng(1)
    do = jnp.asarray(rng.standard_normal(o_shape.shape), o_shape.dtype)
    ds = jnp.asarray(rng.standard_normal(s_shape.shape), s_shape.dtype)

    def forward_backward(diff, rest):
        (o, state), pullback = jax.vjp(lambda d: local(d, rest), diff)
        return o, state, pullback((do, ds))[0]

    return jax.jit(forward_backward), (diff, rest)


FAST_COMPILE = {"xla_backend_optimization_level": 0}
"""Interpret-mode programs are large; XLA's optimisation level 0 halves their compile time."""


def _run(program, args):
    return program.lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


def _mesh(devices: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:devices]), ("x",))


def _errors(result, reference) -> dict[str, float]:
    (o, state, grads), (o_1, state_1, grads_1) = result, reference
    errors = {"output": max_rel_error(o, o_1), "final_state": max_rel_error(state, state_1)}
    errors.update({"d" + name: max_rel_error(grad, grads_1[name]) for name, grad in grads.items()})
    return errors


@functools.cache
def _exact(case: Case):
    """The reference's (output, final state, gradients) in float64 on `case`'s inputs cast up."""
    kwargs = make_inputs(case)
    exact, args = _vjp("reference", {k: (v.astype(jnp.float64) if k in DIFF_ARGS else v) for k, v in kwargs.items()},
                       None)
    return exact(*args)


def _tolerances(case: Case, single_result) -> dict[str, float]:
    """float32: the same kernels on each shard's rows or heads, but the sums over shards (the
    gradient of a replicated `g_gamma`) round in another order. Each output and gradient is
    held to `floor_tolerance` of the unsharded call's error against float64 (the reference
    on the same inputs cast up, float64 cotangents of the same draw). bfloat16: `TOL`."""
    if case.dtype != "float32":
        return dict.fromkeys(_errors(single_result, single_result), TOL)
    floors = _errors(single_result, _exact(case))
    return {name: floor_tolerance(floor) for name, floor in floors.items()}


def assert_sharded_equals_unsharded(fn, case: Case, devices: int = 2, check_vma: bool = True):
    kwargs = make_inputs(case)
    sharded, args = _vjp(fn, kwargs, _mesh(devices), check_vma)
    single, _ = _vjp(fn, kwargs, None)
    (o, state, grads), single_result = _run(sharded, args), _run(single, args)
    errors, tolerances = _errors((o, state, grads), single_result), _tolerances(case, single_result)
    bad = {name: (error, tolerances[name]) for name, error in errors.items() if not error <= tolerances[name]}
    assert not bad, f"{case}: {bad} (error, tolerance)"
    assert all(np.isfinite(np.asarray(x)).all() for x in (o, state, *grads.values()))


CASES = [BATCH, pytest.param(PACKED, marks=pytest.mark.slow)]


@pytest.mark.parametrize("case", CASES, ids=["rows", "packed-heads"])
def test_tpu_kernels_under_shard_map(case):
    assert_sharded_equals_unsharded(TPU, case)


def _kernel_output_axes(fn, case: Case) -> list[frozenset]:
    """The mesh axes every kernel launch's outputs vary over, in the sharded forward and
    backward traced with `check_vma=True` on two devices."""
    sharded, args = _vjp(fn, make_inputs(case), _mesh(2))
    return [v.aval.manual_axis_type.varying for eqn in equations(jax.make_jaxpr(sharded)(*args).jaxpr)
            if eqn.primitive.name == "pallas_call" for v in eqn.outvars]


@pytest.mark.parametrize("case", CASES, ids=["rows", "packed-heads"])
def test_triton_kernels_under_shard_map(case):
    """Traced with `check_vma=True`: forward, state and backward kernels, every output varying
    over the mesh axis; run without the check (the module docstring says why)."""
    axes = _kernel_output_axes(triton_interpret, case)
    assert len(axes) >= 3 + 3 and all(found == {"x"} for found in axes), axes
    assert_sharded_equals_unsharded(triton_interpret, case, check_vma=False)


MOSAIC_CASE = Case(B=2, T=70, H=1, Hkv=1, K=64, V=64, gates=("g_gamma", "g_head"), dtype="bfloat16")


@pytest.mark.slow
@pytest.mark.skipif(not has_interpret_mode(), reason=f"JAX {jax.__version__} has no Mosaic GPU interpret mode")
def test_mosaic_gpu_kernels_under_shard_map():
    """Traced and lowered on two devices; run on a one-device mesh (see the module docstring)."""
    sharded, args = _vjp(mosaic_gpu_interpret, make_inputs(MOSAIC_CASE), _mesh(2))
    sharded.trace(*args).lower()
    assert_sharded_equals_unsharded(mosaic_gpu_interpret, MOSAIC_CASE, devices=1)


@pytest.mark.compile
@pytest.mark.parametrize("implementation", ["pallas_tpu", None])
def test_tpu_kernels_compile_under_shard_map_for_four_v5e_chips(implementation):
    """Forward and gradient of the TPU kernels (named), and of what dispatch picks for the
    target (`chunk`: a v5e measured the kernel slower with `gk`; its output buffer must vary
    over the mesh axis like its inputs), inside `shard_map` over a 4-chip v5e slice, rows split
    over the chips, compiled by libtpu without a TPU (`recurrax.targets`; Mosaic's passes and
    the VMEM check run here)."""
    from test_compile import need

    import recurrax
    from recurrax import targets

    need("v5e:2x2")
    mesh = targets.mesh_for("v5e:2x2")
    B, T, H, K, V = 4, 256, 2, 128, 128
    rows = jax.sharding.NamedSharding(mesh, P("x"))
    shapes = [(B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H, K), (B, H, K, V)]
    dtypes = [jnp.bfloat16] * 3 + [jnp.float32] * 2
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=rows) for shape, dtype in zip(shapes, dtypes)]

    def local(q, k, v, gk, h0):
        return recurrax.recurrent(q, k, v, gk=gk, initial_state=h0, implementation=implementation)

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("x"),) * 5, out_specs=(P("x"), P("x")))
    loss = lambda *a: sum(x.astype(jnp.float32).sum() for x in sharded(*a))  # noqa: E731
    program = targets.compile_for("v5e:2x2", jax.value_and_grad(loss, argnums=tuple(range(5))), *args)
    text = program.executable.as_text()
    kernels = {kind: f"recurrax_tpu_chunk_{kind}" in text for kind in ("fwd", "states", "bwd")}
    if implementation == "pallas_tpu":  # the backward reads the chunk states the forward wrote
        assert kernels == {"fwd": True, "states": False, "bwd": True}, kernels
    else:
        assert not any(kernels.values()), kernels


@pytest.mark.compile
def test_tpu_delta_kernel_compiles_under_shard_map_for_four_v5e_chips():
    """The delta rule's TPU kernels (picked by dispatch for the target) and its gradient inside
    `shard_map` with `check_vma=True` over a 4-chip v5e slice, rows split over the chips,
    per-head and per-channel decays, compiled by libtpu without a TPU."""
    from test_compile import need

    import recurrax
    from recurrax import targets

    need("v5e:2x2")
    mesh = targets.mesh_for("v5e:2x2")
    B, T, H, K, V = 4, 256, 2, 128, 128
    rows = jax.sharding.NamedSharding(mesh, P("x"))
    shapes = [(B, T, H, K), (B, T, H, K), (B, T, H, V), (B, T, H), (B, T, H), (B, T, H, K), (B, H, K, V)]
    dtypes = [jnp.bfloat16] * 3 + [jnp.float32] * 4
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=rows) for shape, dtype in zip(shapes, dtypes)]

    def local(q, k, v, beta, g, gk, h0):
        return recurrax.delta_rule(q, k, v, beta, g, gk, initial_state=h0, qk_l2norm=True,
                                   implementation="pallas_tpu")

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P("x"),) * 7, out_specs=(P("x"), P("x")), check_vma=True)
    loss = lambda *a: sum(x.astype(jnp.float32).sum() for x in sharded(*a))  # noqa: E731
    program = targets.compile_for("v5e:2x2", jax.value_and_grad(loss, argnums=tuple(range(7))), *args)
    text = program.executable.as_text()
    assert all(f"recurrax_tpu_delta_{kind}" in text for kind in ("fwd", "states", "bwd"))


DELTA_CASE = DeltaCase(gates=("g", "gk"), B=2, T=20, Hqk=1, H=2, K=16, V=16, qk_l2norm=True)
"""The delta rule: rows split over the mesh, query/key shared by two value heads."""


def _delta_vjp(algorithm, arrays: dict, cotangents: tuple):
    """(output, final state, gradients) of `algorithm` on the canonical form of `delta_rule`'s
    `arrays` (`qk_l2norm`) under the given cotangents."""

    def run(arrays):
        names = ("query", "key", "value", "beta", "g", "gk")
        problem, scale, _ = canonicalize_delta(*(arrays.get(n) for n in names), None, arrays.get("initial_state"),
                                               None, True)
        return algorithm(problem, scale=scale)

    (o, state), pullback = jax.vjp(run, arrays)
    return o, state, pullback(cotangents)[0]


@pytest.mark.slow
def test_tpu_delta_kernel_under_shard_map():
    """The delta rule's TPU kernels (interpret mode, small tiles), forward and backward, inside `shard_map` with `check_vma=True` on two devices, against the
    unsharded call; held to `floor_tolerance` of the unsharded call's error vs float64."""
    inputs = make_delta_inputs(DELTA_CASE)
    rng = np.random.default_rng(1)
    cotangents = tuple(rng.standard_normal(inputs[name].shape) for name in ("value", "initial_state"))
    cast = lambda tree, dtype: jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)  # noqa: E731
    args = (cast(inputs, jnp.float32), cast(cotangents, jnp.float32))
    exact = _delta_vjp(reference_delta, cast(inputs, jnp.float64), cast(cotangents, jnp.float64))
    local = functools.partial(_delta_vjp, functools.partial(tpu_delta_interpret, tiles=TILES))
    rows = {name: P("x") for name in inputs}
    sharded = jax.shard_map(local, mesh=_mesh(2), in_specs=(rows, (P("x"), P("x"))),
                            out_specs=(P("x"), P("x"), rows), check_vma=True)
    found, single = (_run(jax.jit(fn), args) for fn in (sharded, local))
    leaves = lambda result: dict(zip(["output", "final_state", *result[2]], [*result[:2], *result[2].values()]))  # noqa: E731
    found, single, exact = leaves(found), leaves(single), leaves(exact)
    for name in single:
        tolerance = floor_tolerance(max_rel_error(single[name], exact[name]))
        assert max_rel_error(found[name], single[name]) <= tolerance, name
