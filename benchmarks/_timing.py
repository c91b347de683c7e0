"""The benchmark scripts' timers: calls each waited for (`timed`), and calls back to back (`back_to_back`)."""

from __future__ import annotations

import time

import jax


def timed(fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of `fn` after one untimed warm-up call; each call's
    result is waited for (`jax.block_until_ready`)."""
    jax.block_until_ready(fn())
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append(time.perf_counter() - start)
    return samples


def back_to_back(fn, calls: int = 20, rounds: int = 3) -> float:
    """Seconds per call with `calls` calls dispatched before waiting for them, the best of
    `rounds` rounds: the chip's time per call when the host dispatches ahead of it, as in a
    training loop (a call waited for alone adds a host round trip, about 0.5 ms on a TPU v5e VM)."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready([fn() for _ in range(calls)])
        best = min(best, (time.perf_counter() - start) / calls)
    return best
