"""Train a language model on a plain-text file, save it as a checkpoint directory and sample from it.

    pip install 'recurrax[pretrained,examples]'
    python examples/train_text.py my_text.txt --output my_model            # tiny GLA, 300 steps
    recurrax generate my_model --prompt "Once upon a time"

The text is split into documents (`--split paragraph`: blank-line separated; `line`: one per
line); `--validation-fraction` of them (at least one) are held out. The tokenizer is a
checkpoint directory's (`--tokenizer DIR`, its tokenizer.json) or, by default, a byte-level
BPE of `--vocab-size` tokens trained on the training documents with `tokenizers`; each
document ends with the end-of-sequence token, so the model learns where text stops.
Documents are packed into batches of `--batch-tokens` tokens (`recurrax.nn.pack_documents`)
whose `cu_seqlens` keep them apart: no token sees another document. The model is a named size
(`recurrax.nn.pretrained.SIZES`: tiny, small, gla-340m, mamba2-130m) with the tokenizer's
vocabulary; optax's AdamW with linear warmup, cosine decay and gradient clipping trains it.

It prints `validation loss X at step N` every `--eval-every` steps and at the end (the mean
cross entropy per token, nats, of the held-out documents), saves the model with
`save_pretrained` and the tokenizer files beside it (`recurrax generate DIR` reads them),
and prints `--sample-tokens` of text continuing `--prompt`. At the end of training it prints the
rate (tokens/s, and the MFU on a chip whose peak `recurrax.nn.PEAK_FLOPS` knows). It computes in
`recurrax.nn.training_dtype()` (bfloat16 on a TPU or GPU, float32 on a CPU; `--dtype` to
choose; parameters stay float32) and keeps compiled programs in JAX's persistent cache
(`recurrax.use_compilation_cache`; `--no-compilation-cache` to compile afresh).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from recurrax import use_compilation_cache
from recurrax.nn import MIXERS, pack_documents, parameter_count, training_dtype, training_throughput
from recurrax.generation import generate_text, load_tokenizer
from recurrax.nn.pretrained import SIZES, from_size, save_pretrained

END_OF_TEXT = "<|endoftext|>"
"""The byte-level tokenizer's one special token: the end of a document."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
"""A checkpoint's tokenizer files that are copied beside the trained model (those it has)."""


def split_documents(text: str, split: str) -> list[str]:
    """The non-empty documents of `text`: blank-line separated paragraphs, or lines."""
    pieces = text.splitlines() if split == "line" else text.replace("\r\n", "\n").split("\n\n")
    return [piece.strip() for piece in pieces if piece.strip()]


def write_byte_level_tokenizer(documents: list[str], vocab_size: int, directory: str) -> None:
    """A byte-level BPE of `vocab_size` tokens (the 256 bytes, `END_OF_TEXT`, merges) trained on
    `documents`, written as tokenizer.json + tokenizer_config.json into `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents, trainer)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": END_OF_TEXT, "bos_token": None, "pad_token": END_OF_TEXT}, f, indent=2)


def copy_tokenizer(source: str, directory: str) -> None:
    """The tokenizer files of checkpoint `source` (tokenizer.json required) into `directory`."""
    if not os.path.isfile(os.path.join(source, "tokenizer.json")):
        raise SystemExit(f"--tokenizer {source!r}: no tokenizer.json there")
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(directory, name))
    generation = os.path.join(source, "generation_config.json")  # eos ids load_tokenizer reads
    if os.path.isfile(generation):
        shutil.copyfile(generation, os.path.join(directory, "generation_config.json"))


def encode_documents(tokenizer, documents: list[str]) -> list[list[int]]:
    """Each document's ids, followed by the first end-of-sequence id (where there is one)."""
    end = list(tokenizer.eos_token_ids[:1])
    return [tokenizer.encode(document) + end for document in documents]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("text", help="a UTF-8 text file to train on")
    parser.add_argument("--output", default="trained_model", help="checkpoint directory to write")
    parser.add_argument("--tokenizer", help="a checkpoint directory whose tokenizer.json to use "
                        "(default: a byte-level BPE trained on the text)")
    parser.add_argument("--vocab-size", type=int, default=512, help="the byte-level BPE's vocabulary (>= 257)")
    parser.add_argument("--split", choices=("paragraph", "line"), default="paragraph",
                        help="documents are blank-line separated paragraphs, or lines")
    parser.add_argument("--size", choices=list(SIZES), default="tiny", help="named model size")
    parser.add_argument("--mixer", choices=list(MIXERS), help="token mixer of a LanguageModel size "
                        "(tiny, small; default: the size's, gla)")
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--batch-tokens", type=int, default=1024, help="tokens per packed batch")
    parser.add_argument("--learning-rate", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, help="linear warmup steps (default: a tenth of --steps)")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's weight decay")
    parser.add_argument("--clip-norm", type=float, default=1.0, help="gradients clipped to this global norm")
    parser.add_argument("--validation-fraction", type=float, default=0.1, help="documents held out for validation")
    parser.add_argument("--eval-every", type=int, default=100, help="validation loss every this many steps")
    parser.add_argument("--prompt", default="", help="text the sample continues")
    parser.add_argument("--sample-tokens", type=int, default=100, help="tokens sampled at the end (0: none)")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0: greedy)")
    parser.add_argument("--remat", choices=("none", "block", "dots"), default="none",
                        help="what the backward keeps of each block (recurrax.nn.LanguageModel's remat)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (split, batch order, initialisation)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="computation dtype, parameters float32 (auto: bfloat16 on a TPU or GPU, float32 on a CPU)")
    parser.add_argument("--no-compilation-cache", action="store_true", help="no persistent compilation cache")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_tokens < 1 or args.eval_every < 1:
        parser.error("--steps, --batch-tokens and --eval-every must be positive")
    if not 0 < args.validation_fraction < 1:
        parser.error("--validation-fraction must be between 0 and 1")
    if args.tokenizer is None and args.vocab_size < 257:
        parser.error("--vocab-size must be at least 257 (the 256 bytes and the end-of-text token)")
    if args.mixer is not None and SIZES[args.size]["model_type"] != SIZES["tiny"]["model_type"]:
        parser.error(f"--mixer applies to the LanguageModel sizes (tiny, small), not {args.size}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not args.no_compilation_cache:
        use_compilation_cache()                  # a second run reads its compiled programs from disk
    with open(args.text, encoding="utf-8") as f:
        documents = split_documents(f.read(), args.split)
    if len(documents) < 2:
        raise SystemExit(f"{args.text}: {len(documents)} document(s); training and validation need at least 2 "
                         f"(--split {args.split})")
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(documents))
    held_out = max(1, round(args.validation_fraction * len(documents)))
    validation = [documents[i] for i in order[:held_out]]
    training = [documents[i] for i in order[held_out:]]

    os.makedirs(args.output, exist_ok=True)
    if args.tokenizer is None:
        write_byte_level_tokenizer(training, args.vocab_size, args.output)
    else:
        copy_tokenizer(args.tokenizer, args.output)
    tokenizer = load_tokenizer(args.output)
    train_batches = pack_documents(encode_documents(tokenizer, training), args.batch_tokens)
    validation_batches = pack_documents(encode_documents(tokenizer, validation), args.batch_tokens)
    print(f"{len(training)} training documents ({int(train_batches.weights.sum())} tokens, {len(train_batches)} "
          f"batches of {args.batch_tokens}), {len(validation)} validation documents "
          f"({int(validation_batches.weights.sum())} tokens); vocabulary {tokenizer.vocab_size}", flush=True)

    overrides = {} if args.mixer is None else {"mixer": args.mixer}
    dtype = training_dtype() if args.dtype == "auto" else jnp.dtype(args.dtype)
    model = from_size(args.size, vocab_size=tokenizer.vocab_size, remat=None if args.remat == "none" else args.remat,
                      dtype=dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(args.seed), **overrides)
    graphdef, params = nnx.split(model)          # a pure function of `params` from here on
    warmup = args.steps // 10 if args.warmup_steps is None else args.warmup_steps
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.learning_rate, warmup, max(args.steps, warmup + 1),
                                                  end_value=args.learning_rate / 10)
    optimizer = optax.chain(optax.clip_by_global_norm(args.clip_norm),
                            optax.adamw(schedule, weight_decay=args.weight_decay))
    opt_state = optimizer.init(params)

    def summed_loss(params, batch):
        """Σ weight · cross entropy over a packed batch, and Σ weight (the tokens it counts);
        `token_losses` never holds the [N, vocab] logits."""
        losses = nnx.merge(graphdef, params).token_losses(batch.inputs, batch.targets, where=batch.weights > 0,
                                                          cu_seqlens=batch.cu_seqlens)          # [N]
        return (losses * batch.weights).sum(), batch.weights.sum()

    @jax.jit
    def train_step(params, opt_state, batch):
        def mean_loss(params):
            total, count = summed_loss(params, batch)
            return total / count

        loss, grads = jax.value_and_grad(mean_loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    evaluate_batch = jax.jit(summed_loss)

    def validation_loss(params) -> float:
        sums = [evaluate_batch(params, validation_batches.batch(i)) for i in range(len(validation_batches))]
        return float(sum(total for total, _ in sums) / sum(count for _, count in sums))

    losses, train_seconds = [], 0.0
    print(f"validation loss {validation_loss(params):.4f} at step 0", flush=True)
    batch_order = []
    progress = tqdm(range(1, args.steps + 1), desc="training", unit="step", disable=args.no_progress)
    for step in progress:
        if not batch_order:                      # a new pass over the training batches, shuffled
            batch_order = list(rng.permutation(len(train_batches)))
        step_started = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state, train_batches.batch(batch_order.pop()))
        losses.append(float(loss))
        if step > 1:                             # the first step compiles: the rate counts the others
            train_seconds += time.perf_counter() - step_started
        progress.set_postfix(loss=f"{losses[-1]:.3f}")
        if step % args.eval_every == 0 or step == args.steps:
            tqdm.write(f"step {step:4d} loss {losses[-1]:.4f}")
            tqdm.write(f"validation loss {validation_loss(params):.4f} at step {step}")
    print(f"trained {args.steps} steps", flush=True)
    if args.steps > 1:
        rate = training_throughput((args.steps - 1) * args.batch_tokens, train_seconds, parameter_count(model))
        print(f"training rate {rate}", flush=True)

    model = nnx.merge(graphdef, params)
    save_pretrained(model, args.output)
    with open(os.path.join(args.output, "generation_config.json"), "w") as f:   # the eos ids, for generate
        json.dump({"eos_token_id": list(tokenizer.eos_token_ids)}, f, indent=2)
    print(f"saved to {args.output} (recurrax generate {args.output} --prompt ...)", flush=True)
    prompt = tokenizer.encode(args.prompt) if args.prompt else list(tokenizer.eos_token_ids[:1])  # a new document
    if args.sample_tokens and prompt:
        sample = generate_text(model, tokenizer, prompt, args.sample_tokens, temperature=args.temperature,
                               seed=args.seed)
        print(f"sample: {args.prompt}{sample}")
    return dict(losses=losses, model=model, tokenizer=tokenizer)


if __name__ == "__main__":
    main()
