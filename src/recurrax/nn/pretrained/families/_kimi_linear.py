"""Kimi Linear as `transformers` 5.25 computes it: `KimiLinearForCausalLM` (`kimi_linear`). This
module is the family: its config reading, its blocks and its body; `_config.FAMILY_MODULES`
registers it by `model_type`. Ling (`families/_bailing_hybrid.py`) reuses its decoder layer, MoE
and body; its KDA and MLA are the shared `layers/_kda.py` and `layers/_mla.py`.

| symbol   | meaning                                                                  |
|----------|--------------------------------------------------------------------------|
| D        | `hidden_size`                                                            |
| H, K     | KDA heads and head dim (`linear_attn_config`'s `num_heads`, `head_dim`)  |
| E, k, F  | routed experts `num_experts`, `num_experts_per_token`, `moe_intermediate_size` |
| G, g     | expert groups `num_expert_group`, groups kept per token `topk_group`     |
| s        | `routed_scaling_factor`                                                  |
| N(x)     | RMS norm `x / rms(x) ⊙ w`                                                |

    h = E[tokens]
    per layer:  h = h + mixer(N(h));  h = h + ffn(N(h))      mixer: KDA or MLA; ffn: MLP or MoE
    logits = N(h) W_head                                     (W_head = Eᵀ with tie_word_embeddings)

    KDA (`linear_attention` layers): `layers/_kda.KimiDeltaAttention`, low-rank gates (f_a/f_b, g_a/g_b)
    MLA (`full_attention` layers):  `layers/_mla.LatentAttention` without rotary (Kimi's NoPE)
    MLP:  W_down(silu(x W_gate) ⊙ x W_up)
    MoE:  sigmoid scores σ = sigmoid(x W_router); experts chosen on σ + bias among the g best of
          G groups (each scored by its two best), weighted by σ (÷ their sum with
          `moe_renormalize`) · s; SwiGLU experts on the routed pairs only (`routed_experts`),
          plus the shared experts (one SwiGLU MLP of width F · `num_shared_experts`); a layer's
          `swiglu_limits` (Ling's spec only) clip the routed and the shared experts (`GatedMLP`)

Which layers are what: `layer_types`, else `linear_attn_config`'s 1-indexed `kda_layers` and
`full_attn_layers` (the Hub's spelling), else attention at every 4th layer from the 5th
(`transformers`' default); `mlp_layer_types` (`dense`/`sparse`), else the first
`first_k_dense_replace` (default 1) layers dense. The Hub's config names are read as
`transformers` maps them (`num_experts`, `num_experts_per_token`, `moe_renormalize`,
`num_expert_group`, `num_shared_experts`, `model_max_length`), as are its own.

`tie_word_embeddings` is read and ignored, as `transformers` 5.25 ignores it: its
`KimiLinearForCausalLM` declares no tied weights, so its `lm_head.weight` is always its own (and
saved).

Refused by name at load time: a `hidden_act` other than SiLU; `num_key_value_heads` other
than `num_attention_heads` (MLA expands every head from the latent); options the Hub's own
modelling code knows and `transformers` 5.25 ignores, so that no config silently computes
another model: `mla_use_nope: false` (rotary MLA), `moe_router_activation_func` other than
sigmoid, `moe_layer_freq` other than 1, `use_grouped_topk: false` with more than one group,
`linear_attn_config`'s `gate_lower_bound`, `use_full_rank_gate`, and `mla_use_output_gate: true`.

Decoding: a KDA layer's cache is a `MixerCache` (state `[R, H, K, K]`, convolution buffer
`[R, W − 1, 3·H·K]`); an MLA layer's an `MLACache` (the latent `[R, L, kv_lora_rank]` and the
rope key `[R, L, qk_rope_head_dim]`, not full keys and values). `transformers`' own cache
agrees with its parallel forward to float32 rounding (the fixtures' summaries record it).

Checkpoints: the Hub's and `transformers`' `save_pretrained` name them alike (MoE layers under
`block_sparse_moe.`, each expert's `w1` (gate), `w3` (up), `w2` (down), the forget gate's
`f_a_proj`, `f_b_proj`, `dt_bias`, `A_log` directly under `self_attn`, three short convolutions
`q_conv1d`, `k_conv1d`, `v_conv1d`) except for the dense layers' MLP: the Hub's
`mlp.{gate,up,down}_proj`, `transformers`' `block_sparse_moe.{gate,up,down}_proj`. Both are
read (`loaded_names`), and `transformers`' model state dict too (`mlp.experts.gate_up_proj
[E, 2F, D]`, `down_proj [E, D, F]`); this module tree holds `transformers`' model names with
the experts stacked (`mlp.experts.{gate,up,down}_proj.weight [E, out, in]`), and writes what
`transformers` writes (`saved_names`).
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from .._config_checks import _check_fields, _is_int, _refuse, decode_floats
from ..layers._decoder import DecoderBody
from ..layers._kda import KimiDeltaAttention
from ..layers._mixer import run_mixer
from ..layers._mla import LatentAttention
from ..layers._mlp import (GatedMLP, NemotronRouter, StackedSwiGLUExperts, expand_matching, per_expert,
                           stacked_experts)
from ..layers._norm import RMSNorm

MODEL_TYPES = ("kimi_linear",)
BODY_NAME = "model"
MULTIMODAL: dict = {}

DEFAULTS = dict(
    vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=27,
    num_attention_heads=32, num_key_value_heads=None, num_shared_experts=1, routed_scaling_factor=2.446,
    kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
    num_expert_group=1, topk_group=1, num_experts_per_token=8, moe_renormalize=True, hidden_act="silu",
    model_max_length=1048576, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, num_experts=256,
    mlp_layer_types=None, layer_types=None, linear_head_dim=128, linear_num_heads=32, linear_conv_kernel_dim=4,
    first_k_dense_replace=1, linear_attn_config=None)
"""Defaults of `transformers` 5.25's `KimiLinearConfig` (the keys read here, by their stored names)."""

ALIASES = {"max_position_embeddings": "model_max_length", "norm_topk_prob": "moe_renormalize",
           "n_group": "num_expert_group", "num_local_experts": "num_experts",
           "num_experts_per_tok": "num_experts_per_token", "n_shared_experts": "num_shared_experts"}
"""`KimiLinearConfig.attribute_map`: a name `transformers` also accepts → the name it stores."""

POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "num_shared_experts", "kv_lora_rank",
                 "qk_nope_head_dim", "v_head_dim", "num_expert_group", "topk_group", "num_experts_per_token",
                 "model_max_length", "num_experts", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim")
BOOLS = ("tie_word_embeddings", "attention_bias", "moe_renormalize")
LAYER_TYPES = ("linear_attention", "full_attention")
MLP_TYPES = ("dense", "sparse")
IGNORED_BY_TRANSFORMERS = {  # field: the only value accepted (what transformers 5.25 computes)
    "mla_use_nope": True, "moe_router_activation_func": "sigmoid", "moe_layer_freq": 1}
LINEAR_ATTN_REFUSED = {"gate_lower_bound": None, "use_full_rank_gate": False, "mla_use_output_gate": False}
"""`linear_attn_config` options of later Kimi models that `transformers`' `kimi_linear` ignores."""


def canonical(config: dict, aliases: dict, defaults: dict) -> dict:
    """`config` under its stored names (`aliases` read as what they map to), defaults filled in."""
    c = dict(decode_floats(config))
    for alias, stored in aliases.items():
        if alias in c and stored not in c:
            c[stored] = c[alias]
    return {**defaults, **c}


def refuse_ignored(c: dict, ignored: dict, family: str) -> None:
    """Refuse `hidden_act` other than SiLU, and a value of a field of `ignored` other than the one
    `transformers`' `family` computes whatever the config says."""
    if c["hidden_act"] not in ("silu", "swish"):
        raise NotImplementedError(f"only hidden_act='silu' is supported (the MLPs and the short convolutions use "
                                  f"it), got {c['hidden_act']!r}")
    for field, accepted in ignored.items():
        if c.get(field, accepted) not in (None, accepted):
            raise NotImplementedError(f"config field {field!r} = {c[field]!r} is not supported: transformers' "
                                      f"{family} computes {field}={accepted!r} whatever it says")


def _unsupported(c: dict) -> None:
    """Options `transformers` 5.25 ignores (or cannot compute), refused by name."""
    refuse_ignored(c, IGNORED_BY_TRANSFORMERS, "kimi_linear")
    if c.get("use_grouped_topk") is False and c["num_expert_group"] > 1:
        raise NotImplementedError("config field 'use_grouped_topk' = False with num_expert_group > 1 is not "
                                  "supported: transformers' kimi_linear always limits the choice to groups")
    for field, accepted in LINEAR_ATTN_REFUSED.items():
        value = (c["linear_attn_config"] or {}).get(field, accepted)
        if value != accepted:
            raise NotImplementedError(f"linear_attn_config field {field!r} = {value!r} is not supported "
                                      f"(transformers' kimi_linear ignores it)")


def _check(c: dict) -> None:
    """Refuse values of the default-filled config `c` that cannot build the model (by field)."""
    _check_fields(c, POSITIVE_INTS, optional_ints=("q_lora_rank",), numbers=("rms_norm_eps",), bools=BOOLS)
    _check_fields(c, (), finite=("routed_scaling_factor",))
    if not (_is_int(c["qk_rope_head_dim"]) and c["qk_rope_head_dim"] >= 0):
        _refuse("qk_rope_head_dim", "an integer ≥ 0", c["qk_rope_head_dim"])
    if c["num_key_value_heads"] != c["num_attention_heads"]:
        _refuse("num_key_value_heads", f"num_attention_heads ({c['num_attention_heads']}): multi-head latent "
                "attention expands a key and value for every head", c["num_key_value_heads"])
    if c["linear_conv_kernel_dim"] < 2:
        _refuse("short_conv_kernel_size", "at least 2", c["linear_conv_kernel_dim"])
    experts, groups = c["num_experts"], c["num_expert_group"]
    if experts % groups or experts // groups < 2:
        _refuse("num_expert_group", f"a divisor of num_experts ({experts}) leaving at least 2 experts per group "
                "(a group is scored by its two best)", groups)
    if c["topk_group"] > groups:
        _refuse("topk_group", f"at most num_expert_group ({groups})", c["topk_group"])
    if c["num_experts_per_token"] > experts * c["topk_group"] // groups:
        _refuse("num_experts_per_token", f"at most the experts of topk_group groups "
                f"({experts * c['topk_group'] // groups})", c["num_experts_per_token"])


def _linear_attention(c: dict) -> dict:
    """`linear_attn_config` read over the top-level `linear_*` fields, as `transformers` reads it."""
    la = c["linear_attn_config"]
    if la is None:
        return c
    if not isinstance(la, dict):
        _refuse("linear_attn_config", "an object", la)
    renamed = dict(head_dim="linear_head_dim", num_heads="linear_num_heads",
                   short_conv_kernel_size="linear_conv_kernel_dim")
    return {**c, **{field: la[key] for key, field in renamed.items() if key in la}}


def layer_types(c: dict) -> list[str]:
    """Each layer's mixer: `layer_types`, else `linear_attn_config`'s 1-indexed lists, else every 4th."""
    L = c["num_hidden_layers"]
    types, la = c["layer_types"], c["linear_attn_config"] or {}
    if types is None and "full_attn_layers" in la and "kda_layers" in la:
        types = [None] * L
        for field, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            layers = la[field]
            if not (isinstance(layers, list) and all(_is_int(i) and 1 <= i <= L for i in layers)):
                _refuse(f"linear_attn_config.{field}", f"a list of layer numbers 1 … {L}", layers)
            for i in layers:
                types[i - 1] = kind
    elif types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(L)]
    return _checked_types("layer_types", types, LAYER_TYPES, L)


def mlp_types(c: dict) -> list[str]:
    """Each layer's feed-forward: `mlp_layer_types`, else the first `first_k_dense_replace` dense."""
    types = c["mlp_layer_types"]
    if types is None:
        first = c["first_k_dense_replace"]
        if not (_is_int(first) and first >= 0):
            _refuse("first_k_dense_replace", "an integer ≥ 0", first)
        types = ["dense" if i < first else "sparse" for i in range(c["num_hidden_layers"])]
    return _checked_types("mlp_layer_types", types, MLP_TYPES, c["num_hidden_layers"])


def _checked_types(field: str, types, known: tuple[str, ...], layers: int) -> list[str]:
    if not isinstance(types, list) or len(types) != layers:
        _refuse(field, f"a list of {layers} layer types", types)
    unknown = sorted(set(map(str, types)) - set(known))
    if unknown:
        raise NotImplementedError(f"unsupported {field} {unknown} (supported: {', '.join(known)})")
    return list(types)


def resolve(config: dict) -> dict:
    """The layout spec of a Kimi Linear config: widths, each layer's mixer and feed-forward, and
    the keyword arguments of each layer kind (see the module docstring)."""
    c = canonical(config, ALIASES, DEFAULTS)
    if c["num_key_value_heads"] is None:
        c["num_key_value_heads"] = c["num_attention_heads"]
    _unsupported(c)
    c = _linear_attention(c)
    _check(c)
    mixers, ffns = layer_types(c), mlp_types(c)
    spec = dict(
        family="kimi_linear", vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], eps=float(c["rms_norm_eps"]),
        tie_word_embeddings=False, max_position_embeddings=c["model_max_length"],  # `transformers` never ties
        layers=list(zip(mixers, ffns)),
        linear_attention=dict(num_heads=c["linear_num_heads"], head_dim=c["linear_head_dim"],
                              conv_kernel=c["linear_conv_kernel_dim"], eps=float(c["rms_norm_eps"]),
                              low_rank_gates=True, a_log_shape=(1, 1, c["linear_num_heads"], 1)),
        full_attention=dict(num_heads=c["num_attention_heads"], q_lora_rank=c["q_lora_rank"],
                            kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=c["qk_nope_head_dim"],
                            qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"],
                            bias=bool(c["attention_bias"]), rotary="none"),
        mlp=dict(width=c["intermediate_size"]))
    if "sparse" in ffns:
        spec["moe"] = moe_spec(c)
    return spec


def moe_spec(c: dict) -> dict:
    """`SparseMoE`'s arguments from a canonical config (Kimi's and Ling's field names)."""
    return dict(experts=c["num_experts"], width=c["moe_intermediate_size"],
                shared_width=c["moe_intermediate_size"] * c["num_shared_experts"],
                router=dict(top_k=c["num_experts_per_token"], n_group=c["num_expert_group"],
                            topk_group=c["topk_group"], norm_topk_prob=bool(c["moe_renormalize"]),
                            routed_scaling_factor=float(c["routed_scaling_factor"])))


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------

class SparseMoE(nnx.Module):
    """`gate` (sigmoid, group-limited, score-correction bias: `NemotronRouter`), `experts`,
    `shared_experts` (one SwiGLU MLP); `limits`: the routed and the shared experts' SwiGLU
    clipping (`GatedMLP`), None for none."""

    def __init__(self, hidden_size: int, *, experts: int, width: int, shared_width: int, router: dict,
                 limits: tuple[float | None, float | None] = (None, None), dtype=jnp.float32, rngs: nnx.Rngs):
        self.gate = NemotronRouter(hidden_size, experts, **router, rngs=rngs)
        self.experts = StackedSwiGLUExperts(hidden_size, experts, width, limit=limits[0], dtype=dtype, rngs=rngs)
        self.shared_experts = GatedMLP(hidden_size, shared_width, limit=limits[1], dtype=dtype, rngs=rngs)

    def __call__(self, x: Float[Array, "... D"], *, all_experts: bool = False) -> Float[Array, "... D"]:
        """The layer's output; `all_experts`: every expert on every token (the test oracle)."""
        flat = x.reshape(-1, x.shape[-1])
        routed = self.experts(flat, self.gate(flat), all_experts=all_experts).astype(x.dtype)
        return routed.reshape(x.shape) + self.shared_experts(x)


class DecoderLayer(nnx.Module):
    """`input_layernorm`, `self_attn` (KDA or MLA), `post_attention_layernorm`, `mlp` (MLP or MoE,
    its experts clipped by `limits`: `SparseMoE`)."""

    def __init__(self, spec: dict, mixer: str, ffn: str, *, limits=(None, None), dtype=jnp.float32,
                 rngs: nnx.Rngs):
        D, eps, common = spec["hidden_size"], spec["eps"], dict(dtype=dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(D, eps=eps, dtype=dtype)
        self.linear = mixer == "linear_attention"
        self.self_attn = (KimiDeltaAttention(D, **spec["linear_attention"], **common) if self.linear
                          else LatentAttention(D, **spec["full_attention"], **common))
        self.post_attention_layernorm = RMSNorm(D, eps=eps, dtype=dtype)
        self.mlp = (SparseMoE(D, **spec["moe"], limits=limits, **common) if ffn == "sparse"
                    else GatedMLP(D, **spec["mlp"], **common))
        self.dtype = dtype

    def init_cache(self, rows: int, capacity: int):
        if self.linear:
            return self.self_attn.init_cache(rows, jnp.promote_types(self.dtype, jnp.float32))
        return self.self_attn.init_cache(rows, capacity)

    def __call__(self, h, cache=None, *, cu_seqlens=None, positions=None):
        context = dict(cu_seqlens=cu_seqlens) if self.linear else dict(cu_seqlens=cu_seqlens, positions=positions)
        y, new_cache = run_mixer(self.self_attn, self.input_layernorm(h), cache, context)
        h = h + y
        return h + self.mlp(self.post_attention_layernorm(h)), new_cache


class Body(DecoderBody):
    """`embed_tokens`, `layers`, `norm`: the `model` of a Kimi Linear (or Ling) `CausalLM`; a
    layer's cache is KDA's `MixerCache` or MLA's `MLACache`; `spec["swiglu_limits"]` (Ling's, one
    `(routed, shared)` pair a layer, absent: none) clip the MoE layers' experts."""

    def __init__(self, spec: dict, *, dtype=jnp.float32, rngs: nnx.Rngs):
        limits = spec.get("swiglu_limits") or [(None, None)] * len(spec["layers"])
        super().__init__(spec, lambda: [DecoderLayer(spec, mixer, ffn, limits=pair, dtype=dtype, rngs=rngs)
                                        for (mixer, ffn), pair in zip(spec["layers"], limits)], RMSNorm,
                         dtype=dtype, rngs=rngs)


# ----------------------------------------------------------------------------------------------
# Checkpoint names
# ----------------------------------------------------------------------------------------------

PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
"""The Hub's (and `transformers`' saved) expert matrices → `transformers`' per-expert names."""
HUB_EXPERT = re.compile(r"(\.mlp\.experts\.\d+\.)(w1|w2|w3)\.weight$")
SAVED_EXPERT = re.compile(r"(\.mlp\.experts\.\d+\.)(gate_proj|up_proj|down_proj)\.weight$")
FORGET_GATE = re.compile(r"\.self_attn\.(?P<part>f_a_proj\.|f_b_proj\.|f_proj\.|dt_bias$|A_log$)")
CONVOLUTION = re.compile(r"^(?P<prefix>.+\.self_attn)\.(?P<conv>[qkv]_conv1d)\.weight$")
STACKED_CONVOLUTION = re.compile(r"^(?P<prefix>.+\.self_attn)\.conv1d\.weight$")
CONVOLUTIONS = ("q_conv1d", "k_conv1d", "v_conv1d")


def stack_convolutions(weights: dict) -> dict:
    """`weights` with each KDA layer's `q_conv1d`, `k_conv1d`, `v_conv1d` `[C, 1, W]` as one `conv1d`
    (a layer without all three keeps its names: the loader then names them)."""
    out, convs = {}, {}
    for name, value in weights.items():
        if match := CONVOLUTION.match(name):
            convs.setdefault(match["prefix"], {})[match["conv"]] = value
        else:
            out[name] = value
    for prefix, parts in convs.items():
        if set(parts) == set(CONVOLUTIONS):
            out[f"{prefix}.conv1d.weight"] = np.concatenate([np.asarray(parts[c]) for c in CONVOLUTIONS])
        else:
            out.update({f"{prefix}.{c}.weight": value for c, value in parts.items()})
    return out


def split_convolutions(weights: dict) -> dict:
    """`weights` with each stacked `conv1d` cut into `q_conv1d`, `k_conv1d`, `v_conv1d`."""
    def split(match, value):
        return {f"{match['prefix']}.{c}.weight": np.ascontiguousarray(part)
                for c, part in zip(CONVOLUTIONS, np.split(value, 3))}

    return expand_matching(weights, STACKED_CONVOLUTION, split)


def forget_gate_names(name: str) -> str:
    """The forget gate's tensors, stored under `self_attn.`, under its module `self_attn.forget_gate.`."""
    return FORGET_GATE.sub(lambda m: ".self_attn.forget_gate." + m["part"], name)


def loaded_names(weights: dict) -> dict:
    """A checkpoint's tensors (the Hub's, `transformers`' saved or its model's) under this
    module tree's names (module docstring)."""
    renamed = {}
    for name, value in weights.items():
        name = forget_gate_names(name.replace(".block_sparse_moe.", ".mlp."))
        renamed[HUB_EXPERT.sub(lambda m: m[1] + PROJECTIONS[m[2]] + ".weight", name)] = value
    return stacked_experts(stack_convolutions(renamed))


def saved_names(weights: dict) -> dict:
    """The state dict as `transformers` 5.25 writes it (module docstring)."""
    saved_projection = {v: k for k, v in PROJECTIONS.items()}
    out = {}
    for name, value in split_convolutions(per_expert(weights)).items():
        name = SAVED_EXPERT.sub(lambda m: m[1] + saved_projection[m[2]] + ".weight", name)
        out[name.replace(".mlp.", ".block_sparse_moe.").replace(".self_attn.forget_gate.", ".self_attn.")] = value
    return out
