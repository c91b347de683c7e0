"""Where a Qwen3.5 model's time goes: each part of a layer jitted and timed alone.

| symbol  | meaning                                                         |
|---------|-----------------------------------------------------------------|
| B, T    | batch rows, tokens per row (decode: T = 1, from a cache)        |
| Lg, La  | Gated DeltaNet (`linear_attention`) and attention layers         |
| D       | `hidden_size`                                                   |
| Hk, H   | the delta rule's key heads and value heads; K, V their dims      |

Parts, per call: `GDN in_proj` (q/k/v, z, b and a from [B, T, D]); `conv` (depthwise, SiLU,
over 2·Hk·K + H·V channels, after its buffer); `delta rule` (`delta_rule` for a prefill,
`delta_rule_step` for one token, its state donated and each call's new state fed to the next
as the model's decode step updates its cache in place; q/k L2-normalised inside; β and g given); `GDN out` (the
gated RMS norm and `out_proj`); `attention` (an attention layer's whole mixer: projections,
q/k norms, rotary, softmax attention over its KV cache, output gate, `o_proj`); `MLP` (the
SwiGLU feed-forward); `norms` (a layer's two RMS norms); `head` (final norm and the tied
`vocab`-way product, last position only). The first four are timed on the first Gated
DeltaNet layer's weights and multiplied by Lg, `attention` on the first attention layer's and
multiplied by La, `MLP` and `norms` by Lg + La. What a whole call takes beyond their sum is the
glue between parts (splits, the β and g gates, residuals, cache writes, argmax) and, for a part
alone, the cost of a separate dispatch. `_mamba2_parts._seconds` times each part.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from _mamba2_parts import _seconds, _seconds_in_place


def part_seconds(model, batch: int, length: int, decode: bool, repeats: int) -> dict[str, float]:
    """Seconds of each part for [batch, length] tokens (`decode`: one token through the cache,
    length 1), summed over the layers that have it."""
    layers = model.body.layers
    linear = [layer for layer in layers if layer.linear_attn is not None]
    attention = [layer for layer in layers if layer.self_attn is not None]
    mixer = linear[0].linear_attn
    Hk, H, K, V = mixer.num_heads, mixer.num_v_heads, mixer.head_dim, mixer.head_v_dim
    D = mixer.d_model
    rng = np.random.default_rng(2)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    x = draw(batch, length, D)
    cache = mixer.init_cache(batch, jnp.float32) if decode else None
    buffer, state = (cache.conv, cache.state) if decode else (None, None)
    q, k = draw(batch, length, Hk, K), draw(batch, length, Hk, K)
    v, o, z = draw(batch, length, H, V), draw(batch, length, H, V), draw(batch, length, H, V)
    beta, g = 1 / (1 + jnp.exp(-draw(batch, length, H))), -jnp.abs(draw(batch, length, H)) * 0.1

    per_linear = {
        "GDN in_proj": _seconds(mixer, lambda m, x: m._project(x), (x,), repeats),
        "conv": _seconds(mixer, lambda m, x: m.conv1d(x, buffer), (draw(batch, length, sum(mixer.channels)),),
                         repeats),
        "delta rule": _seconds_in_place(mixer, lambda m, state, *a: m._delta(*a, state, None), (q, k, v, beta, g),
                                        state, repeats) if decode else
                      _seconds(mixer, lambda m, *a: m._delta(*a, None, None), (q, k, v, beta, g), repeats),
        "GDN out": _seconds(mixer, lambda m, o, z: m.out_proj(m.norm(o, z).reshape(batch, length, -1)), (o, z),
                            repeats),
    }
    seconds = {name: len(linear) * t for name, t in per_linear.items()}
    seconds["attention"] = len(attention) * _attention_seconds(attention[0].self_attn, x, decode, repeats) \
        if attention else 0.0
    block = layers[0]
    seconds["MLP"] = len(layers) * _seconds(block, lambda b, x: b.mlp(x), (x,), repeats)
    seconds["norms"] = len(layers) * _seconds(
        block, lambda b, x: (b.input_layernorm(x), b.post_attention_layernorm(x)), (x,), repeats)
    seconds["head"] = _seconds(model, lambda m, x: m._head(x[:, -1:]), (x,), repeats)
    return seconds


def _attention_seconds(attention, x, decode: bool, repeats: int, context: int = 16) -> float:
    """One attention mixer on `x`: the whole prompt, or (`decode`) one token after `context`
    cached ones (a cache of `context + 1` positions, as the benchmark's decode has)."""
    if not decode:
        return _seconds(attention, lambda a, x: a(x), (x,), repeats)
    cache = attention.init_cache(x.shape[0], context + 1)
    positions = jnp.full((x.shape[0], 1), context, jnp.int32)
    return _seconds(attention, lambda a, x: a(x, cache, positions=positions), (x,), repeats)
