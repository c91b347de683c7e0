"""`transformers`' side of `delta_rule.py`: its pure-PyTorch chunk functions on the same inputs.

    TORCH_PYTHON benchmarks/delta_rule_torch.py DIR [--threads 2] [--repeats 7] [--max-seconds 30]

Run by `delta_rule.py` (not on its own): reads DIR/spec.json and DIR/inputs_<variant>.npz, writes
DIR/transformers.json (versions, samples) and DIR/transformers_<variant>.npz (output, final
state, gradients). GDN: `torch_chunk_gated_delta_rule` (models/qwen3_next); KDA:
`chunk_kimi_delta_attention` (models/kimi_linear); both with `use_qk_l2norm_in_kernel=True`,
chunk 64, float32, `torch.set_num_threads(threads)`. Forward under `torch.inference_mode()`;
fwd+bwd: the forward with inputs requiring gradients, then `backward` of
<output, d_output> + <final, d_final>.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

import transformers

NAMES = ("query", "key", "value", "beta", "decay")


def functions() -> dict:
    """Variant -> (qualified name, function), for the variants this transformers has."""
    found = {}
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

        found["gdn"] = ("qwen3_next.torch_chunk_gated_delta_rule", torch_chunk_gated_delta_rule)
    except ImportError:
        pass
    try:
        from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

        found["kda"] = ("kimi_linear.chunk_kimi_delta_attention", chunk_kimi_delta_attention)
    except ImportError:
        pass
    return found


def call(function, tensors: dict):
    return function(tensors["query"], tensors["key"], tensors["value"], tensors["decay"], tensors["beta"],
                    chunk_size=64, output_final_state=True, use_qk_l2norm_in_kernel=True)


def samples(fn, repeats: int, max_seconds: float) -> list[float]:
    """Seconds of up to `repeats` calls after a warm-up; stops once `max_seconds` are spent."""
    fn()
    seconds, spent = [], 0.0
    while len(seconds) < repeats and (not seconds or spent < max_seconds):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
        spent += seconds[-1]
    return seconds


def measure(function, arrays: dict, repeats: int, max_seconds: float) -> tuple[dict, dict]:
    """(samples, arrays to save: output, final, d_<input>)."""
    inputs = {n: torch.from_numpy(arrays[n]) for n in NAMES}
    d_output, d_final = torch.from_numpy(arrays["d_output"]), torch.from_numpy(arrays["d_final"])

    def forward():
        with torch.inference_mode():
            return call(function, inputs)

    def forward_backward():
        leaves = {n: x.clone().requires_grad_(True) for n, x in inputs.items()}
        output, final = call(function, leaves)
        ((output * d_output).sum() + (final * d_final).sum()).backward()
        return output, final, leaves

    seconds = {"fwd": samples(forward, repeats, max_seconds), "fwd_bwd": samples(forward_backward, repeats, max_seconds)}
    output, final, leaves = forward_backward()
    saved = dict(output=output.detach().numpy(), final=final.detach().numpy(),
                 **{f"d_{n}": leaves[n].grad.numpy() for n in NAMES})
    return seconds, saved


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--max-seconds", type=float, default=30.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = json.loads((args.directory / "spec.json").read_text())
    available = functions()
    report = dict(versions=dict(torch=torch.__version__, transformers=transformers.__version__),
                  threads=args.threads, variants={})
    for variant in spec["variants"]:
        if variant not in available:
            report["variants"][variant] = {"not_run": f"transformers {transformers.__version__} has no {variant} function"}
            continue
        name, function = available[variant]
        arrays = dict(np.load(args.directory / f"inputs_{variant}.npz"))
        seconds, saved = measure(function, arrays, args.repeats, args.max_seconds)
        np.savez(args.directory / f"transformers_{variant}.npz", **saved)
        report["variants"][variant] = dict(function=name, seconds=seconds)
        print(variant, {mode: min(s) for mode, s in seconds.items()}, file=sys.stderr)
    (args.directory / "transformers.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
