"""Nested `jit` with a traced `cu_seqlens`, for every implementation of every operation.

Real code differentiates jitted functions (a jitted layer inside a jitted train step), so
`cu_seqlens` reaches the operation as a tracer of an inner `jit` while an outer transform
differentiates it. The four patterns of issue 31 — `grad(jit(f))`, `jit(grad(jit(f)))`,
`value_and_grad(jit(f))` and `vjp(jit(f))` — each against the float64 reference's gradient,
packed and dense, with and without an initial state. The default tier runs every
implementation under `grad(jit(f))` (the pattern that crashed) and the default
implementation under all four; `-m slow` runs the whole product. The delta rule
(`recurrax.delta_rule`, its `reference`, `scan` and `chunk`) the same way, three cases in the default tier.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from _cases import Case, make_inputs, max_rel_error, split_args
from test_delta import Case as DeltaCase
from test_delta import make_inputs as delta_inputs

import recurrax
from recurrax.kernels import mosaic_gpu
from recurrax.kernels.tpu import TpuTiles, tpu_interpret
from recurrax.tools.cases import call

IMPLEMENTATIONS = {
    "reference": "reference",
    "scan": "scan",
    "chunk": "chunk",
    "pallas_interpret": "pallas_interpret",
    "tpu_interpret": functools.partial(tpu_interpret, tiles=TpuTiles(chunk=16, sub=8, block_v=16)),
    "mosaic_gpu_interpret": mosaic_gpu.mosaic_gpu_interpret,
}
PATTERNS = {
    "grad(jit(f))": lambda f: jax.grad(jax.jit(f)),
    "jit(grad(jit(f)))": lambda f: jax.jit(jax.grad(jax.jit(f))),
    "value_and_grad(jit(f))": lambda f: lambda *args: jax.value_and_grad(jax.jit(f))(*args)[1],
    "vjp(jit(f))": lambda f: lambda *args: jax.vjp(jax.jit(f), *args)[1](jnp.ones((), jnp.float32))[0],
}
LAYOUTS = {
    "packed": dict(cu_seqlens=(0, 5, 5, 19), T=19, B=1),
    "dense": dict(B=2, T=19),
}
DEFAULT_TIER = {("chunk", pattern, "packed", True) for pattern in PATTERNS} | {
    ("chunk", "grad(jit(f))", "dense", False)
} | {(name, "grad(jit(f))", "packed", True) for name in IMPLEMENTATIONS if name != "mosaic_gpu_interpret"}


def _case(name: str, layout: str, initial_state: bool) -> Case:
    mosaic = name == "mosaic_gpu_interpret"
    dims = dict(H=2, Hkv=2, K=64, V=64, dtype="bfloat16") if mosaic else dict(H=2, Hkv=1, K=16, V=16, dtype="float32")
    return Case(gates=("g_head", "gk"), initial_state=initial_state, **LAYOUTS[layout], **dims)


def _params(implementations, default_tier):
    """Every (implementation, pattern, layout, initial state), those not in `default_tier` slow."""
    for name in implementations:
        for pattern in PATTERNS:
            for layout in LAYOUTS:
                for initial_state in (True, False):
                    fast = (name, pattern, layout, initial_state) in default_tier
                    marks = [] if fast else [pytest.mark.slow]
                    yield pytest.param(name, pattern, layout, initial_state, marks=marks,
                                       id=f"{name}-{pattern}-{layout}-{'init' if initial_state else 'zero'}")


def _loss(implementation, rest, diff, cu_seqlens):
    kwargs = dict(rest, cu_seqlens=cu_seqlens) if cu_seqlens is not None else rest
    output, final = call(implementation, **diff, **kwargs)
    weights = jnp.cos(jnp.arange(output.size, dtype=jnp.float32)).reshape(output.shape)
    return jnp.sum(output.astype(jnp.float32) * weights) + jnp.sum(jnp.sin(final.astype(jnp.float32)))


@functools.cache
def _expected(case: Case) -> dict:
    """The float64 reference's gradient of the loss (one per case)."""
    diff, rest = split_args(make_inputs(case))
    cu_seqlens = rest.pop("cu_seqlens", None)
    exact = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), diff)
    return jax.grad(functools.partial(_loss, "reference", rest))(exact, cu_seqlens)


@pytest.mark.parametrize(("name", "pattern", "layout", "initial_state"), list(_params(IMPLEMENTATIONS, DEFAULT_TIER)))
def test_nested_jit_with_traced_cu_seqlens(name, pattern, layout, initial_state):
    if name == "mosaic_gpu_interpret" and not mosaic_gpu.has_interpret_mode():
        pytest.skip("Mosaic GPU interpret mode needs JAX >= 0.12")
    case = _case(name, layout, initial_state)
    diff, rest = split_args(make_inputs(case))
    cu_seqlens = rest.pop("cu_seqlens", None)
    traced = None if cu_seqlens is None else jnp.asarray(cu_seqlens)
    grads = PATTERNS[pattern](functools.partial(_loss, IMPLEMENTATIONS[name], rest))(diff, traced)
    expected = _expected(case)
    tolerance = 5e-2 if case.dtype == "bfloat16" else 2e-4
    for key in diff:
        assert max_rel_error(grads[key], expected[key]) < tolerance, key


# ----------------------------------------------------------------------------- the delta rule

DELTA_IMPLEMENTATIONS = ("reference", "scan", "chunk")
DELTA_DEFAULT_TIER = {("chunk", "grad(jit(f))", "packed", True), ("chunk", "vjp(jit(f))", "dense", False),
                      ("scan", "grad(jit(f))", "packed", True)}


@functools.cache
def _delta_inputs(layout: str, initial_state: bool):
    """(differentiable float32 arrays, cu_seqlens or None) of a small gated delta-rule call
    (`test_delta`'s inputs): query/key shared by two value heads, per-head and per-channel
    gates, beta up to 2."""
    spec = LAYOUTS[layout]
    case = DeltaCase(gates=("g", "gk"), B=spec["B"], T=spec["T"], Hqk=1, H=2, K=16, V=16, initial_state=initial_state,
                     cu_seqlens=spec.get("cu_seqlens"), beta_range=(0.0, 2.0))
    return {name: jnp.asarray(x, jnp.float32) for name, x in delta_inputs(case).items()}, case.cu_seqlens


def _delta_loss(implementation, diff, cu_seqlens):
    output, final = recurrax.delta_rule(**diff, cu_seqlens=cu_seqlens, implementation=implementation)
    weights = jnp.cos(jnp.arange(output.size, dtype=output.dtype)).reshape(output.shape)
    return jnp.sum(output * weights) + jnp.sum(jnp.sin(final))


@pytest.mark.parametrize(("name", "pattern", "layout", "initial_state"), list(_params(DELTA_IMPLEMENTATIONS, DELTA_DEFAULT_TIER)))
def test_delta_rule_nested_jit_with_traced_cu_seqlens(name, pattern, layout, initial_state):
    diff, cu_seqlens = _delta_inputs(layout, initial_state)
    traced = None if cu_seqlens is None else jnp.asarray(cu_seqlens)
    grads = PATTERNS[pattern](functools.partial(_delta_loss, name))(diff, traced)
    exact = jax.tree.map(lambda x: x.astype(jnp.float64), diff)
    expected = jax.grad(functools.partial(_delta_loss, "reference"))(exact, traced)
    for key in diff:
        assert max_rel_error(grads[key], expected[key]) < 2e-4, key
