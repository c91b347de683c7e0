"""A Qwen3.5-0.8B-shaped model (Gated DeltaNet + gated attention), recurrax side by side with `transformers`.

    python benchmarks/qwen3_5.py --torch-python TORCH_PYTHON [--layers 8] [--threads 2]
    python benchmarks/qwen3_5.py --tiny [--torch-python TORCH_PYTHON]   # the same steps, tiny model

TORCH_PYTHON is an interpreter of another environment with torch (CPU build) and `transformers`
5.25 (see tests/fixtures/transformers/make_fixtures.py), e.g. `venv-hf/bin/python`; without
one (or with one that does not exist) the `transformers` side is reported as not run.

`transformers`' `qwen3_5_text` (`Qwen3_5ForCausalLM`) in the layer shapes of the text model of
Qwen/Qwen3.5-0.8B, the smallest published Qwen3.5 (d_model 1024; Gated DeltaNet with 16 key
and 16 value heads of 128, a 4-tap short convolution; gated attention with 8 heads and 2 KV heads
of 256, a quarter of each rotated, θ = 10⁷; SwiGLU MLP of width 3584; vocab 248,320, tied), but
`--layers` layers (default 8: the published pattern, three Gated DeltaNet layers then one
attention layer, twice) instead of 24, so that one run of both sides stays near ten minutes on
two cores. Random weights, written with recurrax's `save_pretrained`; then, in one run, for
recurrax (JAX) and in a subprocess `transformers` (`mamba2_130m_torch.py`: its pure-PyTorch
path, its chunked gated delta rule in PyTorch since `fla` is absent), float32:
- load time (`from_pretrained` of the directory);
- prefill tokens/s: 8 prompts × 512 tokens in one call, the last position's logits only;
- decode tokens/s at batch 1, 8 and 64: one token per sequence per step through the cache.
Medians of `--repeats` calls (decode: of `--decode-steps` steps) after a warm-up (`ours` and
`spread` of mamba2_130m.py); the max logit difference on a check batch `[2, 64]` against
`transformers` and against a float64 run of ours; where our time goes (`_qwen3_5_parts.py`);
and this CPU's floors (`_floors.py` and the torch side, as mamba2_130m.py reports them): the
least time a prefill (its FLOPs at the measured matmul rates) and a decode step (the bytes it
must read, or its FLOPs if slower) can take, and our time over them. Writes
results/qwen3_5.md and .png (`--tiny`: only where `--out` says).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from recurrax.nn.pretrained import CausalLM, save_pretrained
from recurrax.tools.bench.machine import machine_description

from _floors import matmul_gflops, read_gbps
from _qwen3_5_parts import part_seconds
from delta_rule import MODEL_CHUNK, forward_flops
from mamba2_130m import BATCHES, figure, float64_logits, floor_lines, floors, ours, parts_table, spread

QWEN3_5_0_8B = dict(
    model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], hidden_size=1024, intermediate_size=3584,
    num_attention_heads=8, num_key_value_heads=2, head_dim=256, attention_bias=False, linear_num_key_heads=16,
    linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    vocab_size=248320, tie_word_embeddings=True, rms_norm_eps=1e-6, hidden_act="silu",
    max_position_embeddings=262144,
    rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25),
)
"""The text model of Qwen/Qwen3.5-0.8B (its `text_config`), its layer count set by `layer_types`."""
TINY = {**QWEN3_5_0_8B, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "vocab_size": 256, "max_position_embeddings": 256}
RESULTS = Path(__file__).resolve().parent / "results"
LOADED = 3.0
"""A load average above which the report says the machine was loaded."""

def layer_types(layers: int) -> list[str]:
    """Gated DeltaNet layers with attention at every fourth (Qwen3.5's `full_attention_interval` 4)."""
    return ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]


def workload(config: dict, batch: int, length: int, parameters: int) -> dict:
    """The prefill's FLOPs per matmul shape ('MxKxN', named in `matmul_names`) and in the mixers (the
    delta rule's chunk forward at C = 64 and causal softmax attention), the bytes a decode step
    must read (every parameter once; per row the delta-rule states and convolution buffers read
    and written) and its FLOPs, in the keys `mamba2_130m.floors` and `floor_lines` read."""
    D, F, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    types = config["layer_types"]
    Lg, La = types.count("linear_attention"), types.count("full_attention")
    Hk, H = config["linear_num_key_heads"], config["linear_num_value_heads"]
    K, V, W = config["linear_key_head_dim"], config["linear_value_head_dim"], config["linear_conv_kernel_dim"]
    Ha, Hkv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    n = batch * length
    channels = 2 * Hk * K + H * V
    matmuls = [("GDN q/k/v", D, channels, Lg), ("GDN z, b, a", D, H * V + 2 * H, Lg), ("GDN out", H * V, D, Lg),
               ("attention q + gate", D, 2 * Ha * d, La), ("attention k, v", D, Hkv * d, 2 * La),
               ("attention o", Ha * d, D, La), ("MLP gate, up", D, F, 2 * (Lg + La)), ("MLP down", F, D, Lg + La),
               ("head", D, vocab, 1)]
    prefill, names = {}, {}
    for name, k, m, count in matmuls:  # shapes that coincide are timed once, under both names
        shape = f"{batch if name == 'head' else n}x{k}x{m}"
        prefill[shape] = prefill.get(shape, 0) + 2 * (batch if name == "head" else n) * k * m * count
        names[shape] = f"{names[shape]}, {name}" if shape in names else name
    delta = forward_flops(batch, length, H, K, V, MODEL_CHUNK) * Lg
    attention = batch * Ha * 2 * 2 * d * (length * (length + 1) // 2) * La
    return dict(prefill_flops=prefill, ssd_flops=delta + attention, delta_flops=delta, attention_flops=attention,
                chunk=MODEL_CHUNK, in_proj=f"{n}x{D}x{channels}", matmul_names=tuple(names.values()),
                param_bytes=4 * parameters, state_bytes=2 * 4 * Lg * (H * K * V + (W - 1) * channels),
                step_flops=2 * parameters,
                mixer_text=f"the mixers (the delta rule's chunk forward at C = {MODEL_CHUNK}, "
                           f"{delta / 1e9:,.0f} GFLOP, and causal softmax attention, {attention / 1e9:,.0f} GFLOP); "
                           "at XLA's measured rates (the mixers at the q/k/v projection's)",
                state_text="the delta-rule states and convolution buffers")


def run_transformers(torch_python: Path | None, directory: Path, threads: int, repeats: int,
                     decode_steps: int) -> tuple[dict | None, np.ndarray | None, str]:
    """`mamba2_130m_torch.py` on the checkpoint in a subprocess: (its measurements, its check
    logits, '') or (None, None, why it did not run)."""
    if torch_python is None:
        return None, None, "no interpreter given (`--torch-python`)"
    if not torch_python.exists():
        return None, None, f"interpreter {torch_python.name} not found"
    command = [str(torch_python), str(Path(__file__).with_name("mamba2_130m_torch.py")), str(directory),
               "--threads", str(threads), "--repeats", str(repeats), "--decode-steps", str(decode_steps)]
    subprocess.run(command, check=True)
    return (json.loads((directory / "torch_measurements.json").read_text()),
            np.load(directory / "torch_logits.npy"), "")


def random_checkpoint(config: dict, directory: Path, batch: int, length: int, tiny: bool) -> tuple[dict, int]:
    """A random `CausalLM(config)` saved in `directory` with the inputs both sides read
    (`inputs.npz`: the `[batch, length]` prompts and a `[2, 64]` check batch, `[2, 8]` tiny);
    returns the inputs and the parameter count."""
    rng = np.random.default_rng(0)
    inputs = dict(prefill=rng.integers(0, config["vocab_size"], (batch, length)),
                  check=rng.integers(0, config["vocab_size"], (2, 64 if not tiny else 8)))
    built = CausalLM(config, rngs=nnx.Rngs(0))
    parameters = sum(x.size for x in jax.tree.leaves(nnx.state(built, nnx.Param)))
    save_pretrained(built, directory)
    np.savez(directory / "inputs.npz", **inputs)
    return inputs, parameters


def write_results(out: Path | None, stem: str, text: str, run: dict, batch: int, length: int, title: str) -> None:
    """`text` as `out/stem.md` and, when `transformers` ran, both sides' tokens/s as `out/stem.png`."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text)
    if run["theirs"] is not None:
        decode = {b: run["theirs"]["decode_seconds"][str(b)] for b in BATCHES}
        figure(tokens_per_second(run["mine"]["prefill"], run["mine"]["decode"], batch, length),
               tokens_per_second(run["theirs"]["prefill_seconds"], decode, batch, length), out / f"{stem}.png", title)


def measure(config: dict, batch: int, length: int, args) -> dict:
    """Both sides on one random checkpoint: ours (with its parts, the XLA floors and a float64
    check), then `transformers` in a subprocess once our weights are freed."""
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        inputs, parameters = random_checkpoint(config, directory, batch, length, args.tiny)
        work = workload(config, batch, length, parameters)
        (directory / "floor_shapes.json").write_text(json.dumps(
            dict(matmuls=list(work["prefill_flops"]), read_bytes=work["param_bytes"])))
        mine = ours(directory, inputs, args.repeats, args.decode_steps)
        parts = {"prefill": part_seconds(mine["model"], batch, length, False, args.repeats)}
        parts.update({b: part_seconds(mine["model"], b, 1, True, args.repeats) for b in BATCHES})
        del mine["model"], mine["state"], mine["graphdef"]  # free our weights before the float64 copy and torch's
        jax.clear_caches()
        xla = dict(matmul_gflops=matmul_gflops([tuple(int(n) for n in key.split("x"))
                                                for key in work["prefill_flops"]], args.repeats),
                   read_gbps=read_gbps(work["param_bytes"], args.repeats))
        exact = float64_logits(directory, inputs["check"])
        jax.clear_caches()
        theirs, torch_logits, not_run = run_transformers(args.torch_python, directory, args.threads, args.repeats,
                                                         args.decode_steps)
    return dict(parameters=parameters, work=work, mine=mine, parts=parts, xla=xla, exact=exact, theirs=theirs,
                torch_logits=torch_logits, not_run=not_run)


def tokens_per_second(prefill: list[float], decode: dict, batch: int, length: int) -> dict:
    med = statistics.median
    return {"prefill": batch * length / med(prefill), **{f"decode b={b}": b / med(decode[b]) for b in BATCHES}}


def speed_rows(mine: dict, theirs: dict | None, batch: int, length: int) -> list[str]:
    """The table's rows: load, prefill and decode of both sides (ours alone when `theirs` is None)."""
    ours_tps = tokens_per_second(mine["prefill"], mine["decode"], batch, length)
    if theirs is None:
        return [f"| `from_pretrained` | {mine['load']:.2f} s | — | — |",
                f"| prefill {batch} × {length}, tokens/s (median; min–max time) | {ours_tps['prefill']:,.0f} "
                f"({spread(mine['prefill'])}) | — | — |"] + [
                f"| decode batch {b}, tokens/s (median; min–max step) | {ours_tps[f'decode b={b}']:,.0f} "
                f"({spread(mine['decode'][b])}) | — | — |" for b in BATCHES]
    torch_decode = {b: theirs["decode_seconds"][str(b)] for b in BATCHES}
    torch_tps = tokens_per_second(theirs["prefill_seconds"], torch_decode, batch, length)
    return [f"| `from_pretrained` | {mine['load']:.2f} s | {theirs['load_seconds']:.2f} s | "
            f"{theirs['load_seconds'] / mine['load']:.1f}× |",
            f"| prefill {batch} × {length}, tokens/s (median; min–max time) | {ours_tps['prefill']:,.0f} "
            f"({spread(mine['prefill'])}) | {torch_tps['prefill']:,.0f} ({spread(theirs['prefill_seconds'])}) | "
            f"**{ours_tps['prefill'] / torch_tps['prefill']:.1f}×** |"] + [
            f"| decode batch {b}, tokens/s (median; min–max step) | {ours_tps[f'decode b={b}']:,.0f} "
            f"({spread(mine['decode'][b])}) | {torch_tps[f'decode b={b}']:,.0f} ({spread(torch_decode[b])}) | "
            f"**{ours_tps[f'decode b={b}'] / torch_tps[f'decode b={b}']:.1f}×** |" for b in BATCHES]


def logit_check(ours: np.ndarray, exact: np.ndarray, theirs: np.ndarray | None) -> str:
    """One sentence: the check batch's max logit differences (ours and theirs against our float64)."""
    scale = np.abs(exact).max()
    check = (f"Logits on a check batch [2, {exact.shape[1]}] (max |logit| {scale:.2f}), max absolute difference: "
             f"recurrax float32 vs recurrax float64 {np.abs(ours - exact).max():.2e}")
    if theirs is not None:
        difference = np.abs(ours - theirs).max()
        check += (f"; transformers float32 vs recurrax float64 {np.abs(theirs - exact).max():.2e}; recurrax "
                  f"vs transformers {difference:.2e} ({difference / scale:.1e} relative)")
    return check + "."


def report(config: dict, batch: int, length: int, run: dict, load_at_start: float) -> str:
    """The markdown report: both sides, the logit check, our parts, the floors and our time over them."""
    med = statistics.median
    mine, theirs, work = run["mine"], run["theirs"], run["work"]
    types = config["layer_types"]
    machine = machine_description()
    if theirs is None:
        torch_side = f"transformers not run: {run['not_run']}"
    else:
        torch_side = (f"torch {theirs['versions']['torch']} with {theirs['threads']} threads, transformers "
                      f"{theirs['versions']['transformers']} (pure-PyTorch path)")
    tiny = config["hidden_size"] < QWEN3_5_0_8B["hidden_size"]
    lines = [
        "# Tiny Qwen3.5 (smoke run)" if tiny else
        f"# Qwen3.5-0.8B shape ({len(types)} layers): recurrax vs transformers on this CPU", "",
        f"`python benchmarks/qwen3_5.py {'--tiny ' if tiny else ''}--layers {len(types)}` — {run['parameters'] / 1e6:,.0f}M parameters "
        f"({types.count('linear_attention')} Gated DeltaNet and {types.count('full_attention')} attention layers, "
        f"each followed by a SwiGLU MLP; the published model has 24), float32, random weights; {machine['cpu']}, "
        f"{machine['usable_cpus']} CPUs, load average {load_at_start:.1f} at the start and "
        f"{os.getloadavg()[0]:.1f} at the end (a machine shared with other jobs: the ratios are side by side in one "
        f"run, each side under the load of its turn); JAX {jax.__version__}; {torch_side}; commit "
        f"{machine['commit']}.", "",
        "| measurement | recurrax (JAX) | transformers (PyTorch) | ratio |", "|---|---:|---:|---:|",
    ]
    load = max(load_at_start, os.getloadavg()[0])
    if load > LOADED:
        lines[4:4] = [f"**A loaded machine** (load average up to {load:.1f} on {machine['usable_cpus']} CPUs): every "
                      "time here is slowed and noisy, the matmul rates and bandwidth below included; the parts, "
                      "timed at other moments than the whole calls, may sum to more than them. Only the side-by-side "
                      "ratios and the ratios to floors measured in the same run mean much.", ""]
    lines += speed_rows(mine, theirs, batch, length)
    lines += ["", logit_check(mine["logits"], run["exact"], run["torch_logits"] if theirs is not None else None)]
    decode = {b: med(mine["decode"][b]) for b in BATCHES}
    lines += parts_table(run["parts"], med(mine["prefill"]), decode, batch, length, len(types),
                         how="`_qwen3_5_parts.py`: each part of a layer jitted and timed alone, times the layers that "
                             "have it; the head once; the rest is the whole call's median minus the parts: the glue "
                             "between them — splits, the β and g gates, residuals, cache writes, argmax — and "
                             "dispatch")
    lines += floor_report(work, run["xla"], theirs, med(mine["prefill"]), decode, batch, length)
    return "\n".join(lines) + "\n"


def floor_report(work: dict, xla: dict, theirs: dict | None, prefill: float, decode: dict, batch: int,
                 length: int) -> list[str]:
    """Markdown: the floors (`mamba2_130m.floor_lines` when transformers ran) and our time over them."""
    read = xla["read_gbps"] if theirs is None else max(xla["read_gbps"], theirs["floors"]["read_gbps"])
    ours_floor = floors(work, xla["matmul_gflops"], read, prefill, decode)  # "ratio" here: our time over the floor
    lines = floor_lines(work, xla, theirs, batch, length) if theirs is not None else [
        "", f"This CPU's floors for XLA (float32, medians): matmul GFLOP/s "
        + ", ".join(f"{name} {xla['matmul_gflops'][shape]:.0f}" for shape, name in zip(work["prefill_flops"], work["matmul_names"]))
        + f"; streaming read {xla['read_gbps']:.1f} GB/s."]
    lines += ["", f"- recurrax over its floor: prefill {prefill:.2f} s against {ours_floor['prefill']:.2f} s "
              f"(**{ours_floor['prefill_ratio']:.2f}×**); decode "
              + "; ".join(f"b={b} {decode[b] * 1e3:,.1f} ms against {ours_floor['decode'][b] * 1e3:,.1f} ms "
                          f"(**{ours_floor['decode_ratio'][b]:.2f}×**)" for b in BATCHES)
              + " (the issue's goal: prefill within 1.5×, every decode step within 1.3×)."]
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--torch-python", type=Path,
                        help="an interpreter with torch and transformers 5.25 (runs mamba2_130m_torch.py)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    config = {**(TINY if args.tiny else QWEN3_5_0_8B), "layer_types": layer_types(args.layers),
              "num_hidden_layers": args.layers}
    batch, length = (8, 512) if not args.tiny else (2, 16)
    load_at_start = os.getloadavg()[0]
    run = measure(config, batch, length, args)
    text = report(config, batch, length, run, load_at_start)
    print(text)
    write_results(args.out or (None if args.tiny else RESULTS), "qwen3_5", text, run, batch, length,
                  f"Qwen3.5-0.8B shape, {args.layers} layers, float32, this CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
