"""The delta rule's chunk scan with a backward that recomputes each chunk from its entry state.

| symbol | meaning                                                                          |
|--------|----------------------------------------------------------------------------------|
| n      | chunks in the scan (processing order i = 0 … n−1)                               |
| B, H   | batch rows, value heads                                                          |
| C      | chunk size;  K, V: key and value head dimensions                                 |
| R      | rows of the table of initial states: 1 (dense), or S packed sequences            |
| x_i    | chunk i's inputs: q, k [B, C, H, K], v [B, C, H, V], β [B, C, H], log decay      |
| S_i    | the state entering chunk i;  E_i = f_i(S_i) the state leaving it                 |

Chunk i is a function `(o_i, E_i) = step(x_i, S_i)` (`_chunk`'s terms and step), and the state entering it is

    S_i = table[seq_i]        if chunk i opens a sequence (`first_i`)
    S_i = E_{i−1}             otherwise.

Forward: a `lax.scan` that builds each chunk's terms inside its step, so nothing token-sized
is kept but the inputs and the outputs; the residual is the exit states E (n × [B, H, K, V],
an output anyway), from which every S_i is read back.

Backward, in reverse chunk order, with Ē_i = ∂L/∂E_i (the cotangent of the output E_i plus,
when chunk i+1 does not open a sequence, the carry S̄_{i+1}):

    (x̄_i, S̄_i) = step_backward(x_i, S_i, ō_i, Ē_i)        (`_chunk_adjoint`)
    carry      = 0 if first_i else S̄_i;      table[seq_i] += S̄_i if first_i

that is, each chunk's terms are recomputed from its inputs and its entry state and
differentiated there: the backward keeps one chunk's intermediates at a time, and across
chunks only the [B, H, K, V] state cotangent. Memory: O(n·K·V) per head for E and Ē, plus the
token-sized inputs and their gradients.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array


def _entry(state: Array, table: Array, seq: Array, first: Array) -> Array:
    """The state entering a chunk: the table's row of its sequence when it opens one."""
    return jnp.where(first, _row(table, seq), state)


def _row(table: Array, index: Array) -> Array:
    """table[index] for a traced scalar index, as a dynamic slice (a gather is slow on CPU)."""
    return jax.lax.dynamic_index_in_dim(table, index, keepdims=False)


def _set_row(table: Array, index: Array, row: Array) -> Array:
    return jax.lax.dynamic_update_index_in_dim(table, row, index, 0)


def _forward(step, chunks, table, owners):
    """(outputs, finals, exits): the scan over chunks; finals start as the table (an empty
    sequence keeps its initial state) and take each sequence's state after its last chunk."""
    def body(carry, xs):
        state, finals = carry
        x, (s, f, last) = xs
        out, exit_state = step(x, _entry(state, table, s, f))
        finals = _set_row(finals, s, jnp.where(last, exit_state, _row(finals, s)))
        return (exit_state, finals), (out, exit_state)

    (_, finals), (out, exits) = jax.lax.scan(body, (jnp.zeros_like(table[0]), table), (chunks, owners))
    return out, finals, exits


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def chunk_scan(step: Callable, step_backward: Callable, chunks: tuple, table: Array, owners: tuple):
    """(outputs [n, B, H, C, V], final states [R, B, H, K, V]) of `step(x, entry state)` over
    `chunks` (q, k, v, beta, log_decay with the chunk axis first; log_decay may be None).

    `step_backward(x, state, d_out, d_exit)` is its adjoint: ((d_x), d_state).
    `owners` = (seq, first, last), each [n]: chunk i starts from `table[seq[i]]` when
    `first[i]`, else from chunk i−1's exit; its exit is `seq[i]`'s final state when `last[i]`.
    A row of the table no chunk opens is its own final state."""
    return _chunk_scan_fwd(step, step_backward, chunks, table, owners)[0]


def _chunk_scan_fwd(step, step_backward, chunks, table, owners):
    out, finals, exits = _forward(step, chunks, table, owners)
    return (out, finals), (chunks, table, owners, exits)


def _chunk_scan_bwd(step, step_backward, residuals, cotangents):
    """The reverse scan; `pending` holds each sequence's final-state cotangent until its last
    chunk takes it, then accumulates the cotangent of its initial state."""
    chunks, table, owners, exits = residuals
    d_out, d_finals = cotangents

    def body(carry, xs):
        d_state, pending = carry
        x, (s, f, last), i, d_o = xs
        # S_i: the previous exit, or the table's row (chunk 0 always opens a sequence)
        entry = _entry(_row(exits, jnp.maximum(i - 1, 0)), table, s, f)
        final = _row(pending, s)
        d_exit = d_state + jnp.where(last, final, 0)
        d_x, d_entry = step_backward(x, entry, d_o, d_exit)
        pending = _set_row(pending, s, jnp.where(last, 0, final) + jnp.where(f, d_entry, 0))
        return (jnp.where(f, 0, d_entry), pending), d_x

    n = d_out.shape[0]
    xs = (chunks, owners, jnp.arange(n), d_out)
    (_, d_table), d_chunks = jax.lax.scan(body, (jnp.zeros_like(table[0]), d_finals), xs, reverse=True)
    return d_chunks, d_table, None


chunk_scan.defvjp(_chunk_scan_fwd, _chunk_scan_bwd)
