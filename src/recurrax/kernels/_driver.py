"""What both operations' Pallas kernels share around their custom VJPs, for every backend.

| name                | what it is                                                              |
|---------------------|-------------------------------------------------------------------------|
| `KernelConfig`      | what a call's kernels are specialised for (their `static` argument)     |
| `in_chunks`         | the layout the kernels read: padded rows, or packed sequences chunk-aligned |
| `keep_empty`        | a sequence without tokens keeps its state (and passes its gradient)     |
| `floored_gate`, `chunk_local_cumsum` | the log decay the kernels see: floored, summed per chunk |
| `vary_over`, `output_type`, … | arrays and kernel outputs varying like the inputs inside `shard_map` |
| `kernel_support`, `missing_module`, `head_dims_refusal` | a backend's `Support` and refusals |

The operations' drivers are `_recurrent_driver.py` (`recurrent`: `PallasBackend`,
`kernel_recurrent`, the gate gradient from dq and dk) and `_delta_driver.py` (the delta rule:
`delta_kernel`, every gradient from the backward kernel).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._core import varlen
from .._core.finite import clean_gate
from .._core.problem import Gate
from .._core.registry import Request, Support

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """What a backend's kernels are specialised for: the hashable `static` argument of its
    launch functions.

    **Arguments:**
    - `scale`: the output scale.
    - `gate`: the key-side decay form the kernels are built for (`None`, `Gate.HEAD`, `Gate.KEY`).
    - `interpret`: run in the backend's interpret mode (any device) instead of compiling.
    - `tiles`: the backend's tile sizes (None where the backend fixes them).
    """

    scale: float
    gate: Gate | None
    interpret: bool = False
    tiles: Any = None


STRONGEST_DECAY = -20.0
"""The kernels' per-token log decays are floored here: e^−20 ≈ 2·10⁻⁹ multiplies what a stronger
decay would zero, below float32's rounding of the state (their state is float32)."""


def chunk_local_cumsum(g, chunk: int):
    """Inclusive cumulative sum of `g` [B, Tp, H(, K)] restarted at every chunk, in float32."""
    B, Tp = g.shape[:2]
    blocks = g.astype(F32).reshape(B, Tp // chunk, chunk, *g.shape[2:])
    return jnp.cumsum(blocks, axis=2).reshape(g.shape)


def floored_gate(g):
    """The per-token log decay the kernels see, cleaned (a NaN or +inf gate reads as 0) and
    floored at `STRONGEST_DECAY`; None without one."""
    return None if g is None else jnp.maximum(clean_gate(g), STRONGEST_DECAY)


def keep_empty(empty, kept, computed):
    """`computed` [R, H, K, V], but `kept` for the sequences `empty` marks (packed input: a
    sequence without tokens keeps its initial state, its gradient passes through); `computed`
    when `empty` is None (dense rows)."""
    return computed if empty is None else jnp.where(empty[:, None, None, None], kept, computed)


def in_chunks(chunked: Callable, chunk: int, tokens: tuple, h0, cu_seqlens):
    """`chunked(*tokens, h0, table, empty) -> (o, h_T)` on token arrays ([B, T, ...], None kept)
    in the layout the kernels read; `(o [B, T, H, V], h_T)`.

    Dense rows: T zero-padded to a multiple of `chunk` (table and empty None). Packed
    sequences ([1, N, ...] and `cu_seqlens`, static or traced): the chunk-aligned layout of
    `recurrax._core.varlen`, every sequence starting a chunk, with its owners table ([3, M] int32)
    and which sequences are empty ([R] bool). Inputs are made to vary alike (`vary_alike`).
    """
    if cu_seqlens is None:
        T = tokens[0].shape[1]
        Tp = -(-T // chunk) * chunk
        o, h_T = chunked(*vary_alike(*(varlen.pad_tokens(x, Tp) for x in tokens), h0), None, None)
        return o[:, :T], h_T
    layout = varlen.chunk_layout(cu_seqlens, tokens[0].shape[1], chunk)
    to_slots = lambda x: None if x is None else varlen.to_chunk_layout(x[0], layout)[None]  # noqa: E731
    owners = layout.owners
    o, h_T = chunked(*vary_alike(*(to_slots(x) for x in tokens), h0, owners.table(), owners.empty))
    return varlen.from_chunk_layout(o[0], layout)[None], h_T


def varying_axes(*arrays) -> frozenset:
    """The mesh axes any of `arrays` (None skipped) varies over inside `jax.shard_map`;
    empty outside it."""
    axes = frozenset()
    for x in arrays:
        if x is not None:
            axes |= jax.typeof(x).manual_axis_type.varying
    return axes


def vary_over(axes: frozenset, *arrays) -> tuple:
    """`arrays` (None kept) cast to vary over `axes` too (`lax.pcast`, whose transpose sums
    the gradient over the axes an array did not vary over)."""

    def cast(x):
        missing = () if x is None else tuple(sorted(axes - varying_axes(x)))
        return lax.pcast(x, missing, to="varying") if missing else x

    return tuple(cast(x) for x in arrays)


def sum_to_vary_like(bar, primal):
    """`bar` summed over the mesh axes it varies over and `primal` does not (inside shard_map:
    e.g. a replicated weight's cotangent from each shard's terms), as autodiff's transpose of
    the implicit broadcast would; unchanged outside shard_map."""
    extra = tuple(sorted(varying_axes(bar) - varying_axes(primal)))
    return lax.psum(bar, extra) if extra else bar


def vary_alike(*arrays) -> tuple:
    """`arrays` made to vary over the union of their mesh axes, so a kernel's outputs (and
    their gradients) vary like all of its inputs. Identity outside `jax.shard_map`."""
    return vary_over(varying_axes(*arrays), *arrays)


def output_type(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """A kernel output's declaration, varying over the mesh axes of `like` (an input)
    inside `jax.shard_map`, which `check_vma=True` asks for."""
    varying = jax.sharding.ManualAxisType(varying=varying_axes(like))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=varying)


def missing_module(module: str, reason: str) -> str | None:
    """`reason` if `module` (a JAX Pallas backend) cannot be imported, else None: a backend's
    `unavailable()`."""
    try:
        importlib.import_module(module)
    except ImportError:
        return reason
    return None


def kernel_support(dtypes: set[str], check: Callable[[Request], str | None], shared_query_key: bool = False) -> Support:
    """A backend's `Support`: its `dtypes` and `check`, and what the driver gives every backend:
    per-head and per-key-channel decays (not `gv`) and packed input; `shared_query_key` where
    the backend's kernels read query/key heads shared by groups of value heads unrepeated."""
    return Support(dtypes=frozenset(dtypes), gates=frozenset({Gate.HEAD, Gate.KEY}), varlen=True, check=check,
                   shared_query_key=shared_query_key)


def head_dims_refusal(request: Request, allowed, words: str) -> str | None:
    """Why a kernel refuses the call's head dims (`allowed`, described by `words`), or None."""
    for name, dim in (("qk_head_dim", request.qk_head_dim), ("v_head_dim", request.v_head_dim)):
        if dim not in allowed:
            return f"{name}={dim} is not {words}"
    return None
