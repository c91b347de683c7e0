"""Load a local checkpoint (fla or transformers), generate, and report tokens per second.

Reads every family `from_pretrained` reads: fla's models (`recurrax.nn.pretrained.SUPPORTED`,
optionally hybrid with softmax attention), transformers' Mamba-2 model and its hybrids, Qwen3-Next
and Qwen3.5.

    python examples/pretrained.py path/to/checkpoint          # a directory with config.json + *.safetensors
    python examples/pretrained.py                             # the tiny GLA fixture in tests/fixtures/fla

Prefills the prompts as one packed batch (`cu_seqlens`), then decodes them together with
the state cache (`recurrax.generation.generate`). Reports load time, prefill and decode
tokens per second (compilation excluded: a warm-up call runs first). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from recurrax.generation import generate
from recurrax.nn.pretrained import from_pretrained

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "fla" / "gla_basic"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("path", nargs="?", default=str(FIXTURE), help="local checkpoint directory")
    parser.add_argument("--prompts", type=int, default=8, help="prompts decoded together")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="parameter dtype")
    args = parser.parse_args()

    start = time.perf_counter()
    model = from_pretrained(args.path, dtype=jnp.dtype(args.dtype))
    print(f"from_pretrained: {time.perf_counter() - start:.2f} s ({args.path})")
    vocab = model.config["vocab_size"]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(args.prompts)]
    packed = jnp.asarray(np.concatenate(prompts), jnp.int32)
    cu_seqlens = jnp.asarray(np.arange(args.prompts + 1) * args.prompt_len, jnp.int32)

    prefill = jax.jit(lambda tokens, cu: model(tokens, cu_seqlens=cu))
    jax.block_until_ready(prefill(packed, cu_seqlens))  # compile
    start = time.perf_counter()
    jax.block_until_ready(prefill(packed, cu_seqlens))
    seconds = time.perf_counter() - start
    print(f"prefill: {packed.size} tokens in {seconds * 1e3:.1f} ms = {packed.size / seconds:,.0f} tokens/s")

    generate(model, prompts, 2)  # compile the decoder
    start = time.perf_counter()
    outputs = generate(model, prompts, args.new_tokens)
    seconds = time.perf_counter() - start
    made = sum(map(len, outputs))
    print(f"generate (prefill + decode, batch {args.prompts}): {made} new tokens in {seconds:.2f} s = "
          f"{made / seconds:,.0f} tokens/s")
    print("first continuation:", outputs[0][:16])


if __name__ == "__main__":
    main()
