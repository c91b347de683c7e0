"""The chunkwise-parallel algorithm: masked matmuls inside a chunk, a scan of the state across.

| symbol | meaning                                                                     |
|--------|-----------------------------------------------------------------------------|
| B, T   | batch rows, tokens per row                                                  |
| H      | heads (grouped heads already expanded)                                      |
| K, V   | key/query and value head dimensions                                         |
| C      | chunk size (`chunk_size`): one K×V state is materialised per chunk          |
| c      | leaf block size (`block_size`) of the per-channel decay ladder              |
| P      | chunks per scan step (`chunks_per_step`)                                    |
| N      | packed tokens; their aligned layout has M ≤ ceil(N / C) + S chunks          |
| S, R   | packed sequences; state rows (B, or S when packed)                          |

Same semantics as DESIGN §1. Inside a chunk the output is a decayed causal product of
queries and keys applied to values (`_chunk_intra`: exact for any decay strength, every
exponential has a non-positive exponent); across chunks only the [K, V] state is carried
by a `lax.scan` (`_chunk_scan`), whose hand-written backward recomputes everything else
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

**Tuning.** `chunk_size` (C), `block_size` (c) and `chunks_per_step` (P) are static. The
defaults (`DEFAULT_TILING`) come from `benchmarks/chunk_sweep.py` on the 2-core development
CPU, an Intel Xeon, and were re-checked on an AMD EPYC (B=2 T=2048 H=8 K=V=64 float32; tables
in `benchmarks/results/chunk_sweep.md`; what bounds them in `chunk_profile.md`). Intel figures:

- without per-channel decays, 64×1×8: the forward+backward is fastest there (per-head g
  50 ms, 9.4% of the measured matmul peak; 6× the scan implementation);
- with per-channel decays, 32×1×4 (gk: 86 ms, 5.5%): c = 1 beats every exact leaf (a leaf
  of c tokens costs c exps per token and channel, a ladder level one multiply), and a shorter
  chunk keeps the ladder shallow;
- P > 1 amortises per-operation overhead over larger batched matmuls (each still runs on
  one core: XLA CPU does not split a batched dot over its threads); under heavy load P = 1
  measured best.

GPU and TPU have not been swept (no device was available) and reuse the CPU table.
"""

from __future__ import annotations

import dataclasses

from jaxtyping import Array, Float

from . import varlen
from ._chunk_scan import ChunkMeta, Gates, Static, chunked
from ._inputs import Problem
from .reference import ALL_FLOATS
from .registry import Backend, Platform, Support, current_backend, kernel_registry


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static tile sizes of the chunk algorithm.

    **Arguments:**
    - `chunk_size`: tokens per chunk C; the state is materialised once per chunk.
    - `block_size`: leaf block c of the per-channel decay ladder: diagonal blocks of c
      tokens are evaluated element-wise (C / c must be a power of two).
    - `chunks_per_step`: chunks P handled by one step of the state scan (their intra-chunk
      work is batched; a larger P amortises per-operation overhead, a smaller P keeps a
      step's working set in cache).
    """

    chunk_size: int
    block_size: int
    chunks_per_step: int

    def check(self) -> None:
        C, c = self.chunk_size, self.block_size
        for name in ("chunk_size", "block_size", "chunks_per_step"):
            size = getattr(self, name)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{name} must be a positive int, got {size!r}")
        ratio = C // c
        if C % c or ratio & (ratio - 1):
            raise ValueError(
                f"chunk_size must be block_size times a power of two, got chunk_size={C}, block_size={c}"
            )

    def fitted(self, seq_len: int) -> Tiling:
        """Smaller tiles for a short sequence: halve C while it fits in half a chunk (C / c
        stays a power of two), then fit the chunks per step to the chunk count."""
        size = self.chunk_size
        while size // 2 >= max(seq_len, self.block_size):
            size //= 2
        return Tiling(size, min(self.block_size, size), self.steps_for(-(-seq_len // size)))

    def steps_for(self, num_chunks: int) -> int:
        """Chunks per step for `num_chunks` chunks: the largest P' ≤ P whose padding of the
        chunk count to a multiple of P' wastes at most an eighth (P' = 1 never pads)."""
        for per_step in range(min(self.chunks_per_step, num_chunks), 0, -1):
            padded = -(-num_chunks // per_step) * per_step
            if 8 * (padded - num_chunks) <= padded:
                return per_step
        return 1


DEFAULT_TILING = {
    "cpu": {"masked": Tiling(64, 1, 8), "ladder": Tiling(32, 1, 4)},
    "gpu": {"masked": Tiling(64, 1, 8), "ladder": Tiling(32, 1, 4)},
    "tpu": {"masked": Tiling(64, 1, 8), "ladder": Tiling(32, 1, 4)},
}
"""Default tiling per backend and regime: `"masked"` when no per-channel decay is present (the
intra-chunk product is a masked matmul), `"ladder"` otherwise. The CPU figures come from
`benchmarks/chunk_sweep.py` (results in `benchmarks/results/chunk_sweep.md`); GPU and TPU
were not measured (no device was available) and reuse them until someone sweeps there."""


def default_tiling(per_channel: bool, backend: str | None = None) -> Tiling:
    """The measured default tiling for a problem with (or without) per-channel decays."""
    table = DEFAULT_TILING.get(backend or current_backend(), DEFAULT_TILING["cpu"])
    return table["ladder" if per_channel else "masked"]


def chunk(
    problem: Problem,
    *,
    scale: float,
    reverse: bool,
    chunk_size: int | None = None,
    block_size: int | None = None,
    chunks_per_step: int | None = None,
) -> tuple[Float[Array, "B T H V"], Float[Array, "R H K V"]]:
    """The chunk algorithm on a canonical `problem`; returns `(output, final_state)`.

    **Arguments:**
    - `problem`: the canonical form (`recurrax._inputs.Problem`).
    - `scale`: the softmax scale; `reverse`: run from the last token to the first.
    - `chunk_size`, `block_size`, `chunks_per_step`: static tiling (`Tiling`); None takes
      this backend's default (a default block size larger than `chunk_size` becomes 1).
    """
    default = default_tiling(problem.log_decay_key is not None or problem.log_decay_value is not None)
    pick = lambda given, fallback: fallback if given is None else given  # noqa: E731
    tiling = Tiling(
        pick(chunk_size, default.chunk_size),
        pick(block_size, default.block_size),
        pick(chunks_per_step, default.chunks_per_step),
    )
    if block_size is None and tiling.chunk_size % tiling.block_size:
        tiling = dataclasses.replace(tiling, block_size=1)
    tiling.check()
    gates = Gates(problem.log_decay_head, problem.log_decay_key, problem.log_decay_value)
    arrays = (problem.query, problem.key, problem.value)
    if problem.cu_seqlens is None:
        return _dense(tiling, scale, reverse, arrays, gates, problem.initial_state)
    return _packed(tiling, scale, reverse, arrays, gates, problem.initial_state, problem.cu_seqlens)


def _static(tiling: Tiling, scale, reverse) -> Static:
    return Static(tiling.chunk_size, tiling.block_size, tiling.chunks_per_step, float(scale), bool(reverse))


def _dense(tiling: Tiling, scale, reverse, arrays, gates: Gates, init):
    T = arrays[0].shape[1]
    tiling = tiling.fitted(T)
    step = tiling.chunk_size * tiling.chunks_per_step
    padded = -(-T // step) * step
    q, k, v = (varlen.pad_tokens(x, padded) for x in arrays)
    gates = Gates(*(varlen.pad_tokens(g, padded) for g in gates))
    out, final = chunked(_static(tiling, scale, reverse), q, k, v, gates, init, None)
    return out[:, :T], final


def _packed(tiling: Tiling, scale, reverse, arrays, gates: Gates, init, cu_seqlens):
    num_tokens, num_seqs = arrays[0].shape[1], cu_seqlens.shape[0] - 1
    tiling = tiling.fitted(num_tokens)  # no sequence is longer than all the tokens
    size = tiling.chunk_size
    needed = varlen.max_chunks(num_tokens, num_seqs, size)
    tiling = dataclasses.replace(tiling, chunks_per_step=tiling.steps_for(needed))
    per_step = tiling.chunks_per_step
    layout = varlen.chunk_layout(cu_seqlens, num_tokens, size, -(-needed // per_step) * per_step)
    to_layout = lambda x: None if x is None else varlen.to_chunk_layout(x[0], layout)[None]  # noqa: E731
    q, k, v = (to_layout(x) for x in arrays)
    gates = Gates(*(to_layout(g) for g in gates))
    first, last = layout.chunk_first, layout.chunk_last
    meta = ChunkMeta(
        seq=layout.chunk_seq,
        load=last if reverse else first,
        emit=first if reverse else last,
        empty=layout.seq_empty,
    )
    out, final = chunked(_static(tiling, scale, reverse), q, k, v, gates, init, meta)
    return varlen.from_chunk_layout(out[0], layout)[None], final


@kernel_registry.register(
    "chunk",
    Platform.XLA,
    Backend.ANY,
    priority=20,
    supports=Support(dtypes=ALL_FLOATS, gates=frozenset({"head", "key", "value"}), varlen=True),
)
def chunk_recurrent(problem: Problem, *, scale: float, reverse: bool):
    """The registered entry point: `chunk` with this backend's default tiling."""
    return chunk(problem, scale=scale, reverse=reverse)
