"""Qwen3-Next and Qwen3.5 (dense and MoE text models) as `transformers` 5.25 computes them:
`Qwen3NextForCausalLM` (`qwen3_next`), `Qwen3_5ForCausalLM` (`qwen3_5_text`) and the Qwen3.5
MoE text model (`qwen3_5_moe_text`). This module is the family: its config reading, its
blocks and its body; `_config.FAMILY_MODULES` registers it by `model_type`.

| symbol   | meaning                                                                  |
|----------|--------------------------------------------------------------------------|
| B, T     | batch rows, tokens per row (packed: one row of N tokens)                 |
| D        | `hidden_size`                                                            |
| Hk, H    | Gated DeltaNet key heads `linear_num_key_heads`, value heads `linear_num_value_heads`; G = H / Hk |
| K, V     | their head dims `linear_key_head_dim`, `linear_value_head_dim`           |
| Ha, Hkv  | attention heads `num_attention_heads`, `num_key_value_heads`; d = `head_dim` |
| r        | rotated channels per attention head, `int(d · partial_rotary_factor)`    |
| E, k, F  | routed experts `num_experts`, `num_experts_per_tok`, `moe_intermediate_size` |
| N(x)     | zero-centred RMS norm `x / rms(x) ⊙ (1 + w)`                             |

    h = E[tokens]
    per layer:  h = h + mixer(N(h));  h = h + ffn(N(h))          mixer by `layer_types`, ffn: MLP or MoE
    logits = N(h) W_head                                         (W_head = Eᵀ with tie_word_embeddings)

Gated DeltaNet (`linear_attention` layers), on `recurrax.nn.GatedDeltaNet`'s delta rule:

    qwen3_next:  [q | k | v | z]_j = (x W_qkvz)_j  for each key head j: [K | K | G·V | G·V]
                 [b | a]_j = (x W_ba)_j                                  [G | G]
                 (value head j·G + i reads key head j; q, k, v concatenated head after head)
    qwen3_5:     [q | k | v] = x W_qkv,  z = x W_z,  b = x W_b,  a = x W_a
    [q | k | v] = silu(conv1d([q | k | v]))                one depthwise convolution over 2·Hk·K + H·V channels
    β = sigmoid(b),  g = −exp(A_log) · softplus(a + dt_bias)
    o = delta_rule(q, k, v, β, g, qk_l2norm=True)          [B, T, H, V]
    y = (o / rms(o) ⊙ w ⊙ silu(z)) W_out                   the gated norm per value head (w, not 1 + w)

Gated softmax attention (`full_attention` layers):

    [q | gate]_h = (x W_q)_h  per head [d | d];   q = N(q), k = N(x W_k) per head (q/k norms)
    q, k rotated on their first r channels (GPT-NeoX halves of those r), θ = `rope_theta`
    y = (softmax(d^{−1/2} q kᵀ, causal) v ⊙ sigmoid(gate)) W_o

MoE (`SparseMoeBlock`): softmax router over E, the top k (renormalised with `norm_topk_prob`;
always in Qwen3.5), SwiGLU experts computed only for the routed pairs (`recurrax.nn`'s
`routed_experts`), plus `sigmoid(x w_shared_gate) · shared_expert(x)`.

Which layers are what: `layer_types`, else every `full_attention_interval`-th layer (default
4) is attention; in Qwen3-Next a layer has the MoE unless it is in `mlp_only_layers`, there
are no experts, or `(l + 1) % decoder_sparse_step ≠ 0`. Qwen3.5 dense: always the MLP;
Qwen3.5 MoE: always the MoE. Refused by name at load time: a `hidden_act` other than SiLU
(the short convolution uses it too), rotary embeddings other than the default (`rope_type`,
`rope_scaling`), unknown layer types.

Decoding: a `linear_attention` layer's cache is a `MixerCache` (the delta-rule state
`[R, H, K, V]` and the convolution's last `W − 1` inputs `[R, W − 1, 2·Hk·K + H·V]`, as
`transformers`' conv state), an attention layer's a `KVCache`. Qwen3.5's multimodal rotary
(`mrope_section`) rotates text tokens as the plain rotary does (their three position ids are
equal), so text-only models need no more.

Checkpoints: `transformers` writes each expert's matrices on their own
(`mlp.experts.{e}.gate_proj.weight`), its models hold them fused (`mlp.experts.gate_up_proj
[E, 2F, D]`, `mlp.experts.down_proj [E, D, F]`); both are read (`loaded_names`) into the
stacked `mlp.experts.{gate,up,down}_proj.weight [E, out, in]` here, and written as
`transformers` writes them (`saved_names`). The multi-token-prediction weights of published
checkpoints (`mtp.*`) are not part of the causal LM and are dropped, as `transformers` does.
The Hub's Qwen3.5 checkpoints are multimodal (`qwen3_5`, `qwen3_5_moe`: `text_config`, the text
model under `model.language_model.`, a vision tower under `model.visual.`): `from_pretrained`
reads their text model (`text_model_config`) and saves it as the text model it is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from ..._conv import CausalConv1d
from ..._gated_deltanet import GatedDeltaNet as DeltaNetLayer
from ..._gated_deltanet import initial_A_log
from ..._mixers import MixerCache
from ..._sharding import param
from .._config_checks import _check_fields, _is_int, _refuse, _rope, check_layer_types, decode_floats, rope_parameters
from ..layers._attention import HFAttention, KVCache
from ..layers._decoder import DecoderBody
from ..layers._mixer import heads, linear, run_mixer
from ..layers._mlp import GatedMLP, per_expert, stacked_experts
from ..layers._mlp import SoftmaxRouter as Router
from ..layers._mlp import StackedSwiGLUExperts as Experts
from ..layers._norm import GatedNorm, ZeroCentredRMSNorm

MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
BODY_NAME = "model"
MULTIMODAL = {"qwen3_5": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
              "qwen3_5_moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")}
"""The Hub's Qwen3.5 checkpoints (`...ForConditionalGeneration`): their text model's `model_type`
and causal LM class."""

_COMMON = dict(hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
               attention_bias=False, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
               linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, layer_types=None,
               full_attention_interval=4)
DEFAULTS = {
    "qwen3_next": dict(_COMMON, vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
                       num_attention_heads=16, num_key_value_heads=2, decoder_sparse_step=1,
                       moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts_per_tok=10,
                       num_experts=512, norm_topk_prob=True, mlp_only_layers=[]),
    "qwen3_5_text": dict(_COMMON, vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                         num_attention_heads=16, num_key_value_heads=4),
    "qwen3_5_moe_text": dict(_COMMON, vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
                             num_attention_heads=16, num_key_value_heads=2, moe_intermediate_size=512,
                             shared_expert_intermediate_size=512, num_experts_per_tok=8, num_experts=256),
}
"""Defaults of `transformers` 5.25's config classes (the keys read here), per `model_type`."""

POSITIVE_INTS = ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads", "intermediate_size",
                 "decoder_sparse_step", "moe_intermediate_size", "shared_expert_intermediate_size",
                 "num_experts_per_tok", "full_attention_interval")
BOOLS = ("tie_word_embeddings", "attention_bias", "norm_topk_prob")
LAYER_TYPES = ("linear_attention", "full_attention")


def _check(c: dict) -> None:
    """Refuse values of the default-filled config `c` that cannot build the model (by field)."""
    _check_fields(c, POSITIVE_INTS, numbers=("rms_norm_eps",), bools=BOOLS)
    if c["hidden_act"] not in ("silu", "swish"):
        raise NotImplementedError(f"only hidden_act='silu' is supported (the MLPs and the short convolution use "
                                  f"it), got {c['hidden_act']!r}")
    if c["linear_conv_kernel_dim"] < 2:
        _refuse("linear_conv_kernel_dim", "at least 2", c["linear_conv_kernel_dim"])
    for heads_field, groups_field in (("linear_num_value_heads", "linear_num_key_heads"),
                                      ("num_attention_heads", "num_key_value_heads")):
        if c[heads_field] % c[groups_field]:
            _refuse(heads_field, f"a multiple of {groups_field} ({c[groups_field]})", c[heads_field])
    experts = c.get("num_experts", 0)
    if not (_is_int(experts) and experts >= (1 if c["model_type"] == "qwen3_5_moe_text" else 0)):
        _refuse("num_experts", "a positive integer" if c["model_type"] == "qwen3_5_moe_text" else "an integer ≥ 0 "
                "(0: a dense MLP in every layer)", experts)
    if experts and c["num_experts_per_tok"] > experts:
        _refuse("num_experts_per_tok", f"at most num_experts ({experts})", c["num_experts_per_tok"])
    only = c.get("mlp_only_layers", [])
    if not (isinstance(only, list) and all(_is_int(i) for i in only)):
        _refuse("mlp_only_layers", "a list of layer indices", only)
    check_layer_types(c, LAYER_TYPES)


def _mixers(c: dict) -> list[str]:
    """Each layer's token mixer: `layer_types`, else attention every `full_attention_interval` layers."""
    if c["layer_types"] is not None:
        return list(c["layer_types"])
    every = c["full_attention_interval"]
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(c["num_hidden_layers"])]


def _ffns(c: dict) -> list[str]:
    """Each layer's feed-forward: `mlp` or `moe`, as `transformers`' decoder layers choose."""
    layers, family = range(c["num_hidden_layers"]), c["model_type"]
    if family == "qwen3_5_text":
        return ["mlp" for _ in layers]
    if family == "qwen3_5_moe_text":
        return ["moe" for _ in layers]
    sparse = lambda i: (i not in c["mlp_only_layers"] and c["num_experts"] > 0  # noqa: E731
                        and (i + 1) % c["decoder_sparse_step"] == 0)
    return ["moe" if sparse(i) else "mlp" for i in layers]


def resolve(config: dict) -> dict:
    """The layout spec of a Qwen3-Next / Qwen3.5 text config: widths, each layer's mixer and
    feed-forward, and the keyword arguments of each layer kind (see the module docstring)."""
    family = config["model_type"]
    c = {**DEFAULTS[family], **decode_floats(config)}
    _check(c)
    rotary_dim, theta = _rope(c, c["head_dim"], _partial_rotary_factor(c))
    ffns = _ffns(c)
    spec = dict(
        family=family, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], eps=float(c["rms_norm_eps"]),
        tie_word_embeddings=bool(c["tie_word_embeddings"]), max_position_embeddings=c["max_position_embeddings"],
        layers=list(zip(_mixers(c), ffns)),
        linear_attention=dict(num_k_heads=c["linear_num_key_heads"], num_v_heads=c["linear_num_value_heads"],
                              head_k_dim=c["linear_key_head_dim"], head_v_dim=c["linear_value_head_dim"],
                              conv_kernel=c["linear_conv_kernel_dim"], eps=float(c["rms_norm_eps"]),
                              fused=family == "qwen3_next"),
        full_attention=dict(num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
                            head_dim=c["head_dim"], bias=bool(c["attention_bias"]), rotary_dim=rotary_dim,
                            rope_theta=theta, eps=float(c["rms_norm_eps"])))
    if "mlp" in ffns:
        spec["mlp"] = dict(width=c["intermediate_size"])
    if "moe" in ffns:
        spec["moe"] = dict(experts=c["num_experts"], width=c["moe_intermediate_size"], top_k=c["num_experts_per_tok"],
                           shared_width=c["shared_expert_intermediate_size"],
                           renormalize=family == "qwen3_5_moe_text" or bool(c["norm_topk_prob"]))
    return spec


def text_model_config(config: dict) -> dict:
    """The text model's config of a multimodal Qwen3.5 config.json: its `text_config` (with the
    top-level `tie_word_embeddings`), as `Qwen3_5ForCausalLM` would save it. Its weights are read
    from under `model.language_model.` (`loaded_names`); the vision tower is not loaded."""
    model_type, architecture = MULTIMODAL[config["model_type"]]
    text = config.get("text_config")
    if not isinstance(text, dict):
        _refuse("text_config", f"an object (the text model of a {config['model_type']} checkpoint)", text)
    tied = {"tie_word_embeddings": config["tie_word_embeddings"]} if "tie_word_embeddings" in config else {}
    return {**text, **tied, "model_type": model_type, "architectures": [architecture]}


def _partial_rotary_factor(c: dict) -> float:
    """`partial_rotary_factor` from `rope_parameters` or the top level (older configs), default 1/4."""
    factor = rope_parameters(c).get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))
    if not (isinstance(factor, (int, float)) and not isinstance(factor, bool) and 0 < factor <= 1):
        _refuse("partial_rotary_factor", "a number in (0, 1]", factor)
    return float(factor)


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------

class Qwen3NextGatedDeltaNet(DeltaNetLayer):
    """`transformers`' Qwen3-Next / Qwen3.5 Gated DeltaNet: `recurrax.nn.GatedDeltaNet`'s delta
    rule and decode cache behind `transformers`' fused projections and one short convolution
    (module docstring). `fused`: Qwen3-Next's `in_proj_qkvz` / `in_proj_ba` in per-key-head
    order; else Qwen3.5's `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.

    **Arguments:** `hidden_size`; `num_k_heads` (Hk), `num_v_heads` (H), `head_k_dim` (K),
    `head_v_dim` (V); `conv_kernel` (taps); `eps` (the gated norm's); `fused`; `dtype`, `rngs`.
    """

    checkpoint_params = ("A_log", "dt_bias")

    def __init__(self, hidden_size: int, *, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, eps: float, fused: bool, dtype=jnp.float32, rngs: nnx.Rngs):
        Hk, H, K, V = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.d_model, self.num_heads, self.num_v_heads, self.head_dim, self.head_v_dim = hidden_size, Hk, H, K, V
        self.allow_neg_eigval, self.implementation, self.dtype, self.fused = False, None, dtype, fused
        self.channels = (Hk * K, Hk * K, H * V)  # q, k, v: the convolution's channels
        project = lambda d_out: linear(hidden_size, d_out, axes=("embed", "heads"), dtype=dtype, rngs=rngs)  # noqa
        if fused:
            self.in_proj_qkvz, self.in_proj_ba = project(2 * Hk * K + 2 * H * V), project(2 * H)
        else:
            self.in_proj_qkv, self.in_proj_z = project(sum(self.channels)), project(H * V)
            self.in_proj_b, self.in_proj_a = project(H), project(H)
        self.conv1d = CausalConv1d(sum(self.channels), conv_kernel, activation="silu", axis="heads", dtype=dtype,
                                   rngs=rngs)
        self.dt_bias = param(jnp.ones((H,), dtype), "heads")
        self.A_log = param(initial_A_log(rngs.params(), H).astype(dtype), "heads")
        self.norm = GatedNorm(V, eps=eps, dtype=dtype)
        self.out_proj = linear(H * V, hidden_size, axes=("heads", "embed"), dtype=dtype, rngs=rngs)

    def _mix(self, x: Float[Array, "B T D"], cache: MixerCache | None, cu_seqlens):
        B, T, _ = x.shape
        mixed, z, b, a = self._project(x)
        mixed, conv = self.conv1d(mixed.astype(self.dtype), None if cache is None else cache.conv, cu_seqlens)
        q, k, v = jnp.split(mixed, np.cumsum(self.channels)[:-1], axis=-1)
        q, k, v = q.reshape(B, T, self.num_heads, -1), k.reshape(B, T, self.num_heads, -1), heads(v, self.head_v_dim)
        beta, g = self._gates_from(b, a)
        o, state = self._delta(q, k, v, beta, g, None if cache is None else cache.state, cu_seqlens)
        return self.out_proj(self.norm(o, z).reshape(B, T, -1)), MixerCache(state, conv)

    def _cache_shapes(self, rows: int) -> MixerCache:
        return MixerCache((rows, self.num_v_heads, self.head_dim, self.head_v_dim),
                          (rows, self.conv1d.kernel_size - 1, sum(self.channels)))

    def _project(self, x: Float[Array, "B T D"]):
        """`[q | k | v]` `[B, T, 2·Hk·K + H·V]` (before the convolution), z `[B, T, H, V]`, b and a `[B, T, H]`."""
        B, T, _ = x.shape
        Hk, H, K, V = self.num_heads, self.num_v_heads, self.head_dim, self.head_v_dim
        if not self.fused:
            return (self.in_proj_qkv(x), heads(self.in_proj_z(x), V), self.in_proj_b(x), self.in_proj_a(x))
        G = H // Hk
        per_key_head = self.in_proj_qkvz(x).reshape(B, T, Hk, 2 * K + 2 * G * V)
        q, k, v, z = jnp.split(per_key_head, [K, 2 * K, 2 * K + G * V], axis=-1)
        mixed = jnp.concatenate([part.reshape(B, T, -1) for part in (q, k, v)], axis=-1)
        b, a = jnp.split(self.in_proj_ba(x).reshape(B, T, Hk, 2 * G), 2, axis=-1)
        return mixed, z.reshape(B, T, H, V), b.reshape(B, T, H), a.reshape(B, T, H)

    def _gates_from(self, b, a):
        """β = sigmoid(b) and g = −exp(A_log) · softplus(a + dt_bias), in float32 or wider."""
        wide = jnp.promote_types(self.dtype, jnp.float32)
        A = jnp.exp(self.A_log[...].astype(wide))
        return jax.nn.sigmoid(b.astype(wide)), -A * jax.nn.softplus(a.astype(wide) + self.dt_bias[...].astype(wide))


class Qwen3NextAttention(HFAttention):
    """Gated softmax attention: q and an output gate from one projection (per head `[d | d]`),
    zero-centred q/k norms per head, partial rotary, `sigmoid(gate)` on the attention output.

    **Arguments:** `hidden_size`, `num_heads`, `num_kv_heads`, `head_dim`, `bias` (all four
    projections), `rotary_dim`, `rope_theta`, `eps` (the q/k norms'), `dtype`, `rngs`.
    """

    def __init__(self, hidden_size: int, *, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 rotary_dim: int, rope_theta: float, eps: float, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, bias=bias,
                         rotary_dim=rotary_dim, rope_theta=rope_theta, dtype=dtype, rngs=rngs)
        self.q_proj = linear(hidden_size, 2 * num_heads * head_dim, axes=("embed", "heads"), bias=bias, dtype=dtype,
                             rngs=rngs)
        self.q_norm = ZeroCentredRMSNorm(head_dim, eps=eps, axis="head_dim", dtype=dtype)
        self.k_norm = ZeroCentredRMSNorm(head_dim, eps=eps, axis="head_dim", dtype=dtype)

    def __call__(self, x, cache: KVCache | None = None, *, cu_seqlens=None, positions=None):
        """As `Attention`: `y = attn(x)` or `y, cache = attn(x, cache, positions=...)`."""
        x3 = x[None] if x.ndim == 2 else x
        B, T, _ = x3.shape
        query, gate = jnp.split(heads(self.q_proj(x3), 2 * self.head_dim), 2, axis=-1)  # [B, T, Ha, d] each

        def project(x3, positions):
            q = self._rotate(self.q_norm(query), positions)
            k = self._rotate(self.k_norm(heads(self.k_proj(x3), self.head_dim)), positions)
            return q, k, heads(self.v_proj(x3), self.head_dim)

        def output(o):  # [B, T, Ha·d]
            return self.o_proj(o * jax.nn.sigmoid(gate.reshape(B, T, -1)).astype(o.dtype))

        return self._attention(x, cache, cu_seqlens, positions, project, output)


class SparseMoeBlock(nnx.Module):
    """`gate` (router), `experts`, `shared_expert` (SwiGLU) and its `shared_expert_gate` (sigmoid)."""

    def __init__(self, hidden_size: int, *, experts: int, width: int, top_k: int, shared_width: int,
                 renormalize: bool, dtype=jnp.float32, rngs: nnx.Rngs):
        self.gate = Router(hidden_size, experts, top_k=top_k, renormalize=renormalize, dtype=dtype, rngs=rngs)
        self.experts = Experts(hidden_size, experts, width, dtype=dtype, rngs=rngs)
        self.shared_expert = GatedMLP(hidden_size, shared_width, dtype=dtype, rngs=rngs)
        self.shared_expert_gate = linear(hidden_size, 1, axes=("embed", None), dtype=dtype, rngs=rngs)

    def __call__(self, x: Float[Array, "... D"], *, all_experts: bool = False) -> Float[Array, "... D"]:
        """The layer's output; `all_experts`: every expert on every token (the test oracle)."""
        flat = x.reshape(-1, x.shape[-1])
        routed = self.experts(flat, self.gate(flat), all_experts=all_experts)
        shared = jax.nn.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return (routed + shared).reshape(x.shape)


class DecoderLayer(nnx.Module):
    """`input_layernorm`, `linear_attn` or `self_attn`, `post_attention_layernorm`, `mlp`."""

    def __init__(self, spec: dict, mixer: str, ffn: str, *, dtype=jnp.float32, rngs: nnx.Rngs):
        D, eps, common = spec["hidden_size"], spec["eps"], dict(dtype=dtype, rngs=rngs)
        self.input_layernorm = ZeroCentredRMSNorm(D, eps=eps, dtype=dtype)
        linear_layer = mixer == "linear_attention"
        self.linear_attn = Qwen3NextGatedDeltaNet(D, **spec["linear_attention"], **common) if linear_layer else None
        self.self_attn = None if linear_layer else Qwen3NextAttention(D, **spec["full_attention"], **common)
        self.post_attention_layernorm = ZeroCentredRMSNorm(D, eps=eps, dtype=dtype)
        self.mlp = SparseMoeBlock(D, **spec["moe"], **common) if ffn == "moe" else GatedMLP(D, **spec["mlp"], **common)
        self.dtype = dtype

    def init_cache(self, rows: int, capacity: int) -> MixerCache | KVCache:
        if self.linear_attn is not None:
            return self.linear_attn.init_cache(rows, jnp.promote_types(self.dtype, jnp.float32))
        return self.self_attn.init_cache(rows, capacity)

    def __call__(self, h, cache=None, *, cu_seqlens=None, positions=None):
        x = self.input_layernorm(h)
        if self.linear_attn is not None:
            y, new_cache = run_mixer(self.linear_attn, x, cache, dict(cu_seqlens=cu_seqlens))
        else:
            y, new_cache = run_mixer(self.self_attn, x, cache, dict(cu_seqlens=cu_seqlens, positions=positions))
        h = h + y
        return h + self.mlp(self.post_attention_layernorm(h)), new_cache


class Body(DecoderBody):
    """`embed_tokens`, `layers`, `norm`: the `model` of a Qwen3-Next / Qwen3.5 `CausalLM`."""

    def __init__(self, spec: dict, *, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(spec, lambda: [DecoderLayer(spec, mixer, ffn, dtype=dtype, rngs=rngs)
                                        for mixer, ffn in spec["layers"]],
                         ZeroCentredRMSNorm, dtype=dtype, rngs=rngs)


# ----------------------------------------------------------------------------------------------
# Checkpoint names
# ----------------------------------------------------------------------------------------------

DROPPED_PREFIXES = ("mtp.", "model.visual.")
"""Published checkpoints' multi-token-prediction weights and Qwen3.5's vision tower: not part of
the causal LM."""
LANGUAGE_MODEL = "model.language_model."
"""Where a multimodal Qwen3.5 checkpoint holds the text model's `model.`."""


def loaded_names(weights: dict) -> dict:
    """A checkpoint's tensors under this module tree's names: each expert's matrices (as
    `transformers` saves them) or the fused ones (as its models hold them) stacked per
    projection; a multimodal checkpoint's `model.language_model.` read as `model.`; `mtp.*` and
    `model.visual.*` dropped. Experts numbered other than 0 … E−1 are left as they are (the
    loader then names them)."""
    out = {}
    for name, value in weights.items():
        if name.startswith(DROPPED_PREFIXES):
            continue
        if name.startswith(LANGUAGE_MODEL):
            name = "model." + name[len(LANGUAGE_MODEL):]
        out[name] = value
    return stacked_experts(out)


def saved_names(weights: dict) -> dict:
    """The state dict as `transformers` writes it: each expert's matrices on their own."""
    return per_expert(weights)
