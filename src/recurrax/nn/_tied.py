"""The tied output head: logits against the embedding table.

| symbol | meaning                                                   |
|--------|-----------------------------------------------------------|
| E      | the embedding table [vocab, D]                            |
| n      | rows of hidden states (all leading axes flattened)        |

    logits = h · Eᵀ        (what `nnx.Embed.attend` computes)
    logits = h · W         (an untied head `nnx.Linear` without bias, W [D, vocab])

Both accumulate in float32 (float64 for float64 models) and return it: a bfloat16 model's
logits are float32, as its loss is.

On the CPU, for a few rows at once (2 ≤ n ≤ `COLUMN_ROWS`: decoding a small batch), the tied
head computes `E · hᵀ` ([vocab, n], the table read row by row, as in a one-row GEMV) and then
transposes it, with an optimisation barrier between the two: without it XLA folds the
transpose into the matmul, which then writes `[n, vocab]` directly at about 1.6× the time. A
248,320 × 1024 table, n = 8: 29 ms against 47 ms for the plain matmul (JAX 0.12; 26 against
47 on JAX 0.10); the transpose of the `[vocab, 8]` result takes 0.2 ms. The same products:
float32 rounding apart, the same logits. One row (a GEMV either way), more rows (the
transpose's copy then costs what the matmul saves) or a mesh keep the single matmul.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from .._core.registry import current_backend

COLUMN_ROWS = 32


def tied_logits(embed: nnx.Embed, h: Float[Array, "... D"]) -> Float[Array, "... vocab"]:
    """`embed.attend(h)` as one contraction over E's feature axis (as `E · hᵀ`, transposed, on
    the CPU for 2 to `COLUMN_ROWS` rows, see the module notes).

    `attend`'s `jnp.dot(h, E.T)` makes XLA on CPU transpose the whole [vocab, D] table when h
    has a single row (a one-token decode step): 5× slower at a 50,280 × 768 table.

    **Arguments:**
    - `embed`: the embedding (its `dtype`, if set, is the computation dtype, as for `attend`).
    - `h`: `[..., D]` hidden states.
    """
    table = embed.embedding[...]
    dtype = embed.dtype or jnp.result_type(h, table)
    h, table = h.astype(dtype), table.astype(dtype)
    if _by_columns(h):
        return column_tied_logits(h, table)
    return jnp.einsum("...d,vd->...v", h, table, preferred_element_type=_wide(dtype))


def column_tied_logits(h: Float[Array, "... D"], table: Float[Array, "vocab D"]) -> Float[Array, "... vocab"]:
    """`h · tableᵀ` computed as `table · hᵀ` ([vocab, n]) and transposed after a barrier (which
    keeps XLA from merging the two), accumulated in float32 or wider."""
    x = h.reshape(-1, h.shape[-1])  # [n, D]
    columns = jnp.einsum("vd,nd->vn", table, x, preferred_element_type=_wide(table.dtype))
    return jax.lax.optimization_barrier(columns).T.reshape(*h.shape[:-1], table.shape[0])


def _by_columns(h) -> bool:
    """Whether `tied_logits` takes the column form: on the CPU, outside a mesh, for 2 to
    `COLUMN_ROWS` rows."""
    n = h.size // h.shape[-1] if h.shape[-1] else 0
    return 2 <= n <= COLUMN_ROWS and jax.sharding.get_abstract_mesh().empty and current_backend() == "cpu"


def untied_logits(head: nnx.Linear, h: Float[Array, "... D"]) -> Float[Array, "... vocab"]:
    """`head(h)` (a `nnx.Linear` without bias; its `dtype`, if set, is the computation dtype),
    accumulated in float32."""
    kernel = head.kernel[...]
    dtype = head.dtype or jnp.result_type(h, kernel)
    return jnp.einsum("...d,dv->...v", h.astype(dtype), kernel.astype(dtype), preferred_element_type=_wide(dtype))


def _wide(dtype):
    """float32, or float64 for float64."""
    return jnp.promote_types(jnp.float32, dtype)
