"""Forward Pallas TPU kernel of the chunk algorithm: outputs, final states, chunk states.

| symbol  | meaning                                                                 |
|---------|-------------------------------------------------------------------------|
| C, c    | chunk length (one grid step), sub-block length (per-channel decays)     |
| S       | [K, BV] float32 state entering the chunk, a VMEM scratch across steps   |
| A_i     | chunk-local inclusive cumulative log decay Σ_{s ≤ i} a_s; A_L the last  |
| p, r    | first row of a query sub-block and its anchor r = p − 1                 |

One grid step is one chunk of Hb heads of one (row, head block, value block), the heads one
after another (`_tiles.head_views`). With ⊙ broadcasting a decay
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
  e^{A_ik − A_jk} masked to j ≤ i (`diagonal_scores`), and added into the same [c, C] score
  tile, so one [c, C]·[C, BV] matmul takes all keys.

The state update S' needs kᵀ v, a contraction over tokens: it reads k (and a per-channel
A) in the transposed [K, C] layout, so every matmul is `a @ b` or `a @ bᵀ` (`_tiles`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..._core.problem import Gate
from .._driver import KernelConfig, output_type
from . import _tiles as tiles
from ._tiles import F32, exp_where, iota, mm, mm_nt, pick_col, pick_row


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


DIAGONAL_GROUP = tiles.TpuTiles.group
"""Rows of a sub-block's query groups (a power of two): pairs in different groups are block
matmuls, pairs inside one are element-wise (`diagonal_scores`); `TpuTiles.group` sets it for
the `recurrent` kernels."""


def group_pick(c: int, g: int, t: int):
    """[c, c] 0/1 selection: row i picks row g·⌊i/g⌋ + t, the t-th of its group of g rows (a
    product with it gathers those rows: exact, one nonzero term per entry)."""
    rows, cols = iota((c, c), 0), iota((c, c), 1)
    return (cols == rows - jnp.bitwise_and(rows, g - 1) + t).astype(F32)


def group_scatter(c: int, g: int, t: int):
    """`group_pick` transposed, built as such: [j, i] = 1 where row i picks row j."""
    rows, cols = iota((c, c), 0), iota((c, c), 1)
    return (rows == cols - jnp.bitwise_and(cols, g - 1) + t).astype(F32)


def diagonal_scores(q_s, k_s, a_s, scores, p: int, dtype, group: int = DIAGONAL_GROUP):
    """Add the exact scores of keys [p, p + c) against queries [p, p + c) to columns
    p … p + c − 1 of the [c, C] `scores`: P_ij = Σ_k q_ik k_jk e^{A_ik − A_jk} for i ≥ j, 0 for i < j.

    The c rows split into groups of g = `group` rows. Queries of the group starting at row
    s against keys j < s are one block matmul anchored at r = s − 1 (e^{A_i − A_r}·e^{A_r − A_j},
    both ≤ 0); keys inside the query's own group, g element-wise steps: step t takes each row's
    group's t-th key, gathered by a selection product (`group_pick`), masked to t ≤ i − s."""
    c, K = q_s.shape
    g = min(group, c)
    rows = iota((c, K), 0)
    D = jnp.zeros((c, c), F32)
    for start in range(g, c, g):  # query groups after the first, against the keys before them
        a_r = pick_row(a_s, start - 1)  # [1, K]
        q_g = q_s * exp_where((rows >= start) & (rows < start + g), a_s - a_r)  # 0 outside the group
        k_g = k_s * exp_where(rows < start, a_r - a_s)  # 0 for j ≥ start
        D = D + mm_nt(q_g, k_g, dtype)
    offset = jnp.bitwise_and(rows, g - 1)  # i − s: the row's place in its group
    for t in range(g):  # the key g·⌊i/g⌋ + t of each query row's own group
        pick = group_pick(c, g, t)
        a_t, k_t = mm(pick, a_s, F32), mm(pick, k_s, F32)  # [c, K] that key's A and k, per row
        P_t = jnp.sum(q_s * k_t * exp_where(offset >= t, a_s - a_t), axis=1, keepdims=True)  # [c, 1]
        D = jnp.where(pick > 0, P_t, D)
    C = scores.shape[1]
    into_columns = (iota((c, C), 1) == iota((c, C), 0) + p).astype(F32)  # [c, C]: column j → p + j
    return scores + mm(D, into_columns, F32)


def key_sub_block(q, k, v, a, S, p: int, c: int, *, dtype, group: int):
    """Per-channel decay: unscaled outputs of query rows [p, p + c), [c, BV] float32."""
    C, K = k.shape
    q_s, a_s = q[p : p + c], a[p : p + c]
    o = mm(q_s * jnp.exp(a_s), S, dtype)  # from the state entering the chunk
    scores = jnp.zeros((c, C), F32)
    if p > 0:  # keys j < p, anchored at r = p − 1
        a_r = pick_row(a, p - 1)  # [1, K]
        k_anchor = k * exp_where(iota((C, K), 0) < p, a_r - a)  # [C, K]; 0 for j ≥ p
        scores = mm_nt(q_s * jnp.exp(a_s - a_r), k_anchor, dtype)  # [c, C]
    scores = diagonal_scores(q_s, k[p : p + c], a_s, scores, p, dtype, group)
    return o + mm(scores, v, dtype)


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


def _forward_kernel(*refs, static: KernelConfig, specs: tiles.Specs, emit_output: bool, emit_states: bool):
    refs = list(refs)
    meta_ref = refs.pop(0) if specs.varlen else None
    flags = tiles.chunk_flags(specs, meta_ref)
    qk = 3 if emit_output else 2  # q, k, kᵀ
    for i in range(specs.s.Hb):
        _forward_head(tiles.head_views(refs, i, specs, qk), flags, static=static, specs=specs,
                      emit_output=emit_output, emit_states=emit_states)


def _forward_head(refs: list, flags, *, static: KernelConfig, specs: tiles.Specs, emit_output: bool,
                  emit_states: bool):
    """One head's chunk: `refs` are its views of the step's blocks (`_tiles.head_views`)."""
    q_ref = refs.pop(0) if emit_output else None  # the chunk states need no queries
    k_ref, kT_ref, v_ref = refs[:3]
    del refs[:3]
    decay_refs = [refs.pop(0) for _ in specs.decay(static.gate)]
    h0_ref = refs.pop(0)
    o_ref = refs.pop(0) if emit_output else None
    hT_ref = refs.pop(0)
    states_ref = refs.pop(0) if emit_states else None
    (S_ref,) = refs

    first, last, step0 = flags
    dtype = tiles.matmul_dtype(k_ref.dtype)

    @pl.when(step0)
    def _():  # packed input: chunks owned by no sequence start from zeros, not garbage
        S_ref[...] = jnp.zeros(S_ref.shape, F32)

    @pl.when(first)
    def _():
        S_ref[...] = h0_ref[...].astype(F32)

    S = S_ref[...]
    if emit_states:
        states_ref[...] = S
    q = None if q_ref is None else tiles.f32(q_ref)
    k, kT, v = (tiles.f32(r) for r in (k_ref, kT_ref, v_ref))
    a, aT = tiles.read_decay(decay_refs, static.gate) or (None, None)
    if static.gate is Gate.KEY:
        c = static.tiles.sub
        S_next = key_chunk(q, k, kT, v, a, aT, S, o_ref, c=c, group=static.tiles.group, scale=static.scale,
                           dtype=dtype)
    else:
        o, S_next = head_chunk(q, k, kT, v, a, aT, S, scale=static.scale, dtype=dtype, emit_output=emit_output)
        if emit_output:
            o_ref[...] = o.astype(o_ref.dtype)
    S_ref[...] = S_next

    @pl.when(last)
    def _():
        hT_ref[...] = S_next.astype(hT_ref.dtype)


@functools.partial(jax.jit, static_argnames=("static", "emit_output", "emit_states"))
def chunk_forward(q, k, v, a, h0, meta=None, *, static: KernelConfig, emit_output: bool = True,
                  emit_states: bool = False):
    """Launch the forward kernel: the driver's `PallasBackend.forward` contract (`kernels/_driver.py`);
    inputs go head-major (float16 upcast to float32), the output comes back token-major."""
    out_dtype = q.dtype
    kdt = tiles.kernel_dtype(q.dtype)
    q, k, v = (x.astype(kdt) for x in (q, k, v))
    s = tiles.shapes_of(q, v, static)
    tiles.check_tiles(s, static, kdt)
    specs = tiles.Specs(s, backward=False, varlen=meta is not None)
    R = h0.shape[0]

    inputs = [tiles.head_major(q)] if emit_output else []
    in_specs = [specs.qk_rows()] if emit_output else []
    inputs += [tiles.head_major(k), tiles.head_major_t(k), tiles.head_major(v)]
    in_specs += [specs.qk_rows(), specs.qk_cols(), specs.rows_v()]
    inputs += tiles.decay_layouts(a, static.gate)
    in_specs += specs.decay(static.gate)
    inputs.append(h0.astype(F32))
    in_specs.append(specs.state())

    out_specs, out_shape = [], []
    if emit_output:
        out_specs.append(specs.rows_v())
        out_shape.append(output_type((s.B, s.H, s.Tp, s.V), kdt, k))
    out_specs.append(specs.state())
    out_shape.append(output_type((R, s.H, s.K, s.V), F32, k))
    if emit_states:
        out_specs.append(specs.chunk_states())
        out_shape.append(output_type((s.B, s.H, s.N, s.K, s.V), F32, k))

    kernel = functools.partial(
        _forward_kernel, static=static, specs=specs, emit_output=emit_output, emit_states=emit_states
    )
    outs = pl.pallas_call(
        kernel,
        grid_spec=tiles.grid_spec(specs, in_specs, out_specs, [specs.state_scratch()]),
        out_shape=out_shape,
        compiler_params=tiles.compiler_params(static),
        interpret=tiles.interpret_mode(static),
        name="recurrax_tpu_chunk_fwd" if emit_output else "recurrax_tpu_chunk_states",
    )(*(([meta] if meta is not None else []) + inputs))
    outs = list(outs)
    if emit_output:
        outs[0] = tiles.token_major(outs[0]).astype(out_dtype)
    return outs
