"""`recurrent`'s forward kernel for a per-head or no decay, reading the driver's token-major arrays.

| symbol  | meaning                                                                   |
|---------|---------------------------------------------------------------------------|
| Hb, Gb  | value heads of one grid step, the query/key heads they read (`_tiles`)    |
| i, j    | a value head of the step, the query/key head it reads (`Shapes.qk_local`) |
| A       | chunk-local inclusive cumulative log decay [B, Tp, H] float32             |
| S       | [K, V] float32 state of one head entering the chunk, a VMEM scratch       |

The head-major forward (`_recurrent_forward`, `_launch.forward`) reads copies of q, k, v made
in XLA ([B, H, Tp, D], kᵀ [B, H, K, Tp], the decay as rows [B, H, 1, Tp]) and transposes its
output back; on a TPU those copies of 64-wide heads take most of the call's time. This one
reads the driver's arrays as they are:

    q, k [B, Tp, G, K] -> blocks [C, Gb, K];  v, o [B, Tp, H, V] -> blocks [C, Hb, V];  A [B, Tp, H] -> [C, H]

A TPU tiles an array's two minor dims, here (heads, D): a block is legal when its heads are a
multiple of 8 or all of them and D is whole (`token_problems`), and A's whole H always is.
(Flattening to [B, Tp, H·D] is no free reshape on a TPU: it re-tiles, two copies per array.)
Inside a grid step head i's tiles are sublane-strided loads, v_i = v[:, i, :] [C, V] and q_j,
k_j likewise; kᵀ, the state update's operand (a contraction over tokens), is k_j transposed in
VMEM. Head i's decay column is column h·Hb + i of the A block (`pick_col`, the step's head
block h), its row that column transposed (`row_of`). The chunk maths is
`_head_chunk.head_chunk`'s:

    o_i = scale · [ (q ⊙ e^{A}) S + (q kᵀ ⊙ D) v ],   D_ts = e^{A_t − A_s} (s ≤ t), else 0
    S'  = e^{A_L} S + (kᵀ ⊙ e^{A_L − A}) v

The grid, the state scratch, its start and end (`_launch.start_carries`, `finish_carry`,
`_tiles.chunk_flags`: packed sequences, h0), the outputs h_T and the chunk-entry states are
the head-major kernel's, so its backward (`_recurrent_backward`) reads them unchanged. The
value block is all of V (one program per head block).
"""

from __future__ import annotations

import dataclasses
import functools

from jax.experimental import pallas as pl

from ..._core.problem import Gate
from .._driver import KernelConfig, output_type
from . import _tiles as tiles
from ._head_chunk import head_chunk
from ._launch import finish_carry, forward_outputs, start_carries
from ._tiles import F32, SUBLANES, _block_spec


def token_shapes(q, v, static: KernelConfig) -> tiles.Shapes:
    """The call's sizes (`_tiles.shapes_of`) with the value block all of V, checked: in compiled
    mode, refuses blocks Mosaic would refuse (`token_problems`) and tiles over the scoped VMEM.
    `heads=None` takes `shapes_of`'s default where its blocks are legal, else all H heads."""
    s = tiles.shapes_of(q, v, static)
    s = dataclasses.replace(s, BV=s.V)
    if static.tiles.heads is None and not static.interpret and token_problems(s):
        s = dataclasses.replace(s, Hb=s.H)
    tiles.check_tiles(s, static, q.dtype)
    if not static.interpret and (problems := token_problems(s)):
        raise ValueError("TPU token-major forward: " + "; ".join(problems))
    return s


def token_major_takes(q, v, static: KernelConfig) -> bool:
    """Whether `chunk_forward` runs this forward: `TpuTiles(layout="tokens")`, no or a per-head
    decay, and, compiled, query/key heads not shared (G = H), all shared (G = 1), or G a multiple
    of 8. libtpu with JAX 0.10.2 crashes compiling the program around it (SIGFPE in XLA's
    TpuLoopFusionEnhancer) for 2 or 4 query/key heads shared by 16 value heads, so shared
    query/key heads in between read the head-major forward until that is understood."""
    if static.tiles.layout != "tokens" or static.gate is Gate.KEY:
        return False
    G, H = q.shape[2], v.shape[2]
    return static.interpret or G in (1, H) or G % SUBLANES == 0


def token_problems(s: tiles.Shapes) -> list[str]:
    """Why the token-major blocks [C, Gb, K], [C, Hb, V] are not legal Mosaic blocks: their
    heads are the second-minor dim, a multiple of 8 or all of them."""
    G = s.G or s.H
    problems = []
    if s.Hb % SUBLANES and s.Hb != s.H:
        problems.append(f"heads={s.Hb} must be a multiple of {SUBLANES} or all {s.H} heads")
    if s.Gb % SUBLANES and s.Gb != G:
        problems.append(f"the {s.Gb} query/key heads of a grid step must be a multiple of {SUBLANES} or all {G}")
    return problems


@dataclasses.dataclass(frozen=True)
class TokenSpecs:
    """BlockSpecs over the grid (b, head block h, 0, n [, meta]) of the token-major arrays;
    the states' are the head-major kernel's (`_tiles.Specs`)."""

    specs: tiles.Specs

    def qk(self):  # [B, Tp, G, K] -> [C, Gb, K] of the step's query/key heads
        sp, s = self.specs, self.specs.s
        return _block_spec((None, s.C, s.Gb, s.K), lambda b, h, j, n, *m: (b, sp.chunk(n), sp.qk_block(h), 0))

    def values(self):  # [B, Tp, H, V] -> [C, Hb, V]
        sp, s = self.specs, self.specs.s
        return _block_spec((None, s.C, s.Hb, s.V), lambda b, h, j, n, *m: (b, sp.chunk(n), h, 0))

    def decay(self):  # [B, Tp, H] -> [C, H], every head
        sp, s = self.specs, self.specs.s
        return _block_spec((None, s.C, s.H), lambda b, h, j, n, *m: (b, sp.chunk(n), 0))


def _grid_step(*refs, specs: tiles.Specs, static: KernelConfig, emit_output: bool, emit_states: bool):
    """One chunk of the step's Hb heads, one after another."""
    refs = list(refs)
    meta_ref = refs.pop(0) if specs.varlen else None
    q_ref = refs.pop(0) if emit_output else None
    k_ref, v_ref = refs.pop(0), refs.pop(0)
    a_ref = refs.pop(0) if static.gate is not None else None
    h0_ref = refs.pop(0)
    o_ref = refs.pop(0) if emit_output else None
    hT_ref = refs.pop(0)
    states_ref = refs.pop(0) if emit_states else None
    (S_ref,) = refs

    s = specs.s
    first, last, step0 = tiles.chunk_flags(specs, meta_ref)
    dtype = tiles.matmul_dtype(k_ref.dtype)
    a_all = None if a_ref is None else a_ref[...]  # [C, H]
    head_block = pl.program_id(1)
    keys = {}  # query/key head j of the step -> (k_j [C, K], k_jᵀ [K, C]), loaded once per group
    for i in range(s.Hb):
        j = s.qk_local(i)
        if j not in keys:
            k = k_ref[:, j, :].astype(F32)
            keys[j] = (k, k.T)
        k, kT = keys[j]
        a_col = a_row = None
        if a_all is not None:
            a_col = tiles.pick_col(a_all, head_block * s.Hb + i)  # [C, 1]
            a_row = tiles.row_of(a_col)  # [1, C]
        start_carries(step0, first, [(S_ref.at[i], h0_ref.at[i])])
        S = S_ref[i]
        if emit_states:
            states_ref[i] = S
        q = None if q_ref is None else q_ref[:, j, :].astype(F32)
        o, S_next = head_chunk(q, k, kT, v_ref[:, i, :].astype(F32), a_col, a_row, S, scale=static.scale,
                               dtype=dtype, emit_output=emit_output)
        if emit_output:
            o_ref[:, i, :] = o.astype(o_ref.dtype)
        S_ref[i] = S_next
        finish_carry(last, hT_ref.at[i], S_next)


def token_forward(q, k, v, a, h0, meta, *, static: KernelConfig, emit_output: bool, emit_states: bool) -> list:
    """The driver's `PallasBackend.forward` contract (`kernels/_recurrent_driver.py`) for no or a
    per-head decay: o [B, Tp, H, V] in q's dtype (if `emit_output`), h_T [R, H, K, V] and the
    states entering every chunk [B, H, N, K, V] (if `emit_states`), float32; q, k, v and A read
    token-major, with no copy in XLA."""
    out_dtype = q.dtype
    kdt = tiles.kernel_dtype(q.dtype)
    q, k, v = (x.astype(kdt) for x in (q, k, v))
    s = token_shapes(q, v, static)
    specs = tiles.Specs(s, backward=False, varlen=meta is not None)
    tokens = TokenSpecs(specs)
    inputs, in_specs = ([q], [tokens.qk()]) if emit_output else ([], [])
    inputs += [k, v]
    in_specs += [tokens.qk(), tokens.values()]
    if static.gate is not None:
        inputs.append(a)
        in_specs.append(tokens.decay())
    inputs.append(h0.astype(F32))
    in_specs.append(specs.state())

    o = (tokens.values(), output_type((s.B, s.Tp, s.H, s.V), kdt, k)) if emit_output else None
    out_specs, out_shape = forward_outputs(specs, o, h0.shape[0], k, emit_states)

    kernel = functools.partial(_grid_step, specs=specs, static=static, emit_output=emit_output,
                               emit_states=emit_states)
    outs = list(pl.pallas_call(
        kernel,
        grid_spec=tiles.grid_spec(specs, in_specs, out_specs, [specs.state_scratch()]),
        out_shape=out_shape,
        compiler_params=tiles.compiler_params(static),
        interpret=tiles.interpret_mode(static),
        name="recurrax_tpu_tokens_fwd" if emit_output else "recurrax_tpu_tokens_states",
    )(*(([meta] if meta is not None else []) + inputs)))
    if emit_output:
        outs[0] = outs[0].astype(out_dtype)
    return outs
