"""Token ids are checked against the vocabulary before they index an embedding.

An id outside `[0, vocab)` would read a clamped or NaN row silently (`−1` means the last
row, `vocab` gives NaN logits everywhere). Concrete ids are checked at once; traced ids only
inside `recurrax.runtime_checks()`, with `checkify`, as gates are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .._core.problem import runtime_checks_enabled


def check_token_ids(tokens, vocab_size: int, name: str = "tokens") -> None:
    """Raise a `ValueError` naming the first id of `tokens` outside `[0, vocab_size)` and its position.

    **Arguments:** `tokens`: an integer array (concrete or traced); `vocab_size`: the
    embedding's rows; `name`: the argument's name in the message.
    """
    if isinstance(tokens, jax.core.Tracer):
        if runtime_checks_enabled():
            from jax.experimental import checkify

            flat = tokens.reshape(-1)
            bad = (flat < 0) | (flat >= vocab_size)
            first = jnp.argmax(bad)
            checkify.check(~jnp.any(bad), f"{name} must be token ids in [0, {vocab_size}) (the vocabulary size), "
                           "got {} at flat position {}", flat[first], first)
        return
    values = np.asarray(tokens)
    bad = (values < 0) | (values >= vocab_size)
    if bad.any():
        position = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name} must be token ids in [0, {vocab_size}) (the vocabulary size), got "
                         f"{int(values[position])} at position {position}")
