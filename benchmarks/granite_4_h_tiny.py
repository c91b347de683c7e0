"""A Granite-4.0-H-tiny-shaped model (Mamba-2 + attention + a 64-expert MoE), recurrax side by side with `transformers`.

    python benchmarks/granite_4_h_tiny.py --torch-python TORCH_PYTHON [--layers 10] [--threads 2]
    python benchmarks/granite_4_h_tiny.py --torch-python TORCH_PYTHON --tiny   # the same steps, tiny model

TORCH_PYTHON is an interpreter of another environment with torch (CPU build) and `transformers`
5.25 (see tests/fixtures/transformers/make_fixtures.py), e.g. `venv-hf/bin/python`.

`transformers`' `granitemoehybrid` in the layer shapes of ibm-granite/granite-4.0-h-tiny
(d_model 1536; Mamba-2 with 48 heads × 64, state 128, one group; attention with 12 heads,
4 KV heads, no position embedding; a MoE of 64 SwiGLU experts of width 512, top-6, plus a
shared expert of width 1024; vocab 100,352, tied), but `--layers` layers (default 10, the
published 9:1 Mamba-2 : attention ratio with attention at layer 5) instead of 40, so that its
float32 weights fit this machine twice (ours and `transformers`'). Random weights, written
with recurrax's `save_pretrained`; then, in one run, for recurrax (JAX; the routed experts,
`recurrax.nn.routed_experts`) and in a subprocess `transformers` (`mamba2_130m_torch.py`:
its pure-PyTorch path, which also runs only the selected experts), float32:
- load time (`from_pretrained` of the directory);
- prefill tokens/s: 8 prompts × 512 tokens in one call, the last position's logits only;
- decode tokens/s at batch 1, 8 and 64: one token per sequence per step through the cache.
Medians of `--repeats` calls (decode: of `--decode-steps` steps) after a warm-up, and the max
logit difference between the two on a check batch `[2, 64]`. Writes
results/granite_4_h_tiny.md and .png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from recurrax.nn.pretrained import CausalLM, save_pretrained
from recurrax.tools.bench.machine import machine_description

from mamba2_130m import BATCHES, figure, ours, spread

GRANITE_4_H_TINY = dict(
    model_type="granitemoehybrid", architectures=["GraniteMoeHybridForCausalLM"], hidden_size=1536,
    num_attention_heads=12, num_key_value_heads=4, position_embedding_type="nope", attention_bias=False,
    num_local_experts=64, num_experts_per_tok=6, intermediate_size=512, shared_intermediate_size=1024,
    mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_expand=2, mamba_d_conv=4,
    mamba_chunk_size=256, mamba_conv_bias=True, mamba_proj_bias=False, vocab_size=100352, tie_word_embeddings=True,
    embedding_multiplier=12.0, logits_scaling=6.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
    rms_norm_eps=1e-5, hidden_act="silu", time_step_limit=[0.0, math.inf], max_position_embeddings=131072,
)
"""ibm-granite/granite-4.0-h-tiny's layer shapes (its layer count set by `layer_types`)."""
TINY = {**GRANITE_4_H_TINY, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "shared_intermediate_size": 48,
        "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16, "vocab_size": 256}
RESULTS = Path(__file__).resolve().parent / "results"


def layer_types(layers: int) -> list[str]:
    """Mamba-2 layers with attention at every tenth from the sixth (Granite-4.0-H's 9:1 pattern)."""
    return ["attention" if i % 10 == 5 else "mamba" for i in range(layers)]


def random_model(config: dict, seed: int = 0) -> CausalLM:
    """Random weights; each Mamba-2 layer's dt_bias and A_log as `transformers` initialises them."""
    model = CausalLM(config, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for block in model.body.layers:
        mixer = getattr(block, "mamba", None) or getattr(block, "mixer", None)
        if not hasattr(mixer, "A_log"):
            continue
        H = mixer.A_log.shape[0]
        dt = np.exp(rng.random(H) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clip(1e-4)
        mixer.dt_bias.set_value(jnp.asarray(dt + np.log(-np.expm1(-dt)), jnp.float32))
        mixer.A_log.set_value(jnp.log(jnp.arange(1, H + 1, dtype=jnp.float32)))
    return model


def report(config: dict, parameters: int, batch: int, length: int, mine: dict, theirs: dict,
           torch_logits: np.ndarray, load_at_start: float) -> tuple[str, dict, dict]:
    """The markdown report and the tokens/s of each side."""
    med = statistics.median
    ours_tps = {"prefill": batch * length / med(mine["prefill"])}
    torch_tps = {"prefill": batch * length / med(theirs["prefill_seconds"])}
    for b in BATCHES:
        ours_tps[f"decode b={b}"] = b / med(mine["decode"][b])
        torch_tps[f"decode b={b}"] = b / med(theirs["decode_seconds"][str(b)])
    machine = machine_description()
    types = config["layer_types"]
    lines = [
        f"# Granite-4.0-H-tiny shape ({len(types)} layers): recurrax vs transformers on this CPU", "",
        f"`python benchmarks/granite_4_h_tiny.py --layers {len(types)}` — {parameters / 1e9:.2f}B parameters "
        f"({types.count('mamba')} Mamba-2 and {types.count('attention')} attention layers, each followed by a MoE of "
        f"{config['num_local_experts']} experts, top-{config['num_experts_per_tok']}, plus a shared expert), "
        f"float32, random weights; {machine['cpu']}, {machine['usable_cpus']} CPUs, load average "
        f"{load_at_start:.1f} at the start and {os.getloadavg()[0]:.1f} at the end (a shared machine: the ratios "
        f"are side by side in one run); JAX {jax.__version__}; torch {theirs['versions']['torch']} with "
        f"{theirs['threads']} threads, transformers {theirs['versions']['transformers']} (pure-PyTorch path); "
        f"commit {machine['commit']}.", "",
        "| measurement | recurrax (JAX) | transformers (PyTorch) | ratio |", "|---|---:|---:|---:|",
        f"| `from_pretrained` | {mine['load']:.2f} s | {theirs['load_seconds']:.2f} s | "
        f"{theirs['load_seconds'] / mine['load']:.1f}× |",
        f"| prefill {batch} × {length}, tokens/s (median; min–max time) | {ours_tps['prefill']:,.0f} "
        f"({spread(mine['prefill'])}) | {torch_tps['prefill']:,.0f} ({spread(theirs['prefill_seconds'])}) | "
        f"**{ours_tps['prefill'] / torch_tps['prefill']:.1f}×** |",
    ]
    for b in BATCHES:
        key = f"decode b={b}"
        lines.append(f"| decode batch {b}, tokens/s (median; min–max step) | {ours_tps[key]:,.0f} "
                     f"({spread(mine['decode'][b])}) | {torch_tps[key]:,.0f} "
                     f"({spread(theirs['decode_seconds'][str(b)])}) | **{ours_tps[key] / torch_tps[key]:.1f}×** |")
    scale = np.abs(torch_logits).max()
    difference = np.abs(mine["logits"] - torch_logits).max()
    lines += ["", f"Logits on a check batch [2, {torch_logits.shape[1]}] (max |logit| {scale:.2f}): recurrax vs "
              f"transformers max absolute difference {difference:.2e} ({difference / scale:.1e} relative)."]
    return "\n".join(lines) + "\n", ours_tps, torch_tps


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--torch-python", required=True,
                        help="an interpreter with torch and transformers 5.25 (runs mamba2_130m_torch.py)")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    config = {**(TINY if args.tiny else GRANITE_4_H_TINY), "layer_types": layer_types(args.layers),
              "num_hidden_layers": args.layers}
    batch, length = (8, 512) if not args.tiny else (2, 16)
    rng = np.random.default_rng(0)
    inputs = dict(prefill=rng.integers(0, config["vocab_size"], (batch, length)),
                  check=rng.integers(0, config["vocab_size"], (2, 64 if not args.tiny else 8)))
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        built = random_model(config)
        parameters = sum(x.size for x in jax.tree.leaves(nnx.state(built, nnx.Param)))
        save_pretrained(built, directory)
        del built
        np.savez(directory / "inputs.npz", **inputs)
        (directory / "floor_shapes.json").write_text(json.dumps(dict(matmuls=[], read_bytes=1 << 26)))
        mine = ours(directory, inputs, args.repeats, args.decode_steps)
        del mine["model"], mine["state"], mine["graphdef"]  # free our weights before transformers loads its own
        jax.clear_caches()
        command = [args.torch_python, str(Path(__file__).with_name("mamba2_130m_torch.py")), str(directory),
                   "--threads", str(args.threads), "--repeats", str(args.repeats),
                   "--decode-steps", str(args.decode_steps)]
        subprocess.run(command, check=True)
        theirs = json.loads((directory / "torch_measurements.json").read_text())
        torch_logits = np.load(directory / "torch_logits.npy")
    text, ours_tps, torch_tps = report(config, parameters, batch, length, mine, theirs, torch_logits, load_at_start)
    print(text)
    if not args.tiny:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "granite_4_h_tiny.md").write_text(text)
        figure(ours_tps, torch_tps, args.out / "granite_4_h_tiny.png",
               f"Granite-4.0-H-tiny shape, {args.layers} layers, float32, this CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
