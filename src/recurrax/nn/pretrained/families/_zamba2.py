"""Zamba2's layers (`transformers`' `Zamba2ForCausalLM`): Mamba-2 layers, and shared transformer
blocks fed the token embeddings, with a low-rank adapter per use.

| symbol | meaning                                                            |
|--------|--------------------------------------------------------------------|
| D      | `hidden_size`; the shared attention reads 2D channels              |
| H, Hkv | attention heads, key/value heads; head dim d = 2D / H              |
| F, r   | the shared MLP's width, `adapter_rank`                             |
| e      | the token embeddings (the model's input, before any layer)         |
| u, b   | a use of a shared block (its hybrid layer's index among the hybrid |
|        | layers) and its block, b = u mod `num_mem_blocks`                  |

    mamba layer:   h = h + mamba(input_layernorm(h))
    hybrid layer:  x = input_layernorm([h | e])                                     [.., 2D]
                   a = self_attn_b,u(x)        q, k, v = x W (+ x A_u B_u: use_shared_attention_adapter)
                   y = pre_ff_layernorm(a);   [g | p] = y W_gate_up (+b) + y A_u B_u
                   t = linear(W_down(act(g) ⊙ p) (+b))
                   h = h + mamba(input_layernorm(h + t))                          (t is not kept in h)

The attention scale is `(d/2)^{−1/2}`; with `use_mem_rope` rotary covers whole heads. The
Mamba layers are `Mamba2Mixer` with `dt ≥ time_step_min`, a conv bias and a gated norm with
ε = 1e-5 always (as `transformers` builds them). Each hybrid layer keeps its own KV cache.

Sharing, as `transformers` 5.25 does it: with `tie_word_embeddings` the uses u ≡ b hold one
block object, whose parameters are named (loaded and saved) under its first use's layer; the
later uses' names are accepted as aliases. Without it `transformers` ties nothing: each hybrid
layer has its own block (holding the adapters of every use of its b, of which it runs its own).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from ..layers._attention import HFAttention, LayerCache
from ..layers._mamba2_mixer import Mamba2Mixer
from ..layers._mixer import linear, run_mixer
from ..layers._mlp import activation
from ..layers._norm import RMSNorm


def adapter_list(uses: int, block: int, blocks: int, d_in: int, rank: int, d_out: int, axis: str, *, dtype,
                 rngs: nnx.Rngs) -> nnx.List:
    """A block's adapters as `transformers` lists them: `[d_in → r → d_out]` at every use of
    block `block`, None (its `Identity`) at the others."""
    def adapter():
        return nnx.Sequential(linear(d_in, rank, axes=("embed", None), dtype=dtype, rngs=rngs),
                              linear(rank, d_out, axes=(None, axis), dtype=dtype, rngs=rngs))

    return nnx.List([adapter() if use % blocks == block else None for use in range(uses)])


class ZambaAttention(HFAttention):
    """The shared attention: 2D → H heads of d = 2D/H → D, no biases, `linear_{q,k,v}_adapter_list`.

    **Arguments:** `hidden_size` D; `num_heads`, `num_kv_heads`, `head_dim`, `rotary_dim`,
    `rope_theta`, `scale` as in `HFAttention`; `adapters`: `(uses, block, blocks, rank)` for
    `use_shared_attention_adapter`, or None; `dtype`, `rngs`.
    """

    def __init__(self, hidden_size: int, *, adapters: tuple[int, int, int, int] | None, dtype=jnp.float32,
                 rngs: nnx.Rngs, **attention):
        super().__init__(2 * hidden_size, out_size=hidden_size, dtype=dtype, rngs=rngs, **attention)
        for name, axis in (("q", "heads"), ("k", "kv_heads"), ("v", "kv_heads")):
            value = None if adapters is None else adapter_list(*adapters[:3], 2 * hidden_size, adapters[3],
                                                               2 * hidden_size, axis, dtype=dtype, rngs=rngs)
            setattr(self, f"linear_{name}_adapter_list", value)

    def __call__(self, x: Float[Array, "B T D2"], cache=None, *, use: int, cu_seqlens=None, positions=None):
        """`Attention`'s call for use `use` (its adapters)."""
        return self._attention(x, cache, cu_seqlens, positions, lambda x3, p: self._adapted(use, x3, p))

    def _adapted(self, use: int, x, positions):
        projected = [getattr(self, f"{name}_proj")(x) for name in "qkv"]
        if self.linear_q_adapter_list is not None:
            projected = [p + getattr(self, f"linear_{name}_adapter_list")[use](x) for p, name in zip(projected, "qkv")]
        return self._split_heads(*projected, positions)


class ZambaMLP(nnx.Module):
    """The shared MLP: `down_proj(act(g) ⊙ p)`, `[g | p] = gate_up_proj(y) + gate_up_proj_adapter_list[u](y)`."""

    def __init__(self, hidden_size: int, *, width: int, bias: bool, act: str, adapters: tuple[int, int, int, int],
                 dtype=jnp.float32, rngs: nnx.Rngs):
        self.act = act
        activation(act, "zamba2's hidden_act")
        self.gate_up_proj = linear(hidden_size, 2 * width, axes=("embed", "mlp"), bias=bias, dtype=dtype, rngs=rngs)
        self.down_proj = linear(width, hidden_size, axes=("mlp", "embed"), bias=bias, dtype=dtype, rngs=rngs)
        self.gate_up_proj_adapter_list = adapter_list(*adapters[:3], hidden_size, adapters[3], 2 * width, "mlp",
                                                      dtype=dtype, rngs=rngs)

    def __call__(self, y: Float[Array, "... D"], use: int) -> Float[Array, "... D"]:
        gate, up = jnp.split(self.gate_up_proj(y) + self.gate_up_proj_adapter_list[use](y), 2, axis=-1)
        return self.down_proj(activation(self.act, "hidden_act")(gate) * up)


class SharedTransformer(nnx.Module):
    """`transformers`' `Zamba2AttentionDecoderLayer` (block `block` of `blocks`, run by `uses` hybrid layers)."""

    def __init__(self, spec: dict, *, block: int, uses: int, dtype=jnp.float32, rngs: nnx.Rngs):
        D, eps, shared = spec["hidden_size"], spec["eps"], spec["shared"]
        adapters = (uses, block, shared["blocks"], shared["rank"])
        self.input_layernorm = RMSNorm(2 * D, eps=eps, dtype=dtype)
        self.self_attn = ZambaAttention(D, **spec["attention"], adapters=adapters if shared["attention_adapters"]
                                        else None, dtype=dtype, rngs=rngs)
        self.pre_ff_layernorm = RMSNorm(D, eps=eps, dtype=dtype)
        self.feed_forward = ZambaMLP(D, **spec["mlp"], adapters=adapters, dtype=dtype, rngs=rngs)

    def __call__(self, h, embeddings, use: int, cache, context):
        """`(feed_forward output, new KV cache)` for use `use`."""
        x = self.input_layernorm(jnp.concatenate([h, embeddings.astype(h.dtype)], axis=-1))
        a, new_cache = run_mixer(self.self_attn, x, cache, dict(context, use=use))
        return self.feed_forward(self.pre_ff_layernorm(a), use), new_cache


class MambaLayer(nnx.Module):
    """`Zamba2MambaDecoderLayer`: `h + mamba(input_layernorm(h + added))`."""

    kind = "mamba"

    def __init__(self, spec: dict, *, dtype=jnp.float32, rngs: nnx.Rngs):
        D = spec["hidden_size"]
        self.mamba = Mamba2Mixer(D, **spec["mamba"], dtype=dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(D, eps=spec["eps"], dtype=dtype)

    def init_cache(self, rows: int, capacity: int) -> LayerCache:
        return LayerCache(self.mamba.init_cache(rows), None)

    def __call__(self, h, cache: LayerCache | None, *, added=None, **context):
        x = self.input_layernorm(h if added is None else h + added)
        y, new = run_mixer(self.mamba, x, None if cache is None else cache.mamba, context)
        return h + y, None if cache is None else LayerCache(new, cache.attention)


class HybridLayer(nnx.Module):
    """`Zamba2HybridLayer`: the shared block (use `use`), its `linear`, then `mamba_decoder`."""

    kind = "hybrid"

    def __init__(self, spec: dict, shared_transformer: SharedTransformer, use: int, *, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        D = spec["hidden_size"]
        self.shared_transformer, self.use = shared_transformer, use
        self.linear = linear(D, D, axes=("embed", None), dtype=dtype, rngs=rngs)
        self.mamba_decoder = MambaLayer(spec, dtype=dtype, rngs=rngs)

    def init_cache(self, rows: int, capacity: int) -> LayerCache:
        return LayerCache(self.mamba_decoder.mamba.init_cache(rows),
                          self.shared_transformer.self_attn.init_cache(rows, capacity))

    def __call__(self, h, cache: LayerCache | None, *, embeddings, **context):
        t, attention = self.shared_transformer(h, embeddings, self.use, None if cache is None else cache.attention,
                                               context)
        h, mamba = self.mamba_decoder(h, cache, added=self.linear(t), **context)
        return h, None if cache is None else LayerCache(mamba.mamba, attention)


def zamba2_layers(spec: dict, *, dtype=jnp.float32, rngs: nnx.Rngs) -> list[nnx.Module]:
    """The layers of a resolved zamba2 spec, the shared blocks tied as `transformers` 5.25 ties them."""
    uses, blocks = spec["layers"].count("hybrid"), spec["shared"]["blocks"]
    tied: dict[int, SharedTransformer] = {}
    layers: list[nnx.Module] = []
    for kind in spec["layers"]:
        if kind == "mamba":
            layers.append(MambaLayer(spec, dtype=dtype, rngs=rngs))
            continue
        use = sum(layer.kind == "hybrid" for layer in layers)
        block = use % blocks
        shared = tied.get(block) or SharedTransformer(spec, block=block, uses=uses, dtype=dtype, rngs=rngs)
        if spec["tie_word_embeddings"]:
            tied[block] = shared
        layers.append(HybridLayer(spec, shared, use, dtype=dtype, rngs=rngs))
    return layers
