"""Packed sequences: segment membership and the chunk-aligned layout of the chunk algorithm."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recurrax._core import varlen


def _layout_by_hand(lengths, chunk_size):
    """The chunk-aligned layout written out with Python loops."""
    slots, chunk_seq, first, last = [], [], [], []
    token = 0
    for seq, length in enumerate(lengths):
        chunks = -(-length // chunk_size)
        base = len(chunk_seq) * chunk_size
        slots += [base + i for i in range(length)]
        for c in range(chunks):
            chunk_seq.append(seq)
            first.append(c == 0)
            last.append(c == chunks - 1)
        token += length
    return slots, chunk_seq, first, last


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=6), st.sampled_from([1, 2, 3, 4, 8]))
def test_chunk_layout_matches_loops(lengths, chunk_size):
    if sum(lengths) == 0:
        lengths = [1, *lengths]
    cu = np.cumsum([0, *lengths]).astype(np.int32)
    N, S = int(cu[-1]), len(lengths)
    layout = varlen.chunk_layout(jnp.asarray(cu), N, chunk_size)
    M = varlen.max_chunks(N, S, chunk_size)
    assert M <= -(-N // chunk_size) + S
    assert layout.slot_token.shape == (M * chunk_size,) and layout.owners.seq.shape == (M,)

    slots, chunk_seq, first, last = _layout_by_hand(lengths, chunk_size)
    used = len(chunk_seq)
    assert used <= M
    np.testing.assert_array_equal(layout.token_slot, slots)
    np.testing.assert_array_equal(layout.owners.seq[:used], chunk_seq)
    np.testing.assert_array_equal(layout.owners.first, first + [False] * (M - used))
    np.testing.assert_array_equal(layout.owners.last, last + [False] * (M - used))
    np.testing.assert_array_equal(layout.owners.empty, np.asarray(lengths) == 0)
    # every sequence starts on a chunk boundary, and the two index maps are inverse
    assert all(layout.token_slot[c] % chunk_size == 0 for c in cu[:-1][np.asarray(lengths) > 0])
    np.testing.assert_array_equal(layout.slot_token[layout.token_slot], np.arange(N))
    assert np.sum(np.asarray(layout.slot_token) < N) == N


def test_round_trip_pads_with_zeros():
    cu = jnp.asarray([0, 3, 3, 4, 11], jnp.int32)
    layout = varlen.chunk_layout(cu, 11, 4)
    x = jnp.arange(1.0, 12.0)[:, None] * jnp.ones((1, 2))
    slots = varlen.to_chunk_layout(x, layout)
    assert slots.shape == (5 * 4, 2)
    np.testing.assert_array_equal(slots[:, 0], [1, 2, 3, 0, 4, 0, 0, 0, 5, 6, 7, 8, 9, 10, 11, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(varlen.from_chunk_layout(slots, layout), x)


def test_chunk_layout_under_jit_with_extra_chunks():
    @jax.jit
    def slots_of(cu):
        layout = varlen.chunk_layout(cu, 7, 2, num_chunks=8)
        return layout.token_slot, layout.owners.first

    token_slot, first = slots_of(jnp.asarray([0, 1, 1, 7], jnp.int32))
    np.testing.assert_array_equal(token_slot, [0, 2, 3, 4, 5, 6, 7])
    np.testing.assert_array_equal(first, [True, True, False, False, False, False, False, False])
    token_slot, _ = slots_of(jnp.asarray([0, 4, 5, 7], jnp.int32))  # same program, other boundaries
    np.testing.assert_array_equal(token_slot, [0, 1, 2, 3, 4, 6, 7])


def test_too_few_chunks_is_refused():
    with pytest.raises(ValueError, match="num_chunks must be at least"):
        varlen.chunk_layout(jnp.asarray([0, 1, 2, 3], jnp.int32), 3, 4, num_chunks=2)


def test_segments():
    seg = varlen.segments(jnp.asarray([0, 2, 2, 5], jnp.int32), 5)
    np.testing.assert_array_equal(seg.seq_id, [0, 0, 2, 2, 2])
    np.testing.assert_array_equal(seg.starts, [True, False, True, False, False])
    np.testing.assert_array_equal(seg.ends, [False, True, False, False, True])
    rev = seg.reversed()
    np.testing.assert_array_equal(rev.starts, [True, False, False, True, False])
