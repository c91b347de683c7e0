"""Reading and writing fla checkpoints: HF layout (config.json + safetensors), fla's names.

A parameter's fla name is its path in the module tree (which mirrors fla's) plus fla's
parameter name; only the layout of some parameters differs:

| module here     | parameter      | fla (PyTorch)                 | conversion            |
|-----------------|----------------|-------------------------------|-----------------------|
| nnx.Linear      | kernel [in, out], bias | `weight [out, in]`, `bias` | transpose            |
| nnx.Embed       | embedding [V, D] | `weight [V, D]`             | rename                |
| RMSNorm         | weight [D]     | `weight [D]`                  | none                  |
| CausalConv1d    | kernel [W, C], bias | `weight [C, 1, W]`, `bias` | transpose, add axis  |
| Backbone        | lower_bounds   | `lower_bounds`                | none                  |

A family whose checkpoints hold its parameters as they are (`recurrax.nn.LanguageModel`'s)
names them by its module's `stored_params` instead; the rest (checks, saving) is the same.

`nnx.Sequential` children are numbered like PyTorch's (`gk_proj.0`, `gk_proj.1`). A
LinearAttention whose q and k share one feature map (`tie_feature_map_qk`) holds it as
`feature_map_q`; PyTorch names the shared tensors under `feature_map_k` too, so those names
are accepted (either spelling suffices) and written as aliases. A module held at several
places (Zamba2's tied shared blocks) is named, loaded and saved at its first place; the later
places' names are accepted when loading and not written, as `transformers` saves them. With
`tie_word_embeddings` the head is the embedding and `lm_head.weight` is neither written nor
required (and ignored when present), as in Hugging Face's checkpoints.

Loading checks what it reads: every tensor must be floating point (a `TypeError` naming it)
and finite (unless `allow_nonfinite=True`), a tensor may be in one shard only, and a bad
config.json or index is a `ValueError` naming the file and the field. Saving is atomic: the
files are written into a temporary directory beside the target and then moved into place,
so a failed save leaves an earlier checkpoint there intact.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from .._conv import CausalConv1d
from .._decoder import CausalDecoder
from .._model import LanguageModel
from ._config import FAMILY_MODULES, text_model_config
from ._config_checks import ConfigError, eos_token_ids, read_json
from ._hf_checkpoint import legacy_names
from ._hf_checkpoint import loaded_names as hf_loaded_names
from ._hf_checkpoint import saved_names as hf_saved_names
from ._mapped_safetensors import mapped_tensors
from ._model import Backbone, CausalLM
from ._sizes import model_from_config
from .families._linear_attn import LinearAttention
from .families._mamba2 import is_hf_config
from .layers._norm import RMSNorm

INSTALL_HINT = "reading and writing fla checkpoints needs safetensors: pip install 'recurrax[pretrained]'"
TIED_HEAD = "lm_head.weight"


class Tensor(NamedTuple):
    """One checkpoint tensor: the parameter it fills and the layout changes both ways."""

    variable: nnx.Variable
    to_fla: Callable[[np.ndarray], np.ndarray]
    from_fla: Callable[[np.ndarray], np.ndarray]
    alias: bool = False  # a second name of a shared tensor: optional when loading
    saved: bool = True  # written by state_dict (not a tied module's later places)


def _same(a):
    return a


def _module_tensors(module: nnx.Module) -> dict[str, Tensor]:
    """The checkpoint tensors a module owns directly, by fla's parameter name."""
    if hasattr(module, "checkpoint_params"):  # parameters stored as they are, e.g. Mamba-2's A_log
        return {name: Tensor(getattr(module, name), _same, _same) for name in module.checkpoint_params}
    if isinstance(module, nnx.Linear):
        found = {"weight": Tensor(module.kernel, np.transpose, np.transpose)}
        if module.bias is not None:
            found["bias"] = Tensor(module.bias, _same, _same)
        return found
    if isinstance(module, nnx.Embed):
        return {"weight": Tensor(module.embedding, _same, _same)}
    if isinstance(module, RMSNorm):
        return {} if module.weight is None else {"weight": Tensor(module.weight, _same, _same)}
    if isinstance(module, CausalConv1d):
        to_fla, from_fla = lambda k: np.transpose(k)[:, None, :], lambda w: np.transpose(w[:, 0])  # noqa: E731
        found = {"weight": Tensor(module.kernel, to_fla, from_fla)}
        if module.bias is not None:
            found["bias"] = Tensor(module.bias, _same, _same)
        return found
    if isinstance(module, Backbone) and module.lower_bounds is not None:
        return {"lower_bounds": Tensor(module.lower_bounds, _same, _same)}
    return {}


def _children(module: nnx.Module):
    """(name, child) pairs in PyTorch's naming: Sequential and List children are numbered."""
    if isinstance(module, nnx.Sequential):
        yield from ((str(i), layer) for i, layer in enumerate(module.layers))
        return
    for name, value in vars(module).items():
        if name.startswith("_"):
            continue
        if isinstance(value, nnx.List):
            yield from ((f"{name}.{i}", item) for i, item in enumerate(value) if isinstance(item, nnx.Module))
        elif isinstance(value, nnx.Module):
            yield name, value


def tensors(model: nnx.Module, prefix: str = "") -> dict[str, Tensor]:
    """Every checkpoint tensor of `model` by its full fla name (e.g. `model.layers.0.attn.q_proj.weight`)."""
    found = {prefix + name: tensor for name, tensor in _module_tensors(model).items()}
    for name, child in _children(model):
        found.update(tensors(child, f"{prefix}{name}."))
    if isinstance(model, LinearAttention) and model.tie_feature_map_qk:
        shared = tensors(model.feature_map_q, f"{prefix}feature_map_k.")
        found.update({name: tensor._replace(alias=True) for name, tensor in shared.items()})
    return _later_places_as_aliases(found)


def _later_places_as_aliases(found: dict[str, Tensor]) -> dict[str, Tensor]:
    """Tensors met again under a later name (a module held at several places) as unsaved aliases."""
    first = set()
    for name, tensor in found.items():
        if tensor.alias:
            continue
        if id(tensor.variable) in first:
            found[name] = tensor._replace(alias=True, saved=False)
        first.add(id(tensor.variable))
    return found


def checkpoint_tensors(model: CausalLM | LanguageModel) -> dict[str, Tensor]:
    """Every checkpoint tensor of `model`: its family module's `stored_params` (stored as they
    are), else `tensors`' (fla's names and layouts)."""
    family_module = FAMILY_MODULES.get(model.model_type)
    stored = getattr(family_module, "stored_params", None)
    if stored is None:
        return tensors(model)
    return {name: Tensor(variable, _same, _same) for name, variable in stored(model).items()}


def state_dict(model: CausalLM | LanguageModel) -> dict[str, np.ndarray]:
    """fla's state dict of `model`: fla's names, PyTorch layouts, the parameters' dtypes (a
    `recurrax.nn.LanguageModel`: its parameters as they are, by module path). A parameter
    sharded over several processes is gathered (every process must call this)."""
    if not isinstance(model, CausalDecoder):
        raise TypeError(f"save_pretrained and state_dict take a recurrax.nn.pretrained.CausalLM or a "
                        f"recurrax.nn.LanguageModel, got {type(model).__name__}")
    weights = {name: np.ascontiguousarray(t.to_fla(_host_value(t.variable.get_value())))
               for name, t in checkpoint_tensors(model).items() if t.saved}
    family_module = FAMILY_MODULES.get(model.model_type)
    if family_module is None:
        return hf_saved_names(model.model_type, weights)
    buffers = getattr(family_module, "saved_buffers", None)  # config-derived tensors transformers saves
    return {**family_module.saved_names(weights), **({} if buffers is None else buffers(model.config, weights))}


def _host_value(value) -> np.ndarray:
    """The whole of a parameter on this host: gathered from the other processes where it has
    shards this process does not hold (a model on a multi-host mesh)."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(value)


def load_weights(model: CausalLM | LanguageModel, weights: dict[str, np.ndarray], *,
                 allow_nonfinite: bool = False) -> CausalLM | LanguageModel:
    """Fill `model`'s parameters from fla's state dict `weights` (in place; returns `model`);
    a family module's checkpoint names are read as its `loaded_names` reads them (Qwen3-Next:
    each expert's matrices, or the fused ones), Nemotron-H's experts as `_hf_checkpoint`'s.

    Raises a `ValueError` listing missing and unexpected names, or naming a parameter whose
    shape differs (with both shapes) or that holds NaN or inf (unless `allow_nonfinite`), and
    a `TypeError` naming a tensor that is not floating point; then nothing is changed. Values
    are cast to each parameter's dtype. `model` may be abstract (`nnx.eval_shape`): every
    parameter is set.
    """
    expected = checkpoint_tensors(model)
    family_module = FAMILY_MODULES.get(model.model_type)
    given = (hf_loaded_names(model.model_type, dict(weights)) if family_module is None
             else family_module.loaded_names(weights))
    if model.lm_head is None:  # tied: the head is the embedding
        given.pop(TIED_HEAD, None)
    for name, tensor in expected.items():  # a shared tensor may come under its alias only
        primary = next(n for n, t in expected.items() if t.variable is tensor.variable and not t.alias)
        if tensor.alias and primary not in given and name in given:
            given[primary] = given[name]
    unexpected = sorted(set(given) - set(expected))
    expected = {name: tensor for name, tensor in expected.items() if not tensor.alias}
    missing = sorted(set(expected) - set(given))
    if missing or unexpected:
        lines = []
        if missing:
            lines.append(f"missing weights ({len(missing)}): {', '.join(missing)}")
        if unexpected:
            lines.append(f"unexpected weights ({len(unexpected)}): {', '.join(unexpected)}")
        raise ValueError("checkpoint does not match the model built from its config:\n" + "\n".join(lines))
    for name, tensor in checkpoint_tensors(model).items():
        if name not in given:
            continue
        want = tuple(tensor.to_fla(np.zeros(tensor.variable.get_value().shape, np.int8)).shape)
        got = tuple(np.shape(given[name]))
        if want != got:
            raise ValueError(f"shape mismatch for {name}: the model expects {list(want)}, "
                             f"the checkpoint has {list(got)}")
    for name in expected:
        _check_values(name, np.asarray(given[name]), allow_nonfinite)
    for name, tensor in expected.items():
        value = tensor.from_fla(np.asarray(given[name]))
        tensor.variable.set_value(jnp.asarray(value, dtype=tensor.variable.get_value().dtype))
    return model


def _check_values(name: str, value: np.ndarray, allow_nonfinite: bool) -> None:
    """A checkpoint tensor must be floating point and, unless allowed, finite."""
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(f"checkpoint tensor {name} has dtype {value.dtype}; the model's parameters are floating "
                        "point (an integer or bool tensor here is not a float checkpoint's)")
    if not allow_nonfinite:
        bad = int(np.size(value) - np.count_nonzero(np.isfinite(value)))
        if bad:
            raise ValueError(f"checkpoint tensor {name} holds {bad} non-finite values (NaN or inf); pass "
                             "allow_nonfinite=True to load it anyway")


def from_pretrained(path: str | os.PathLike, *, dtype=jnp.float32, param_dtype=None, allow_nonfinite: bool = False,
                    remat: str | None = None) -> CausalLM | LanguageModel:
    """Load a checkpoint directory (Hugging Face layout) of a supported family (`SUPPORTED`)
    into its family's model class: a `CausalLM` (of a multimodal Qwen3.5 checkpoint, its text
    model), or a `recurrax.nn.LanguageModel` for one `save_pretrained` wrote from a
    `LanguageModel` (its `model_type` is `recurrax_language_model`). Nothing is downloaded.

    **Arguments:**
    - `path`: a local directory with `config.json` and `model.safetensors`, or sharded
      `model.safetensors.index.json` + its shards.
    - `dtype`: computation dtype of the model.
    - `param_dtype`: its parameters' dtype (default `dtype`; weights are cast to it):
      `dtype=jnp.bfloat16, param_dtype=jnp.float32` is mixed precision (see `CausalLM`).
    - `allow_nonfinite`: load weights holding NaN or inf (refused by default).
    - `remat`: what a training step keeps of each block for the backward: None (everything),
      `"block"` (its input) or `"dots"` (its projections' outputs); see `CausalLM`.

    Errors name the file: a config.json or index that is not valid JSON, not an object, or
    holds a bad value (`ValueError`, naming the field and what it accepts); a tensor in two
    shards (`ValueError`); a tensor of integers or bools (`TypeError`).
    """
    load_file = partial(mapped_tensors, fallback=_safetensors().load_file)  # views of the file, not copies
    path = os.fspath(path)
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no config.json in {path!r} (from_pretrained reads local directories only)")
    try:
        config = text_model_config(read_json(config_path))
    except ValueError as error:
        raise type(error)(f"{config_path}: {error}") from error
    single, index = os.path.join(path, "model.safetensors"), os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        weights = load_file(single)
    elif os.path.isfile(index):
        weights = _load_shards(path, index, load_file)
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path!r}")
    try:
        hf_config = is_hf_config(config)
        model = nnx.eval_shape(lambda: model_from_config(config, dtype=dtype, param_dtype=param_dtype, remat=remat,
                                                         rngs=nnx.Rngs(0)))  # shapes only, no init
    except (ValueError, TypeError, NotImplementedError) as error:
        raise type(error)(f"{config_path}: {error}") from error
    if hf_config:
        weights = legacy_names(config, weights)
    model.eos_token_ids = _generation_eos(path, model.eos_token_ids)
    return load_weights(model, weights, allow_nonfinite=allow_nonfinite)


def _generation_eos(path: str, default: tuple[int, ...]) -> tuple[int, ...]:
    """generation_config.json's `eos_token_id` (it wins over config.json's), else `default`."""
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return default
    generation = read_json(file)
    if generation.get("eos_token_id") is None:
        return default
    try:
        return eos_token_ids(generation["eos_token_id"], "eos_token_id")
    except ValueError as error:
        raise ConfigError(f"{file}: {error}") from error


def _load_shards(path: str, index: str, load_file) -> dict[str, np.ndarray]:
    """The tensors of the shards an index's `weight_map` lists; a tensor in two shards is an error."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConfigError(f"{index}: field 'weight_map' must be an object mapping tensor names to shard files, "
                          f"got {weight_map!r:.200}")
    weights, source = {}, {}
    for shard in sorted(set(weight_map.values())):
        shard_path = os.path.join(path, shard)
        if not os.path.isfile(shard_path):
            raise FileNotFoundError(f"{index} lists shard {shard!r}, which is not in {path!r}")
        for name, value in load_file(shard_path).items():
            if name in weights:
                raise ValueError(f"checkpoint tensor {name} is in two shards, {source[name]} and {shard}")
            weights[name], source[name] = value, shard
    return weights


def save_pretrained(model: CausalLM | LanguageModel, path: str | os.PathLike) -> None:
    """Write `model` as a checkpoint: config.json (the config it was built from, with the
    saved dtype), generation_config.json (its bos/eos/pad ids) and model.safetensors (the
    family's names and PyTorch layouts, the parameters' dtypes), which fla's or `transformers`'
    own `from_pretrained` reads back. A `recurrax.nn.LanguageModel` is written with its
    constructor's arguments as config.json (`LanguageModel.config`) and its parameters as they
    are, by module path: `from_pretrained` reads it back (no other library does).

    Atomic: the files are written into a temporary directory beside `path`, then moved into
    place; a failure leaves an earlier checkpoint in `path` as it was. Files of an earlier
    save that this one replaces (a sharded index and its shards) are removed; nothing else.

    A model on a mesh is written whole, as one host's checkpoint. On several processes
    every process must call this: the parameters are gathered, process 0 writes the files,
    and all return once they are in place.
    """
    save_file = _safetensors().save_file
    weights = state_dict(model)
    if jax.process_count() > 1:
        if jax.process_index() == 0:
            _write_checkpoint(model, weights, path, save_file)
        multihost_utils.sync_global_devices(f"save_pretrained {os.path.abspath(os.fspath(path))}")
    else:
        _write_checkpoint(model, weights, path, save_file)


def _write_checkpoint(model: CausalLM, weights: dict[str, np.ndarray], path, save_file) -> None:
    """Write `weights` and `model`'s configs into `path` through a staging directory."""
    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.saving-", dir=os.path.dirname(path))
    try:
        save_file(weights, os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
        _write_json(os.path.join(staging, "config.json"), _saved_config(model.config, weights))
        _write_json(os.path.join(staging, "generation_config.json"), _generation_config(model.config))
        stale = _replaced_files(path)
        for name in SAVED_FILES:  # weights first: a config never describes weights it was not saved with
            os.replace(os.path.join(staging, name), os.path.join(path, name))
        for name in stale:
            os.remove(os.path.join(path, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


SAVED_FILES = ("model.safetensors", "config.json", "generation_config.json")
GENERATION_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _write_json(file: str, value: dict) -> None:
    with open(file, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")


def _saved_config(config: dict, weights: dict[str, np.ndarray]) -> dict:
    """`config` with the dtype the weights were saved in (`dtype`, and `torch_dtype` if present)."""
    dtypes = sorted({str(np.dtype(w.dtype)) for w in weights.values()})
    if len(dtypes) != 1:
        return config
    config = {**config, "dtype": dtypes[0]}
    if "torch_dtype" in config:
        config["torch_dtype"] = dtypes[0]
    return config


def _generation_config(config: dict) -> dict:
    """Hugging Face's generation config derived from the model config: its special token ids."""
    return {"_from_model_config": True, **{k: config[k] for k in GENERATION_IDS if config.get(k) is not None}}


def _replaced_files(path: str) -> list[str]:
    """Files of an earlier sharded save in `path`: its index and the shards it lists."""
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.isfile(index):
        return []
    try:
        with open(index) as f:
            shards = set(json.load(f).get("weight_map", {}).values())
    except (OSError, ValueError, AttributeError, TypeError):
        shards = set()
    listed = {s for s in shards if isinstance(s, str) and os.path.basename(s) == s and s not in SAVED_FILES}
    return ["model.safetensors.index.json"] + sorted(s for s in listed if os.path.isfile(os.path.join(path, s)))


def _safetensors():
    try:
        import safetensors.numpy as st
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(INSTALL_HINT) from error
    return st
