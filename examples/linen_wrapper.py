"""Use recurrax's Flax NNX layers inside a Flax linen model (`flax.nnx.bridge.to_linen`).

`bridge.to_linen(NNXClass, *args, **kwargs)` makes a linen submodule that builds the NNX
layer on `init` (its parameters land in the linen `params` collection, under the
submodule's name) and runs it on `apply`; linen passes it the `params` rng stream. The rest
is ordinary linen: `model.init`, `jax.jit(model.apply)`, `jax.grad` of a loss of `apply`.

The script checks that the wrapped layer computes exactly what the NNX layer computes with
the same parameters (it loads the linen parameters into an NNX layer), prints `max error`
and a gradient norm, and exits non-zero on a mismatch.

    python examples/linen_wrapper.py
    python examples/linen_wrapper.py --seq-len 8 --d-model 16    # a smoke run
"""

from __future__ import annotations

import argparse
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import bridge

from recurrax.nn import GatedLinearAttention


class Classifier(nn.Module):
    """Embed tokens, mix them with a recurrax layer, classify each sequence from its last token."""

    d_model: int
    num_heads: int
    num_classes: int = 4
    vocab_size: int = 32

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:            # [B, T] ids → [B, num_classes]
        x = nn.Embed(self.vocab_size, self.d_model)(tokens)
        mixer = bridge.to_linen(GatedLinearAttention, self.d_model, num_heads=self.num_heads, conv_size=2,
                                name="mixer")
        x = x + mixer(x)                                            # the NNX layer, as a linen submodule
        return nn.Dense(self.num_classes)(nn.RMSNorm()(x[:, -1]))


class GatedLinearAttentionApply(nn.Module):
    """The wrapped layer alone, under the same submodule name, to compare with NNX."""

    d_model: int
    num_heads: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return bridge.to_linen(GatedLinearAttention, self.d_model, num_heads=self.num_heads, conv_size=2,
                               name="mixer")(x)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per batch")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--d-model", type=int, default=32, help="model width")
    parser.add_argument("--num-heads", type=int, default=2, help="attention heads per mixer")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest accepted difference from the reference")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    args = parser.parse_args(argv)

    model = Classifier(args.d_model, args.num_heads)
    tokens = jax.random.randint(jax.random.key(args.seed), (args.batch_size, args.seq_len), 0, model.vocab_size)
    labels = jnp.arange(args.batch_size) % model.num_classes
    variables = model.init(jax.random.key(args.seed + 1), tokens)
    params = variables["params"]
    print("parameters of the wrapped layer:", sorted(params["mixer"]))

    logits = jax.jit(model.apply)({"params": params}, tokens)      # [B, num_classes]

    def loss_fn(params):
        logits = model.apply({"params": params}, tokens)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1).mean()

    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    mixer_grad_norm = float(jnp.sqrt(sum((g**2).sum() for g in jax.tree.leaves(grads["mixer"]))))
    print(f"loss {float(loss):.4f}; gradient norm of the wrapped layer's parameters {mixer_grad_norm:.3e}")

    # The same layer as plain NNX, loaded with the linen parameters: identical outputs.
    abstract = nnx.eval_shape(lambda: GatedLinearAttention(args.d_model, num_heads=args.num_heads, conv_size=2,
                                                           rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, nn.unbox(params["mixer"]))
    layer = nnx.merge(graphdef, state)
    x = jax.random.normal(jax.random.key(args.seed + 2), (args.batch_size, args.seq_len, args.d_model))
    wrapped = GatedLinearAttentionApply(args.d_model, args.num_heads).apply({"params": {"mixer": params["mixer"]}}, x)
    error = float(jnp.abs(wrapped - layer(x)).max())
    print(f"max error, linen-wrapped vs NNX layer: {error:.3e}")
    print(f"logits {logits.shape}, finite: {bool(jnp.isfinite(logits).all())}")
    if error > args.tolerance or not mixer_grad_norm > 0 or not jnp.isfinite(logits).all():
        print("FAILED", file=sys.stderr)
        sys.exit(1)
    return error


if __name__ == "__main__":
    main()
