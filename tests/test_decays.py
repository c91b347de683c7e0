"""Fixed per-head decays of published models, checked against their definitions."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

import recurrax
from recurrax.decays import alibi_slopes, lightning_g_gamma, retention_g_gamma


def _ejkernel_lightning(q, k, v, layer_idx, num_layers):
    """ejKernel's `lightning_attn` semantics written out in float64 loops: head h decays its
    state by exp(−(8 / H) · (1 − l / L) · h) per token, scale K^−½, current token included."""
    B, T, H, K = q.shape
    out = np.zeros((B, T, H, v.shape[-1]))
    for b in range(B):
        for h in range(H):
            decay = math.exp(-(8.0 / H) * (1.0 - layer_idx / num_layers) * h)
            state = np.zeros((K, v.shape[-1]))
            for t in range(T):
                state = decay * state + np.outer(k[b, t, h], v[b, t, h])
                out[b, t, h] = K**-0.5 * q[b, t, h] @ state
    return out


@pytest.mark.parametrize("layer_idx", [0, 3, 11])
def test_ejkernel_form_reproduces_ejkernels_lightning(layer_idx):
    rng = np.random.default_rng(layer_idx)
    q, k, v = (rng.standard_normal((2, 9, 4, 8)) for _ in range(3))
    g_gamma = lightning_g_gamma(4, layer_idx, 12, form="ejkernel").astype(jnp.float64)
    o, _ = recurrax.recurrent(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), g_gamma=g_gamma)
    # the helper returns float32 decays (as ejKernel's `arange(..., "f4")`): ~1e-7 relative each
    np.testing.assert_allclose(np.asarray(o), _ejkernel_lightning(q, k, v, layer_idx, 12), rtol=2e-6, atol=2e-6)


def test_formulas():
    np.testing.assert_allclose(lightning_g_gamma(8, 2, 4, "ejkernel"), -(8 / 8) * (1 - 2 / 4) * np.arange(8), rtol=1e-6)
    slopes = np.asarray(alibi_slopes(8))
    np.testing.assert_allclose(slopes, 2.0 ** (-np.arange(1, 9)), rtol=1e-12)  # ALiBi: 2^(−8i/8)
    np.testing.assert_allclose(lightning_g_gamma(8, 1, 3, "alibi"), -slopes * (1 - 1 / 2 + 1e-5), rtol=1e-6)
    np.testing.assert_allclose(retention_g_gamma(3), np.log(1 - 2.0 ** (-5 - np.arange(3))), rtol=1e-6)


def test_bad_form_and_layer_are_named():
    with pytest.raises(ValueError, match="form"):
        lightning_g_gamma(4, 0, 2, form="minimax")
    with pytest.raises(ValueError, match="layer_idx"):
        lightning_g_gamma(4, 2, 2)
