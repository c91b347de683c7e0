"""How the driver's arrays meet the Mosaic GPU kernels: checks, TMA-friendly layouts, launch.

| array   | driver layout            | kernel layout                     | why                                   |
|---------|--------------------------|-----------------------------------|---------------------------------------|
| q, k    | [B, Tp, H, K]            | same; TMA tile `ref.at[b, rows, h]`| a [C, K] tile, rows strided by H·K     |
| v, do   | [B, Tp, H, V]            | same; tile `ref.at[b, rows, h, cols]` |                                    |
| a (head)| [B, Tp, H] float32       | [B, H, Tp]                        | TMA needs a contiguous minor dim       |
| a (key) | [B, Tp, H, K] float32    | same; tile `ref.at[b, rows, h]`   | rows and the [C, K] tile (`_channel`)  |
| meta    | [3, N] int32             | [3, N16], N rounded up to 16      | TMA rows of whole 64-byte multiples    |
| h0, h_T | [R, H, K, V] float32     | same; tile `ref.at[r, h, :, cols]`|                                       |
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from .._driver import KernelConfig
from ._tiles import BLOCK_V, CHUNK, F32, interpret_params, swizzled


def check_shapes(q, v, a, static: KernelConfig) -> str:
    """The gate kind (`"none"`, `"head"` or `"key"`) after checking what these kernels support."""
    K, V = q.shape[-1], v.shape[-1]
    gate = "none" if static.gate is None else static.gate.value
    if gate not in ("none", "head", "key"):
        raise NotImplementedError(f"Mosaic GPU chunk kernels: gate kind {gate!r} is not implemented")
    expected = {"none": None, "head": q.shape[:3], "key": q.shape}[gate]
    if a is not None and a.shape != expected:
        raise ValueError(f"decay of shape {a.shape} for gate kind {gate!r}; expected {expected}")
    if K % 64 or V % BLOCK_V or K > 256:
        raise ValueError(f"Mosaic GPU chunk kernels need K and V multiples of 64, K ≤ 256; got K={K}, V={V}")
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise ValueError(f"Mosaic GPU chunk kernels take bfloat16/float16 inputs (wgmma operands), got {q.dtype}")
    if (a is None) != (gate == "none"):
        raise ValueError(f"decay {None if a is None else a.shape} does not match gate kind {gate!r}")
    return gate


def head_major_decay(a):
    """[B, Tp, H] -> [B, H, Tp]: one chunk's decays become a contiguous TMA row."""
    return jnp.swapaxes(a, 1, 2)


def decay_operands(a, gate: str) -> list:
    """The kernel arguments carrying A: none, the head-major [B, H, Tp], or [B, Tp, H, K]."""
    return [] if a is None else [head_major_decay(a) if gate == "head" else a]


DECAY_COPIES = {"none": 0, "head": 2, "key": 1}
"""TMA copies of A per chunk: per head A twice (one SMEM copy per register layout it is loaded
in, rows and columns); per key channel one [C, K] tile (read by rows, `_channel`)."""


def decay_scratch(gate: str, slots: int, K: int, dtype) -> dict:
    """SMEM for A in every slot; per key channel also `_channel`'s two wgmma operand tiles."""
    C = CHUNK
    if gate == "key":
        return dict(a_s=plgpu.SMEM((slots, C, K), F32), lhs=swizzled((C, K), dtype), rhs=swizzled((C, K), dtype))
    return dict(a_s=plgpu.SMEM((slots, C), F32), a_cols_s=plgpu.SMEM((slots, C), F32))


def decay_bytes(gate: str, slots: int, K: int, dtype) -> int:
    """The bytes `decay_scratch` allocates."""
    C, isz = CHUNK, jnp.dtype(dtype).itemsize
    if gate == "key":
        return slots * C * K * 4 + 2 * C * K * isz
    return slots * 2 * C * 4


def fetch_decay(a_ref, scratch: dict, gate: str, b, h, rows, slot, bar) -> None:
    """TMA of one chunk's A into `slot` of `decay_scratch` (`DECAY_COPIES[gate]` copies on `bar`)."""
    if gate == "key":
        plgpu.copy_gmem_to_smem(a_ref.at[b, rows, h], scratch["a_s"].at[slot], bar)
    elif gate == "head":
        plgpu.copy_gmem_to_smem(a_ref.at[b, h, rows], scratch["a_s"].at[slot], bar)
        plgpu.copy_gmem_to_smem(a_ref.at[b, h, rows], scratch["a_cols_s"].at[slot], bar)


def chunk_inputs(refs: list, gate: str, varlen: bool) -> tuple:
    """(q, k, v, a or None, meta or None): the kernels' first operands, taken off `refs`."""
    q_ref, k_ref, v_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    a_ref = refs.pop(0) if gate != "none" else None
    return q_ref, k_ref, v_ref, a_ref, (refs.pop(0) if varlen else None)


def padded_meta(meta):
    """[3, N] -> [3, N16] int32 (zero columns appended): a TMA copy of whole 64-byte rows."""
    N = meta.shape[1]
    return jnp.pad(meta.astype(jnp.int32), ((0, 0), (0, -N % 16)))


SMEM_LIMIT = 227 * 1024
"""Dynamic shared memory one block may use on H100/H200 (sm_90)."""


def slots_that_fit(smem_bytes, what: str) -> int:
    """2 (double-buffered inputs: chunk n + 1 loads while n computes) if `smem_bytes(2)` fits
    in `SMEM_LIMIT`, else 1 (each chunk's inputs are loaded, then used); a ValueError if
    not even one slot fits (the kernel could not launch on a Hopper GPU)."""
    if smem_bytes(1) > SMEM_LIMIT:
        needed = smem_bytes(1)
        raise ValueError(f"Mosaic GPU chunk kernel ({what}) needs {needed} bytes of shared memory, over {SMEM_LIMIT}")
    return 2 if smem_bytes(2) <= SMEM_LIMIT else 1


def kernel_params(static) -> dict:
    """`plgpu.kernel` keyword arguments for the static target (compiled, or CPU interpret)."""
    return {"interpret": interpret_params() if static.interpret else None}
