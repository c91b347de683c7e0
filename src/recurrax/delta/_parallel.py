"""Sequence parallelism for the delta rule: the token axis split over a device mesh, exact.

| symbol   | meaning                                                                   |
|----------|---------------------------------------------------------------------------|
| P        | sequence shards: the size of `sequence_axis`                              |
| p        | a shard's position along the sequence                                     |
| L        | tokens per shard; T = P·L (N = P·L packed tokens with `cu_seqlens`)       |
| B, H     | batch rows and value heads on one device (after batch / head sharding)    |
| K, V     | key/query and value head dimensions                                       |
| S        | packed sequences                                                          |
| s        | the softmax scale                                                         |
| h_p      | the state entering shard p [K, V]; h_0 = initial_state                    |
| M_t, N_t | the shard's state after its token t as an affine map of h_p: M_t h_p + N_t |
| M_p, N_p | the same after the shard's last token: the shard's transfer               |
| r_t      | s · M_tᵀ q_t [K]: how the entry state reaches output t                    |

Every step of the delta rule, S ↦ (I − β_t k_t k_tᵀ) diag(e^{a_t}) S + β_t k_t v_tᵀ, applies
the same K×K matrix to every column of the state and adds that column's own write. So, by
induction over the shard's tokens, its state after token t is M_t h_p + N_t, with
M_t = Π_{u≤t} (I − β_u k_u k_uᵀ) diag(e^{a_u}) (later factors on the left) and N_t the state
reached from zero; the output is o_t = s · (M_t h_p + N_t)ᵀ q_t = h_pᵀ r_t + o⁰_t.

Both come from one run of the single-device algorithm on a widened state [K, K + V]: the
first K columns start from the identity with zero values (they carry M_t and output r_t),
the last V start from zero with the true values (they carry N_t and output o⁰_t). Then

    h_{p+1} = M_p h_p + N_p          shard transfer
    o_t     = o⁰_t + h_pᵀ r_t        output correction, one matmul (instead of a second run)

Transfers compose associatively, (M, N) then (M', N') = (M' M, M' N + N'), so each shard
all-gathers every shard's final widened state [M_p | N_p] — P·B·H·K·(K + V) numbers,
independent of T — and folds the transfers of the shards before it, in the state dtype. For
unit keys (`qk_l2norm`), β ∈ [0, 2] and gates ≤ 0 every factor of M has norm ≤ 1, so the fold
cannot grow however many shards there are.

Packed input (`cu_seqlens`): the entry state reaches only the shard's first sequence, and
only when that sequence began in an earlier shard; that sequence starts from [I | 0]. Every
sequence starting inside the shard starts from [0 | its initial state]: its M columns stay
zero, so r_t = 0 on its tokens and, when it is the shard's last sequence, the transfer is
h ↦ N_p (a reset) with no special case. A sequence's final state, M h_p + N, lives in the
shard holding its last token; one psum over the sequence axis collects them (S·H·K·V
numbers, again no T). An empty sequence keeps its initial state.

Non-finite inputs (`_finite`): each shard runs on its block cleaned (non-finite token entries
and output cotangents read as 0), so no NaN enters a transfer, and marks NaN what the token
loop makes non-finite, its first tainted and last adjoint-tainted positions reduced over the
sequence axis (a `pmin` and a `pmax` of [rows or S, H] integers).

The backward is JAX's autodiff through `shard_map`, as for `recurrax.parallel.recurrent`:
the all-gather transposes to a reduce-scatter of the same size, and the local algorithm's
own backward runs once per shard on the widened state (its memory grows by the factor
(K + V) / V over a one-device run of the shard).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._core.arguments import CuSeqlens, HeadGates, HeadValues, KeyGates, PerHead, Precision, Results
from .._core.arguments import SharedQueries, States
from .._core.eager import cached_when_eager
from .._core.finite import clean_cotangent
from .._core.finite_delta import guarded
from .._core.intra import dot
from .._core.mesh import MeshAxes, Pieces, check_divisible, head_axis_splits, local_sequences, run_sharded
from .._core.registry import Request
from ._api import check_argument_values
from ._finite import cleaned
from ._implementations import kernel_registry
from ._problem import DeltaProblem, canonicalize_delta

__all__ = ["delta_rule"]


@dataclasses.dataclass(frozen=True)
class DeltaPlan:
    """Static configuration of one sharded call.

    **Arguments:**
    - `algorithm`: the local algorithm, `(DeltaProblem, scale=) -> (output, final_state)`.
    - `scale`: the softmax scale s.
    - `axes`: the mesh axes.
    """

    algorithm: Callable
    scale: float
    axes: MeshAxes

    def run(self, problem: DeltaProblem):
        return self.algorithm(problem, scale=self.scale)

    def gather(self, transfer: Float[Array, "R H K KV"]) -> Float[Array, "P R H K KV"]:
        """Every shard's transfer [M_p | N_p], in shard order: one all-gather."""
        return jax.lax.all_gather(transfer, self.axes.sequence)


def widened(
    problem: DeltaProblem, from_identity: Bool[Array, " R"], initial: Float[Array, "R H K V"]
) -> DeltaProblem:
    """The problem on the state [K, K + V]: values [0 | v], initial states [I or 0 | initial].

    Rows (or packed sequences) marked `from_identity` start their M columns from I, the others
    from 0. The query is taken in the state dtype, so that r_t comes back unrounded.
    """
    K = problem.key.shape[-1]
    value = problem.value
    value = jnp.concatenate([jnp.zeros((*value.shape[:-1], K), value.dtype), value], axis=-1)
    identity = jnp.eye(K, dtype=initial.dtype)
    start = jnp.where(from_identity[:, None, None, None], identity, jnp.zeros_like(identity))
    start = jnp.broadcast_to(start, (*initial.shape[:2], K, K))
    return problem._replace(
        query=problem.query.astype(initial.dtype),
        value=value,
        initial_state=jnp.concatenate([start, initial], axis=-1),
    )


def carry(widened_state: Float[Array, "... K KV"], entry: Float[Array, "... K V"]) -> Float[Array, "... K V"]:
    """M h + N for a widened state [M | N] and the entry state h."""
    K = widened_state.shape[-2]
    return dot("...kj,...jv->...kv", widened_state[..., :K], entry) + widened_state[..., K:]


def fold_transfers(
    first: Float[Array, "R H K V"], transfers: Float[Array, "P R H K KV"]
) -> tuple[Float[Array, "P R H K V"], Float[Array, "R H K V"]]:
    """The state entering every shard, and the state leaving the last one."""

    def transfer(state, shard):
        return carry(shard, state), state

    last, incoming = jax.lax.scan(transfer, first, transfers)
    return incoming, last


def corrected(output: Float[Array, "R L H KV"], incoming: Float[Array, "R H K V"]) -> Float[Array, "R L H V"]:
    """o⁰_t + h_pᵀ r_t from the widened run's output [r | o⁰]."""
    K = incoming.shape[-2]
    return output[..., K:] + dot("blhk,bhkv->blhv", output[..., :K], incoming)


def _dense_shard(plan: DeltaPlan, problem: DeltaProblem, shard: Int[Array, ""], dtype):
    """One shard of a batch of whole sequences: (output [B, L, H, V], final_state [B, H, K, V])."""
    initial = problem.initial_state
    rows = initial.shape[0]
    output, final = plan.run(widened(problem, jnp.ones(rows, bool), jnp.zeros_like(initial)))
    incoming, last = fold_transfers(initial, plan.gather(final))
    return corrected(output, incoming[shard]).astype(dtype), last


def _packed_shard(plan: DeltaPlan, problem: DeltaProblem, shard: Int[Array, ""], dtype):
    """One shard of packed sequences: (output [1, L, H, V], this shard's final states [S, H, K, V]).

    Final states are those of the sequences ending in the shard, zero elsewhere (summed over
    shards by the psum).
    """
    length = problem.query.shape[1]
    cu_seqlens, initial = problem.cu_seqlens, problem.initial_state
    local_cu, starts_here, ends_here = local_sequences(cu_seqlens, shard, length)
    this = Pieces.of(cu_seqlens, shard, length)
    continuing = (jnp.arange(initial.shape[0]) == this.head) & this.continues
    own_initial = jnp.where(starts_here[:, None, None, None], initial, jnp.zeros_like(initial))
    local = widened(problem._replace(cu_seqlens=local_cu), continuing, own_initial)
    output, finals = plan.run(local)

    incoming, _ = fold_transfers(jnp.zeros_like(initial[:1]), plan.gather(finals[this.tail][None]))
    incoming = incoming[shard]
    output = corrected(output, incoming).astype(dtype)
    finals = carry(finals, incoming)
    finals = jnp.where(ends_here[:, None, None, None], finals, jnp.zeros_like(finals))
    return output, jax.lax.psum(finals, plan.axes.sequence)


def _shard(plan: DeltaPlan, problem: DeltaProblem, dtype):
    """The body run on every device of the mesh, on its own block of the canonical problem:
    the cleaned problem's results, marked NaN where the token loop's are (`_core/finite_delta.py`)."""
    return guarded(functools.partial(_cleaned_shard, plan, dtype), problem, plan.axes.sequence)


def _cleaned_shard(plan: DeltaPlan, dtype, problem: DeltaProblem):
    """The shard on the cleaned problem, its output cotangent cleaned: no non-finite value
    enters the transfers, so none reaches another shard through them."""
    shard = jax.lax.axis_index(plan.axes.sequence)
    body = _dense_shard if problem.cu_seqlens is None else _packed_shard
    output, final_state = body(plan, cleaned(problem), shard, dtype)
    return clean_cotangent(output), final_state


def _heads_split_evenly(problem: DeltaProblem, mesh: Any, axes: MeshAxes) -> DeltaProblem:
    """Query and key repeated to every value head when `head_axis` cannot split their heads
    alongside the value heads (their count not divisible by its size); unchanged otherwise."""
    heads = problem.query.shape[2]
    if head_axis_splits(heads, mesh, axes):
        return problem
    groups = problem.value.shape[2] // heads
    repeat = lambda x: jnp.repeat(x, groups, axis=2)  # noqa: E731
    return problem._replace(query=repeat(problem.query), key=repeat(problem.key))


def delta_rule(
    query: SharedQueries, key: SharedQueries, value: HeadValues, beta: PerHead, g: HeadGates = None,
    gk: KeyGates = None, softmax_scale: float | None = None, initial_state: States = None, cu_seqlens: CuSeqlens = None,
    qk_l2norm: bool = False, *,
    mesh: Any, sequence_axis: str, batch_axis: str | None = None, head_axis: str | None = None,
    implementation: str | None = None, precision: Precision = None, allow_positive_gates: bool = False,
) -> Results:
    """`recurrax.delta_rule` with the token axis split over `sequence_axis` of a device mesh.

    Same arguments, results and gradients as `recurrax.delta_rule`; each device runs the
    local algorithm on its block of tokens with a state widened from [K, V] to [K, K + V]
    (which also carries the product of its tokens' transitions), then the devices exchange
    that state (an all-gather whose size does not depend on the sequence length) and each
    corrects its outputs by the state entering its block.

    **Arguments:** `query` … `qk_l2norm`, `precision` (which covers the exchange's products
    too) and `allow_positive_gates` as for `recurrax.delta_rule`; `implementation` the local
    algorithm, as there (`None`: the registry's choice for the call, `"chunk"` here); `mesh`,
    `sequence_axis`, `batch_axis` and `head_axis` (which splits the value heads) as for
    `recurrax.parallel.recurrent`, and so are packed sequences across shards, eager calls and
    the errors, besides `recurrax.delta_rule`'s own argument checks.

    **Returns:** `(output, final_state)` as `recurrax.delta_rule`, laid out over the mesh:
    `output` split like the value, `final_state` split over `batch_axis` and `head_axis`.
    """
    arrays = (query, key, value, beta, g, gk, softmax_scale, initial_state, cu_seqlens, qk_l2norm)
    axes = MeshAxes.of(mesh, sequence_axis, batch_axis, head_axis)
    output = _sharded(*arrays, mesh=mesh, axes=axes, implementation=implementation, precision=precision,
                      allow_positive_gates=allow_positive_gates)
    check_argument_values(query, key, beta, g, gk, cu_seqlens, qk_l2norm, allow_positive_gates)
    return output


@cached_when_eager(static_argnames=("softmax_scale", "qk_l2norm", "mesh", "axes", "implementation",
                                    "precision", "allow_positive_gates"))
def _sharded(
    query, key, value, beta, g, gk, softmax_scale, initial_state, cu_seqlens, qk_l2norm, *,
    mesh, axes: MeshAxes, implementation, precision, allow_positive_gates,
):
    problem, scale, layout = canonicalize_delta(
        query, key, value, beta, g, gk, softmax_scale, initial_state, cu_seqlens, qk_l2norm, allow_positive_gates
    )
    algorithm = kernel_registry.get(implementation, Request.of(problem)).fn
    check_divisible(problem, mesh, axes)
    problem = _heads_split_evenly(problem, mesh, axes)
    plan = DeltaPlan(algorithm, float(scale), axes)

    dtype = problem.query.dtype
    output, final_state = run_sharded(lambda p: _shard(plan, p, dtype), problem, mesh, axes, precision)
    return layout.restore(output), final_state
