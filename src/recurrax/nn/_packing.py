"""Documents packed into fixed-size training batches, with `cu_seqlens` so that no token
attends across a document boundary.

| symbol | meaning                                                               |
|--------|-----------------------------------------------------------------------|
| d      | a document: its token ids `d_0 … d_{L-1}`                             |
| N      | tokens per batch (`batch_tokens`)                                     |
| M      | batches                                                               |
| S      | segments per batch, the most any batch has (shorter ones padded)      |

Each document of L ≥ 2 tokens becomes L − 1 (input, target) pairs `(d_i, d_{i+1})`; the
pairs of all documents, in order, are cut into batches of N. A batch's segments are its runs
of pairs from one document (a document longer than the rest of a batch goes on in the next
one, as a new segment there, its recurrent state starting afresh). The last batch is filled
up with padding pairs of weight 0 in a segment of their own; `cu_seqlens` of batches with
fewer than S segments end in empty segments (repeats of N), so every batch has one shape and
one compiled step serves them all. Every pair is in exactly one batch, once.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np


class PackedBatches(NamedTuple):
    """`pack_documents`'s batches, stacked.

    **Arguments:**
    - `inputs`: `[M, N]` token ids the model reads.
    - `targets`: `[M, N]` the next token of each input, in the same document.
    - `weights`: `[M, N]` 1 for a real pair, 0 for padding.
    - `cu_seqlens`: `[M, S + 1]` each batch's segment boundaries (int32).
    """

    inputs: np.ndarray
    targets: np.ndarray
    weights: np.ndarray
    cu_seqlens: np.ndarray

    def __len__(self) -> int:  # type: ignore[override]  # batches, not the tuple's four fields
        return self.inputs.shape[0]

    def batch(self, index: int) -> PackedBatches:
        """Batch `index` alone: `[N]` arrays and `[S + 1]` boundaries."""
        return PackedBatches(*(field[index] for field in self))


def pack_documents(documents: Sequence[Sequence[int]], batch_tokens: int) -> PackedBatches:
    """Pack `documents` (lists of token ids) into batches of `batch_tokens` (input, target)
    pairs, each batch's documents kept apart by its `cu_seqlens` (see the module's notes).

    **Arguments:**
    - `documents`: token ids per document; documents of fewer than 2 tokens give no pair.
    - `batch_tokens`: N, the pairs per batch (≥ 1).

    **Returns:** `PackedBatches` with `M = ceil(pairs / N)` batches (a `ValueError` when
    there is no pair at all).
    """
    if int(batch_tokens) != batch_tokens or batch_tokens < 1:
        raise ValueError(f"batch_tokens must be a positive integer, got {batch_tokens!r}")
    pieces = [np.asarray(d, np.int64) for d in documents if len(d) >= 2]
    if not pieces:
        raise ValueError("no document has 2 or more tokens: there is nothing to predict")
    inputs = np.concatenate([d[:-1] for d in pieces])
    targets = np.concatenate([d[1:] for d in pieces])
    owner = np.repeat(np.arange(len(pieces)), [len(d) - 1 for d in pieces])
    num_batches = -(-len(inputs) // batch_tokens)
    padding = num_batches * batch_tokens - len(inputs)
    weights = np.concatenate([np.ones(len(inputs), np.float32), np.zeros(padding, np.float32)])
    inputs, targets = (np.pad(x, (0, padding)) for x in (inputs, targets))
    owner = np.concatenate([owner, np.full(padding, len(pieces))])       # padding: a document of its own
    shape = (num_batches, batch_tokens)
    boundaries = [_segment_starts(row) for row in owner.reshape(shape)]
    most = max(len(b) for b in boundaries)
    cu_seqlens = np.stack([np.concatenate([b, np.full(most + 1 - len(b), batch_tokens)]) for b in boundaries])
    return PackedBatches(inputs.reshape(shape).astype(np.int32), targets.reshape(shape).astype(np.int32),
                         weights.reshape(shape), cu_seqlens.astype(np.int32))


def _segment_starts(owner: np.ndarray) -> np.ndarray:
    """Where each run of one document begins in a batch's row of owners (0 first)."""
    return np.concatenate([[0], np.flatnonzero(owner[1:] != owner[:-1]) + 1])
