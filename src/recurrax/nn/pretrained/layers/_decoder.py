"""The body of a `transformers` decoder-only causal LM as the family modules hold it.

    h = embed_tokens[tokens];  h = layer_l(h) for each layer;  head input = norm(h)

`DecoderBody` holds `embed_tokens`, `layers` and `norm` under `transformers`' names (a family
module's `Body` subclasses it with its own layers and norm); the calls `CausalLM` makes on every
body (`embedding`, `embed`, `layer_context`, `head_input`, `init_caches`) are the shared
decoder's (`recurrax.nn._decoder.DecoderBody`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx

from ..._decoder import DecoderBody as Body
from ..._sharding import partitioned


class DecoderBody(Body):
    """`embed_tokens`, `layers`, `norm`: the `model` of a `transformers` causal LM.

    **Arguments:** `spec` (a family's resolved config: `vocab_size`, `hidden_size`, `eps`);
    `layers` (called once, after the embedding is made, it returns the decoder layers, each with
    `init_cache(rows, capacity)` and `__call__(h, cache, *, cu_seqlens, positions)`); `norm` (the
    final norm's class, called as `norm(hidden_size, eps=, dtype=)`); `dtype`, `rngs`.
    """

    def __init__(self, spec: dict, layers: Callable[[], list], norm, *, dtype=jnp.float32, rngs: nnx.Rngs):
        D = spec["hidden_size"]
        self.embed_tokens = nnx.Embed(spec["vocab_size"], D, dtype=dtype, param_dtype=dtype, rngs=rngs,
                                      embedding_init=partitioned(nnx.initializers.normal(0.02), "vocab", "embed"))
        self.layers = nnx.List(layers())
        self.norm = norm(D, eps=spec["eps"], dtype=dtype)
