"""The delta rule through a backend's forward and backward kernels, as one differentiable function.

| symbol | meaning                                                                  |
|--------|--------------------------------------------------------------------------|
| B, H   | batch rows, value heads                                                  |
| G      | query/key heads: H, or fewer shared by groups of H / G value heads (unrepeated) |
| T, Tp  | tokens, tokens padded to a multiple of the chunk C                       |
| K, V   | key/query and value head dimensions                                      |
| R      | state rows: B, or S sequences when packed                                |
| a      | the chunk-local cumulative log decay the kernel sees: [B, Tp, H] or [B, Tp, H, K] |

Around the kernels, plain JAX does what it does for `recurrent`'s kernels (`_recurrent_driver.py`):
combining a per-head and a per-channel decay into one
per-channel decay, zero-padding T to a multiple of C (padded tokens have q = k = v = 0,
β = 0 and a zero log decay, so they neither read nor change the state), the chunk-aligned
layout of packed sequences (a traced `cu_seqlens` is fine: shapes depend on N and S only),
and the chunk-local cumulative sums of the log decays, each floored at
`_driver.STRONGEST_DECAY` (e^−20 per token, below float32's rounding of the state; a
stronger decay, or a hard reset of −inf, is taken as that). Query/key heads shared by groups
of value heads reach the kernels unrepeated (the TPU kernels' index maps read them, `kernels/tpu/_tiles.py`).

**Gradients.** `_delta_chunk` is a `custom_vjp` over the padded (or chunk-aligned packed),
arrays and the floored per-token log decay: its backward runs the backend's
forward kernel once more to write the state entering every chunk ([B, H, N, K, V] float32,
as the `recurrent` kernels' backward reads them), then the backward kernel, which returns
every gradient, the per-token log decay's included, and dq, dk summed over the value heads
sharing a query/key head (`kernels/tpu/_delta_backward.py`). The rest (the decay's floor and sum, padding, the packed layout, `qk_l2norm`
before the problem reaches the kernel) is JAX's autodiff around it.

**Non-finite inputs** (`recurrax._core.finite_delta`): the kernels read the non-finite entries of
q, k, v, β and the output cotangent as 0 where they load a block (no cleaned copy in XLA), and
inside the custom VJP a NaN or +inf gate reads as 0; `_core.finite_delta.guarded` around the whole
marks NaN what depends on them. A backend's `forward` and `backward` must clean at load so.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from .._core.finite_delta import guarded
from .._core.problem import Gate
from ._driver import (STRONGEST_DECAY, KernelConfig, chunk_local_cumsum, floored_gate, in_chunks, keep_empty,
                      vary_over, varying_axes)

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class DeltaKernelCall:
    """Static configuration of one call (the custom_vjp's non-differentiable argument).

    **Arguments:**
    - `forward`: the backend's forward launch, `forward(q, k, v, beta, a, h0, table, *,
      static, emit_output, emit_states) -> [o], h_T, [states]` (token-major, q and k [B, Tp,
      G, K] with G query/key heads shared by the value heads in groups, Tp a multiple of the
      chunk, `a` the chunk-local cumulative log decay).
    - `backward`: the backend's backward launch, `backward(q, k, v, beta, a, do, states,
      dh_T, table, *, static) -> (dq, dk, dv, dβ, da, dh0)`, float32, dq and dk [B, Tp, G,
      K] (summed over the groups), `da` with respect to the per-token log decay.
    - `static`: what the kernels are specialised for (`KernelConfig`; its tiles' `chunk` is C).
    """

    forward: Callable
    backward: Callable
    static: KernelConfig

    @property
    def chunk(self) -> int:
        return self.static.tiles.chunk


def _key_side_decay(g_head, g_key):
    """The one log decay the kernel reads: per channel when a per-channel term is present."""
    if g_key is None:
        return g_head
    return g_key if g_head is None else g_key + g_head[..., None]


def _floored(g):
    """The per-token log decay the kernels see (`_driver.STRONGEST_DECAY`), float32."""
    return None if g is None else jnp.maximum(g.astype(F32), STRONGEST_DECAY)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _delta_chunk(call: DeltaKernelCall, q, k, v, beta, g, h0, table, empty):
    """(o [B, Tp, H, V], h_T [R, H, K, V]) of padded arrays (q, k [B, Tp, G, K], `g` the floored
    per-token log decay or None); `table` [3, M] and `empty` [R] describe packed input (None
    when dense): a sequence without tokens keeps its initial state."""
    return _delta_chunk_fwd(call, q, k, v, beta, g, h0, table, empty)[0]


def _local(g, call: DeltaKernelCall):
    """The kernels' chunk-local cumulative log decay of the cleaned gate (a NaN or +inf gate as 0,
    `floored_gate`), taken inside the custom VJP so gradients pass as they are; q, k, v, β and do
    the kernels clean at load (module docstring)."""
    return None if g is None else chunk_local_cumsum(floored_gate(g), call.chunk)


def _delta_chunk_fwd(call, q, k, v, beta, g, h0, table, empty):
    o, h_T = call.forward(q, k, v, beta, _local(g, call), h0, table, static=call.static)
    return (o, keep_empty(empty, h0, h_T)), (q, k, v, beta, g, h0, table, empty)


def _delta_chunk_bwd(call, residuals, cotangents):
    q, k, v, beta, g, h0, table, empty = residuals
    do, dh_T = cotangents
    a = _local(g, call)
    _, states = call.forward(q, k, v, beta, a, h0, table, static=call.static, emit_output=False,
                             emit_states=True)
    dh_T = dh_T.astype(F32)
    grads = call.backward(q, k, v, beta, a, do.astype(q.dtype), states, dh_T, table,
                          static=call.static)
    dq, dk, dv, d_beta, dg, dh0 = vary_over(varying_axes(q, k, v, beta, g, h0, do, dh_T), *grads)
    dh0 = keep_empty(empty, dh_T, dh0)
    grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_beta.astype(beta.dtype),
             None if g is None else dg.astype(g.dtype), dh0.astype(h0.dtype))
    return grads + (None, None)


_delta_chunk.defvjp(_delta_chunk_fwd, _delta_chunk_bwd)


def _run_kernel(call: DeltaKernelCall, q, k, v, beta, g_head, g_key, h0, cu_seqlens):
    """(o [B, T, H, V], h_T [R, H, K, V] float32) of the canonical arrays (heads shared)."""
    k, v = k.astype(q.dtype), v.astype(q.dtype)  # one operand dtype for the kernels
    tokens = (q, k, v, beta.astype(F32), _floored(_key_side_decay(g_head, g_key)))
    return in_chunks(functools.partial(_delta_chunk, call), call.chunk, tokens, h0.astype(F32), cu_seqlens)


def delta_kernel(problem, *, scale: float, forward: Callable, backward: Callable, tiles, interpret: bool = False):
    """The delta rule through a backend's kernels; `(output, final_state)` like
    `recurrax.delta.chunk_delta`, differentiable (module docstring).

    **Arguments:**
    - `problem`: the canonical `DeltaProblem` (float32 or bfloat16 inputs; query/key heads
      may be shared by groups of value heads).
    - `scale`: the output scale; `forward`, `backward`: the backend's launch functions
      (`DeltaKernelCall`); `tiles`: its tiles.
    - `interpret`: run the kernels in the backend's interpret mode.
    """
    gate = Gate.KEY if problem.log_decay_key is not None else Gate.HEAD if problem.log_decay_head is not None else None
    call = DeltaKernelCall(forward, backward, KernelConfig(float(scale), gate, bool(interpret), tiles))
    return guarded(functools.partial(_delta_kernel, call), problem)


def _delta_kernel(call: DeltaKernelCall, problem):
    o, h_T = _run_kernel(call, *problem)
    return o.astype(problem.query.dtype), h_T.astype(problem.state_dtype)
