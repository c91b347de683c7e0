"""What remat and the chunked loss save: XLA's temporaries of one training step (loss and
gradients) of a small `recurrax.nn.LanguageModel`, compiled on this CPU, for every `remat`
and both losses (the full-logits cross entropy and `token_losses`, chunked).

    python benchmarks/training_memory.py                # writes results/training_memory.md and .json
    python benchmarks/training_memory.py --seq-len 256 --vocab 1024 --out /tmp/memory   # a smoke run
    python benchmarks/training_memory.py --time 3       # also the step time, median of 3 runs

The step is `jax.value_and_grad` of the mean next-token loss, compiled ahead of time;
`compiled.memory_analysis().temp_size_in_bytes` is what it holds beyond its arguments and
outputs: the activations kept for the backward, the logits, the gradients' scratch. XLA's CPU
compiler schedules buffers without minimising memory, so absolute figures are larger than a
GPU's or TPU's; the ratios between rows are what carries over. Timing compiles again at
XLA's default optimisation level (memory compiles at level 0 to save time: the buffers are
the same) and is only as quiet as the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from recurrax.nn import LanguageModel

REMATS = (None, "block", "dots")
LOSSES = ("full", "chunked")


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per step")
    parser.add_argument("--vocab", type=int, default=32_000, help="vocabulary size")
    parser.add_argument("--d-model", type=int, default=256, help="model width")
    parser.add_argument("--num-layers", type=int, default=4, help="blocks")
    parser.add_argument("--num-heads", type=int, default=4, help="query heads per mixer")
    parser.add_argument("--mixer", default="gla", help="the mixer of every block")
    parser.add_argument("--time", type=int, default=0, help="also time the step: the median of this many runs")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="folder for the results")
    return parser.parse_args(argv)


def step(graphdef, loss: str):
    """`(params, tokens) → (loss, gradients)`: the mean next-token cross entropy."""

    def mean_loss(params, tokens):
        model = nnx.merge(graphdef, params)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if loss == "chunked":
            return model.token_losses(inputs, targets).mean()
        log_probs = jax.nn.log_softmax(model(inputs).astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(log_probs, targets[..., None], axis=-1).mean()

    return jax.jit(jax.value_and_grad(mean_loss))


def measure(args, remat, loss: str) -> dict:
    model = nnx.eval_shape(lambda: LanguageModel(args.vocab, args.d_model, args.num_layers, args.num_heads,
                                                 mixer=args.mixer, remat=remat, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((args.batch_size, args.seq_len + 1), jnp.int32)
    lowered = step(graphdef, loss).lower(params, tokens)
    memory = lowered.compile(compiler_options={"xla_backend_optimization_level": 0}).memory_analysis()
    row = {"remat": remat or "none", "loss": loss, "temp_bytes": int(memory.temp_size_in_bytes),
           "argument_bytes": int(memory.argument_size_in_bytes)}
    if args.time:
        compiled = lowered.compile()
        concrete = nnx.split(LanguageModel(args.vocab, args.d_model, args.num_layers, args.num_heads,
                                           mixer=args.mixer, remat=remat, rngs=nnx.Rngs(0)))[1]
        batch = jax.random.randint(jax.random.key(0), tokens.shape, 0, args.vocab)
        jax.block_until_ready(compiled(concrete, batch))
        times = []
        for _ in range(args.time):
            started = time.perf_counter()
            jax.block_until_ready(compiled(concrete, batch))
            times.append(time.perf_counter() - started)
        row["step_seconds"] = statistics.median(times)
    return row


def table(args, rows: list[dict]) -> str:
    base = next(r["temp_bytes"] for r in rows if r["remat"] == "none" and r["loss"] == "full")
    timed = "step_seconds" in rows[0]
    lines = [f"# Training-step memory: {args.mixer} LanguageModel, d_model {args.d_model}, {args.num_layers} blocks, "
             f"vocab {args.vocab}, {args.batch_size} × {args.seq_len} tokens", "",
             f"XLA temporaries of one `value_and_grad` step on this CPU ({jax.devices()[0].device_kind}); "
             "`python benchmarks/training_memory.py`." + (f" Step time: the median of {args.time} runs "
                                                          "(as quiet as the machine was)." if args.time else ""), "",
             "| remat | loss | temporaries (MiB) | vs none + full |" + (" step (s) |" if timed else ""),
             "|---|---|---:|---:|" + ("---:|" if timed else "")]
    for r in rows:
        line = f"| {r['remat']} | {r['loss']} | {r['temp_bytes'] / 2**20:,.1f} | {r['temp_bytes'] / base:.2f} |"
        lines.append(line + (f" {r['step_seconds']:.3f} |" if timed else ""))
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    args = parse(argv)
    rows = []
    for loss in LOSSES:
        for remat in REMATS:
            rows.append(measure(args, remat, loss))
            print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "training_memory.json").write_text(json.dumps({"arguments": vars(args), "rows": rows}, indent=1) + "\n")
    (out / "training_memory.md").write_text(table(args, rows))
    print(table(args, rows))
    return rows


if __name__ == "__main__":
    main()
