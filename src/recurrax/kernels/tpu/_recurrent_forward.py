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

**Layout** (`_tiles`): q, k [B, Tp, G·K], v, o [B, Tp, H·V] and a per-channel A
[B, Tp, H·K] are read and written lane-dense token-major, in [C, Hb·D] blocks (head i: lanes
[i·D, (i + 1)·D)); a per-head gate g [B, Tp, H] as a [C, H] block (head i's column picked in
VMEM, floored and summed within the chunk there: `_tiles.local_decay`). The state update S' needs kᵀ v, a contraction over tokens: k (and a per-channel A) is
transposed in VMEM, so every matmul is `a @ b` or `a @ bᵀ`; no copy is made in XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..._core.problem import Gate
from .._driver import KernelConfig, output_type
from . import _tiles as tiles
from ._channel import sub_block_scores
from ._head_chunk import head_chunk
from ._launch import forward_head, forward_outputs, launch
from ._tiles import F32, mm, pick_col


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
    """One head's chunk (`_launch.forward_head`): writes o when given `o_ref`; returns S'."""
    k_ref, v_ref = token_refs
    dtype = tiles.matmul_dtype(k_ref.dtype)
    q = None if q_ref is None else tiles.token(q_ref)
    k, v = tiles.token(k_ref), tiles.token(v_ref)
    kT = k.T  # [K, C], in VMEM
    a, aT = tiles.read_decay(decay_refs, static.gate, local_sums=True) or (None, None)
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
    """Launch the forward kernel: the driver's `PallasBackend.forward` contract
    (`kernels/_recurrent_driver.py`); q, k, v and the decay are read lane-dense token-major
    (`_tiles.token_lanes`, a reshape; float16 upcast to float32), o comes back as [B, Tp, H, V]."""
    out_dtype = q.dtype
    kdt = tiles.kernel_dtype(q.dtype)
    q, k, v = (x.astype(kdt) for x in (q, k, v))
    s = recurrent_shapes(q, v, static)
    specs = tiles.Specs(s, backward=False, varlen=meta is not None)
    decay = specs.lane_decay(static.gate)
    ins = ([specs.lanes_qk()] if emit_output else []) + [specs.lanes_qk(), specs.lanes_v(), *decay,
                                                          specs.per_head(specs.state())]
    inputs = [tiles.token_lanes(x) for x in ([q] if emit_output else []) + [k, v]]
    inputs += [] if a is None else [tiles.token_lanes(a) if static.gate is Gate.KEY else a]
    inputs.append(h0.astype(F32))
    o = (specs.lanes_v().spec, output_type((s.B, s.Tp, s.H * s.V), kdt, k)) if emit_output else None
    out_specs, out_shape = forward_outputs(specs, o, h0.shape[0], k, emit_states)
    outs = [specs.lanes_v()] if emit_output else []
    outs += [specs.per_head(spec) for spec in out_specs[len(outs):]]
    scratch = specs.per_head(specs.state_scratch())
    head = functools.partial(forward_head, chunk=functools.partial(_chunk, static=static), tokens=2,
                             decays=len(decay), emit_output=emit_output, emit_states=emit_states)
    result = list(launch(head, inputs, [b.spec for b in ins], out_specs, out_shape, [scratch.spec], meta,
                         specs=specs, static=static, name="recurrax_tpu_chunk_fwd" if emit_output else
                         "recurrax_tpu_chunk_states", views=[b.view for b in ins + outs + [scratch]]))
    if emit_output:
        result[0] = tiles.from_lanes(result[0], s.H).astype(out_dtype)
    return result
