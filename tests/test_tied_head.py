"""The tied output head (`recurrax.nn._tied`): its CPU blocked form for a few rows against the
NumPy float64 product `h · Eᵀ`, within `floor_tolerance` of the plain float32 matmul's error
against the same product; the same greedy tokens; and which shapes take the blocked form.
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

VOCAB, D = 103, 16  # 103 rows: blocks of 8 leave a tail of 7


def _relative(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want)))


def _embed(dtype=jnp.float32) -> nnx.Embed:
    embed = nnx.Embed(VOCAB, D, rngs=nnx.Rngs(0), param_dtype=dtype)
    embed.embedding[...] = jax.random.normal(jax.random.key(1), (VOCAB, D), dtype)
    return embed


@pytest.mark.parametrize("lead", [(2,), (8, 1), (3, 5)], ids=["2_rows", "8x1_decode", "3x5"])
@pytest.mark.parametrize("rows", [8, 1, 103], ids=["blocks_of_8", "blocks_of_1", "one_block"])
def test_blocked_head_matches_the_float64_product(lead, rows):
    table = jax.random.normal(jax.random.key(0), (VOCAB, D), jnp.float32)
    h = jax.random.normal(jax.random.key(len(lead) + rows), (*lead, D), jnp.float32)
    want = np.asarray(h, np.float64) @ np.asarray(table, np.float64).T
    floor = _relative(jnp.einsum("...d,vd->...v", h, table), want)
    got = _tied.blocked_tied_logits(h, table, rows)
    assert got.shape == (*lead, VOCAB) and got.dtype == jnp.float32
    assert _relative(got, want) <= floor_tolerance(floor)
    np.testing.assert_array_equal(np.argmax(got, -1), np.argmax(want, -1))


def test_tied_logits_blocks_few_rows_on_the_cpu(monkeypatch):
    """With 8-row blocks (`BLOCK_BYTES` shrunk to the tiny table), 2 to `BLOCKED_ROWS` rows take
    the blocked form and equal the float64 product; one row and more rows keep the single matmul."""
    monkeypatch.setattr(_tied, "BLOCK_BYTES", 8 * D * 4)
    calls = []
    blocked = _tied.blocked_tied_logits
    monkeypatch.setattr(_tied, "blocked_tied_logits", lambda *a: calls.append(a[0].shape) or blocked(*a))
    embed = _embed()
    table = np.asarray(embed.embedding[...], np.float64)
    for lead, expect_blocked in [((4, 1), True), ((1, 1), False), ((_tied.BLOCKED_ROWS + 1,), False)]:
        calls.clear()
        h = jax.random.normal(jax.random.key(2), (*lead, D), jnp.float32)
        want = np.asarray(h, np.float64) @ table.T
        floor = _relative(jnp.einsum("...d,vd->...v", h, embed.embedding[...]), want)
        got = jax.jit(_tied.tied_logits)(embed, h) if expect_blocked else _tied.tied_logits(embed, h)
        assert bool(calls) == (expect_blocked and jax.default_backend() == "cpu"), lead
        assert _relative(got, want) <= floor_tolerance(floor)


def test_tied_logits_in_float64_equals_the_product(monkeypatch):
    monkeypatch.setattr(_tied, "BLOCK_BYTES", 8 * D * 8)
    embed = _embed(jnp.float64)
    h = jax.random.normal(jax.random.key(3), (5, 1, D), jnp.float64)
    got = _tied.tied_logits(embed, h)
    want = np.asarray(h) @ np.asarray(embed.embedding[...]).T
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
