"""Multi-query associative recall (MQAR), generated on the fly with `jax.random`.

A sequence lists `num_pairs` key–value pairs, then asks queries: each query is a key from
the pairs followed by its value. The model must predict the value from the position of
the queried key, so only those positions are scored.

    tokens   k1 v1 k2 v2 … kP vP | q1 a1 q2 a2 … | 0 …      a_i is the value paired with q_i
    targets  the next token at every position
    mask     True exactly at the positions of q1, q2, …

Keys and values come from disjoint halves of the vocabulary (token 0 is padding); keys in a
sequence are distinct. The training and held-out splits draw from different random
streams of the same seed, so held-out sequences are new to the model.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int, PRNGKeyArray

TRAIN, HELD_OUT = 0, 1
"""Split ids: each split has its own random stream."""


@dataclasses.dataclass(frozen=True)
class MQARConfig:
    """The shape of an MQAR task.

    **Arguments:**
    - `vocab_size`: token ids `0 … vocab_size − 1`; 0 is padding, keys take the lower half of
      the rest and values the upper half.
    - `seq_len`: tokens per sequence.
    - `num_pairs`: key–value pairs in the context; the rest of the sequence holds
      `(seq_len − 2 · num_pairs) // 2` queries.
    """

    vocab_size: int = 64
    seq_len: int = 64
    num_pairs: int = 8

    def __post_init__(self):
        if self.num_keys < self.num_pairs or self.num_values < self.num_pairs:
            raise ValueError(
                f"vocab_size={self.vocab_size} is too small for num_pairs={self.num_pairs}: "
                f"need at least {2 * self.num_pairs + 1}"
            )
        if self.num_queries < 1:
            raise ValueError(
                f"seq_len={self.seq_len} leaves no room for a query after num_pairs={self.num_pairs} pairs: "
                f"need at least {2 * self.num_pairs + 2}"
            )

    @property
    def num_keys(self) -> int:
        return (self.vocab_size - 1) // 2

    @property
    def num_values(self) -> int:
        return self.vocab_size - 1 - self.num_keys

    @property
    def num_queries(self) -> int:
        return (self.seq_len - 2 * self.num_pairs) // 2


class MQARBatch(NamedTuple):
    """A batch of MQAR sequences: `tokens`, next-token `targets`, and the scored `mask`."""

    tokens: Int[Array, "batch seq_len"]
    targets: Int[Array, "batch seq_len"]
    mask: Bool[Array, "batch seq_len"]


def split_key(seed: int, split: int) -> PRNGKeyArray:
    """The root key of a split (`TRAIN` or `HELD_OUT`) for `seed`."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), split)


def mqar_batch(key: PRNGKeyArray, batch_size: int, config: MQARConfig) -> MQARBatch:
    """`batch_size` random MQAR sequences (jit-compatible; `config` and `batch_size` are static).

    **Arguments:**
    - `key`: a PRNG key, e.g. `jax.random.fold_in(split_key(seed, TRAIN), step)`.
    - `batch_size`: number of sequences.
    - `config`: the task's shape.
    """
    tokens = jax.vmap(lambda k: _sequence(k, config))(jax.random.split(key, batch_size))
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    positions = jnp.arange(config.seq_len)
    query_offset = positions - 2 * config.num_pairs
    is_query = (query_offset >= 0) & (query_offset % 2 == 0) & (query_offset < 2 * config.num_queries)
    mask = jnp.broadcast_to(is_query, tokens.shape)
    return MQARBatch(tokens, targets, mask)


def _sequence(key: PRNGKeyArray, config: MQARConfig) -> Int[Array, " seq_len"]:
    P, Q = config.num_pairs, config.num_queries
    key_rng, value_rng, query_rng = jax.random.split(key, 3)
    keys = 1 + jax.random.permutation(key_rng, config.num_keys)[:P]  # [P] distinct keys
    values = 1 + config.num_keys + jax.random.permutation(value_rng, config.num_values)[:P]  # [P]
    asked = jax.random.choice(query_rng, P, (Q,), replace=Q > P)  # [Q] pair indices
    context = jnp.stack([keys, values], axis=1).reshape(2 * P)
    queries = jnp.stack([keys[asked], values[asked]], axis=1).reshape(2 * Q)
    padding = jnp.zeros(config.seq_len - 2 * (P + Q), jnp.int32)
    return jnp.concatenate([context, queries, padding]).astype(jnp.int32)
