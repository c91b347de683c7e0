"""A Kimi-Linear-shaped model (KDA, MLA, routed experts), recurrax side by side with `transformers`.

    python benchmarks/kimi_linear.py --torch-python TORCH_PYTHON [--layers 4] [--experts 16]
    python benchmarks/kimi_linear.py --tiny [--torch-python TORCH_PYTHON]   # the same steps, tiny model

TORCH_PYTHON is an interpreter of another environment with torch (CPU build) and `transformers`
5.25 (as for `qwen3_5.py`); without one the `transformers` side is reported as not run.

`transformers`' `kimi_linear` (`KimiLinearForCausalLM`) in the layer shapes of
moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json (d_model 2304; KDA with 32 heads of 128
and a 4-tap short convolution on q, k and v; NoPE multi-head latent attention with 32 heads, a
512-wide latent, q/k heads of 128 + 64, v heads of 128; the first layer a dense SwiGLU MLP of
width 9216, the others sigmoid-routed experts of width 1024, 8 per token, renormalised and
scaled by 2.446, plus one shared expert; vocab 163,840, untied head), but `--layers` layers
(default 4: the published pattern's first four, three KDA then one MLA) and `--experts`
routed experts (default 16 instead of 256: the weights of 256 would not fit this machine's
memory twice). Random weights, written with recurrax's `save_pretrained`; then, in one run,
recurrax (JAX) and in a subprocess `transformers` (`mamba2_130m_torch.py`: its pure-PyTorch
path, its chunked KDA in PyTorch since `fla` is absent), float32:
- load time (`from_pretrained` of the directory);
- prefill tokens/s: 8 prompts × 512 tokens in one call, the last position's logits only;
- decode tokens/s at batch 1, 8 and 64: one token per sequence per step through the cache.
Medians as in `qwen3_5.py`; the max logit difference on a check batch `[2, 64]` against
`transformers` and against a float64 run of ours. No floors or parts here (`qwen3_5.py` and
`mamba2_130m.py` have them): with routed experts the bytes a decode step reads depend on the
routing. Writes results/kimi_linear.md and .png (`--tiny`: only where `--out` says).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import jax

from recurrax.tools.bench.machine import machine_description

from mamba2_130m import BATCHES, float64_logits, ours
from qwen3_5 import LOADED, logit_check, random_checkpoint, run_transformers, speed_rows, write_results

KIMI_LINEAR_48B_A3B = dict(
    model_type="kimi_linear", architectures=["KimiLinearForCausalLM"], vocab_size=163840, hidden_size=2304,
    intermediate_size=9216, moe_intermediate_size=1024, num_experts=256, num_experts_per_token=8,
    num_shared_experts=1, num_expert_group=1, topk_group=1, moe_renormalize=True, routed_scaling_factor=2.446,
    moe_router_activation_func="sigmoid", moe_layer_freq=1, first_k_dense_replace=1, num_attention_heads=32,
    num_key_value_heads=32, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, mla_use_nope=True, hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False,
    model_max_length=1048576, linear_attn_config=dict(head_dim=128, num_heads=32, short_conv_kernel_size=4),
    bos_token_id=163584, eos_token_id=163586, pad_token_id=163839,
)
"""moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json (its 27-layer pattern: MLA at layers
4, 8, …, 24 and 27, 1-indexed), without the layer lists, which `config` sets."""
TINY = {**KIMI_LINEAR_48B_A3B, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
        "moe_intermediate_size": 16, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "model_max_length": 256,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "linear_attn_config": dict(head_dim=16, num_heads=4, short_conv_kernel_size=4)}
RESULTS = Path(__file__).resolve().parent / "results"


def config(base: dict, layers: int, experts: int) -> dict:
    """`base` with `layers` layers (MLA at every fourth, as published) and `experts` routed experts."""
    full = [i for i in range(1, layers + 1) if i % 4 == 0]
    lists = dict(kda_layers=[i for i in range(1, layers + 1) if i not in full], full_attn_layers=full)
    return {**base, "num_hidden_layers": layers, "num_experts": experts,
            "num_experts_per_token": min(base["num_experts_per_token"], experts),
            "linear_attn_config": {**base["linear_attn_config"], **lists}}


def measure(config: dict, batch: int, length: int, args) -> dict:
    """Both sides on one random checkpoint: ours and a float64 check, then `transformers` in a
    subprocess once our weights are freed."""
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        inputs, parameters = random_checkpoint(config, directory, batch, length, args.tiny)
        expert = (batch * length, config["hidden_size"], config["moe_intermediate_size"])
        (directory / "floor_shapes.json").write_text(json.dumps(dict(matmuls=["x".join(map(str, expert))],
                                                                     read_bytes=4 * parameters)))
        mine = ours(directory, inputs, args.repeats, args.decode_steps)
        del mine["model"], mine["state"], mine["graphdef"]
        jax.clear_caches()
        exact = float64_logits(directory, inputs["check"])
        jax.clear_caches()
        theirs, torch_logits, not_run = run_transformers(args.torch_python, directory, args.threads, args.repeats,
                                                         args.decode_steps)
    return dict(parameters=parameters, mine=mine, exact=exact, theirs=theirs, torch_logits=torch_logits,
                not_run=not_run)


def report(config: dict, batch: int, length: int, run: dict, load_at_start: float, tiny: bool) -> str:
    med = statistics.median
    mine, theirs = run["mine"], run["theirs"]
    layers, experts = config["num_hidden_layers"], config["num_experts"]
    mla = len(config["linear_attn_config"]["full_attn_layers"])
    machine = machine_description()
    torch_side = (f"transformers not run: {run['not_run']}" if theirs is None else
                  f"torch {theirs['versions']['torch']} with {theirs['threads']} threads, transformers "
                  f"{theirs['versions']['transformers']} (pure-PyTorch path)")
    load = max(load_at_start, os.getloadavg()[0])
    lines = [
        "# Tiny Kimi Linear (smoke run)" if tiny else
        f"# Kimi-Linear-48B-A3B shape ({layers} layers, {experts} experts): recurrax vs transformers on this CPU", "",
        f"`python benchmarks/kimi_linear.py {'--tiny ' if tiny else ''}--layers {layers} --experts {experts}` — "
        f"{run['parameters'] / 1e6:,.1f}M parameters ({layers - mla} KDA and {mla} MLA layers; the first layer's "
        f"MLP dense, the others {experts} routed experts, {config['num_experts_per_token']} per token, and a shared "
        f"one; the published model has 27 layers and 256 experts), float32, random weights; {machine['cpu']}, "
        f"{machine['usable_cpus']} CPUs, load average {load_at_start:.1f} at the start and "
        f"{os.getloadavg()[0]:.1f} at the end; JAX {jax.__version__}; {torch_side}; commit {machine['commit']}.", "",
    ]
    if load > LOADED:
        lines += [f"**A loaded machine** (load average up to {load:.1f}): only the side-by-side ratios mean much.", ""]
    lines += ["| measurement | recurrax (JAX) | transformers (PyTorch) | ratio |", "|---|---:|---:|---:|"]
    lines += speed_rows(mine, theirs, batch, length)
    lines += ["", logit_check(mine["logits"], run["exact"], run["torch_logits"] if theirs is not None else None)]
    lines += ["", "Decode step medians: " + "; ".join(
        f"b={b} {med(mine['decode'][b]) * 1e3:,.1f} ms" for b in BATCHES) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--torch-python", type=Path,
                        help="an interpreter with torch and transformers 5.25 (runs mamba2_130m_torch.py)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    chosen = config(TINY if args.tiny else KIMI_LINEAR_48B_A3B, args.layers, args.experts)
    batch, length = (8, 512) if not args.tiny else (2, 16)
    load_at_start = os.getloadavg()[0]
    run = measure(chosen, batch, length, args)
    text = report(chosen, batch, length, run, load_at_start, args.tiny)
    print(text)
    write_results(args.out or (None if args.tiny else RESULTS), "kimi_linear", text, run, batch, length,
                  f"Kimi-Linear-48B-A3B shape, {args.layers} layers, {args.experts} experts, float32, this CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
