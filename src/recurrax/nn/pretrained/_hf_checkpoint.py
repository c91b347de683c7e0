"""Older parameter names of `transformers` Mamba-2 checkpoints, renamed to the ones written today.

| family     | published as                | loaded as                   |
|------------|-----------------------------|-----------------------------|
| mamba2     | `backbone.embedding.weight` | `backbone.embeddings.weight` |
| nemotron_h | `model.…` (5.x in memory)   | `backbone.…` (as saved)     |
"""

from __future__ import annotations


def legacy_names(config: dict, weights: dict) -> dict:
    """`weights` with older names of `config`'s family renamed (others unchanged)."""
    family = config.get("model_type")
    renamed = {}
    for name, value in weights.items():
        if family == "mamba2" and name.startswith("backbone.embedding."):
            name = "backbone.embeddings." + name[len("backbone.embedding."):]
        elif family == "nemotron_h" and name.startswith("model."):
            name = "backbone." + name[len("model."):]
        renamed[name] = value
    return renamed
