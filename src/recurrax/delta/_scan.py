"""The delta rule token by token in blocks: `scan`, the fallback that never stores per-token states.

| symbol | meaning                                                        |
|--------|----------------------------------------------------------------|
| B, T   | batch rows, tokens per row (packed: B = 1)                     |
| H      | value heads (query/key heads repeated to H)                    |
| K, V   | key/query and value head dimensions                            |
| R      | state rows: B, or S packed sequences                           |
| C      | block length: one state is kept at the start of every block    |
| N      | blocks, ceil(T / C); T is padded to N·C                        |
| e_s    | the last token of packed sequence s                            |

Each token is the reference's (`_reference.delta_token`):

    S  ← initial_state[seq]           where the token opens its sequence
    S  = diag(e^{a_t}) S;   S = S + k_t (β_t (v_t − Sᵀ k_t))ᵀ;   o_t = scale · Sᵀ q_t

A `lax.scan` over blocks runs an inner `lax.scan` over the block's C tokens under
`jax.checkpoint`, so JAX's autodiff keeps the N states entering the blocks and recomputes
the C states of one block at a time in the backward: memory O(N·K·V + C·K·V) per head, not
O(T·K·V). Padding tokens (q = k = v = 0, β = 0, a = 0) leave the state as it is.

Packed final states: sequence s's state after e_s is the scan's state only when e_s closes its
block. So the block holding e_s is run once more from its entry state, with every token after
e_s made a no-op (q = k = v = 0, β = 0, a = 0, no reset); an empty sequence keeps its initial
state. That is S extra blocks of work, and no [S, H, K, V] carry threaded through every token;
the reruns go max(1, N / C²) sequences at a time, each checkpointed, so their backward holds
about as many states as the scan's N / C entry states, not S·C.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._core import varlen
from ._problem import DeltaProblem
from ._reference import delta_token

BLOCK = 64
"""C: tokens between two stored states."""


class Tokens(NamedTuple):
    """Per-token inputs in the state dtype, time-major: [..., B, H, ·] (a_t: [..., B, H, K or 1])."""

    query: Float[Array, "... B H K"]
    key: Float[Array, "... B H K"]
    value: Float[Array, "... B H V"]
    beta: Float[Array, "... B H"]
    log_decay: Float[Array, "... B H X"] | None
    seq: Int[Array, "..."]
    start: Bool[Array, "..."]


def _tokens(problem: DeltaProblem, C: int) -> Tokens:
    """The problem's tokens padded to N·C and blocked [N, C, B, H, ·]."""
    B, T = problem.query.shape[:2]
    padded = -(-T // C) * C
    q, k = problem.expanded_query_key()
    a = problem.key_side_decay()
    if a is not None and a.ndim == 3:
        a = a[..., None]
    if problem.cu_seqlens is None:
        seg = varlen.single_segment(T)
        seg = seg._replace(starts=jnp.zeros_like(seg.starts))  # dense rows start from the carried init
    else:
        seg = varlen.segments(problem.cu_seqlens, T)

    def blocked(x):  # [B, T, ...] -> [N, C, B, ...]
        x = jnp.moveaxis(varlen.pad_tokens(x, padded), 1, 0)
        return x.reshape(padded // C, C, *x.shape[1:])

    def blocked_flags(x):  # [T] -> [N, C]
        return jnp.pad(x, (0, padded - T)).reshape(padded // C, C)

    arrays = (q, k, problem.value.astype(problem.state_dtype), problem.beta, a)
    return Tokens(*(None if x is None else blocked(x) for x in arrays),
                  seq=blocked_flags(seg.seq_id), start=blocked_flags(seg.starts))


def _block(scale: float, init: Array, state: Array, block: Tokens):
    """Run one block's tokens from `state`: (the state leaving it, o [C, B, H, V])."""

    def step(state, token: Tokens):
        state = jnp.where(token.start, init[token.seq][None], state)
        return jax.vmap(lambda *x: delta_token(*x, scale))(
            state, token.query, token.key, token.value, token.beta, token.log_decay
        )[::-1]

    return jax.lax.scan(step, state, block)


def _up_to(block: Tokens, last: Int[Array, ""]) -> Tokens:
    """The block with every token after position `last` a no-op: q = k = v = 0, β = 0, a = 0
    (selected, not multiplied: a NaN there must not reach the earlier sequence's state)."""
    keep = jnp.arange(block.seq.shape[0]) <= last
    kept = lambda x: None if x is None else jnp.where(keep.reshape(-1, *[1] * (x.ndim - 1)), x, 0)  # noqa: E731
    arrays = (block.query, block.key, block.value, block.beta, block.log_decay)
    return block._replace(**dict(zip(("query", "key", "value", "beta", "log_decay"), map(kept, arrays))),
                          start=block.start & keep)


def _packed_finals(scale, init, entries, tokens: Tokens, cu_seqlens, C: int):
    """[S, H, K, V]: each sequence's state after its last token (empty: its initial state)."""
    last_token = cu_seqlens[1:] - 1
    empty = cu_seqlens[1:] == cu_seqlens[:-1]
    index = jnp.maximum(last_token, 0)

    def final(token_index):
        n = token_index // C
        block = jax.tree.map(lambda x: x[n], tokens)
        return _block(scale, init, entries[n], _up_to(block, token_index % C))[0][0]

    # a few sequences at a time, each rerun checkpointed: its backward holds batch·C states,
    # about the N / C entry states the scan keeps anyway (all S at once: S·C states)
    batch = max(1, tokens.seq.size // (C * C))
    finals = jax.lax.map(jax.checkpoint(final), index, batch_size=min(batch, index.shape[0]))
    return jnp.where(empty[:, None, None, None], init, finals)


def scan_delta(problem: DeltaProblem, *, scale: float, block: int = BLOCK):
    """The blocked token loop on a canonical `problem`; `(output [B, T, H, V], final_state)`."""
    B, T = problem.query.shape[:2]
    C = min(block, T) if T else 1
    tokens = _tokens(problem, C)
    init = problem.initial_state
    packed = problem.cu_seqlens is not None
    first_state = jnp.zeros_like(init[:1]) if packed else init

    @jax.checkpoint
    def outer(state, block: Tokens):
        exit_state, o = _block(float(scale), init, state, block)
        return exit_state, (o, state)

    last_state, (o, entries) = jax.lax.scan(outer, first_state, tokens)
    o = jnp.moveaxis(o.reshape(-1, *o.shape[2:]), 0, 1)[:, :T]
    if packed:
        finals = _packed_finals(float(scale), init, entries, tokens, problem.cu_seqlens, C)
    else:
        finals = last_state
    return o.astype(problem.query.dtype), finals
