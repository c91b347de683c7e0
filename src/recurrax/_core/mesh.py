"""The mesh plumbing both operations' sequence parallelism shares (`recurrax.parallel`,
`recurrax.delta`'s `parallel` form): which axes a call is split over, where packed sequences
meet a shard, and `shard_map` across JAX versions. It imports nothing of either operation.

| symbol | meaning                                                         |
|--------|-----------------------------------------------------------------|
| P      | sequence shards: the size of the sequence axis                  |
| L      | tokens per shard                                                |
| S      | packed sequences                                                |
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as Spec
from jaxtyping import Array, Bool, Int

from .matmul_precision import matmul_precision, resolve


@dataclasses.dataclass(frozen=True)
class MeshAxes:
    """The mesh axes a call is split over, validated against the mesh.

    **Arguments:**
    - `sequence`: the axis the token axis is split over.
    - `batch`, `head`: optional axes for the batch rows and the heads.
    - `shards`: the size of `sequence` (P).
    """

    sequence: str
    batch: str | None
    head: str | None
    shards: int

    @classmethod
    def of(cls, mesh: Any, sequence_axis: Any, batch_axis: Any, head_axis: Any) -> MeshAxes:
        names = tuple(getattr(mesh, "axis_names", ()))
        if not names or not hasattr(mesh, "shape"):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        given = {"sequence_axis": sequence_axis, "batch_axis": batch_axis, "head_axis": head_axis}
        for argument, axis in given.items():
            if axis is None and argument != "sequence_axis":
                continue
            if axis not in names:
                raise ValueError(f"{argument}={axis!r} is not an axis of the mesh; the mesh has axes {names}")
        used = [axis for axis in given.values() if axis is not None]
        if len(set(used)) != len(used):
            raise ValueError(f"sequence_axis, batch_axis and head_axis must be different mesh axes, got {given}")
        return cls(sequence_axis, batch_axis, head_axis, int(mesh.shape[sequence_axis]))


def check_divisible(problem, mesh: Any, axes: MeshAxes) -> None:
    """Each split axis of a canonical problem (`Problem` or `DeltaProblem`) must divide evenly:
    no padding is done (H: the value heads)."""
    (B, T), H = problem.query.shape[:2], problem.value.shape[2]
    if T % axes.shards:
        what = "total_tokens" if problem.cu_seqlens is not None else "seq_len"
        raise ValueError(
            f"{what}={T} is not divisible by the {axes.shards} shards of sequence_axis={axes.sequence!r}; "
            "pad the token axis to a multiple of it (packed input: append a padding sequence to cu_seqlens)"
        )
    for axis, size, what in ((axes.batch, B, "batch"), (axes.head, H, "num_heads")):
        if axis is not None and size % mesh.shape[axis]:
            raise ValueError(f"{what}={size} is not divisible by the {mesh.shape[axis]} shards of {axis!r}")


class Pieces(NamedTuple):
    """Where packed sequences meet shard p (positions are global token indices).

    **Arguments:**
    - `head`, `tail`: the sequences holding the shard's first and last token.
    - `continues`: whether `head` began in an earlier shard (the incoming state reaches it).
    - `head_end`: the local index of `head`'s last token in this shard.
    - `passes`: whether the incoming state reaches the outgoing one (`head` spans the shard).
    """

    head: Int[Array, "..."]
    tail: Int[Array, "..."]
    continues: Bool[Array, "..."]
    head_end: Int[Array, "..."]
    passes: Bool[Array, "..."]

    @classmethod
    def of(cls, cu_seqlens: Int[Array, " S_plus_1"], shard: Int[Array, "..."], length: int) -> Pieces:
        first = shard * length
        head = jnp.searchsorted(cu_seqlens[1:], first, side="right")
        tail = jnp.searchsorted(cu_seqlens[1:], first + length - 1, side="right")
        continues = cu_seqlens[head] < first
        head_end = jnp.minimum(cu_seqlens[head + 1], first + length) - 1 - first
        return cls(head, tail, continues, head_end, continues & (head == tail))


def local_sequences(cu_seqlens: Int[Array, " S_plus_1"], shard: Int[Array, ""], length: int):
    """Local boundaries [S + 1] and which sequences start / end in the shard ([S] each)."""
    first = shard * length
    starts, stops = cu_seqlens[:-1], cu_seqlens[1:]
    inside = lambda token: (token >= first) & (token < first + length)  # noqa: E731
    nonempty = stops > starts
    local_cu = jnp.clip(cu_seqlens - first, 0, length)
    return local_cu, nonempty & inside(starts), nonempty & inside(stops - 1)


def shard_map_unchecked(fn, mesh, in_specs, out_specs):
    """`jax.shard_map`, or `jax.experimental.shard_map` on older JAX, without replication checks.

    The local algorithm comes from the registry and may start its own scans from fresh
    (unsharded) zero carries, which the varying-axes type check rejects; every output here
    is either sharded over the sequence axis or computed identically on every shard, which
    is what unchecked autodiff needs to be exact.
    """
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map

    return shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def head_axis_splits(heads: int, mesh: Any, axes: MeshAxes) -> bool:
    """Whether `head_axis` (if any) splits `heads` query/key heads evenly alongside the value heads."""
    return axes.head is None or heads % mesh.shape[axes.head] == 0


def explicit_axes(mesh: Any) -> bool:
    return any("explicit" in str(kind).lower() for kind in getattr(mesh, "axis_types", ()) or ())


_PER_HEAD = ("log_decay_head", "beta")
"""Fields of a canonical problem laid out [B, T, H]; the other token fields are [B, T, H, D]."""


def problem_specs(problem, axes: MeshAxes):
    """Partition specs of a canonical problem (`Problem` or `DeltaProblem`: token arrays
    [B, T, H, D] and [B, T, H], the initial state [R, H, K, V], the packed boundaries) and of
    the call's (output, final_state)."""
    tokens = Spec(axes.batch, axes.sequence, axes.head, None)
    per_head = Spec(axes.batch, axes.sequence, axes.head)
    state = Spec(None if problem.cu_seqlens is not None else axes.batch, axes.head, None, None)

    def spec(field: str, x):
        if x is None:
            return None
        special = {"initial_state": state, "cu_seqlens": Spec()}
        return special.get(field, per_head if field in _PER_HEAD else tokens)

    return type(problem)(*(spec(f, x) for f, x in zip(problem._fields, problem))), (tokens, state)


def placed(problem, specs, mesh: Any):
    """The problem laid out as `specs` says (needed on meshes with explicit axes)."""
    if not explicit_axes(mesh):
        return problem
    put = lambda x, spec: None if x is None else jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    return type(problem)(*(put(x, spec) for x, spec in zip(problem, specs)))


def run_sharded(body, problem, mesh: Any, axes: MeshAxes, precision):
    """`(output, final_state)` of `body` (one shard's pair from its block of the canonical
    `problem`) run on every device under `shard_map`, at the call's matmul `precision`. A packed
    sequence with no tokens is in no shard: its final state is its initial state."""
    in_specs, out_specs = problem_specs(problem, axes)
    sharded = shard_map_unchecked(body, mesh, (in_specs,), out_specs)
    with matmul_precision(resolve(precision, problem.query.dtype)):
        output, final_state = sharded(placed(problem, in_specs, mesh))
    if problem.cu_seqlens is not None:
        empty = (problem.cu_seqlens[1:] == problem.cu_seqlens[:-1])[:, None, None, None]
        final_state = final_state + jnp.where(empty, problem.initial_state, jnp.zeros_like(final_state))
    return output, final_state
