"""One head's chunk of `recurrent`'s forward with no or a per-head decay, on the [C, D] tiles
`_recurrent_forward` has loaded (kᵀ transposed in VMEM; notation: `_recurrent_forward`'s table).

    o   = scale · [ (q ⊙ e^{A}) S + (q kᵀ ⊙ D) v ],   D_ij = e^{A_i − A_j} (j ≤ i), else 0
    S'  = e^{A_L} S + (kᵀ ⊙ e^{A_L − A}) v
"""

from __future__ import annotations

import jax.numpy as jnp

from ._tiles import exp_where, iota, mm, mm_nt, pick_col


def head_chunk(q, k, kT, v, a_col, a_row, S, *, scale, dtype, emit_output: bool = True):
    """No or per-head decay: `(o [C, BV] or None, S' [K, BV])`, float32; `a_col` [C, 1],
    `a_row` [1, C] (None without decay)."""
    C = k.shape[0]
    causal = iota((C, C), 0) >= iota((C, C), 1)
    if a_col is None:
        o = None
        if emit_output:
            scores = jnp.where(causal, mm_nt(q, k, dtype), 0.0)  # [C, C]
            o = scale * (mm(q, S, dtype) + mm(scores, v, dtype))
        return o, S + mm(kT, v, dtype)
    a_last = pick_col(a_row, C - 1)  # [1, 1]
    o = None
    if emit_output:
        decay = exp_where(causal, a_col - a_row)  # [C, C] e^{A_i − A_j}, j ≤ i
        scores = mm_nt(q, k, dtype) * decay
        o = scale * (mm(q * jnp.exp(a_col), S, dtype) + mm(scores, v, dtype))
    kT_to_end = kT * jnp.exp(a_last - a_row)  # [K, C] k_j ⊙ e^{A_L − A_j}
    return o, jnp.exp(a_last) * S + mm(kT_to_end, v, dtype)
