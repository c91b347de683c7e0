"""`recurrax.delta_rule` against the delta-rule functions of flash-linear-attention (fla) and
`transformers`, from committed fixtures (no PyTorch needed).

tests/fixtures/delta/<case>.npz were made by make_fixtures.py there (its docstring maps every
library's conventions onto ours; MANIFEST.md lists cases and versions): float32 inputs exactly
as `delta_rule` takes them, cotangents `do` and `dht`, and per library its float32 output,
final state and the gradients of ⟨o, do⟩ + ⟨final_state, dht⟩ in every input.

Error metric, per quantity: max |x − y| / max |exact|, where `exact` is our float64 reference
on the same (float32) inputs; a quantity whose exact value is (near) zero is judged against
`ZERO_FLOOR` times the largest exact quantity of the case, as `recurrax.tools.cases.compare` does.

* `test_library_agrees_with_float64_reference`: each library's value is within a rounding floor
  of our float64 reference. The floor is our float32 reference's own error (measured here), so
  a convention or a formula that differs anywhere shows up as O(1); the factor allows for the
  libraries' other float32 summation orders (chunked, exp2-based). A chunk form's floor also
  holds the rounding of its cumulative log decays (`decay_exponent_rounding`), which is what
  sets its error under strong decays.
* `test_implementation_matches_library`: every entry of `recurrax.delta.IMPLEMENTATIONS` that
  dispatch may pick on this machine (the TPU kernel's interpreter is checked in
  `test_kernels_tpu_delta.py`), run in float32 like the libraries, equals each library's value within twice the factor on the same
  floor (two float32 results, each allowed that far from the exact one). The floor is measured
  from our float32 reference, not from the library's own error, so that a library value that is
  off does not widen its own tolerance.

Library values the fixture maker could not keep (not finite) are reported as skipped, with why.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cases import float64, floor_tolerance

import recurrax
from recurrax.delta import kernel_registry
from recurrax.registry import Backend, current_backend
from recurrax.tools.cases import ZERO_FLOOR

FIXTURES = Path(__file__).parent / "fixtures" / "delta"
CASES = sorted(p.stem for p in FIXTURES.glob("*.npz"))
DIFFERENTIABLE = ("query", "key", "value", "beta", "g", "gk", "initial_state")
QUANTITIES = ("o", "final_state", *("d" + n for n in DIFFERENTIABLE))
EPS32 = float(np.finfo(np.float32).eps)

WHY_NOT_FINITE = (
    "its chunk form takes decays between tokens as exp(γ_i − γ_j) of cumulative log decays γ; "
    "after a hard reset (log decay −inf) γ is −inf and −inf − (−inf) is NaN"
)
"""Why the chunk forms of fla and transformers give NaN on the `*_reset` cases (read in
fla 0.6.0 `chunk_local_cumsum` + `exp2(g_i - g_j)`, transformers 5.25 `decay_mask` /
`pairwise_decay`); their token loops are finite there and are compared."""

FAST = {"gdn_grouped_beta2", "kda_packed", "gdn_strong", "gdn_reset", "kda_strong", "kda_reset"}
"""The default tier's fixtures: GDN with grouped heads and β up to 2, KDA packed with an empty
sequence and initial states, strong decays and hard resets (each shape costs three compilations,
float64 and float32 reference and chunk; a `*_strong` fixture shares them with its `*_reset`
twin). `-m ""` runs all of them."""

LIBRARY_FACTOR = 8.0
"""A library's float32 value may be this many times our float32 reference's floor away from
the float64 reference (plus `floor_tolerance`'s absolute term)."""


@functools.cache
def fixture(case: str) -> tuple[dict, dict]:
    """(arrays, config) of one fixture."""
    with np.load(FIXTURES / f"{case}.npz") as data:
        arrays = {k: data[k] for k in data.files if k != "config"}
        return arrays, json.loads(str(data["config"]))


def inputs(case: str) -> dict:
    arrays, _ = fixture(case)
    return {n: arrays[n] for n in DIFFERENTIABLE if n in arrays}


def library_values(case: str, library: str) -> dict:
    arrays, _ = fixture(case)
    return {q: arrays[f"{library}/{q}"] for q in QUANTITIES if f"{library}/{q}" in arrays}


@functools.partial(jax.jit, static_argnames=("names", "softmax_scale", "qk_l2norm", "implementation"))
def _forward_backward(diff, do, dht, cu_seqlens, *, names, softmax_scale, qk_l2norm, implementation):
    """delta_rule's output, final state and its pullback of (do, dht); one compiled function per
    shape and options, shared by the fixtures that have the same (the strong / reset pairs)."""
    def f(*diff):
        return recurrax.delta_rule(**dict(zip(names, diff)), softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                                   qk_l2norm=qk_l2norm, implementation=implementation)

    (o, final), pullback = jax.vjp(f, *diff)
    return o, final, pullback((do.astype(o.dtype), dht.astype(final.dtype)))


@functools.cache
def ours(case: str, implementation: str, dtype: str) -> dict:
    """Our output, final state and gradients (jax.vjp with the fixture's cotangents) in `dtype`."""
    arrays, config = fixture(case)
    args = inputs(case)
    if dtype == "float64":
        args = float64(args)
    names = tuple(args)
    cu_seqlens = None if "cu_seqlens" not in arrays else jnp.asarray(arrays["cu_seqlens"])
    o, final, grads = _forward_backward(
        tuple(args[n] for n in names), arrays["do"], arrays["dht"], cu_seqlens, names=names,
        softmax_scale=config["softmax_scale"], qk_l2norm=config["qk_l2norm"], implementation=implementation)
    values = {"o": o, "final_state": final, **{"d" + n: g for n, g in zip(names, grads)}}
    return {q: np.asarray(v, np.float64) for q, v in values.items()}


def difference(values: dict, other: dict, case: str) -> dict[str, float]:
    """Per quantity of `values`: max |values − other| / max |exact| (the module's metric; `exact`
    our float64 reference, its near-zero quantities judged against `ZERO_FLOOR` times its largest)."""
    exact = ours(case, "reference", "float64")
    zero_floor = ZERO_FLOOR * max(float(np.max(np.abs(y), initial=0.0)) for y in exact.values())
    return {q: float(np.max(np.abs(np.asarray(x, np.float64) - other[q]), initial=0.0))
            / max(float(np.max(np.abs(exact[q]), initial=0.0)), zero_floor, 1e-30) for q, x in values.items()}


def errors(values: dict, case: str) -> dict[str, float]:
    """Per quantity: `values`' error against our float64 reference."""
    return difference(values, ours(case, "reference", "float64"), case)


def pairs():
    """(case, library) for every library in every fixture, those of cases not in `FAST` marked
    slow; skipped ones carry their reason."""
    params = []
    for case in CASES:
        _, config = fixture(case)
        tier = () if case in FAST else pytest.mark.slow
        for library in config["libraries"]:
            params.append(pytest.param(case, library, id=f"{case}-{library}", marks=tier))
        for library, found in config["skipped"].items():
            why = f"{library} on {case} was not kept: {found}"
            if case.endswith("_reset") and "chunk" in library:
                why += f" ({WHY_NOT_FINITE})"
            params.append(pytest.param(case, library, id=f"{case}-{library}", marks=pytest.mark.skip(reason=why)))
    return params


def test_fixtures_are_present_and_cover_the_issue():
    """Every family of the issue has a fixture, with the libraries the maker ran."""
    assert {"gdn", "kda", "deltanet", "gdn_grouped_beta2", "gdn_packed", "kda_packed", "gdn_strong",
            "kda_strong", "gdn_reset", "kda_reset"} <= set(CASES)
    for case in CASES:
        arrays, config = fixture(case)
        for library in config["libraries"]:
            assert set(library_values(case, library)) == {"o", "final_state", *("d" + n for n in inputs(case))}
        if "cu_seqlens" in arrays:
            assert np.any(np.diff(arrays["cu_seqlens"]) == 0), "a packed fixture holds an empty sequence"


def decay_exponent_rounding(case: str) -> float:
    """EPS32 · max |finite log decay| of the fixture: a chunk form (fla's and transformers')
    takes a chunk's decays as exp(γ_i − γ_j) of the cumulative log decays γ, whose float32
    rounding is an absolute error of about eps · |γ| in the exponent, i.e. that relative error
    in the decay factor — 1.2e-3 after a token with log decay −1e4 (the `*_strong` fixtures;
    measured there: 6e-5 to 6e-4 against a float32 token loop's 2e-7)."""
    gates = [x[np.isfinite(x)] for n, x in inputs(case).items() if n in ("g", "gk")]
    return EPS32 * max((float(np.max(np.abs(x), initial=0.0)) for x in gates), default=0.0)


def library_floors(case: str, library: str) -> dict[str, float]:
    """Per quantity, the rounding floor a float32 library is held to: our float32 reference's
    error (at least one float32 epsilon), or a chunk form's `decay_exponent_rounding` if larger."""
    floor32 = errors(ours(case, "reference", "float32"), case)
    chunk_form = decay_exponent_rounding(case) if "chunk" in library else 0.0
    return {q: max(e, EPS32, chunk_form) for q, e in floor32.items()}


@pytest.mark.parametrize("case, library", pairs())
def test_library_agrees_with_float64_reference(case, library):
    lib = errors(library_values(case, library), case)
    floors = library_floors(case, library)
    bad = {q: (e, floors[q]) for q, e in lib.items() if not e <= floor_tolerance(floors[q], LIBRARY_FACTOR)}
    assert not bad, f"{library} vs our float64 reference, (error, floor) per quantity: {bad}"


RUNNABLE = sorted(impl.name for impl in kernel_registry.implementations()
                  if impl.priority >= 0 and (impl.backend is Backend.ANY or impl.backend.value == current_backend()))
"""The implementations dispatch may pick here (not another chip's kernel, not an interpreter)."""


@pytest.mark.parametrize("implementation", RUNNABLE)
@pytest.mark.parametrize("case, library", pairs())
def test_implementation_matches_library(case, library, implementation):
    """Two float32 computations, each allowed `LIBRARY_FACTOR` floors from the exact value: their
    difference within twice that (a bound that does not grow with the library's own error)."""
    lib_values = library_values(case, library)
    mine = ours(case, implementation, "float32")
    assert all(np.all(np.isfinite(mine[q])) for q in lib_values), f"{implementation} is not finite on {case}"
    floors = library_floors(case, library)
    gap = difference({q: mine[q] for q in lib_values}, lib_values, case)
    bad = {q: (d, floors[q]) for q, d in gap.items() if not d <= floor_tolerance(floors[q], 2 * LIBRARY_FACTOR)}
    assert not bad, f"{implementation} vs {library}, (difference, floor) per quantity: {bad}"
