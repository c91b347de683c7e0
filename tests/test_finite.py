"""Hard resets and non-finite values (`recurrax._core.finite`), property tests over every
chunkwise implementation and the token-by-token ones.

- A gate of −inf (a hard reset, `log 0`) gives the −1e4 result, finite, forward and backward.
- A NaN or ±inf in the query, key, value or gate of token t, or in the output cotangent of
  token t, makes non-finite exactly the (token, head) cells of the outputs, final states and
  gradients that the token loop's own autodiff (the float64 `reference`) makes non-finite;
  every other cell is finite and matches the reference; cells the value cannot reach (other
  rows and sequences, outputs of earlier tokens, gradients of later ones when the cotangent
  is bad) equal the clean run's bit for bit. "Before" is in processing order: with
  `reverse=True` it means after.

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
from _cases import Case, make_inputs, split_args
from hypothesis import given, settings
from hypothesis import strategies as st

import recurrax
from recurrax.kernels.tpu import TpuTiles, tpu_interpret
from recurrax.tools.cases import call, max_rel_error

TPU = functools.partial(tpu_interpret, tiles=TpuTiles(chunk=16, sub=8, block_v=64))
IMPLEMENTATIONS = {"reference": "reference", "scan": "scan", "chunk": "chunk", "pallas_interpret": "pallas_interpret",
                   "tpu_interpret": TPU}
SHAPES = dict(T=20, H=1, Hkv=1, K=16, V=16, dtype="float32")
LAYOUTS = {
    "rows": Case(B=2, gates=("g_head",), **SHAPES),
    "packed-reverse": Case(gates=("g_channel",), cu_seqlens=(0, 7, 20), reverse=True, **SHAPES),
}
TOKEN_ARRAYS = ("query", "key", "value", "g")


@functools.cache
def _program(implementation: str, layout: str):
    """(jitted (diff, do, ds) -> (output, final state, gradients), inputs, cotangents, clean results)."""
    kwargs = make_inputs(LAYOUTS[layout])
    diff, rest = split_args(kwargs)
    static = {k: rest.pop(k) for k in ("reverse", "softmax_scale")}
    fn = IMPLEMENTATIONS[implementation]

    @jax.jit
    def run(diff, do, ds):
        (o, state), pullback = jax.vjp(lambda d: call(fn, **d, **rest, **static), diff)
        return o, state, pullback((do, ds))[0]

    o_shape, s_shape = jax.eval_shape(lambda d: call(fn, **d, **rest, **static), diff)
    rng = np.random.default_rng(1)
    do = jnp.asarray(rng.standard_normal(o_shape.shape), jnp.float32)
    ds = jnp.asarray(rng.standard_normal(s_shape.shape), jnp.float32)
    return run, diff, do, ds, run(diff, do, ds)


def _in_float64(diff, do, ds):
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), (diff, do, ds))


def _segments(layout: str) -> np.ndarray:
    """[B, T] segment id of every token: the row (dense) or the packed sequence."""
    case = LAYOUTS[layout]
    if case.cu_seqlens is None:
        return np.repeat(np.arange(case.B)[:, None], case.T, axis=1)
    return (np.searchsorted(case.cu_seqlens, np.arange(case.T), side="right") - 1)[None]


def _at(x, row: int, t: int, value: float):
    return x.at[row, t].set(value)


def _cells(results) -> dict:
    """Name -> array of every output and gradient of one run."""
    o, s, grads = results
    return {"output": np.asarray(o), "final_state": np.asarray(s), **{k: np.asarray(v) for k, v in grads.items()}}


def _bad_cells(x: np.ndarray, name: str) -> np.ndarray:
    """Per (token, head) cell ([B, T, H] for token arrays, [R, H] for states): any non-finite entry."""
    bad = ~np.isfinite(x)
    cell_dims = 2 if name in ("final_state", "initial_state") else 3
    return bad.reshape(*bad.shape[:cell_dims], -1).any(-1)


DEFAULT = {("chunk", "rows"), ("pallas_interpret", "packed-reverse"), ("tpu_interpret", "rows")}
"""In the default suite (the others run under `-m slow`): one XLA and two kernel programs,
both layouts; the GPU kernels share the driver's cleaning, the TPU kernels clean at load
(`PallasBackend.cleans_at_load`), and `reference` and `scan` are causal by construction.
Measured 130 s for all ten programs, ~20 s for the first two."""
CASES = [
    pytest.param(name, layout, marks=[] if (name, layout) in DEFAULT else [pytest.mark.slow])
    for name in IMPLEMENTATIONS
    for layout in LAYOUTS
]


@pytest.mark.parametrize(("implementation", "layout"), CASES)
@settings(max_examples=4)
@given(data=st.data())
def test_non_finite_values_reach_what_the_token_loop_reaches(implementation, layout, data):
    run, diff, do, ds, clean = _program(implementation, layout)
    oracle, *_, clean_exact = _program("reference", layout)
    floor = max(max_rel_error(x, y) for x, y in zip(_cells(clean).values(), _cells(clean_exact).values()))
    case = LAYOUTS[layout]
    segments = _segments(layout)
    rows, T = segments.shape
    row, t = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, T - 1))
    where = data.draw(st.sampled_from(TOKEN_ARRAYS + ("d_output",)))
    value = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    if where == "g" and value == -np.inf:
        return  # a hard reset, not a non-finite value: test_hard_reset_is_the_minus_1e4_result
    if where == "d_output":
        do = _at(do, row, t, value)
    else:
        diff = {**diff, where: _at(diff[where], row, t, value)}
    got, expected = _cells(run(diff, do, ds)), _cells(oracle(*_in_float64(diff, do, ds)))
    for name, x in got.items():
        bad = _bad_cells(x, name)
        np.testing.assert_array_equal(bad, _bad_cells(expected[name], name), f"{name}: non-finite cells")
        fine = ~bad.reshape(*bad.shape, *([1] * (x.ndim - bad.ndim)))
        fine = np.broadcast_to(fine, x.shape)
        assert max_rel_error(x[fine], expected[name][fine]) <= 8 * floor + 1e-6, name

    # What the value cannot reach equals the clean run bit for bit.
    seg = segments[row, t]
    earlier = np.arange(T) > t if case.reverse else np.arange(T) < t
    later = np.arange(T) < t if case.reverse else np.arange(T) > t
    untouched = (segments != seg) | (later if where == "d_output" else earlier)[None]
    clean = _cells(clean)
    other_state = np.arange(clean["final_state"].shape[0]) != seg
    for name in ("final_state", "initial_state"):
        np.testing.assert_array_equal(got[name][other_state], clean[name][other_state], name)
    names = TOKEN_ARRAYS if where == "d_output" else ("output",)
    for name in names:
        np.testing.assert_array_equal(got[name][untouched], clean[name][untouched], name)
    for name in TOKEN_ARRAYS:
        np.testing.assert_array_equal(got[name][segments != seg], clean[name][segments != seg], name)


def test_a_bad_value_leaves_the_gradients_of_earlier_tokens_finite():
    """The issue-31 case: a NaN in v at token 100 of 200, a loss over the tokens before it.
    Finite, and equal to the gradients without the NaN: every gradient of the tokens before
    it. Non-finite, as in the token loop: dq from token 100 on (h_t is NaN there, and
    NaN · 0 = NaN), dk at token 100 (∂h · v), the gate's from token 101 on (it reads h_{t−1})."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 200, 2, 16)), jnp.float32) for _ in range(3))
    g = jnp.asarray(-rng.uniform(0, 1, (1, 200, 2)), jnp.float32)

    def loss(q, k, v, g):
        return jnp.sum(recurrax.recurrent(q, k, v, g=g)[0][:, :100] ** 2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    clean, poisoned = grads(q, k, v, g), grads(q, k, v.at[0, 100].set(np.nan), g)
    tokens = np.arange(200)
    expected_bad = {"q": tokens >= 100, "k": tokens == 100, "v": tokens < 0, "g": tokens > 100}
    for name, x, y in zip("qkvg", poisoned, clean):
        x, y = np.asarray(x), np.asarray(y)
        bad = ~np.isfinite(x).reshape(1, 200, 2, -1).any(-1)
        np.testing.assert_array_equal(bad[0], np.stack([expected_bad[name]] * 2, -1), name)
        np.testing.assert_allclose(x[:, ~expected_bad[name]], y[:, ~expected_bad[name]], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize(("implementation", "layout"), CASES)
def test_hard_reset_is_the_minus_1e4_result(implementation, layout):
    """−inf at a gate anywhere (first, middle, last token) equals −1e4 there, all finite."""
    run, diff, do, ds, _ = _program(implementation, layout)
    g = diff["g"]
    for t in (0, 9, g.shape[1] - 1):
        hard = run({**diff, "g": g.at[0, t].set(-np.inf)}, do, ds)
        soft = run({**diff, "g": g.at[0, t].set(-1e4)}, do, ds)
        for x, y in zip(jax.tree.leaves(hard), jax.tree.leaves(soft)):
            assert np.isfinite(np.asarray(x)).all()
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)
