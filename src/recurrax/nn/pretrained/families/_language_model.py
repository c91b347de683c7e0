"""`recurrax.nn.LanguageModel` as a family (`model_type` `"recurrax_language_model"`): its config
is its constructor's arguments, its mixer one of `recurrax.nn.MIXERS`, and its model class is
`LanguageModel` itself (`MODEL`; the other families' is `CausalLM`), the shared decoder
(`recurrax.nn._decoder`) with its own blocks. This module is the family's row of the table
(`.._config.FAMILIES`): `model_from_config` and `from_pretrained` build it from
`resolve(config)`, and `load_weights`, `state_dict` and `save_pretrained` read and write it by
`stored_params`, as they do every family.

    config.json = {"model_type": "recurrax_language_model", vocab_size, d_model, num_layers, num_heads,
                   mixer, mlp_ratio, mixer_options, implementation}   (LanguageModel.config)

Checkpoints hold the parameters as they are, by module path (`embed.embedding`,
`blocks.0.mixer.qkv_proj.kernel`, `blocks.0.mlp.up.kernel`, `norm.scale`): the names and
layouts `save_pretrained` has written since the first release, which no other library reads.
"""

from __future__ import annotations

from flax import nnx

from ..._model import CONFIG_MODEL_TYPE, LanguageModel
from .._config_checks import ConfigError, _check_fields, _refuse

MODEL_TYPES = (CONFIG_MODEL_TYPE,)
MULTIMODAL: dict = {}
MODEL = LanguageModel
"""The family's model class: `MODEL(**resolve(config), dtype=, param_dtype=, remat=, rngs=)`."""
ARGUMENTS = ("vocab_size", "d_model", "num_layers", "num_heads", "mixer", "mlp_ratio", "mixer_options",
             "implementation")
"""The fields of its config.json: the constructor's arguments (all of them required)."""


def resolve(config: dict) -> dict:
    """The constructor's arguments of a `recurrax_language_model` config.json, their kinds
    checked (a `ConfigError` naming the field; the constructor checks the values)."""
    missing = [k for k in ARGUMENTS if k not in config]
    if missing:
        raise ConfigError(f"a {CONFIG_MODEL_TYPE} config needs the fields {', '.join(missing)}")
    _check_fields(config, ints=("vocab_size", "d_model", "num_layers", "num_heads", "mlp_ratio"))
    if not isinstance(config["mixer"], str):
        _refuse("mixer", "a mixer's name (a string)", config["mixer"])
    if not isinstance(config["mixer_options"], dict):
        _refuse("mixer_options", "an object of the mixer's keyword arguments", config["mixer_options"])
    if config["implementation"] is not None and not isinstance(config["implementation"], str):
        _refuse("implementation", "null or an implementation's name (a string)", config["implementation"])
    return {k: config[k] for k in ARGUMENTS}


def stored_params(model: LanguageModel) -> dict[str, nnx.Variable]:
    """The checkpoint's tensors: the model's parameters as they are, by dotted module path."""
    return {".".join(map(str, path)): variable for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def loaded_names(weights: dict) -> dict:
    """A checkpoint's names are the module tree's."""
    return dict(weights)


def saved_names(weights: dict) -> dict:
    """The module tree's names are the checkpoint's."""
    return weights
