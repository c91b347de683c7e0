"""Compile time of a training step or a prefill against depth, layers scanned (`scan_layers=True`)
and unrolled.

    python benchmarks/layer_scan_compile.py                      # GLA LanguageModel, 2/8/24 layers, this CPU
    python benchmarks/layer_scan_compile.py --layers 2 8 --mixer gated_deltanet
    python benchmarks/layer_scan_compile.py --program prefill    # the engine's admission of a prompt

The step is `jax.value_and_grad` of the mean `token_losses` of a `recurrax.nn.LanguageModel`
(width `--d-model`, `remat="block"`) on 1 × `--seq-len` tokens; the prefill is `model.prefill` of
`--seq-len` packed tokens (two prompts) into a 2-row `generation_cache`, as `DecodePool` admits
them. Each cell is the cold `lower` + `compile` time (no persistent cache) and the lowered
StableHLO's size in characters.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from recurrax.nn import LanguageModel


def compile_seconds(num_layers: int, scan: bool, args) -> tuple[float, int]:
    model = LanguageModel(256, args.d_model, num_layers, 2, mixer=args.mixer, remat="block", scan_layers=scan,
                          rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens = jnp.zeros((1, args.seq_len + 1), jnp.int32)

    def loss(params):
        return nnx.merge(graphdef, params).token_losses(tokens[:, :-1], tokens[:, 1:]).mean()

    def prefill(params, cache):
        packed = tokens[0, :-1]
        return nnx.merge(graphdef, params).prefill(packed, jnp.asarray([0, args.seq_len // 2, args.seq_len]), cache)

    start = time.perf_counter()
    if args.program == "prefill":
        lowered = jax.jit(prefill).lower(params, model.generation_cache(2))
    else:
        lowered = jax.jit(jax.value_and_grad(loss)).lower(params)
    lowered.compile()
    return time.perf_counter() - start, len(lowered.as_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 24])
    parser.add_argument("--mixer", default="gla")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--program", choices=("step", "prefill"), default="step")
    args = parser.parse_args(argv)
    print(f"{jax.devices()[0].device_kind}, JAX {jax.__version__}, {args.mixer}, d_model {args.d_model}, "
          f"T {args.seq_len}, {args.program}\n\n"
          "| layers | scanned s | unrolled s | scanned HLO chars | unrolled HLO chars |\n|---:|---:|---:|---:|---:|",
          flush=True)
    for num_layers in args.layers:
        (scanned, scanned_size), (unrolled, unrolled_size) = (compile_seconds(num_layers, scan, args)
                                                              for scan in (True, False))
        print(f"| {num_layers} | {scanned:.1f} | {unrolled:.1f} | {scanned_size:,} | {unrolled_size:,} |", flush=True)


if __name__ == "__main__":
    main()
