"""The launch scaffolding both operations' TPU kernels share: one grid step's heads, the state
carried across the chunk axis, the `pallas_call`, and the forward launch whole.

A kernel module (`_recurrent_forward`, `_recurrent_backward`, `_delta_forward`,
`_delta_backward`) writes one head's chunk, `head(refs, flags)`, with `refs` its views of the
step's blocks (lane slices of the lane-dense token blocks, columns of the [C, H] per-head
blocks, `ref.at[i]` of the states: `_tiles.Block`) and `flags` = (the chunk is its sequence's
first, its last, the program's first grid step) (`_tiles.chunk_flags`); `launch` runs it for
the step's Hb heads, one after another, on the grid (b, head block, value block, chunk) of
`_tiles`.

A carry is a [K, BV] float32 VMEM scratch that walks the chunks of a (row, head, value block):
the state S forward, its cotangent backward. `start_carries` loads it where a sequence starts
in the walk's order and zeroes it at a program's first step (packed input: chunks owned by no
sequence read zeros, not garbage); `finish_carry` writes it out where a sequence ends.

`forward` is a forward launch whole, lane-dense token-major: q (only with `emit_output`), k, v,
the operation's own per-head columns (the delta rule's β), the decay, h0; out o, h_T and (with
`emit_states`) the state entering every chunk, for the backward. The delta rule's forward is
it; `recurrent`'s (`_recurrent_forward.chunk_forward`) shares `forward_head` and
`forward_outputs`.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..._core.problem import Gate
from .._driver import KernelConfig, output_type
from . import _tiles as tiles
from ._tiles import F32


def _grid_step(*refs, head, specs: tiles.Specs, views):
    refs = list(refs)
    meta_ref = refs.pop(0) if specs.varlen else None
    flags = tiles.chunk_flags(specs, meta_ref)
    for i in range(specs.s.Hb):
        head([view(ref, i) for view, ref in zip(views, refs, strict=True)], flags)


def launch(head, inputs: list, in_specs: list, out_specs: list, out_shape: list, scratch: list, meta, *,
           specs: tiles.Specs, static: KernelConfig, name: str, views: list):
    """`head` on every grid step; the outputs. A head's views of the step's blocks: `views`,
    one `view(ref, i)` per input, output and scratch (`_tiles.Block`). `meta`: the packed
    input's [3, N] owners table, scalar-prefetched, or None."""
    return pl.pallas_call(
        functools.partial(_grid_step, head=head, specs=specs, views=views),
        grid_spec=tiles.grid_spec(specs, in_specs, out_specs, scratch),
        out_shape=out_shape,
        compiler_params=tiles.compiler_params(static),
        interpret=tiles.interpret_mode(static),
        name=name,
    )(*(([meta] if meta is not None else []) + inputs))


def take(refs: list, n: int) -> list:
    """The first `n` of a head's `refs`, taken off the list (a kernel unpacks its refs in order)."""
    taken = refs[:n]
    del refs[:n]
    return taken


def start_carries(step0, start, carries: list) -> None:
    """Every (scratch, ref of its value where a sequence starts) in `carries`: zeros at the
    program's first grid step `step0`, the start value where `start`."""

    @pl.when(step0)
    def _():  # packed input: chunks owned by no sequence start from zeros, not garbage
        for carry_ref, _ in carries:
            carry_ref[...] = jnp.zeros(carry_ref.shape, F32)

    @pl.when(start)
    def _():
        for carry_ref, start_ref in carries:
            carry_ref[...] = start_ref[...].astype(F32)


def finish_carry(end, out_ref, value) -> None:
    """`value` written to `out_ref` (its dtype) where a sequence ends in the walk's order."""

    @pl.when(end)
    def _():
        out_ref[...] = value.astype(out_ref.dtype)


def forward_head(refs: list, flags, *, chunk, tokens: int, decays: int, emit_output: bool, emit_states: bool):
    """One head's chunk of the forward: `chunk(q_ref or None, token_refs, decay_refs, S, o_ref
    or None) -> S'` (writing o when given its ref); `refs` are q (with `emit_output`), the
    `tokens` token views, the `decays` decay views, h0, o (with `emit_output`), h_T, the chunk
    states (with `emit_states`) and the state scratch."""
    q_ref = refs.pop(0) if emit_output else None  # the chunk states need no queries
    token_refs = take(refs, tokens)
    decay_refs = take(refs, decays)
    h0_ref = refs.pop(0)
    o_ref = refs.pop(0) if emit_output else None
    hT_ref = refs.pop(0)
    states_ref = refs.pop(0) if emit_states else None
    (S_ref,) = refs

    first, last, step0 = flags
    start_carries(step0, first, [(S_ref, h0_ref)])
    S = S_ref[...]
    if emit_states:
        states_ref[...] = S
    S_next = chunk(q_ref, token_refs, decay_refs, S, o_ref)
    S_ref[...] = S_next
    finish_carry(last, hT_ref, S_next)


def forward_outputs(specs: tiles.Specs, o, rows: int, like, emit_states: bool) -> tuple[list, list]:
    """A forward's out specs and shapes: o (`o`, its (spec, shape), or None), h_T [rows, H, K, V]
    float32 and, with `emit_states`, the states entering every chunk [B, H, N, K, V] float32
    (`like`: an input whose sharding the outputs take, `output_type`)."""
    s = specs.s
    out_specs, out_shape = ([o[0]], [o[1]]) if o is not None else ([], [])
    out_specs.append(specs.state())
    out_shape.append(output_type((rows, s.H, s.K, s.V), F32, like))
    if emit_states:
        out_specs.append(specs.chunk_states())
        out_shape.append(output_type((s.B, s.H, s.N, s.K, s.V), F32, like))
    return out_specs, out_shape


def forward(chunk, q, k, v, columns: list, a, h0, meta, *, shapes, static: KernelConfig, name: str,
            emit_output: bool, emit_states: bool) -> list:
    """Launch an operation's forward kernel, lane-dense token-major (`_tiles`): a list of o
    [B, Tp, H, V] in q's dtype (if `emit_output`), h_T [R, H, K, V] float32 and the states
    entering every chunk [B, H, N, K, V] float32 (if `emit_states`).

    **Arguments:** `chunk` as `forward_head`'s (its token views: k, v, then the columns);
    token-major q, k [B, Tp, G, K], v [B, Tp, H, V] (float16 upcast); `columns` the
    operation's own per-head [B, Tp, H] float32 inputs, read after v as [C, H] blocks; `a` the
    chunk-local cumulative log decay ([B, Tp, H] per head, [B, Tp, H, K] per channel, None);
    h0 [R, H, K, V]; `meta` the packed input's owners table or None; `shapes(q, v) -> Shapes`,
    checked; `name` the kernel's name without its `_fwd` / `_states`."""
    out_dtype = q.dtype
    kdt = tiles.kernel_dtype(q.dtype)
    q, k, v = (x.astype(kdt) for x in (q, k, v))
    s = shapes(q, v)
    specs = tiles.Specs(s, backward=False, varlen=meta is not None)
    decay = specs.lane_decay(static.gate)
    ins = ([specs.lanes_qk()] if emit_output else []) + [specs.lanes_qk(), specs.lanes_v()]
    ins += [specs.head_columns() for _ in columns] + decay + [specs.per_head(specs.state())]
    inputs = [tiles.token_lanes(x) for x in ([q] if emit_output else []) + [k, v]]
    inputs += [x.astype(F32) for x in columns]
    inputs += [] if a is None else [tiles.token_lanes(a) if static.gate is Gate.KEY else a]
    inputs.append(h0.astype(F32))
    o = (specs.lanes_v().spec, output_type((s.B, s.Tp, s.H * s.V), kdt, k)) if emit_output else None
    out_specs, out_shape = forward_outputs(specs, o, h0.shape[0], k, emit_states)
    outs = [specs.lanes_v()] if emit_output else []
    outs += [specs.per_head(spec) for spec in out_specs[len(outs):]]
    scratch = specs.per_head(specs.state_scratch())
    head = functools.partial(forward_head, chunk=chunk, tokens=2 + len(columns), decays=len(decay),
                             emit_output=emit_output, emit_states=emit_states)
    result = list(launch(head, inputs, [b.spec for b in ins], out_specs, out_shape, [scratch.spec], meta,
                         specs=specs, static=static, name=f"{name}_fwd" if emit_output else f"{name}_states",
                         views=[b.view for b in ins + outs + [scratch]]))
    if emit_output:
        result[0] = tiles.from_lanes(result[0], s.H).astype(out_dtype)
    return result
