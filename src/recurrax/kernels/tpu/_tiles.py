"""Layouts, Mosaic-legal BlockSpecs and tile maths shared by the TPU kernels.

| symbol | meaning                                                               |
|--------|-----------------------------------------------------------------------|
| B, H   | batch rows, heads (grouped key/value heads already expanded)          |
| G      | query/key heads: H, or fewer shared by groups of H / G value heads    |
| Tp, N  | tokens padded to a multiple of C; chunks per row, N = Tp / C          |
| K, V   | key/query and value head dimensions                                   |
| C, c   | chunk length (one grid step), sub-block length (per-channel decays)   |
| BV     | value columns of one program: V, or with Hb = 1 a multiple of 128; nV = V / BV |
| Hb, Gb | heads of one grid step, a divisor of H (`TpuTiles.heads`); the query/key heads they read |
| nH     | head blocks, H / Hb (grid steps along the heads)                      |
| A      | chunk-local inclusive cumulative log decay, float32                   |

**Lane-dense token-major layout (both operations' kernels).** The driver's arrays are
token-major, [B, Tp, H, D]. A TPU tiles an array's two minor dims in (8, 128) tiles, so a
block of one head of that layout (the head axis second-minor) is refused, and head-major
copies [B, H, Tp, D] of 64-wide heads are lane-sparse copies made in XLA. The same bytes seen
as [B, Tp, H · D] (`token_lanes`, a reshape; what a projection writes) have lane-dense blocks
[C, Hb · D]: q, k [B, Tp, G · K] -> [C, Gb · K]; v, o, do, dv [B, Tp, H · V] -> [C, Hb · BV];
dq, dk (per value head) and a per-channel A [B, Tp, H · K] -> [C, Hb · K]; a per-head decay
(`recurrent`'s: the gate g, summed in VMEM, `local_decay`; the delta rule's: A) and the delta
rule's β [B, Tp, H] -> [C, H], every head. A block must be a multiple of 128 lanes
or the whole minor dim (`lane_problems`; Hb = H always is), so with 64-wide heads a step takes
an even number of heads. Head i of a step reads and writes lanes [i · D, (i + 1) · D) of its
blocks by static lane slices (`LaneSlice`; Mosaic loads and stores them at lane offset 64, but
refuses a `ref.at` view narrower than a lane tile), and its column h · Hb + i of a [C, H]
block by a masked lane sum (`HeadColumn`, h the step's head block; its row by `row_of`). The
delta rule's per-head gradients (dβ, a per-head decay's) are written as such columns of a
[C, H] block of [nV, H / Hb, B, Tp, H] (each head block its own, zero outside its heads;
`head_columns_out`), summed in XLA: a reduction, no transpose. States stay [R, H, K, V] and
[B, H, N, K, V], [Hb, K, BV] blocks viewed `ref.at[i]`. No array is copied in XLA around the
kernels.

**Transposes in VMEM.** The chunk-state updates need kᵀ v and qᵀ do, contractions over the
token axis: the kernels transpose the [C, K] tile of k or q (and a per-channel decay) in VMEM,
so every matmul is `a @ b` or `a @ bᵀ` (the two forms JAX's own TPU attention kernels use;
the delta rule's backward also transposes [C, C] float32 tiles, Pᵀ Ō and Xᵀ Ū, so its chunk
is a multiple of 128, `mosaic_problems`). Products whose natural form has a transposed operand
are computed transposed instead (e.g. Pᵀ = k̃ q̃ᵀ rather than Pᵀ from P). Single rows or
columns (an anchor, the chunk's last decay) are taken by masked sums (`pick_row`,
`pick_col`), and sub-block slices start at multiples of c = 16, so no slice needs a sublane
shift. (Arrays whose minor dimension is 1 are kept out of HBM: TPU layouts pad the minor
dimension to 128 lanes.)

**Shared query/key heads** (Mamba-2's layout, G < H): q and k keep their G heads; value
head h reads query/key head h // (H / G) through the index maps of their blocks
(`qk_block`), so no per-value-head copy of them is made. A step's query/key block is Gb · K
lanes: 16 value heads sharing two 64-wide query/key heads need all 16 heads in a step (one
64-lane query/key head of two is no legal block); where no such step fits the scoped VMEM the
call is refused (`tiling_problems`, dispatch then runs `chunk`). dq and dk are written per
value head (each head's share; `recurrent`'s driver sums the groups after the gate gradient has
read them, the delta rule's backward launch at once).

**Grid.** (b, head block h, value block j, chunk n), the chunk axis last and sequential
("arbitrary"): the state lives in a VMEM scratch across it, so VMEM use does not grow with T.
A grid step takes Hb heads and runs the chunk maths once per head, a static loop over the
heads' views (`Block.view`): v5e's single TensorCore runs the grid steps one after another,
and a step of one head's 128 × 64 matmuls is mostly the step's own overhead. The backward
walks the chunks backwards by its index maps. Packed input hands the [3, N] (sequence, first,
last) table to the kernels as a scalar-prefetch operand in SMEM, which the index maps of the
per-sequence states read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..._core.problem import Gate
from .._driver import KernelConfig, floored_gate

F32 = jnp.float32
LANES, SUBLANES = 128, 8


# ----------------------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class TpuTiles:
    """Tile sizes of the TPU kernels: chunk C (a multiple of 16; for the delta rule a power of
    two and a multiple of 128: its [C, C] transposes in VMEM), sub-block c for per-channel
    decays, value block BV (clipped to V; split only with one head per grid step), and `heads`
    Hb per grid step (a divisor of H; with query/key heads shared by groups of g value heads, a
    multiple or a divisor of g). `heads=None`: both operations' kernels take the most heads, up
    to `MOST_HEADS` (more only where no fewer give lane-dense blocks, `lane_problems`), whose
    blocks fit the target's scoped VMEM (`_vmem.py`). `group`: rows of the diagonal sub-block's
    groups in the `recurrent` kernels (a power of two; `_channel.diagonal_scores`; the delta
    rule's are 4)."""

    chunk: int = 128
    sub: int = 16
    block_v: int = 128
    heads: int | None = None
    group: int = 4


MOST_HEADS = 8
"""The most heads per grid step `heads=None` takes (a bound on the kernels' unrolled size
until measurements on the chip, `benchmarks/tpu_kernel_sweep.py`, say where the gain stops)."""


def interpret_mode(static: KernelConfig):
    """The `interpret=` argument of `pallas_call`: TPU interpret mode when `static.interpret`."""
    return pltpu.InterpretParams() if static.interpret else False


def compiler_params(static: KernelConfig):
    """Batch, head and value block independent; chunks sequential (the state is carried). The
    kernel's scoped-VMEM limit is `_vmem.kernel_vmem_limit`: headroom over the estimate tiles
    are chosen by, for what XLA places in VMEM around small calls."""
    if static.interpret:
        return None
    from ._vmem import kernel_vmem_limit

    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),  # b, h, j, n
                                vmem_limit_bytes=kernel_vmem_limit(target_generation()))


def target_generation() -> str | None:
    """The TPU generation dispatch judges for (`recurrax.targets`, else the device), or None."""
    from ..._core.registry import current_chip

    chip = current_chip()
    return chip.generation if chip.backend == "tpu" else None


def matmul_dtype(dtype) -> jnp.dtype:
    """MXU operand type: bf16 stays bf16; everything else (f32, f16 upcast) is float32."""
    return jnp.dtype(jnp.bfloat16) if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(F32)


def kernel_dtype(dtype) -> jnp.dtype:
    """The dtype q, k, v, do are handed to the kernels in (float16 is upcast in the wrapper:
    TPUs have no float16 matmul)."""
    return matmul_dtype(dtype)


def block_v(static: KernelConfig, V: int, heads: int = 1) -> int:
    """BV: the configured value block when it is a legal divisor of V and a grid step takes one
    head (a lane-dense block of several heads holds whole heads), else all of V."""
    bv = static.tiles.block_v
    return bv if (heads == 1 and bv < V and V % bv == 0 and bv % LANES == 0) else V


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The static sizes of one call."""

    B: int
    H: int
    Tp: int
    K: int
    V: int
    BV: int
    C: int
    c: int
    G: int | None = None  # query/key heads (None: H)
    Hb: int = 1  # heads per grid step
    delta: bool = False  # the delta rule's kernels (their VMEM, their chunk rules), else `recurrent`'s

    @property
    def nH(self) -> int:
        """Head blocks: grid steps along the heads."""
        return self.H // self.Hb

    @property
    def groups(self) -> int:
        """Value heads per query/key head."""
        return 1 if self.G is None else self.H // self.G

    @property
    def Gb(self) -> int:
        """Query/key heads of one grid step's blocks."""
        return max(1, self.Hb // self.groups)

    def qk_local(self, i: int) -> int:
        """The index, in its step's query/key block, of the query/key head of the step's head i."""
        return i // self.groups if self.Hb >= self.groups else 0

    @property
    def N(self) -> int:
        return self.Tp // self.C

    @property
    def nV(self) -> int:
        return self.V // self.BV


def shapes_of(q, v, static: KernelConfig, backward: bool = False, delta: bool = False) -> Shapes:
    """The sizes of a call (`delta`: the delta rule's kernels); Hb is the tiles' `heads`, else
    the most that give lane-dense blocks and fit the scoped VMEM (`most_heads`); BV by
    `block_v`. Refuses heads that do not tile H."""
    B, Tp, G, K = q.shape
    H, V = v.shape[-2:]
    s = Shapes(B, H, Tp, K, V, block_v(static, V), static.tiles.chunk, static.tiles.sub, G, delta=delta)
    heads = static.tiles.heads or most_heads(s, static.gate, q.dtype, backward)
    group = static.tiles.group
    problems = heads_problems(s, heads) + ([] if group > 0 and not group & (group - 1) else
                                           [f"group={group} must be a power of two"])
    if problems:
        raise ValueError("TPU chunk kernels: " + "; ".join(problems))
    return dataclasses.replace(s, Hb=heads, BV=block_v(static, V, heads))


def heads_problems(s: Shapes, heads: int) -> list[str]:
    """Why `heads` per grid step do not tile the H value heads (and their query/key heads)."""
    if heads < 1 or s.H % heads:
        return [f"heads={heads} must divide the {s.H} value heads"]
    if heads % s.groups and s.groups % heads:
        return [f"heads={heads} must be a multiple or a divisor of the {s.groups} value heads sharing each "
                "query/key head"]
    return []


def most_heads(s: Shapes, gate: Gate | None, dtype, backward: bool) -> int:
    """The most heads per grid step, up to `MOST_HEADS`, that tile H, give lane-dense blocks
    (`lane_problems`) and fit the scoped VMEM; where none up to `MOST_HEADS` does, the fewest
    above it that do (e.g. 16 heads sharing two 64-wide query/key heads: a step reads a whole
    128-lane query/key head pair). 1 when none does (`check_tiles` then says why). `s.BV` is
    the value block of one head per step; several heads take all of V (`block_v`)."""
    divisors = [h for h in range(1, s.H + 1) if s.H % h == 0]
    candidates = [h for h in reversed(divisors) if h <= MOST_HEADS] + [h for h in divisors if h > MOST_HEADS]
    for heads in candidates:
        tiled = dataclasses.replace(s, Hb=heads, BV=s.BV if heads == 1 else s.V)
        if not (heads_problems(s, heads) or lane_problems(tiled) or vmem_problems(tiled, gate, dtype, backward)):
            return heads
    return 1


def tiling_problems(H: int, G: int, K: int, V: int, gate: Gate | None, dtype, delta: bool = False) -> list[str]:
    """Why no heads per grid step give the declared tiles (C = 128, BV = min(V, 128))
    lane-dense blocks that fit the scoped VMEM of the target dispatch judges for, forward or
    backward, of `recurrent`'s kernels or (`delta`) the delta rule's (e.g. 16 value heads
    sharing two 64-wide query/key heads: a step must read both, all 16 heads, which overflow
    v5e's VMEM in the backward). Empty when some do."""
    s = Shapes(B=1, H=H, Tp=128, K=K, V=V, BV=min(V, LANES), C=128, c=16, G=G, delta=delta)
    for backward in (False, True):
        heads = most_heads(s, gate, dtype, backward)
        tiled = dataclasses.replace(s, Hb=heads, BV=s.BV if heads == 1 else V)
        if heads_problems(s, heads) or lane_problems(tiled) or vmem_problems(tiled, gate, dtype, backward):
            every = vmem_problems(dataclasses.replace(s, Hb=H, BV=V), gate, dtype, backward)
            return [f"no heads per grid step give lane-dense blocks (a multiple of {LANES} lanes, or all heads) "
                    f"that fit the scoped VMEM; all {H}: " + "; ".join(every or lane_problems(tiled))]
    return []


def lane_problems(s: Shapes) -> list[str]:
    """Why a step's lane-dense blocks of the token-major [B, Tp, heads · D] arrays are not legal
    Mosaic blocks: [C, Gb · K] (q, k), [C, Hb · K] (dq, dk, a per-channel decay), [C, Hb · BV]
    (v, o, do, dv) must each be a multiple of 128 lanes or the whole minor dimension."""
    G = s.G or s.H
    problems = []
    if (s.Hb * s.K) % LANES and s.Hb != s.H:
        problems.append(f"heads={s.Hb} of K={s.K} are {s.Hb * s.K} lanes, neither a multiple of {LANES} nor all "
                        f"{s.H} heads")
    if (s.Gb * s.K) % LANES and s.Gb != G:
        problems.append(f"the {s.Gb} query/key head(s) of a grid step are {s.Gb * s.K} lanes, neither a multiple "
                        f"of {LANES} nor all {G} query/key heads (take more heads per step)")
    if (s.Hb * s.BV) % LANES and s.Hb * s.BV != s.H * s.V:
        problems.append(f"heads={s.Hb} of block_v={s.BV} are {s.Hb * s.BV} lanes, neither a multiple of {LANES} "
                        f"nor all {s.H} heads of V={s.V}")
    return problems


def mosaic_problems(s: Shapes, dtype) -> list[str]:
    """Why these tiles are not legal Mosaic TPU blocks (empty when they are).

    Blocks are [C, width], [K, BV], [1, K]: the second-minor block dim must be a multiple of 8
    (16 for 16-bit inputs) or the full dimension, the minor one a multiple of 128 or the full
    dimension. The delta rule's backward transposes [C, C] float32 tiles in VMEM: C a multiple
    of 128 there.
    """
    sublane = 16 if jnp.dtype(dtype).itemsize == 2 else SUBLANES
    problems = []
    if s.C % sublane and s.C != s.Tp:
        problems.append(f"chunk={s.C} must be a multiple of {sublane}")
    if s.delta and s.C % LANES:
        problems.append(f"chunk={s.C} must be a multiple of {LANES} (the delta rule's [C, C] transposes in VMEM)")
    if s.c % sublane:
        problems.append(f"sub={s.c} must be a multiple of {sublane} (sub-block rows of a tile)")
    if s.BV != s.V and s.BV % LANES:
        problems.append(f"block_v={s.BV} must be V={s.V} or a multiple of {LANES}")
    return problems


def vmem_problems(s: Shapes, gate: Gate | None, dtype, backward: bool) -> list[str]:
    """[why] when the tiles overflow the scoped VMEM of the TPU generation dispatch judges for."""
    from ._vmem import vmem_problem

    problem = vmem_problem(s.C, s.K, s.BV, dtype, gate, backward, target_generation(), heads=s.Hb, delta=s.delta,
                           qk_heads=s.Gb)
    return [problem] if problem else []


def check_tiles(s: Shapes, static: KernelConfig, dtype, backward: bool = False) -> None:
    """Refuse, at trace time, tiles Mosaic would refuse (`mosaic_problems`, `lane_problems`)
    or that overflow the target's scoped VMEM (`_vmem.py`; interpret mode takes any)."""
    if static.interpret:
        return
    problems = mosaic_problems(s, dtype) + lane_problems(s) + vmem_problems(s, static.gate, dtype, backward)
    if problems:
        raise ValueError("TPU chunk kernels: " + "; ".join(problems))


# ----------------------------------------------------------------------------- layouts


# ----------------------------------------------------------------------------- block specs


def _block_spec(block_shape, index_map) -> pl.BlockSpec:
    """`pl.BlockSpec` whose index map returns int32: a Python int there is int64 under
    `jax_enable_x64`, which Mosaic's compiler cannot legalize (`jax.export` does not see it)."""
    as_int32 = lambda *grid: tuple(jnp.int32(i) if isinstance(i, int) else i for i in index_map(*grid))  # noqa: E731
    return pl.BlockSpec(block_shape, as_int32)


@dataclasses.dataclass(frozen=True)
class Specs:
    """BlockSpec factories over the grid (b, head block h, j, n [, meta]): blocks of Hb heads.

    `backward` walks the chunks from last to first; `varlen` reads each chunk's sequence
    from the scalar-prefetched [3, N] table (then B = 1).
    """

    s: Shapes
    backward: bool
    varlen: bool

    def chunk(self, n):
        return self.s.N - 1 - n if self.backward else n

    def seq(self, b, n, meta):
        return meta[0, self.chunk(n)] if self.varlen else b

    def qk_block(self, h):
        """The block of query/key heads head block h reads: block h of Gb heads when the groups
        tile the step's heads, else the one head (h · Hb) // g (h ≥ 0: truncating division is floor)."""
        s = self.s
        if s.groups == 1 or s.Hb >= s.groups:
            return h
        return lax.div(h * jnp.int32(s.Hb), jnp.int32(s.groups))

    def state(self):  # [R, H, K, V] -> [Hb, K, BV] of this row or sequence
        return _block_spec(
            (None, self.s.Hb, self.s.K, self.s.BV), lambda b, h, j, n, *m: (self.seq(b, n, m[0] if m else None), h, 0, j)
        )

    def chunk_states(self):  # [B, H, N, K, V] -> [Hb, K, BV] entering this chunk
        return _block_spec(
            (None, self.s.Hb, None, self.s.K, self.s.BV), lambda b, h, j, n, *m: (b, h, self.chunk(n), 0, j)
        )

    def partial_row(self):  # [nV, B, H, N, 1, K] -> [Hb, 1, K] of this chunk and value block
        return _block_spec(
            (None, None, self.s.Hb, None, 1, self.s.K), lambda b, h, j, n, *m: (j, b, h, self.chunk(n), 0, 0)
        )

    def state_scratch(self):
        """One [K, BV] float32 state per head of the step, in VMEM."""
        return pltpu.VMEM((self.s.Hb, self.s.K, self.s.BV), F32)

    # lane-dense token-major blocks (`recurrent`'s kernels): [B, Tp, heads · D] -> [C, Hb · D]

    def lanes(self, width: int) -> Block:  # [B, Tp, H·width] -> [C, Hb·width], head i lanes [i·width, (i+1)·width)
        s = self.s
        return Block(_block_spec((None, s.C, s.Hb * width), lambda b, h, j, n, *m: (b, self.chunk(n), h)),
                     lambda ref, i: LaneSlice(ref, i * width, width))

    def lanes_qk(self) -> Block:  # [B, Tp, G·K] -> [C, Gb·K] of the step's query/key heads
        s = self.s
        return Block(_block_spec((None, s.C, s.Gb * s.K), lambda b, h, j, n, *m: (b, self.chunk(n), self.qk_block(h))),
                     lambda ref, i: LaneSlice(ref, s.qk_local(i) * s.K, s.K))

    def lanes_v(self) -> Block:  # [B, Tp, H·V] -> [C, Hb·BV]: block h·nV + j (nV = 1 or Hb = 1)
        s = self.s
        return Block(_block_spec((None, s.C, s.Hb * s.BV), lambda b, h, j, n, *m: (b, self.chunk(n), h * s.nV + j)),
                     lambda ref, i: LaneSlice(ref, i * s.BV, s.BV))

    def lanes_partial(self) -> Block:  # [nV, B, Tp, H·K] -> [C, Hb·K] of this value block
        s = self.s
        return Block(_block_spec((None, None, s.C, s.Hb * s.K), lambda b, h, j, n, *m: (j, b, self.chunk(n), h)),
                     lambda ref, i: LaneSlice(ref, i * s.K, s.K))

    def head_columns(self) -> Block:  # [B, Tp, H] -> [C, H], every head; head i's column h·Hb + i
        s = self.s
        return Block(_block_spec((None, s.C, s.H), lambda b, h, j, n, *m: (b, self.chunk(n), 0)),
                     lambda ref, i: HeadColumn(ref, pl.program_id(1) * s.Hb + i, first=i == 0))

    def head_columns_out(self) -> Block:  # [nV, nH, B, Tp, H] -> [C, H] of this value and head block
        """A per-head output column: each (value block, head block) writes its own [C, H] block,
        its heads' columns and zeros elsewhere (`HeadColumn`); the caller sums the two leading axes."""
        s = self.s
        return Block(_block_spec((None, None, None, s.C, s.H), lambda b, h, j, n, *m: (j, h, b, self.chunk(n), 0)),
                     lambda ref, i: HeadColumn(ref, pl.program_id(1) * s.Hb + i, first=i == 0))

    def lane_decay(self, gate: Gate | None) -> list:
        """The token-major decay's blocks: per head [C, H], per channel [C, Hb·K]; none: []."""
        return {Gate.HEAD: [self.head_columns()], Gate.KEY: [self.lanes(self.s.K)]}.get(gate, [])

    def per_head(self, spec) -> Block:
        """A block (or scratch) of Hb heads on its leading axis: head i's view `ref.at[i]`."""
        return Block(spec, lambda ref, i: ref.at[i])


class Block(NamedTuple):
    """A BlockSpec (or a scratch shape) and `view(ref, i)`, head i's view of the step's block."""

    spec: Any
    view: Callable


class LaneSlice:
    """Head i's [rows, width] view of a lane-dense [rows, Hb · width] block, lanes [start,
    start + width): reads and writes are static lane slices of the block (Mosaic refuses a ref
    view, `ref.at`, that is not a whole number of 128-lane tiles wide, but loads and stores
    them). Indexed by `...` or (rows, `:`)."""

    def __init__(self, ref, start: int, width: int):
        self.ref, self.lanes = ref, slice(start, start + width)
        self.shape, self.dtype = (ref.shape[0], width), ref.dtype

    def _index(self, index):
        return slice(None) if index is Ellipsis else index[0], self.lanes

    def __getitem__(self, index):
        return self.ref[self._index(index)]

    def __setitem__(self, index, value):
        self.ref[self._index(index)] = value


class HeadColumn:
    """Column `index` (traced) of a token-major [C, H] block, as [C, 1] when read (`[...]`,
    a masked lane sum: exact). Written (`[...] = column`) by a masked select into the block:
    the step's `first` head zeroes the other columns, the later ones keep what is there."""

    def __init__(self, ref, index, first: bool = True):
        self.ref, self.index, self.first, self.dtype = ref, index, first, ref.dtype

    def __getitem__(self, index):
        return pick_col(self.ref[...].astype(F32), self.index)

    def __setitem__(self, index, column):
        mine = iota(self.ref.shape, 1) == self.index
        rest = jnp.zeros(self.ref.shape, self.ref.dtype) if self.first else self.ref[...]
        self.ref[...] = jnp.where(mine, jnp.broadcast_to(column.astype(self.ref.dtype), self.ref.shape), rest)


def token_lanes(x):
    """[B, Tp, H, D] -> [B, Tp, H · D], the lane-dense token-major array the kernels read."""
    return x.reshape(*x.shape[:2], -1)


def from_lanes(x, heads: int):
    """[..., Tp, H · D] -> [..., Tp, H, D]."""
    return x.reshape(*x.shape[:-1], heads, -1)


def grid_spec(specs: Specs, in_specs, out_specs, scratch_shapes):
    s = specs.s
    return pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1 if specs.varlen else 0,
        grid=(s.B, s.H // s.Hb, s.nV, s.N),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=scratch_shapes,
    )


def chunk_flags(specs: Specs, meta_ref):
    """(is this chunk its sequence's first, its last, the first grid step of the program),
    as traced booleans; dense rows: first = chunk 0, last = chunk N − 1."""
    n = pl.program_id(3)
    chunk = specs.chunk(n)
    if specs.varlen:
        return meta_ref[1, chunk] > 0, meta_ref[2, chunk] > 0, n == 0
    return chunk == 0, chunk == specs.s.N - 1, n == 0


# ----------------------------------------------------------------------------- tile maths


def _dot(a, b, contract: tuple[int, int], dtype):
    return lax.dot_general(
        a.astype(dtype),
        b.astype(dtype),
        (((contract[0],), (contract[1],)), ((), ())),
        precision=_precision(dtype),
        preferred_element_type=F32,
    )


def mm(a, b, dtype):
    """a @ b, [M, D] x [D, N] -> [M, N], operands in `dtype`, float32 accumulation."""
    return _dot(a, b, (1, 0), dtype)


def mm_nt(a, b, dtype):
    """a @ bᵀ, [M, D] x [N, D] -> [M, N] (the only other form: no transposed left operand)."""
    return _dot(a, b, (1, 1), dtype)


def _precision(dtype):
    """float32 operands at full precision (the MXU's default for them is a bf16 pass)."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == F32 else None


def exp_where(mask, exponent):
    """exp(exponent) where `mask`, exactly 0 elsewhere (masked exponents may be positive)."""
    return jnp.exp(jnp.where(mask, exponent, -jnp.inf))


def iota(shape, axis: int):
    return lax.broadcasted_iota(jnp.int32, shape, axis)


def pick_row(x, j):
    """Row j of a [m, D] tile as [1, D], by a masked sublane sum: no dynamic or unaligned
    slice for Mosaic to relayout (j may be traced, or a static row like the chunk's last)."""
    return jnp.sum(jnp.where(iota(x.shape, 0) == j, x, 0.0), axis=0, keepdims=True)


def pick_col(x, j):
    """Column j of a [m, D] tile as [m, 1], by a masked lane sum (as `pick_row`)."""
    return jnp.sum(jnp.where(iota(x.shape, 1) == j, x, 0.0), axis=1, keepdims=True)


def f32(ref):
    return ref[...].astype(F32)


def token(ref):
    """A token block read as float32 with its non-finite entries as 0: the kernels clean at load
    (`recurrax._core.finite`), so XLA stores no cleaned copy of q, k, v or do."""
    x = ref[...].astype(F32)
    return jnp.where(jnp.isfinite(x), x, 0.0)


def row_of(column):
    """A [K, 1] column as a [1, K] row, by a masked sublane sum (exact: the other terms are 0)."""
    K = column.shape[0]
    return jnp.sum(jnp.where(iota((K, K), 0) == iota((K, K), 1), column, 0.0), axis=0, keepdims=True)


def read_decay(refs: list, gate: Gate | None, local_sums: bool = False) -> tuple | None:
    """One chunk's decay as the kernels use it, from a head's view of its decay block: per
    head (column [C, 1], row [1, C]) from a `HeadColumn` (its row by `row_of`), per channel
    ([C, K], [K, C]) from a [C, K] view (transposed in VMEM); None without decay.
    `local_sums`: a per-head block holds the log decay g itself, and the chunk-local
    cumulative sum A is formed here (`local_decay`)."""
    if gate is None:
        return None
    (decay,) = (f32(r) for r in refs)
    if gate is Gate.HEAD:
        decay = local_decay(decay) if local_sums else decay
        return decay, row_of(decay)
    return decay, decay.T


def local_decay(g):
    """A [C, 1] = the chunk-local inclusive cumulative sum of the driver's `floored_gate(g)` for
    the gate g [C, 1] (NaN and +inf read as 0, floored at `STRONGEST_DECAY`): what XLA formed
    before the kernels, here in VMEM (`running_sums`), so XLA keeps no copy of A."""
    return running_sums(floored_gate(g))


def running_sums(x, reverse: bool = False):
    """Σ_{s ≤ t} x_s (`reverse`: Σ_{s ≥ t}) over the rows of a [C, D] float32 tile, [C, D]:
    L @ x with L_ts = 1 for s ≤ t (U, s ≥ t), a cumulative sum within the chunk. Exact
    products on the MXU in three bf16 passes: L is 0/1 (exact in bf16) and x splits exactly
    into three bf16 parts (8 + 8 + 8 of float32's 24 significant bits), each product
    accumulated in float32."""
    C = x.shape[0]
    rows, cols = iota((C, C), 0), iota((C, C), 1)
    triangle = ((cols >= rows) if reverse else (cols <= rows)).astype(jnp.bfloat16)
    total = jnp.zeros(x.shape, F32)
    for _ in range(3):
        part = x.astype(jnp.bfloat16)
        total += mm(triangle, part, jnp.bfloat16)
        x = x - part.astype(F32)
    return total
