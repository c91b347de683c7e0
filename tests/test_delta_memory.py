"""Memory of packed input in the delta rule grows with the tokens, not with sequences × chunk
(issue 49): XLA's temporary bytes of the compiled forward and of jit(grad), as measured by
`memory_analysis()` (no program runs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import recurrax

H, K, V = 1, 16, 16
T, LENGTH = 1024, 16  # short sequences: 64 of 16 tokens


def _temp_bytes(implementation: str, num_tokens: int, num_seqs: int) -> tuple[int, int]:
    """(forward, jit(grad)) temporary bytes of a packed call on `num_tokens` tokens."""
    shape = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    args = (shape(num_tokens, H, K), shape(num_tokens, H, K), shape(num_tokens, H, V), shape(num_tokens, H),
            shape(num_tokens, H), jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32))

    def call(q, k, v, beta, g, cu_seqlens):
        return recurrax.delta_rule(q, k, v, beta, g=g, cu_seqlens=cu_seqlens, qk_l2norm=True,
                                   implementation=implementation)

    loss = lambda *a: sum(jnp.sum(x) for x in call(*a))  # noqa: E731
    temp = lambda fn: fn.lower(*args).compile().memory_analysis().temp_size_in_bytes  # noqa: E731
    return temp(jax.jit(call)), temp(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))))


@pytest.mark.parametrize("implementation", ["chunk", pytest.param("scan", marks=pytest.mark.slow)])
def test_many_short_sequences_cost_what_their_tokens_cost(implementation):
    """T tokens in T/16 sequences take at most what one sequence of 2T tokens takes, plus one
    [H, K, V] state per sequence (the layouts hold at most 2T token slots; each sequence has its
    own final state). Before: `chunk` padded every sequence to a chunk of 64 (4.9·T slots here:
    3350 KiB forward at T = 2048 against 1350 KiB for one sequence of 4096), `scan` reran every
    sequence's last block of 64 tokens at once (23.7 MiB of jit(grad) against 2.2 MiB)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the figures are XLA CPU's")
    packed = _temp_bytes(implementation, T, T // LENGTH)
    longer = _temp_bytes(implementation, 2 * T, 1)
    states = (T // LENGTH) * H * K * V * 4
    for name, got, bound in zip(("forward", "grad"), packed, longer):
        assert got <= bound + states, f"{name}: {got} bytes for {T // LENGTH} sequences, {bound} for one of {2 * T}"
