"""The delta rule through a backend's forward kernel, differentiable by the XLA `chunk` backward.

| symbol | meaning                                                                  |
|--------|--------------------------------------------------------------------------|
| B, H   | batch rows, value heads (query/key heads repeated to H before the kernel) |
| T, Tp  | tokens, tokens padded to a multiple of the chunk C                       |
| K, V   | key/query and value head dimensions                                      |
| R      | state rows: B, or S sequences when packed                                |
| a      | the chunk-local cumulative log decay the kernel sees: [B, Tp, H] or [B, Tp, H, K] |

Around the kernel, plain JAX does what it does for `recurrent`'s kernels (`_driver.py`):
repeating shared query/key heads, combining a per-head and a per-channel decay into one
per-channel decay, zero-padding T to a multiple of C (padded tokens have q = k = v = 0,
β = 0 and a zero log decay, so they neither read nor change the state), the chunk-aligned
layout of packed sequences (a traced `cu_seqlens` is fine: shapes depend on N and S only),
and the chunk-local cumulative sums of the log decays, each floored at
`_driver.STRONGEST_DECAY` (e^−20 per token, below float32's rounding of the state; a
stronger decay, or a hard reset of −inf, is taken as that).

**Gradients.** The kernel has no backward of its own yet: `delta_kernel` is a `custom_vjp`
whose forward is the kernel and whose backward is the VJP of the XLA `chunk` algorithm
(`recurrax.delta.chunk_delta`) recomputed from the inputs: its forward scan once more (to
store one state per chunk), then its reverse scan. So `jax.grad` through the kernel costs
the kernel's forward, plus XLA `chunk`'s forward and backward, and gives `chunk`'s gradients.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from .. import varlen
from ..problem import Gate
from ._driver import STRONGEST_DECAY, KernelConfig, chunk_local_cumsum, vary_alike

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class DeltaKernelCall:
    """Static configuration of one call (the custom_vjp's non-differentiable argument).

    **Arguments:**
    - `forward`: the backend's launch function, `forward(q, k, v, beta, a, h0, table, *,
      static) -> (o, h_T)` (token-major, heads expanded, Tp a multiple of the chunk).
    - `static`: what the kernel is specialised for (`KernelConfig`; its tiles' `chunk` is C).
    """

    forward: Callable
    static: KernelConfig

    @property
    def chunk(self) -> int:
        return self.static.tiles.chunk


def _expanded(x, heads: int):
    """Query/key heads repeated to the `heads` value heads (value head h reads h // groups)."""
    return jnp.repeat(x, heads // x.shape[2], axis=2)


def _key_side_decay(g_head, g_key):
    """The one log decay the kernel reads: per channel when a per-channel term is present."""
    if g_key is None:
        return g_head
    return g_key if g_head is None else g_key + g_head[..., None]


def _local_decay(g, chunk: int):
    return None if g is None else chunk_local_cumsum(jnp.maximum(g.astype(F32), STRONGEST_DECAY), chunk)


def _run_kernel(call: DeltaKernelCall, q, k, v, beta, g_head, g_key, h0, cu_seqlens):
    """(o [B, T, H, V], h_T [R, H, K, V] float32) of the canonical arrays (heads shared)."""
    H, C = v.shape[2], call.chunk
    q, k = _expanded(q, H), _expanded(k, H)
    g = _key_side_decay(g_head, g_key)
    beta = beta.astype(F32)
    h0 = h0.astype(F32)
    if cu_seqlens is None:
        T = q.shape[1]
        Tp = -(-T // C) * C
        q, k, v, beta, g = (varlen.pad_tokens(x, Tp) for x in (q, k, v, beta, g))
        arrays = vary_alike(q, k, v, beta, _local_decay(g, C), h0)
        o, h_T = call.forward(*arrays, None, static=call.static)
        return o[:, :T], h_T
    layout = varlen.chunk_layout(cu_seqlens, q.shape[1], C)
    to_slots = lambda x: None if x is None else varlen.to_chunk_layout(x[0], layout)[None]  # noqa: E731
    q, k, v, beta, g = (to_slots(x) for x in (q, k, v, beta, g))
    owners = layout.owners
    *arrays, table = vary_alike(q, k, v, beta, _local_decay(g, C), h0, owners.table())
    o, h_T = call.forward(*arrays, table, static=call.static)
    h_T = jnp.where(owners.empty[:, None, None, None], h0, h_T)  # an empty sequence keeps its state
    return varlen.from_chunk_layout(o[0], layout)[None], h_T


def _chunk_algorithm(scale: float, q, k, v, beta, g_head, g_key, h0, cu_seqlens):
    """The same call through the XLA `chunk` algorithm (the backward's function)."""
    from ..delta._chunk import chunk_delta
    from ..delta._problem import DeltaProblem

    problem = DeltaProblem(q, k, v, beta, g_head, g_key, h0, cu_seqlens)
    return chunk_delta(problem, scale=scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _delta_kernel(call: DeltaKernelCall, q, k, v, beta, g_head, g_key, h0, cu_seqlens):
    return _run_kernel(call, q, k, v, beta, g_head, g_key, h0, cu_seqlens)


def _delta_kernel_fwd(call, q, k, v, beta, g_head, g_key, h0, cu_seqlens):
    outputs = _run_kernel(call, q, k, v, beta, g_head, g_key, h0, cu_seqlens)
    return outputs, (q, k, v, beta, g_head, g_key, h0, cu_seqlens)


def _delta_kernel_bwd(call, residuals, cotangents):
    *arrays, cu_seqlens = residuals
    algorithm = lambda *arrays: _chunk_algorithm(call.static.scale, *arrays, cu_seqlens)  # noqa: E731
    _, pullback = jax.vjp(algorithm, *arrays)
    do, dh_T = cotangents
    return (*pullback((do, dh_T)), None)


_delta_kernel.defvjp(_delta_kernel_fwd, _delta_kernel_bwd)


def delta_kernel(problem, *, scale: float, forward: Callable, tiles, interpret: bool = False):
    """The delta rule through a backend's forward kernel; `(output, final_state)` like
    `recurrax.delta.chunk_delta`, differentiable (by `chunk`'s backward, module docstring).

    **Arguments:**
    - `problem`: the canonical `DeltaProblem` (float32 or bfloat16 inputs; query/key heads
      may be shared by groups of value heads).
    - `scale`: the output scale; `forward`: the backend's launch function; `tiles`: its tiles.
    - `interpret`: run the kernel in the backend's interpret mode.
    """
    gate = Gate.KEY if problem.log_decay_key is not None else Gate.HEAD if problem.log_decay_head is not None else None
    call = DeltaKernelCall(forward, KernelConfig(float(scale), gate, bool(interpret), tiles))
    o, h_T = _delta_kernel(call, *problem)
    return o.astype(problem.query.dtype), h_T.astype(problem.state_dtype)
