"""The short causal convolution (`recurrax.nn._conv.causal_conv`) against a reference written
here: each sequence's inputs after its buffer, each output a sum over the lags, in float64.

Gradients (inputs, buffer, kernel) are compared with autodiff of that reference, so the
hand-written VJP of `window_depthwise` is checked against JAX's own; and what the VJP keeps for
the backward is checked to be the inputs' size, not W lagged copies of them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recurrax.nn._conv import causal_conv

WIDTH, C = 4, 3


def reference(x, buffer, cu_seqlens, kernel):
    """`(y, new_buffer)`: each sequence (a row of `x`, or a packed span) after its buffer rows;
    `y_t = Σ_l kernel[l] x_{t−l}`; the new buffer its last W − 1 inputs (with the old buffer's
    in front, for a sequence shorter than W − 1)."""
    spans = [(b, 0, x.shape[1]) for b in range(x.shape[0])] if cu_seqlens is None else \
        [(0, int(begin), int(end)) for begin, end in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    outputs, buffers = [], []
    for row, (b, begin, end) in enumerate(spans):
        window = jnp.concatenate([buffer[row], x[b, begin:end]])  # [W − 1 + L, C]
        L = end - begin
        outputs.append(sum(kernel[lag] * window[WIDTH - 1 - lag: WIDTH - 1 - lag + L] for lag in range(WIDTH)))
        buffers.append(window[window.shape[0] - (WIDTH - 1):])
    y = jnp.stack(outputs) if cu_seqlens is None else jnp.concatenate(outputs)[None]
    return y, jnp.stack(buffers)


def case(packed: bool):
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (1, 12, C) if packed else (2, 9, C), jnp.float64)
    cu_seqlens = jnp.array([0, 2, 2, 7, 12], jnp.int32) if packed else None  # one short, one empty
    rows = 4 if packed else 2
    buffer = jax.random.normal(keys[1], (rows, WIDTH - 1, C), jnp.float64)
    kernel = jax.random.normal(keys[2], (WIDTH, C), jnp.float64)
    return x, buffer, cu_seqlens, kernel


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_values_and_gradients_equal_the_reference(packed):
    x, buffer, cu_seqlens, kernel = case(packed)
    got, got_pull = jax.vjp(lambda *a: causal_conv(a[0], a[1], cu_seqlens, a[2]), x, buffer, kernel)
    want, want_pull = jax.vjp(lambda *a: reference(a[0], a[1], cu_seqlens, a[2]), x, buffer, kernel)
    cotangents = tuple(jax.random.normal(jax.random.key(i + 5), w.shape, w.dtype) for i, w in enumerate(want))
    for ours, theirs in zip((*got, *got_pull(cotangents)), (*want, *want_pull(cotangents))):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-12, atol=1e-12)


def test_the_backward_keeps_the_inputs_not_their_lagged_copies():
    """The residuals of the dense convolution's VJP: nothing larger than the window `[B, T + W − 1, C]`."""
    x, buffer, _, kernel = case(False)
    _, pull = jax.vjp(lambda x, kernel: causal_conv(x, buffer, None, kernel)[0], x, kernel)
    sizes = [leaf.size for leaf in jax.tree.leaves(pull)]
    assert max(sizes) <= x.shape[0] * (x.shape[1] + WIDTH - 1) * C < WIDTH * x.size, sizes
