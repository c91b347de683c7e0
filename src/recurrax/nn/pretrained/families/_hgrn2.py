"""fla's `HGRN2Attention` layer (HGRN2, Qin et al. 2024): gated linear RNN with state expansion.

| symbol | meaning                                                         |
|--------|-----------------------------------------------------------------|
| D      | `hidden_size`                                                   |
| H      | heads: `D / expand_ratio` when `expand_ratio` is set            |
| K      | forget/key head dim = `expand_ratio`;  V = D / H                |
| β      | the layer's lower bound `[H·K]` (from the model; 0 for layer 0)  |

    q, f, i = x W_q, x W_f, x W_i                 (short convs without activation, optional)
    q       = swish(q)
    g       = log σ(f)                            log forget gate
    g       = log(β + (1 − β) σ(f))               with a lower bound (layers after the first)
    k       = 1 − exp(g)                          input gate tied to the forget gate
    h_t     = diag(exp(g_t)) h_{t−1} + k_t i_tᵀ,   o_t = K^{−1/2} q_tᵀ h_t
    y       = RMSNorm_D(o) W_o                    one norm over all heads together

fla applies that norm through `rms_norm_linear` without passing its eps, so ε is 1e-5
whatever `norm_eps` says; `norm_eps` is accepted and ignored, as in fla.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ..layers._mixer import heads, linear
from ..layers._norm import RMSNorm
from ..layers._projected import ProjectedMixer


class HGRN2Attention(ProjectedMixer):
    """fla's HGRN2 layer.

    **Arguments:** fla's names: `hidden_size`, `num_heads`, `expand_ratio` (wins over
    `num_heads` when both are given, as in fla's layer), `use_short_conv`, `conv_size`,
    `conv_bias`, `elementwise_affine`, `norm_eps`, `layer_idx` (layer 0 ignores the lower
    bound); `dtype`, `rngs`.
    """

    def __init__(self, hidden_size: int, *, num_heads: int | None = None, expand_ratio: int | None = 128,
                 use_short_conv: bool = False, conv_size: int = 4, conv_bias: bool = False,
                 elementwise_affine: bool = True, norm_eps: float = 1e-5, layer_idx: int = 0,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        if expand_ratio is not None:
            num_heads = hidden_size // expand_ratio
        elif num_heads is not None:
            expand_ratio = hidden_size // num_heads
        else:
            raise ValueError("HGRN2 needs one of expand_ratio or num_heads")
        self._make_projections(("q", "f", "i"), hidden_size, num_heads, expand_ratio, use_short_conv=use_short_conv,
                               conv_size=conv_size, conv_bias=conv_bias, dtype=dtype, rngs=rngs)
        self.layer_idx = layer_idx
        self.g_norm = RMSNorm(hidden_size, eps=1e-5, elementwise_affine=elementwise_affine, axis="heads",
                              dtype=dtype)
        self.o_proj = linear(hidden_size, hidden_size, axes=("heads", "embed"), dtype=dtype, rngs=rngs)

    def _mix(self, x, cache, cu_seqlens, positions, lower_bound):
        projected, buffers = self._projected(x, cache, cu_seqlens)
        q = jax.nn.silu(projected["q"])
        g = jax.nn.log_sigmoid(projected["f"].astype(jnp.float32))
        if lower_bound is not None and self.layer_idx > 0:
            beta = lower_bound.astype(jnp.float32)
            g = jnp.logaddexp(jnp.log(beta), jnp.log1p(-beta) + g)
        k = (1.0 - jnp.exp(g)).astype(x.dtype)
        q, k, g = (heads(t, self.head_k_dim) for t in (q, k, g))
        i = heads(projected["i"], self.head_v_dim)
        o, new_cache = self._recur_cached(q, k, i, g, cache, buffers, cu_seqlens)
        o = self.g_norm(o.reshape(*o.shape[:-2], -1).astype(self.dtype))
        return self.o_proj(o), new_cache
