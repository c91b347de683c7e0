"""The delta rule's Pallas TPU kernels (`recurrax.kernels.tpu`, `pallas_tpu`) in TPU interpret mode
against the float64 reference, and their dispatch.

Forward and backward are kernels (`_delta_forward.py`, `_delta_backward.py`); a gradient program
runs the forward kernel, the forward kernel again for the chunk states, and the backward kernel
(`test_the_gradient_runs_the_backward_kernel`). Every output and gradient is held to the
issue's bound (2e-4 relative in float32, 2e-2 in bfloat16, against the float64 reference's
largest magnitude) and, in float32, to the rounding floor measured here
(`test_delta.assert_within_floor`: 8 times the float32 reference's own error). Where per-token
decays are stronger than the kernels' floor e^−20 (`kernels._driver.STRONGEST_DECAY`), the gate
and initial-state gradients are held to the issue's bound only (strong decays: the decays come
from differences of chunk sums, float32's rounding of C · 20; the floor changes what e^{−25}
and weaker would give by ≤ e^−20), and behind hard resets, whose exact values underflow
(e^{−1e4}), to an absolute bound, as `test_kernels_tpu.py` holds the `recurrent` kernels.
Tiny shapes (K, V = 16, chunk 16, sub-blocks of 8, tiles Mosaic would refuse and interpret
mode takes) keep the interpreter's compile time small.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cases import equations
from test_delta import _run as run_delta
from test_delta import _values_and_grads as values_and_grads
from test_delta import assert_within_floor, chunk_errors

import recurrax
from recurrax.delta import kernel_registry, reference_delta
from recurrax.kernels.tpu import TpuTiles, tpu_delta, tpu_delta_interpret
from recurrax.tools.cases import DeltaCase as Case
from recurrax.tools.cases import compare_delta, make_delta_inputs

KERNEL = functools.partial(tpu_delta_interpret, tiles=TpuTiles(chunk=16, sub=8, block_v=64))
F32_BOUND = 2e-4
BF16_BOUND = 2e-2
SMALL = dict(K=16, V=16, T=20)

CASES = [
    # Gated DeltaNet: per-head g, qk_l2norm, query/key shared by two value heads, an initial state
    Case(gates=("g",), qk_l2norm=True, Hqk=1, H=2, **SMALL),
    # KDA: per-key-channel gk, β up to 2, packed: an empty sequence, a sequence across chunks
    pytest.param(Case(gates=("gk",), beta_range=(0.0, 2.0), cu_seqlens=(0, 3, 3, 4, 30), **{**SMALL, "T": 30}),
                 marks=pytest.mark.slow),
    pytest.param(Case(**{**SMALL, "T": 33}, initial_state=False), marks=pytest.mark.slow),  # DeltaNet
]
FLOORED = ("d_g", "d_gk", "d_initial_state")
"""The gradients the kernels' decay floor touches (module docstring)."""


@pytest.mark.parametrize("case", CASES, ids=str)
def test_tpu_delta_interpret_matches_float64_reference(case):
    errors = chunk_errors(case, KERNEL)
    assert_within_floor(errors, "pallas_tpu_interpret")
    assert max(error for error, _ in errors.values()) <= F32_BOUND, errors


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_tpu_delta_interpret_many_heads_per_grid_step(heads):
    """Hb heads per grid step ([Hb, C, D] blocks, a static loop over the heads), GDN on four
    value heads in pairs sharing a query/key head: the same bounds as one head a step."""
    kernel = functools.partial(tpu_delta_interpret, tiles=TpuTiles(chunk=16, sub=8, block_v=64, heads=heads))
    errors = chunk_errors(Case(gates=("g",), qk_l2norm=True, Hqk=2, H=4, **SMALL), kernel)
    assert_within_floor(errors, "pallas_tpu_interpret")
    assert max(error for error, _ in errors.values()) <= F32_BOUND, errors


@pytest.mark.slow
def test_tpu_delta_interpret_many_heads_packed_kda():
    """KDA's per-key-channel decay, packed (an empty sequence, one across chunks), two heads a step."""
    kernel = functools.partial(tpu_delta_interpret, tiles=TpuTiles(chunk=16, sub=8, block_v=64, heads=2))
    case = Case(gates=("gk",), Hqk=1, H=2, cu_seqlens=(0, 3, 3, 4, 30), **{**SMALL, "T": 30})
    errors = chunk_errors(case, kernel)
    assert_within_floor(errors, "pallas_tpu_interpret")
    assert max(error for error, _ in errors.values()) <= F32_BOUND, errors


@pytest.mark.slow
def test_tpu_delta_interpret_two_value_blocks():
    """V = 256 in two value blocks of 128 (independent programs): dq, dk, dβ and the decay's
    gradient are sums of the blocks' partial sums, g and gk both, grouped heads (one head a step:
    a step of several takes all of V)."""
    tiles = TpuTiles(chunk=16, sub=8, block_v=128, heads=1)
    errors = chunk_errors(Case(gates=("g", "gk"), Hqk=1, H=2, **{**SMALL, "V": 256}),
                          functools.partial(tpu_delta_interpret, tiles=tiles))
    assert_within_floor(errors, "pallas_tpu_interpret")
    assert max(error for error, _ in errors.values()) <= F32_BOUND, errors


@pytest.mark.slow
def test_tpu_delta_interpret_strong_decays():
    """Per-token log decays down to −80 (g and gk both down to −40): every exponent the kernels
    evaluate is ≤ 0; the gate and initial-state gradients within the issue's bound."""
    errors = chunk_errors(Case(gates=("g", "gk"), gate_range=(-40.0, 0.0), **SMALL), KERNEL)
    assert_within_floor({n: e for n, e in errors.items() if n not in FLOORED}, "pallas_tpu_interpret")
    assert max(error for error, _ in errors.values()) <= F32_BOUND, errors


@pytest.mark.slow
def test_tpu_delta_interpret_hard_resets():
    """Gates down to −1e4 on grouped heads: finite, and the gradients the floor touches (exactly
    ~e^{−1e4} in float64, e^−20 times O(1) terms here) within an absolute 1e-4."""
    case = Case(gates=("g",), gate_range=(-1e4, 0.0), Hqk=1, H=2, **SMALL)
    errors = chunk_errors(case, KERNEL)
    assert_within_floor({n: e for n, e in errors.items() if n not in FLOORED}, "pallas_tpu_interpret")
    args = make_delta_inputs(case)
    o, final = run_delta(reference_delta, args, case)
    rng = np.random.default_rng(1)
    cotangents = (rng.normal(size=o.shape), rng.normal(size=final.shape))
    exact = values_and_grads(reference_delta, args, case, cotangents)
    got = values_and_grads(KERNEL, {n: np.asarray(x, np.float32) for n, x in args.items()}, case, cotangents)
    for x in got.values():
        assert np.isfinite(np.asarray(x, np.float64)).all()
    for name in FLOORED[:1] + FLOORED[2:]:
        assert np.max(np.abs(np.asarray(got[name], np.float64) - np.asarray(exact[name]))) < 1e-4, name


def test_the_gradient_runs_the_backward_kernel():
    """jax.grad through `pallas_tpu_interpret` (KDA, grouped heads, packed with a traced
    `cu_seqlens`) launches the forward kernel, the chunk states' forward and the backward
    kernel, each once: traced only, nothing runs."""
    case = Case(gates=("gk",), Hqk=1, H=2, cu_seqlens=(0, 7, 7, 16, 20), **SMALL)
    arrays = {n: jnp.asarray(x, jnp.float32) for n, x in make_delta_inputs(case).items()}

    def loss(arrays, cu_seqlens):
        o, state = recurrax.delta_rule(**arrays, cu_seqlens=cu_seqlens, implementation="pallas_tpu_interpret")
        return jnp.sum(o) + jnp.sum(state)

    text = str(jax.make_jaxpr(jax.grad(loss))(arrays, jnp.asarray(case.cu_seqlens, jnp.int32)))
    for kernel in ("recurrax_tpu_delta_fwd", "recurrax_tpu_delta_states", "recurrax_tpu_delta_bwd"):
        assert text.count(f"name={kernel}") == 1, kernel


def _kernel_loss(gates, tiles: TpuTiles | None = None, T: int = 200, H: int = 2, Hqk: int = 1, K: int = 64,
                 cu_seqlens=None):
    """(loss through `tpu_delta` (compiled-kernel form), its bfloat16 arguments): V = 128, by
    default K = 64, T = 200 (Tp = 256), one query/key head shared by two value heads."""
    case = Case(gates=gates, Hqk=Hqk, H=H, K=K, V=128, T=T, B=1 if cu_seqlens else 2, cu_seqlens=cu_seqlens)
    tiles = TpuTiles() if tiles is None else tiles
    args = {n: jnp.asarray(x, jnp.bfloat16) for n, x in make_delta_inputs(case).items()}

    def loss(args):
        o, final = run_delta(functools.partial(tpu_delta, tiles=tiles), args, case)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(final.astype(jnp.float32))

    return loss, args


def _kernel_program(gates, tiles: TpuTiles | None = None, **shape):
    """The jaxpr of value_and_grad through `tpu_delta` (`_kernel_loss`), traced only."""
    loss, args = _kernel_loss(gates, tiles, **shape)
    return jax.make_jaxpr(jax.value_and_grad(loss))(args).jaxpr


@pytest.mark.parametrize(("gates", "heads", "cu_seqlens"), [(("g",), None, None), (("g", "gk"), 2, (0, 70, 70, 200))],
                         ids=["g", "g-gk-packed"])
def test_the_kernels_lower_for_tpu(gates, heads, cu_seqlens):
    """value_and_grad through `tpu_delta` lowers for platforms=["tpu"] (Mosaic's Pallas-level
    rules: block shapes, a lowering for every primitive): forward, states and backward kernels."""
    loss, args = _kernel_loss(gates, TpuTiles(heads=heads), cu_seqlens=cu_seqlens)
    text = jax.export.export(jax.jit(jax.value_and_grad(loss)), platforms=["tpu"])(args).mlir_module()
    assert text.count("tpu_custom_call") == 3


@pytest.mark.parametrize("gates", [(), ("g",), ("gk",), ("g", "gk")], ids=str)
def test_no_token_array_is_transposed_or_repeated_around_the_kernels(gates):
    """The forward and backward kernels read q, k (unrepeated), v, β, do and the decay
    lane-dense token-major and write o, dq, dk, dv, dβ and the decay's gradient so: the program
    of value_and_grad through `pallas_tpu` transposes no array with a token axis (T = 200,
    Tp = 256) in XLA, and no kernel operand is a per-value-head copy of q or k ([B, Tp, H · K])
    or a column [.., 1] (padded to 128 lanes in HBM)."""
    jaxpr = _kernel_program(gates)
    transposed = [tuple(e.invars[0].aval.shape) for e in equations(jaxpr, outside=("pallas_call",))
                  if e.primitive.name == "transpose"]
    assert not [shape for shape in transposed if {200, 256} & set(shape)], transposed
    kernels = [e for e in equations(jaxpr) if e.primitive.name == "pallas_call"]
    assert len(kernels) == 3
    operands = [tuple(v.aval.shape) for e in kernels for v in e.invars]
    results = [tuple(v.aval.shape) for e in kernels for v in e.outvars]
    assert (2, 256, 64) in operands and (2, 256, 2) in operands  # q, k one head; β token-major
    per_channel_decays = 3 if "gk" in gates else 0  # [B, Tp, H · K], one a kernel
    assert operands.count((2, 256, 2 * 64)) == per_channel_decays, operands
    assert not [shape for shape in operands + results if shape[-1] == 1], operands + results


@pytest.mark.parametrize(("heads", "steps"), [(None, 1), (2, 2), (1, 4)])
def test_a_delta_grid_step_takes_the_tiles_heads(heads, steps):
    """The grid is (B, H / Hb, value blocks, chunks) in the forward, state and backward kernels;
    `heads=None` takes the four heads (lane-dense, they fit the scoped VMEM, `_vmem.py`)."""
    jaxpr = _kernel_program(("g",), TpuTiles(heads=heads), T=40, H=4, Hqk=2, K=128)
    grids = [tuple(e.params["grid_mapping"].grid) for e in equations(jaxpr) if e.primitive.name == "pallas_call"]
    assert grids == [(2, steps, 1, 1)] * 3, grids


def test_delta_tilings_without_a_lane_dense_step_that_fits_are_refused():
    """The lane rule and the delta rule's VMEM estimate: one 64-wide head a step is no legal
    block; 64 value heads sharing two 64-wide query/key heads need all 64 heads a step, which
    overflow the scoped VMEM, so dispatch hears why; 32 heads sharing 16 of 128 fit."""
    from recurrax.kernels.tpu import _tiles
    from recurrax.problem import Gate

    with pytest.raises(ValueError, match="heads=1 of K=64 are 64 lanes"):
        _kernel_program(("g",), TpuTiles(heads=1), H=2, Hqk=2)
    refused = _tiles.tiling_problems(64, 2, 64, 64, Gate.HEAD, jnp.bfloat16, delta=True)
    assert refused and "no heads per grid step give lane-dense blocks" in refused[0], refused
    assert _tiles.tiling_problems(32, 16, 128, 128, Gate.KEY, jnp.bfloat16, delta=True) == []
    case = Case(gates=("g",), K=64, V=64, T=8, B=1, Hqk=2, H=64)
    arrays = {n: np.asarray(x, np.float32) for n, x in make_delta_inputs(case).items()}
    with recurrax.target("v6e"):
        selection = kernel_registry.select(**arrays)
    assert selection.name == "chunk" and "lane-dense" in dict(selection.answers)["pallas_tpu"], selection


@pytest.mark.slow
@pytest.mark.parametrize("gates", [("g",), ("gk",)], ids=str)
def test_tpu_delta_interpret_bfloat16_by_name(gates):
    """The public name, default tiles (C = 128), bfloat16 inputs, gradients included."""
    case = Case(gates=gates, qk_l2norm=True, Hqk=1, H=2, **SMALL)
    errors = compare_delta("pallas_tpu_interpret", case, "bfloat16")
    assert max(errors.values()) <= BF16_BOUND, errors


@pytest.mark.slow
def test_tpu_delta_interpret_traced_cu_seqlens():
    """KDA's per-key-channel decay on packed input, `cu_seqlens` an argument of the jitted
    function (traced): an empty sequence, sequences ending inside chunks."""
    case = Case(gates=("gk",), cu_seqlens=(0, 7, 7, 16, 20), **SMALL)
    arrays = {n: jnp.asarray(x, jnp.float32) for n, x in make_delta_inputs(case).items()}
    run = jax.jit(lambda cu: recurrax.delta_rule(**arrays, cu_seqlens=cu, implementation="pallas_tpu_interpret"))
    o, state = run(jnp.asarray(case.cu_seqlens, jnp.int32))
    exact = {n: jnp.asarray(x, jnp.float64) for n, x in make_delta_inputs(case).items()}
    o_ref, state_ref = recurrax.delta_rule(**exact, cu_seqlens=jnp.asarray(case.cu_seqlens), implementation="reference")
    for got, want in ((o, o_ref), (state, state_ref)):
        want = np.asarray(want)
        assert np.max(np.abs(np.asarray(got, np.float64) - want)) <= F32_BOUND * np.max(np.abs(want))


def _request_arrays(K: int = 128, dtype=np.float32, gates=("g",)) -> dict:
    case = Case(gates=gates, K=K, V=K, T=8, B=1, Hqk=1, H=2)
    return {n: np.asarray(x, dtype) for n, x in make_delta_inputs(case).items()}


def test_dispatch_picks_the_tpu_kernel_where_it_was_not_measured_slower_and_says_why_not_elsewhere():
    with recurrax.target("v6e"):
        assert kernel_registry.select(**_request_arrays(gates=("g", "gk"))).name == "pallas_tpu"
    with recurrax.target("v5e"):  # measured slower than chunk there (kernels/tpu/_measured.py)
        selection = kernel_registry.select(**_request_arrays(gates=("g", "gk")))
        assert selection.name == "chunk" and "measured slower than chunk on TPU v5e" in dict(selection.passed_over)[
            "pallas_tpu"], selection
        assert kernel_registry.select(**_request_arrays(), implementation="pallas_tpu").name == "pallas_tpu"
    with recurrax.target("v5e"):
        refused = {
            "dtype float16": _request_arrays(dtype=np.float16),
            "qk_head_dim=32 is not one of": _request_arrays(K=32),
        }
        for reason, arrays in refused.items():
            selection = kernel_registry.select(**arrays)
            assert selection.name == "chunk" and reason in dict(selection.answers)["pallas_tpu"], selection
    here = kernel_registry.select(**_request_arrays())
    assert here.name == "chunk" and "runs on tpu" in dict(here.answers)["pallas_tpu"]
    assert dict(here.answers)["pallas_tpu_interpret"] is None  # takes it when named; never picked
