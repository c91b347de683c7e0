"""The scan algorithm against the reference: forward, every gradient, block sizes, dtypes, memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cases import GATE_COMBOS, GATES, Case, assert_matches, make_inputs, max_rel_error, run_vjp, split_args
from hypothesis import given, settings
from hypothesis import strategies as st

import recurrax
from recurrax import Problem
from recurrax.recurrence._scan import scan_recurrent

ALL_GATES = GATES  # g_head and g_channel both set g; make_inputs lets the channel one win


@pytest.mark.parametrize("case", [Case(gates=gates) for gates in GATE_COMBOS], ids=str)
def test_gate_combinations_through_the_public_api(case):
    assert_matches("scan", case)


@pytest.mark.parametrize(
    "case",
    [
        Case(gates=("g_head", "gv"), cu_seqlens=(0, 3, 3, 4, 11), packed_3d=True),  # 3-D packed
        Case(gates=("gk", "g_gamma"), cu_seqlens=(0, 0, 5, 6, 9), reverse=True),  # [1, N, ...], reverse
    ],
    ids=str,
)
def test_varlen_through_the_public_api(case):
    assert_matches("scan", case)


# ----------------------------------------------------------------------------- block sizes


def checkpointed(checkpoint_every: int):
    """The scan algorithm with a chosen block size C (the registered one uses the default)."""
    return functools.partial(scan_recurrent, checkpoint_every=checkpoint_every)


def errors_vs_reference(got, expected) -> dict[str, float]:
    (o, state, grads), (o_ref, state_ref, grads_ref) = got, expected
    errors = {"output": max_rel_error(o, o_ref), "final_state": max_rel_error(state, state_ref)}
    errors.update({"d" + name: max_rel_error(grads[name], grads_ref[name]) for name in grads_ref})
    return errors


def jitted_vjp(implementation, kwargs: dict):
    """`run_vjp` compiled as one program (much faster here than running it op by op)."""
    diff, rest = split_args(kwargs)
    return jax.jit(lambda diff: run_vjp(implementation, {**diff, **rest}))(diff)


def assert_checkpointed_matches(case: Case, checkpoint_every: int, tol: float = 1e-9):
    """Like `assert_matches` (float64), compiled, with block size C."""
    kwargs = make_inputs(case)
    got = jitted_vjp(checkpointed(checkpoint_every), kwargs)
    for name, grad in got[2].items():
        assert grad.dtype == kwargs[name].dtype and grad.shape == kwargs[name].shape, name
    errors = errors_vs_reference(got, jitted_vjp("reference", kwargs))
    bad = {k: v for k, v in errors.items() if not v <= tol}
    assert not bad, f"scan(checkpoint_every={checkpoint_every}) vs reference on {case}: {bad}"


@pytest.mark.parametrize(
    "case, checkpoint_every",
    [
        (Case(gates=ALL_GATES), 4),  # T=9: two full blocks and a padded one
        (Case(gates=("g_head", "gk", "gv"), reverse=True, T=20), 4),  # T a multiple of C
        (Case(gates=("g_channel", "gv"), reverse=True, initial_state=False), 4),
        (Case(gates=("gk",), T=7, initial_state=False), 1),  # one token per block
        (Case(gates=("g_channel",), initial_state=False, Hkv=4, K=5, V=7, scale=0.3), 4),  # no GQA, K != V
        (Case(gates=("g_head", "gv"), Hkv=1, T=13), 4),  # one kv head for four query heads, odd T
        (Case(gates=("g_channel",), T=1, B=3), 4),
        (Case(gates=ALL_GATES, gate_low=-20.0), 4),  # strong decays
        (Case(gates=("g_head", "gv"), cu_seqlens=(0, 3, 3, 4, 11), packed_3d=True), 4),
        (Case(gates=ALL_GATES, cu_seqlens=(0, 1, 1, 8, 9), reverse=True, packed_3d=True), 4),
        (Case(gates=("g_channel", "gv"), cu_seqlens=(0, 5, 5, 6, 13, 13), reverse=True), 3),
        (Case(gates=("g_head",), cu_seqlens=(0, 0, 0, 2), initial_state=False), 4),
    ],
    ids=str,
)
def test_checkpoint_every(case, checkpoint_every):
    assert_checkpointed_matches(case, checkpoint_every)


def test_checkpoint_every_must_be_positive():
    x = jnp.ones((1, 2, 1, 2))
    problem = Problem.create(query=x, key=x, value=x)
    with pytest.raises(ValueError, match="checkpoint_every"):
        scan_recurrent(problem, scale=problem.default_scale, reverse=False, checkpoint_every=0)


# ----------------------------------------------------------------------------- numerics and dtypes


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_extreme_decays_stay_finite(dtype):
    case = Case(gates=ALL_GATES, gate_low=-1e4, dtype=dtype, B=1, T=6)
    kwargs = make_inputs(case)
    o, state, grads = got = jitted_vjp(checkpointed(4), kwargs)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in [o, state, *grads.values()])
    errors = errors_vs_reference(got, jitted_vjp("reference", kwargs))
    assert max(errors.values()) < (1e-9 if dtype == "float64" else 1e-5), errors


F32_TOLERANCE = 1e-5
BF16_TOLERANCE = 2e-2
"""Scale-relative, against the float64 reference on the same (rounded) input values; bf16
outputs and gradients are themselves rounded to bf16 (relative step 2**-8)."""


@pytest.mark.parametrize(
    "case, tol",
    [
        (Case(gates=ALL_GATES, cu_seqlens=(0, 4, 4, 11), dtype="float32"), F32_TOLERANCE),
        (Case(gates=("g_head", "gk", "gv"), reverse=True, dtype="float32", gate_low=-20.0), F32_TOLERANCE),
        (Case(gates=("g_head", "gk", "gv"), reverse=True, dtype="bfloat16"), BF16_TOLERANCE),
    ],
    ids=str,
)
def test_low_precision_against_float64_reference(case, tol):
    kwargs = make_inputs(case)
    o, state, grads = got = jitted_vjp("scan", kwargs)
    assert o.dtype == kwargs["query"].dtype and state.dtype == jnp.float32
    assert all(grads[name].dtype == kwargs[name].dtype for name in grads)
    exact = {k: (v.astype(jnp.float64) if k in grads else v) for k, v in kwargs.items()}
    errors = errors_vs_reference(got, jitted_vjp("reference", exact))
    assert max(errors.values()) < tol, errors


def test_state_dtypes():
    kwargs = make_inputs(Case(gates=("gv",), dtype="bfloat16", B=1, T=3))
    o, state = recurrax.recurrent(**kwargs, implementation="scan")
    assert o.dtype == jnp.bfloat16 and state.dtype == jnp.float32


# ----------------------------------------------------------------------------- transformations


def test_jit_with_traced_cu_seqlens():
    case = Case(gates=("g_head", "gk", "gv"), cu_seqlens=(0, 2, 2, 7, 12), packed_3d=True, reverse=True)
    kwargs = make_inputs(case)
    diff, rest = split_args(kwargs)
    rest.pop("cu_seqlens")
    rng = np.random.default_rng(5)

    @functools.partial(jax.jit, static_argnums=2)
    def loss_and_grads(diff, cu_seqlens, implementation):
        def loss(diff):
            call = dict(cu_seqlens=cu_seqlens, implementation=implementation)
            o, state = recurrax.recurrent(**diff, **rest, **call)
            return jnp.sum(o * w_o) + jnp.sum(state * w_s)

        return jax.value_and_grad(loss)(diff)

    w_o = rng.standard_normal((12, case.H, case.V))
    w_s = rng.standard_normal((4, case.H, case.K, case.V))
    for cu in [(0, 2, 2, 7, 12), (0, 0, 6, 6, 12), (0, 12, 12, 12, 12)]:
        cu_seqlens = jnp.asarray(cu, jnp.int32)
        value, grads = loss_and_grads(diff, cu_seqlens, "scan")
        ref_value, ref_grads = loss_and_grads(diff, cu_seqlens, "reference")
        assert abs(float(value - ref_value)) <= 1e-9 * abs(float(ref_value))
        for name in diff:
            assert max_rel_error(grads[name], ref_grads[name]) < 1e-9, (cu, name)
    assert loss_and_grads._cache_size() == 2  # one compile per implementation, none per cu_seqlens


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_vmap_over_a_leading_axis(varlen):
    cu = (0, 3, 3, 9) if varlen else None
    cases = [Case(gates=("g_head", "gv"), cu_seqlens=cu, packed_3d=varlen, T=9)]
    examples = [make_inputs(cases[0], seed) for seed in (0, 1, 2)]
    diffs, rests = zip(*map(split_args, examples))
    rest = rests[0]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *diffs)

    def loss(implementation, diff):
        o, state = recurrax.recurrent(**diff, **rest, implementation=implementation)
        return jnp.sum(jnp.sin(o)) + jnp.sum(state**2)

    grads = jax.jit(jax.vmap(jax.grad(functools.partial(loss, "scan"))))(stacked)
    reference_grad = jax.jit(jax.grad(functools.partial(loss, "reference")))
    for i, diff in enumerate(diffs):
        expected = reference_grad(diff)
        for name in diff:
            assert max_rel_error(grads[name][i], expected[name]) < 1e-9, (i, name)


# ----------------------------------------------------------------------------- property test

GATE_KINDS = [(), ("g_head",), ("g_channel", "gv"), ("g_gamma", "gk"), ("g_head", "gk", "gv")]


PROPERTY = dict(
    T=st.sampled_from([1, 6, 11]),
    heads=st.sampled_from([(2, 1), (2, 2)]),
    gates=st.sampled_from(GATE_KINDS),
    reverse=st.booleans(),
    initial_state=st.booleans(),
    checkpoint_every=st.sampled_from([2, 4, 64]),
    packed=st.booleans(),
)
"""Each example is a new shape (two compiles): the default run draws 4, `-m slow` 10 more."""


@settings(max_examples=4, deadline=None)
@given(**PROPERTY)
def test_property_matches_reference(T, heads, gates, reverse, initial_state, checkpoint_every, packed):
    check_property(T, heads, gates, reverse, initial_state, checkpoint_every, packed)


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(**PROPERTY)
def test_property_matches_reference_more_examples(T, heads, gates, reverse, initial_state, checkpoint_every, packed):
    check_property(T, heads, gates, reverse, initial_state, checkpoint_every, packed)


def check_property(T, heads, gates, reverse, initial_state, checkpoint_every, packed):
    H, Hkv = heads
    cu = (0, 0, T // 2, T) if packed else None
    case = Case(B=1 if packed else 2, T=T, H=H, Hkv=Hkv, K=4, V=3, gates=gates, reverse=reverse,
                initial_state=initial_state, cu_seqlens=cu, packed_3d=packed)
    assert_checkpointed_matches(case, checkpoint_every)


# ----------------------------------------------------------------------------- memory and registry


ONE_STATE_PER_TOKEN = 16384 * 4 * 64 * 64 * 4  # bytes: T·H·K·V float32 = 1 GiB
MEMORY_BOUND = 128 * 2**20


def test_backward_memory_is_far_below_one_state_per_token():
    B, T, H, K, V = 1, 16384, 4, 64, 64
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731

    def loss(query, key, value, g, gv):
        o, state = recurrax.recurrent(query, key, value, g=g, gv=gv, implementation="scan")
        return jnp.sum(o) + jnp.sum(state)

    grad_fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
    args = spec(B, T, H, K), spec(B, T, H, K), spec(B, T, H, V), spec(B, T, H, K), spec(B, T, H, V)
    temp = grad_fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
    print(f"scan backward temp memory, B=1 T=16384 H=4 K=V=64 f32 with g and gv: {temp / 2**20:.1f} MiB")
    assert temp < MEMORY_BOUND < ONE_STATE_PER_TOKEN


def test_registered_with_its_support():
    impl = {i.name: i for i in recurrax.kernel_registry.implementations()}["scan"]
    assert impl.priority == 10
    assert impl.support.varlen and impl.support.gates == frozenset({"head", "key", "value"})
    assert impl.support.dtypes == frozenset({"float16", "bfloat16", "float32", "float64"})
