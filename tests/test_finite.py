"""Hard resets and non-finite values (`recurrax._finite`), property tests over every
chunkwise implementation and the token-by-token ones.

- A gate of −inf (a hard reset, `log 0`) gives the −1e4 result, finite, forward and backward.
- A NaN or ±inf in the query, key, value or gate of token t (or in the output cotangent of
  token t) never reaches the outputs of tokens before t (the gradients of tokens after t),
  nor any output, final state or gradient of the other batch rows or packed sequences.
  "Before" is in processing order: with `reverse=True` it means after.

Each (implementation, layout) is one compiled forward-and-backward program; hypothesis draws
the position, the array and the value as data, so examples cost no compilation. Expected
values are the same program on the clean inputs (unaffected entries must match exactly),
and for hard resets the same program with −1e4 in place of −inf.
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

from recurrax.kernels.tpu import TpuTiles, tpu_interpret
from recurrax.tools.cases import call

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


def _segments(layout: str) -> np.ndarray:
    """[B, T] segment id of every token: the row (dense) or the packed sequence."""
    case = LAYOUTS[layout]
    if case.cu_seqlens is None:
        return np.repeat(np.arange(case.B)[:, None], case.T, axis=1)
    return (np.searchsorted(case.cu_seqlens, np.arange(case.T), side="right") - 1)[None]


def _at(x, row: int, t: int, value: float):
    return x.at[row, t].set(value)


DEFAULT = {("chunk", "rows"), ("pallas_interpret", "packed-reverse")}
"""In the default suite (the others run under `-m slow`): one XLA and one kernel program,
both layouts; the kernels share the driver's handling, and `reference` and `scan` are
causal by construction. Measured 130 s for all ten programs, ~20 s for these two."""
CASES = [
    pytest.param(name, layout, marks=[] if (name, layout) in DEFAULT else [pytest.mark.slow])
    for name in IMPLEMENTATIONS
    for layout in LAYOUTS
]


@pytest.mark.parametrize(("implementation", "layout"), CASES)
@settings(max_examples=4)
@given(data=st.data())
def test_non_finite_values_stay_causal(implementation, layout, data):
    run, diff, do, ds, (o0, s0, g0) = _program(implementation, layout)
    case = LAYOUTS[layout]
    segments = _segments(layout)
    rows, T = segments.shape
    row, t = data.draw(st.integers(0, rows - 1)), data.draw(st.integers(0, T - 1))
    where = data.draw(st.sampled_from(TOKEN_ARRAYS + ("d_output",)))
    value = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    if where == "g" and value == -np.inf:
        return  # a hard reset, not a non-finite value: test_hard_reset_is_the_minus_1e4_result
    if where == "d_output":
        o, s, grads = run(diff, _at(do, row, t, value), ds)
    else:
        o, s, grads = run({**diff, where: _at(diff[where], row, t, value)}, do, ds)
    seg = segments[row, t]
    same_segment = segments == seg  # [B, T]
    earlier = np.arange(T) > t if case.reverse else np.arange(T) < t
    later = np.arange(T) < t if case.reverse else np.arange(T) > t
    state_segment = np.arange(s0.shape[0]) == seg
    np.testing.assert_array_equal(np.asarray(s)[~state_segment], np.asarray(s0)[~state_segment])
    np.testing.assert_array_equal(np.asarray(grads["initial_state"])[~state_segment],
                                  np.asarray(g0["initial_state"])[~state_segment])
    unaffected = ~same_segment | (later if where == "d_output" else earlier)[None]
    if where == "d_output":
        np.testing.assert_array_equal(np.asarray(o), np.asarray(o0))
        for name in TOKEN_ARRAYS:
            np.testing.assert_array_equal(np.asarray(grads[name])[unaffected], np.asarray(g0[name])[unaffected], name)
    else:
        np.testing.assert_array_equal(np.asarray(o)[unaffected], np.asarray(o0)[unaffected])
        for name in TOKEN_ARRAYS:
            other = ~same_segment
            np.testing.assert_array_equal(np.asarray(grads[name])[other], np.asarray(g0[name])[other], name)


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
