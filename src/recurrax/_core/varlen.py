"""Packed variable-length input: where each sequence starts and ends in the token axis.

Notation: N packed tokens, S sequences, `cu_seqlens` [S + 1] with sequence s occupying
tokens `cu_seqlens[s] : cu_seqlens[s + 1]` (possibly empty). Everything here works on a
traced `cu_seqlens`: S comes from its static shape, never from its values. `pad_tokens` is
the dense rows' counterpart of the chunk-aligned layout (a row padded to whole chunks).
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
    cu_seqlens = jnp.asarray(cu_seqlens)
    tokens = jnp.arange(num_tokens, dtype=cu_seqlens.dtype)
    seq_id = jnp.searchsorted(cu_seqlens[1:], tokens, side="right").astype(jnp.int32)
    starts = tokens == cu_seqlens[seq_id]
    ends = tokens == cu_seqlens[seq_id + 1] - 1
    return Segments(seq_id, starts, ends)


def single_segment(num_tokens: int) -> Segments:
    """The segments of one dense sequence of `num_tokens` tokens."""
    tokens = jnp.arange(num_tokens)
    return Segments(jnp.zeros(num_tokens, jnp.int32), tokens == 0, tokens == num_tokens - 1)


# ----------------------------------------------------------------------------- chunk-aligned layout
#
# The chunk algorithm wants every sequence to start on a chunk boundary. Sequence s of length
# L_s then occupies ceil(L_s / C) whole chunks, its tokens left-aligned and the rest of its
# last chunk padding. Since ceil(L / C) <= (L + C - 1) / C, the total over S sequences is at
# most floor((N + S·(C - 1)) / C) <= ceil(N / C) + S: a static number of chunks M however the
# tokens are split, so the layout has the static shape [M·C] even for a traced cu_seqlens.


class ChunkOwners(NamedTuple):
    """Which sequence owns each chunk of the aligned layout, and where it opens and closes.

    **Arguments:**
    - `seq`: [M] the sequence owning each chunk (unused trailing chunks: the last one).
    - `first`, `last`: [M] whether the chunk is its sequence's first / last (in token order).
    - `empty`: [S] whether the sequence has no tokens (it owns no chunk; its final state is
      its initial state).
    """

    seq: Int[Array, " M"]
    first: Bool[Array, " M"]
    last: Bool[Array, " M"]
    empty: Bool[Array, " S"]

    def table(self) -> Int[Array, "3 M"]:
        """`seq`, `first`, `last` stacked as one int32 table: the form kernels read."""
        return jnp.stack([self.seq, self.first, self.last]).astype(jnp.int32)


class ChunkLayout(NamedTuple):
    """Where packed tokens sit when every sequence starts on a chunk boundary.

    **Arguments:**
    - `token_slot`: [N] the slot (in the padded axis of M·C slots) of every packed token.
    - `slot_token`: [M·C] the packed token in every slot, or N for padding.
    - `owners`: the `ChunkOwners` of the M chunks.
    """

    token_slot: Int[Array, " N"]
    slot_token: Int[Array, " M_times_C"]
    owners: ChunkOwners


def max_chunks(num_tokens: int, num_seqs: int, chunk_size: int) -> int:
    """The static chunk count M of the aligned layout: floor((N + S·(C−1)) / C) <= ceil(N/C) + S."""
    return max(1, (num_tokens + num_seqs * (chunk_size - 1)) // chunk_size)


def chunk_layout(
    cu_seqlens: Int[Array, " S_plus_1"], num_tokens: int, chunk_size: int, num_chunks: int | None = None
) -> ChunkLayout:
    """The chunk-aligned layout of a packed batch (works on a traced `cu_seqlens`).

    **Arguments:**
    - `cu_seqlens`: [S + 1] sequence boundaries; `num_tokens`: N; `chunk_size`: C.
    - `num_chunks`: M, at least `max_chunks(N, S, C)` (the default); extra chunks are unused.
    """
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    num_seqs = cu.shape[0] - 1
    needed = max_chunks(num_tokens, num_seqs, chunk_size)
    num_chunks = needed if num_chunks is None else num_chunks
    if num_chunks < needed:
        raise ValueError(f"num_chunks must be at least {needed} for {num_tokens} tokens in {num_seqs} sequences")
    lengths = cu[1:] - cu[:-1]
    seq_chunks = (lengths + chunk_size - 1) // chunk_size  # [S]
    chunk_end = jnp.cumsum(seq_chunks)  # [S] one past each sequence's last chunk
    chunk_start = chunk_end - seq_chunks

    seg = segments(cu, num_tokens)
    token_slot = chunk_start[seg.seq_id] * chunk_size + jnp.arange(num_tokens, dtype=jnp.int32) - cu[seg.seq_id]

    chunks = jnp.arange(num_chunks, dtype=jnp.int32)
    used = chunks < chunk_end[-1]
    chunk_seq = jnp.minimum(jnp.searchsorted(chunk_end, chunks, side="right"), num_seqs - 1).astype(jnp.int32)
    chunk_first = used & (chunks == chunk_start[chunk_seq])
    chunk_last = used & (chunks == chunk_end[chunk_seq] - 1)

    slot_token = jnp.full((num_chunks * chunk_size,), num_tokens, jnp.int32).at[token_slot].set(
        jnp.arange(num_tokens, dtype=jnp.int32)
    )
    return ChunkLayout(token_slot, slot_token, ChunkOwners(chunk_seq, chunk_first, chunk_last, lengths == 0))


def to_chunk_layout(x: Array, layout: ChunkLayout) -> Array:
    """[N, ...] packed tokens -> [M·C, ...] aligned slots, padding slots zero."""
    return jnp.take(x, layout.slot_token, axis=0, mode="fill", fill_value=0)


def from_chunk_layout(y: Array, layout: ChunkLayout) -> Array:
    """[M·C, ...] aligned slots -> [N, ...] packed tokens."""
    return jnp.take(y, layout.token_slot, axis=0)


def pad_tokens(x: Array | None, length: int) -> Array | None:
    """Dense rows [B, T, ...] zero-padded along the token axis to `length` (None stays None):
    how the chunked algorithms fill the last chunk of a row when T is not a multiple of it."""
    if x is None or x.shape[1] == length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, length - x.shape[1])
    return jnp.pad(x, widths)
