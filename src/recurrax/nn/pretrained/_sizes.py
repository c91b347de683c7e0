"""Named model sizes: each a config.json dict, built freshly initialised by `from_size`.

| name          | model                              | width × layers, heads | parameters (vocabulary) |
|---------------|------------------------------------|-----------------------|-------------------------|
| `tiny`        | `recurrax.nn.LanguageModel`, GLA   | 64 × 2, 2 heads       | 0.14 M (512)            |
| `small`       | `recurrax.nn.LanguageModel`, GLA   | 256 × 4, 4 heads      | 3.6 M (512)             |
| `gla-340m`    | `CausalLM`, fla's GLA              | 1024 × 24, 4 heads    | 0.34 G (32000, tied)    |
| `mamba2-130m` | `CausalLM`, `transformers`' Mamba-2 | 768 × 24, 24 heads   | 0.13 G (50280, tied)    |

`tiny` trains in seconds and `small` in minutes on a laptop's CPU; the other two are the
published shapes (fla's `gla_340M` training recipe; state-spaces/mamba2-130m) the benchmarks
measure. Any field can be overridden (`from_size("tiny", vocab_size=300, mixer="retnet")`);
`save_pretrained` writes the model and `from_pretrained` reads it back.
"""

from __future__ import annotations

import copy
import math

import jax.numpy as jnp
from flax import nnx

from .._model import CONFIG_MODEL_TYPE, MIXERS, LanguageModel
from ._config import FAMILY_MODULES
from ._model import CausalLM
from .families._language_model import ARGUMENTS as LANGUAGE_MODEL_ARGUMENTS


def _language_model(d_model: int, num_layers: int, num_heads: int) -> dict:
    return dict(model_type=CONFIG_MODEL_TYPE, architectures=["recurrax.nn.LanguageModel"], vocab_size=512,
                d_model=d_model, num_layers=num_layers, num_heads=num_heads, mixer="gla", mlp_ratio=4,
                mixer_options={}, implementation=None)


SIZES = {
    "tiny": _language_model(64, 2, 2),
    "small": _language_model(256, 4, 4),
    "gla-340m": dict(
        model_type="gla", hidden_size=1024, num_hidden_layers=24, num_heads=4, expand_k=0.5, expand_v=1,
        hidden_ratio=4, intermediate_size=None, vocab_size=32000, tie_word_embeddings=True, use_short_conv=False,
        use_output_gate=True, norm_eps=1e-6, max_position_embeddings=2048, attn=None),
    "mamba2-130m": dict(
        model_type="mamba2", architectures=["Mamba2ForCausalLM"], hidden_size=768, num_hidden_layers=24,
        num_heads=24, head_dim=64, expand=2, state_size=128, n_groups=1, conv_kernel=4, chunk_size=256,
        vocab_size=50280, tie_word_embeddings=True, use_bias=False, use_conv_bias=True, residual_in_fp32=True,
        layer_norm_epsilon=1e-5, time_step_limit=[0.0, math.inf]),
}
"""Each named size's config.json (see the module's table)."""


def size_config(name: str, **overrides) -> dict:
    """The config.json of size `name` (a key of `SIZES`) with `overrides` set (a copy).

    A `recurrax.nn.LanguageModel` size takes only its constructor's arguments
    (`LANGUAGE_MODEL_ARGUMENTS`); a `CausalLM` size any field its family reads.
    """
    if name not in SIZES:
        raise ValueError(f"unknown model size {name!r}; the sizes are {', '.join(SIZES)}")
    config = copy.deepcopy(SIZES[name])
    if config["model_type"] == CONFIG_MODEL_TYPE:
        unknown = sorted(set(overrides) - set(LANGUAGE_MODEL_ARGUMENTS))
        if unknown:
            raise ValueError(f"size {name!r} is a recurrax.nn.LanguageModel, which has no field {', '.join(unknown)} "
                             f"(its fields: {', '.join(LANGUAGE_MODEL_ARGUMENTS)})")
        if overrides.get("mixer", config["mixer"]) not in MIXERS:
            raise ValueError(f"mixer must be one of {list(MIXERS)}, got {overrides['mixer']!r}")
    return {**config, **copy.deepcopy(overrides)}


def model_from_config(config: dict, *, dtype=jnp.float32, param_dtype=None, remat: str | None = None,
                      rngs: nnx.Rngs | None = None) -> LanguageModel | CausalLM:
    """A freshly initialised model of a config.json dict, of its family's model class: a
    `CausalLM`, or the family's own (`recurrax.nn.LanguageModel` for `model_type`
    `"recurrax_language_model"`, whose fields are the constructor's arguments; a missing one
    is a `ValueError` naming it); `param_dtype` (default `dtype`) and `remat` as theirs."""
    rngs = nnx.Rngs(0) if rngs is None else rngs
    model_type = config.get("model_type") if isinstance(config, dict) else None
    family = FAMILY_MODULES.get(model_type) if isinstance(model_type, str) else None
    if not hasattr(family, "MODEL"):
        return CausalLM(config, dtype=dtype, param_dtype=param_dtype, remat=remat, rngs=rngs)
    return family.MODEL(**family.resolve(config), dtype=dtype, param_dtype=dtype if param_dtype is None else param_dtype,
                        remat=remat, rngs=rngs)


def from_size(name: str, *, dtype=jnp.float32, param_dtype=None, remat: str | None = None,
              rngs: nnx.Rngs | None = None, **overrides) -> LanguageModel | CausalLM:
    """A freshly initialised model of size `name` (a key of `SIZES`; see the module's table),
    with `overrides` of its config (e.g. `vocab_size`, a LanguageModel's `mixer`).

    **Arguments:**
    - `name`: `"tiny"`, `"small"`, `"gla-340m"` or `"mamba2-130m"`.
    - `dtype`: computation dtype; `param_dtype`: the parameters' (default `dtype`; float32
      with a bfloat16 `dtype` is mixed precision); `rngs`: initialisation (default seed 0).
    - `remat`: what a training step keeps of each block for the backward (as `LanguageModel`'s).
    - `overrides`: config fields to change (`size_config`).
    """
    return model_from_config(size_config(name, **overrides), dtype=dtype, param_dtype=param_dtype, remat=remat,
                             rngs=rngs)
