"""The delta rule's Pallas TPU kernel (`recurrax.kernels.tpu`, `pallas_tpu`) in TPU interpret mode
against the float64 reference, and its dispatch.

The kernel is the forward; gradients come from XLA `chunk`'s backward recomputed from the inputs
(`kernels/_delta_driver.py`), so the gradient checks here check that fallback under the
kernel's `custom_vjp`. Every output and gradient is held to the issue's bound (2e-4 relative in
float32, 2e-2 in bfloat16, against the float64 reference's largest magnitude) and, in float32,
to the rounding floor measured here (`test_delta.assert_within_floor`: 8 times the float32
reference's own error). Tiny shapes (K, V = 16, chunk 16, sub-blocks of 8, tiles Mosaic would
refuse and interpret mode takes) keep the interpreter's compile time small.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_delta import assert_within_floor, chunk_errors

import recurrax
from recurrax.delta import kernel_registry
from recurrax.kernels.tpu import TpuTiles, tpu_delta_interpret
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
    pytest.param(Case(gates=("g", "gk"), gate_range=(-40.0, 0.0), **SMALL), marks=pytest.mark.slow),  # strong decays
    pytest.param(Case(gates=("g",), gate_range=(-1e4, 0.0), Hqk=1, H=2, **SMALL), marks=pytest.mark.slow),  # resets
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_tpu_delta_interpret_matches_float64_reference(case):
    errors = chunk_errors(case, KERNEL)
    assert_within_floor(errors, "pallas_tpu_interpret")
    assert max(error for error, _ in errors.values()) <= F32_BOUND, errors


@pytest.mark.slow
@pytest.mark.parametrize("gates", [("g",), ("gk",)], ids=str)
def test_tpu_delta_interpret_bfloat16_by_name(gates):
    """The public name, default tiles (C = 128), bfloat16 inputs, gradients included."""
    case = Case(gates=gates, qk_l2norm=True, Hqk=1, H=2, **SMALL)
    errors = compare_delta("pallas_tpu_interpret", case, "bfloat16")
    assert max(errors.values()) <= BF16_BOUND, errors


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


def test_dispatch_picks_the_tpu_kernel_on_v5e_and_v6e_and_says_why_not_elsewhere():
    for generation in ("v5e", "v6e"):
        with recurrax.target(generation):
            assert kernel_registry.select(**_request_arrays(gates=("g", "gk"))).name == "pallas_tpu"
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
