"""Generate tokens from a `recurrax.nn.LanguageModel` with `recurrax.generation.generate`.

`generate` takes any model with a cache (its protocol: `generation_cache`, `prefill`,
`decode_step`, `vocab_size`). It prefills the ragged prompts as one packed batch
(`cu_seqlens`) into a pool of cache slots, then advances every slot one token per step, so
each generated token costs the same whatever the length so far; a finished sequence's slot
takes the next waiting prompt.

The script checks the cache against the parallel forward: a greedy run of `generate` must
pick, at every step, the best token of one parallel forward over the prompt plus the tokens
generated before it (so repeated greedy parallel forwards would produce the same tokens).
It prints the largest shortfall of a chosen token's logit below the best one as `max logit
shortfall (generate vs parallel)` and exits non-zero when it exceeds `--tolerance`. The
model is untrained (random weights): the point is the mechanics.

    python examples/generate.py
    python examples/generate.py --new-tokens 4 --prompt-len 8 --batch-size 2   # a smoke run
"""

from __future__ import annotations

import argparse
import sys
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from recurrax.nn import MIXERS, LanguageModel
from recurrax.generation import generate


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=4, help="prompts (of lengths 1 to --prompt-len)")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens of the longest prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt")
    parser.add_argument("--num-slots", type=int, default=None, help="sequences decoded at once (default: all, at most 8)")
    parser.add_argument("--vocab-size", type=int, default=64, help="vocabulary size")
    parser.add_argument("--d-model", type=int, default=64, help="model width")
    parser.add_argument("--num-layers", type=int, default=2, help="number of blocks")
    parser.add_argument("--num-heads", type=int, default=4, help="attention heads per mixer")
    parser.add_argument("--mixer", default="gla", choices=list(MIXERS), help="token mixer of every block")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the printed run (0: greedy)")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="largest accepted logit shortfall")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    args = parser.parse_args(argv)

    grouped = (dict(num_v_heads=2 * args.num_heads) if args.mixer == "gated_deltanet"  # grouped value heads
               else dict(num_kv_heads=max(1, args.num_heads // 2)))                    # grouped key/value heads
    model = LanguageModel(args.vocab_size, args.d_model, args.num_layers, args.num_heads, mixer=args.mixer,
                          mixer_options=dict(grouped, conv_size=4), rngs=nnx.Rngs(args.seed))
    rng = np.random.default_rng(args.seed)
    lengths = [args.prompt_len] + rng.integers(1, args.prompt_len + 1, args.batch_size - 1).tolist()
    prompts = [rng.integers(0, args.vocab_size, n).tolist() for n in lengths]   # ragged token-id lists

    started = time.perf_counter()
    sampled = generate(model, prompts, args.new_tokens, temperature=args.temperature, seed=args.seed,
                       num_slots=args.num_slots)                                 # compiles, then runs
    first = time.perf_counter() - started
    started = time.perf_counter()
    greedy = generate(model, prompts, args.new_tokens, num_slots=args.num_slots)  # compiled already
    second = time.perf_counter() - started
    new_tokens = sum(map(len, greedy))

    # Every greedy token must be the best of one parallel forward over what came before it;
    # one forward of all rows, right-padded (a causal model's logits at t ignore what follows).
    rows = np.zeros((len(prompts), max(lengths) + args.new_tokens), np.int32)
    for row, (prompt, generated) in enumerate(zip(prompts, greedy)):
        rows[row, : len(prompt) + len(generated)] = prompt + generated
    logits = np.asarray(model(jnp.asarray(rows)))                               # [prompts, length, vocab]
    shortfall = 0.0
    for row, (prompt, generated) in enumerate(zip(prompts, greedy)):
        steps = logits[row, len(prompt) - 1 : len(prompt) - 1 + len(generated)]  # before each new token
        chosen = steps[np.arange(len(generated)), generated]
        shortfall = max(shortfall, float(np.max(steps.max(axis=-1) - chosen)))

    for prompt, tokens in list(zip(prompts, sampled))[:2]:
        print(f"prompt {prompt[-8:]} ... -> generated {tokens[:16]}")
    print(f"generate: {len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens, {new_tokens} new tokens in "
          f"{second:.3f} s ({new_tokens / second:,.0f} tokens/s; the first call, compiling, took {first:.1f} s)")
    print(f"max logit shortfall (generate vs parallel) {shortfall:.3e}")
    if shortfall > args.tolerance:
        print(f"FAILED: the shortfall exceeds --tolerance {args.tolerance}", file=sys.stderr)
        sys.exit(1)
    return shortfall


if __name__ == "__main__":
    main()
