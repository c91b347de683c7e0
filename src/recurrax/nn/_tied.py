"""The tied output head: logits against the embedding table.

| symbol | meaning                         |
|--------|---------------------------------|
| E      | the embedding table [vocab, D]  |

    logits = h · Eᵀ        (what `nnx.Embed.attend` computes)
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float


def tied_logits(embed: nnx.Embed, h: Float[Array, "... D"]) -> Float[Array, "... vocab"]:
    """`embed.attend(h)` as one contraction over E's feature axis.

    `attend`'s `jnp.dot(h, E.T)` makes XLA on CPU transpose the whole [vocab, D] table when h
    has a single row (a one-token decode step): 5× slower at a 50,280 × 768 table.

    **Arguments:**
    - `embed`: the embedding (its `dtype`, if set, is the computation dtype, as for `attend`).
    - `h`: `[..., D]` hidden states.
    """
    table = embed.embedding[...]
    dtype = embed.dtype or jnp.result_type(h, table)
    return jnp.einsum("...d,vd->...v", h.astype(dtype), table.astype(dtype))
