"""Eager (un-jitted) calls against jitted ones: the cost a notebook user sees.

    python benchmarks/eager.py                     # writes benchmarks/results/eager.md
    python benchmarks/eager.py --out /tmp/eager.md --repeats 5

Measures, in one run side by side:
- `recurrax.recurrent` on `[2, 32, 4, 16]` with a per-head `g`, for `chunk`, `scan` and
  `reference`: the first eager call (compiles), the median of the next eager calls, and the
  median of a jitted call; target: the second eager call within 3× of the jitted one.
- a tiny `recurrax.nn.LanguageModel` (vocab 32, d_model 64, 2 layers, 4 heads, GLA) on
  `[2, 32]` tokens: the first eager forward and the median of the next ones; target: under
  50 ms after the first call.
Works on any recurrax with the same public API (run it on an older checkout with
PYTHONPATH to get the "before" figures).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import recurrax

RESULTS = Path(__file__).resolve().parent / "results" / "eager.md"


def seconds(fn) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def recurrent_row(implementation: str, repeats: int) -> dict:
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (2, 32, 4, 16)) for key in keys[:3])
    g = jax.nn.log_sigmoid(jax.random.normal(keys[3], (2, 32, 4)))
    eager = lambda: recurrax.recurrent(q, k, v, g=g, implementation=implementation)  # noqa: E731
    jitted_fn = jax.jit(lambda q, k, v, g: recurrax.recurrent(q, k, v, g=g, implementation=implementation))
    first = seconds(eager)
    later = statistics.median(seconds(eager) for _ in range(repeats))
    seconds(lambda: jitted_fn(q, k, v, g))
    jitted = statistics.median(seconds(lambda: jitted_fn(q, k, v, g)) for _ in range(repeats))
    return dict(what=f"recurrent, {implementation}", first=first, eager=later, jitted=jitted)


def model_row(repeats: int) -> dict:
    from flax import nnx

    from recurrax.nn import LanguageModel

    model = LanguageModel(vocab_size=32, d_model=64, num_layers=2, num_heads=4, mixer="gla", rngs=nnx.Rngs(0))
    tokens = jnp.zeros((2, 32), jnp.int32)
    first = seconds(lambda: model(tokens))
    later = statistics.median(seconds(lambda: model(tokens)) for _ in range(repeats))
    return dict(what="LanguageModel forward (vocab 32, d 64, 2 layers, [2, 32])", first=first, eager=later, jitted=None)


def markdown(rows: list[dict], repeats: int) -> str:
    ms = lambda x: "—" if x is None else f"{1e3 * x:.2f}"  # noqa: E731
    lines = [
        "# Eager calls vs jitted calls",
        "",
        f"`python benchmarks/eager.py --repeats {repeats}` — recurrax {recurrax.__version__}, JAX {jax.__version__}, "
        f"Python {platform.python_version()}, {platform.machine()}; medians of {repeats} calls after the first.",
        "",
        "| call | first eager call, ms | later eager calls, ms | jitted call, ms | eager / jitted |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        ratio = "—" if row["jitted"] is None else f"{row['eager'] / row['jitted']:.1f}×"
        lines.append(f"| {row['what']} | {ms(row['first'])} | {ms(row['eager'])} | {ms(row['jitted'])} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rows = [recurrent_row(name, args.repeats) for name in ("chunk", "scan", "reference")]
    rows.append(model_row(args.repeats))
    text = markdown(rows, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
