"""The Triton-backend Pallas kernels: interpret mode vs the reference, dispatch, and GPU lowering.

Interpret mode runs the very kernels the GPU runs, so these tests check their math on
CPU; compilation dominates their time (a few seconds per distinct shape), hence tiny
shapes (T ≤ 33, K, V ∈ {16, 32}, chunk 16 with sub-blocks of 8 unless stated).
"""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cases import Case, assert_matches, canonical, compare, make_inputs, max_rel_error, run_vjp

import recurrax
from recurrax import Platform, Problem, Request, kernel_registry
from recurrax.kernels.triton import SUPPORT, TritonTiles, gpu_tiles, triton_interpret, triton_recurrent

F32_TOL = 2e-4
BF16_TOL = 2e-2
"""bf16 inputs: the kernels round matmul operands (decayed q, k, the state, dP) to bf16 as
tensor-core kernels do (flash-linear-attention too); outputs and q/k/v/state gradients
measure 2e-3 to 6e-3, per-token gate gradients 2e-3 to 1.1e-2. Not held to it: g_gamma's
gradient, a sum over B·T(·K) of per-token gate gradients whose true total can be far
smaller than its terms; measured relative to that total: 6.6e-3 (per-head g, B=2, T=130,
K=V=32, C=64), 7e-2 (per-channel g there; 4e-2 even with float32 backward matmuls), and
5.5e-3 to 8.9e-2 on T=20 cases (chunk 16) depending on the seed."""

SMALL = dict(B=1, H=2, Hkv=1, K=16, V=16, dtype="float32")

CASES = [
    Case(T=20, **SMALL),  # no gate, T not a multiple of the chunk, GQA, initial state
    Case(T=20, gates=("g_head", "g_gamma"), reverse=True, **SMALL),
    Case(T=32, gates=("g_channel",), **SMALL),
    Case(**{**SMALL, "V": 32}, T=25, gates=("g_head", "g_gamma", "gk"), initial_state=False, scale=0.3),
    Case(B=2, T=9, H=2, Hkv=2, K=16, V=16, gates=("gk",), reverse=True, dtype="float32"),
    # packed input: empty sequences, a sequence across chunks, boundaries inside a chunk
    Case(**SMALL, gates=("g_head", "gk"), cu_seqlens=(0, 3, 3, 4, 30), packed_3d=True),
    Case(**SMALL, gates=("g_head",), cu_seqlens=(0, 0, 17, 20), reverse=True),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_interpret_matches_reference(case):
    assert_matches("pallas_interpret", case, tol=F32_TOL)


GATE_GRADS = ("dg", "dg_gamma", "dgk")
STRONG_GATE_TOL = 1e-2
"""Gate gradients under strong decays (gates down to −20). dg is a (chunk-local) sum of
terms q⊙dq − k⊙dk that cancel to a small result, so float32 rounding of dq, dk shows
relative to it, g_gamma's (a further sum over T and K) the most: measured 2.2e-3.
Everything else stays within F32_TOL."""


@pytest.mark.parametrize("gates", [("g_head",), ("g_channel", "g_gamma")], ids=str)
def test_strong_decays_match(gates):
    errors = compare("pallas_interpret", Case(T=20, gates=gates, gate_low=-20.0, **SMALL))
    assert all(v <= (STRONG_GATE_TOL if k in GATE_GRADS else F32_TOL) for k, v in errors.items()), errors


def test_extreme_decays_stay_finite():
    """Gates down to −1e4: everything finite and matching. The true gate gradient is ~0
    there (e^{-1e4}), and the reverse-cumsum identity returns it as a sum of O(1) terms that
    cancel, so it is held to an absolute bound instead of a relative one."""
    from recurrax.tools.cases import compare_results, oracle_results

    case = Case(T=20, gates=("g_head", "gk"), gate_low=-1e4, **SMALL)
    kwargs = make_inputs(case)
    results, exact_results = run_vjp("pallas_interpret", kwargs), oracle_results(kwargs)  # each compiled once
    o, state, grads = results
    for x in (o, state, *grads.values()):
        assert np.isfinite(np.asarray(x, np.float64)).all()
    errors = compare_results(results, exact_results, kwargs)  # compare("pallas_interpret", case) on these results
    assert all(v <= F32_TOL for k, v in errors.items() if k not in GATE_GRADS), errors
    exact = exact_results[2]  # the reference's gradients on the inputs cast to float64
    for name in ("g", "gk"):
        assert np.max(np.abs(np.asarray(grads[name], np.float64) - np.asarray(exact[name]))) < 1e-4


def test_bfloat16_within_tolerance():
    case = Case(T=20, gates=("g_head", "gk"), **{**SMALL, "dtype": "bfloat16"})
    assert_matches("pallas_interpret", case, tol=BF16_TOL)


def _tiles(chunk: int, sub: int, block_v: int = 64):
    """The interpret-mode algorithm with other tile sizes, for `assert_matches`."""
    return functools.partial(triton_interpret, tiles=TritonTiles(chunk, sub, block_v, num_warps=8, num_stages=2))


@pytest.mark.parametrize(
    ("chunk", "sub", "block_v"),
    [(8, 8, 64), (32, 8, 16)],
    ids=["one-sub-block", "four-sub-blocks-two-value-blocks"],
)
def test_tile_sizes(chunk, sub, block_v):
    case = Case(T=33, gates=("g_channel", "g_head"), **{**SMALL, "V": 32})
    assert_matches(_tiles(chunk, sub, block_v), case, tol=F32_TOL)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        Case(B=2, T=130, H=4, Hkv=2, K=32, V=64, gates=("g_channel", "g_gamma"), reverse=True, dtype="float32"),
        Case(B=2, T=130, H=4, Hkv=1, K=64, V=32, gates=("g_head",), dtype="float32"),
        Case(B=1, T=1, H=2, Hkv=1, K=16, V=16, gates=("gk",), dtype="float32"),
        Case(B=1, T=70, H=2, Hkv=1, K=32, V=32, gates=("g_channel",), dtype="float16"),
    ],
    ids=str,
)
def test_default_tiles_slow(case):
    tol = F32_TOL if case.dtype == "float32" else BF16_TOL
    assert_matches(_tiles(64, 16, 32), case, tol=tol)


# ----------------------------------------------------------------------------- dispatch


def _request(**overrides):
    """The dispatch request of a small case with `overrides` applied."""
    problem, _, _ = canonical(make_inputs(dataclasses.replace(Case(T=8, **SMALL), **overrides)))
    return Request.of(problem)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (dict(gates=("gv",)), "gate kinds ['value']"),
        (dict(dtype="float64"), "dtype float64"),
        (dict(K=24), "qk_head_dim=24"),
        (dict(V=8), "v_head_dim=8"),
    ],
    ids=["gv", "float64", "K=24", "V=8"],
)
def test_supports_is_fail_closed(overrides, reason):
    refusal = SUPPORT.refusal(_request(**overrides))
    assert refusal is not None and reason in refusal


def test_supports_accepts_what_the_kernels_take():
    for gates in [(), ("g_head", "g_gamma"), ("g_channel", "gk")]:
        for dtype in ["float32", "bfloat16", "float16"]:
            assert SUPPORT.refusal(_request(gates=gates, dtype=dtype, K=32, V=16)) is None
    assert SUPPORT.refusal(_request(cu_seqlens=(0, 3, 8))) is None


def test_traced_cu_seqlens_under_jit():
    case = Case(**SMALL, gates=("g_channel",), cu_seqlens=(0, 7, 7, 25), packed_3d=True)
    kwargs = make_inputs(case)
    cu = kwargs.pop("cu_seqlens")
    run = jax.jit(lambda cu: recurrax.recurrent(**kwargs, cu_seqlens=cu, implementation="pallas_interpret"))
    o, state = run(cu)
    o_ref, state_ref = recurrax.recurrent(**kwargs, cu_seqlens=cu, implementation="reference")
    assert np.allclose(o, o_ref, atol=1e-4) and np.allclose(state, state_ref, atol=1e-4)


def test_dispatch_never_picks_pallas_on_cpu():
    for gates in [(), ("g_head",), ("gk",)]:
        impl = kernel_registry.get(None, _request(gates=gates))
        assert impl.platform is not Platform.PALLAS, impl.name
    names = {impl.name: impl for impl in kernel_registry.implementations()}
    assert names["pallas_gpu"].priority == 30 and names["pallas_gpu"].backend is recurrax.Backend.GPU
    assert names["pallas_interpret"].priority < names["reference"].priority


def test_forced_pallas_fails_clearly():
    kwargs = make_inputs(Case(T=8, gates=("gv",), **SMALL))
    with pytest.raises(ValueError, match="pallas_interpret.*gate kinds"):
        recurrax.recurrent(**kwargs, implementation="pallas_interpret")
    kwargs = make_inputs(Case(T=8, **SMALL))
    with pytest.raises(ValueError, match="pallas_gpu.*runs on gpu"):
        recurrax.recurrent(**kwargs, implementation="pallas_gpu")


# ----------------------------------------------------------------------------- GPU lowering


def _abstract_gpu():
    """The GPU to lower for without one: JAX ≥ 0.12 asks for an abstract device (an H100)
    to pick the target; older JAX lowers for `cuda` without asking."""
    if not hasattr(jax.sharding, "AbstractDevice"):
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
    explicit = (jax.sharding.AxisType.Explicit,)
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), explicit, abstract_device=device))


@pytest.mark.parametrize(
    ("gates", "cu_seqlens"), [((), None), (("g_head",), None), (("g_channel",), None), (("g_head",), (0, 50, 200))],
    ids=["none", "head", "channel", "head-packed"],
)
def test_triton_lowering_on_cpu(gates, cu_seqlens):
    """The GPU kernels (default tiles, bf16, forward and backward) lower to Triton IR.

    Lowering for `cuda` needs no GPU: it builds and verifies the Triton MLIR that XLA
    would compile; compiling it to PTX happens only on a GPU (`benchmarks/gpu.sh`).
    """
    case = Case(B=1, T=200, H=2, Hkv=1, K=128, V=64, gates=gates, dtype="bfloat16", cu_seqlens=cu_seqlens)
    kwargs = make_inputs(case)
    diff = {k: kwargs[k] for k in ("query", "key", "value", "g", "initial_state") if k in kwargs}

    def loss(diff):
        problem = Problem.create(**diff, cu_seqlens=kwargs.get("cu_seqlens"))
        o, state = triton_recurrent(problem, scale=problem.default_scale, reverse=False)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(state)

    with _abstract_gpu():
        text = jax.jit(jax.value_and_grad(loss)).trace(diff).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("xla.gpu.triton") == 3  # forward, state recomputation, backward


def test_gpu_tiles_fill_the_gpu():
    assert gpu_tiles(8, 32, 128, 128).block_v == 32  # 256 heads: register-bound choice
    assert gpu_tiles(4, 16, 64, 64).block_v == 16  # 64 heads: 4 value blocks each, 256 programs
    assert gpu_tiles(1, 8, 128, 128).block_v == 16  # 8 heads: as many programs as allowed


def test_vmap_and_grad():
    """`jax.vmap` over an extra axis batches the pallas_call (a grid dimension) and its VJP."""
    kwargs = make_inputs(Case(T=20, gates=("g_channel",), **SMALL))
    queries = jnp.stack([kwargs["query"], -2 * kwargs["query"]])

    def batched(implementation):
        def one(query):
            o, state = recurrax.recurrent(**{**kwargs, "query": query}, implementation=implementation)
            return jnp.sum(o * o) + jnp.sum(state)

        return jax.jit(jax.vmap(jax.value_and_grad(one)))(queries)  # one program (op by op: slow)

    for got, want in zip(batched("pallas_interpret"), batched("reference")):
        assert max_rel_error(got, want) < F32_TOL
