"""Packed variable-length batches: several sequences in one token axis, split by `cu_seqlens`.

Instead of padding sequences of different lengths to a common `[batch, seq_len]`, lay their
tokens end to end (`[total_tokens, ...]`) and pass the boundaries `cu_seqlens = [0, n_0,
n_0 + n_1, ..., total_tokens]`. No state crosses a boundary: the result equals running each
sequence on its own, which this script checks, for `recurrax.recurrent` (outputs, final
states, and gradients) and for a `recurrax.nn.GatedLinearAttention` layer. Empty sequences
are allowed. It prints one `max error` line per check and exits non-zero when one exceeds
`--tolerance`.

    python examples/packed_batches.py
    python examples/packed_batches.py --lengths 5,0,11 --heads 2 --head-dim 8   # a smoke run
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import recurrax


def boundaries(lengths: list[int]) -> jax.Array:
    """`cu_seqlens` for sequences of these lengths: [0, n_0, n_0 + n_1, ...]."""
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def check_recurrent(lengths: list[int], heads: int, head_dim: int, seed: int) -> dict[str, float]:
    """Packed `recurrax.recurrent` against one call per sequence: outputs, states, gradients."""
    total = sum(lengths)
    ks = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (jax.random.normal(key, (total, heads, head_dim)) for key in ks[:3])
    gk = jax.nn.log_sigmoid(jax.random.normal(ks[3], (total, heads, head_dim)))    # per-key-channel decay
    cu = boundaries(lengths)

    out, state = recurrax.recurrent(q, k, v, gk=gk, cu_seqlens=cu)              # [N, H, V], [S, H, K, V]
    errors = {"output": 0.0, "final state": 0.0}
    for s, (start, stop) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if start == stop:                                                         # an empty sequence keeps
            errors["final state"] = max(errors["final state"], float(jnp.abs(state[s]).max()))  # its zero state
            continue
        piece = lambda x: x[None, start:stop]                                     # noqa: E731  [1, n, H, D]
        o_s, state_s = recurrax.recurrent(piece(q), piece(k), piece(v), gk=piece(gk))
        errors["output"] = max(errors["output"], float(jnp.abs(out[start:stop] - o_s[0]).max()))
        errors["final state"] = max(errors["final state"], float(jnp.abs(state[s] - state_s[0]).max()))

    # Gradients, under jit, with cu_seqlens traced: one compiled function serves any boundaries.
    def packed_loss(q, k, v, gk, cu):
        o, final = recurrax.recurrent(q, k, v, gk=gk, cu_seqlens=cu)
        return (o**2).sum() + final.sum()

    spans = [(start, stop) for start, stop in zip(cu[:-1].tolist(), cu[1:].tolist()) if start < stop]

    def separate_loss(q, k, v, gk):
        total_loss = 0.0
        for start, stop in spans:                                                 # Python ints: static slices
            o, final = recurrax.recurrent(q[None, start:stop], k[None, start:stop], v[None, start:stop],
                                          gk=gk[None, start:stop])
            total_loss = total_loss + (o**2).sum() + final.sum()
        return total_loss

    packed_grads = jax.jit(jax.grad(packed_loss, argnums=(0, 1, 2, 3)))(q, k, v, gk, cu)
    separate_grads = jax.jit(jax.grad(separate_loss, argnums=(0, 1, 2, 3)))(q, k, v, gk)
    scale = max(float(jnp.abs(g).max()) for g in separate_grads)
    errors["gradients (relative)"] = max(
        float(jnp.abs(a - b).max()) for a, b in zip(packed_grads, separate_grads)) / max(scale, 1.0)
    return errors


def check_layer(lengths: list[int], heads: int, head_dim: int, seed: int) -> float:
    """A `GatedLinearAttention` layer (with its short convolution) on packed input vs per sequence."""
    from flax import nnx

    from recurrax.nn import GatedLinearAttention

    d_model = heads * head_dim
    layer = GatedLinearAttention(d_model, num_heads=heads, conv_size=4, rngs=nnx.Rngs(seed))
    x = jax.random.normal(jax.random.key(seed + 1), (sum(lengths), d_model))
    cu = boundaries(lengths)
    packed = layer(x, cu_seqlens=cu)                                              # [N, d_model]
    error = 0.0
    for start, stop in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if start < stop:
            alone = layer(x[None, start:stop])[0]                                 # [n, d_model]
            error = max(error, float(jnp.abs(packed[start:stop] - alone).max()))
    return error


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--lengths", default="37,0,100,5,114", help="comma-separated sequence lengths")
    parser.add_argument("--heads", type=int, default=4, help="heads")
    parser.add_argument("--head-dim", type=int, default=16, help="key and value head dimension")
    parser.add_argument("--no-layer", action="store_true", help="skip the flax layer check")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="largest accepted difference from the reference")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]

    total, shape = sum(lengths), (sum(lengths), args.heads, args.head_dim)
    chosen = recurrax.kernel_registry.select(*(jnp.zeros(shape),) * 3, gk=jnp.zeros(shape), cu_seqlens=boundaries(lengths))
    print(f"{len(lengths)} sequences of {lengths} tokens packed into {total}; recurrent runs {chosen.name}")
    errors = {f"recurrent {name}": value for name, value in
              check_recurrent(lengths, args.heads, args.head_dim, args.seed).items()}
    if not args.no_layer:
        errors["GatedLinearAttention output"] = check_layer(lengths, args.heads, args.head_dim, args.seed)
    for name, value in errors.items():
        print(f"max error, packed vs per sequence, {name}: {value:.3e}")
    worst = max(errors.values())
    if worst > args.tolerance:
        print(f"FAILED: {worst:.3e} exceeds --tolerance {args.tolerance}", file=sys.stderr)
        sys.exit(1)
    print("packed == per sequence")
    return errors


if __name__ == "__main__":
    main()
