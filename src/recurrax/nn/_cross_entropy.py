"""Next-token cross entropy without the full logits: the head matmul, the log-softmax and
their gradient computed one chunk of positions at a time.

| symbol | meaning                                                               |
|--------|-----------------------------------------------------------------------|
| R, T   | rows (every leading axis but the last, flattened), positions per row  |
| D, V   | hidden width, vocabulary                                              |
| C      | `chunk_size`: positions per row in one chunk                          |
| W      | the head `[D, V]` (or the tied embedding table `[V, D]`, used as Wᵀ)  |
| s      | `logits_scale`                                                        |
| m_t    | 1 where position t counts (`where`, and its target in `[0, V)`), else 0 |

    z_t = s · h_t W                                   [V], accumulated in float32
    ℓ_t = m_t · (logsumexp(z_t) − z_t[y_t])
    backward:  dz_t = dℓ_t · m_t · (softmax(z_t) − onehot(y_t))
               dh_t = s · dz_t Wᵀ,   dW = s · Σ_t h_tᵀ dz_t

The forward keeps `logsumexp(z_t)` (one float per position); the backward recomputes each
chunk's `z` from `h` and `W`. So a step holds `[R, C, V]` logits at a time, never
`[R, T, V]`: at T = 32,768 and V = 32,000 that is 4 GiB of float32 per row less.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

DEFAULT_CHUNK_SIZE = 512
"""Positions per row in one chunk of `chunked_cross_entropy`."""


def chunked_cross_entropy(
    hidden: Float[Array, "... T D"],
    head: Float[Array, "D V"] | Float[Array, "V D"],
    targets: Int[Array, "... T"],
    *,
    where: Bool[Array, "... T"] | None = None,
    tied: bool = False,
    logits_scale: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_predictions: bool = False,
) -> Float[Array, "... T"] | tuple[Float[Array, "... T"], Int[Array, "... T"]]:
    """Per-position cross entropy `logsumexp(z) − z[target]` of the logits `z = s · hidden W`,
    computed `chunk_size` positions at a time (see the module's table): what
    `optax.softmax_cross_entropy_with_integer_labels(hidden @ head * s, targets)` gives,
    without the `[..., T, V]` logits in memory, forward or backward.

    **Arguments:**
    - `hidden`: `[..., T, D]` the head's input (e.g. after the final norm).
    - `head`: `[D, V]` output projection, or with `tied` the embedding table `[V, D]`.
    - `targets`: `[..., T]` token ids; a target outside `[0, V)` (e.g. -100) is ignored.
    - `where`: `[..., T]` booleans, False to ignore a position; None counts every one.
    - `tied`: `head` is an embedding table `[V, D]` (logits `hidden Eᵀ`).
    - `logits_scale`: `s`, a family's logits multiplier (1 for most).
    - `chunk_size`: positions per row in one chunk (the last chunk is padded).
    - `with_predictions`: also return the argmax ids `[..., T]` (no gradient).

    **Returns:** float32 losses `[..., T]` (float64 for float64 inputs), 0 at ignored
    positions, whose gradients flow to `hidden` and `head`; with `with_predictions`,
    `(losses, predictions)`. Reduce them as the task needs, e.g. `losses.sum() / count`.
    """
    if hidden.ndim < 2 or hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden must be [..., seq_len, d_model] and targets [..., seq_len] with the same leading "
                         f"axes, got hidden {hidden.shape} and targets {targets.shape}")
    D = hidden.shape[-1]
    if head.ndim != 2 or head.shape[1 if tied else 0] != D:
        words = "[vocab, d_model] (tied)" if tied else "[d_model, vocab]"
        raise ValueError(f"head must be {words} with d_model = {D}, got shape {head.shape}")
    if where is not None and where.shape != targets.shape:
        raise ValueError(f"where must be shaped like targets {targets.shape}, got {where.shape}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"targets must be integer token ids, got dtype {targets.dtype}")
    V = head.shape[0 if tied else 1]
    counted = (targets >= 0) & (targets < V)
    counted = counted if where is None else counted & where
    lead, T = targets.shape[:-1], targets.shape[-1]
    rows = hidden.reshape(-1, T, D)
    C = max(1, min(chunk_size, T))
    chunks = -(-T // C)
    pad = chunks * C - T

    def to_chunks(x):  # [R, T, ...] → [T/C, R, C, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(x.shape[0], chunks, C, *x.shape[2:]), 1, 0)

    safe_targets = jnp.where(counted, targets, 0).reshape(-1, T)
    losses, predictions = _chunk_losses(to_chunks(rows), head, to_chunks(safe_targets),
                                        to_chunks(counted.reshape(-1, T)), tied, float(logits_scale))

    def from_chunks(x):  # [T/C, R, C] → [..., T]
        return jnp.moveaxis(x, 0, 1).reshape(-1, chunks * C)[:, :T].reshape(*lead, T)

    losses = from_chunks(losses)
    return (losses, from_chunks(predictions)) if with_predictions else losses


def _accumulation_dtype(hidden, head):
    """float32, or float64 when the inputs are float64."""
    return jnp.promote_types(jnp.float32, jnp.result_type(hidden, head))


def _chunk_logits(h, head, tied: bool, scale: float):
    """`s · h W` of one chunk `[R, C, V]` in the accumulation dtype."""
    spec = "rcd,vd->rcv" if tied else "rcd,dv->rcv"
    dtype = jnp.result_type(h, head)
    z = jnp.einsum(spec, h.astype(dtype), head.astype(dtype), preferred_element_type=_accumulation_dtype(h, head))
    return z * scale if scale != 1.0 else z


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _chunk_losses(hidden, head, targets, counted, tied, scale):
    return _forward(hidden, head, targets, counted, tied, scale)[0]


def _forward(hidden, head, targets, counted, tied, scale):
    """`(losses, predictions)` `[T/C, R, C]` and the log-normalisers they need for the backward."""

    def chunk(_, inputs):
        h, y, m = inputs
        z = _chunk_logits(h, head, tied, scale)
        log_normaliser = jax.nn.logsumexp(z, axis=-1)
        picked = jnp.take_along_axis(z, y[..., None], axis=-1)[..., 0]
        return None, (jnp.where(m, log_normaliser - picked, 0), jnp.argmax(z, axis=-1), log_normaliser)

    _, (losses, predictions, log_normalisers) = jax.lax.scan(chunk, None, (hidden, targets, counted))
    return (losses, predictions), log_normalisers


def _chunk_losses_fwd(hidden, head, targets, counted, tied, scale):
    outputs, log_normalisers = _forward(hidden, head, targets, counted, tied, scale)
    return outputs, (hidden, head, targets, counted, log_normalisers)


def _chunk_losses_bwd(tied, scale, residuals, cotangents):
    hidden, head, targets, counted, log_normalisers = residuals
    d_losses = cotangents[0]
    accumulate = _accumulation_dtype(hidden, head)
    dtype = jnp.result_type(hidden, head)

    def chunk(d_head, inputs):
        h, y, m, log_normaliser, d_loss = inputs
        z = _chunk_logits(h, head, tied, scale)
        probabilities = jnp.exp(z - log_normaliser[..., None])
        onehot = jax.nn.one_hot(y, z.shape[-1], dtype=z.dtype)
        dz = (probabilities - onehot) * (jnp.where(m, d_loss, 0) * scale)[..., None]
        dz = dz.astype(dtype)
        dh = jnp.einsum("rcv,vd->rcd" if tied else "rcv,dv->rcd", dz, head.astype(dtype),
                        preferred_element_type=accumulate)
        d_head = d_head + jnp.einsum("rcd,rcv->vd" if tied else "rcd,rcv->dv", h.astype(dtype), dz,
                                     preferred_element_type=accumulate)
        return d_head, dh.astype(hidden.dtype)

    d_head, d_hidden = jax.lax.scan(chunk, jnp.zeros(head.shape, accumulate),
                                    (hidden, targets, counted, log_normalisers, d_losses.astype(accumulate)))
    return d_hidden, d_head.astype(head.dtype), None, None


_chunk_losses.defvjp(_chunk_losses_fwd, _chunk_losses_bwd)
