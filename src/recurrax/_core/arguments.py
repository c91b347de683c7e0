"""The array types of the operations' public arguments, named once (jaxtyping: the axes in
words). `recurrent`'s key and value may have fewer heads than its query (`num_kv_heads`); the
delta rule's query and key may have fewer than its value (`num_qk_heads`). Packed input
(`cu_seqlens`) lays the tokens out as `[total_tokens, ...]` (or `[1, total_tokens, ...]`)."""

from __future__ import annotations

import jax
from jaxtyping import Array, Float, Int

Queries = Float[Array, "batch seq_len num_heads qk_head_dim"] | Float[Array, "total_tokens num_heads qk_head_dim"]
Keys = Float[Array, "batch seq_len num_kv_heads qk_head_dim"] | Float[Array, "total_tokens num_kv_heads qk_head_dim"]
Values = Float[Array, "batch seq_len num_kv_heads v_head_dim"] | Float[Array, "total_tokens num_kv_heads v_head_dim"]
SharedQueries = (Float[Array, "batch seq_len num_qk_heads qk_head_dim"]
                 | Float[Array, "total_tokens num_qk_heads qk_head_dim"])
HeadValues = Float[Array, "batch seq_len num_heads v_head_dim"] | Float[Array, "total_tokens num_heads v_head_dim"]
PerHead = Float[Array, "batch seq_len num_heads"] | Float[Array, "total_tokens num_heads"]
Gates = Float[Array, "batch seq_len num_heads *qk_head_dim"] | None
HeadGates = Float[Array, "batch seq_len num_heads"] | None
KeyGates = Float[Array, "batch seq_len num_heads qk_head_dim"] | None
ValueGates = Float[Array, "batch seq_len num_heads v_head_dim"] | None
ConstantGates = Float[Array, " num_heads"] | Float[Array, "rows num_heads"] | None
States = Float[Array, "rows num_heads qk_head_dim v_head_dim"] | None
CuSeqlens = Int[Array, " num_seqs_plus_one"] | None
Precision = str | jax.lax.Precision | None
Results = tuple[Float[Array, "... num_heads v_head_dim"], Float[Array, "rows num_heads qk_head_dim v_head_dim"]]
"""`(output, final_state)`."""
