"""`recurrax.nn.chunked_cross_entropy` and the models' `token_losses` against the plain loss.

Reference: numpy float64, the log-softmax and its gradient written out
(`dz = c · m · (softmax(z) − onehot(y))`, `dh = s · dz Wᵀ`, `dW = s · hᵀ dz` for a weighted sum
`Σ c_t ℓ_t`). The chunked loss in float64 matches it to 1e-10; in float32 it is held to
`floor_tolerance` of the plain float32 loss's error (full logits, autodiff) against it.
Error metric: max |got − want| / max |want|.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flax", reason="recurrax.nn needs flax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from _cases import floor_tolerance, max_rel_error  # noqa: E402

from recurrax.nn import LanguageModel, chunked_cross_entropy  # noqa: E402

CHECKPOINTS = {"linear_attn": Path(__file__).parent / "fixtures" / "fla" / "linear_attn_elu",  # untied head
               "falcon_h1": Path(__file__).parent / "fixtures" / "transformers" / "falcon_h1_mup"}  # and logits × 0.8
D, V, SCALE = 8, 13, 0.7


def problem(tied: bool, lead=(2, 3), T=11, seed=0):
    """hidden [*lead, T, D], head, targets (some -100 or ≥ V: ignored), mask, cotangents (numpy float64)."""
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((*lead, T, D))
    head = rng.standard_normal((V, D) if tied else (D, V))
    targets = rng.integers(0, V, size=(*lead, T))
    targets[..., 2] = -100
    targets[..., 5] = V
    where = rng.random((*lead, T)) < 0.8
    cotangents = rng.standard_normal((*lead, T))
    return hidden, head, targets, where, cotangents


def reference(hidden, head, targets, where, cotangents, tied: bool):
    """Losses, d hidden and d head of Σ c ℓ, in numpy float64."""
    W = head.T if tied else head
    z = SCALE * hidden @ W
    z_max = z.max(-1, keepdims=True)
    log_normaliser = (z_max + np.log(np.exp(z - z_max).sum(-1, keepdims=True)))[..., 0]
    counted = where & (targets >= 0) & (targets < V)
    safe = np.where(counted, targets, 0)
    picked = np.take_along_axis(z, safe[..., None], -1)[..., 0]
    losses = np.where(counted, log_normaliser - picked, 0.0)
    dz = np.exp(z - log_normaliser[..., None]) - np.eye(V)[safe]
    dz *= (cotangents * counted)[..., None]
    d_hidden = SCALE * dz @ W.T
    d_W = SCALE * hidden.reshape(-1, D).T @ dz.reshape(-1, V)
    return losses, d_hidden, d_W.T if tied else d_W


def chunked(hidden, head, targets, where, cotangents, tied: bool, chunk_size: int):
    def weighted(hidden, head):
        losses = chunked_cross_entropy(hidden, head, targets, where=where, tied=tied, logits_scale=SCALE,
                                       chunk_size=chunk_size)
        return (losses * cotangents).sum(), losses

    (_, losses), grads = jax.value_and_grad(weighted, argnums=(0, 1), has_aux=True)(hidden, head)
    return losses, *grads


def plain(hidden, head, targets, where, cotangents, tied: bool):
    """The full-logits loss in the inputs' dtype, by autodiff."""
    counted = where & (targets >= 0) & (targets < V)

    def weighted(hidden, head):
        z = SCALE * (hidden @ (head.T if tied else head))
        log_probs = jax.nn.log_softmax(z, axis=-1)
        picked = jnp.take_along_axis(log_probs, jnp.where(counted, targets, 0)[..., None], -1)[..., 0]
        losses = jnp.where(counted, -picked, 0)
        return (losses * cotangents).sum(), losses

    (_, losses), grads = jax.value_and_grad(weighted, argnums=(0, 1), has_aux=True)(hidden, head)
    return losses, *grads


def errors(got, want) -> list[float]:
    return [max_rel_error(g, w) for g, w in zip(got, want)]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk_size", [4, 64])
def test_chunked_equals_reference(tied, chunk_size):
    inputs = problem(tied)
    want = reference(*inputs, tied)
    hidden, head, targets, where, cotangents = (jnp.asarray(x) for x in inputs)
    exact = chunked(hidden, head, targets, where, cotangents, tied, chunk_size)
    assert max(errors(exact, want)) < 1e-10
    single = [x.astype(jnp.float32) for x in (hidden, head)]
    floors = errors(plain(*single, targets, where, cotangents.astype(jnp.float32), tied), want)
    got = errors(chunked(*single, targets, where, cotangents.astype(jnp.float32), tied, chunk_size), want)
    for name, error, floor in zip(("losses", "d hidden", "d head"), got, floors):
        assert error <= floor_tolerance(floor), f"{name}: error {error:.3g} > tolerance from floor {floor:.3g}"


def test_chunked_ignores_and_predicts():
    hidden, head, targets, where, _ = (jnp.asarray(x) for x in problem(False, lead=(3,), T=7, seed=1))
    losses, predictions = chunked_cross_entropy(hidden, head, targets, where=where, chunk_size=3,
                                                with_predictions=True)
    ignored = ~where | (targets < 0) | (targets >= V)
    assert bool(jnp.all(jnp.where(ignored, losses, 0) == 0)) and bool(jnp.all(losses[~ignored] > 0))
    np.testing.assert_array_equal(predictions, jnp.argmax(hidden @ head, -1))
    d_hidden = jax.grad(lambda h: chunked_cross_entropy(h, head, targets, where=where).sum())(hidden)
    assert bool(jnp.all(jnp.where(ignored[..., None], d_hidden, 0) == 0))


def test_chunked_refuses_bad_shapes():
    hidden, head, targets = jnp.zeros((2, 5, D)), jnp.zeros((D, V)), jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match="same leading axes"):
        chunked_cross_entropy(hidden, head, targets[:, :4])
    with pytest.raises(ValueError, match=r"head must be \[vocab, d_model\] \(tied\)"):
        chunked_cross_entropy(hidden, head, targets, tied=True)
    with pytest.raises(ValueError, match="where must be shaped like targets"):
        chunked_cross_entropy(hidden, head, targets, where=jnp.ones((5,), bool))
    with pytest.raises(TypeError, match="integer token ids"):
        chunked_cross_entropy(hidden, head, targets.astype(jnp.float32))


def full_logits_losses(logits, targets, where):
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.where(where, -jnp.take_along_axis(log_probs, targets[..., None], -1)[..., 0], 0)


def model_of(kind: str):
    """A `recurrax.nn.LanguageModel` (`"language_model"`) or a fixture's `CausalLM`."""
    if kind in CHECKPOINTS:
        pytest.importorskip("safetensors")
        from recurrax.nn.pretrained import from_pretrained

        return from_pretrained(CHECKPOINTS[kind])
    return LanguageModel(29, 16, 1, 2, implementation="scan", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("kind", ["language_model", "linear_attn", pytest.param("falcon_h1", marks=pytest.mark.slow)])
def test_token_losses_equal_full_logits(kind):
    """`model.token_losses` equals the loss of `model(tokens)`'s logits, dense and packed."""
    model = model_of(kind)
    tokens = jax.random.randint(jax.random.key(3), (2, 9), 0, model.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1)
    where = jnp.arange(9)[None] < jnp.array([[9], [6]])
    graphdef, params = nnx.split(model)

    @jax.jit
    def both(params, tokens, targets, where, cu_seqlens=None):
        model = nnx.merge(graphdef, params)
        chunked = model.token_losses(tokens, targets, where=where, cu_seqlens=cu_seqlens, chunk_size=4)
        return chunked, full_logits_losses(model(tokens, cu_seqlens=cu_seqlens), targets, where)

    got, want = both(params, tokens, targets, where)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    cu_seqlens = jnp.array([0, 9, 15])
    packed = [jnp.concatenate([x[0], x[1, :6]]) for x in (tokens, targets, where)]
    got, want = both(params, *packed, cu_seqlens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["language_model", "linear_attn"])
@pytest.mark.parametrize("call", ["logits", "token_losses"])
def test_models_refuse_bad_tokens_alike(kind, call):
    """Both model stacks check their tokens in one place (`recurrax.nn._decoder`): the same
    errors, before any layer runs, from the call and from `token_losses`."""
    model = model_of(kind)
    run = model if call == "logits" else lambda tokens, **packed: model.token_losses(tokens, tokens, **packed)
    with pytest.raises(TypeError, match=r"^tokens must be an integer array of token ids, got dtype float32"):
        run(jnp.ones((1, 3), jnp.float32))
    with pytest.raises(ValueError, match=r"^tokens must have at least one batch row and one token .*\(1, 0\)"):
        run(jnp.zeros((1, 0), jnp.int32))
    with pytest.raises(ValueError, match=r"^tokens must be \[batch, seq_len\] token ids, .*pass cu_seqlens"):
        run(jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match=r"^tokens must have at least one batch row and one token"):
        run(jnp.zeros((0,), jnp.int32), cu_seqlens=jnp.array([0, 0]))
