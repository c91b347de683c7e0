"""The public contract, for every XLA implementation: jit, grad, vmap, traced cu_seqlens, dtypes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cases import Case, make_inputs, max_rel_error, run_vjp, split_args

import recurrax
from recurrax import Platform, kernel_registry

IMPLEMENTATIONS = [impl.name for impl in kernel_registry.implementations() if impl.platform is Platform.XLA]
CASE = Case(B=2, T=7, H=4, Hkv=2, K=4, V=3, gates=("g_head", "gk", "gv", "g_gamma"))
PACKED = Case(T=11, H=2, Hkv=1, K=4, V=3, gates=("g_channel", "gv"), cu_seqlens=(0, 0, 4, 5, 11), packed_3d=True)


def outputs_close(a, b, tol=1e-10):
    return all(max_rel_error(x, y) < tol for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_jit_grad_equals_eager(name):
    kwargs = make_inputs(CASE)
    diff, rest = split_args(kwargs)

    def loss(diff, implementation=name):
        o, state = recurrax.recurrent(**diff, **rest, implementation=implementation)
        return jnp.sum(jnp.sin(o)) + jnp.sum(state**2)

    eager = jax.grad(loss)(diff)
    jitted = jax.jit(jax.grad(loss))(diff)
    reference = jax.grad(loss)(diff, "reference")
    assert outputs_close(eager, jitted) and outputs_close(jitted, reference)
    assert set(eager) == set(diff)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(eager))


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_vmap_over_a_leading_axis(name):
    stacked = [make_inputs(CASE, seed) for seed in (0, 1)]
    diff = jax.tree.map(lambda *xs: jnp.stack(xs), *[split_args(k)[0] for k in stacked])
    rest = split_args(stacked[0])[1]
    batched = jax.vmap(lambda d: recurrax.recurrent(**d, **rest, implementation=name))(diff)
    for i, kwargs in enumerate(stacked):
        single = recurrax.recurrent(**kwargs, implementation="reference")
        assert outputs_close(jax.tree.map(lambda x: x[i], batched), single)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_traced_cu_seqlens_under_jit(name):
    kwargs = make_inputs(PACKED)
    diff, rest = split_args(kwargs)
    rest = {k: v for k, v in rest.items() if k != "cu_seqlens"}

    @jax.jit
    def forward_and_grad(diff, cu_seqlens):
        def loss(diff):
            o, state = recurrax.recurrent(**diff, **rest, cu_seqlens=cu_seqlens, implementation=name)
            return jnp.sum(jnp.cos(o)) + jnp.sum(state * jnp.arange(state.size).reshape(state.shape) / state.size)

        return jax.value_and_grad(loss)(diff)

    for boundaries in ((0, 0, 4, 5, 11), (0, 6, 6, 7, 11), (0, 1, 2, 3, 11)):
        cu = jnp.asarray(boundaries, jnp.int32)
        got = forward_and_grad(diff, cu)

        def loss_ref(diff):
            o, state = recurrax.recurrent(**diff, **rest, cu_seqlens=np.asarray(boundaries), implementation="reference")
            return jnp.sum(jnp.cos(o)) + jnp.sum(state * jnp.arange(state.size).reshape(state.shape) / state.size)

        assert outputs_close(got, jax.value_and_grad(loss_ref)(diff)), boundaries


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype, state_dtype", [("bfloat16", "float32"), ("float32", "float32"), ("float64", "float64")])
def test_dtypes(name, dtype, state_dtype):
    kwargs = make_inputs(Case(B=1, T=5, H=2, Hkv=2, K=4, V=4, gates=("g_head",), dtype=dtype))
    o, state, grads = run_vjp(name, kwargs)
    assert o.dtype == jnp.dtype(dtype) and state.dtype == jnp.dtype(state_dtype)
    assert all(grads[k].dtype == kwargs[k].dtype for k in grads)
    o_ref, state_ref = recurrax.recurrent(**{k: (v.astype(jnp.float64) if hasattr(v, "astype") else v)
                                             for k, v in kwargs.items()}, implementation="reference")
    tol = {"bfloat16": 3e-2, "float32": 1e-5, "float64": 1e-12}[dtype]
    assert max_rel_error(o, o_ref) < tol and max_rel_error(state, state_ref) < tol


def test_default_dispatch_picks_the_highest_priority_xla_implementation():
    best = IMPLEMENTATIONS[0]
    request = recurrax.Request("float32", frozenset({"head", "key", "value"}), True, "cpu", 8, 8, 16)
    assert kernel_registry.get(None, request).name == best
