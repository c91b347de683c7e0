"""The tied output head: logits against the embedding table.

| symbol | meaning                                                   |
|--------|-----------------------------------------------------------|
| E      | the embedding table [vocab, D]                            |
| n      | rows of hidden states (all leading axes flattened)        |
| R      | table rows per block of the CPU's blocked head (~5 MiB)   |

    logits = h · Eᵀ        (what `nnx.Embed.attend` computes)
    logits = h · W         (an untied head `nnx.Linear` without bias, W [D, vocab])

Both accumulate in float32 (float64 for float64 models) and return it: a bfloat16 model's
logits are float32, as its loss is.

On the CPU, for a few rows at once (2 ≤ n ≤ `BLOCKED_ROWS`: decoding a small batch), the tied
head runs over E in blocks of R rows, each block's `E_blk · hᵀ` one matmul, and transposes the
`[vocab, n]` result: XLA's CPU matmul at such thin shapes runs far below the rate it reaches
on a cache-sized block (a 248,320 × 1024 table, batch 8: 1.2–1.4× less CPU time blocked).
The same products, summed over D in another order: float32 rounding apart, the same logits.
One row (a GEMV, already at the read bandwidth), many rows, or a mesh keep the single matmul.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from ..registry import current_backend

BLOCK_BYTES = 5 * 2**20
BLOCKED_ROWS = 64


def tied_logits(embed: nnx.Embed, h: Float[Array, "... D"]) -> Float[Array, "... vocab"]:
    """`embed.attend(h)` as one contraction over E's feature axis (blocked over E's rows on the
    CPU for 2 to `BLOCKED_ROWS` rows, see the module notes).

    `attend`'s `jnp.dot(h, E.T)` makes XLA on CPU transpose the whole [vocab, D] table when h
    has a single row (a one-token decode step): 5× slower at a 50,280 × 768 table.

    **Arguments:**
    - `embed`: the embedding (its `dtype`, if set, is the computation dtype, as for `attend`).
    - `h`: `[..., D]` hidden states.
    """
    table = embed.embedding[...]
    dtype = embed.dtype or jnp.result_type(h, table)
    h, table = h.astype(dtype), table.astype(dtype)
    if _blocked(h, table):
        return blocked_tied_logits(h, table, block_rows(table))
    return jnp.einsum("...d,vd->...v", h, table, preferred_element_type=_wide(dtype))


def blocked_tied_logits(h: Float[Array, "... D"], table: Float[Array, "vocab D"],
                        rows: int) -> Float[Array, "... vocab"]:
    """`h · tableᵀ` over blocks of `rows` table rows (one scan step each; the last
    `vocab mod rows` rows in one matmul after it), accumulated in float32 or wider."""
    vocab, D = table.shape
    x = h.reshape(-1, D)  # [n, D]
    wide = _wide(table.dtype)
    product = lambda block: jnp.einsum("rd,nd->rn", block, x, preferred_element_type=wide)  # noqa: E731
    blocks = vocab // rows
    body = jax.lax.map(lambda i: product(jax.lax.dynamic_slice_in_dim(table, i * rows, rows)), jnp.arange(blocks))
    logits = jnp.concatenate([body.reshape(blocks * rows, -1), product(table[blocks * rows:])])  # [vocab, n]
    return logits.T.reshape(*h.shape[:-1], vocab)


def block_rows(table: Float[Array, "vocab D"]) -> int:
    """R: the table rows in `BLOCK_BYTES` (at least one)."""
    return max(1, BLOCK_BYTES // (table.shape[1] * table.dtype.itemsize))


def _blocked(h, table) -> bool:
    """Whether `tied_logits` takes the blocked path: on the CPU, outside a mesh, for 2 to
    `BLOCKED_ROWS` rows and a table of at least two blocks."""
    n = h.size // h.shape[-1] if h.shape[-1] else 0
    return (2 <= n <= BLOCKED_ROWS and table.shape[0] >= 2 * block_rows(table)
            and jax.sharding.get_abstract_mesh().empty and current_backend() == "cpu")


def untied_logits(head: nnx.Linear, h: Float[Array, "... D"]) -> Float[Array, "... vocab"]:
    """`head(h)` (a `nnx.Linear` without bias; its `dtype`, if set, is the computation dtype),
    accumulated in float32."""
    kernel = head.kernel[...]
    dtype = head.dtype or jnp.result_type(h, kernel)
    return jnp.einsum("...d,dv->...v", h.astype(dtype), kernel.astype(dtype), preferred_element_type=_wide(dtype))


def _wide(dtype):
    """float32, or float64 for float64."""
    return jnp.promote_types(jnp.float32, dtype)
