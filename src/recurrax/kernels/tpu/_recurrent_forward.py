"""Forward Pallas TPU kernel of the chunk algorithm: outputs, final states, chunk states.

| symbol  | meaning                                                                 |
|---------|-------------------------------------------------------------------------|
| C, c    | chunk length (one grid step), sub-block length (per-channel decays)     |
| S       | [K, BV] float32 state entering the chunk, a VMEM scratch across steps   |
| A_i     | chunk-local inclusive cumulative log decay Σ_{s ≤ i} a_s; A_L the last  |
| p, r    | first row of a query sub-block and its anchor r = p − 1                 |

One grid step is one chunk of Hb heads of one (row, head block, value block), the heads one
after another (`_launch`). With ⊙ broadcasting a decay
over the axis it belongs to (everything for a per-head scalar, K for per-channel):

    o_i  = scale · [ (q_i ⊙ e^{A_i})ᵀ S  +  Σ_{j ≤ i} P_ij v_j ],  P_ij = Σ_k q_ik k_jk e^{A_ik − A_jk}
    S'   = e^{A_L} ⊙ S  +  Σ_j (k_j ⊙ e^{A_L − A_j}) v_jᵀ

Every exponential that is evaluated has a non-positive exponent for gates ≤ 0:
A_i, A_L − A_j (j ≤ L) and A_i − A_j (j ≤ i) are sums of gates.

* Per-head decay: P = (q kᵀ) ⊙ D with D_ij = e^{A_i − A_j} masked to j ≤ i before the
  exponential, formed from the column [C, 1] and row [1, C] copies of A.
* Per-channel decay: the decay sits inside the contraction over k. For query rows
  [p, p + c) and keys j < p it splits at r = p − 1, e^{A_i − A_j} = e^{A_i − A_r}·e^{A_r − A_j},
  both factors ≤ 0 (i > r ≥ j); keys j ≥ p are zeroed before the exponential. The keys
  j ∈ [p, p + c) split the same way in groups of 4 rows, anchored at the row before each
  group; inside a group, the 4 × 4 pairs are computed element-wise, P_ij = Σ_k q_ik k_jk
  e^{A_ik − A_jk} masked to j ≤ i (`_channel.diagonal_scores`), and added into the same [c, C] score
  tile, so one [c, C]·[C, BV] matmul takes all keys.

The state update S' needs kᵀ v, a contraction over tokens: it reads k (and a per-channel
A) in the transposed [K, C] layout, so every matmul is `a @ b` or `a @ bᵀ` (`_tiles`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..._core.problem import Gate
from .._driver import KernelConfig
from . import _tiles as tiles
from ._channel import sub_block_scores
from ._head_chunk import head_chunk
from ._launch import forward
from ._token_forward import token_forward, token_major_takes
from ._tiles import mm, pick_col


def key_sub_block(q, k, v, a, S, p: int, c: int, *, dtype, group: int):
    """Per-channel decay: unscaled outputs of query rows [p, p + c), [c, BV] float32."""
    q_s, a_s = q[p : p + c], a[p : p + c]
    o = mm(q_s * jnp.exp(a_s), S, dtype)  # from the state entering the chunk
    return o + mm(sub_block_scores(q_s, a_s, k, a, p, dtype, group), v, dtype)


def key_chunk(q, k, kT, v, a, aT, S, o_ref, *, c: int, group: int, scale, dtype):
    """Per-channel decay: writes o (when `o_ref` is given) sub-block by sub-block; returns
    S' [K, BV] float32."""
    C = k.shape[0]
    if o_ref is not None:
        for p in range(0, C, c):
            o_s = key_sub_block(q, k, v, a, S, p, c, dtype=dtype, group=group)
            o_ref[p : p + c, :] = (scale * o_s).astype(o_ref.dtype)
    a_last = pick_col(aT, C - 1)  # [K, 1]
    return jnp.exp(a_last) * S + mm(kT * jnp.exp(a_last - aT), v, dtype)


def _chunk(q_ref, token_refs, decay_refs, S, o_ref, *, static: KernelConfig):
    """One head's chunk (`_launch.forward`): writes o when given `o_ref`; returns S'."""
    k_ref, kT_ref, v_ref = token_refs
    dtype = tiles.matmul_dtype(k_ref.dtype)
    q = None if q_ref is None else tiles.f32(q_ref)
    k, kT, v = (tiles.f32(r) for r in (k_ref, kT_ref, v_ref))
    a, aT = tiles.read_decay(decay_refs, static.gate) or (None, None)
    if static.gate is Gate.KEY:
        return key_chunk(q, k, kT, v, a, aT, S, o_ref, c=static.tiles.sub, group=static.tiles.group,
                         scale=static.scale, dtype=dtype)
    o, S_next = head_chunk(q, k, kT, v, a, aT, S, scale=static.scale, dtype=dtype, emit_output=o_ref is not None)
    if o_ref is not None:
        o_ref[...] = o.astype(o_ref.dtype)
    return S_next


def recurrent_shapes(q, v, static: KernelConfig, backward: bool = False) -> tiles.Shapes:
    """The call's sizes, the most heads per grid step that fit by default, checked (`_tiles`)."""
    s = tiles.shapes_of(q, v, static, backward=backward)
    tiles.check_tiles(s, static, q.dtype, backward)
    return s


@functools.partial(jax.jit, static_argnames=("static", "emit_output", "emit_states"))
def chunk_forward(q, k, v, a, h0, meta=None, *, static: KernelConfig, emit_output: bool = True,
                  emit_states: bool = False):
    """Launch the forward kernel: the driver's `PallasBackend.forward` contract (`kernels/_recurrent_driver.py`);
    inputs go head-major (float16 upcast to float32), the output comes back token-major; with
    `TpuTiles(layout="tokens")`, no or a per-head decay reads them token-major (`_token_forward`,
    `token_major_takes`)."""
    if token_major_takes(q, v, static):
        return token_forward(q, k, v, a, h0, meta, static=static, emit_output=emit_output, emit_states=emit_states)
    return forward(functools.partial(_chunk, static=static), q, k, v, [], a, h0, meta,
                   shapes=functools.partial(recurrent_shapes, static=static), static=static, name="recurrax_tpu_chunk",
                   emit_output=emit_output, emit_states=emit_states)
