"""The tied output head (`recurrax.nn._tied`): its CPU column form for a few rows against the
NumPy float64 product `h · Eᵀ`, within `floor_tolerance` of the plain float32 matmul's error
against the same product; the same greedy tokens; its gradients; and which shapes take it.
Error metric: max |got − want| / max |want|.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flax", reason="recurrax.nn needs flax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from _cases import floor_tolerance  # noqa: E402

from recurrax.nn import _tied  # noqa: E402

VOCAB, D = 103, 16


def _relative(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


def _embed(dtype=jnp.float32) -> nnx.Embed:
    embed = nnx.Embed(VOCAB, D, rngs=nnx.Rngs(0), param_dtype=dtype)
    embed.embedding[...] = jax.random.normal(jax.random.key(1), (VOCAB, D), dtype)
    return embed


@pytest.mark.parametrize("lead", [(2,), (8, 1), (3, 5)], ids=["2_rows", "8x1_decode", "3x5"])
def test_column_head_matches_the_float64_product(lead):
    table = jax.random.normal(jax.random.key(0), (VOCAB, D), jnp.float32)
    h = jax.random.normal(jax.random.key(len(lead)), (*lead, D), jnp.float32)
    want = np.asarray(h, np.float64) @ np.asarray(table, np.float64).T
    floor = _relative(jnp.einsum("...d,vd->...v", h, table), want)
    got = jax.jit(_tied.column_tied_logits)(h, table)
    assert got.shape == (*lead, VOCAB) and got.dtype == jnp.float32
    assert _relative(got, want) <= floor_tolerance(floor)
    np.testing.assert_array_equal(np.argmax(got, -1), np.argmax(want, -1))


def test_column_head_gradients_match_the_float64_products():
    """d/dh and d/dE of Σ c · logits (c fixed) through the barrier: c · E and cᵀ · h."""
    table = jax.random.normal(jax.random.key(0), (VOCAB, D), jnp.float32)
    h = jax.random.normal(jax.random.key(1), (4, D), jnp.float32)
    c = np.asarray(jax.random.normal(jax.random.key(2), (4, VOCAB)), np.float64)
    dh, dtable = jax.jit(jax.grad(lambda h, t: jnp.sum(c * _tied.column_tied_logits(h, t)), (0, 1)))(h, table)
    for got, want, floor_of in [(dh, c @ np.asarray(table, np.float64), jnp.asarray(c, jnp.float32) @ table),
                                (dtable, c.T @ np.asarray(h, np.float64), jnp.asarray(c, jnp.float32).T @ h)]:
        assert _relative(got, want) <= floor_tolerance(_relative(floor_of, want))


def test_tied_logits_takes_the_column_form_for_few_rows_on_the_cpu(monkeypatch):
    """2 to `COLUMN_ROWS` rows take the column form and equal the float64 product; one row and
    more rows keep the single matmul."""
    calls = []
    column = _tied.column_tied_logits
    monkeypatch.setattr(_tied, "column_tied_logits", lambda *a: calls.append(a[0].shape) or column(*a))
    embed = _embed()
    table = np.asarray(embed.embedding[...], np.float64)
    for lead, expect_columns in [((4, 1), True), ((1, 1), False), ((_tied.COLUMN_ROWS + 1,), False)]:
        calls.clear()
        h = jax.random.normal(jax.random.key(2), (*lead, D), jnp.float32)
        want = np.asarray(h, np.float64) @ table.T
        floor = _relative(jnp.einsum("...d,vd->...v", h, embed.embedding[...]), want)
        got = jax.jit(_tied.tied_logits)(embed, h) if expect_columns else _tied.tied_logits(embed, h)
        assert bool(calls) == (expect_columns and jax.default_backend() == "cpu"), lead
        assert _relative(got, want) <= floor_tolerance(floor)


def test_tied_logits_in_float64_equals_the_product():
    embed = _embed(jnp.float64)
    h = jax.random.normal(jax.random.key(3), (5, 1, D), jnp.float64)
    got = _tied.tied_logits(embed, h)
    want = np.asarray(h) @ np.asarray(embed.embedding[...]).T
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
