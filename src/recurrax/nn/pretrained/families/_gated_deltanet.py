"""fla's `GatedDeltaNet` layer (`GatedDeltaNetForCausalLM`, Yang et al., *Gated Delta
Networks*), on `recurrax.nn.GatedDeltaNet`'s projections, gates, delta rule and decode cache.

| symbol | meaning                                                            |
|--------|--------------------------------------------------------------------|
| D      | `hidden_size`                                                      |
| Hk, H  | `num_heads` (query/key heads), `num_v_heads` (value heads; Hk | H)  |
| K, V   | `head_dim`, `head_dim · expand_v`                                  |
| W      | `conv_size`, the short convolutions' taps                          |

    q, k, v = silu(conv(x W_q)), silu(conv(x W_k)), silu(conv(x W_v))   (silu only without use_short_conv)
    β = sigmoid(x W_b)                     (× 2 with allow_neg_eigval)
    g = −exp(A_log) · softplus(x W_a + dt_bias)
    o = delta_rule(q, k, v, β, g, qk_l2norm=True)          value head h reads q/k head h // (H / Hk)
    y = (RMSNorm_V(o) ⊙ act(x W_g)) W_o    act = swish (or sigmoid: `output_gate_activation`);
                                           without use_gate: RMSNorm_V(o) W_o, no g_proj

fla's block (`models/gated_deltanet/modeling_gated_deltanet.py`) passes the config's
`expand_v`, `head_dim`, `num_heads`, `num_v_heads`, `use_gate`, `use_short_conv`,
`allow_neg_eigval`, `conv_size`, `norm_eps` (also the output norm's ε) and
`output_gate_activation`, and never `conv_bias` (so no convolution bias). `attn_mode`
(`chunk` or `fused_recurrent`) picks a kernel, not a result: both are accepted. The tensor
names are fla's: `q_proj`, `k_proj`, `v_proj`, `a_proj`, `b_proj`, `A_log`, `dt_bias`,
`q_conv1d`, `k_conv1d`, `v_conv1d`, `g_proj`, `o_norm.weight`, `o_proj`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from ..._gated_deltanet import GatedDeltaNet as DeltaNetLayer
from .._config_checks import ConfigError, _check_fields, _is_int, _refuse
from ..layers._norm import GatedNorm

DEFAULTS = dict(attn_mode="chunk", expand_v=2.0, use_gate=True, use_short_conv=True, allow_neg_eigval=False,
                conv_size=4, head_dim=256, num_heads=6, num_v_heads=None, num_hidden_layers=21,
                output_gate_activation="swish")
"""fla 0.6.0's `GatedDeltaNetConfig` defaults that differ from the other fla families'."""
GATE_ACTIVATIONS = {"swish": jax.nn.silu, "silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid}
"""`output_gate_activation`s fla's layer accepts (`swish` and `silu` are one function)."""
MODES = ("chunk", "fused_recurrent")


def check(config: dict) -> None:
    """Refuse a default-filled gated_deltanet config that fla's layer would refuse or that
    would build a wrong model, naming the field."""
    _check_fields(config, ints=("head_dim",), optional_ints=("num_v_heads",),
                  bools=("use_gate", "allow_neg_eigval"))
    heads, value_heads = config["num_heads"], config["num_v_heads"]
    if not _is_int(heads):
        _refuse("num_heads", "a positive integer", heads)
    if value_heads is not None and value_heads % heads:
        _refuse("num_v_heads", f"null or a multiple of num_heads ({heads}): each query/key head serves "
                "num_v_heads / num_heads value heads", value_heads)
    if not float(config["head_dim"] * config["expand_v"]).is_integer():
        _refuse("expand_v", f"a ratio making head_dim · expand_v (head_dim {config['head_dim']}) a whole number",
                config["expand_v"])
    if config["attn_mode"] not in MODES:
        _refuse("attn_mode", " or ".join(repr(mode) for mode in MODES), config["attn_mode"])
    if config["output_gate_activation"] not in GATE_ACTIVATIONS:
        _refuse("output_gate_activation", " or ".join(repr(name) for name in GATE_ACTIVATIONS),
                config["output_gate_activation"])


class OutputNorm(GatedNorm):
    """The output norm per value head, `RMSNorm(o) ⊙ w ⊙ act(gate)` (fla's `FusedRMSNormGated`,
    `activation` swish or sigmoid), or `RMSNorm(o) ⊙ w` without a gate (fla's `RMSNorm`).
    Computes in float32 or wider; stored as `weight`."""

    def __init__(self, size: int, *, eps: float, activation: str, dtype=jnp.float32):
        super().__init__(size, eps=eps, dtype=dtype)
        self.activation = activation

    def __call__(self, x: Float[Array, "... V"], gate: Float[Array, "... V"] | None = None) -> Float[Array, "... V"]:
        if gate is None or GATE_ACTIVATIONS[self.activation] is jax.nn.silu:
            return super().__call__(x, gate)
        wide = jnp.promote_types(x.dtype, jnp.float32)
        gated = super().__call__(x.astype(wide)) * GATE_ACTIVATIONS[self.activation](gate.astype(wide))
        return gated.astype(x.dtype)


class GatedDeltaNet(DeltaNetLayer):
    """fla's Gated DeltaNet layer: `recurrax.nn.GatedDeltaNet` with fla's options and names,
    called as fla's other converted layers are: `y = layer(x)`, or `y, cache = layer(x, cache)`
    from `layer.init_cache(rows)` (`positions` and `lower_bound` are accepted and ignored).

    **Arguments:** fla's names: `hidden_size`, `expand_v`, `head_dim`, `num_heads`,
    `num_v_heads`, `use_gate`, `use_short_conv`, `allow_neg_eigval`, `conv_size`, `norm_eps`,
    `output_gate_activation`; `dtype` (parameters and computation), `rngs`.
    """

    checkpoint_params = ("A_log", "dt_bias")

    def __init__(self, hidden_size: int, *, expand_v: float, head_dim: int, num_heads: int, num_v_heads: int | None,
                 use_gate: bool, use_short_conv: bool, allow_neg_eigval: bool, conv_size: int, norm_eps: float,
                 output_gate_activation: str, dtype=jnp.float32, rngs: nnx.Rngs):
        super().__init__(hidden_size, num_heads, num_v_heads=num_v_heads, head_dim=head_dim, expand_v=expand_v,
                         conv_size=conv_size if use_short_conv else 0, use_gate=use_gate,
                         allow_neg_eigval=allow_neg_eigval, norm_eps=norm_eps, dtype=dtype, param_dtype=dtype,
                         rngs=rngs)
        self.o_norm = OutputNorm(self.head_v_dim, eps=norm_eps, activation=output_gate_activation, dtype=dtype)

    def __call__(self, x, cache=None, *, cu_seqlens=None, positions=None, lower_bound=None):
        """`y = layer(x)`, or `y, cache = layer(x, cache)`, as `recurrax.nn.GatedDeltaNet`."""
        return super().__call__(x, cache, cu_seqlens=cu_seqlens)


def gated_deltanet_mixer(config: dict, *, dtype, rngs: nnx.Rngs) -> GatedDeltaNet:
    """The layer fla's `GatedDeltaNetBlock` builds from `config` (defaults filled in)."""
    c = config
    try:
        return GatedDeltaNet(
            c["hidden_size"], expand_v=c["expand_v"], head_dim=c["head_dim"], num_heads=c["num_heads"],
            num_v_heads=c["num_v_heads"], use_gate=c["use_gate"], use_short_conv=c["use_short_conv"],
            allow_neg_eigval=c["allow_neg_eigval"], conv_size=c["conv_size"], norm_eps=c["norm_eps"],
            output_gate_activation=c["output_gate_activation"], dtype=dtype, rngs=rngs)
    except ValueError as error:  # a value check() let through (e.g. conv_size 1 with use_short_conv)
        raise ConfigError(f"cannot build fla's GatedDeltaNet from this config: {error}") from error
