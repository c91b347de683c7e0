"""Packed variable-length input: where each sequence starts and ends in the token axis.

Notation: N packed tokens, S sequences, `cu_seqlens` [S + 1] with sequence s occupying
tokens `cu_seqlens[s] : cu_seqlens[s + 1]` (possibly empty). Everything here works on a
traced `cu_seqlens`: S comes from its static shape, never from its values.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


class Segments(NamedTuple):
    """Per-token sequence membership, in the original token order.

    **Arguments:**
    - `seq_id`: [N] the sequence each token belongs to (empty sequences own no token).
    - `starts`: [N] whether the token is its sequence's first.
    - `ends`: [N] whether the token is its sequence's last.
    """

    seq_id: Int[Array, " N"]
    starts: Bool[Array, " N"]
    ends: Bool[Array, " N"]

    def reversed(self) -> Segments:
        """The same segments read from the last token to the first."""
        return Segments(self.seq_id[::-1], self.ends[::-1], self.starts[::-1])


def segments(cu_seqlens: Int[Array, " S_plus_1"], num_tokens: int) -> Segments:
    """Sequence membership of every token of a packed batch."""
    tokens = jnp.arange(num_tokens, dtype=cu_seqlens.dtype)
    seq_id = jnp.searchsorted(cu_seqlens[1:], tokens, side="right").astype(jnp.int32)
    starts = tokens == cu_seqlens[seq_id]
    ends = tokens == cu_seqlens[seq_id + 1] - 1
    return Segments(seq_id, starts, ends)


def single_segment(num_tokens: int) -> Segments:
    """The segments of one dense sequence of `num_tokens` tokens."""
    tokens = jnp.arange(num_tokens)
    return Segments(jnp.zeros(num_tokens, jnp.int32), tokens == 0, tokens == num_tokens - 1)
