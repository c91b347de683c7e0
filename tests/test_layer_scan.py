"""Scan over layers (recurrax.nn._layer_scan): a stack of identical blocks, or of identical groups
of blocks in a hybrid, runs under one `jax.lax.scan`, with the unrolled stack's loss and gradients.

Error metric: per parameter, max |scanned − unrolled| / max |unrolled| (float32 both), held to
`floor_tolerance` of the unrolled float32 gradients' error against the float64 model's (same
parameters cast up); the loss likewise. Models: `LanguageModel` with GLA and with Gated DeltaNet
(4 layers: period 1), and a Qwen3.5-shaped `CausalLM` of 8 layers (three Gated DeltaNet layers,
then full attention: period 4). The structural test counts the training step's jaxpr equations
(scan bodies included, `_cases.equations`) for 2 and 8 layers: scanned, the 6 more layers add at
most a few equations per parameter array (the stacking and the gradients' unstacking), not the
6 more block bodies the unrolled stack adds. With decode caches, a prefill scans (its logits,
caches and the decode step after it against the unrolled stack's, floor from the float64
model) and a decode step of one token a row does not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("flax", reason="recurrax.nn needs flax")
pytest.importorskip("safetensors", reason="checkpoints need safetensors (pip install 'recurrax[pretrained]')")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from _cases import compile_once_quickly, equations, float64, floor_tolerance, max_rel_error  # noqa: E402

from recurrax.nn import LanguageModel, call_blocks, scan_period  # noqa: E402
from recurrax.nn.pretrained import CausalLM, from_pretrained, save_pretrained  # noqa: E402

QWEN3_5 = Path(__file__).parent / "fixtures" / "transformers" / "qwen3_5_text_dense_tied" / "config.json"
SEQ_LEN = 12


def language_model(mixer: str, num_layers: int = 4, dtype=jnp.float32, remat="block") -> LanguageModel:
    options = {"conv_size": 2} if mixer == "gla" else None
    return LanguageModel(23, 16, num_layers, 2, mixer=mixer, mixer_options=options, dtype=dtype, param_dtype=dtype,
                         remat=remat, rngs=nnx.Rngs(0))


def hybrid(dtype=jnp.float32, remat="block") -> CausalLM:
    """A tiny Qwen3.5 of 8 layers: Gated DeltaNet ×3 then full attention, twice."""
    config = json.loads(QWEN3_5.read_text())
    config.update(num_hidden_layers=8, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)
    return CausalLM(config, dtype=dtype, remat=remat, rngs=nnx.Rngs(0))


BUILDERS = {"gla": lambda **kw: language_model("gla", **kw),
            "gated_deltanet": lambda **kw: language_model("gated_deltanet", **kw),
            "qwen3_5_hybrid": hybrid}
PERIODS = {"gla": 1, "gated_deltanet": 1, "qwen3_5_hybrid": 4}


def loss_and_gradients(model, params, tokens, quickly: bool = False):
    """The mean next-token loss (`token_losses`) and its gradients at `params`, compiled."""
    graphdef = nnx.split(model)[0]

    def loss(params):
        return nnx.merge(graphdef, params).token_losses(tokens[:, :-1], tokens[:, 1:]).mean()

    step = jax.jit(jax.value_and_grad(loss))
    return (compile_once_quickly(step, params) if quickly else step)(params)


def errors(got, want) -> tuple[float, float]:
    """The loss's and the worst parameter gradient's relative error."""
    (loss, grads), (want_loss, want_grads) = got, want
    worst = max(max_rel_error(g, w) for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)))
    return max_rel_error(loss, want_loss), worst


def layers_of(model):
    return model.blocks if isinstance(model, LanguageModel) else model.body.layers


@pytest.mark.parametrize("name", list(BUILDERS))
def test_scanned_equals_unrolled(name):
    model = BUILDERS[name]()
    assert model.scan_layers and scan_period(layers_of(model)) == PERIODS[name]
    params = nnx.split(model)[1]
    tokens = jax.random.randint(jax.random.key(1), (2, SEQ_LEN + 1), 0, model.vocab_size)
    scanned = loss_and_gradients(model, params, tokens)
    model.scan_layers = False
    unrolled = loss_and_gradients(model, params, tokens)
    exact_model = BUILDERS[name](dtype=jnp.float64)
    exact_model.scan_layers = False
    floors = errors(unrolled, loss_and_gradients(exact_model, float64(params), tokens, quickly=True))
    got = errors(scanned, unrolled)
    for what, error, floor in zip(("loss", "gradient"), got, floors):
        assert error <= floor_tolerance(floor), f"{name}: {what} error {error:.3g}, floor {floor:.3g}"


def step_equations(model, tokens) -> int:
    """Equations of the training step's jaxpr, the bodies of scans and custom VJPs included."""
    graphdef, params = nnx.split(model)

    def loss(params):
        return nnx.merge(graphdef, params).token_losses(tokens[:, :-1], tokens[:, 1:]).mean()

    return sum(1 for _ in equations(jax.make_jaxpr(jax.value_and_grad(loss))(params).jaxpr))


def test_compiled_size_does_not_grow_with_depth():
    """From 2 to 8 GLA layers the scanned step gains at most 4 equations per added parameter
    array (stack, unstack of its gradient and their reshapes); the unrolled one gains 6 blocks."""
    tokens = jnp.zeros((1, SEQ_LEN + 1), jnp.int32)
    counts = {}
    for scan in (True, False):
        for num_layers in (2, 8):
            model = language_model("gla", num_layers)
            model.scan_layers = scan
            counts[scan, num_layers] = step_equations(model, tokens)
    arrays_per_block = len(jax.tree.leaves(nnx.state(language_model("gla", 1).blocks[0])))
    scanned_growth = counts[True, 8] - counts[True, 2]
    unrolled_growth = counts[False, 8] - counts[False, 2]
    assert scanned_growth <= 4 * arrays_per_block * 6, counts
    assert unrolled_growth >= 3 * counts[True, 2] // 2, counts  # the unrolled step grows by blocks


def test_unrolled_checkpoint_runs_scanned(tmp_path):
    """A checkpoint written from an unrolled model loads (same parameter names) and runs scanned
    with the unrolled model's losses."""
    model = language_model("gated_deltanet")
    model.scan_layers = False
    save_pretrained(model, tmp_path)
    loaded = from_pretrained(tmp_path)
    assert loaded.scan_layers and scan_period(loaded.blocks) == 1
    assert {path for path, _ in nnx.to_flat_state(nnx.state(loaded))} == \
        {path for path, _ in nnx.to_flat_state(nnx.state(model))}
    tokens = jax.random.randint(jax.random.key(3), (2, SEQ_LEN + 1), 0, model.vocab_size)
    want = model.token_losses(tokens[:, :-1], tokens[:, 1:])
    exact = language_model("gated_deltanet", dtype=jnp.float64)
    nnx.update(exact, float64(nnx.state(model)))
    exact.scan_layers = False
    floor = max_rel_error(want, exact.token_losses(tokens[:, :-1], tokens[:, 1:]))
    got = loaded.token_losses(tokens[:, :-1], tokens[:, 1:])
    assert max_rel_error(got, want) <= floor_tolerance(floor)


def prefill_and_step(model, tokens, cu_seqlens):
    """Packed prompts prefilled into a 2-row cache, then one decode step of both rows: the
    prefill's logits and the step's, and the caches after each."""
    prefill_logits, cache = jax.jit(lambda t, c: model.prefill(t, cu_seqlens, c))(tokens, model.generation_cache(2, 16))
    step_logits, stepped = jax.jit(model.decode_step)(jnp.asarray([3, 5], jnp.int32), cache)
    return prefill_logits, cache, step_logits, stepped


@pytest.mark.parametrize("name", ["gla", "qwen3_5_hybrid"])
def test_a_cached_prefill_scans_and_equals_unrolled(name):
    """With caches, a prefill (more than one token a row) scans over the layers, and its logits
    and caches, and the decode step after it, are the unrolled stack's up to float rounding
    (floor: the unrolled float32 model against the float64 one)."""
    model = BUILDERS[name](remat=None)
    tokens = jax.random.randint(jax.random.key(4), (9,), 0, model.vocab_size)
    cu_seqlens = jnp.asarray([0, 5, 9], jnp.int32)
    caches = model.generation_cache(2, 16).layers
    assert scan_period(layers_of(model), None, caches) == PERIODS[name]
    scanned = prefill_and_step(model, tokens, cu_seqlens)
    model.scan_layers = False
    unrolled = prefill_and_step(model, tokens, cu_seqlens)
    exact = BUILDERS[name](dtype=jnp.float64, remat=None)
    nnx.update(exact, float64(nnx.state(model)))
    exact.scan_layers = False
    want = prefill_and_step(exact, tokens, cu_seqlens)
    for got, ref, exact_ref in zip(jax.tree.leaves(scanned), jax.tree.leaves(unrolled), jax.tree.leaves(want)):
        if jnp.issubdtype(ref.dtype, jnp.floating):
            assert max_rel_error(got, ref) <= floor_tolerance(max_rel_error(ref, exact_ref))
        else:
            assert (got == ref).all()


def test_a_cached_prefill_does_not_grow_with_depth_and_a_decode_step_does():
    """From 2 to 8 GLA layers the prefill's program gains a few equations per added parameter
    and cache array (their stacking); the decode step (one token a row) runs the blocks one by
    one, so it gains the 6 block bodies."""
    def count(num_layers, tokens):
        model = language_model("gla", num_layers, remat=None)
        cache = model.generation_cache(1, 16)
        return sum(1 for _ in equations(jax.make_jaxpr(lambda t, c: model(t, c))(tokens, cache).jaxpr))

    one_block = language_model("gla", 1, remat=None)
    arrays_per_block = len(jax.tree.leaves(nnx.state(one_block.blocks[0])))
    arrays_per_block += len(jax.tree.leaves(one_block.generation_cache(1, 16).layers[0]))
    prompt, token = jnp.zeros((1, 6), jnp.int32), jnp.zeros((1, 1), jnp.int32)
    assert count(8, prompt) - count(2, prompt) <= 4 * arrays_per_block * 6
    assert count(8, token) - count(2, token) >= 3 * count(2, token) // 2


def test_no_period_runs_unrolled():
    """Lightning Attention's decays differ per layer: no period, the blocks run one by one, and a
    call with a cache never scans."""
    model = LanguageModel(23, 16, 4, 2, mixer="lightning", rngs=nnx.Rngs(0))
    assert scan_period(model.blocks) is None
    x = jnp.ones((1, 3, 16))
    h, caches = call_blocks(model.blocks, None, x, [b.mixer.init_cache(1) for b in model.blocks])
    assert all(cache is not None for cache in caches)
