"""Picking the next token from a row of logits: greedy, or sampled with a temperature, top-k
and top-p (nucleus), every setting per row and traceable.

| symbol | meaning                                                                  |
|--------|--------------------------------------------------------------------------|
| P      | rows (cache slots), each with its own settings                           |
| V      | the vocabulary                                                           |
| C      | `CANDIDATES`: the best tokens a top-k / top-p cut is looked for among    |
| τ      | a row's temperature (0: greedy)                                          |

    greedy:   argmax_j logits_j (the first of equal maxima)
    sampled:  j ~ softmax(logits / τ) over the kept tokens: rank r (best first) is kept when
              r < top_k and (mass of the better tokens < top_p, or r = 0)

Decoding with a large vocabulary (Qwen3.5's 248,320) is what this is written for: each step
samples P rows, and sorting every row (what a nucleus cut needs in general) takes longer than
the model's step (P = 8: 140 ms against ~60 ms for the whole step of an 8-layer Qwen3.5 on 2
cores). So the step does only the work its rows ask for, each part behind a `lax.cond`:
- no row samples: only the greedy argmax (a max and a first-index pass, 13× faster than XLA's
  `argmax` reduction at P = 8);
- rows sample without a cut: the Gumbel-max draw over all V (`jax.random.categorical`);
- rows cut: their kept set is looked for among the C best tokens (`lax.top_k`, which orders
  ties by index as the stable sort does). A rank ≥ C is never kept when top_k ≤ C, or when the
  C best already hold top_p of the mass (the mass before any later rank is at least that);
  when neither holds for some cut row, every row takes the full sort. Either way the same
  tokens are kept, and the draw is the same Gumbel-max over all V with the others masked
  out, so a seed gives the same token whichever path ran (the nucleus's boundary apart, where
  a cumulative sum in another order can round differently).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CANDIDATES = 1024


def sample_tokens(logits, keys, *, temperature, top_k, top_p):
    """One token per row of `logits [P, vocab]` (int32 `[P]`): greedy at temperature 0, else
    sampled from `softmax(logits / temperature)` restricted to the top-k tokens and the top-p
    nucleus (see the module notes for what runs).

    **Arguments:**
    - `logits`: `[P, vocab]`.
    - `keys`: `[P]` PRNG keys, one per row (unused by greedy rows).
    - `temperature`, `top_k`, `top_p`: each a scalar or one value per row `[P]`, possibly
      traced (one compiled decoder serves them all); `top_k=None` is the whole vocabulary,
      `top_p=None` is 1 (no nucleus cut).
    """
    P, vocab = logits.shape
    row = lambda x: jnp.broadcast_to(jnp.reshape(jnp.asarray(x), (-1,)), (P,))  # noqa: E731
    temperature = row(temperature)
    top_k = row(vocab if top_k is None else top_k)
    top_p = row(1.0 if top_p is None else top_p)
    sampling = temperature > 0
    cut = sampling & ((top_k < vocab) | (top_p < 1.0))
    greedy = greedy_tokens(logits)

    def draw(with_cut: bool):
        scaled = logits.astype(jnp.float32) / jnp.where(sampling, temperature, 1.0)[:, None]
        if with_cut:
            scaled = jnp.where(kept_tokens(scaled, top_k, top_p, cut) | ~cut[:, None], scaled, -jnp.inf)
        return jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)

    sampled = jax.lax.cond(jnp.any(cut), lambda: draw(True),
                           lambda: jax.lax.cond(jnp.any(sampling), lambda: draw(False), lambda: greedy))
    return jnp.where(sampling, sampled, greedy)


def greedy_tokens(logits):
    """`jnp.argmax(logits, -1)` as int32 (the first of equal maxima; the first NaN if any), as
    a max and a first-index pass, which XLA runs far faster on the CPU than its argmax."""
    vocab = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)
    hit = (logits == top) | (jnp.isnan(logits) & jnp.isnan(top))
    return jnp.min(jnp.where(hit, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)


def kept_tokens(scaled, top_k, top_p, cut):
    """`[P, vocab]`: the tokens each row's top-k and top-p keep (rows not in `cut` are ignored):
    from the `CANDIDATES` best where they hold every kept token, else from a full sort."""
    candidates = min(CANDIDATES, scaled.shape[-1])
    values, order = jax.lax.top_k(scaled, candidates)
    log_total = jax.nn.logsumexp(scaled, axis=-1, keepdims=True)
    keep, mass = _ranked_keep(values, log_total, top_k, top_p)
    enough = (top_k <= candidates) | ((top_p < 1.0) & (mass >= top_p)) | ~cut
    return jax.lax.cond(jnp.all(enough), lambda: _scatter(keep, order, scaled.shape),
                        lambda: _kept_by_sorting(scaled, log_total, top_k, top_p))


def _kept_by_sorting(scaled, log_total, top_k, top_p):
    """`kept_tokens` over the whole vocabulary, sorted (best first, ties by index)."""
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    keep, _ = _ranked_keep(jnp.take_along_axis(scaled, order, axis=-1), log_total, top_k, top_p)
    return _scatter(keep, order, scaled.shape)


def _ranked_keep(ranked, log_total, top_k, top_p):
    """Which of the `ranked` (best first) tokens are kept, and the mass they hold in all."""
    probs = jnp.exp(ranked - log_total)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the better tokens
    rank = jnp.arange(ranked.shape[-1])
    keep = (rank < top_k[:, None]) & ((before < top_p[:, None]) | (rank == 0) | (top_p[:, None] >= 1.0))
    return keep, jnp.sum(probs, axis=-1)


def _scatter(keep_ranked, order, shape):
    """Ranked keep flags back in vocabulary order."""
    rows = jnp.arange(shape[0])[:, None]
    return jnp.zeros(shape, bool).at[rows, order].set(keep_ranked)


def penalize_repetitions(logits, seen, penalty):
    """`logits [P, vocab]` with the tokens each row has seen (`seen [P, vocab]`, its prompt
    and its tokens so far) made less likely, as `transformers`' repetition penalty: a seen
    token's positive logit divided by `penalty`, a negative one multiplied by it (`penalty`
    > 1 discourages repeats; 1 changes nothing; it may be traced)."""
    logits = logits.astype(jnp.float32)
    return jnp.where(seen, jnp.where(logits > 0, logits / penalty, logits * penalty), logits)
