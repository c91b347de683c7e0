"""One timer for the benchmark scripts: warm up (compile) once, then time `repeats` calls."""

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
