"""`recurrax.nn.LanguageModel` is a family of the one decoder (issue 48): registered in the family
table, built and loaded through the same path as every family, with the families' cache type,
and reading the checkpoints the release wrote (`tests/fixtures/language_model/`, made by
`make_fixture.py` with the code of commit 0189a48)."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from recurrax.nn import LanguageModel, MixerCache
from recurrax.nn.pretrained import SUPPORTED, CausalLM, ModelCache, from_pretrained, model_from_config, save_pretrained
from recurrax.nn.pretrained._config import FAMILIES, FAMILY_MODULES

FIXTURES = Path(__file__).parent / "fixtures" / "language_model"
TOKENS = np.array([[1, 5, 9, 2, 14], [3, 3, 0, 15, 7]], np.int32)  # make_fixture.TOKENS


@pytest.mark.parametrize("mixer", ["gla", "gated_deltanet"])
def test_a_checkpoint_the_release_saved_loads_with_its_logits_and_names(mixer, tmp_path):
    """0189a48's checkpoint loads into a LanguageModel whose float64 logits are the ones 0189a48
    computed from it, within the float64 rounding floor (float32's error against float64,
    measured here, scaled by the ratio of the two epsilons); saved again, its tensors are the
    file's, name for name and bit for bit."""
    directory = FIXTURES / mixer
    want = np.load(directory / "logits.npy")
    model = from_pretrained(directory, dtype=jnp.float64)
    assert type(model) is LanguageModel and model.config["mixer"] == mixer
    got = np.asarray(model(jnp.asarray(TOKENS)))
    float32 = np.asarray(from_pretrained(directory)(jnp.asarray(TOKENS)), np.float64)
    floor = np.abs(float32 - got).max() * np.finfo(np.float64).eps / np.finfo(np.float32).eps
    assert 0 < floor < 1e-12
    np.testing.assert_allclose(got, want, rtol=0, atol=16 * floor)

    from safetensors.numpy import load_file

    save_pretrained(from_pretrained(directory), tmp_path)
    saved, release = load_file(tmp_path / "model.safetensors"), load_file(directory / "model.safetensors")
    assert sorted(saved) == sorted(release) and "blocks.1.mlp.up.kernel" in saved and "norm.scale" in saved
    assert all(np.array_equal(saved[name], release[name]) for name in release)


def test_the_language_model_is_a_family_of_the_table_whose_model_class_is_its_own():
    config = LanguageModel(16, 8, 1, 2, rngs=nnx.Rngs(0)).config
    family = FAMILY_MODULES[config["model_type"]]
    assert family in FAMILIES and family.MODEL is LanguageModel
    model = model_from_config(config, dtype=jnp.float64, rngs=nnx.Rngs(3))
    assert type(model) is LanguageModel and model.config == config and model.embed.embedding.dtype == jnp.float64
    assert config["model_type"] not in SUPPORTED  # CausalLM's model_types
    with pytest.raises(ValueError, match="builds a LanguageModel, not a CausalLM: build it with .*model_from_config"):
        CausalLM(config)
    with pytest.raises(ValueError, match="needs the fields num_heads"):
        model_from_config({k: v for k, v in config.items() if k != "num_heads"})


def test_its_cache_is_the_families_model_cache_through_prefill_and_decode_step():
    """init_cache, prefill and decode_step give `ModelCache`s (one MixerCache per block, each
    row's position), as a CausalLM's; the decode step's logits are the parallel forward's."""
    model = LanguageModel(16, 8, 2, 2, mlp_ratio=2, dtype=jnp.float64, param_dtype=jnp.float64, rngs=nnx.Rngs(2))
    cache = model.init_cache(2, jnp.float64)
    assert type(cache) is ModelCache and np.array_equal(cache.positions, [0, 0])
    assert type(model.generation_cache(2)) is ModelCache
    assert type(CausalLM(dict(model_type="gla", vocab_size=16, hidden_size=16, num_hidden_layers=1, num_heads=2),
                         rngs=nnx.Rngs(0)).init_cache(2)) is ModelCache
    prompts = jnp.asarray([1, 2, 3, 4, 5], jnp.int32)
    _, cache = model.prefill(prompts, jnp.asarray([0, 3, 5], jnp.int32), cache)
    assert np.array_equal(cache.positions, [3, 2]) and all(isinstance(c, MixerCache) for c in cache.layers)
    step, cache = model.decode_step(jnp.asarray([6, 7], jnp.int32), cache)
    assert np.array_equal(cache.positions, [4, 3])
    whole = [model(jnp.asarray([[1, 2, 3, 6]]))[0, -1], model(jnp.asarray([[4, 5, 7]]))[0, -1]]
    scale = float(jnp.abs(jnp.stack(whole)).max())
    np.testing.assert_allclose(step, jnp.stack(whole), rtol=0, atol=1e-12 * scale)
