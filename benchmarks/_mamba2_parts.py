"""Where a Mamba-2 model's time goes: each part of a layer jitted and timed alone.

| symbol | meaning                                                   |
|--------|-----------------------------------------------------------|
| B, T   | batch rows, tokens per row (decode: T = 1, from a cache)  |
| L      | layers (every part but the head runs once per layer)      |
| D, I   | `hidden_size`; mixer width H·P                            |
| H, P, N| SSM heads, head dim, state size (one group)               |

Parts, per call: `in_proj` [B, T, D] → [B, T, 2I + 2N + H]; `conv` (depthwise, SiLU) on
[B, T, I + 2N] after its buffer; `SSD` (`recurrent` for a prefill, `recurrent_step` for
one token, its state donated as the model's decode step donates its cache; B/C as query/key
shared by the H heads, as the mixer passes them); `norms` (the pre-mixer RMSNorm and the gated
RMSNorm); `out_proj` [B, T, I] → [B, T, D]; `head` (final norm and the tied
`vocab`-way product, last position only). Times are medians of `repeats` calls of one layer's
part (its first layer's weights), times L; what a whole call takes beyond their sum is the
glue between parts (splits, dt and gate math, the D skip, residuals, cache writes) and, for
a part alone, the cost of a separate dispatch.
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from _timing import timed

PARTS = ("in_proj", "conv", "SSD", "norms", "out_proj", "head")


def _seconds(module, fn, arrays, repeats: int) -> float:
    graphdef, state = nnx.split(module)
    jitted = jax.jit(lambda state, *a: fn(nnx.merge(graphdef, state), *a))
    return statistics.median(timed(lambda: jitted(state, *arrays), repeats))


def _seconds_in_place(module, fn, arrays, state, repeats: int) -> float:
    """As `_seconds` for `fn(module, state, *arrays) -> (output, new_state)`, with the state
    donated and each call's new state fed to the next, as the model's decode step updates its
    cache in place (a state held as a constant instead costs a fresh state-sized output buffer
    per call: at batch 64 about 3× the donated step's time)."""
    graphdef, params = nnx.split(module)
    jitted = jax.jit(lambda params, state, *a: fn(nnx.merge(graphdef, params), state, *a), donate_argnums=(1,))
    held = [jnp.array(state)]  # a copy: the caller's array stays valid

    def call():
        output, held[0] = jitted(params, held[0], *arrays)
        return output, held[0]

    return statistics.median(timed(call, repeats))


def part_seconds(model, batch: int, length: int, decode: bool, repeats: int) -> dict[str, float]:
    """Seconds of each of `PARTS` for [batch, length] tokens (`decode`: one token through the
    cache, length 1), summed over the layers."""
    block = model.body.layers[0]
    mixer, layers = block.mixer, len(model.body.layers)
    H, P, N = mixer.num_heads, mixer.head_v_dim, mixer.head_k_dim
    rng = np.random.default_rng(2)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    x, y = draw(batch, length, model.body.embedding.features), draw(batch, length, mixer.width)
    buffer = mixer.conv1d.empty_buffer(batch) if decode else None
    state = draw(batch, H, N, P) if decode else None
    bc, v = draw(batch, length, 1, N), draw(batch, length, H, P)
    g = -jnp.abs(draw(batch, length, H)) * 0.1

    def ssd(m, state, bc, v, g):
        return m._recur(bc, bc, v, g=g, state=state, cu_seqlens=None, scale=1.0)

    arrays = (bc, v, g)

    per_layer = {
        "in_proj": _seconds(mixer, lambda m, x: m.in_proj(x), (x,), repeats),
        "conv": _seconds(mixer, lambda m, x: m.conv1d(x, buffer), (draw(batch, length, mixer.conv_dim),), repeats),
        "SSD": _seconds_in_place(mixer, ssd, arrays, state, repeats) if decode else
               _seconds(mixer, lambda m, *a: ssd(m, None, *a), arrays, repeats),
        "norms": _seconds(block, lambda b, x, y: (b.norm(x), b.mixer.norm(y, y)), (x, y), repeats),
        "out_proj": _seconds(mixer, lambda m, y: m.out_proj(y), (y,), repeats),
    }
    seconds = {name: layers * t for name, t in per_layer.items()}
    seconds["head"] = _seconds(model, lambda m, x: m._head(x[:, -1:]), (x,), repeats)
    return seconds


def repeated_ssd_seconds(model, batch: int, length: int, repeats: int) -> float:
    """Seconds of the prefill's SSD with B/C repeated to every head first (what the mixer did
    before `recurrent` took query and key shared by the heads), summed over the layers."""
    mixer, layers = model.body.layers[0].mixer, len(model.body.layers)
    H, P, N = mixer.num_heads, mixer.head_v_dim, mixer.head_k_dim
    rng = np.random.default_rng(2)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    bc, v, g = draw(batch, length, 1, N), draw(batch, length, H, P), -jnp.abs(draw(batch, length, H)) * 0.1

    def ssd(m, bc, v, g):
        q = jnp.repeat(bc, H, axis=2)
        return m._recur(q, q, v, g=g, state=None, cu_seqlens=None, scale=1.0)

    return layers * _seconds(mixer, ssd, (bc, v, g), repeats)
