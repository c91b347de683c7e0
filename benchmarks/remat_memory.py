"""What `remat=` saves on this backend: the compiled temporaries (and peak, where the backend
reports it) of one training step of a `recurrax.nn.LanguageModel`, for each `remat`.

    python benchmarks/remat_memory.py                       # 6 GLA blocks, d_model 512, 4,096 tokens
    python benchmarks/remat_memory.py --seq-len 8192 --num-layers 12
    JAX_PLATFORMS=cpu python benchmarks/remat_memory.py     # the CPU's figures on a machine with a chip
    python benchmarks/remat_memory.py --target v5e          # compiled for a TPU v5e by libtpu, no chip
                                                            # needed (extra compile-tpu, Python >= 3.12)

The step is `jax.jit(jax.value_and_grad(loss))` of the mean of `model.token_losses` (the
chunked loss: no `[tokens, vocab]` logits), compiled ahead of time for the default backend,
not run (or, with `--target`, for that chip through `recurrax.targets.compile_for`: the figures
the chip's compiler gives, without the chip); `compiled.memory_analysis()` gives the temporaries (what the step holds beyond its
arguments and outputs) and, on JAX versions that report it, the peak (on a CPU the peak counts
the arguments and outputs only: the temporaries are its figure). Prints one JSON line per
`remat` and a table with each row's ratio to `remat=None`.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from flax import nnx

from recurrax.nn import REMAT_POLICIES, LanguageModel


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per step")
    parser.add_argument("--vocab", type=int, default=32_000, help="vocabulary size")
    parser.add_argument("--d-model", type=int, default=512, help="model width")
    parser.add_argument("--num-layers", type=int, default=6, help="blocks")
    parser.add_argument("--num-heads", type=int, default=4, help="query heads per mixer")
    parser.add_argument("--mixer", default="gla", help="the mixer of every block")
    parser.add_argument("--target", help="compile for this chip instead of the default backend (recurrax.targets: "
                                         "v5e, v6e, h100, ...)")
    return parser.parse_args(argv)


def measure(args, remat: str | None) -> dict:
    """The compiled step's memory for one `remat` (parameters abstract: nothing is allocated)."""
    model = nnx.eval_shape(lambda: LanguageModel(args.vocab, args.d_model, args.num_layers, args.num_heads,
                                                 mixer=args.mixer, remat=remat, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(model)

    def mean_loss(params, tokens):
        return nnx.merge(graphdef, params).token_losses(tokens[:, :-1], tokens[:, 1:]).mean()

    tokens = jax.ShapeDtypeStruct((args.batch_size, args.seq_len + 1), jnp.int32)
    step = jax.value_and_grad(mean_loss)
    if args.target:
        from recurrax import targets

        memory = targets.compile_for(args.target, step, params, tokens).memory()
    else:
        memory = jax.jit(step).lower(params, tokens).compile().memory_analysis()
    peak = getattr(memory, "peak_memory_in_bytes", None)
    return {"remat": remat or "none", "temp_mib": memory.temp_size_in_bytes / 2**20,
            "peak_mib": None if peak is None else peak / 2**20,
            "argument_mib": memory.argument_size_in_bytes / 2**20}


def main(argv=None) -> list[dict]:
    args = parse(argv)
    device = jax.devices()[0]
    where = f"compiled for {args.target} (no chip)" if args.target else f"{device.platform} ({device.device_kind})"
    print(f"# {args.mixer} LanguageModel, {args.num_layers} blocks, d_model {args.d_model}, vocab {args.vocab}, "
          f"{args.batch_size} × {args.seq_len} tokens; {where}, JAX {jax.__version__}")
    rows = []
    for remat in (None, *REMAT_POLICIES):
        rows.append(measure(args, remat))
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]
    print("\n| remat | temporaries (MiB) | vs none | peak (MiB) | vs none |\n|---|---:|---:|---:|---:|")
    for row in rows:
        peak = "n/a | n/a" if row["peak_mib"] is None else f"{row['peak_mib']:,.1f} | {row['peak_mib'] / base['peak_mib']:.2f}"
        print(f"| {row['remat']} | {row['temp_mib']:,.1f} | {row['temp_mib'] / base['temp_mib']:.2f} | {peak} |")
    return rows


if __name__ == "__main__":
    main()
