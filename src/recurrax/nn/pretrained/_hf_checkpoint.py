"""Parameter names of `transformers` Mamba-2 checkpoints: older names renamed to the ones
written today (`legacy_names`), and Nemotron-H's per-expert matrices stacked as its MoE
layers hold them (`loaded_names`) and written per expert again (`saved_names`).

| family     | published as                | loaded as                   |
|------------|-----------------------------|-----------------------------|
| mamba2     | `backbone.embedding.weight` | `backbone.embeddings.weight` |
| nemotron_h | `model.…` (5.x in memory)   | `backbone.…` (as saved)     |

A tensor present under both names must hold one value there. Nemotron-H's experts, as saved
(`mixer.experts.{e}.up_proj.weight [F, D]`, `down_proj.weight [D, F]`) or as `transformers`
5.x holds them (`mixer.experts.up_proj [E, F, D]`, `down_proj [E, D, F]`), load as
`mixer.experts.up_proj.weight [E, F, D]`, `down_proj.weight [E, D, F]`; saving writes the former.
"""

from __future__ import annotations

import numpy as np

from .layers._mlp import per_expert, stacked_experts

STACKED_EXPERTS = ("nemotron_h",)
"""The families whose experts are stored per expert and held stacked."""


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


def loaded_names(model_type: str, weights: dict) -> dict:
    """`weights` under the module tree's names: Nemotron-H's experts stacked per projection
    (`layers._mlp.stacked_experts`); other families' unchanged."""
    return stacked_experts(weights) if model_type in STACKED_EXPERTS else weights


def saved_names(model_type: str, weights: dict) -> dict:
    """The state dict as `transformers` writes it: Nemotron-H's experts one by one."""
    return per_expert(weights) if model_type in STACKED_EXPERTS else weights
