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


# --------------------------------------------------------------------------- eager calls


def test_eager_calls_reuse_one_compiled_program():
    """Outside jit, a second call with the same shapes runs the cached program (no new trace);
    new shapes or options compile once more; under an outer jit nothing is cached here."""
    from recurrax.recurrence._api import _recurrent

    kwargs = make_inputs(Case(B=1, T=5, H=2, Hkv=2, K=4, V=4, gates=("g_head",), dtype="float32"))
    before = _recurrent.jitted._cache_size()
    first = recurrax.recurrent(**kwargs)
    second = recurrax.recurrent(**kwargs)
    assert _recurrent.jitted._cache_size() == before + 1
    assert outputs_close(first, second, 1e-12)
    recurrax.recurrent(**kwargs, implementation="scan")
    assert _recurrent.jitted._cache_size() == before + 2
    arrays, static = split_args(kwargs)
    jax.jit(lambda arrays: recurrax.recurrent(**arrays, **static))(arrays)
    assert _recurrent.jitted._cache_size() == before + 2


# --------------------------------------------------------------------------- gate signs


GATE_SHAPES = {"g": (2, 5, 3), "g_gamma": (3,), "gk": (2, 5, 3, 4), "gv": (2, 5, 3, 4)}


def _gate_call(**gates):
    x = jnp.ones((2, 5, 3, 4))
    return recurrax.recurrent(x, x, x, **gates)


@pytest.mark.parametrize("name", list(GATE_SHAPES))
def test_positive_log_decay_names_the_argument_and_its_largest_value(name):
    values = -np.ones(GATE_SHAPES[name])
    values.flat[1] = 2.5
    with pytest.raises(ValueError, match=rf"{name} must be log decays.*largest value of 2\.5"):
        _gate_call(**{name: jnp.asarray(values)})


def test_decay_factors_get_a_hint_and_positive_gates_can_be_allowed():
    factors = jnp.full(GATE_SHAPES["g"], 0.9)
    with pytest.raises(ValueError, match=r"decay factors: pass their log \(e\.g\. jnp\.log\(g\)\)"):
        _gate_call(g=factors)
    o, state = recurrax.recurrent(*(jnp.ones((2, 5, 3, 4)),) * 3, g=factors, allow_positive_gates=True)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(state))
    _gate_call(g=jnp.log(factors))  # the log decays pass


def test_runtime_checks_catch_traced_positive_gates_and_bad_cu_seqlens():
    from jax.experimental import checkify

    x = jnp.ones((10, 3, 4))

    def run(g, cu):
        return recurrax.recurrent(x, x, x, g=g, cu_seqlens=cu)[0]

    good_g, good_cu = -jnp.ones((10, 3)), jnp.array([0, 4, 10])
    with recurrax.runtime_checks():
        checked = jax.jit(checkify.checkify(run))
        error, _ = checked(good_g, good_cu)
        error.throw()  # nothing wrong
        error, _ = checked(good_g.at[2, 1].set(0.5), good_cu)
        with pytest.raises(Exception, match=r"g must be log decays.*0\.5"):
            error.throw()
        error, _ = checked(good_g, jnp.array([0, 4, 7]))  # leaves tokens 7..9 unassigned
        with pytest.raises(Exception, match="cu_seqlens must end at the token count 10"):
            error.throw()


def test_the_default_path_adds_no_check():
    x = jnp.ones((10, 3, 4))
    jaxpr = str(jax.make_jaxpr(lambda g, cu: recurrax.recurrent(x, x, x, g=g, cu_seqlens=cu))(-jnp.ones((10, 3)),
                                                                                           jnp.array([0, 4, 10])))
    assert "check" not in jaxpr and "callback" not in jaxpr


# --------------------------------------------------------------------------- which implementation


def test_select_says_which_implementation_runs_and_why_others_refuse():
    x = jnp.ones((2, 5, 3, 16), jnp.float32)
    selection = kernel_registry.select(x, x, x, gv=-jnp.ones((2, 5, 3, 16), jnp.float32))
    answers = dict(selection.answers)
    assert selection.name == kernel_registry.get(None, recurrax.Request.of(recurrax.Problem.create(
        query=x, key=x, value=x, gv=-jnp.ones((2, 5, 3, 16), jnp.float32)))).name
    assert "runs on gpu" in answers["pallas_gpu"] and "gate kinds ['value']" in answers["pallas_interpret"]
    assert f"runs: {selection.name}" in str(selection)
    assert kernel_registry.select(x, x, x, implementation="scan").name == "scan"
