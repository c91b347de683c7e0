"""MiniMax-01 as `transformers` 5.25 computes it: `MiniMaxForCausalLM` (`minimax`), Lightning
Attention layers and softmax attention layers, each followed by a mixture of experts. This
module is the family: its config reading, its blocks and its body; `_config.FAMILY_MODULES`
registers it by `model_type`.

| symbol   | meaning                                                                  |
|----------|--------------------------------------------------------------------------|
| B, T     | batch rows, tokens per row (packed: one row of N tokens)                 |
| D        | `hidden_size`                                                            |
| H, Hkv   | `num_attention_heads`, `num_key_value_heads`; d = `head_dim` (default D / H) |
| l, L     | a layer's index (from 0), `num_hidden_layers`                            |
| E, k, F  | experts `num_local_experts`, `num_experts_per_tok`, `intermediate_size`   |
| α, β     | a sublayer's residual factors (`*_alpha_factor`, `*_beta_factor`)        |
| N(x)     | RMS norm `x / rms(x) ⊙ w`                                                |

    h = E[tokens]
    per layer:  x = N(h);  h = α_mix · x + β_mix · mixer(x)        the residual is the normed input
                x = N(h);  h = α_mlp · x + β_mlp · moe(x)
    logits = N(h) W_head                                         (W_head = Eᵀ with tie_word_embeddings)

α_mix, β_mix are `linear_attn_*_factor` after a Lightning layer, `full_attn_*_factor` after
an attention layer; α_mlp, β_mlp are `mlp_*_factor` (all 1 by default; the Hub's MiniMax-Text-01
has α = (2·80)^{1/4} ≈ 3.557, β = 1).

Lightning Attention (`linear_attention` layers), on `recurrax.recurrent` with a per-head `g_gamma`:

    [q_h | k_h | v_h] = silu(x W_qkv)_h        per head [d | d | d]  (SiLU on q, k and v)
    s_h = 2^{−8(h+1)/H} · (1 − l / (L − 1 + 1e-5) + 1e-5)           `transformers`' `slope_rate`
    S_t = e^{−s_h} S_{t−1} + k_t v_tᵀ,   o_t = q_tᵀ S_t              recurrent(g_gamma = −s, scale 1)
    y = (sigmoid(x W_gate) ⊙ N_{1e-6}(o))  W_out                     N over all H·d channels, ε = 1e-6

`transformers` computes the same sum in blocks of `block_size` tokens (`query_decay`,
`key_decay`, `diagonal_decay` are `e^{−s·…}` inside a block); the blocks change only the
rounding, so `block_size` is read and not needed here. The slopes are geometric for every H
(not ALiBi's completed sequence that `recurrax.decays.lightning_g_gamma` uses for H that is not
a power of two), and the depth factor has 1e-5 in its denominator too: `slope_rates` computes
them as `transformers` does.

Softmax attention (`full_attention` layers): `transformers`' Mixtral attention, grouped heads,
head dim d, rotary on every channel (GPT-NeoX halves), θ = `rope_theta`, a `sliding_window` if
set (a key is visible to the `sliding_window` queries from its own position on).

MoE: a softmax router over E (`gate`), the top k renormalised to sum to one, SwiGLU experts
computed only for the routed pairs (`recurrax.nn`'s `routed_experts`). Every layer has it.

Which layers are what: `layer_types`, else `attn_type_list` (the spelling of MiniMax's own
configs: 0 Lightning, 1 softmax attention), else attention at even layers (`transformers`'
default). Refused by name at load time: a `hidden_act` other than SiLU, rotary embeddings other
than the default (`rope_type`, `rope_scaling`), `postnorm: false` (a pre-norm residual, which
`transformers` does not build), a shared expert (`shared_intermediate_size` > 0, which
`transformers` would drop), unknown layer types, `layer_types` and `attn_type_list` that
disagree, head counts that do not divide.

Partial rotary: the Hub's MiniMax-Text-01-hf config says `rotary_dim: 64` (of `head_dim`
128), and MiniMax's own code rotates only those channels; `transformers` 5.25's `minimax` ignores
`rotary_dim` and `partial_rotary_factor` and rotates all `head_dim` channels (the mistake its
`minimax_m2` had, huggingface/transformers#48241). This module computes what `transformers`
computes, and says so here rather than differ from it silently.

Decoding: a Lightning layer's cache is a `MixerCache` (the state `[R, H, d, d]`, no
convolution), an attention layer's a `KVCache`. `transformers`' own cache (`MiniMaxCache`) runs
the same recurrence token by token, so its cached decode equals its parallel forward up to
rounding (the fixtures record ≤ 4.3e-7 relative); its position ids, though, come from the first layer's
key cache, which is empty when layer 0 is a Lightning layer: a caller must pass `position_ids`
(as `generate` does), or the rotary angles restart at 0. Decoding here always uses the
positions of the tokens.

Checkpoints: `transformers` 5.25 writes (and the Hub's checkpoints hold) the MoE Mixtral's way:
`block_sparse_moe.gate.weight` and each expert's `block_sparse_moe.experts.{e}.w1` (gate),
`w3` (up), `w2` (down) `.weight`; its model holds `mlp.gate.weight`, fused
`mlp.experts.gate_up_proj [E, 2F, D]` and `mlp.experts.down_proj [E, D, F]` (its
`WeightConverter`s for `mixtral`). Both are read (`loaded_names`) into the stacked
`mlp.experts.{gate,up,down}_proj.weight [E, out, in]` here; `saved_names` writes the former.
The Lightning layers' `slope_rate`, `query_decay`, `key_decay` and `diagonal_decay` buffers
are saved by `transformers` but are functions of the config: they are not read (`transformers`
computes the same values when a checkpoint lacks them), and `saved_buffers` writes them as
`transformers` 5.25 does, bit for bit (`[1, H, b, b]` floats per layer for `block_size` b).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from ..._mixers import MixerCache, RecurrentMixer
from .._config_checks import _check_fields, _refuse, _rope, check_layer_types, decode_floats
from ..layers._attention import HFAttention, KVCache
from ..layers._decoder import DecoderBody
from ..layers._mixer import linear, run_mixer
from ..layers._mlp import SoftmaxRouter, StackedSwiGLUExperts, stacked_experts
from ..layers._norm import RMSNorm

MODEL_TYPES = ("minimax",)
BODY_NAME = "model"
MULTIMODAL: dict = {}

DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=None, hidden_act="silu",
                max_position_embeddings=4096 * 32, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
                num_experts_per_tok=2, num_local_experts=8, layer_types=None, block_size=256,
                full_attn_alpha_factor=1, full_attn_beta_factor=1, linear_attn_alpha_factor=1,
                linear_attn_beta_factor=1, mlp_alpha_factor=1, mlp_beta_factor=1, rope_theta=1000000.0)
"""Defaults of `transformers` 5.25's `MiniMaxConfig` (the keys read here; head_dim None: D / H)."""

POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "max_position_embeddings", "num_experts_per_tok", "num_local_experts", "block_size")
OPTIONAL_INTS = ("num_key_value_heads", "head_dim", "sliding_window")
FACTORS = ("full_attn_alpha_factor", "full_attn_beta_factor", "linear_attn_alpha_factor", "linear_attn_beta_factor",
           "mlp_alpha_factor", "mlp_beta_factor")
LAYER_TYPES = ("linear_attention", "full_attention")
ATTN_TYPES = {0: "linear_attention", 1: "full_attention"}
"""`attn_type_list`'s codes (MiniMax's own configs)."""
LIGHTNING_NORM_EPS = 1e-6
"""ε of the Lightning output norm: `transformers` builds it with `MiniMaxRMSNorm`'s default."""


def _check(c: dict) -> None:
    """Refuse values of the default-filled config `c` that cannot build the model (by field)."""
    _check_fields(c, POSITIVE_INTS, optional_ints=OPTIONAL_INTS, numbers=("rms_norm_eps",),
                  bools=("tie_word_embeddings",), finite=FACTORS)
    if c["hidden_act"] not in ("silu", "swish"):
        raise NotImplementedError(f"only hidden_act='silu' is supported (the experts and the Lightning q, k, v "
                                  f"use it), got {c['hidden_act']!r}")
    if c.get("postnorm", True) is not True:
        raise NotImplementedError(f"only postnorm=true is supported (transformers' MiniMax adds each sublayer to "
                                  f"its normed input), got {c['postnorm']!r}")
    if c.get("shared_intermediate_size") not in (None, 0):
        raise NotImplementedError(f"a shared expert (shared_intermediate_size={c['shared_intermediate_size']!r}) "
                                  f"is not supported: transformers' MiniMax has none")
    if c["num_experts_per_tok"] > c["num_local_experts"]:
        _refuse("num_experts_per_tok", f"at most num_local_experts ({c['num_local_experts']})",
                c["num_experts_per_tok"])


def _layer_types(c: dict) -> list[str]:
    """Each layer's token mixer: `layer_types`, else `attn_type_list`, else attention at even layers."""
    n, types, codes = c["num_hidden_layers"], c["layer_types"], c.get("attn_type_list")
    if codes is not None:
        if not (isinstance(codes, list) and len(codes) == n and all(code in ATTN_TYPES for code in codes)
                and not any(isinstance(code, bool) for code in codes)):
            _refuse("attn_type_list", f"a list of {n} codes (0: Lightning, 1: softmax attention)", codes)
        if types is not None and types != [ATTN_TYPES[code] for code in codes]:
            _refuse("attn_type_list", f"the layer_types of the same config ({types})", codes)
        types = [ATTN_TYPES[code] for code in codes]
    check_layer_types({**c, "layer_types": types}, LAYER_TYPES)
    if types is None:
        return ["full_attention" if i % 2 == 0 else "linear_attention" for i in range(n)]
    return list(types)


def resolve(config: dict) -> dict:
    """The layout spec of a MiniMax config: widths, each layer's mixer and residual factors, and
    the keyword arguments of each layer kind (see the module docstring)."""
    c = {**DEFAULTS, **decode_floats(config)}
    if "num_experts" in config and "num_local_experts" not in config:  # `MiniMaxConfig.attribute_map`
        c["num_local_experts"] = config["num_experts"]
    _check(c)
    H = c["num_attention_heads"]
    Hkv = H if c["num_key_value_heads"] is None else c["num_key_value_heads"]
    if H % Hkv:
        _refuse("num_attention_heads", f"a multiple of num_key_value_heads ({Hkv})", H)
    if c["head_dim"] is None and c["hidden_size"] % H:
        _refuse("num_attention_heads", f"a divisor of hidden_size ({c['hidden_size']}) without head_dim", H)
    d = c["head_dim"] or c["hidden_size"] // H
    _, theta = _rope(c, d, 1.0)  # transformers 5.25 rotates all d channels (module docstring)
    factors = {name: float(c[name]) for name in FACTORS}
    layers = _layer_types(c)
    return dict(
        family="minimax", vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], eps=float(c["rms_norm_eps"]),
        tie_word_embeddings=bool(c["tie_word_embeddings"]), max_position_embeddings=c["max_position_embeddings"],
        layers=layers, factors=factors,
        linear_attention=dict(num_heads=H, head_dim=d, num_layers=len(layers)),
        full_attention=dict(num_heads=H, num_kv_heads=Hkv, head_dim=d, rotary_dim=d, rope_theta=theta,
                            window=c["sliding_window"]),
        moe=dict(experts=c["num_local_experts"], width=c["intermediate_size"], top_k=c["num_experts_per_tok"]),
        block_size=c["block_size"])


def slope_rates(num_heads: int, layer_idx: int, num_layers: int) -> Float[Array, " H"]:
    """Lightning layer `layer_idx`'s per-head decay rates s_h, as `transformers` 5.25 computes
    `slope_rate` (in float32): `2^{−8(h+1)/H} · (1 − l / (L − 1 + 1e-5) + 1e-5)`."""
    return jnp.asarray(_slope_rates(num_heads, layer_idx, num_layers))


def _slope_rates(num_heads: int, layer_idx: int, num_layers: int) -> np.ndarray:
    base = np.float32(1 / (2 ** (8 / num_heads)))
    rates = base ** np.arange(1, num_heads + 1, dtype=np.float32)
    return rates * np.float32(1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5)


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------

class MiniMaxLightningAttention(RecurrentMixer):
    """`transformers`' MiniMax Lightning Attention: `RecurrentMixer`'s recurrence, cache and
    packed sequences behind MiniMax's per-head `[q | k | v]` projection (SiLU on all three), a
    constant per-head decay `−slope_rates(H, l, L)`, score scale 1, and an RMS norm over all
    H·d channels gated by `sigmoid(x W_gate)` (module docstring).

    **Arguments:** `hidden_size`; `num_heads` (H), `head_dim` (d); `layer_idx`, `num_layers`
    (l, L: the decay); `dtype`, `rngs`.
    """

    def __init__(self, hidden_size: int, *, num_heads: int, head_dim: int, layer_idx: int, num_layers: int,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        self.d_model, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_heads
        self.qk_head_dim = self.v_head_dim = head_dim
        self.softmax_scale, self.implementation, self.dtype, self.conv = 1.0, None, dtype, None
        self.layer_idx, self.num_layers = layer_idx, num_layers
        inner = num_heads * head_dim
        self.qkv_proj = linear(hidden_size, 3 * inner, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        self.output_gate = linear(hidden_size, inner, axes=("embed", "heads"), dtype=dtype, rngs=rngs)
        self.norm = RMSNorm(inner, eps=LIGHTNING_NORM_EPS, axis="heads", dtype=dtype)
        self.out_proj = linear(inner, hidden_size, axes=("heads", "embed"), dtype=dtype, rngs=rngs)

    def _project(self, x: Float[Array, "B T D"], conv_buffer, cu_seqlens):
        """q, k, v `[B, T, H, d]` (SiLU applied) and no convolution buffer."""
        B, T, _ = x.shape
        qkv = jax.nn.silu(self.qkv_proj(x)).reshape(B, T, self.num_heads, 3 * self.qk_head_dim)
        q, k, v = jnp.split(qkv.astype(self.dtype), 3, axis=-1)
        return q, k, v, None

    def _decays(self, x: Float[Array, "B T D"]) -> dict:
        wide = jnp.promote_types(self.dtype, jnp.float32)  # float64 models: the same rates, not rounded again
        return {"g_gamma": -slope_rates(self.num_heads, self.layer_idx, self.num_layers).astype(wide)}

    def _output(self, o: Float[Array, "B T H d"], x: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
        B, T = o.shape[:2]
        o = self.norm(o.reshape(B, T, -1).astype(self.dtype))
        return self.out_proj(jax.nn.sigmoid(self.output_gate(x)) * o)


class MiniMaxAttention(HFAttention):
    """Mixtral's attention (`HFAttention`, no biases) with an optional sliding window.

    **Arguments:** `hidden_size`, `num_heads`, `num_kv_heads`, `head_dim`, `rotary_dim`,
    `rope_theta`; `window` (`sliding_window`, None for none); `dtype`, `rngs`.
    """

    def __init__(self, hidden_size: int, *, num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int,
                 rope_theta: float, window: int | None, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         rotary_dim=rotary_dim, rope_theta=rope_theta, dtype=dtype, rngs=rngs)
        self.window_size = window


class SparseMoeBlock(nnx.Module):
    """`gate` (softmax over E, top k renormalised) and the stacked SwiGLU `experts`."""

    def __init__(self, hidden_size: int, *, experts: int, width: int, top_k: int, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.gate = SoftmaxRouter(hidden_size, experts, top_k=top_k, renormalize=True, dtype=dtype, rngs=rngs)
        self.experts = StackedSwiGLUExperts(hidden_size, experts, width, dtype=dtype, rngs=rngs)

    def __call__(self, x: Float[Array, "... D"], *, all_experts: bool = False) -> Float[Array, "... D"]:
        """The layer's output; `all_experts`: every expert on every token (the test oracle)."""
        flat = x.reshape(-1, x.shape[-1])
        return self.experts(flat, self.gate(flat), all_experts=all_experts).reshape(x.shape)


class DecoderLayer(nnx.Module):
    """`input_layernorm`, `self_attn` (Lightning or softmax attention), `post_attention_layernorm`,
    `mlp`; each sublayer's output is added to its normed input, scaled by the layer's factors."""

    def __init__(self, spec: dict, layer_idx: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        D, eps, common = spec["hidden_size"], spec["eps"], dict(dtype=dtype, rngs=rngs)
        self.lightning = spec["layers"][layer_idx] == "linear_attention"
        self.input_layernorm = RMSNorm(D, eps=eps, dtype=dtype)
        if self.lightning:
            self.self_attn = MiniMaxLightningAttention(D, **spec["linear_attention"], layer_idx=layer_idx, **common)
        else:
            self.self_attn = MiniMaxAttention(D, **spec["full_attention"], **common)
        self.post_attention_layernorm = RMSNorm(D, eps=eps, dtype=dtype)
        self.mlp = SparseMoeBlock(D, **spec["moe"], **common)
        kind, f = "linear_attn" if self.lightning else "full_attn", spec["factors"]
        self.attn_factors = (f[f"{kind}_alpha_factor"], f[f"{kind}_beta_factor"])
        self.mlp_factors = (f["mlp_alpha_factor"], f["mlp_beta_factor"])
        self.dtype = dtype

    def init_cache(self, rows: int, capacity: int) -> MixerCache | KVCache:
        if self.lightning:
            return self.self_attn.init_cache(rows, jnp.promote_types(self.dtype, jnp.float32))
        return self.self_attn.init_cache(rows, capacity)

    def __call__(self, h, cache=None, *, cu_seqlens=None, positions=None):
        x = self.input_layernorm(h)
        context = dict(cu_seqlens=cu_seqlens) if self.lightning else dict(cu_seqlens=cu_seqlens, positions=positions)
        y, new_cache = run_mixer(self.self_attn, x, cache, context)
        alpha, beta = self.attn_factors
        x = self.post_attention_layernorm(x * alpha + y * beta)
        alpha, beta = self.mlp_factors
        return x * alpha + self.mlp(x) * beta, new_cache


class Body(DecoderBody):
    """`embed_tokens`, `layers`, `norm`: the `model` of a `MiniMaxForCausalLM`."""

    def __init__(self, spec: dict, *, dtype=jnp.float32, rngs: nnx.Rngs):
        layers = lambda: [DecoderLayer(spec, i, dtype=dtype, rngs=rngs) for i in range(len(spec["layers"]))]  # noqa
        super().__init__(spec, layers, RMSNorm, dtype=dtype, rngs=rngs)


# ----------------------------------------------------------------------------------------------
# Checkpoint names
# ----------------------------------------------------------------------------------------------

MIXTRAL_EXPERT = re.compile(r"^(?P<layer>.+)\.block_sparse_moe\.experts\.(?P<index>\d+)\.(?P<w>w[123])\.weight$")
MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""Mixtral's expert matrices → `transformers`' per-expert names (gate, up, down)."""
STACKED = re.compile(r"^(?P<layer>.+)\.mlp\.experts\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
DERIVED = re.compile(r"\.self_attn\.(slope_rate|query_decay|key_decay|diagonal_decay)$")
"""The Lightning layers' decay buffers: functions of the config."""


def loaded_names(weights: dict) -> dict:
    """A checkpoint's tensors under this module tree's names: `block_sparse_moe.` read as `mlp.`,
    each expert's `w1`/`w3`/`w2` (as `transformers` saves them) or the fused `gate_up_proj` /
    `down_proj` (as its model holds them) stacked per projection (`layers._mlp.stacked_experts`);
    the Lightning decay buffers dropped. Experts numbered other than 0 … E−1 are left as they
    are (the loader then names them)."""
    renamed = {}
    for name, value in weights.items():
        if DERIVED.search(name):
            continue
        if match := MIXTRAL_EXPERT.match(name):
            name = f"{match['layer']}.mlp.experts.{match['index']}.{MIXTRAL_PROJ[match['w']]}.weight"
        renamed[name.replace(".block_sparse_moe.", ".mlp.")] = value
    return stacked_experts(renamed)


def saved_names(weights: dict) -> dict:
    """The state dict as `transformers` 5.25 writes it: `block_sparse_moe.gate.weight` and each
    expert's `block_sparse_moe.experts.{e}.w1` / `w3` / `w2` `.weight`."""
    out, proj_to_w = {}, {proj: w for w, proj in MIXTRAL_PROJ.items()}
    for name, value in weights.items():
        if match := STACKED.match(name):
            out.update({f"{match['layer']}.block_sparse_moe.experts.{e}.{proj_to_w[match['proj']]}.weight":
                        np.ascontiguousarray(value[e]) for e in range(value.shape[0])})
        else:
            out[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = value
    return out


def saved_buffers(config: dict, weights: dict) -> dict:
    """The Lightning layers' decay buffers as `transformers` 5.25 saves them (float32 values as
    its `exp` rounds them, in the dtype of the other weights), from the config."""
    spec = resolve(config)
    dtype, b = weights["model.embed_tokens.weight"].dtype, spec["block_size"]
    H, L = spec["linear_attention"]["num_heads"], len(spec["layers"])
    positions = np.arange(1, b + 1, dtype=np.float32)  # 1 … b inside a block
    exp = lambda x: np.exp(x.astype(np.float64)).astype(np.float32)  # noqa: E731  (torch's float32 exp)
    out = {}
    for layer, kind in enumerate(spec["layers"]):
        if kind != "linear_attention":
            continue
        slope = _slope_rates(H, layer, L)[:, None, None]  # [H, 1, 1]
        gaps = slope * (positions[:, None] - positions[None, :])[None, None]  # [1, H, b, b]
        buffers = dict(slope_rate=slope, query_decay=exp(-slope * positions[:, None]),
                       key_decay=exp(-slope * (b - positions[:, None])),
                       diagonal_decay=exp(np.where(gaps >= 0, -gaps, -np.inf)))
        out.update({f"model.layers.{layer}.self_attn.{name}": np.ascontiguousarray(value.astype(dtype))
                    for name, value in buffers.items()})
    return out
