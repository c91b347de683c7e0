"""`recurrax.parallel.recurrent` against single-device `recurrax.recurrent`, on 8 host CPU devices.

Every case compares outputs, final state and the gradient of every differentiable argument
(one `jax.vjp` with random cotangents, all inside one `jit` so `cu_seqlens` is traced)
against the `reference` implementation on one device, in float64.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cases import GATES, Case, default_tolerance, make_inputs, max_rel_error, split_args
from jax.sharding import Mesh

import recurrax
from recurrax import parallel

SMALL = dict(T=16, H=2, Hkv=1, K=4, V=3)  # GQA and K != V everywhere


@dataclasses.dataclass(frozen=True)
class Split:
    """How the mesh splits a call: shards of the token axis, and optionally batch or heads."""

    sequence: int
    batch: int = 1
    head: int = 1

    def mesh(self) -> Mesh:
        sizes = {"seq": self.sequence, "batch": self.batch, "head": self.head}
        sizes = {name: size for name, size in sizes.items() if size > 1 or name == "seq"}
        devices = np.array(jax.devices()[: math.prod(sizes.values())]).reshape(tuple(sizes.values()))
        return Mesh(devices, tuple(sizes))

    def axes(self) -> dict:
        return dict(
            sequence_axis="seq",
            batch_axis="batch" if self.batch > 1 else None,
            head_axis="head" if self.head > 1 else None,
        )

    def __str__(self) -> str:
        return f"seq{self.sequence}" + (f"-batch{self.batch}" if self.batch > 1 else "") + (
            f"-head{self.head}" if self.head > 1 else ""
        )


def vjp_results(fn, kwargs: dict, seed: int = 1):
    """(output, final_state, gradients) of `fn(**kwargs)` under one `jit`, random cotangents."""
    diff, rest = split_args(kwargs)
    static = {k: rest.pop(k) for k in ("reverse", "softmax_scale") if k in rest}

    @jax.jit
    def run(diff, rest):
        (output, state), pullback = jax.vjp(lambda d: fn(**d, **rest, **static), diff)
        key_o, key_s = jax.random.split(jax.random.PRNGKey(seed))
        d_output = jax.random.normal(key_o, output.shape).astype(output.dtype)  # same draw in any dtype
        d_state = jax.random.normal(key_s, state.shape).astype(state.dtype)
        return output, state, pullback((d_output, d_state))[0]

    return run(diff, rest)


def scaled_error(x, y, floor: float) -> float:
    """max |x − y| / max(max |y|, floor): `max_rel_error` with a smallest scale."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), floor, 1e-30)) if y.size else 0.0


def errors_against_single_device(case: Case, split: Split, floor: float = 0.0, **options) -> dict[str, float]:
    """Scale-relative errors of the sharded call vs `reference` on one device (float64).

    `floor` is the smallest scale an error is measured against: with it, an expected value of
    exactly zero tolerates rounding-level noise.
    """
    kwargs = make_inputs(case)
    mesh = split.mesh()
    sharded = vjp_results(lambda **kw: parallel.recurrent(**kw, mesh=mesh, **split.axes(), **options), kwargs)
    exact = {k: (v.astype(jnp.float64) if k in split_args(kwargs)[0] else v) for k, v in kwargs.items()}
    single = vjp_results(lambda **kw: recurrax.recurrent(**kw, implementation="reference"), exact)
    (o, state, grads), (o_ref, state_ref, grads_ref) = sharded, single
    assert o.shape == o_ref.shape and o.dtype == kwargs["query"].dtype
    assert state.shape == state_ref.shape
    error = lambda x, y: scaled_error(x, y, floor)  # noqa: E731
    errors = {"output": error(o, o_ref), "final_state": error(state, state_ref)}
    for name, grad in grads.items():
        assert grad.shape == kwargs[name].shape and grad.dtype == kwargs[name].dtype, name
        errors["d" + name] = error(grad, grads_ref[name])
    return errors


def assert_sharded_matches(case: Case, split: Split, floor: float = 0.0, **options) -> None:
    tol = default_tolerance(case.dtype)
    errors = errors_against_single_device(case, split, floor, **options)
    bad = {name: error for name, error in errors.items() if not error <= tol}
    assert not bad, f"{split} {case}: {bad} (tol {tol})"


slow = pytest.mark.slow

DENSE = [
    (Case(**SMALL, gates=("g_head", "gv")), Split(2, head=2)),
    (Case(**SMALL, gates=GATES, reverse=True), Split(4, batch=2)),
    (Case(**SMALL, gates=("g_gamma", "gk")), Split(8)),
    pytest.param(Case(**SMALL), Split(2), marks=slow),
    pytest.param(Case(**SMALL, gates=("g_channel", "gv"), reverse=True), Split(8), marks=slow),
    pytest.param(Case(**SMALL, gates=("gk",), initial_state=False, gate_low=-30.0), Split(4), marks=slow),
    pytest.param(Case(**SMALL, gates=("gv",), scale=0.3), Split(4, head=2), marks=slow),
]

PACKED = [
    # boundaries inside shards, one sequence across a shard edge, an empty sequence
    (Case(**SMALL, gates=("g_channel", "gv"), cu_seqlens=(0, 3, 3, 11, 16)), Split(4)),
    # one sequence over six shards, 3-D packed layout, reversed
    (Case(**SMALL, gates=GATES, cu_seqlens=(0, 1, 1, 13, 16), packed_3d=True, reverse=True), Split(8)),
    # empty sequences first and last, with head sharding
    (Case(**SMALL, gates=("gk",), cu_seqlens=(0, 0, 5, 9, 16, 16)), Split(2, head=2)),
    # boundaries exactly on shard edges
    pytest.param(
        Case(**SMALL, gates=("g_head",), cu_seqlens=(0, 4, 8, 8, 12, 16), initial_state=False), Split(4), marks=slow
    ),
    # a sequence starting mid-shard and spanning five shards, reversed
    pytest.param(
        Case(**SMALL, gates=("g_gamma", "gk", "gv"), cu_seqlens=(0, 2, 2, 7, 16), reverse=True), Split(8), marks=slow
    ),
    # two sequences over two shards each, reversed, heads split
    pytest.param(
        Case(**SMALL, gates=("g_channel",), cu_seqlens=(0, 6, 16), reverse=True), Split(4, head=2), marks=slow
    ),
]


@pytest.mark.parametrize(("case", "split"), DENSE, ids=lambda x: str(x) if isinstance(x, Split) else None)
def test_dense_matches_single_device(case, split):
    assert_sharded_matches(case, split)


@pytest.mark.parametrize(("case", "split"), PACKED, ids=lambda x: str(x) if isinstance(x, Split) else None)
def test_packed_matches_single_device(case, split):
    assert_sharded_matches(case, split)


SHARED_QK = dict(T=16, K=4, V=3)
SHARED = [
    # Mamba-2's layout: one query/key head shared by every value head, kept shared in the shards
    (Case(**SHARED_QK, Hqk=1, H=4, gates=("g_head",)), Split(4)),
    # two shared heads split over the head axis alongside their value heads; packed, reversed
    (Case(**SHARED_QK, Hqk=2, H=4, gates=("g_head", "g_gamma"), cu_seqlens=(0, 3, 3, 11, 16), reverse=True),
     Split(2, head=2)),
    # one shared head cannot be split over two head shards, and per-channel decays: repeated first
    (Case(**SHARED_QK, Hqk=1, H=4, gates=("g_head",)), Split(2, head=2)),
    (Case(**SHARED_QK, Hqk=1, H=2, gates=("g_channel", "gv")), Split(4)),
]


@pytest.mark.parametrize(("case", "split"), SHARED, ids=lambda x: str(x) if isinstance(x, Split) else None)
def test_shared_query_key_matches_single_device(case, split):
    assert_sharded_matches(case, split)


def _shard_map_query_heads(case: Case, split: Split) -> int:
    """The head count of the query each shard receives (the shard_map's first operand)."""
    arrays, static = split_args(make_inputs(case))
    mesh = split.mesh()
    jaxpr = jax.make_jaxpr(lambda kw: parallel.recurrent(**kw, **static, mesh=mesh, **split.axes()))(arrays)
    (shard_map,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "shard_map"]
    return shard_map.invars[0].aval.shape[2]


def test_shared_query_key_is_not_repeated_over_the_mesh():
    """A query shared by every value head reaches the shards with its one head (the local
    algorithm reads it shared); where the head axis cannot split it, it is repeated."""
    case = Case(**SHARED_QK, Hqk=1, H=4, gates=("g_head",))
    assert _shard_map_query_heads(case, Split(4)) == 1
    assert _shard_map_query_heads(case, Split(2, head=2)) == 4


@pytest.mark.parametrize("gate_low", [-1e4, pytest.param(-1.0, marks=slow)])
def test_float32(gate_low):
    """Strong decays (down to -1e4 per token) stay finite; float32 meets its tolerance.

    With such decays the gates' exact gradients are 0 (every decay factor underflows), so
    errors are measured against a scale of at least 1 (the other gradients' order).
    """
    case = Case(**SMALL, gates=GATES, dtype="float32", gate_low=gate_low)
    assert_sharded_matches(case, Split(8), floor=1.0)


@slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_inputs(dtype):
    case = Case(**SMALL, gates=("g_head", "gk", "gv"), dtype=dtype, cu_seqlens=(0, 3, 3, 11, 16))
    assert_sharded_matches(case, Split(4))


LOCAL_CASES = [
    Case(**SMALL, gates=("g_channel", "gv"), cu_seqlens=(0, 5, 5, 16)),
    Case(**{**SMALL, "K": 16, "V": 16}, gates=("g_channel",), dtype="float32", reverse=True),
]


@slow
@pytest.mark.parametrize("case", LOCAL_CASES, ids=["packed-float64", "dense-float32"])
@pytest.mark.parametrize("name", recurrax.kernel_registry.names())
def test_every_registered_implementation(name, case):
    """Each implementation that declares it can run a shard's part of the call runs it exactly."""
    try:
        assert_sharded_matches(case, Split(4), implementation=name)
    except ValueError as error:
        if "cannot run this call" not in str(error):
            raise
        pytest.skip(str(error))


@pytest.mark.skipif(not hasattr(jax, "set_mesh"), reason="explicit mesh axes need jax.set_mesh")
def test_explicit_mesh_axes():
    kwargs = make_inputs(Case(**SMALL, gates=("g_head",)))
    arrays, static = split_args(kwargs)
    mesh = jax.make_mesh((4,), ("seq",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        call = jax.jit(lambda kw: parallel.recurrent(**kw, **static, mesh=mesh, sequence_axis="seq"))
        output, state = call(arrays)
    output_ref, state_ref = recurrax.recurrent(**kwargs, implementation="reference")
    assert max_rel_error(output, output_ref) <= 1e-12
    assert max_rel_error(state, state_ref) <= 1e-12


def _collectives(case: Case, split: Split) -> list[str]:
    """The collective instructions of the compiled forward, as `op result-type` strings."""
    arrays, static = split_args(make_inputs(case))
    mesh = split.mesh()
    forward = jax.jit(lambda kw: parallel.recurrent(**kw, **static, mesh=mesh, **split.axes()))
    text = forward.lower(arrays).compile().as_text()
    pattern = r"= (\S+) (all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)(?:-start)?\("
    return sorted(f"{op} {shape.split('{')[0]}" for shape, op in re.findall(pattern, text))


def test_forward_exchanges_one_state_per_shard_whatever_the_length():
    short, long = (_collectives(Case(**{**SMALL, "T": T}, gates=("gk", "gv")), Split(4)) for T in (16, 64))
    assert short == long == ["all-gather f64[4,2,2,5,4]"]  # [P, B, H, K + 1, V + 1]


# --- errors: all raised while tracing, before anything runs ---------------------------------


def _call(case: Case, split: Split, **axes):
    kwargs = make_inputs(case)
    return parallel.recurrent(**kwargs, mesh=split.mesh(), **{**split.axes(), **axes})


def test_indivisible_sequence_length_is_refused():
    with pytest.raises(ValueError, match=r"seq_len=18 is not divisible by the 4 shards of sequence_axis='seq'"):
        _call(Case(**{**SMALL, "T": 18}), Split(4))


def test_indivisible_packed_token_count_is_refused():
    with pytest.raises(ValueError, match=r"total_tokens=18 is not divisible by the 8 shards"):
        _call(Case(**SMALL, cu_seqlens=(0, 7, 18)), Split(8))


@pytest.mark.parametrize("argument", ["sequence_axis", "batch_axis", "head_axis"])
def test_missing_mesh_axis_is_named(argument):
    with pytest.raises(ValueError, match=rf"{argument}='tokens' is not an axis of the mesh.*\('seq',\)"):
        _call(Case(**SMALL), Split(2), **{argument: "tokens"})


def test_one_axis_for_two_roles_is_refused():
    with pytest.raises(ValueError, match="must be different mesh axes"):
        _call(Case(**SMALL), Split(2), batch_axis="seq")


@pytest.mark.parametrize(
    ("case", "split", "message"),
    [
        (Case(**{**SMALL, "B": 3}), Split(2, batch=2), "batch=3 is not divisible by the 2 shards of 'batch'"),
        (Case(**{**SMALL, "H": 3, "Hkv": 1}), Split(2, head=2), "num_heads=3 is not divisible"),
        (Case(**SMALL, cu_seqlens=(0, 8, 16)), Split(2, batch=2), "batch=1 is not divisible"),
    ],
    ids=["batch", "heads", "packed-batch"],
)
def test_indivisible_batch_or_heads_is_refused(case, split, message):
    with pytest.raises(ValueError, match=message):
        _call(case, split)


def test_argument_checks_are_the_single_device_ones():
    kwargs = make_inputs(Case(**SMALL))
    kwargs["query"] = kwargs["query"][0]
    with pytest.raises(ValueError, match=r"query must be \[batch, seq_len, num_heads, qk_head_dim\]"):
        parallel.recurrent(**kwargs, mesh=Split(2).mesh(), sequence_axis="seq")


def test_not_a_mesh_is_refused():
    kwargs = make_inputs(Case(**SMALL))
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        parallel.recurrent(**kwargs, mesh="seq", sequence_axis="seq")
