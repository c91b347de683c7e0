"""`recurrent`'s Pallas chunk algorithm as one differentiable function of the canonical
`Problem`, for any backend's kernels (a `PallasBackend`: Triton, Mosaic GPU and TPU today).

| symbol | meaning                                                              |
|--------|----------------------------------------------------------------------|
| B, H   | batch rows, heads                                                    |
| T, Tp  | tokens, tokens padded to a multiple of the chunk C                   |
| K, V   | key/query and value head dimensions                                  |
| g      | the key-side log decay the kernels see: [B, Tp, H] or [B, Tp, H, K]  |
| B_t    | global cumulative log decay Σ_{s ≤ t} g_s (never materialised)       |

Around the kernels (a backend's `forward` and `backward`), plain JAX does what autodiff handles
well: folding the per-head decay into a per-channel one when both are present, reversing
the token axis for `reverse=True`, the layout both operations' kernels read (`_driver.in_chunks`:
T zero-padded to a multiple of C, padded tokens have q = k = v = 0 and g = 0, so they leave
the state unchanged; packed sequences chunk-aligned), and casting.

**Gate gradients without stored states.** Write h_t = e^{B_t} ⊙ (h_{-1} + Σ_{j ≤ t}
(k_j ⊙ e^{−B_j}) v_jᵀ) and o_t = scale · (q_t ⊙ e^{B_t})ᵀ (…). Treating every B_t as a free
variable, B_t enters only through q̃_t = q_t ⊙ e^{B_t}, k̃_t = k_t ⊙ e^{−B_t} and, for the
last token, through the final state h_T = e^{B_T} ⊙ (…). Since ∂L/∂q_t = e^{B_t} ⊙ ∂L/∂q̃_t
and ∂L/∂k_t = e^{−B_t} ⊙ ∂L/∂k̃_t:

    dB_t := ∂L/∂B_t = q_t ⊙ dq_t − k_t ⊙ dk_t  (+ Σ_V h_T ⊙ dh_T on the last token)   [K]

and because B_s = Σ_{t ≤ s} g_t, dg_t = Σ_{s ≥ t} dB_s, a reverse cumulative sum.

That sum, taken over the whole sequence, adds O(1) terms that cancel to a much smaller
result, so the rounding of dq and dk (bf16 matmul operands) grows with T. It is cut at
chunk boundaries instead: for t in chunk n, whose last token is m − 1,

    dg_t = Σ_{t ≤ s < m} dB_s  +  Σ_V S_m ⊙ dS_m

because Σ_{s ≥ m} dB_s is the derivative of shifting B_s by the same δ for every s ≥ m,
which multiplies every pair (j < m ≤ i) and the initial state's contribution after m by
e^δ, i.e. scales the state S_m leaving chunk n (as later tokens see it) by e^δ; its
derivative is Σ_V S_m ⊙ dS_m with dS_m the gradient the backward kernel carries there
(for the last chunk: h_T ⊙ dh_T, the final-state term). The kernel writes that
"boundary" term per chunk; only sums of at most C terms are left to cancel. A per-head
decay sums the K channels. Everything else (the gradient of g_gamma, of grouped heads,
of the flip and the padding) is JAX's autodiff of the normalisation.

Where these sums are taken: a backend whose backward kernel has q, k, dq, dk and the boundary
term of a chunk in fast memory forms dg there (`PallasBackend.gate_in_kernel`; the TPU
kernels: the suffix sums Σ_{t ≤ s < m} as a product with a [C, C] upper-triangular 0/1
matrix, exact in three bf16 MXU passes), so no float32 dq, dk and no cumulative sum
over them is made in XLA, and dq, dk leave the kernel in the caller's dtype where nothing
is summed after it. Otherwise the kernel writes the boundary terms and `gate_gradient`
takes the sums here. The chunk-local decay the kernels read is the forward's residual
(float32 like g), not recomputed for the backward; kernels that form it where they load a
block (`PallasBackend.head_decay_in_kernel`, a per-head decay) read g itself. A backend
whose forward kernel writes the states entering every chunk while differentiated
(`PallasBackend.states_residual`) hands them to the backward; else the backward reruns the
forward kernel for them.
"""


from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .._core.finite import clean_tokens
from .._core.finite_recurrent import guarded
from .._core.problem import Gate, Problem
from ._driver import (F32, KernelConfig, chunk_local_cumsum, floored_gate, in_chunks, keep_empty, vary_over,
                      varying_axes)


def _no_tiles(problem: Problem) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class PallasBackend:
    """A Pallas backend of the chunk algorithm: what its folder hands the driver. Hashable (it is
    part of the custom_vjp's static argument), so its fields are module-level functions.

    Both launch functions take token-major `[B, Tp, H, ·]` inputs with Tp a multiple of the
    chunk, the chunk-local cumulative key-side log decay `a` (float32 `[B, Tp, H]` for
    `Gate.HEAD`, `[B, Tp, H, K]` for `Gate.KEY`, None without decay), `h0` / `h_T` `[R, H, K, V]`
    float32 (R = B, or S sequences when packed), for packed input (B = 1, chunk-aligned
    layout) the `[3, N]` int32 table of `varlen.ChunkOwners.table()` (per chunk its sequence,
    whether it is that sequence's first chunk, and its last; else None), and `static`, a
    `KernelConfig`.

    **Arguments:**
    - `forward(q, k, v, a, h0, table, *, static, emit_output, emit_states)`: a list: `o`
      [B, Tp, H, V] (q's dtype) if `emit_output`, `h_T` [R, H, K, V] float32 (packed: written
      only for sequences that own a chunk), and the states entering every chunk
      [B, H, N, K, V] float32 if `emit_states`.
    - `backward(q, k, v, a, do, states, h_T, dh_T, table, *, static)`: `(dq, dk, dv, dh0,
      boundary)`, float32: dq and dk [B, Tp, H, K] with respect to each value head's q and k
      (summed over value blocks; with shared query/key heads, q and k [B, Tp, G, K], each
      value head's share, which the driver sums over the groups), dv [B, Tp, H, V], dh0
      [R, H, K, V] (packed: written only for sequences that own a chunk), and `boundary`
      [B, H, N, K] = Σ_V S ⊙ dS of the state leaving each chunk, the gate gradient's carry
      (`gate_gradient`; None without decay). With `gate_in_kernel`, see that field.
    - `chip_tiles(problem)`: the tiles of a call on the backend's chip.
    - `interpret_tiles`: the tiles in interpret mode unless a call names its own.
    - `chunk`: the chunk length where the backend fixes it; None: the tiles' `chunk`.
    - `gate_in_kernel`: the backward kernel forms the gate gradient itself: `backward` takes
      `grad_dtypes` (q's, k's and v's dtypes) and returns `(dq, dk, dv, dh0, dg)`, dq and dk
      [B, Tp, G, K] summed over groups and value blocks, in a dtype the driver casts to q's, k's
      and v's from (theirs where the kernel can write it), dg as `gate_gradient`'s (None
      without decay). Without it the driver forms dg
      from the boundary terms in XLA (`gate_gradient`).
    - `cleans_at_load`: the kernels read non-finite entries of q, k, v and do as 0 where they
      load a block (`recurrax._core.finite`), so the driver hands them the arrays as they are
      and XLA stores no cleaned copy; without it the driver cleans them first (`clean_tokens`).
    - `head_decay_in_kernel`: with a per-head decay the kernels take the gate g itself
      ([B, Tp, H] float32, as the caller gave it) in place of `a` and form `floored_gate`'s
      cleaning and floor and the chunk-local cumulative sum where they load a block, so XLA
      runs no cumulative sum and stores no `a`.
    - `states_residual`: a differentiated call's forward kernel also writes the states
      entering every chunk (`emit_states`, [B, H, N, K, V] float32: the residual the XLA
      `chunk`'s scan keeps too), which the backward reads; without it the backward reruns
      the forward kernel for them (`emit_output=False`). The primal (inference) call writes
      none either way.
    """

    forward: Callable[..., list]
    backward: Callable[..., tuple]
    chip_tiles: Callable[[Problem], Any] = _no_tiles
    interpret_tiles: Any = None
    chunk: int | None = None
    gate_in_kernel: bool = False
    cleans_at_load: bool = False
    head_decay_in_kernel: bool = False
    states_residual: bool = False

    def recurrent(self, problem: Problem, *, scale: float, reverse: bool, tiles: Any = None):
        """The kernels compiled for the backend's chip; `(output, final_state)`.

        **Arguments:** as `kernel_recurrent`; `tiles` default to `chip_tiles(problem)`.
        """
        tiles = self.chip_tiles(problem) if tiles is None else tiles
        return kernel_recurrent(problem, scale=scale, reverse=reverse, backend=self, tiles=tiles)

    def interpret(self, problem: Problem, *, scale: float, reverse: bool, tiles: Any = None):
        """The same kernels in the backend's interpret mode on any device (tests).

        **Arguments:** as `kernel_recurrent`; `tiles` default to `interpret_tiles`.
        """
        tiles = self.interpret_tiles if tiles is None else tiles
        return kernel_recurrent(problem, scale=scale, reverse=reverse, backend=self, tiles=tiles, interpret=True)


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """Static configuration of one call (the custom_vjp's non-differentiable argument): the
    backend and what its kernels are specialised for. Outputs and gradients vary over the
    mesh axes of q (`jax.shard_map`)."""

    backend: PallasBackend
    static: KernelConfig

    @property
    def chunk(self) -> int:
        return self.backend.chunk or self.static.tiles.chunk

    def forward(self, q, k, v, a, h0, table, **emit):
        outputs = self.backend.forward(q, k, v, a, h0, table, static=self.static, **emit)
        return list(vary_over(varying_axes(q), *outputs))

    def backward(self, q, *args, **kwargs):
        gradients = self.backend.backward(q, *args, static=self.static, **kwargs)
        return vary_over(varying_axes(q), *gradients)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunk(call: KernelCall, q, k, v, g, h0, table, empty):
    """(o [B, Tp, H, V], h_T [R, H, K, V]) for padded, forward-ordered inputs.

    `table` ([3, M] int32) and `empty` ([R] bool) describe packed input in the chunk-aligned
    layout (None when dense): sequences without tokens keep their initial state.
    """
    a = _local_decay(call, g)
    o, h_T = call.forward(*_operands(call, q, k, v), a, h0, table, emit_output=True, emit_states=False)
    return o, keep_empty(empty, h0, h_T)


def _cleaned(call: KernelCall, x):
    """x with its non-finite entries as 0, unless the backend's kernels do that at load."""
    return x if call.backend.cleans_at_load else clean_tokens(x)


def _operands(call: KernelCall, q, k, v):
    """q, k and v cleaned (`_cleaned`), k and v in q's dtype: grouped heads arrive expanded in
    float32 (`problem._expand_heads`), the kernels read one operand dtype; their gradients
    still leave in k's and v's dtype."""
    return _cleaned(call, q), _cleaned(call, k).astype(q.dtype), _cleaned(call, v).astype(q.dtype)


def _local_decay(call: KernelCall, g):
    """The kernels' chunk-local cumulative log decay of the cleaned gate (None without one;
    g itself where the kernels form it, `PallasBackend.head_decay_in_kernel`).

    The kernels take e^{A_i − A_j} from differences of these float32 cumulative sums, so a
    chunk's sum must stay small: with hard resets (−1e4) in a chunk, a difference of two sums
    near −1e4 keeps about 3 digits. Flooring each token's log decay at `STRONGEST_DECAY`
    bounds a chunk's sum by C · 20, and the relative error of the decays by about
    C · 20 · 2⁻²⁴ (1.5·10⁻⁴ at C = 128, whatever the strength of the decays; the XLA `chunk`
    forms the same factors as products and has no such term).
    """
    if g is None or (call.backend.head_decay_in_kernel and call.static.gate is Gate.HEAD):
        return g
    return chunk_local_cumsum(floored_gate(g), call.chunk)


def _chunk_fwd(call: KernelCall, q, k, v, g, h0, table, empty):
    """The differentiated forward: with `states_residual`, its kernel also writes the states
    entering every chunk, the backward's residual (else None: the backward recomputes them)."""
    a = _local_decay(call, g)  # float32 like g (`_kernel_recurrent`): kept instead of it
    keep = call.backend.states_residual
    o, h_T, *states = call.forward(*_operands(call, q, k, v), a, h0, table, emit_output=True, emit_states=keep)
    h_T = keep_empty(empty, h0, h_T)
    return (o, h_T), (q, k, v, a, h0, h_T, states[0] if keep else None, table, empty)


def _chunk_bwd(call: KernelCall, residuals, cotangents):
    q, k, v, a, h0, h_T, states, table, empty = residuals
    do, dh_T = cotangents
    operands = _operands(call, q, k, v)
    if states is None:
        _, states = call.forward(*operands, a, h0, table, emit_output=False, emit_states=True)
    dh_T = dh_T.astype(F32)
    cotangents = (a, _cleaned(call, do).astype(q.dtype), states, h_T, dh_T, table)
    if call.backend.gate_in_kernel:
        dq, dk, dv, dh0, dg = call.backward(*operands, *cotangents, grad_dtypes=(q.dtype, k.dtype, v.dtype))
    else:
        dq, dk, dv, dh0, boundary = call.backward(*operands, *cotangents)
        dg = None if a is None else gate_gradient(clean_tokens(q), clean_tokens(k), dq, dk, boundary, call)
    dh0 = keep_empty(empty, dh_T, dh0)
    dg = None if a is None else dg.astype(a.dtype)
    dq, dk = (sum_groups(x, q.shape[2]) for x in (dq, dk))
    grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dg, dh0.astype(h0.dtype))
    return grads + (None, None)


_chunk.defvjp(_chunk_fwd, _chunk_bwd)


def by_group(x, qk_heads: int):
    """Per-value-head [B, Tp, H, K] as [B, Tp, G, H / G, K], by the G = `qk_heads` query/key
    heads the value heads share."""
    B, Tp, H, K = x.shape
    return x.reshape(B, Tp, qk_heads, H // qk_heads, K)


def sum_groups(x, qk_heads: int):
    """Per-value-head gradients [B, Tp, H, K] summed over the groups sharing each of the
    `qk_heads` query/key heads: [B, Tp, G, K] (unchanged when G = H)."""
    return x if qk_heads == x.shape[2] else by_group(x, qk_heads).sum(3)


def gate_gradient(q, k, dq, dk, boundary, call: KernelCall):
    """dg by the chunk-local reverse-cumsum identity (module docstring).

    **Arguments:** `q`, `k` [B, Tp, G, K] (G = H, or query/key heads shared by groups of
    value heads); `dq`, `dk` [B, Tp, H, K] their float32 gradients per value head (each
    head's share, before the groups are summed); `boundary` [B, H, N, K] = Σ_V S_{n+1} ⊙
    dS_{n+1} per chunk. **Returns** [B, Tp, H] (per-head decay) or [B, Tp, H, K] (per
    channel), float32.
    """
    B, Tp, H, K = dq.shape
    C, G = call.chunk, q.shape[2]
    shared = lambda x: x.astype(F32)[:, :, :, None, :]  # [B, Tp, G, 1, K]: broadcast, not copied  # noqa: E731
    dB = (shared(q) * by_group(dq, G) - shared(k) * by_group(dk, G)).reshape(B, Tp, H, K)
    within = lax.cumsum(dB.reshape(B, Tp // C, C, H, K), axis=2, reverse=True)  # Σ_{t ≤ s < chunk end}
    dg = (within + jnp.transpose(boundary, (0, 2, 1, 3))[:, :, None]).reshape(B, Tp, H, K)
    return dg.sum(-1) if call.static.gate is Gate.HEAD else dg


def _key_side_gate(problem: Problem) -> tuple[Gate | None, jax.Array | None]:
    """The key-side decay form and its log decay: [B, T, H] per head, [B, T, H, K] per channel."""
    decay = problem.key_side_decay()
    if decay is None:
        return None, None
    if problem.log_decay_key is None:
        return Gate.HEAD, decay[..., 0]
    return Gate.KEY, decay


def kernel_recurrent(problem: Problem, *, scale: float, reverse: bool, backend: PallasBackend, tiles: Any = None,
                     interpret: bool = False):
    """The chunk algorithm through a backend's Pallas kernels; `(output, final_state)`.

    **Arguments:**
    - `problem`: the canonical form, without value-side decay; packed input (`cu_seqlens`)
      runs in the chunk-aligned layout of `recurrax._core.varlen` (every sequence starts a chunk).
    - `scale`, `reverse`: static configuration of the call.
    - `backend`: the backend's `PallasBackend`; `tiles`: its tile sizes (None where fixed).
    - `interpret`: run the kernels in the backend's interpret mode.
    """
    if problem.log_decay_value is not None:
        raise ValueError("the Pallas chunk kernels do not support value-side decay (gv)")
    run = functools.partial(_kernel_recurrent, float(scale), bool(reverse), backend, tiles, bool(interpret))
    return guarded(run, bool(reverse), problem)


def _kernel_recurrent(scale: float, reverse: bool, backend: PallasBackend, tiles, interpret: bool, problem: Problem):
    state_dtype = problem.initial_state.dtype
    if reverse:  # the same recurrence on the flipped token axis (and sequence order)
        problem = problem.mirrored()
    gate, g = _key_side_gate(problem)
    call = KernelCall(backend, KernelConfig(float(scale), gate, interpret, tiles))
    q, k, v, h0 = problem.query, problem.key, problem.value, problem.initial_state.astype(F32)
    g = None if g is None else g.astype(F32)
    o, h_T = in_chunks(functools.partial(_chunk, call), call.chunk, (q, k, v, g), h0, problem.cu_seqlens)
    if problem.cu_seqlens is not None and reverse:
        h_T = h_T[::-1]
    o = jnp.flip(o, axis=1) if reverse else o
    return o.astype(problem.query.dtype), h_T.astype(state_dtype)
