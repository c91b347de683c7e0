"""`transformers`' MLPs and mixtures of experts (the Mamba-2 hybrids', reused by the other families).

| symbol | meaning                                                |
|--------|--------------------------------------------------------|
| D      | `hidden_size`                                          |
| F      | an MLP's width                                         |
| E, k   | routed experts, experts per token                      |
| n      | tokens (all rows flattened)                            |

    GatedMLP        W_down(act(x W_gate · m_g) ⊙ x W_up) · m_d      Bamba, Falcon-H1 (m: Falcon's mlp_multipliers);
                    with a `limit` L, act(·) capped at L and x W_up clipped to [−L, L] (Ling's shared experts)
    PlainMLP        W_down(act(x W_up))                              Nemotron-H (relu²)
    NemotronMoE     sigmoid router with group-limited top-k and a score-correction bias; relu²
                    experts; optional latent projections; plus the shared MLP
    GraniteMoE      softmax over the top-k router logits; SwiGLU experts stored as `[E, 2F, D]`
    SoftmaxRouter   softmax over all E, the top k (renormalised or not): Qwen3-Next's, MiniMax's `gate`
    StackedSwiGLUExperts  SwiGLU experts `gate_proj`, `up_proj` `[E, F, D]`, `down_proj` `[E, D, F]`
                    (clipped as GatedMLP with a `limit`: Ling's);
                    their checkpoint names per expert or fused (`stacked_experts`, `per_expert`)
    StackedPlainExperts   the same without a gate (`up_proj`, `down_proj`): Nemotron-H's experts

The routers and the experts are `recurrax.nn`'s mixture of experts (`route`,
`routed_experts`): only the routed (token, expert) pairs are computed, as grouped matmuls.
`all_experts=True` runs every expert on every token instead (E/k times the FLOPs): the
oracle the routed path equals, kept for tests.
"""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

from ..._moe import ExpertWeights as StackedExperts
from ..._expert_blocks import glu
from ..._moe import Routing, route, routed_experts
from ..._moe import all_experts as every_expert
from ..._sharding import mesh_axis, param
from ._mixer import linear


TRANSFORMERS_ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),
    "sigmoid": jax.nn.sigmoid,
}
"""`transformers`' activations by its names (its `gelu` is the exact, erf one; fla's, in
`_norm.ACTIVATIONS`, is the tanh approximation)."""


def activation(name: str, what: str):
    """`transformers`' activation called `name`, or NotImplementedError naming `what`."""
    if name not in TRANSFORMERS_ACTIVATIONS:
        raise NotImplementedError(f"{what} must be one of {sorted(TRANSFORMERS_ACTIVATIONS)}, got {name!r}")
    return TRANSFORMERS_ACTIVATIONS[name]


class GatedMLP(nnx.Module):
    """`W_down(act(x W_gate · m_g) ⊙ x W_up) · m_d` (Bamba's and Falcon-H1's `feed_forward`); with a
    `limit` L, `W_down(min(act(x W_gate · m_g), L) ⊙ clip(x W_up, −L, L)) · m_d` (Ling's shared experts)."""

    def __init__(self, hidden_size: int, width: int, *, bias: bool = False, act: str = "silu",
                 multipliers: tuple[float, float] = (1.0, 1.0), limit: float | None = None, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.gate_proj = linear(hidden_size, width, axes=("embed", "mlp"), bias=bias, dtype=dtype, rngs=rngs)
        self.up_proj = linear(hidden_size, width, axes=("embed", "mlp"), bias=bias, dtype=dtype, rngs=rngs)
        self.down_proj = linear(width, hidden_size, axes=("mlp", "embed"), bias=bias, dtype=dtype, rngs=rngs)
        self.act, self.multipliers, self.limit = act, tuple(float(m) for m in multipliers), limit
        activation(act, "hidden_act")

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        gate_multiplier, down_multiplier = self.multipliers
        y = glu(activation(self.act, "hidden_act"), self.limit, self.gate_proj(x) * gate_multiplier, self.up_proj(x))
        return self.down_proj(y) * down_multiplier


class PlainMLP(nnx.Module):
    """`W_down(act(x W_up))` (Nemotron-H's MLP layers and shared experts)."""

    def __init__(self, hidden_size: int, width: int, *, bias: bool = False, act: str = "relu2",
                 dtype=jnp.float32, rngs: nnx.Rngs):
        self.up_proj = linear(hidden_size, width, axes=("embed", "mlp"), bias=bias, dtype=dtype, rngs=rngs)
        self.down_proj = linear(width, hidden_size, axes=("mlp", "embed"), bias=bias, dtype=dtype, rngs=rngs)
        self.act = act
        activation(self.act, "mlp_hidden_act")

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        return self.down_proj(activation(self.act, "mlp_hidden_act")(self.up_proj(x)))


class NemotronRouter(nnx.Module):
    """Nemotron-H's `gate`: sigmoid scores, top-k within the best `topk_group` of `n_group` groups
    (chosen with the correction bias), weights from the uncorrected scores."""

    checkpoint_params = ("weight", "e_score_correction_bias")

    def __init__(self, hidden_size: int, experts: int, *, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float, rngs: nnx.Rngs):
        if experts % n_group:
            raise ValueError(f"n_group ({n_group}) must divide n_routed_experts ({experts})")
        weight = jax.random.normal(rngs.params(), (experts, hidden_size), jnp.float32) * 0.02
        self.weight = param(weight, "experts", "embed")
        self.e_score_correction_bias = param(jnp.zeros((experts,), jnp.float32), "experts")
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, float(routed_scaling_factor)

    def __call__(self, x: Float[Array, "n D"]) -> Routing:
        """Each token's `top_k` experts and their weights."""
        logits = x.astype(jnp.float32) @ self.weight[...].astype(jnp.float32).T
        return route(logits, self.top_k, score="sigmoid", renormalize=self.norm_topk_prob,
                     bias=self.e_score_correction_bias[...], n_group=self.n_group, topk_group=self.topk_group,
                     routed_scaling=self.routed_scaling_factor)


class NemotronMoE(nnx.Module):
    """Nemotron-H's MoE layer: `gate`, `experts` (stacked: `experts.{up,down}_proj`; the
    checkpoints' `experts.{e}.{up,down}_proj` per expert), optional
    `fc1_latent_proj`/`fc2_latent_proj`, `shared_experts`."""

    def __init__(self, hidden_size: int, *, experts: int, width: int, shared_width: int, latent: int | None,
                 bias: bool, act: str, router: dict, dtype=jnp.float32, rngs: nnx.Rngs):
        inner = hidden_size if latent is None else latent
        self.gate = NemotronRouter(hidden_size, experts, **router, rngs=rngs)
        self.experts = StackedPlainExperts(inner, experts, width, act=act, dtype=dtype, rngs=rngs)
        self.shared_experts = PlainMLP(hidden_size, shared_width, bias=bias, act=act, dtype=dtype, rngs=rngs)
        options = dict(bias=bias, dtype=dtype, rngs=rngs)
        self.fc1_latent_proj = None if latent is None else linear(hidden_size, latent, axes=("embed", None), **options)
        self.fc2_latent_proj = None if latent is None else linear(latent, hidden_size, axes=(None, "embed"), **options)

    def __call__(self, x: Float[Array, "... D"], *, all_experts: bool = False) -> Float[Array, "... D"]:
        """The layer's output; `all_experts`: every expert on every token (the test oracle)."""
        flat = x.reshape(-1, x.shape[-1])
        inner = flat if self.fc1_latent_proj is None else self.fc1_latent_proj(flat)
        routed = self.experts(inner, self.gate(flat), all_experts=all_experts)
        if self.fc2_latent_proj is not None:
            routed = self.fc2_latent_proj(routed)
        return routed.reshape(x.shape) + self.shared_experts(x)


def run_experts(x, routing: Routing, weights: StackedExperts, act, *, transposed: bool = False,
                all_experts: bool = False, limit: float | None = None):
    """The routed experts (`recurrax.nn.routed_experts`), or with `all_experts` every expert."""
    if all_experts:
        return every_expert(x, routing, weights, act=act, transposed=transposed, limit=limit)
    return routed_experts(x, routing, weights, act=act, transposed=transposed, limit=limit)


class GraniteRouter(nnx.Module):
    """Granite's `router`: `layer` (no bias), softmax over the top-k logits."""

    def __init__(self, hidden_size: int, experts: int, *, top_k: int, dtype=jnp.float32, rngs: nnx.Rngs):
        self.layer = linear(hidden_size, experts, axes=("embed", "experts"), dtype=dtype, rngs=rngs)
        self.top_k = top_k

    def __call__(self, x: Float[Array, "n D"]) -> Routing:
        """Each token's `top_k` experts (by logit) and the softmax of their logits."""
        return route(self.layer(x).astype(jnp.float32), self.top_k, renormalize=True, select_on="logits")


class ExpertWeights(nnx.Module):
    """Stacked expert matrices `weight [E, out, in]`, stored as PyTorch stores them."""

    checkpoint_params = ("weight",)

    def __init__(self, experts: int, d_out: int, d_in: int, *, axes: tuple[str, str], dtype=jnp.float32,
                 rngs: nnx.Rngs):
        weight = nnx.initializers.normal(0.02)(rngs.params(), (experts, d_out, d_in), dtype)
        self.weight = param(weight, "experts", *axes)


class SoftmaxRouter(nnx.Module):
    """The MoE's `gate`: `weight [E, D]`; softmax over all E, the top k (renormalised or not)."""

    checkpoint_params = ("weight",)

    def __init__(self, hidden_size: int, experts: int, *, top_k: int, renormalize: bool, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.weight = param(nnx.initializers.normal(0.02)(rngs.params(), (experts, hidden_size), dtype),
                            "experts", "embed")
        self.top_k, self.renormalize = top_k, renormalize

    def __call__(self, x: Float[Array, "n D"]) -> Routing:
        logits = x.astype(jnp.float32) @ self.weight[...].astype(jnp.float32).T
        return route(logits, self.top_k, score="softmax", renormalize=self.renormalize)


class StackedSwiGLUExperts(nnx.Module):
    """The routed SwiGLU experts, stacked: `gate_proj`, `up_proj` `[E, F, D]`, `down_proj` `[E, D, F]`;
    `limit`: their clipping (`recurrax.nn.routed_experts`), None for none."""

    def __init__(self, hidden_size: int, experts: int, width: int, *, limit: float | None = None,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        stacked = lambda d_out, d_in, axes: ExpertWeights(experts, d_out, d_in, axes=axes, dtype=dtype,  # noqa
                                                          rngs=rngs)
        self.gate_proj, self.up_proj = stacked(width, hidden_size, ("mlp", "embed")), stacked(width, hidden_size,
                                                                                              ("mlp", "embed"))
        self.down_proj = stacked(hidden_size, width, ("embed", "mlp"))
        self.limit = limit

    def __call__(self, x: Float[Array, "n D"], routing: Routing, *, all_experts: bool = False):
        weights = StackedExperts(self.up_proj.weight[...], self.down_proj.weight[...], self.gate_proj.weight[...])
        return run_experts(x, routing, weights, jax.nn.silu, transposed=True, all_experts=all_experts,
                           limit=self.limit)


class StackedPlainExperts(nnx.Module):
    """The routed experts without a gate, stacked: `up_proj [E, F, D]`, `down_proj [E, D, F]`;
    each expert is `W_down act(x W_up)` (Nemotron-H's, relu²)."""

    def __init__(self, hidden_size: int, experts: int, width: int, *, act: str = "relu2", dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.up_proj = ExpertWeights(experts, width, hidden_size, axes=("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.down_proj = ExpertWeights(experts, hidden_size, width, axes=("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.act = act
        activation(act, "mlp_hidden_act")

    def __call__(self, x: Float[Array, "n D"], routing: Routing, *, all_experts: bool = False):
        weights = StackedExperts(self.up_proj.weight[...], self.down_proj.weight[...])
        return run_experts(x, routing, weights, activation(self.act, "mlp_hidden_act"), transposed=True,
                           all_experts=all_experts)


class GraniteMoE(nnx.Module):
    """Granite 4.0-H's `block_sparse_moe`: `router`, `input_linear [E, 2F, D]`, `output_linear [E, D, F]`."""

    def __init__(self, hidden_size: int, *, experts: int, width: int, top_k: int, act: str = "silu",
                 dtype=jnp.float32, rngs: nnx.Rngs):
        self.router = GraniteRouter(hidden_size, experts, top_k=top_k, dtype=dtype, rngs=rngs)
        self.input_linear = ExpertWeights(experts, 2 * width, hidden_size, axes=("mlp", "embed"), dtype=dtype,
                                          rngs=rngs)
        self.output_linear = ExpertWeights(experts, hidden_size, width, axes=("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.act = act
        activation(act, "hidden_act")

    def __call__(self, x: Float[Array, "... D"], *, all_experts: bool = False) -> Float[Array, "... D"]:
        """The layer's output; `all_experts`: every expert on every token (the test oracle)."""
        flat = x.reshape(-1, x.shape[-1])
        act, fused = activation(self.act, "hidden_act"), self.input_linear.weight[...]  # [E, 2F, D]: gate, up
        if mesh_axis("mlp", fused.shape[1]) is None:
            # the fused matrix as one ungated projection, act(gate) ⊙ up taken on its output: each
            # block gathers its expert's rows only (splitting first copies every expert each call)
            weights, act = StackedExperts(fused, self.output_linear.weight[...]), partial(_glu, act)
        else:  # the width split over devices: each device's part must hold both gate and up rows
            gate, up = jnp.split(fused, 2, axis=1)
            weights = StackedExperts(up, self.output_linear.weight[...], gate)
        out = run_experts(flat, self.router(flat), weights, act, transposed=True, all_experts=all_experts)
        return out.reshape(x.shape)


def _glu(act, gate_up: Float[Array, "... F2"]) -> Float[Array, "... F"]:
    """`act(gate) ⊙ up` of `[gate | up]` (the two halves of the last axis)."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return act(gate) * up


class GraniteSharedMLP(nnx.Module):
    """Granite's `shared_mlp`: `output_linear(act(a) ⊙ b)` with `[a | b] = input_linear(x)`."""

    def __init__(self, hidden_size: int, width: int, *, act: str = "silu", dtype=jnp.float32, rngs: nnx.Rngs):
        self.input_linear = linear(hidden_size, 2 * width, axes=("embed", "mlp"), dtype=dtype, rngs=rngs)
        self.output_linear = linear(width, hidden_size, axes=("mlp", "embed"), dtype=dtype, rngs=rngs)
        self.act = act
        activation(act, "hidden_act")

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        a, b = jnp.split(self.input_linear(x), 2, axis=-1)
        return self.output_linear(activation(self.act, "hidden_act")(a) * b)


EXPERTS = r"^(?P<experts>.+\.(?:mlp|mixer)\.experts)"  # Nemotron-H's MoE is its layers' `mixer`
PER_EXPERT = re.compile(EXPERTS + r"\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
FUSED = re.compile(EXPERTS + r"\.(?P<proj>gate_up_proj|up_proj|down_proj)$")
STACKED = re.compile(EXPERTS + r"\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def stacked_experts(weights: dict) -> dict:
    """`weights` with each expert's matrices (`mlp.experts.{e}.gate_proj.weight`, as
    `transformers` saves them) or the fused ones (`mlp.experts.gate_up_proj [E, 2F, D]`,
    `down_proj [E, D, F]`, as its models hold them) stacked per projection
    (`mlp.experts.gate_proj.weight [E, F, D]`, …: `StackedSwiGLUExperts`); the same under
    `mixer.experts` with `up_proj` and `down_proj` only (Nemotron-H: `StackedPlainExperts`).
    Experts numbered other than 0 … E−1 are left as they are (the loader then names them)."""
    out, experts = {}, {}
    for name, value in weights.items():
        if match := PER_EXPERT.match(name):
            experts.setdefault((match["experts"], match["proj"]), {})[int(match["index"])] = value
        elif match := FUSED.match(name):
            if match["proj"] == "gate_up_proj":  # [E, 2F, D]: gate rows, then up rows
                gate, up = np.split(np.asarray(value), 2, axis=1)
                out[f"{match['experts']}.gate_proj.weight"], out[f"{match['experts']}.up_proj.weight"] = gate, up
            else:
                out[f"{match['experts']}.{match['proj']}.weight"] = value
        else:
            out[name] = value
    for (prefix, proj), values in experts.items():
        if sorted(values) == list(range(len(values))):
            out[f"{prefix}.{proj}.weight"] = np.stack([np.asarray(values[e]) for e in range(len(values))])
        else:
            out.update({f"{prefix}.{e}.{proj}.weight": value for e, value in values.items()})
    return out


def per_expert(weights: dict) -> dict:
    """`weights` with each stacked expert matrix written per expert, as `transformers` saves them."""
    def split(match, value):
        return {f"{match['experts']}.{e}.{match['proj']}.weight": np.ascontiguousarray(value[e])
                for e in range(value.shape[0])}

    return expand_matching(weights, STACKED, split)


def expand_matching(weights: dict, pattern: re.Pattern, expand) -> dict:
    """`weights` (checkpoint name → tensor) with each entry whose name `pattern` matches replaced
    by the entries `expand(match, tensor)` returns (in place, the others kept in order)."""
    out = {}
    for name, value in weights.items():
        match = pattern.match(name)
        out.update(expand(match, value) if match else {name: value})
    return out
