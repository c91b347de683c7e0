"""Mixed precision (float32 parameters, bfloat16 compute) on `LanguageModel` and `CausalLM`.

Each case builds a model in float32 and the same model with `dtype=bfloat16,
param_dtype=float32` and the same parameters, and checks: the mixed model's parameters and
gradients are float32 (and finite); its forward is within `floor_tolerance` of the float32
model's, the floor being the error bfloat16 rounding makes measured in the test (the float32
model run on its parameters rounded to bfloat16); its logits are float32; token-by-token
decoding equals its parallel forward within `floor_tolerance` of the mixed forward's own
error; its recurrent states (the caches' `state` and `normalizer`) are float32. A `CausalLM`'s
mixed forward is exactly the model built in bfloat16 on the rounded parameters.

Cases: a gated-delta-rule `LanguageModel` and Mamba-2 (`-m slow`: fla's GLA, Qwen3-Next with
routed experts and the gated delta rule, a GLA `LanguageModel` and Bamba); the exactness
check runs on Qwen3-Next. tests/test_tools_demo.py's slow tests train `recurrax demo
--dtype bfloat16` briefly.

Error metric: max |ours − reference| / max |reference|.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("flax", reason="recurrax.nn needs flax")
pytest.importorskip("safetensors", reason="checkpoints need safetensors (pip install 'recurrax[pretrained]')")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _cases import by_tier, floor_tolerance, max_rel_error  # noqa: E402
from flax import nnx  # noqa: E402

from recurrax.nn import LanguageModel  # noqa: E402
from recurrax.nn.pretrained import CausalLM  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
CONFIGS = {"gla": FIXTURES / "fla" / "gla_basic",
           "qwen3_next_moe": FIXTURES / "transformers" / "qwen3_next_moe_grouped",
           "mamba2": FIXTURES / "transformers" / "mamba2_basic",
           "bamba": FIXTURES / "transformers" / "bamba_basic"}
LANGUAGE_MODELS = {"lm_gated_deltanet": "gated_deltanet", "lm_gla": "gla"}
"""`LanguageModel` cases: their mixer."""
SEQ_LEN = 6
WIDE_STATES = ("state", "normalizer")
"""Cache fields that hold recurrent state: float32 in a bfloat16-compute model."""


def rounded(tree, dtype=jnp.bfloat16):
    """`tree`'s floating leaves rounded to `dtype` and cast back."""
    return jax.tree.map(lambda x: x.astype(dtype).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        tree)


def models(name: str):
    """(float32 model, the mixed model with its parameters, vocab size)."""
    if name in LANGUAGE_MODELS:
        kwargs = dict(vocab_size=32, d_model=32, num_layers=2, num_heads=2, mixer=LANGUAGE_MODELS[name])
        make = lambda **types: LanguageModel(**kwargs, **types, rngs=nnx.Rngs(0))  # noqa: E731
        vocab = 32
    else:
        config = json.loads((CONFIGS[name] / "config.json").read_text())
        make = lambda **types: CausalLM(config, **types, rngs=nnx.Rngs(0))  # noqa: E731
        vocab = config["vocab_size"]
    full, mixed = make(), make(dtype=jnp.bfloat16, param_dtype=jnp.float32)
    nnx.update(mixed, nnx.state(full, nnx.Param))
    return full, mixed, vocab


def cache_of(model, rows: int):
    return model.init_cache(rows, SEQ_LEN) if isinstance(model, CausalLM) else model.init_cache(rows)


def decoded(model, tokens):
    """Logits of `tokens` fed one at a time through the cache, and the last cache."""
    graphdef, state = nnx.split(model)
    step = jax.jit(lambda state, token, cache: nnx.merge(graphdef, state)(token, cache))
    cache, pieces = cache_of(model, tokens.shape[0]), []
    for t in range(tokens.shape[1]):
        logits, cache = step(state, tokens[:, t:t + 1], cache)
        pieces.append(logits)
    return jnp.concatenate(pieces, axis=1), cache


def forward(model, tokens):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda state: nnx.merge(graphdef, state)(tokens))(state)


@pytest.mark.parametrize("name", by_tier((*LANGUAGE_MODELS, *CONFIGS), fast=("lm_gated_deltanet", "mamba2")))
def test_bfloat16_compute_float32_parameters(name):
    full, mixed, vocab = models(name)
    tokens = jax.random.randint(jax.random.key(1), (2, SEQ_LEN), 0, vocab)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(mixed, nnx.Param))} == {jnp.dtype(jnp.float32)}

    reference = forward(full, tokens)
    floor = max_rel_error(forward(_with_params(full, rounded(nnx.state(full, nnx.Param))), tokens), reference)
    ours = forward(mixed, tokens)
    assert ours.dtype == jnp.float32
    error = max_rel_error(ours, reference)
    assert 0 < error <= floor_tolerance(floor), (error, floor)

    steps, cache = decoded(mixed, tokens)
    assert max_rel_error(steps, ours) <= floor_tolerance(error), (max_rel_error(steps, ours), error)
    states = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(cache)
              if getattr(path[-1], "name", None) in WIDE_STATES]
    assert states and {leaf.dtype for leaf in states} == {jnp.dtype(jnp.float32)}

    loss = lambda model: model.token_losses(tokens[:, :-1], tokens[:, 1:]).mean()  # noqa: E731
    grads = jax.tree.leaves(nnx.grad(loss)(mixed))
    assert {g.dtype for g in grads} == {jnp.dtype(jnp.float32)}
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads) and any(bool(jnp.any(g != 0)) for g in grads)


def _with_params(model, params):
    """A copy of `model` holding `params`."""
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    return nnx.merge(graphdef, params, rest)


def test_causal_lm_computes_as_the_model_built_in_bfloat16():
    """Qwen3-Next's mixed forward is the bfloat16 model's on the parameters rounded to bfloat16."""
    _, mixed, vocab = models("qwen3_next_moe")
    config = json.loads((CONFIGS["qwen3_next_moe"] / "config.json").read_text())
    half = CausalLM(config, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    nnx.update(half, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(mixed, nnx.Param)))
    tokens = jax.random.randint(jax.random.key(2), (2, SEQ_LEN), 0, vocab)
    np.testing.assert_array_equal(forward(mixed, tokens), forward(half, tokens))


def test_mamba2_bfloat16_model_runs_its_recurrence_on_bfloat16_operands(monkeypatch):
    """The mixed Mamba-2 hands `recurrent` q, k, v in bfloat16 (a float32 recurrence there runs
    the float32-exact product on a TPU, several MXU passes), and its float32 model float32."""
    from recurrax.nn.pretrained.layers import _mixer

    seen = []
    original = _mixer.recurrent_on_mesh

    def recording(q, k, v, **rest):
        seen.append((q.dtype, k.dtype, v.dtype))
        return original(q, k, v, **rest)

    monkeypatch.setattr(_mixer, "recurrent_on_mesh", recording)
    full, mixed, vocab = models("mamba2")
    tokens = jax.random.randint(jax.random.key(1), (2, SEQ_LEN), 0, vocab)
    for model, dtype in ((mixed, jnp.bfloat16), (full, jnp.float32)):
        seen.clear()
        model(tokens)
        assert seen and set(seen) == {(jnp.dtype(dtype),) * 3}, seen
