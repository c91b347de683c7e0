"""The floor both operations stand on (`recurrax.recurrence`, `recurrax.delta`): it imports
neither of them, nor the kernels, models or tools.

| module             | what it holds                                                          |
|--------------------|------------------------------------------------------------------------|
| `arguments`        | the public arguments' array types, named once                           |
| `problem`          | the canonical form: validation, `Gate`, `Problem` (the delta rule's `DeltaProblem` reuses its checks) |
| `registry`         | `Platform`, `Backend`, `Request`, `Support`, `KernelRegistry`, the chip judged |
| `varlen`           | packed sequences: `cu_seqlens` ↔ segments, chunk-aligned layout         |
| `finite`           | non-finite inputs: the clean-then-mark guard both operations wrap their algorithms in |
| `finite_recurrent`, `finite_delta` | each operation's `Rule` for it (the kernels' drivers apply them too) |
| `mesh`             | sequence parallelism's plumbing: `MeshAxes`, where packed sequences meet a shard, `shard_map` |
| `matmul_precision` | the XLA paths' matmul precision, carried into custom VJPs              |
| `eager`            | eager calls as one compiled program cached per shape and option        |
| `intra`            | decayed causal products inside a chunk (both chunk algorithms' scores)  |
"""
