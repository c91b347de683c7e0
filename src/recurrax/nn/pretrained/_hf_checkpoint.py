"""Older parameter names of `transformers` Mamba-2 checkpoints, renamed to the ones written today.

| family     | published as                | loaded as                   |
|------------|-----------------------------|-----------------------------|
| mamba2     | `backbone.embedding.weight` | `backbone.embeddings.weight` |
| nemotron_h | `model.…` (5.x in memory)   | `backbone.…` (as saved)     |

A tensor present under both names must hold one value there.
"""

from __future__ import annotations

import numpy as np


def legacy_names(config: dict, weights: dict) -> dict:
    """`weights` with older names of `config`'s family renamed (others unchanged). A tensor
    under both names is kept once if the two are equal; different values are a `ValueError`
    naming both (which one the checkpoint means is unknown)."""
    family = config.get("model_type")
    renamed, source = {}, {}
    for name, value in weights.items():
        new = _current_name(family, name)
        if new in renamed:
            if not (np.shape(renamed[new]) == np.shape(value) and np.array_equal(renamed[new], value)):
                first, second = sorted((source[new], name))
                raise ValueError(f"checkpoint tensors {first} and {second} are two names of {new} (an older "
                                 "and the current one) with different values; keep one of them")
            name = min(name, source[new])  # the same tensor either way
        renamed[new], source[new] = value, name
    return renamed


def _current_name(family: str, name: str) -> str:
    """The name `transformers` writes today for a tensor named `name` in a `family` checkpoint."""
    if family == "mamba2" and name.startswith("backbone.embedding."):
        return "backbone.embeddings." + name[len("backbone.embedding."):]
    if family == "nemotron_h" and name.startswith("model."):
        return "backbone." + name[len("model."):]
    return name
