"""fla's Gated DeltaNet family (`model_type` gated_deltanet, `recurrax.nn.pretrained.families._gated_deltanet`).

The fixtures `tests/fixtures/fla/gated_deltanet_*` (fla 0.6.0's own kernels, see MANIFEST.md
there) are checked with fla's other families in test_pretrained.py: logits and packed logits
against fla, cached decoding against the parallel forward and fla's decoding, greedy tokens
through `generate`, and the `save_pretrained` round trip (the default tier runs
`gated_deltanet_gva_negeig`; `-m ""` all three). Here, without compiling a model: configs as
published (flame's `gated_deltanet_340M.json`, which leaves most fields to fla's defaults)
build fla's parameter shapes and counts, the options fla's layer refuses or this port does not
support are refused by name at load time, and every parameter has logical axis names.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flax", reason="recurrax.nn.pretrained needs flax")

from flax import nnx  # noqa: E402

import recurrax.nn as rnn  # noqa: E402
from recurrax.nn.pretrained import CausalLM  # noqa: E402
from recurrax.nn.pretrained._checkpoint import tensors  # noqa: E402
from recurrax.nn.pretrained._config_checks import ConfigError  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "fla"
NAMES = sorted(d.name for d in FIXTURES.glob("gated_deltanet_*") if (d / "config.json").exists())
MAIN = "gated_deltanet_gva_negeig"
FLAME_340M = {
    "attn_mode": "chunk", "bos_token_id": 1, "conv_size": 4, "eos_token_id": 2, "expand_v": 2,
    "fuse_cross_entropy": True, "head_dim": 256, "hidden_act": "swish", "hidden_ratio": 4, "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": None, "model_type": "gated_deltanet", "norm_eps": 1e-06,
    "num_heads": 6, "num_hidden_layers": 21, "tie_word_embeddings": False, "use_cache": True, "use_gate": True,
    "use_short_conv": True,
}
"""fla-org/flame's configs/gated_deltanet_340M.json as published (no vocab_size, num_v_heads,
allow_neg_eigval or output_gate_activation: fla's defaults)."""


def config_of(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """fla's tensor names and shapes of the model `config` builds (abstractly: nothing allocated)."""
    model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))
    return {name: t.to_fla(np.empty(t.variable.get_value().shape, np.float32)).shape
            for name, t in tensors(model).items()}


def parameter_count(config: dict) -> int:
    """The parameters of `config`'s model, from one- and two-layer builds (every layer is alike)."""
    one, two = (sum(np.prod(s) for s in shapes({**config, "num_hidden_layers": n}).values()) for n in (1, 2))
    return one + (config["num_hidden_layers"] - 1) * (two - one)


def test_published_configs_build_fla_parameter_counts():
    """flame's 340M config has 512,272,124 parameters in fla 0.6.0; with expand_v=1 and 4 heads,
    357,781,928 (the count published for puigde/gated-deltanet-360M-15B-slimpajama, trained from
    that config so modified). The defaults fill in: 32000 tokens, 6 value heads of 512, and
    a SwiGLU width of 2816 (2/3 · 4 · 1024 rounded up to 256)."""
    assert parameter_count(FLAME_340M) == 512_272_124
    assert parameter_count({**FLAME_340M, "expand_v": 1, "num_heads": 4}) == 357_781_928
    found, layer = shapes({**FLAME_340M, "num_hidden_layers": 1}), "model.layers.0.attn."
    assert found["model.embeddings.weight"] == found["lm_head.weight"] == (32000, 1024)
    assert found[layer + "q_proj.weight"] == (1536, 1024) and found[layer + "v_proj.weight"] == (3072, 1024)
    assert found[layer + "q_conv1d.weight"] == (1536, 1, 4) and found[layer + "g_proj.weight"] == (3072, 1024)
    assert found[layer + "A_log"] == (6,) and found[layer + "o_norm.weight"] == (512,)
    assert found["model.layers.0.mlp.gate_proj.weight"] == (2816, 1024)


def test_grouped_value_heads_and_the_options_that_drop_parameters():
    """num_v_heads: a_proj, b_proj, A_log, dt_bias, v/g projections per value head; use_gate
    False drops g_proj (the norm keeps its weight); use_short_conv False drops the convolutions."""
    small = dict(model_type="gated_deltanet", vocab_size=16, hidden_size=8, num_hidden_layers=1, num_heads=2,
                 head_dim=4, expand_v=1.5, intermediate_size=8)
    grouped = shapes({**small, "num_v_heads": 6})
    layer = "model.layers.0.attn."
    assert grouped[layer + "q_proj.weight"] == (8, 8) and grouped[layer + "v_proj.weight"] == (36, 8)
    assert grouped[layer + "a_proj.weight"] == grouped[layer + "b_proj.weight"] == (6, 8)
    assert grouped[layer + "A_log"] == grouped[layer + "dt_bias"] == (6,) and grouped[layer + "o_norm.weight"] == (6,)
    bare = shapes({**small, "use_gate": False, "use_short_conv": False})
    assert {name for name in grouped if name not in bare} == {
        layer + name + ".weight" for name in ("g_proj", "q_conv1d", "k_conv1d", "v_conv1d")}


@pytest.mark.parametrize("edit, error, words", [
    (dict(num_v_heads=3), ConfigError, "'num_v_heads' must be null or a multiple of num_heads"),
    (dict(num_v_heads=1), ConfigError, "'num_v_heads' must be null or a multiple of num_heads"),
    (dict(head_dim=None), ConfigError, "'head_dim' must be a positive integer"),
    (dict(num_heads=None), ConfigError, "'num_heads' must be a positive integer"),
    (dict(expand_v=0.3), ConfigError, "'expand_v' must be a ratio making head_dim"),
    (dict(attn_mode="parallel"), ConfigError, "'attn_mode' must be 'chunk' or 'fused_recurrent'"),
    (dict(output_gate_activation="relu"), ConfigError, "'output_gate_activation' must be"),
    (dict(allow_neg_eigval="yes"), ConfigError, "'allow_neg_eigval' must be true or false"),
    (dict(use_gate=1), ConfigError, "'use_gate' must be true or false"),
    (dict(conv_size=1), ConfigError, "conv_size must be 0 .* or at least 2"),
    (dict(hidden_act="gelu"), NotImplementedError, "hidden_act"),
    (dict(attnres_block_size=4), NotImplementedError, "attnres_block_size"),
])
def test_unsupported_and_bad_options_are_refused_by_name(edit, error, words):
    with pytest.raises(error, match=words):
        CausalLM({**config_of(MAIN), **edit})


@pytest.mark.parametrize("name", NAMES)
def test_every_parameter_has_logical_axis_names(name):
    model = nnx.eval_shape(lambda: CausalLM(config_of(name), rngs=nnx.Rngs(0)))
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = variable.get_metadata()["out_sharding"]
        assert len(names) == len(variable.get_value().shape), path
        assert set(names) <= set(rnn.LOGICAL_AXES) | {None}, path
