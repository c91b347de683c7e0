"""The delta rule: the reference against a NumPy loop of the formula, `chunk` and `scan` against the float64
reference (forward and the gradients of every input) within a rounding floor measured here,
packed sequences with a traced `cu_seqlens`, the validation messages, and `delta_rule_step`."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import checkify
from jax.test_util import check_grads

import recurrax
from recurrax.tools.cases import DeltaCase as Case
from recurrax.tools.cases import delta_options as call_kwargs
from recurrax.tools.cases import make_delta_inputs as make_inputs
from recurrax.delta import canonicalize_delta, chunk_delta, kernel_registry, reference_delta, scan_delta

# ----------------------------------------------------------------------------- cases


def numpy_delta(query, key, value, beta, g=None, gk=None, initial_state=None, cu_seqlens=None,
                qk_l2norm=False, softmax_scale=None):
    """The formula of the issue written out with loops over rows, heads and tokens (float64)."""
    q, k, v, beta = (np.asarray(x, np.float64) for x in (query, key, value, beta))
    if qk_l2norm:
        q, k = (x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6) for x in (q, k))
    B, T, Hqk, K = q.shape
    H, V = v.shape[2:]
    scale = K**-0.5 if softmax_scale is None else softmax_scale
    spans = ([(b, 0, T) for b in range(B)] if cu_seqlens is None
             else [(0, int(s), int(e)) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])])
    out, finals = np.zeros((B, T, H, V)), np.zeros((len(spans), H, K, V))
    for row, (b, start, end) in enumerate(spans):
        for h in range(H):
            qk_head = h // (H // Hqk)
            S = np.zeros((K, V)) if initial_state is None else np.array(initial_state[row, h], np.float64)
            for t in range(start, end):
                a = np.zeros(K) + (0 if g is None else g[b, t, h]) + (0 if gk is None else gk[b, t, h])
                S = np.exp(a)[:, None] * S
                kt = k[b, t, qk_head]
                S = S + np.outer(kt, beta[b, t, h] * (v[b, t, h] - S.T @ kt))
                out[b, t, h] = scale * S.T @ q[b, t, qk_head]
            finals[row, h] = S
    return out, finals


# ----------------------------------------------------------------------------- the reference


REFERENCE_CASES = [
    Case(gates=("g", "gk"), Hqk=1, H=2, T=6, scale=0.3),
    Case(gates=("gk",), cu_seqlens=(0, 3, 3, 9), T=9, qk_l2norm=True, beta_range=(1.0, 2.0)),
]


@pytest.mark.parametrize("case", REFERENCE_CASES, ids=str)
def test_reference_matches_numpy_loop(case):
    args = make_inputs(case)
    o, final = recurrax.delta_rule(**args, **call_kwargs(case), implementation="reference")
    o_np, final_np = numpy_delta(**args, **call_kwargs(case))
    np.testing.assert_allclose(o, o_np, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(final, final_np, rtol=1e-12, atol=1e-12)


def test_reference_gradients_match_finite_differences():
    """The oracle's gradients (JAX's autodiff of the token loop) in every input, float64."""
    case = Case(gates=("g", "gk"), Hqk=1, H=2, T=4, K=3, V=2, B=1)
    args = make_inputs(case)
    names = [n for n in ("query", "key", "value", "beta", "g", "gk", "initial_state") if n in args]

    def f(*arrays):
        o, final = recurrax.delta_rule(**{**args, **dict(zip(names, arrays))}, implementation="reference")
        return jnp.sum(jnp.sin(o)), jnp.sum(jnp.cos(final))

    check_grads(f, [args[n] for n in names], order=1, modes=["rev"], atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------- chunk vs the reference

DIFFERENTIABLE = ("query", "key", "value", "beta", "g", "gk", "initial_state")
CHUNK = functools.partial(chunk_delta, chunk_size=8, leaf_size=2)  # several chunks and ladder levels at T ≈ 20
SCAN = functools.partial(scan_delta, block=4)  # several blocks, sequences ending inside one


def _run(algorithm, args: dict, case: Case):
    """(output, final_state) of `algorithm` on the canonical form of `args` (so `chunk` runs at
    a small chunk size); differentiable in every array argument."""
    kw = call_kwargs(case)
    problem, scale, layout = canonicalize_delta(
        args["query"], args["key"], args["value"], args["beta"], args.get("g"), args.get("gk"),
        kw["softmax_scale"], args.get("initial_state"), kw.get("cu_seqlens"), kw["qk_l2norm"])
    o, final = algorithm(problem, scale=scale)
    return layout.restore(o), final


def _values_and_grads(algorithm, args: dict, case: Case, cotangents):
    """Output, final state and the gradients of ⟨o, do⟩ + ⟨final, dfinal⟩ for every array input."""
    names = [n for n in DIFFERENTIABLE if n in args]

    def loss(diff):
        o, final = _run(algorithm, {**args, **diff}, case)
        return jnp.sum(o.astype(jnp.float64) * cotangents[0]) + jnp.sum(final.astype(jnp.float64) * cotangents[1]), (o, final)

    (_, (o, final)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))({n: args[n] for n in names})
    return {"output": o, "final_state": final, **{f"d_{n}": grads[n] for n in names}}


def _rel_error(x, exact) -> float:
    exact = np.asarray(exact, np.float64)
    return float(np.max(np.abs(np.asarray(x, np.float64) - exact)) / max(np.max(np.abs(exact)), 1e-30))


def chunk_errors(case: Case, algorithm=CHUNK) -> dict[str, tuple[float, float]]:
    """Per quantity: (`algorithm`'s float32 error, the float32 reference's error), both relative
    to the float64 reference's largest magnitude."""
    args64 = make_inputs(case)
    args32 = {n: np.asarray(x, np.float32) for n, x in args64.items()}
    o64, final64 = jax.eval_shape(lambda: _run(reference_delta, args64, case))  # shapes only: nothing run
    rng = np.random.default_rng(1)
    cotangents = (rng.normal(size=o64.shape), rng.normal(size=final64.shape))
    exact = _values_and_grads(reference_delta, args64, case, cotangents)
    floor = _values_and_grads(reference_delta, args32, case, cotangents)
    chunk = _values_and_grads(algorithm, args32, case, cotangents)
    return {n: (_rel_error(chunk[n], exact[n]), _rel_error(floor[n], exact[n])) for n in exact}


CHUNK_CASES = [
    Case(gates=("g", "gk"), Hqk=1, H=2, K=6, V=5),  # query/key shared by 2 value heads, K not a power of two
    Case(gates=("g", "gk"), cu_seqlens=(0, 7, 7, 16, 20), T=20),  # packed, an empty sequence
    Case(gates=("gk",), qk_l2norm=True, beta_range=(0.0, 2.0), initial_state=False),
    pytest.param(Case(gates=("gk",), gate_range=(-40.0, 0.0)), marks=pytest.mark.slow),  # e^-160 per chunk
    pytest.param(Case(), marks=pytest.mark.slow),
    pytest.param(Case(gates=("g",)), marks=pytest.mark.slow),
    pytest.param(Case(gates=("gk",)), marks=pytest.mark.slow),
    pytest.param(Case(gates=("g",), beta_range=(1.5, 2.0)), marks=pytest.mark.slow),
    pytest.param(Case(gates=("g",), T=70, K=16, V=16), marks=pytest.mark.slow),
]

ROUNDING_FACTOR = 8.0
"""chunk may be this many times the float32 reference's own error (both vs float64)."""
EPS32 = float(np.finfo(np.float32).eps)


def assert_within_floor(errors: dict[str, tuple[float, float]], name: str = "chunk") -> None:
    """Every (error, float32 reference error) pair of `chunk_errors` within ROUNDING_FACTOR
    times the reference's own error (at least float32's epsilon)."""
    bad = {n: e for n, e in errors.items() if not e[0] <= ROUNDING_FACTOR * max(e[1], EPS32)}
    assert not bad, f"({name} error, float32 reference error) exceeding the floor: {bad}"


@pytest.mark.parametrize("case", CHUNK_CASES, ids=str)
def test_chunk_matches_float64_reference(case):
    assert_within_floor(chunk_errors(case))


SCAN_CASES = [
    Case(gates=("g", "gk"), Hqk=1, H=2, K=6, V=5, beta_range=(0.0, 2.0)),
    Case(gates=("g", "gk"), cu_seqlens=(0, 7, 7, 16, 18, 20), T=20),  # packed: an empty one, ends inside blocks
    pytest.param(Case(gates=("g",), T=70, K=16, V=16, qk_l2norm=True), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("case", SCAN_CASES, ids=str)
def test_scan_matches_float64_reference(case):
    assert_within_floor(chunk_errors(case, SCAN), "scan")


def test_registry_explains_the_delta_rule_dispatch():
    args = _small()
    selection = kernel_registry.select(**args)
    names = [name for name, _ in selection.answers]
    assert selection.name == "chunk" and names == ["pallas_tpu", "chunk", "scan", "reference", "pallas_tpu_interpret"]
    assert "runs: chunk" in str(selection)
    assert kernel_registry.select(**args, implementation="scan").name == "scan"
    with pytest.raises(ValueError, match="beta must lie"):
        kernel_registry.select(**{**args, "beta": args["beta"] + 3})


@functools.cache
def _float64_pair():
    """Jitted (chunk, reference) at one fixed shape: property examples vary values, not shapes."""
    case = Case(gates=("g", "gk"), Hqk=1, H=2, T=21, K=4, V=3, cu_seqlens=(0, 6, 6, 21))

    def run(algorithm, args):
        return _run(algorithm, args, case)

    return case, jax.jit(functools.partial(run, CHUNK)), jax.jit(functools.partial(run, reference_delta))


@settings(max_examples=12)
@given(seed=st.integers(0, 2**16), gate_scale=st.floats(1e-3, 30.0), beta_max=st.floats(0.0, 2.0),
       key_scale=st.floats(0.1, 1.0))
def test_chunk_equals_reference_for_any_values(seed, gate_scale, beta_max, key_scale):
    """Float64, packed with an empty sequence: exact (≤ 1e-11 relative) for gate strengths from
    1e-3 to 30 per token (a chunk of 8 tokens decays by up to e^-480: underflow, never
    overflow), β anywhere in [0, 2], keys shorter than unit length."""
    case, chunk, reference = _float64_pair()
    args = make_inputs(case, seed)
    args["g"], args["gk"] = gate_scale * args["g"], gate_scale * args["gk"]
    args["beta"] = beta_max * args["beta"]
    args["key"] = key_scale * args["key"]
    (o, final), (o_ref, final_ref) = chunk(args), reference(args)
    assert o.dtype == final.dtype == jnp.float64
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(final))
    assert _rel_error(o, o_ref) < 1e-11 and _rel_error(final, final_ref) < 1e-11


# ----------------------------------------------------------------------------- the public entry


def test_delta_rule_default_is_chunk_and_keeps_the_query_dtype():
    case = Case(gates=("g",), T=40)
    args = {n: jnp.asarray(x, jnp.bfloat16 if n in ("query", "key", "value") else jnp.float32)
            for n, x in make_inputs(case).items()}
    o, final = recurrax.delta_rule(**args)
    o_ref, final_ref = recurrax.delta_rule(**args, implementation="reference")
    assert o.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    assert _rel_error(final, final_ref) < 1e-5
    assert _rel_error(o.astype(jnp.float32), o_ref.astype(jnp.float32)) < 1e-2  # bf16 output rounding


def test_packed_3d_with_traced_cu_seqlens_under_grad_of_jit():
    case = Case(gates=("g", "gk"), cu_seqlens=(0, 4, 4, 11, 16), T=16)
    args = {n: x[0] if n not in ("initial_state",) else x for n, x in make_inputs(case).items()}  # 3-D packed

    def loss(query, gk, cu, implementation):
        o, final = recurrax.delta_rule(**{**args, "query": query, "gk": gk}, cu_seqlens=cu,
                                       implementation=implementation)
        return jnp.sum(o * o) + jnp.sum(final)

    cu = jnp.asarray(case.cu_seqlens, jnp.int32)
    grads = jax.grad(jax.jit(functools.partial(loss, implementation="chunk")), argnums=(0, 1))(args["query"], args["gk"], cu)
    expected = jax.jit(jax.grad(functools.partial(loss, implementation="reference"), argnums=(0, 1)))(args["query"], args["gk"], cu)
    for got, want in zip(grads, expected):
        assert got.shape == want.shape and _rel_error(got, want) < 1e-12


_STEP_ARGS = ("query", "key", "value", "beta", "g", "gk")


@pytest.mark.parametrize("gates", [(), ("g",), ("gk",), ("g", "gk")], ids=["no_decay", "g", "gk", "g_gk"])
def test_delta_rule_step_matches_the_sequence(gates):
    """One token at a time (`_step.py`: both state reads before the update) equals the token
    loop, with a per-head decay, a per-key-channel one, both, or none."""
    case = Case(gates=gates, Hqk=1, H=2, T=5, qk_l2norm=True)
    args = make_inputs(case)
    o, final = recurrax.delta_rule(**args, qk_l2norm=True, implementation="reference")
    state, outs = args["initial_state"], []
    for t in range(case.T):
        token = {n: None if args.get(n) is None else args[n][:, t] for n in _STEP_ARGS}
        o_t, state = recurrax.delta_rule_step(**token, state=state, qk_l2norm=True)
        outs.append(o_t)
    np.testing.assert_allclose(np.stack(outs, 1), o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(state, final, rtol=1e-12, atol=1e-12)
    # several tokens at once: a prefill of 2, then the other 3 in one call
    prefix = {n: None if args.get(n) is None else args[n][:, :2] for n in _STEP_ARGS}
    rest = {n: None if prefix[n] is None else args[n][:, 2:] for n in prefix}
    o_2, state = recurrax.delta_rule_step(**prefix, state=args["initial_state"], qk_l2norm=True)
    o_3, state = recurrax.delta_rule_step(**rest, state=state, qk_l2norm=True)
    np.testing.assert_allclose(np.concatenate([o_2, o_3], 1), o, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(state, final, rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------- validation


def _small():
    return make_inputs(Case(gates=("g", "gk"), T=4, B=1))


@pytest.mark.parametrize("change, message", [
    (dict(beta=lambda a: a["beta"] + 2.5), r"beta must lie in \[0, 2\]"),
    (dict(beta=lambda a: -a["beta"] - 0.1), r"beta must lie in \[0, 2\]"),
    (dict(beta=lambda a: np.where(np.arange(4)[:, None] == 0, [np.nan, 5.0], a["beta"])), r"beta must lie in \[0, 2\]"),
    (dict(g=lambda a: -a["g"] + 0.1), r"g must be log decays"),
    (dict(gk=lambda a: -a["gk"]), r"gk must be log decays"),
    (dict(beta=lambda a: a["beta"][..., None]), r"beta must be \[batch, seq_len, num_heads\]"),
    (dict(key=lambda a: a["key"][:, :, :1]), r"key must be of the query's head count"),
    (dict(value=lambda a: a["value"][:, :, :1]), r"value must be"),
    (dict(initial_state=lambda a: a["initial_state"][..., :2]), r"initial_state must be"),
], ids=["beta_above_2", "beta_negative", "beta_above_2_beside_nan", "positive_g", "positive_gk", "beta_shape", "key_heads",
        "value_heads", "state_shape"])
def test_errors_name_the_argument(change, message):
    args = _small()
    args.update({n: f(args) for n, f in change.items()})
    with pytest.raises(ValueError, match=message):
        recurrax.delta_rule(**args)


def test_unknown_implementation_and_positive_gates_on_purpose():
    args = _small()
    with pytest.raises(ValueError, match="implementation must be one of"):
        recurrax.delta_rule(**args, implementation="fast")
    args["g"] = 0.01 * np.ones_like(args["g"])
    o, _ = recurrax.delta_rule(**args, allow_positive_gates=True)
    assert np.all(np.isfinite(o))


def test_traced_beta_is_checked_under_runtime_checks():
    args = _small()
    f = lambda beta: recurrax.delta_rule(**{**args, "beta": beta})[0]  # noqa: E731
    with recurrax.runtime_checks():
        error, _ = jax.jit(checkify.checkify(f))(args["beta"] + 3.0)
    with pytest.raises(Exception, match=r"beta must lie in \[0, 2\]"):
        error.throw()


def test_traced_nan_beta_is_a_non_finite_input_not_a_range_error():
    """Issue 49: a NaN β is judged as any non-finite input (its effect causal,
    tests/test_delta_finite.py), the range on the other values, concrete or traced."""
    args = _small()
    nan_beta = args["beta"].copy()
    nan_beta[0, 1, 0] = np.nan
    recurrax.delta_rule(**{**args, "beta": nan_beta})  # concrete: no error
    f = lambda beta: recurrax.delta_rule(**{**args, "beta": beta})[0]  # noqa: E731
    with recurrax.runtime_checks():
        clean, _ = jax.jit(checkify.checkify(f))(nan_beta)
        error, _ = jax.jit(checkify.checkify(f))(np.where(np.isnan(nan_beta), np.nan, nan_beta + 3.0))
    clean.throw()
    with pytest.raises(Exception, match=r"beta must lie in \[0, 2\]"):
        error.throw()


def test_expansive_keys_warn_and_fail_under_runtime_checks():
    """β‖k‖² > 2 makes the update expansive (issue 49: the README's example reached 5e17 with no
    word): concrete arguments warn, traced ones fail inside runtime_checks; unit keys
    (`qk_l2norm`) never do."""
    args = _small()
    beta = np.full_like(args["beta"], 1.0)
    key = args["key"] * 1.5  # unit keys (make_inputs): ‖k‖² = 2.25 > 2 at β = 1
    with pytest.warns(recurrax.delta.ExpansiveUpdateWarning, match=r"reaches 2\.25 > 2"):
        recurrax.delta_rule(**{**args, "key": key, "beta": beta})
    with warnings.catch_warnings():
        warnings.simplefilter("error", recurrax.delta.ExpansiveUpdateWarning)
        recurrax.delta_rule(**{**args, "key": key, "beta": beta}, qk_l2norm=True)
        recurrax.delta_rule(**{**args, "key": args["key"] * 1.4, "beta": beta})  # 1.96 ≤ 2
    f = lambda key: recurrax.delta_rule(**{**args, "key": key, "beta": beta})[0]  # noqa: E731
    with recurrax.runtime_checks():
        error, _ = jax.jit(checkify.checkify(f))(key)
        fine, _ = jax.jit(checkify.checkify(f))(args["key"])
    fine.throw()
    with pytest.raises(Exception, match="update is expansive"):
        error.throw()


# ----------------------------------------------------------------------------- memory


def _backward_temp_bytes(implementation: str, T: int, K: int = 64, V: int = 64) -> int:
    """XLA's temporaries of fwd+bwd in every input at [1, T, 1 head, K, V], per-head gate (compiled, not run)."""
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    args = (spec(1, T, 1, K), spec(1, T, 1, K), spec(1, T, 1, V), spec(1, T, 1), spec(1, T, 1))

    def loss(q, k, v, beta, g):
        o, final = recurrax.delta_rule(q, k, v, beta, g=g, implementation=implementation)
        return jnp.sum(o) + jnp.sum(final)

    compiled = jax.jit(jax.grad(loss, argnums=tuple(range(5)))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_chunk_and_scan_backward_keep_states_per_block_not_per_token():
    """The reference's autodiff keeps a K×V state per token; chunk's (one checkpointed scan step
    per chunk) and scan's (one checkpointed block of 64 tokens) keep one per chunk or block plus
    token-sized terms: at K = V = 64, C = 64 several times less."""
    T = 512
    per_token_states = T * 64 * 64 * 4
    reference = _backward_temp_bytes("reference", T)
    assert reference > per_token_states
    for name in ("chunk", "scan"):
        temp = _backward_temp_bytes(name, T)
        assert temp < per_token_states / 2 and temp < reference / 5, (name, temp, reference)
