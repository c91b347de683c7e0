"""Non-finite values in the delta rule (`recurrax.delta._finite`), property tests over every
implementation, `parallel.delta_rule` included: `tests/test_finite.py` for `delta_rule`.

- A NaN or ±inf in the query, key, value, β or gate of token t, or in the output cotangent of
  token t, makes non-finite exactly the (token, head) cells of the outputs, final states and
  gradients that the token loop's own autodiff (the float64 `reference`) makes non-finite;
  every other cell is finite and matches the reference; cells the value cannot reach (other
  rows and sequences, outputs of earlier tokens, gradients of later ones when the cotangent
  is bad) equal the clean run's bit for bit.

Each (implementation, layout) is one compiled forward-and-backward program; hypothesis draws
the position, the array and the value as data, so examples cost no compilation. The rounding
floor of each program is its clean run's error against the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_parallel import Split

import recurrax
from recurrax import parallel
from recurrax.delta import canonicalize_delta
from recurrax.kernels.tpu import TpuTiles, tpu_delta_interpret
from recurrax.tools.cases import DeltaCase, delta_options, make_delta_inputs, max_rel_error

KERNEL = functools.partial(tpu_delta_interpret, tiles=TpuTiles(chunk=16, sub=8, block_v=64))
SHAPES = dict(T=24, Hqk=1, H=2, K=16, V=16)
LAYOUTS = {
    "rows": DeltaCase(B=2, gates=("g",), **SHAPES),
    "packed": DeltaCase(gates=("gk",), cu_seqlens=(0, 7, 7, 24), beta_range=(0.0, 2.0), **SHAPES),
}
TOKEN_ARRAYS = ("query", "key", "value", "beta", "gate")
SEQUENCE_SHARDS = Split(sequence=4)


def _kernel(**kwargs):
    """The TPU kernel in interpret mode under one `jit` (run eagerly, op by op, its interpreter's
    callbacks once left a worker waiting forever in XLA's CPU executor on a loaded machine)."""
    static = {n: kwargs.pop(n, None) for n in ("softmax_scale", "qk_l2norm")}
    return _jitted_kernel(kwargs, **static)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "qk_l2norm"))
def _jitted_kernel(arrays, softmax_scale, qk_l2norm):
    args = [arrays.get(n) for n in ("query", "key", "value", "beta", "g", "gk")]
    problem, scale, layout = canonicalize_delta(*args, softmax_scale, arrays.get("initial_state"),
                                                arrays.get("cu_seqlens"), qk_l2norm)
    output, final_state = KERNEL(problem, scale=scale)
    return layout.restore(output), final_state


IMPLEMENTATIONS = {
    "reference": functools.partial(recurrax.delta_rule, implementation="reference"),
    "scan": functools.partial(recurrax.delta_rule, implementation="scan"),
    "chunk": functools.partial(recurrax.delta_rule, implementation="chunk"),
    "pallas_tpu_interpret": _kernel,
    "parallel": lambda **kw: parallel.delta_rule(**kw, mesh=SEQUENCE_SHARDS.mesh(), **SEQUENCE_SHARDS.axes(),
                                                 implementation="chunk"),
}


def _gate_name(layout: str) -> str:
    return LAYOUTS[layout].gates[0]


@functools.cache
def _program(implementation: str, layout: str):
    """(jitted (diff, do, ds) -> (output, final state, gradients), inputs, cotangents, clean results)."""
    case = LAYOUTS[layout]
    diff = {n: jnp.asarray(x, jnp.float32) for n, x in make_delta_inputs(case).items()}
    options = delta_options(case)
    cu_seqlens = options.pop("cu_seqlens", None)
    fn = IMPLEMENTATIONS[implementation]

    @jax.jit
    def run(diff, do, ds, cu_seqlens):
        (o, state), pullback = jax.vjp(lambda d: fn(**d, **options, cu_seqlens=cu_seqlens), diff)
        return o, state, pullback((do, ds))[0]

    o_shape, s_shape = jax.eval_shape(lambda d: fn(**d, **options, cu_seqlens=cu_seqlens), diff)
    rng = np.random.default_rng(1)
    do = jnp.asarray(rng.standard_normal(o_shape.shape), jnp.float32)
    ds = jnp.asarray(rng.standard_normal(s_shape.shape), jnp.float32)
    run = functools.partial(run, cu_seqlens=cu_seqlens)
    return run, diff, do, ds, run(diff, do, ds)


def _in_float64(diff, do, ds):
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), (diff, do, ds))


def _segments(layout: str) -> np.ndarray:
    """[B, T] segment id of every token: the row (dense) or the packed sequence."""
    case = LAYOUTS[layout]
    if case.cu_seqlens is None:
        return np.repeat(np.arange(case.B)[:, None], case.T, axis=1)
    return (np.searchsorted(case.cu_seqlens, np.arange(case.T), side="right") - 1)[None]


def _cells(results) -> dict:
    """Name -> array of every output and gradient of one run."""
    o, s, grads = results
    return {"output": np.asarray(o), "final_state": np.asarray(s), **{k: np.asarray(v) for k, v in grads.items()}}


def _bad_cells(x: np.ndarray, name: str) -> np.ndarray:
    """Per (token, head) cell ([B, T, H] for token arrays, [R, H] for states): any non-finite entry."""
    bad = ~np.isfinite(x)
    cell_dims = 2 if name in ("final_state", "initial_state") else 3
    return bad.reshape(*bad.shape[:cell_dims], -1).any(-1)


DEFAULT = {("chunk", "rows"), ("chunk", "packed"), ("scan", "packed"), ("pallas_tpu_interpret", "packed"),
           ("parallel", "packed")}
"""In the default suite (the others run under `-m slow`): every implementation that cleans
and marks, and `scan`'s packed final states (the case issue 49 found leaking)."""
CASES = [
    pytest.param(name, layout, marks=[] if (name, layout) in DEFAULT else [pytest.mark.slow])
    for name in IMPLEMENTATIONS if name != "reference"
    for layout in LAYOUTS
]


@pytest.mark.parametrize(("implementation", "layout"), CASES)
@settings(max_examples=6)
@given(data=st.data())
def test_non_finite_values_reach_what_the_token_loop_reaches(implementation, layout, data):
    run, diff, do, ds, clean = _program(implementation, layout)
    oracle, *_, clean_exact = _program("reference", layout)
    floor = max(max_rel_error(x, y) for x, y in zip(_cells(clean).values(), _cells(clean_exact).values()))
    segments = _segments(layout)
    rows, T = segments.shape
    row, t = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, T - 1))
    where = data.draw(st.sampled_from(TOKEN_ARRAYS + ("d_output",)))
    value = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    if where == "gate" and value == -np.inf:
        return  # a hard reset, not a non-finite value (test_delta_chunk's hard-reset test)
    if where == "d_output":
        do = do.at[row, t].set(value)
    else:
        name = _gate_name(layout) if where == "gate" else where
        diff = {**diff, name: diff[name].at[row, t].set(value)}
    got, expected = _cells(run(diff, do, ds)), _cells(oracle(*_in_float64(diff, do, ds)))
    for name, x in got.items():
        bad = _bad_cells(x, name)
        np.testing.assert_array_equal(bad, _bad_cells(expected[name], name), f"{name}: non-finite cells")
        fine = np.broadcast_to(bad.reshape(*bad.shape, *([1] * (x.ndim - bad.ndim))), x.shape)
        assert max_rel_error(x[~fine], expected[name][~fine]) <= 8 * floor + 1e-6, name

    # What the value cannot reach equals the clean run bit for bit.
    seg = segments[row, t]
    earlier, later = np.arange(T) < t, np.arange(T) > t
    untouched = (segments != seg) | (later if where == "d_output" else earlier)[None]
    clean = _cells(clean)
    other_state = np.arange(clean["final_state"].shape[0]) != seg
    for name in ("final_state", "initial_state"):
        np.testing.assert_array_equal(got[name][other_state], clean[name][other_state], name)
    token_arrays = [n for n in got if n not in ("output", "final_state", "initial_state")]
    for name in token_arrays if where == "d_output" else ("output",):
        np.testing.assert_array_equal(got[name][untouched], clean[name][untouched], name)
    for name in token_arrays:
        np.testing.assert_array_equal(got[name][segments != seg], clean[name][segments != seg], name)


def test_a_nan_beta_leaves_earlier_tokens_and_other_sequences_alone():
    """Issue 49: a NaN β passed silently. It is a non-finite input like any other: the outputs
    of its sequence from its token on are NaN, every earlier output and every other sequence
    (its final state included) are the clean run's."""
    case = LAYOUTS["packed"]
    arrays = {n: jnp.asarray(x, jnp.float32) for n, x in make_delta_inputs(case).items()}
    options = delta_options(case)
    clean_o, clean_s = recurrax.delta_rule(**arrays, **options)
    o, s = recurrax.delta_rule(**{**arrays, "beta": arrays["beta"].at[0, 12, 1].set(np.nan)}, **options)
    o, s, clean_o, clean_s = map(np.asarray, (o, s, clean_o, clean_s))
    np.testing.assert_array_equal(o[0, :12], clean_o[0, :12])
    assert np.isnan(o[0, 12:, 1]).all() and np.isfinite(o[0, 12:, 0]).all()
    np.testing.assert_array_equal(s[:2], clean_s[:2])
    assert np.isnan(s[2, 1]).all()


@pytest.mark.parametrize("implementation", [n for n in IMPLEMENTATIONS if n != "reference"])
def test_issue_49_cases(implementation):
    """The three leaks issue 49 found, forward: a NaN in the value of token 20 (the last
    sequence, the last shard) reached the earlier tokens of its chunk (`chunk`), the final
    state of the sequence before (`scan`'s packed final states), and every later shard of
    `parallel.delta_rule`. Here only token 20 on of its sequence and its final state are NaN."""
    case = LAYOUTS["packed"]
    arrays = {n: jnp.asarray(x, jnp.float32) for n, x in make_delta_inputs(case).items()}
    run = functools.partial(IMPLEMENTATIONS[implementation], **delta_options(case))
    clean_o, clean_s = map(np.asarray, run(**arrays))
    o, s = map(np.asarray, run(**{**arrays, "value": arrays["value"].at[0, 20].set(np.nan)}))
    np.testing.assert_array_equal(o[0, :20], clean_o[0, :20])
    np.testing.assert_array_equal(s[:2], clean_s[:2])
    assert np.isnan(o[0, 20:]).all() and np.isnan(s[2]).all()
