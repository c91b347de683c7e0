"""`remat=` (recurrax.nn._remat) on `LanguageModel` and `CausalLM`: the gradients of a training
loss under `"block"` and `"dots"` equal the plain model's, and the saved residuals shrink.

Error metric: per parameter, max |remat − plain| / max |plain| (float32 both), held to
`floor_tolerance` of the plain float32 gradients' error against the float64 model's (same
parameters cast up). The default tier checks a one-block GLA `LanguageModel`'s gradients
(its mixer on the `scan` algorithm), and the
saved residuals of it and of a Zamba2 `CausalLM` (shared attention blocks fed the
embeddings, Mamba-2 layers); `-m slow` checks the gradients of Zamba2, the gated delta
rule, fla's GLA/attention hybrid and Bamba. Under `"block"` a second GLA layer adds exactly
its input and its parameters to the saved residuals (counted, no bound to tune).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flax", reason="recurrax.nn needs flax")
pytest.importorskip("safetensors", reason="checkpoints need safetensors (pip install 'recurrax[pretrained]')")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from _cases import compile_once_quickly, float64, floor_tolerance, max_rel_error  # noqa: E402

from recurrax.nn import REMAT_POLICIES, LanguageModel  # noqa: E402
from recurrax.nn.pretrained import from_pretrained, save_pretrained  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
CHECKPOINTS = {"zamba2": FIXTURES / "transformers" / "zamba2_shared_adapters_rope_tied",
               "bamba": FIXTURES / "transformers" / "bamba_basic",
               "gla_hybrid": FIXTURES / "fla" / "gla_hybrid_attn"}
SEQ_LEN = 12


def language_model(mixer: str, dtype=jnp.float32, remat=None, **options) -> LanguageModel:
    options = dict(dict(num_layers=2), **options)
    return LanguageModel(23, 16, num_heads=2, mixer=mixer, mixer_options={"conv_size": 2} if mixer == "gla" else None,
                         dtype=dtype, param_dtype=dtype, remat=remat, rngs=nnx.Rngs(0), **options)


LANGUAGE_MODELS = {  # name: (mixer, options); "gla_scan" compiles in a third of "gla"'s time
    "gla_scan": ("gla", dict(num_layers=1, implementation="scan")),
    "gla": ("gla", {}),
    "gated_deltanet": ("gated_deltanet", {}),
}


def build(name: str, dtype=jnp.float32, remat=None):
    """The model called `name`: a LanguageModel's mixer, or a key of CHECKPOINTS."""
    if name in CHECKPOINTS:
        return from_pretrained(CHECKPOINTS[name], dtype=dtype, remat=remat)
    mixer, options = LANGUAGE_MODELS[name]
    return language_model(mixer, dtype, remat, **options)


def loss_gradients(model, params, tokens, quickly: bool = False):
    """The gradients of the mean next-token loss (through the logits) at `params`; `quickly`
    compiles at XLA's level 0 (for the float64 floor)."""
    graphdef = nnx.split(model)[0]

    def loss(params):
        logits = nnx.merge(graphdef, params)(tokens[:, :-1]).astype(jnp.float32)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1).mean()

    gradients = jax.jit(jax.grad(loss))
    return (compile_once_quickly(gradients, params) if quickly else gradients)(params)


def gradient_error(got, want) -> float:
    return max(max_rel_error(g, w) for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


CASES = [pytest.param("gla_scan"), pytest.param("gla", marks=pytest.mark.slow), pytest.param("zamba2", marks=pytest.mark.slow),
         pytest.param("gated_deltanet", marks=pytest.mark.slow),
         pytest.param("gla_hybrid", marks=pytest.mark.slow), pytest.param("bamba", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name", CASES)
def test_remat_gradients_equal_plain(name):
    model = build(name)
    params = nnx.split(model)[1]
    tokens = jax.random.randint(jax.random.key(1), (2, SEQ_LEN + 1), 0, model.vocab_size)
    plain = loss_gradients(model, params, tokens)
    exact = loss_gradients(build(name, jnp.float64), float64(params), tokens, quickly=True)
    tolerance = floor_tolerance(gradient_error(plain, exact))
    for remat in REMAT_POLICIES:
        model.remat = remat
        error = gradient_error(loss_gradients(model, params, tokens), plain)
        assert error <= tolerance, f"{name} remat={remat!r}: gradient error {error:.3g} > {tolerance:.3g}"


def saved_elements(model, tokens, capsys) -> int:
    """Numbers the backward of the model's loss keeps, per `jax.ad_checkpoint.print_saved_residuals`."""
    graphdef, params = nnx.split(model)
    capsys.readouterr()
    jax.ad_checkpoint.print_saved_residuals(lambda p: nnx.merge(graphdef, p)(tokens).sum(), params)
    shapes = re.findall(r"^\w+\[([\d,]*)\]", capsys.readouterr().out, flags=re.MULTILINE)
    return sum(int(np.prod([int(d) for d in shape.split(",") if d])) for shape in shapes)


@pytest.mark.parametrize("name", ["gla", "zamba2"])
def test_remat_saves_less(name, capsys):
    """Block keeps the fewest numbers, dots more (the projections), none the most."""
    import jax.ad_checkpoint  # noqa: F401  (print_saved_residuals)

    tokens = jnp.zeros((2, 32), jnp.int32)
    model = build(name)
    saved = {}
    for remat in (None, "dots", "block"):
        model.remat = remat
        saved[remat] = saved_elements(model, tokens, capsys)
    assert saved["block"] < saved["dots"] < saved[None], saved


def test_remat_reaches_every_entry_point(tmp_path):
    model = language_model("gla", remat="block")
    assert model.remat == "block" and "remat" not in model.config
    save_pretrained(model, tmp_path)
    assert from_pretrained(tmp_path, remat="dots").remat == "dots"
    assert from_pretrained(CHECKPOINTS["zamba2"], remat="block").remat == "block"
    with pytest.raises(ValueError, match="remat must be None, 'block' or 'dots', got 'all'"):
        language_model("gla", remat="all")
    with pytest.raises(ValueError, match="remat must be"):
        from_pretrained(CHECKPOINTS["zamba2"], remat="full")


def test_cached_call_ignores_remat():
    """Decoding runs the plain blocks: the same logits and caches with remat set."""
    model = build("gla_scan")
    tokens = jax.random.randint(jax.random.key(2), (2, 5), 0, 23)
    plain, plain_cache = model(tokens, model.init_cache(2))
    model.remat = "dots"
    logits, cache = model(tokens, model.init_cache(2))
    np.testing.assert_array_equal(logits, plain)
    jax.tree.map(np.testing.assert_array_equal, cache, plain_cache)


def test_block_remat_keeps_only_each_block_input(capsys):
    """Under `"block"` a second layer adds exactly its input `[B, T, D]` and its parameters to
    what the backward keeps: none of its mixer's internals (the recurrent kernels' custom_vjp
    residuals, per-chunk states among them) outlive the layer."""
    import jax.ad_checkpoint  # noqa: F401  (print_saved_residuals)

    B, T, D = 2, 32, 16
    tokens = jnp.zeros((B, T), jnp.int32)
    models = [language_model("gla", remat="block", num_layers=n) for n in (1, 2)]
    saved = [saved_elements(model, tokens, capsys) for model in models]
    sizes = [sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) for model in models]
    assert saved[1] - saved[0] == B * T * D + sizes[1] - sizes[0], (saved, sizes)


def test_block_remat_frees_memory_in_the_compiled_step(capsys):
    """Issue 49: what `"block"` stops saving is freed in the compiled step too. XLA's temporaries
    of `jit(value_and_grad)` of the chunked loss grow with a second GLA layer by
    Δ_none (plain) and Δ_block; the compiled saving Δ_none − Δ_block is at least half of what
    JAX stops keeping for that layer (`print_saved_residuals`: its residuals plain minus under
    `"block"`). Measured on CPU, 1,024 tokens, d_model 64: 7.3 of 11.9 MiB under JAX 0.10.2,
    7.8 under 0.12.1. Under `jax.checkpoint`, jaxlib 0.10's CPU compiler dropped the optimization
    barrier that holds the recompute back before it scheduled, ran the recompute in the
    forward, and saved nothing (Δ_block = Δ_none = 9.8 MiB)."""
    import jax.ad_checkpoint  # noqa: F401  (print_saved_residuals)

    T, mib = 1024, 2**20
    tokens = jnp.zeros((1, T + 1), jnp.int32)

    def mean_loss(graphdef):
        return lambda params: nnx.merge(graphdef, params).token_losses(tokens[:, :-1], tokens[:, 1:]).mean()

    def temp_and_saved(num_layers: int, remat) -> tuple[float, float]:
        model = LanguageModel(256, 64, num_layers, 2, mixer="gla", remat=remat, rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(model)
        compiled = jax.jit(jax.value_and_grad(mean_loss(graphdef))).lower(params).compile()
        capsys.readouterr()
        jax.ad_checkpoint.print_saved_residuals(mean_loss(graphdef), params)
        shapes = re.findall(r"^f32\[([\d,]*)\]", capsys.readouterr().out, flags=re.MULTILINE)
        saved = sum(int(np.prod([int(d) for d in shape.split(",") if d])) for shape in shapes) * 4
        return compiled.memory_analysis().temp_size_in_bytes / mib, saved / mib

    (temp_1, saved_1), (temp_2, saved_2) = temp_and_saved(1, None), temp_and_saved(2, None)
    (block_temp_1, block_saved_1), (block_temp_2, block_saved_2) = temp_and_saved(1, "block"), temp_and_saved(2, "block")
    compiled_saving = (temp_2 - temp_1) - (block_temp_2 - block_temp_1)
    jax_saving = (saved_2 - saved_1) - (block_saved_2 - block_saved_1)
    assert compiled_saving >= jax_saving / 2, (f"a second layer's compiled temporaries: {temp_2 - temp_1:.2f} MiB plain, "
                                               f"{block_temp_2 - block_temp_1:.2f} under block; JAX saves {jax_saving:.2f} less")
