"""The chunkwise-parallel algorithm: masked matmuls inside a chunk, a scan of the state across.

| symbol | meaning                                                                     |
|--------|-----------------------------------------------------------------------------|
| B, T   | batch rows, tokens per row                                                  |
| H      | heads (grouped heads already expanded)                                      |
| K, V   | key/query and value head dimensions                                         |
| C      | chunk size (`chunk_size`): one K×V state is materialised per chunk          |
| c      | leaf size (`leaf_size`) of the per-channel decay ladder                     |
| P      | chunks per scan step (`chunks_per_step`)                                    |
| N      | packed tokens; their aligned layout has M ≤ ceil(N / C) + S chunks          |
| S, R   | packed sequences; state rows (B, or S when packed)                          |

Same semantics as `docs/design.md` §1. Inside a chunk the output is a decayed causal product of
queries and keys applied to values (`_intra`: exact for any decay strength, every
exponential has a non-positive exponent); across chunks only the [K, V] state is carried
by a `lax.scan` (`_state_scan`), whose hand-written backward recomputes everything else
from the chunk-entry states. FLOPs per token and head: forward 4·K·V + 2·C·(K + V), backward
8·K·V + 2·C·(3·K + 2·V) (with per-channel decays the intra-chunk part is about halved: the
ladder never computes the masked upper triangle). Residual memory: the inputs and one state
per chunk, O(B·T·H·(K+V) + B·H·(T/C)·K·V).

- Padding: T is padded to a multiple of P·C with q = k = v = 0 and log decay 0 — tokens
  that neither change the state nor read it. A short T first shrinks C (by halving) and P.
- `reverse`: chunks are visited from last to first and each chunk is flipped; the padding
  then comes first, which is harmless for neutral tokens.
- Packed input: tokens are gathered into the chunk-aligned layout of `varlen.chunk_layout`
  (every sequence starts on a chunk boundary), the state is reset per sequence, and the
  output is gathered back. Shapes depend only on N and S, so `cu_seqlens` may be traced.

**Tuning.** `chunk_size` (C), `leaf_size` (c) and `chunks_per_step` (P) are static: a `Tiling`
(`_tiling.py`, with the defaults per backend and where they come from).
"""

from __future__ import annotations

import dataclasses
import functools

from jaxtyping import Array, Float

from ..._core import varlen
from ..._core.finite_recurrent import guarded
from ..._core.matmul_precision import traced_precision
from ..._core.problem import Problem
from ..._core.registry import ALL_GATES, FLOAT_DTYPES, Support
from ._shared import shared_chunked
from ._state_scan import ChunkCall, LogDecays, chunked
from ._tiling import Tiling, default_tiling

SUPPORT = Support(dtypes=FLOAT_DTYPES, gates=ALL_GATES, varlen=True, shared_query_key=True)


def chunk_recurrent(
    problem: Problem, *, scale: float, reverse: bool, tiling: Tiling | None = None
) -> tuple[Float[Array, "B T H V"], Float[Array, "R H K V"]]:
    """The chunk algorithm on a canonical `problem`; returns `(output, final_state)`.

    **Arguments:**
    - `problem`: the canonical form (`recurrax.Problem`).
    - `scale`: the softmax scale; `reverse`: run from the last token to the first.
    - `tiling`: static tile sizes; None takes this backend's default (`default_tiling`).
    """
    if tiling is None:
        per_channel = problem.log_decay_key is not None or problem.log_decay_value is not None
        tiling = default_tiling(per_channel, shared_query_key=problem.shares_query_key)
    tiling.check()
    return guarded(functools.partial(_chunk_recurrent, tiling, scale, reverse), bool(reverse), problem)


def _chunk_recurrent(tiling: Tiling, scale, reverse, problem: Problem):
    gates = LogDecays(problem.log_decay_head, problem.log_decay_key, problem.log_decay_value)
    scan = chunked
    if problem.shares_query_key:
        if gates.key is None and gates.value is None:
            scan = _shared
        else:  # per-channel decays: the general scan on heads expanded
            problem = problem.expanded()
    run = functools.partial(_run, scan, float(scale), bool(reverse))
    arrays = (problem.query, problem.key, problem.value)
    if problem.cu_seqlens is None:
        return _dense(tiling, run, arrays, gates, problem.initial_state)
    return _packed(tiling, run, arrays, gates, problem.initial_state, problem.cu_seqlens)


def _run(scan, scale: float, reverse: bool, tiling: Tiling, q, k, v, gates: LogDecays, init, meta):
    """`scan` (the general `chunked` or `_shared`) with the tiling fitted to this call."""
    call = ChunkCall(tiling.chunk_size, tiling.leaf_size, tiling.chunks_per_step, scale, reverse, traced_precision())
    return scan(call, q, k, v, gates, init, meta)


def _shared(call: ChunkCall, q, k, v, gates: LogDecays, init, meta):
    return shared_chunked(call, q, k, v, gates.head, init, meta)


def _dense(tiling: Tiling, run, arrays, gates: LogDecays, init):
    T = arrays[0].shape[1]
    tiling = tiling.fitted(T)
    step = tiling.chunk_size * tiling.chunks_per_step
    padded = -(-T // step) * step
    q, k, v = (varlen.pad_tokens(x, padded) for x in arrays)
    gates = LogDecays(*(varlen.pad_tokens(g, padded) for g in gates))
    out, final = run(tiling, q, k, v, gates, init, None)
    return out[:, :T], final


def _packed(tiling: Tiling, run, arrays, gates: LogDecays, init, cu_seqlens):
    num_tokens, num_seqs = arrays[0].shape[1], cu_seqlens.shape[0] - 1
    tiling = tiling.fitted(num_tokens)  # no sequence is longer than all the tokens
    size = tiling.chunk_size
    needed = varlen.max_chunks(num_tokens, num_seqs, size)
    tiling = dataclasses.replace(tiling, chunks_per_step=tiling.steps_for(needed))
    per_step = tiling.chunks_per_step
    layout = varlen.chunk_layout(cu_seqlens, num_tokens, size, -(-needed // per_step) * per_step)
    to_layout = lambda x: None if x is None else varlen.to_chunk_layout(x[0], layout)[None]  # noqa: E731
    q, k, v = (to_layout(x) for x in arrays)
    gates = LogDecays(*(to_layout(g) for g in gates))
    out, final = run(tiling, q, k, v, gates, init, layout.owners)
    return varlen.from_chunk_layout(out[0], layout)[None], final
