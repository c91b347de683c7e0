"""`transformers`' side of `mamba2_130m.py` (and `granite_4_h_tiny.py`, `qwen3_5.py`): its own model on the same checkpoint.

    TORCH_PYTHON benchmarks/mamba2_130m_torch.py DIR [--threads 2] [--repeats 3]

Run by `mamba2_130m.py`, `granite_4_h_tiny.py` and `qwen3_5.py` (not on its own): reads DIR (config.json + model.safetensors,
written by recurrax's `save_pretrained`), DIR/inputs.npz and DIR/floor_shapes.json, writes
DIR/torch_measurements.json and DIR/torch_logits.npy. Also this CPU's floors for torch: float32
`F.linear` GFLOP/s at the model's matmul shapes and the GB/s of a `sum` over as many bytes as
the weights. PyTorch on the CPU, pure-PyTorch path (`mamba_ssm` and
`causal_conv1d` absent), float32, `torch.set_num_threads(threads)`, inference mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import transformers


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def decode_samples(model, batch: int, steps: int, vocab: int) -> list[float]:
    """Seconds per one-token step at `batch`, after a 4-token prefill through the cache."""
    generator = torch.Generator().manual_seed(batch)
    prompt = torch.randint(0, vocab, (batch, 4), generator=generator)
    out = model(input_ids=prompt, use_cache=True)
    cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    samples = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        out = model(input_ids=token, cache=cache, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        samples.append(time.perf_counter() - start)
    return samples[1:]  # the first step is the warm-up


def floors(shapes: dict, repeats: int) -> dict:
    """GFLOP/s of `F.linear` per 'MxKxN' shape (median), GB/s of one streaming `sum`."""
    rates = {}
    for key in shapes["matmuls"]:
        M, K, N = (int(n) for n in key.split("x"))
        x, w = torch.randn(M, K), torch.randn(N, K)
        rates[key] = 2 * M * K * N / statistics.median(timed(lambda: torch.nn.functional.linear(x, w), repeats)) / 1e9
    data = torch.ones(shapes["read_bytes"] // 4)
    read = data.numel() * 4 / statistics.median(timed(lambda: data.sum(), repeats)) / 1e9
    return dict(matmul_gflops=rates, read_gbps=read)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    inputs = np.load(args.directory / "inputs.npz")
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.directory, dtype=torch.float32).eval()
    load_seconds = time.perf_counter() - start
    vocab = model.config.vocab_size
    with torch.inference_mode():
        check = torch.from_numpy(inputs["check"])
        np.save(args.directory / "torch_logits.npy", model(input_ids=check, use_cache=False).logits.float().numpy())
        prompts = torch.from_numpy(inputs["prefill"])
        prefill = timed(lambda: model(input_ids=prompts, use_cache=False, logits_to_keep=1), args.repeats)
        decode = {b: decode_samples(model, b, args.decode_steps, vocab) for b in (1, 8, 64)}
        floor = floors(json.loads((args.directory / "floor_shapes.json").read_text()), args.repeats)
    report = dict(load_seconds=load_seconds, prefill_seconds=prefill, prefill_tokens=int(prompts.numel()),
                  decode_seconds={str(b): s for b, s in decode.items()}, floors=floor, threads=args.threads,
                  versions=dict(torch=torch.__version__, transformers=transformers.__version__))
    (args.directory / "torch_measurements.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(dict(load=load_seconds, prefill=statistics.median(prefill),
                          decode={b: statistics.median(s) for b, s in decode.items()})))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
