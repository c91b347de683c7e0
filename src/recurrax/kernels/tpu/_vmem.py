"""Whether a tiling's VMEM fits the TPU compiler's scoped-VMEM limit, judged before Mosaic.

| symbol | meaning                                                                     |
|--------|-----------------------------------------------------------------------------|
| C, K   | chunk length, key head dim                                                  |
| BV     | value columns of one program                                                |
| Hb     | heads of one grid step (its blocks and its state scratch hold Hb heads)     |
| Gb     | query/key heads of a step's q and k blocks (the delta rule's count)         |
| kdt    | the kernels' operand dtype (bf16, or f32)                                   |

Mosaic TPU allocates, per kernel, every block of the pipeline twice (double buffering), the
scratch, and the kernel body's temporaries, all in VMEM tiles of (8, 128) 32-bit words (16
rows for 16-bit types); the sum must fit the generation's scoped-VMEM limit (`SCOPED_VMEM_BYTES`,
the compiler's default) or compiling fails with "CompileTimeScopedVmemOom". `vmem_bytes`
counts the lane-dense blocks of `_recurrent_forward` / `_recurrent_backward` ([C, Hb · D]: 64-wide
heads fill lanes two at a time; the backward's gate gradient a [C, H] or [C, Hb · K] float32
block) and bounds the temporaries by [C, C] float32 matrices (one live in the forward, two in
the backward; the gate gradient's [C, C] suffix-sum matrix, a 0/1 constant, needed no more:
libtpu 0.0.42.1 compiles the per-head backward at C = 256 with 8 heads of 64, 14.6 MiB by this
estimate, and at C = 128 with 16), [C, max(K, BV)] float32 ones (four more [C, K] of a
per-channel decay's anchored rows) and the [K, C] transposes made
in VMEM, once per head of a grid step: Mosaic gives each unrolled head's temporaries their own
VMEM (libtpu 0.0.42.1 needed 17.8 MiB for the per-channel backward, C = 256, 8 heads of 64,
where the blocks take 8.6 MiB; checked against libtpu for the most heads the estimate
accepts, `tests/test_compile.py`).
Calibrated against libtpu: `TpuTiles(chunk=2048)` bf16, K = V = 128, a per-head decay, needs
17.24 MiB in the forward kernel (measured with the head-major blocks; this estimate: 25.4 MiB) and fails on v5e's 16 MiB; the largest
chunks the estimate accepts compile (`tests/test_compile.py`).

The delta rule's kernels (`_delta_forward`, `_delta_backward`, `delta=True`) have their own
count (`_delta_vmem_bytes`): the same lane-dense blocks plus β and the per-head gradient
columns, q and k at the step's Gb query/key heads, and per head more [C, C] temporaries (the
inverse X = (I + M)⁻¹ and the backward's adjoints), fitted to libtpu 0.0.42.1's compiles for
a v5e (every tiling that ran out of VMEM there is refused; the default heads compile,
`tests/test_compile.py`).
"""

from __future__ import annotations

import jax.numpy as jnp

from ..._core.problem import Gate

MiB = 1 << 20
SCOPED_VMEM_BYTES = {"v5e": 16 * MiB, "v6e": 32 * MiB}
"""The compiler's default scoped-VMEM limit per generation; unknown ones get the smallest."""
F32_BYTES = 4


def tile_bytes(rows: int, cols: int, itemsize: int) -> int:
    """Bytes of a [rows, cols] block in VMEM tiles ((8, 128) words; 16-bit types pack 16 rows)."""
    sublanes = 8 * (4 // itemsize)
    return -(-rows // sublanes) * sublanes * -(-cols // 128) * 128 * itemsize


def vmem_bytes(C: int, K: int, BV: int, dtype, gate: Gate | None, backward: bool, heads: int = 1,
               delta: bool = False, qk_heads: int | None = None) -> int:
    """An upper estimate of one kernel's scoped VMEM (bytes) for these tiles (`delta`: the
    delta rule's kernels, whose q and k blocks hold `qk_heads` heads, else `recurrent`'s)."""
    item = jnp.dtype(dtype).itemsize
    lanes = lambda width, itemsize=item: tile_bytes(C, heads * width, itemsize)  # noqa: E731  [C, Hb·width]
    state = heads * tile_bytes(K, BV, F32_BYTES)
    column = tile_bytes(C, 1, F32_BYTES)  # a [C, H] block of per-head columns (H ≤ 128)
    decay = {Gate.HEAD: column, Gate.KEY: lanes(K, F32_BYTES)}.get(gate, 0)  # [C, H], [C, Hb·K]
    if delta:
        qk = tile_bytes(C, (qk_heads or heads) * K, item)  # [C, Gb·K]
        return _delta_vmem_bytes(C, K, BV, gate, backward, heads, lanes, qk, state, column, decay)
    if backward:  # q, k, v, decay, do, states, h_T, dh_T -> dq, dk (≤ f32), dv (f32), dh0, dg (a decay's); dS, S⁺
        inputs = 2 * lanes(K) + 2 * lanes(BV) + decay + 3 * state
        gate_gradient = {Gate.HEAD: tile_bytes(C, 1, F32_BYTES), Gate.KEY: lanes(K, F32_BYTES)}.get(gate, 0)
        outputs = 2 * lanes(K, F32_BYTES) + lanes(BV, F32_BYTES) + state + gate_gradient  # [C, H], [C, Hb·K]
        scratch, square = 2 * state, 2
    else:  # q, k, v, decay, h0 -> o, h_T, states; S
        inputs = 2 * lanes(K) + lanes(BV) + decay + state
        outputs = lanes(BV) + 2 * state
        scratch, square = state, 1
    transposed = tile_bytes(K, C, F32_BYTES) * (2 if gate is Gate.KEY else 1)  # kᵀ or qᵀ (and Aᵀ) in VMEM
    anchored = 4 * tile_bytes(C, K, F32_BYTES) if gate is Gate.KEY else 0  # per channel: [C, K] anchored rows
    temporaries = (square * tile_bytes(C, C, F32_BYTES) + 2 * tile_bytes(C, max(K, BV), F32_BYTES) + transposed
                   + anchored)
    return 2 * (inputs + outputs) + scratch + heads * temporaries


KERNEL_HEADROOM = 2
"""The kernels' own scoped-VMEM limit (`vmem_limit_bytes`) over the default tiles are judged by.
Around a small call XLA may place the kernel's whole operands in VMEM (memory space S(1)),
counted in the kernel's scoped allocation: libtpu 0.0.42.1 needed 20.3 MiB for the per-channel
backward, float32, 4 heads of 64, at B2 T128 (one chunk), where T = 512 compiles within 16 MiB
(`tests/test_compile.py`). v5e and v6e have 128 MiB of VMEM."""


def kernel_vmem_limit(generation: str | None) -> int:
    """The `vmem_limit_bytes` the kernels compile with: `KERNEL_HEADROOM` × the generation's
    default scoped limit (tiles are still chosen to fit the default, `vmem_problem`)."""
    return KERNEL_HEADROOM * vmem_limit(generation)


DELTA_SQUARES = {False: 3, True: 7}
"""[C, C] float32 temporaries a head of the delta rule's forward / backward keeps live (the
scores, X = (I + M)⁻¹ and its doubling's products; the backward's adjoints, their transposes
and the triangular sums), fitted to libtpu 0.0.42.1's v5e compiles (`_delta_vmem_bytes`)."""


def _delta_vmem_bytes(C, K, BV, gate, backward, heads, lanes, qk, state, column, decay) -> int:
    """The delta rule's kernels: the blocks as `recurrent`'s plus β [C, H] (and, backward, the
    per-head gradient columns [C, H] and the per-channel da [C, Hb · K]), the state scratch,
    and per head `DELTA_SQUARES` [C, C] float32 temporaries, [C, max(K, BV)] float32 ones (one
    forward, two backward) and, per channel, the sub-blocks' anchored [C, K] rows
    (`_channel_rows`).

    Fitted to libtpu 0.0.42.1 on a v5e (16 MiB, K = V = 128 bf16, 32 value heads on 16
    query/key heads): per head, chunk 128, up to 8 heads compile forward and backward; chunk
    256, 8 forward and 4 backward, 8 backward fail; per channel, chunk 128 up to 8 heads, chunk
    256 the backward of 1 head compiles and of 2 fails (as with K = V = 256 at chunk 128). Also compiled: per head, 16 heads of
    64, 8 of 128 float32, 4 of 256 (backward). The q and k blocks hold the Gb
    query/key heads a step reads)."""
    if backward:  # q, k, v, β, decay, do, states, dh_T -> dq, dk, dv, dβ, da, dh0; dS
        inputs = 2 * qk + 2 * lanes(BV) + column + decay + 2 * state
        da = {Gate.HEAD: column, Gate.KEY: lanes(K, F32_BYTES)}.get(gate, 0)
        outputs = 2 * lanes(K, F32_BYTES) + lanes(BV, F32_BYTES) + column + da + state
    else:  # q, k, v, β, decay, h0 -> o, h_T, states; S
        inputs = 2 * qk + lanes(BV) + column + decay + state
        outputs = lanes(BV) + 2 * state
    wide = (2 if backward else 1) * tile_bytes(C, max(K, BV), F32_BYTES)
    channel = _channel_rows(C, K, backward) if gate is Gate.KEY else 0
    temporaries = DELTA_SQUARES[backward] * tile_bytes(C, C, F32_BYTES) + wide + channel
    return 2 * (inputs + outputs) + state + heads * temporaries


def _channel_rows(C: int, K: int, backward: bool) -> int:
    """A per-channel decay's [C, K] float32 rows (the sub-blocks' anchored rows and products) a
    head of the delta rule's kernels keeps live: 2 forward; in the backward measured to grow far
    faster than the tile (libtpu 0.0.42.1, v5e: under 0.16 MiB a head at C = K = 128, over 3.7
    MiB at C = 256, K = 128 and over 6 MiB at C = 128, K = 256, where two heads overflow and
    one compiles), counted as 2 · (C · K / 128²)⁵ rows, a fit to those bounds."""
    rows = 2 * (C * K / 128**2) ** 5 if backward else 2
    return int(rows * tile_bytes(C, K, F32_BYTES))


def vmem_limit(generation: str | None) -> int:
    """The scoped-VMEM limit tiles are judged against: the generation's, else the smallest."""
    return SCOPED_VMEM_BYTES.get(generation, min(SCOPED_VMEM_BYTES.values()))


def vmem_problem(C: int, K: int, BV: int, dtype, gate: Gate | None, backward: bool, generation: str | None,
                 heads: int = 1, delta: bool = False, qk_heads: int | None = None) -> str | None:
    """Why these tiles overflow the generation's scoped VMEM, or None (`delta`: the delta rule's
    kernels, `qk_heads` query/key heads a step)."""
    need, limit = vmem_bytes(C, K, BV, dtype, gate, backward, heads, delta, qk_heads), vmem_limit(generation)
    if need <= limit:
        return None
    kernel = ("delta rule's " if delta else "") + ("backward" if backward else "forward")
    tiles = f"chunk={C}" + (f" with {heads} heads per grid step" if heads > 1 else "")
    return (f"{tiles} needs about {need / MiB:.1f} MiB of VMEM in the {kernel} kernel, over the "
            f"{limit / MiB:.0f} MiB scoped-VMEM limit of {generation or 'the smallest supported TPU'}")
