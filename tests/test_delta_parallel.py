"""`recurrax.parallel.delta_rule` against one-device `recurrax.delta_rule`, on 8 host CPU devices
(conftest.py asks for them).

Every case compares the output, the final state and the gradient of every differentiable input
(one `jax.vjp` with random cotangents, inside one `jit`, so `cu_seqlens` is traced). In float64
the sharded call must equal the one-device token loop (`reference`) to rounding; in float32 it
must stay within `floor_tolerance` of the one-device float32 call, the floor being that call's
own error against float64.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cases import floor_tolerance
from test_delta import Case, make_inputs
from test_parallel import Split

import recurrax
from recurrax import parallel

DIFFERENTIABLE = ("query", "key", "value", "beta", "g", "gk", "initial_state")
SMALL = dict(T=16, Hqk=1, H=2, K=4, V=3)  # grouped query/key heads and K != V everywhere
EXACT = 1e-10
"""Float64: the sharded call against the one-device token loop (rounding is ~1e-15)."""

slow = pytest.mark.slow


def inputs(case: Case, dtype=jnp.float64) -> tuple[dict, dict]:
    """(the differentiable arrays in `dtype`, the other arguments) of `delta_rule` for `case`."""
    arrays = {n: jnp.asarray(x, dtype) for n, x in make_inputs(case).items()}
    options = dict(qk_l2norm=case.qk_l2norm, softmax_scale=case.scale)
    if case.cu_seqlens is not None:
        options["cu_seqlens"] = jnp.asarray(case.cu_seqlens, jnp.int32)
    return arrays, options


def vjp_results(fn, arrays: dict, options: dict, seed: int = 1) -> dict:
    """Output, final state and the gradients of every array for random cotangents, under one
    `jit` (`cu_seqlens` traced; the cotangents drawn in float64 whatever the dtype)."""
    cu_seqlens = options.get("cu_seqlens")
    static = {n: x for n, x in options.items() if n != "cu_seqlens"}

    @jax.jit
    def run(arrays, cu_seqlens):
        call = lambda a: fn(**a, **static, cu_seqlens=cu_seqlens)  # noqa: E731
        (output, state), pullback = jax.vjp(call, arrays)
        key_o, key_s = jax.random.split(jax.random.PRNGKey(seed))
        d_output = jax.random.normal(key_o, output.shape, jnp.float64).astype(output.dtype)
        d_state = jax.random.normal(key_s, state.shape, jnp.float64).astype(state.dtype)
        grads = pullback((d_output, d_state))[0]
        return {"output": output, "final_state": state, **{"d_" + n: g for n, g in grads.items()}}

    return run(arrays, cu_seqlens)


def scaled_error(x, exact) -> float:
    """max |x − exact| / max |exact|."""
    x, exact = np.asarray(x, np.float64), np.asarray(exact, np.float64)
    return float(np.max(np.abs(x - exact)) / max(np.max(np.abs(exact)), 1e-30)) if exact.size else 0.0


def sharded(split: Split, **options):
    mesh = split.mesh()
    return lambda **kw: parallel.delta_rule(**kw, mesh=mesh, **split.axes(), **options)


def one_device(implementation: str | None = None):
    return lambda **kw: recurrax.delta_rule(**kw, implementation=implementation)


def float64_errors(case: Case, split: Split, **options) -> dict[str, float]:
    """Scale-relative errors of the sharded call against the one-device token loop, in float64."""
    arrays, call_options = inputs(case)
    got = vjp_results(sharded(split, **options), arrays, call_options)
    want = vjp_results(one_device("reference"), arrays, call_options)
    for name, x in got.items():
        assert x.shape == want[name].shape and x.dtype == want[name].dtype == jnp.float64, name
    assert set(got) == {"output", "final_state", *("d_" + n for n in arrays)}
    return {name: scaled_error(x, want[name]) for name, x in got.items()}


DENSE = [
    (Case(**SMALL, gates=("g", "gk")), Split(8)),  # per-head and per-channel gates together
    (Case(**SMALL, gates=("g",), qk_l2norm=True, beta_range=(0.0, 2.0)), Split(4, batch=2)),
    pytest.param(Case(**SMALL, gates=("gk",), scale=0.3), Split(2, head=2), marks=slow),  # 1 qk head over 2 shards
    pytest.param(Case(**SMALL, initial_state=False), Split(8), marks=slow),  # DeltaNet: no gate
    pytest.param(Case(**{**SMALL, "Hqk": 2}, gates=("gk",), gate_range=(-30.0, 0.0)), Split(4, head=2), marks=slow),
]

PACKED = [
    # one sequence inside shard 0, an empty one, one across shards 0-2, one across a shard edge
    (Case(**SMALL, gates=("gk",), cu_seqlens=(0, 3, 3, 11, 16)), Split(4)),
    # one sequence over six shards (four wholly inside it) ending on a shard edge, where the
    # next one starts; empty sequences first and last
    (Case(**SMALL, gates=("g",), cu_seqlens=(0, 0, 1, 12, 16, 16), qk_l2norm=True), Split(8)),
    # boundaries exactly on shard edges, heads split
    pytest.param(Case(**SMALL, gates=("g", "gk"), cu_seqlens=(0, 4, 8, 8, 16)), Split(4, head=2), marks=slow),
    # a sequence starting mid-shard and running to the end, β up to 2, no initial state
    pytest.param(
        Case(**SMALL, gates=("g", "gk"), cu_seqlens=(0, 2, 2, 7, 16), beta_range=(0.0, 2.0), initial_state=False),
        Split(8), marks=slow,
    ),
]


def _ids(x):
    return str(x) if isinstance(x, Split) else None


@pytest.mark.parametrize(("case", "split"), DENSE, ids=_ids)
def test_dense_equals_one_device(case, split):
    errors = float64_errors(case, split)
    assert max(errors.values()) <= EXACT, errors


@pytest.mark.parametrize(("case", "split"), PACKED, ids=_ids)
def test_packed_equals_one_device(case, split):
    errors = float64_errors(case, split)
    assert max(errors.values()) <= EXACT, errors


@slow
def test_reference_as_the_local_algorithm():
    case = Case(**SMALL, gates=("g", "gk"), cu_seqlens=(0, 5, 5, 16))
    errors = float64_errors(case, Split(4), implementation="reference")
    assert max(errors.values()) <= EXACT, errors


@pytest.mark.parametrize(
    "case",
    [
        Case(**{**SMALL, "K": 8, "V": 8}, gates=("g", "gk")),
        pytest.param(Case(**{**SMALL, "K": 8, "V": 8}, gates=("g",), cu_seqlens=(0, 3, 3, 11, 16)), marks=slow),
    ],
    ids=["dense", "packed"],
)
def test_float32_within_the_one_device_floor(case):
    """Float32 on 8 shards against float32 on one device (both `chunk`), within the floor
    measured here: the one-device float32 call's own error against float64."""
    arrays64, options = inputs(case)
    arrays32 = {n: x.astype(jnp.float32) for n, x in arrays64.items()}
    exact = vjp_results(one_device("reference"), arrays64, options)
    single = vjp_results(one_device(), arrays32, options)
    got = vjp_results(sharded(Split(8)), arrays32, options)
    bad = {}
    for name, x in got.items():
        assert x.dtype == single[name].dtype == jnp.float32, name
        floor = scaled_error(single[name], exact[name])
        error = scaled_error(x, single[name])
        if not error <= floor_tolerance(floor):
            bad[name] = (error, floor)
    assert not bad, f"(sharded vs one device, one device's floor): {bad}"


def test_half_precision_query_keeps_its_dtype():
    case = Case(**SMALL, gates=("g",))
    arrays, options = inputs(case, jnp.float32)
    arrays = {**arrays, **{n: arrays[n].astype(jnp.bfloat16) for n in ("query", "key", "value")}}
    output, state = parallel.delta_rule(**arrays, **options, mesh=Split(4).mesh(), sequence_axis="seq")
    output_ref, state_ref = recurrax.delta_rule(**arrays, **options)
    assert output.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    assert scaled_error(state, state_ref) < 1e-5
    assert scaled_error(output, output_ref) < 1e-2  # bfloat16 output rounding


@pytest.mark.skipif(not hasattr(jax, "set_mesh"), reason="explicit mesh axes need jax.set_mesh")
def test_explicit_mesh_axes():
    arrays, options = inputs(Case(**SMALL, gates=("g",), cu_seqlens=(0, 5, 5, 16)))
    mesh = jax.make_mesh((4,), ("seq",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        call = jax.jit(lambda a, cu: parallel.delta_rule(**a, cu_seqlens=cu, mesh=mesh, sequence_axis="seq"))
        output, state = call(arrays, options["cu_seqlens"])
    output_ref, state_ref = recurrax.delta_rule(**arrays, **options, implementation="reference")
    assert scaled_error(output, output_ref) <= EXACT and scaled_error(state, state_ref) <= EXACT


def _collectives(case: Case, split: Split) -> list[str]:
    """The collective instructions of the compiled forward, as `op result-type` strings."""
    arrays, options = inputs(case)
    mesh = split.mesh()
    forward = jax.jit(lambda a: parallel.delta_rule(**a, **options, mesh=mesh, **split.axes()))
    text = forward.lower(arrays).compile().as_text()
    pattern = r"= (\S+) (all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)(?:-start)?\("
    return sorted(f"{op} {shape.split('{')[0]}" for shape, op in re.findall(pattern, text))


def test_forward_exchanges_one_widened_state_per_shard_whatever_the_length():
    short, long = (_collectives(Case(**{**SMALL, "T": T}, gates=("gk",)), Split(4)) for T in (16, 64))
    # [P, B, H, K, K + V], and the first position a non-finite input taints per row and head
    # (`delta/_finite.py`: a pmin of [B, H] integers)
    assert short == long == ["all-gather f64[4,2,2,4,7]", "all-reduce s32[2,2]"]


# --- errors: raised while tracing or right after, as for one device -------------------------


def _call(case: Case, split: Split, change=None, **axes):
    arrays, options = inputs(case)
    if change:
        arrays.update({n: f(arrays) for n, f in change.items()})
    return parallel.delta_rule(**arrays, **options, mesh=split.mesh(), **{**split.axes(), **axes})


def test_indivisible_token_counts_are_refused():
    with pytest.raises(ValueError, match=r"seq_len=18 is not divisible by the 4 shards of sequence_axis='seq'"):
        _call(Case(**{**SMALL, "T": 18}), Split(4))
    with pytest.raises(ValueError, match=r"total_tokens=18 is not divisible by the 8 shards"):
        _call(Case(**{**SMALL, "T": 18}, cu_seqlens=(0, 7, 18)), Split(8))


def test_indivisible_value_heads_are_refused():
    with pytest.raises(ValueError, match="num_heads=3 is not divisible by the 2 shards of 'head'"):
        _call(Case(**{**SMALL, "H": 3}), Split(2, head=2))


def test_missing_mesh_axis_is_named():
    with pytest.raises(ValueError, match=r"sequence_axis='tokens' is not an axis of the mesh"):
        _call(Case(**SMALL), Split(2), sequence_axis="tokens")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(beta=lambda a: a["beta"] + 2.5), r"beta must lie in \[0, 2\]"),
        (dict(g=lambda a: -a["g"] + 0.1), r"g must be log decays"),
        (dict(key=lambda a: a["key"][..., :2]), r"key must be"),
    ],
    ids=["beta_above_2", "positive_g", "key_shape"],
)
def test_argument_checks_are_the_one_device_ones(change, message):
    with pytest.raises(ValueError, match=message):
        _call(Case(**SMALL, gates=("g",)), Split(2), change)
