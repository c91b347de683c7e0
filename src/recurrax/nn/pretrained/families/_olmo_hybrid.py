"""OLMo-Hybrid as `transformers` 5.25 computes it: `OlmoHybridForCausalLM` (`olmo_hybrid`), Gated
DeltaNet layers and softmax attention layers. This module is the family: its config reading,
its blocks and its body; `_config.FAMILY_MODULES` registers it by `model_type`.

| symbol   | meaning                                                                  |
|----------|--------------------------------------------------------------------------|
| B, T     | batch rows, tokens per row (packed: one row of N tokens)                 |
| D, F     | `hidden_size`, `intermediate_size`                                       |
| Hk, H    | Gated DeltaNet key heads `linear_num_key_heads`, value heads `linear_num_value_heads` |
| K, V     | their head dims `linear_key_head_dim`, `linear_value_head_dim`           |
| Ha, Hkv  | attention heads `num_attention_heads`, `num_key_value_heads`; d = `head_dim` (D / Ha) |
| N(x)     | RMS norm `x / rms(x) ⊙ w` (ε = `rms_norm_eps`)                           |

    h = E[tokens]
    linear_attention layers (pre-norm):   h = h + gdn(N(h));          h = h + mlp(N(h))
    full_attention layers (post-norm):    h = h + N(attention(h));    h = h + N(mlp(h))
    logits = N(h) W_head                                         (W_head = Eᵀ with tie_word_embeddings)
    mlp(x) = (silu(x W_gate) ⊙ x W_up) W_down

Gated DeltaNet (`linear_attention` layers), on `recurrax.nn.GatedDeltaNet`'s delta rule:

    [q | k | v] = silu(conv1d([x W_q | x W_k | x W_v]))   one depthwise convolution over 2·Hk·K + H·V
                                                          channels, no bias
    β = sigmoid(x W_b) (× 2 with `linear_allow_neg_eigval`, the default),
    g = −exp(A_log) · softplus(x W_a + dt_bias)
    o = delta_rule(q, k, v, β, g, qk_l2norm=True)         [B, T, H, V]; value head h reads key head h // (H / Hk)
    y = (o / rms(o) ⊙ w ⊙ silu(x W_g)) W_o                 the gated norm per value head, ε = 1e-5 (fla's)

Attention (`full_attention` layers): q = N(x W_q), k = N(x W_k), each norm over the whole
projection (`[Ha·d]`, `[Hkv·d]`, not per head), then heads; rotary on every channel (GPT-NeoX
halves), θ = `rope_theta`, or none (NoPE) where `rope_parameters` has `rope_theta: null`;
`y = softmax(d^{−1/2} q kᵀ, causal) v W_o`, grouped heads.

Which layers are what: `layer_types`, else every fourth layer (l % 4 = 3) is attention (the
last one if there is none); a model needs both kinds (`transformers` refuses the others too).
Absent or null head counts and dims take `transformers`' derived defaults (`linear_*_heads =
num_attention_heads`, K = ⌊0.75 · D / Hk⌋, V = 2K, Hkv = Ha). Refused by name at load time: a
`hidden_act` other than SiLU (the short convolution uses it too), rotary embeddings other than
the default (`rope_type`, `rope_scaling`), unknown layer types, head counts that do not divide.

Decoding: a `linear_attention` layer's cache is a `MixerCache` (the delta-rule state
`[R, H, K, V]` and the convolution's last `W − 1` inputs `[R, W − 1, 2·Hk·K + H·V]`, as
`transformers`' conv state), an attention layer's a `KVCache`.

Checkpoints: `transformers`' model holds one `linear_attn.conv1d.weight [2·Hk·K + H·V, 1, W]`
and the norms `input_layernorm` / `post_attention_layernorm`; checkpoints name those norms
`attention_layer_norm` / `feedforward_layer_norm` and split the convolution in three,
`q_conv1d`, `k_conv1d`, `v_conv1d`: the Hub's at the q, k and v channels (`[Hk·K]`, `[Hk·K]`,
`[H·V]`), `transformers` 5.25's `save_pretrained` in three near-equal parts (`torch.chunk`, which
cuts across q, k and v whenever V·H ≠ K·Hk). `transformers` reads either by concatenating the three;
so does `loaded_names`, which reads the model's own names too. `saved_names` writes what
`transformers` 5.25 writes, so a saved checkpoint round-trips bit for bit.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from ..._conv import CausalConv1d
from ..._gated_deltanet import GatedDeltaNet as DeltaNetLayer
from ..._gated_deltanet import initial_A_log, initial_dt_bias
from ..._mixers import MixerCache
from ..._sharding import param
from .._config_checks import _check_fields, _refuse, _rope, check_layer_types, decode_floats
from ..layers._attention import HFAttention, KVCache
from ..layers._decoder import DecoderBody
from ..layers._mixer import linear, run_mixer
from ..layers._mlp import GatedMLP
from ..layers._norm import GatedNorm, RMSNorm

MODEL_TYPES = ("olmo_hybrid",)
BODY_NAME = "model"
MULTIMODAL: dict = {}

DEFAULTS = dict(vocab_size=100352, hidden_size=3840, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=30, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=65536,
                rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, layer_types=None,
                linear_num_key_heads=None, linear_num_value_heads=None, linear_key_head_dim=None,
                linear_value_head_dim=None, linear_conv_kernel_dim=4, linear_allow_neg_eigval=True, head_dim=None)
"""Defaults of `transformers` 5.25's `OlmoHybridConfig` (the keys read here; None: derived)."""

POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "max_position_embeddings", "linear_conv_kernel_dim")
OPTIONAL_INTS = ("num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "head_dim")
BOOLS = ("tie_word_embeddings", "attention_bias", "linear_allow_neg_eigval")
LAYER_TYPES = ("linear_attention", "full_attention")
GATED_NORM_EPS = 1e-5
"""ε of the Gated DeltaNet's output norm: fixed in `transformers` (fla's `FusedRMSNormGated` default)."""


def _derived(c: dict) -> dict:
    """`c` with the head counts and dims `OlmoHybridConfig` derives when they are absent or null."""
    c = dict(c)
    Ha = c["num_attention_heads"]
    for field in ("num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads"):
        c[field] = Ha if c[field] is None else c[field]
    if c["linear_key_head_dim"] is None:
        c["linear_key_head_dim"] = int(0.75 * c["hidden_size"] / c["linear_num_key_heads"])
    if c["linear_value_head_dim"] is None:
        c["linear_value_head_dim"] = 2 * c["linear_key_head_dim"]
    if c["head_dim"] is None:
        if c["hidden_size"] % Ha:
            _refuse("num_attention_heads", f"a divisor of hidden_size ({c['hidden_size']}) without head_dim", Ha)
        c["head_dim"] = c["hidden_size"] // Ha
    return c


def _check(c: dict) -> None:
    """Refuse values of the default-filled config `c` that cannot build the model (by field)."""
    _check_fields(c, POSITIVE_INTS, optional_ints=OPTIONAL_INTS, numbers=("rms_norm_eps",), bools=BOOLS)
    if c["hidden_act"] not in ("silu", "swish"):
        raise NotImplementedError(f"only hidden_act='silu' is supported (the MLPs and the short convolution use "
                                  f"it), got {c['hidden_act']!r}")
    if c["linear_conv_kernel_dim"] < 2:
        _refuse("linear_conv_kernel_dim", "at least 2", c["linear_conv_kernel_dim"])
    check_layer_types(c, LAYER_TYPES)
    if c["layer_types"] is not None and set(c["layer_types"]) != set(LAYER_TYPES):
        _refuse("layer_types", "a list with both linear_attention and full_attention layers", c["layer_types"])


def _check_heads(c: dict) -> None:
    for heads_field, groups_field in (("linear_num_value_heads", "linear_num_key_heads"),
                                      ("num_attention_heads", "num_key_value_heads")):
        if c[heads_field] % c[groups_field]:
            _refuse(heads_field, f"a multiple of {groups_field} ({c[groups_field]})", c[heads_field])


def _mixers(c: dict) -> list[str]:
    """Each layer's token mixer: `layer_types`, else `OlmoHybridConfig`'s pattern."""
    if c["layer_types"] is not None:
        return list(c["layer_types"])
    n = c["num_hidden_layers"]
    types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    if "full_attention" not in types:
        types[-1] = "full_attention"
    if "linear_attention" not in types:
        _refuse("num_hidden_layers", "at least 2 without layer_types (one layer of each kind)", n)
    return types


def _no_positions(c: dict) -> bool:
    """NoPE: `rope_parameters` with `rope_theta: null`, where `transformers` builds no rotary
    embedding (its long-context option); a config without `rope_parameters` has the default one."""
    params = c.get("rope_parameters")
    return isinstance(params, dict) and "rope_theta" in params and params["rope_theta"] is None


def resolve(config: dict) -> dict:
    """The layout spec of an OLMo-Hybrid config: widths, each layer's mixer, and the keyword
    arguments of each layer kind (see the module docstring)."""
    c = {**DEFAULTS, **decode_floats(config)}
    _check(c)
    c = _derived(c)
    _check_heads(c)
    rotary_dim, theta = (0, 0.0) if _no_positions(c) else _rope(c, c["head_dim"], 1.0)
    eps = float(c["rms_norm_eps"])
    return dict(
        family="olmo_hybrid", vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], eps=eps,
        tie_word_embeddings=bool(c["tie_word_embeddings"]), max_position_embeddings=c["max_position_embeddings"],
        layers=_mixers(c), mlp=dict(width=c["intermediate_size"]),
        linear_attention=dict(num_k_heads=c["linear_num_key_heads"], num_v_heads=c["linear_num_value_heads"],
                              head_k_dim=c["linear_key_head_dim"], head_v_dim=c["linear_value_head_dim"],
                              conv_kernel=c["linear_conv_kernel_dim"],
                              allow_neg_eigval=bool(c["linear_allow_neg_eigval"])),
        full_attention=dict(num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
                            head_dim=c["head_dim"], bias=bool(c["attention_bias"]), rotary_dim=rotary_dim,
                            rope_theta=theta, eps=eps))


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------

class OlmoHybridGatedDeltaNet(DeltaNetLayer):
    """`transformers`' OLMo-Hybrid Gated DeltaNet: `recurrax.nn.GatedDeltaNet` (its projections,
    gates, delta rule, gated norm and decode cache) with one short convolution `conv1d` over
    `[q | k | v]` in place of three (module docstring).

    **Arguments:** `hidden_size`; `num_k_heads` (Hk), `num_v_heads` (H), `head_k_dim` (K),
    `head_v_dim` (V); `conv_kernel` (taps); `allow_neg_eigval` (β in [0, 2]); `dtype`, `rngs`.
    """

    checkpoint_params = ("A_log", "dt_bias")

    def __init__(self, hidden_size: int, *, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, allow_neg_eigval: bool, dtype=jnp.float32, rngs: nnx.Rngs):
        Hk, H, K, V = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.d_model, self.num_heads, self.num_v_heads, self.head_dim, self.head_v_dim = hidden_size, Hk, H, K, V
        self.allow_neg_eigval, self.implementation, self.dtype = allow_neg_eigval, None, dtype
        self.channels = (Hk * K, Hk * K, H * V)  # q, k, v: the convolution's channels
        project = lambda d_out: linear(hidden_size, d_out, axes=("embed", "heads"), dtype=dtype, rngs=rngs)  # noqa
        self.q_proj, self.k_proj, self.v_proj = project(Hk * K), project(Hk * K), project(H * V)
        self.a_proj, self.b_proj, self.g_proj = project(H), project(H), project(H * V)
        self.conv1d = CausalConv1d(sum(self.channels), conv_kernel, activation="silu", axis="heads", dtype=dtype,
                                   rngs=rngs)
        self.A_log = param(initial_A_log(rngs.params(), H).astype(dtype), "heads")
        self.dt_bias = param(initial_dt_bias(rngs.params(), H).astype(dtype), "heads")
        self.o_norm = GatedNorm(V, eps=GATED_NORM_EPS, dtype=dtype)
        self.o_proj = linear(H * V, hidden_size, axes=("heads", "embed"), dtype=dtype, rngs=rngs)

    def _cache_shapes(self, rows: int) -> MixerCache:
        return MixerCache((rows, self.num_v_heads, self.head_dim, self.head_v_dim),
                          (rows, self.conv1d.kernel_size - 1, sum(self.channels)))

    def _qkv(self, x: Float[Array, "B T D"], conv_buffer, cu_seqlens):
        """q, k `[B, T, Hk, K]`, v `[B, T, H, V]` (after the convolution and SiLU) and the new buffer."""
        B, T, _ = x.shape
        mixed = jnp.concatenate([proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj)], axis=-1)
        mixed, buffer = self.conv1d(mixed.astype(self.dtype), conv_buffer, cu_seqlens)
        q, k, v = jnp.split(mixed, np.cumsum(self.channels)[:-1], axis=-1)
        heads = lambda y, n: y.reshape(B, T, n, -1)  # noqa: E731
        return heads(q, self.num_heads), heads(k, self.num_heads), heads(v, self.num_v_heads), buffer


class OlmoHybridAttention(HFAttention):
    """Softmax attention with RMS norms on the whole q and k projections (before the heads are
    split), then rotary on every channel.

    **Arguments:** `hidden_size`, `num_heads`, `num_kv_heads`, `head_dim`, `bias` (all four
    projections), `rotary_dim`, `rope_theta`, `eps` (the q/k norms'), `dtype`, `rngs`.
    """

    def __init__(self, hidden_size: int, *, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 rotary_dim: int, rope_theta: float, eps: float, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, bias=bias,
                         rotary_dim=rotary_dim, rope_theta=rope_theta, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(num_heads * head_dim, eps=eps, axis="heads", dtype=dtype)
        self.k_norm = RMSNorm(num_kv_heads * head_dim, eps=eps, axis="kv_heads", dtype=dtype)

    def _project(self, x, positions):
        return self._split_heads(self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x)), self.v_proj(x), positions)


class LinearAttentionDecoderLayer(nnx.Module):
    """`input_layernorm`, `linear_attn`, `post_attention_layernorm`, `mlp` (pre-norm)."""

    def __init__(self, spec: dict, *, dtype=jnp.float32, rngs: nnx.Rngs):
        D, eps, common = spec["hidden_size"], spec["eps"], dict(dtype=dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(D, eps=eps, dtype=dtype)
        self.linear_attn = OlmoHybridGatedDeltaNet(D, **spec["linear_attention"], **common)
        self.post_attention_layernorm = RMSNorm(D, eps=eps, dtype=dtype)
        self.mlp = GatedMLP(D, **spec["mlp"], **common)
        self.dtype = dtype

    def init_cache(self, rows: int, capacity: int) -> MixerCache:
        return self.linear_attn.init_cache(rows, jnp.promote_types(self.dtype, jnp.float32))

    def __call__(self, h, cache=None, *, cu_seqlens=None, positions=None):
        y, new_cache = run_mixer(self.linear_attn, self.input_layernorm(h), cache, dict(cu_seqlens=cu_seqlens))
        h = h + y
        return h + self.mlp(self.post_attention_layernorm(h)), new_cache


class AttentionDecoderLayer(nnx.Module):
    """`self_attn`, `post_attention_layernorm`, `mlp`, `post_feedforward_layernorm` (post-norm:
    each norm on its sublayer's output, before the residual sum)."""

    def __init__(self, spec: dict, *, dtype=jnp.float32, rngs: nnx.Rngs):
        D, eps, common = spec["hidden_size"], spec["eps"], dict(dtype=dtype, rngs=rngs)
        self.self_attn = OlmoHybridAttention(D, **spec["full_attention"], **common)
        self.post_attention_layernorm = RMSNorm(D, eps=eps, dtype=dtype)
        self.mlp = GatedMLP(D, **spec["mlp"], **common)
        self.post_feedforward_layernorm = RMSNorm(D, eps=eps, dtype=dtype)

    def init_cache(self, rows: int, capacity: int) -> KVCache:
        return self.self_attn.init_cache(rows, capacity)

    def __call__(self, h, cache=None, *, cu_seqlens=None, positions=None):
        y, new_cache = run_mixer(self.self_attn, h, cache, dict(cu_seqlens=cu_seqlens, positions=positions))
        h = h + self.post_attention_layernorm(y)
        return h + self.post_feedforward_layernorm(self.mlp(h)), new_cache


class Body(DecoderBody):
    """`embed_tokens`, `layers`, `norm`: the `model` of an `OlmoHybridForCausalLM`."""

    def __init__(self, spec: dict, *, dtype=jnp.float32, rngs: nnx.Rngs):
        layer = {"linear_attention": LinearAttentionDecoderLayer, "full_attention": AttentionDecoderLayer}
        super().__init__(spec, lambda: [layer[mixer](spec, dtype=dtype, rngs=rngs) for mixer in spec["layers"]],
                         RMSNorm, dtype=dtype, rngs=rngs)


# ----------------------------------------------------------------------------------------------
# Checkpoint names
# ----------------------------------------------------------------------------------------------

CONV_PART = re.compile(r"^(?P<layer>.+\.linear_attn)\.(?P<part>[qkv])_conv1d\.weight$")
CONV = re.compile(r"^(?P<layer>.+\.linear_attn)\.conv1d\.weight$")
NORM_NAMES = {"attention_layer_norm": "input_layernorm", "feedforward_layer_norm": "post_attention_layernorm"}
"""Checkpoints' norm names → the model's (`transformers`' `WeightRenaming`s for olmo_hybrid)."""
DROPPED_PREFIXES = ("mtp.",)
"""Multi-token-prediction weights: not part of the causal LM (`transformers` ignores them)."""


def _renamed(name: str, table: dict) -> str:
    for old, new in table.items():
        name = name.replace(f".{old}.", f".{new}.")
    return name


def loaded_names(weights: dict) -> dict:
    """A checkpoint's tensors under this module tree's names: `attention_layer_norm` /
    `feedforward_layer_norm` renamed, a layer's `q_conv1d`, `k_conv1d`, `v_conv1d` concatenated
    (in that order, whatever their sizes) into its `conv1d`; `mtp.*` dropped. A layer with only
    some of the three keeps them under their names (the loader then names them)."""
    out, parts = {}, {}
    for name, value in weights.items():
        if name.startswith(DROPPED_PREFIXES):
            continue
        name = _renamed(name, NORM_NAMES)
        if match := CONV_PART.match(name):
            parts.setdefault(match["layer"], {})[match["part"]] = value
        else:
            out[name] = value
    for layer, found in parts.items():
        if sorted(found) == ["k", "q", "v"]:
            out[f"{layer}.conv1d.weight"] = np.concatenate([np.asarray(found[p]) for p in "qkv"], axis=0)
        else:
            out.update({f"{layer}.{p}_conv1d.weight": value for p, value in found.items()})
    return out


def saved_names(weights: dict) -> dict:
    """The state dict as `transformers` 5.25 writes it: the norms under the checkpoints' names,
    each `conv1d` cut into `q_conv1d`, `k_conv1d`, `v_conv1d` as `torch.chunk(w, 3)` cuts it
    (pieces of ⌈C / 3⌉ channels, the last one shorter)."""
    out = {}
    for name, value in weights.items():
        name = _renamed(name, {new: old for old, new in NORM_NAMES.items()})
        if match := CONV.match(name):
            size = -(-value.shape[0] // 3)
            out.update({f"{match['layer']}.{p}_conv1d.weight": np.ascontiguousarray(value[i * size:(i + 1) * size])
                        for i, p in enumerate("qkv")})
        else:
            out[name] = value
    return out

