"""A 340M-parameter GLA in fla's configuration on this CPU: load, prefill and decode speed.

    python benchmarks/pretrained_340m.py                  # writes benchmarks/results/pretrained_340m.md
    python benchmarks/pretrained_340m.py --tiny           # the same steps on a tiny model (seconds)

Builds `recurrax.nn.pretrained.CausalLM` from fla's GLA-340M configuration (below) with
random weights, writes it in Hugging Face layout (`save_pretrained`: config.json +
model.safetensors, float32) to a temporary directory, then measures:
- `from_pretrained` time (reading and placing every weight);
- prefill tokens/s: 8 prompts of 512 tokens as one packed batch (`cu_seqlens`), jitted;
- decode tokens/s at batch 8 and 64: one jitted step of one token per sequence with the
  state cache, the median of several steps.
Compilation is excluded (one warm-up call each). With `--keep DIR` the checkpoint stays in
DIR for `pretrained_340m_fla.py` (fla's own model on it); when that has saved fla's logits
there, they are compared with ours and with a float64 run of ours. fla's decode and prefill
on this CPU run under Triton's interpreter, which executes every kernel program in Python:
they measure the interpreter, not fla (see that script).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from recurrax.nn.pretrained import CausalLM, from_pretrained, save_pretrained, size_config
from recurrax.tools.bench.machine import machine_description

from _timing import timed

GLA_340M = size_config("gla-340m")
"""fla's GLA 340M configuration (the `gla_340M` config of fla's training recipes)."""
TINY = {**GLA_340M, "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256}
RESULTS = Path(__file__).resolve().parent / "results" / "pretrained_340m.md"


def median_seconds(fn, repeats: int) -> float:
    return statistics.median(timed(fn, repeats))


def fla_figures(directory: Path | None) -> dict:
    """fla's figures on the same checkpoint (`pretrained_340m_fla.py` leaves them there), or {}."""
    path = None if directory is None else directory / "fla_measurements.json"
    return json.loads(path.read_text()) if path is not None and path.is_file() else {}


def fla_cell(seconds: float | None, tokens: int | None = None) -> str:
    if seconds is None:
        return "not measured (see pretrained_340m_fla.md)"
    return f"{seconds:.2f} s" if tokens is None else f"{tokens / seconds:,.3f} tokens/s ({seconds:,.1f} s per step)"


def fla_cross_check(directory: Path, model) -> list[str]:
    """Our logits vs fla's (`pretrained_340m_fla.py` saves them beside the checkpoint) on the
    same 16 ids, with a float64 run of our model as the yardstick for float32 rounding."""
    ids_file, logits_file = directory / "fla_input_ids_16.npy", directory / "fla_logits_16.npy"
    if not (ids_file.is_file() and logits_file.is_file()):
        return []
    ids, fla = jnp.asarray(np.load(ids_file)), np.load(logits_file).astype(np.float64)
    ours = np.asarray(model(ids), np.float64)
    jax.config.update("jax_enable_x64", True)
    exact = np.asarray(from_pretrained(directory, dtype=jnp.float64)(ids), np.float64)
    jax.config.update("jax_enable_x64", False)
    gap = lambda a, b: float(np.max(np.abs(a - b)))  # noqa: E731
    return [
        "", f"Logits on the same {ids.shape[1]} token ids (max |difference|; logits up to {np.abs(exact).max():.2f}):", "",
        "| pair | max abs difference |", "|---|---:|",
        f"| recurrax float32 vs fla float32 (`{logits_file.name}`) | {gap(ours, fla):.1e} |",
        f"| recurrax float32 vs recurrax float64 | {gap(ours, exact):.1e} |",
        f"| fla float32 vs recurrax float64 | {gap(fla, exact):.1e} |",
    ]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--keep", type=Path, help="write the checkpoint here and keep it (for pretrained_340m_fla.py)")
    args = parser.parse_args(argv)
    config = TINY if args.tiny else GLA_340M
    prompts, prompt_len = (8, 512) if not args.tiny else (2, 16)

    model = CausalLM(config, rngs=nnx.Rngs(0))
    parameters = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.keep or scratch
        save_pretrained(model, directory)
        del model
        start = time.perf_counter()
        model = from_pretrained(directory)
        jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
        load_s = time.perf_counter() - start

    graphdef, state = nnx.split(model)
    vocab = config["vocab_size"]
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, vocab, prompts * prompt_len), jnp.int32)
    cu_seqlens = jnp.asarray(np.arange(prompts + 1) * prompt_len, jnp.int32)
    prefill = jax.jit(lambda state, tokens, cu: nnx.merge(graphdef, state)(tokens, cu_seqlens=cu))
    prefill_s = median_seconds(lambda: prefill(state, tokens, cu_seqlens), args.repeats)

    @jax.jit
    def step(state, token, cache):
        logits, cache = nnx.merge(graphdef, state)(token, cache)
        return jnp.argmax(logits[:, -1], -1), cache

    decode = {}
    for batch in (8, 64):
        cache = model.init_cache(batch)
        token = jnp.asarray(rng.integers(0, vocab, (batch, 1)), jnp.int32)
        decode[batch] = median_seconds(lambda: step(state, token, cache), max(args.repeats, 5))

    machine = machine_description()
    fla = fla_figures(args.keep)
    fla_decode = fla.get("decode_step_s", {})
    lines = [
        "# A 340M GLA (fla's configuration) on this CPU" if not args.tiny else "# Tiny GLA (smoke run)",
        "",
        f"`python benchmarks/pretrained_340m.py{' --tiny' if args.tiny else ''}` — {parameters / 1e6:.1f}M parameters, "
        f"float32; {machine['cpu']}, {machine['usable_cpus']} CPUs; JAX {jax.__version__}; commit {machine['commit']}.",
        "",
        f"Config: `{config}`",
        "",
        "| measurement | recurrax (JAX, CPU) | fla (PyTorch CPU; kernels under Triton's interpreter) |",
        "|---|---:|---:|",
        f"| `from_pretrained` (safetensors, float32) | {load_s:.2f} s | {fla_cell(fla.get('from_pretrained_s'))} |",
        f"| prefill, {prompts} prompts × {prompt_len} tokens packed | {prompts * prompt_len / prefill_s:,.0f} tokens/s "
        f"({prefill_s * 1e3:.0f} ms) | not attempted (interpreter) |",
    ]
    for batch, seconds in decode.items():
        lines.append(f"| decode, batch {batch}, one token per sequence per step | {batch / seconds:,.0f} tokens/s "
                     f"({seconds * 1e3:.1f} ms per step) | {fla_cell(fla_decode.get(str(batch)), batch)} |")
    if args.keep is not None:
        lines += fla_cross_check(args.keep, model)
    lines += ["", "fla's own model on the same checkpoint and CPU: `pretrained_340m_fla.py` "
              "(results/pretrained_340m_fla.md) — its load time compares; its kernels run only under "
              "Triton's interpreter here, so its decode and prefill times measure the interpreter."]
    text = "\n".join(lines) + "\n"
    if not args.tiny:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
