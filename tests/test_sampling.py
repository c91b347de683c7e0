"""Token sampling (`recurrax.generation._sampling`): greedy against NumPy's argmax (ties and
NaN included); the kept top-k / top-p sets against NumPy's sort; the tokens drawn against a
reference that masks the whole vocabulary from a full sort (the form every step took before
the candidate search), for the same keys, on both of `kept_tokens`' paths (the `CANDIDATES`
best, and the full sort when they do not hold the kept set); the draws' support."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flax", reason="recurrax.nn.pretrained needs flax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from recurrax.generation import _sampling  # noqa: E402
from recurrax.generation._sampling import greedy_tokens, kept_tokens, sample_tokens  # noqa: E402


def numpy_kept(logits, temperature, top_k, top_p):
    """`[P, V]` kept flags from a stable descending sort in float64."""
    kept = np.zeros(logits.shape, bool)
    for r, row in enumerate(np.asarray(logits, np.float64) / temperature[:, None]):
        order = np.argsort(-row, kind="stable")
        probs = np.exp(row[order] - row.max())
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        rank = np.arange(row.size)
        kept[r, order] = (rank < top_k[r]) & ((before < top_p[r]) | (rank == 0) | (top_p[r] >= 1))
    return kept


def sorted_reference(logits, keys, temperature, top_k, top_p):
    """Every row masked from a full sort (kept flags from `numpy_kept`), Gumbel-max over the
    whole vocabulary; greedy rows by NumPy's argmax."""
    sampling = temperature > 0
    scaled = np.asarray(logits, np.float32) / np.where(sampling, temperature, 1.0)[:, None].astype(np.float32)
    kept = numpy_kept(logits, np.where(sampling, temperature, 1.0), top_k, top_p)
    drawn = jax.vmap(jax.random.categorical)(keys, jnp.asarray(np.where(kept, scaled, -np.inf)))
    return np.where(sampling, np.asarray(drawn), np.argmax(np.asarray(logits), axis=-1))


def test_greedy_tokens_are_numpys_argmax_with_ties_and_nan():
    logits = np.random.default_rng(0).normal(size=(5, 33)).astype(np.float32)
    logits[1, [4, 9, 20]] = 9.0  # a tie: the first wins
    logits[2, :] = -np.inf
    logits[3, [7, 11]] = np.nan  # the first NaN, as argmax
    logits[4, 0] = np.inf
    got = jax.jit(greedy_tokens)(jnp.asarray(logits))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
    np.testing.assert_array_equal(got, jnp.argmax(jnp.asarray(logits), axis=-1))


SETTINGS = [  # (temperature, top_k, top_p) per row: greedy, plain sampling, cuts within and beyond the candidates
    (0.0, 64, 1.0), (1.3, 64, 1.0), (0.7, 3, 1.0), (1.0, 64, 0.3), (2.0, 5, 0.9), (1.0, 20, 1.0), (5.0, 64, 0.999),
]


@pytest.mark.parametrize("candidates", [8, 1024], ids=["8_candidates", "all_candidates"])
@pytest.mark.parametrize("rows", [[0, 1], [0, 1, 2, 3, 4], [2, 3, 4], [5], [6], list(range(7))],
                         ids=["no_cut", "cuts_within", "only_cuts", "top_k_beyond", "flat_nucleus", "every_kind"])
def test_sampled_tokens_equal_the_sorted_reference(monkeypatch, candidates, rows):
    """With 8 candidates of 64 tokens, the rows `top_k_beyond` (top_k 20) and `flat_nucleus` (a
    temperature of 5 and top_p 0.999) need the full sort; the others are settled among the 8."""
    monkeypatch.setattr(_sampling, "CANDIDATES", candidates)
    rng = np.random.default_rng(len(rows) * 7 + candidates)
    temperature, top_k, top_p = (np.array([SETTINGS[r][i] for r in rows]) for i in range(3))
    logits = (rng.normal(size=(len(rows), 64)) * 2).astype(np.float32)
    step = jax.jit(lambda logits, keys, t, k, p: sample_tokens(logits, keys, temperature=t, top_k=k, top_p=p))
    for seed in range(20):
        keys = jax.random.split(jax.random.key(seed), len(rows))
        got = step(jnp.asarray(logits), keys, jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k),
                   jnp.asarray(top_p, jnp.float32))
        np.testing.assert_array_equal(got, sorted_reference(logits, keys, temperature, top_k, top_p), f"seed {seed}")


@pytest.mark.parametrize("candidates", [8, 1024], ids=["8_candidates", "all_candidates"])
def test_kept_tokens_equal_numpys_sort(monkeypatch, candidates):
    monkeypatch.setattr(_sampling, "CANDIDATES", candidates)
    rng = np.random.default_rng(5)
    logits = (rng.normal(size=(len(SETTINGS), 64)) * 2).astype(np.float32)
    temperature, top_k, top_p = (np.array([s[i] for s in SETTINGS]) for i in range(3))
    temperature = np.where(temperature > 0, temperature, 1.0)
    cut = (top_k < 64) | (top_p < 1)
    got = kept_tokens(jnp.asarray(logits / temperature[:, None], jnp.float32), jnp.asarray(top_k),
                      jnp.asarray(top_p, jnp.float32), jnp.asarray(cut))
    np.testing.assert_array_equal(np.asarray(got)[cut], numpy_kept(logits, temperature, top_k, top_p)[cut])


def test_sample_tokens_top_k_top_p_temperature():
    """Sampling restricted to the top-k / top-p set; greedy at temperature 0 (against numpy)."""
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 10)) * 2, jnp.float32)
    keys = jax.random.split(jax.random.key(0), 4)
    greedy = np.argmax(np.asarray(logits), axis=-1)
    assert np.array_equal(sample_tokens(logits, keys, temperature=0.0, top_k=None, top_p=None), greedy)
    assert np.array_equal(sample_tokens(logits, keys, temperature=1.0, top_k=1, top_p=None), greedy)
    assert np.array_equal(sample_tokens(logits, keys, temperature=1.0, top_k=None, top_p=1e-6), greedy)
    order = np.argsort(-np.asarray(logits), axis=-1)
    draw = jax.jit(jax.vmap(lambda k, top_k, top_p: sample_tokens(
        logits, jax.random.split(k, 4), temperature=2.0, top_k=top_k, top_p=top_p), in_axes=(0, None, None)))
    many = draw(jax.random.split(jax.random.key(1), 200), 3, 1.0)  # [200, 4]
    for row in range(4):
        assert set(np.asarray(many[:, row]).tolist()) == set(order[row, :3].tolist())
    probs = np.exp(np.asarray(logits, np.float64)[0] / 2.0)
    probs /= probs.sum()
    nucleus = order[0, : int(np.searchsorted(np.cumsum(probs[order[0]]), 0.5)) + 1]
    many = draw(jax.random.split(jax.random.key(2), 200), 10, 0.5)
    assert set(np.asarray(many[:, 0]).tolist()) == set(nucleus.tolist())
