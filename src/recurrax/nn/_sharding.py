"""Models on a device mesh: logical axis names on every parameter, rules that map them to mesh
axes, placing a model's parameters, and the context a sharded forward runs in.

Every parameter of `recurrax.nn` and `recurrax.nn.pretrained` carries Flax NNX's sharding
metadata (`out_sharding`, set through `nnx.with_partitioning`) with these logical names:

| logical axis | indexes                                                                    |
|--------------|----------------------------------------------------------------------------|
| `vocab`      | token ids (embedding rows, output-head columns)                            |
| `embed`      | the model width D (the residual stream)                                    |
| `heads`      | query heads: fused `H·K` / `H·V` projection axes, per-head vectors          |
| `kv_heads`   | key/value heads: fused `Hkv·K` / `Hkv·V` axes                              |
| `head_dim`   | one head's channels (per-head norm weights)                                |
| `mlp`        | an MLP's (or an expert's) hidden width                                     |
| `experts`    | routed experts (the first axis of stacked expert weights)                  |
| `inner`      | a projection's concatenated outputs: Mamba-2's `[z | xBC | dt]` and its conv channels, the fused q/k/v of `recurrax.nn` mixers |
| `conv`       | short-convolution taps                                                     |
| `layers`     | HGRN2's per-layer lower bounds                                             |

Low-rank and feature-map dimensions are `None` (never sharded). Activations use `batch`,
`length`, `embed`, `heads`, `kv_heads`, `head_dim`, `mlp` and `vocab`.

A rules table (Flax's `LogicalRules`: `(logical, mesh axis or None)` pairs) maps them to mesh
axes; `logical_rules` builds the usual ones over the mesh axes `data`, `tensor`, `sequence` and
`expert`:

| layout     | maps                                                                     |
|------------|--------------------------------------------------------------------------|
| `data`     | `batch` → `data`                                                         |
| `fsdp`     | `batch` → `data`, and `embed` → `data` (parameters and, through them, optimizer state sharded) |
| `tensor`   | `heads`, `kv_heads`, `mlp`, `vocab`, `inner` → `tensor`                  |
| `sequence` | `length` → `sequence`                                                    |
| `expert`   | `experts` → `expert` (expert parallelism)                                |

Expert parallelism has its own mesh axis, `expert`, rather than `tensor`'s: tensor parallelism
splits each expert's hidden width `mlp` over `tensor` (its own all-reduce), and expert
parallelism splits the experts and, with them, the tokens (`recurrax.nn._expert_parallel`:
each (token, expert) pair travels to its expert's device by an all-to-all), so the two
combine on a mesh such as `(data, expert, tensor)`. `logical_rules(..., expert="data")` runs
expert parallelism over the data-parallel devices instead (with the `data` layout; `fsdp`
gives `data` to the weights' `embed` axis first). Under the rules, a mixture of experts whose
expert count the expert axis divides takes that path (`routed_experts`).

Creating a model never shards it (the metadata has `eager_sharding=False`), with or without a
mesh; `shard_model` places its parameters. A dimension the mesh axes do not divide stays
whole (replicated) there. Sharding changes where numbers live, not what is computed: a
sharded forward and its gradients equal one device's up to float rounding of reordered sums.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from flax import nnx
from flax.core import spmd as core_spmd
from flax.linen import spmd as linen_spmd
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as Spec

from .. import parallel
from ..recurrence._api import recurrent
from ..delta import delta_rule

LOGICAL_AXES = ("batch", "length", "vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "experts", "inner",
                "conv", "layers")
"""Every logical axis name the layers use (parameters and activations)."""

TENSOR_AXES = ("heads", "kv_heads", "mlp", "vocab", "inner")
"""The logical axes tensor parallelism shards."""

LAYOUTS = ("data", "fsdp", "tensor", "sequence", "expert")
"""The layouts `logical_rules` combines."""

RESIDUAL = ("batch", "length", "embed")
"""The logical axes of the residual stream `[B, T, D]`, constrained at every block boundary."""

Rules = tuple[tuple[str, Any], ...]


def logical_rules(*layouts: str, data: str = "data", tensor: str = "tensor", sequence: str = "sequence",
                  expert: str = "expert") -> Rules:
    """The rules table of a combination of the usual layouts.

    - `"data"`: `batch` over `data` (parameters replicated);
    - `"fsdp"`: `batch` and the parameters' `embed` axis over `data` (an optimizer's state,
      made from the placed parameters, is sharded alike);
    - `"tensor"`: `heads`, `kv_heads`, `mlp`, `vocab` and `inner` over `tensor`;
    - `"sequence"`: `length` over `sequence`;
    - `"expert"`: `experts` over `expert` (expert parallelism; mixtures of experts then send
      each token to its experts' devices).

    **Arguments:**
    - `layouts`: any of `"data"`, `"fsdp"`, `"tensor"`, `"sequence"`, `"expert"`; none:
      everything replicated.
    - `data`, `tensor`, `sequence`, `expert`: the mesh axis names each layout uses.

    **Returns:** one `(logical axis, mesh axis or None)` pair for every name in `LOGICAL_AXES`,
    in that order (Flax gives earlier pairs precedence when two names want one mesh axis).
    """
    unknown = [layout for layout in layouts if layout not in LAYOUTS]
    if unknown:
        raise ValueError(f"layouts must be among {LAYOUTS}, got {unknown}")
    mapping: dict[str, Any] = dict.fromkeys(LOGICAL_AXES)
    if "data" in layouts or "fsdp" in layouts:
        mapping["batch"] = data
    if "fsdp" in layouts:
        mapping["embed"] = data
    if "tensor" in layouts:
        mapping.update(dict.fromkeys(TENSOR_AXES, tensor))
    if "sequence" in layouts:
        mapping["length"] = sequence
    if "expert" in layouts:
        mapping["experts"] = expert
    return tuple(mapping.items())


DATA_PARALLEL = logical_rules("data")
"""`batch` over `data`; parameters replicated."""
FSDP = logical_rules("fsdp")
"""`batch` and the parameters' `embed` axis over `data`."""
TENSOR_PARALLEL = logical_rules("tensor")
"""Heads, MLP width, vocabulary and fused projections over `tensor`."""
SEQUENCE_PARALLEL = logical_rules("sequence")
"""The token axis (`length`) over `sequence`."""
EXPERT_PARALLEL = logical_rules("expert")
"""The experts over `expert` (tokens to their experts by all-to-all)."""


def partitioned(initializer, *names: str | None):
    """`initializer` whose parameter carries the logical axis `names` (never sharded eagerly)."""
    return nnx.with_partitioning(initializer, names, eager_sharding=False)


def param(value: jax.Array, *names: str | None) -> nnx.Param:
    """An `nnx.Param` holding `value` with the logical axis `names`."""
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def mesh_spec(names: Sequence[str | None], shape: Sequence[int], mesh: Any, rules: Rules | None = None,
              undivided: Any = None) -> Spec:
    """The mesh `PartitionSpec` of an array with logical axis `names` and `shape`, by `rules`
    (default: the current ones); a dimension its mesh axes do not divide gets `undivided`."""
    spec = linen_spmd.logical_to_mesh_axes(tuple(names), rules)
    return Spec(*(axes if _divides(axes, size, mesh) else undivided for axes, size in zip(spec, shape)))


def _divides(axes, size: int, mesh: Any) -> bool:
    if axes is None:
        return True
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    return size % math.prod(mesh.shape[name] for name in names) == 0


def check_mesh_axes(mesh: Any, rules: Rules) -> None:
    """A `ValueError` naming a mesh axis that `rules` map a logical axis to and `mesh` lacks,
    with the mesh's axes (instead of a `KeyError` from deep inside)."""
    axes = tuple(mesh.axis_names)
    for logical, target in rules:
        names = () if target is None else (target,) if isinstance(target, str) else tuple(target)
        missing = [name for name in names if name not in axes]
        if missing:
            raise ValueError(f"the rules map the logical axis {logical!r} to the mesh axis {missing[0]!r}, which "
                             f"the mesh lacks (its axes: {', '.join(map(repr, axes))}); give the mesh that axis or "
                             "name one of its axes in logical_rules(..., data=, tensor=, sequence=, expert=)")


def logical_specs(model: nnx.Module) -> nnx.State:
    """Every variable's logical `PartitionSpec` (`nnx.get_partition_spec`, read without rules)."""
    with core_spmd.logical_axis_rules(()):
        return nnx.get_partition_spec(nnx.state(model))


def parameter_shardings(model: nnx.Module, mesh: Any, rules: Rules) -> nnx.State:
    """The `NamedSharding` of every variable of `model` on `mesh` by `rules`, as an `nnx.State`
    shaped like `nnx.state(model)` (e.g. `out_shardings` of a jitted initialiser).

    **Arguments:**
    - `model`: a module of `recurrax.nn` or `recurrax.nn.pretrained` (concrete or abstract).
    - `mesh`: a `jax.sharding.Mesh`; `rules`: a rules table (`logical_rules(...)`).
    """
    check_mesh_axes(mesh, rules)
    state = nnx.state(model)
    specs = logical_specs(model)

    def sharding(spec, value):
        return NamedSharding(mesh, mesh_spec(tuple(spec), value.shape, mesh, rules))

    return jax.tree.map(sharding, specs, state, is_leaf=lambda x: isinstance(x, Spec))


def shard_model(model: nnx.Module, mesh: Any, rules: Rules) -> nnx.Module:
    """Place `model`'s parameters on `mesh` as `rules` lay them out (in place; returns `model`).

    **Arguments:**
    - `model`: a module of `recurrax.nn` or `recurrax.nn.pretrained`.
    - `mesh`: a `jax.sharding.Mesh`; `rules`: a rules table (`logical_rules(...)`); a mesh
      axis the rules name and the mesh lacks is a `ValueError` naming it and the mesh's axes.
    """
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, parameter_shardings(model, mesh, rules)))
    return model


@contextlib.contextmanager
def use_mesh(mesh: Any, rules: Rules) -> Iterator[Any]:
    """Run a model's forward (and its `jax.jit`) on `mesh` by `rules`: `jax.set_mesh(mesh)` and
    Flax's `logical_axis_rules(rules)` together. Inside, the layers constrain their activations
    by logical name, and `length` mapped to a mesh axis splits the sequence over it.

    **Arguments:**
    - `mesh`: a `jax.sharding.Mesh` (axes of type `Auto`); `rules`: a rules table. A mesh axis
      the rules name and the mesh lacks is a `ValueError` naming it and the mesh's axes.
    """
    check_mesh_axes(mesh, rules)
    with jax.set_mesh(mesh), core_spmd.logical_axis_rules(rules):
        yield mesh


def mesh_axis(name: str, size: int | None = None) -> str | None:
    """The mesh axis the logical axis `name` maps to under the current mesh and rules
    (`use_mesh`), or None: no mesh or rules, no single mesh axis for it, an axis of size 1, or
    one that does not divide `size`."""
    rules = core_spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return None
    axis = next((axes for logical, axes in rules if logical == name), None)
    if not isinstance(axis, str) or mesh.shape[axis] == 1 or (size is not None and size % mesh.shape[axis]):
        return None
    return axis


def recurrent_on_mesh(query, key, value, *, cu_seqlens=None, implementation: str | None = None, **options):
    """`recurrax.recurrent`, or `recurrax.parallel.recurrent` over the mesh axis of `length`
    when the current rules map it to one that divides the token count (batch rows and heads
    over the axes of `batch` and `heads` where those divide too). Same arguments and results."""
    return _on_mesh(recurrent, parallel.recurrent, (query, key, value), cu_seqlens, implementation, options)


def delta_rule_on_mesh(query, key, value, beta, *, cu_seqlens=None, implementation: str | None = None, **options):
    """`recurrax.delta_rule`, or `recurrax.parallel.delta_rule` over the mesh axis of `length`,
    chosen as `recurrent_on_mesh` chooses. Same arguments and results."""
    return _on_mesh(delta_rule, parallel.delta_rule, (query, key, value, beta), cu_seqlens, implementation, options)


def _on_mesh(single, sharded, arrays: tuple, cu_seqlens, implementation, options: dict):
    """`single(*arrays, ...)`, or `sharded(*arrays, ..., mesh=, sequence_axis=, ...)` when the
    rules map `length` to a mesh axis dividing the token count."""
    query, value = arrays[0], arrays[2]
    (B, T), H = query.shape[:2], value.shape[-2]
    sequence = mesh_axis("length", T)
    if sequence is None:
        return single(*arrays, cu_seqlens=cu_seqlens, implementation=implementation, **options)
    batch = None if cu_seqlens is not None else mesh_axis("batch", B)
    head = mesh_axis("heads", H)
    batch = None if batch == sequence else batch
    head = None if head in (sequence, batch) else head
    return sharded(*arrays, cu_seqlens=cu_seqlens, implementation=implementation,
                   mesh=jax.sharding.get_abstract_mesh(), sequence_axis=sequence, batch_axis=batch,
                   head_axis=head, **options)


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
    """`x` constrained to the layout of the logical axis `names` under the current mesh and
    rules (`use_mesh`); unchanged outside it. Dimensions their mesh axes do not divide are left
    unconstrained."""
    rules = core_spmd.get_logical_axis_rules()
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or mesh.empty:
        return x
    spec = mesh_spec(names, x.shape, mesh, rules, undivided=Spec.UNCONSTRAINED)
    return jax.lax.with_sharding_constraint(x, spec)
