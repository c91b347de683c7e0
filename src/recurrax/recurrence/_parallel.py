"""Sequence parallelism: the token axis split over a device mesh, exact forward and backward.

(The derivation below and the shard bodies that implement it are one algorithm and are read
together; the mesh plumbing both operations share is `_core/mesh.py`; the delta rule's parallel
form is `delta/_parallel.py`; `recurrax.parallel` offers both.)

| symbol  | meaning                                                                   |
|---------|---------------------------------------------------------------------------|
| P       | sequence shards: the size of `sequence_axis`                              |
| p       | a shard's position in processing order (mirrored when `reverse`)          |
| L       | tokens per shard; T = P·L (N = P·L packed tokens with `cu_seqlens`)       |
| B, H    | batch rows and heads on one device (after batch / head sharding)          |
| K, V    | key/query and value head dimensions                                       |
| S       | packed sequences                                                          |
| a_t b_t | key-side [K] (or [1] per head) and value-side [V] log decays of token t   |
| α_t β_t | their in-shard inclusive cumulative sums up to token t                    |
| A_p B_p | shard p's total log decays (α and β at its last token)                    |
| F_p     | shard p's state after its last token, run from a zero incoming state      |
| h_p     | the state entering shard p; h_0 = initial_state                           |

The recurrence is linear in its state, so splitting the state of token t in shard p as
`h_t = h⁰_t + e^{α_t} ⊙ h_p ⊙ e^{β_t}` (h⁰ the local run from zero; induction on t:
`e^{a_t}(h⁰_{t-1} + e^{α_{t-1}} h_p e^{β_{t-1}})e^{b_t} + k_t v_tᵀ = h⁰_t + e^{α_t} h_p e^{β_t}`)
gives

    o_t     = o⁰_t + s · ((q_t ⊙ e^{α_t})ᵀ h_p) ⊙ e^{β_t}       output correction, one matmul
    h_{p+1} = e^{A_p} ⊙ h_p ⊙ e^{B_p} + F_p                       shard transfer

Transfers compose associatively, (A, B, F) then (A', B', F') = (A + A', B + B',
e^{A'} F e^{B'} + F'), so each shard all-gathers every shard's (F_p, A_p, B_p), packed in
one [B, H, K+1, V+1] buffer — P·B·H·(K+1)·(V+1) numbers, independent of T — and folds the
transfers of the shards before it, in the state dtype. Every
exponent is one shard's total log decay or an in-shard cumulative one: ≤ 0 for gates ≤ 0,
so nothing overflows however long the sequence.

Packed input (`cu_seqlens`): a sequence that starts inside shard p resets the carry. The
shard's transfer becomes `h ↦ F_p` (it "passes" only when one sequence spans the whole
shard), where F_p is the state of the shard's last sequence, its initial state included
when it starts in the shard. The incoming state reaches only the shard's first sequence,
and only if that sequence began in an earlier shard. A sequence's final state lives in the
shard holding its last token (corrected by the incoming state when it is the shard's first
sequence); one psum over the sequence axis collects them (S·H·K·V numbers, again no T).

`reverse=True` runs the forward algorithm on the mirrored sequence: each shard flips its
tokens locally and takes position p = P − 1 − (its mesh index), so the state flows from the
last shard to the first and no extra communication is needed.

The backward is JAX's autodiff through `shard_map`: the all-gather transposes to a
reduce-scatter of the same size, the local algorithm's own backward runs once per shard.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._core.arguments import ConstantGates, CuSeqlens, Gates, KeyGates, Keys, Precision, Queries, Results
from .._core.arguments import States, ValueGates, Values
from .._core.eager import cached_when_eager
from .._core.mesh import MeshAxes, Pieces, check_divisible, head_axis_splits, local_sequences, run_sharded
from .._core.problem import Problem, canonicalize
from .._core.registry import Implementation, Request, kernel_registry
from ._api import check_gate_values

__all__ = ["recurrent"]


class Decays(NamedTuple):
    """In-shard inclusive cumulative log decays; absent kinds are None.

    **Arguments:**
    - `key`: α [B, L, H, K] (or [B, L, H, 1] for per-head decays).
    - `value`: β [B, L, H, V].
    """

    key: Float[Array, "B L H K"] | None
    value: Float[Array, "B L H V"] | None

    @classmethod
    def of(cls, problem: Problem) -> Decays:
        cumulative = lambda x: None if x is None else jnp.cumsum(x, axis=1)  # noqa: E731
        return cls(cumulative(problem.key_side_decay()), cumulative(problem.log_decay_value))

    def at(self, token: int | Int[Array, ""]) -> Decays:
        """The cumulative decays at one local token: [B, H, K] and [B, H, V]."""
        pick = lambda x: None if x is None else jax.lax.dynamic_index_in_dim(x, token, 1, False)  # noqa: E731
        return Decays(pick(self.key), pick(self.value))


def decay_state(state: Float[Array, "B H K V"], decays: Decays) -> Float[Array, "B H K V"]:
    """e^{α} ⊙ state ⊙ e^{β} for decays taken at one token ([B, H, K] and [B, H, V])."""
    if decays.key is not None:
        state = jnp.exp(decays.key)[..., None] * state
    if decays.value is not None:
        state = state * jnp.exp(decays.value)[..., None, :]
    return state


def fold_shards(
    first: Float[Array, "B H K V"],
    finals: Float[Array, "P B H K V"],
    totals: Decays,
    passes: Bool[Array, " P"],
) -> tuple[Float[Array, "P B H K V"], Float[Array, "B H K V"]]:
    """The state entering every shard, and the state leaving the last one.

    **Arguments:**
    - `first`: the state entering shard 0.
    - `finals`: F_p for every shard, in processing order.
    - `totals`: A_p [P, B, H, K] and B_p [P, B, H, V] (or None), in processing order.
    - `passes`: whether shard p's incoming state reaches its outgoing one (False: reset).
    """

    def transfer(state, shard):
        final, total, through = shard
        carried = jnp.where(through, decay_state(state, total), jnp.zeros_like(state))
        return carried + final, state

    last, incoming = jax.lax.scan(transfer, first, (finals, totals, passes))
    return incoming, last


def correction(
    query: Float[Array, "B L H K"],
    decays: Decays,
    incoming: Float[Array, "B H K V"],
    scale: float,
    reached: Bool[Array, " L"] | None = None,
) -> Float[Array, "B L H V"]:
    """s · ((q_t ⊙ e^{α_t})ᵀ h_p) ⊙ e^{β_t}: what the incoming state adds to each output.

    **Arguments:**
    - `query`: the shard's queries, [B, L, G, K]: G = H, or query heads shared by groups of
      value heads (then the key-side decay is per head, a factor of each output row:
      e^{α_t} (q_tᵀ h_p), and the shared query is never repeated).
    - `decays`: the shard's cumulative decays α, β.
    - `incoming`: h_p.
    - `scale`: the softmax scale s.
    - `reached`: tokens the incoming state reaches (packed input); None for all of them.
    """
    (B, L, G, K), (H, V) = query.shape, incoming.shape[-3::2]
    query = query.astype(incoming.dtype)
    per_channel = decays.key is not None and decays.key.shape[-1] > 1
    if per_channel:
        query = query * jnp.exp(decays.key)
    if reached is not None:
        query = jnp.where(reached[None, :, None, None], query, jnp.zeros_like(query))
    by_group = incoming.reshape(B, G, H // G, K, V)
    output = scale * jnp.einsum("blgk,bgrkv->blgrv", query, by_group).reshape(B, L, H, V)
    if decays.key is not None and not per_channel:
        output = output * jnp.exp(decays.key)
    return output if decays.value is None else output * jnp.exp(decays.value)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Static configuration of one sharded call.

    **Arguments:**
    - `impl`: the local algorithm.
    - `scale`: the softmax scale.
    - `reverse`: whether state flows from the last token to the first.
    - `axes`: the mesh axes.
    """

    impl: Implementation
    scale: float
    reverse: bool
    axes: MeshAxes

    def run(self, problem: Problem):
        return self.impl.run(problem, scale=self.scale, reverse=False)

    def gather(self, state: Float[Array, "B H K V"], totals: Decays) -> tuple[Array, Decays]:
        """Every shard's state and total decays ([P, ...]) in processing order: one all-gather."""
        gathered = jax.lax.all_gather(pack(state, totals), self.axes.sequence)
        gathered = gathered[::-1] if self.reverse else gathered
        return unpack(gathered, totals)


def pack(state: Float[Array, "B H K V"], totals: Decays) -> Float[Array, "B H K+1 V+1"]:
    """State and total decays in one buffer: A_p as an extra value column, B_p as an extra key row.

    Absent decays add nothing (the buffer is then [B, H, K, V], or one of K, V grows by one).
    """
    B, H, K, V = state.shape
    if totals.key is not None:
        state = jnp.concatenate([state, jnp.broadcast_to(totals.key, (B, H, K))[..., None]], axis=-1)
    if totals.value is not None:
        row = totals.value if totals.key is None else jnp.pad(totals.value, ((0, 0), (0, 0), (0, 1)))
        state = jnp.concatenate([state, row[:, :, None, :]], axis=-2)
    return state


def unpack(packed: Float[Array, "... K+1 V+1"], like: Decays) -> tuple[Array, Decays]:
    """The inverse of `pack`, for any leading axes; `like` says which decays are present."""
    rows = slice(None, -1) if like.value is not None else slice(None)
    columns = slice(None, -1) if like.key is not None else slice(None)
    key = None if like.key is None else packed[..., rows, -1]
    value = None if like.value is None else packed[..., -1, columns]
    return packed[..., rows, columns], Decays(key, value)


def _dense_shard(plan: Plan, problem: Problem, shard: Int[Array, ""]):
    """One shard of a batch of whole sequences: (output [B, L, H, V], final_state [B, H, K, V])."""
    local = problem._replace(initial_state=jnp.zeros_like(problem.initial_state))
    output, final = plan.run(local)
    decays = Decays.of(problem)
    finals, totals = plan.gather(final, decays.at(problem.query.shape[1] - 1))
    passes = jnp.ones(plan.axes.shards, bool)
    incoming, last = fold_shards(problem.initial_state, finals, totals, passes)
    incoming = incoming[shard]
    output = output.astype(incoming.dtype) + correction(problem.query, decays, incoming, plan.scale)
    return output.astype(problem.query.dtype), last


def _packed_shard(plan: Plan, problem: Problem, shard: Int[Array, ""]):
    """One shard of packed sequences: (output [1, L, H, V], this shard's final states [S, H, K, V]).

    Final states are those of the sequences ending in the shard, zero elsewhere (summed over
    shards by the caller).
    """
    length = problem.query.shape[1]
    cu_seqlens, initial = problem.cu_seqlens, problem.initial_state
    local_cu, starts_here, ends_here = local_sequences(cu_seqlens, shard, length)
    own_initial = jnp.where(starts_here[:, None, None, None], initial, jnp.zeros_like(initial))
    local = problem._replace(initial_state=own_initial, cu_seqlens=local_cu)
    output, finals = plan.run(local)

    every = Pieces.of(cu_seqlens, jnp.arange(plan.axes.shards), length)
    this = Pieces.of(cu_seqlens, shard, length)
    decays = Decays.of(problem)
    carry_out = finals[this.tail][None]  # [1, H, K, V]
    gathered, totals = plan.gather(carry_out, decays.at(length - 1))
    incoming, _ = fold_shards(jnp.zeros_like(carry_out), gathered, totals, every.passes)
    incoming = jnp.where(this.continues, incoming[shard], jnp.zeros_like(carry_out))

    reached = jnp.arange(length) <= this.head_end
    output = output.astype(incoming.dtype) + correction(problem.query, decays, incoming, plan.scale, reached)
    output = output.astype(problem.query.dtype)
    finals = finals.at[this.head].add(decay_state(incoming, decays.at(this.head_end))[0])
    finals = jnp.where(ends_here[:, None, None, None], finals, jnp.zeros_like(finals))
    return output, jax.lax.psum(finals, plan.axes.sequence)


def _shard(plan: Plan, problem: Problem):
    """The body run on every device of the mesh, on its own block of the canonical problem."""
    P = plan.axes.shards
    index = jax.lax.axis_index(plan.axes.sequence)
    shard = P - 1 - index if plan.reverse else index
    if plan.reverse:
        problem = problem.mirrored(P * problem.query.shape[1])
    body = _dense_shard if problem.cu_seqlens is None else _packed_shard
    output, final_state = body(plan, problem, shard)
    if plan.reverse:
        output = output[:, ::-1]
        final_state = final_state if problem.cu_seqlens is None else final_state[::-1]
    return output, final_state


def _shared_or_expanded(problem: Problem, mesh: Any, axes: MeshAxes) -> Problem:
    """Query and key shared by groups of value heads stay shared (each shard holds its G heads,
    the local algorithm reads them as it does unsharded), unless `head_axis` cannot split them
    alongside the value heads or the key-side decay is per channel (`correction` then needs a
    query per value head): then they are repeated to every value head."""
    keep = head_axis_splits(problem.query.shape[2], mesh, axes) and problem.log_decay_key is None
    return problem if keep else problem.expanded()


def recurrent(
    query: Queries, key: Keys, value: Values, g: Gates = None, g_gamma: ConstantGates = None, gk: KeyGates = None,
    gv: ValueGates = None, softmax_scale: float | None = None, initial_state: States = None, reverse: bool = False,
    cu_seqlens: CuSeqlens = None, *,
    mesh: Any, sequence_axis: str, batch_axis: str | None = None, head_axis: str | None = None,
    implementation: str | None = None, precision: Precision = None, allow_positive_gates: bool = False,
) -> Results:
    """`recurrax.recurrent` with the token axis split over `sequence_axis` of a device mesh.

    Same arguments, results and gradients as `recurrax.recurrent`; each device runs the
    local algorithm on its block of tokens, then the devices exchange one state and one
    total decay each (an all-gather whose size does not depend on the sequence length).

    **Arguments:**
    - `query` … `cu_seqlens`: as for `recurrax.recurrent`. With `cu_seqlens`, sequences may
      cross shard boundaries and empty sequences are allowed.
    - `mesh`: a `jax.sharding.Mesh` (on a mesh with explicit axes, call inside
      `jax.set_mesh(mesh)`).
    - `sequence_axis`: the mesh axis the token axis is split over; its size must divide the
      token count (`seq_len`, or `total_tokens` when packed) — no padding is done.
    - `batch_axis`, `head_axis`: optional other mesh axes for the batch rows (not with
      `cu_seqlens`, whose batch is 1) and the heads; their sizes must divide B and H.
    - `implementation`: the local algorithm, a registered name or `None` for the best one
      that supports a shard's part of the call.
    - `precision`: as for `recurrax.recurrent` (it covers the exchange's products too).
    - `allow_positive_gates`: as for `recurrax.recurrent`.

    Called eagerly, it runs one compiled program cached per shape, mesh and option.

    **Returns:** `(output, final_state)` as `recurrax.recurrent`, laid out over the mesh:
    `output` split like the query, `final_state` split over `batch_axis` and `head_axis`.

    **Raises:** `ValueError` for a mesh axis the mesh lacks, or a split axis that does not
    divide evenly, besides `recurrax.recurrent`'s own argument checks.
    """
    arrays = (query, key, value, g, g_gamma, gk, gv, softmax_scale, initial_state, reverse, cu_seqlens)
    axes = MeshAxes.of(mesh, sequence_axis, batch_axis, head_axis)
    output = _sharded(*arrays, mesh=mesh, axes=axes, implementation=implementation, precision=precision,
                      allow_positive_gates=allow_positive_gates)
    check_gate_values(query, g, g_gamma, gk, gv, cu_seqlens, allow_positive_gates)
    return output


@cached_when_eager(
    static_argnames=("softmax_scale", "reverse", "mesh", "axes", "implementation", "precision", "allow_positive_gates")
)
def _sharded(
    query, key, value, g, g_gamma, gk, gv, softmax_scale, initial_state, reverse, cu_seqlens, *,
    mesh, axes: MeshAxes, implementation, precision, allow_positive_gates,
):
    problem, config, layout = canonicalize(
        query, key, value, g, g_gamma, gk, gv, softmax_scale, initial_state, reverse, cu_seqlens, allow_positive_gates
    )
    problem = _shared_or_expanded(problem, mesh, axes)
    check_divisible(problem, mesh, axes)
    local_request = dataclasses.replace(Request.of(problem), seq_len=problem.query.shape[1] // axes.shards)
    impl = kernel_registry.get(implementation, local_request)
    plan = Plan(impl, config.scale, config.reverse, axes)

    output, final_state = run_sharded(lambda p: _shard(plan, p), problem, mesh, axes, precision)
    return layout.restore(output), final_state

