"""Expert parallelism: the routed experts with the experts split over a mesh axis, each
routed (token, expert) pair sent to the device holding its expert by an all-to-all.

| symbol | meaning                                                                        |
|--------|--------------------------------------------------------------------------------|
| X      | devices along the expert axis                                                  |
| E, Eₗ  | experts, experts per device E/X (device j holds experts j·Eₗ … (j+1)·Eₗ − 1)     |
| nₗ, k  | tokens per device (tokens padded to a multiple of the token-axis devices), experts per token |
| C      | slots from one device to one device: nₗ · min(k, Eₗ)                             |
| F, Fₗ  | an expert's hidden width, and its part on one device of the tensor axis         |

On every device (`jax.shard_map` with `check_vma=True` over the token axes — those of the
logical `batch` and `length` and the expert axis — the expert axis, and the tensor axis of
`mlp` when it is another one), for its nₗ tokens and its Eₗ experts:

    pair (t, e), t local      →  destination device e // Eₗ, local expert e mod Eₗ,
                                 slot: its rank among this device's pairs bound there (stable)
    send  [X, C, D]           ←  x_t in its slot, zero rows in the empty slots
    receive = all_to_all(send)   block i of device j: the rows device i sends j
    out   [X·C, D]            =  the local grouped matmul (`routed_experts`, one expert a row)
                                 on every received row (F split: a partial sum over Fₗ)
    back = all_to_all(out)       each row returns to its slot on its token's device
    y_t   = Σ_{e∈S_t} w_{t,e} · back[slot(t, e)]     then psum over the tensor axis

No pair is dropped: a token's k experts are distinct (`route`'s top-k), and at most
min(k, Eₗ) of them are on one device, so at most nₗ·min(k, Eₗ) = C of a device's pairs go to
one destination. That bound is the worst case (every token of a device choosing the same
device), needed because shapes are static: each device computes X·C rows where nₗ·k arrive on
average (X/k·min(k, Eₗ) times that; 1 when k = E). `jax.lax.ragged_all_to_all` would send
fewer bytes but its receive buffer is bounded alike, and XLA's CPU backend does not implement
it (JAX 0.10.2 and 0.12), so the collective is `jax.lax.all_to_all` of the padded buffers.
The backward is JAX's autodiff through the shard_map: the all-to-alls transpose to the
reverse all-to-alls, the psum to a broadcast.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as Spec
from jaxtyping import Array, Float, Int

from ._expert_blocks import combine as combine_rows
from ._sharding import mesh_axis

LocalExperts = Callable[[Float[Array, "R D"], Int[Array, " R"], Any], Float[Array, "R D"]]
"""`(rows, local expert of each row, this device's expert weights) → each row through its expert`."""


def expert_axis(num_experts: int) -> str | None:
    """The mesh axis the logical `experts` axis maps to under the current mesh and rules
    (`use_mesh`), if it has more than one device, divides `num_experts`, and is not already
    manual (inside this module's shard_map); else None: the experts stay on every device."""
    axis = mesh_axis("experts", num_experts)
    if axis is None or axis in jax.sharding.get_abstract_mesh().manual_axes:
        return None
    return axis


def expert_parallel(x: Float[Array, "n D"], experts: Int[Array, "n k"], combine: Float[Array, "n k"], weights,
                    axis: str, local: LocalExperts, *, transposed: bool = False) -> Float[Array, "n D"]:
    """`Σ_{e∈S_t} w_{t,e} FFN_e(x_t)` with the experts split over the mesh axis `axis` (see the
    module docstring).

    **Arguments:**
    - `x`: tokens; `experts`, `combine`: each token's k distinct experts and their weights.
    - `weights`: the stacked expert matrices (`recurrax.nn.ExpertWeights`: `up`, `down`,
      optional `gate`), experts first; `transposed`: in PyTorch's `[E, out, in]` layout.
    - `axis`: the expert mesh axis (of the current abstract mesh).
    - `local`: the experts of one device on its received rows.
    """
    mesh = jax.sharding.get_abstract_mesh()
    num_experts, X = weights.up.shape[0], mesh.shape[axis]
    width = weights.up.shape[1 if transposed else 2]
    free = set(mesh.axis_names) - set(mesh.manual_axes)  # not already split by an enclosing shard_map
    tokens = tuple(dict.fromkeys(a for a in (mesh_axis("batch"), mesh_axis("length"), axis) if a in free))
    tensor = mesh_axis("mlp", width)
    tensor = tensor if tensor in free - set(tokens) else None
    n, k = experts.shape
    shards = math.prod(mesh.shape[a] for a in tokens)
    padding = -n % shards
    if padding:  # padding tokens: zero rows, k distinct experts, weight 0
        x = jnp.pad(x, ((0, padding), (0, 0)))
        experts = jnp.concatenate([experts, jnp.broadcast_to(jnp.arange(k, dtype=experts.dtype), (padding, k))])
        combine = jnp.pad(combine, ((0, padding), (0, 0)))
    slots = (n + padding) // shards * min(k, num_experts // X)

    def body(x, experts, combine, weights):
        slot, rows, local_experts = _send_plan(experts, num_experts // X, X, slots)
        send = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[rows]  # [X·C, D]
        received = jax.lax.all_to_all(send, axis, 0, 0, tiled=True)
        local_experts = jax.lax.all_to_all(local_experts, axis, 0, 0, tiled=True)
        out = local(received, local_experts, weights)
        back = jax.lax.all_to_all(out, axis, 0, 0, tiled=True)
        y = combine_rows(back, slot, combine)
        return y if tensor is None else jax.lax.psum(y, tensor)

    rows = Spec(tokens, None)
    in_up, in_down = Spec(axis, tensor, None), Spec(axis, None, tensor)
    if not transposed:
        in_up, in_down = in_down, in_up
    specs = type(weights)(in_up, in_down, None if weights.gate is None else in_up)
    split = jax.shard_map(body, mesh=mesh, in_specs=(rows, rows, rows, specs), out_specs=rows, check_vma=True)
    return split(x, experts, combine, weights)[:n]


def _send_plan(experts: Int[Array, "n k"], per_device: int, devices: int, slots: int):
    """Where this device's pairs go: `slot [n, k]` (each pair's row of the send buffer,
    destination · C + rank), `rows [X·C]` (the token of each row, n for an empty one) and
    `local_experts [X·C]` (each row's expert on its destination, 0 for an empty one)."""
    n, k = experts.shape
    flat = experts.reshape(-1).astype(jnp.int32)
    pairs = jnp.arange(flat.shape[0], dtype=jnp.int32)
    destination = flat // per_device
    order = jnp.argsort(destination, stable=True)
    counts = jnp.bincount(destination, length=devices).astype(jnp.int32)
    starts = jnp.cumsum(counts, dtype=jnp.int32) - counts
    sorted_destination = destination[order]
    sorted_slot = sorted_destination * slots + pairs - starts[sorted_destination]
    slot = jnp.zeros_like(flat).at[order].set(sorted_slot)
    rows = jnp.full((devices * slots,), n, jnp.int32).at[slot].set(pairs // k)
    local_experts = jnp.zeros((devices * slots,), jnp.int32).at[slot].set(flat % per_device)
    return slot.reshape(n, k), rows, local_experts
