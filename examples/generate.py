"""Generate tokens with the decode cache: one parallel prefill, then one token at a time.

`LanguageModel(tokens, cache=model.init_cache(batch))` runs the prompt through every block
in parallel and returns each block's recurrent state; every later call feeds one token and
advances the states, so each generated token costs the same whatever the length so far.

The script checks the cache against the parallel forward: the logits of the decoded
tokens must equal those of one parallel call over the prompt plus the generated tokens. It
prints that difference as `max abs logit difference` and exits non-zero when it exceeds
`--tolerance`. The model is untrained (random weights): the point is the mechanics. Pass
`--temperature 0` for greedy decoding.

    python examples/generate.py
    python examples/generate.py --new-tokens 4 --prompt-len 8 --batch-size 2   # a smoke run
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from recurrax.nn import LanguageModel


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per batch")
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per sequence")
    parser.add_argument("--vocab-size", type=int, default=64, help="vocabulary size")
    parser.add_argument("--d-model", type=int, default=64, help="model width")
    parser.add_argument("--num-layers", type=int, default=2, help="number of blocks")
    parser.add_argument("--num-heads", type=int, default=4, help="attention heads per mixer")
    parser.add_argument("--mixer", default="gla", choices=["gla", "retnet", "lightning", "linear"], help="token mixer of every block")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="largest accepted difference from the reference")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    args = parser.parse_args(argv)

    model = LanguageModel(args.vocab_size, args.d_model, args.num_layers, args.num_heads, mixer=args.mixer,
                          mixer_options=dict(num_kv_heads=max(1, args.num_heads // 2), conv_size=4),
                          rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model)
    key, prompt_key = jax.random.split(jax.random.key(args.seed))
    prompt = jax.random.randint(prompt_key, (args.batch_size, args.prompt_len), 0, args.vocab_size)

    @jax.jit
    def prefill(params, prompt):
        model = nnx.merge(graphdef, params)
        return model(prompt, cache=model.init_cache(prompt.shape[0]))   # logits [B, P, vocab], cache

    @jax.jit
    def decode(params, token, cache):
        return nnx.merge(graphdef, params)(token, cache=cache)         # token [B, 1] → logits [B, 1, vocab]

    def sample(key, logits):                                            # logits [B, vocab] → [B, 1]
        if args.temperature == 0:
            return jnp.argmax(logits, -1)[:, None]
        return jax.random.categorical(key, logits / args.temperature)[:, None]

    logits, cache = prefill(params, prompt)
    key, sample_key = jax.random.split(key)
    token = sample(sample_key, logits[:, -1])
    generated, step_logits = [token], []
    started = None
    for step in range(args.new_tokens - 1):
        if step == 1:                                                   # time from the second step on:
            started = time.perf_counter()                               # the first one compiles `decode`
        logits, cache = decode(params, token, cache)
        step_logits.append(logits[:, 0])
        key, sample_key = jax.random.split(key)
        token = sample(sample_key, logits[:, 0])
        generated.append(token)
    jax.block_until_ready(token)
    timed_steps = args.new_tokens - 2
    elapsed = time.perf_counter() - started if started is not None else 0.0
    generated = jnp.concatenate(generated, axis=1)                      # [B, new_tokens]

    # The same logits from one parallel forward over the prompt and the generated tokens.
    everything = jnp.concatenate([prompt, generated], axis=1)
    parallel = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))(params, everything)
    difference = 0.0
    if step_logits:
        decoded = jnp.stack(step_logits, axis=1)                        # logits after generated[:, :-1]
        expected = parallel[:, args.prompt_len : args.prompt_len + args.new_tokens - 1]
        difference = float(jnp.max(jnp.abs(decoded - expected)))

    for row in range(min(args.batch_size, 2)):
        print(f"prompt {prompt[row, -8:].tolist()} ... -> generated {generated[row, :16].tolist()}")
    if timed_steps > 0:
        print(f"decoded {timed_steps} steps of batch {args.batch_size} in {elapsed:.3f} s after the first "
              f"({timed_steps * args.batch_size / elapsed:,.0f} tokens/s)")
    print(f"max abs logit difference (decode vs parallel) {difference:.3e}")
    if difference > args.tolerance:
        print(f"FAILED: the difference exceeds --tolerance {args.tolerance}", file=sys.stderr)
        sys.exit(1)
    return difference


if __name__ == "__main__":
    main()
