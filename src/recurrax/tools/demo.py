"""`recurrax demo`: train a small recurrent-attention model on associative recall, on the CPU.

Trains `recurrax.nn.LanguageModel` on multi-query associative recall (see `mqar.py`),
reports held-out query accuracy per mixer, decodes held-out sequences token by token with
the state cache and checks them against the parallel forward, reports decode tokens/s,
and writes a loss/accuracy plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from recurrax._extras import require

from .mqar import HELD_OUT, TRAIN, MQARBatch, MQARConfig, mqar_batch, split_key
from .options import add_compilation_cache_option, start_compilation_cache



def mixer_names() -> tuple[str, ...]:
    """The token mixers the demo can train: `recurrax.nn.MIXERS` (needs the `demo` extra)."""
    from recurrax.nn import MIXERS

    return tuple(MIXERS)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Model and optimisation settings of one training run.

    **Arguments:**
    - `task`: the MQAR task.
    - `mixer`: a name of `recurrax.nn.MIXERS` (`"gla"`, `"retnet"`, `"lightning"`, `"linear"`,
      `"gated_deltanet"`).
    - `d_model`, `num_layers`, `num_heads`, `mlp_ratio`: the model.
    - `conv_size`: taps of the mixers' short convolution over q, k, v (0 for none); it lets
      one layer see the previous token, which associative recall needs.
    - `steps`, `batch_size`, `learning_rate`, `warmup`, `weight_decay`: the optimisation
      (AdamW, linear warmup then cosine decay).
    - `seed`: model initialisation and data streams.
    - `dtype`: the computation dtype (`"float32"` or `"bfloat16"`); the parameters and the
      optimiser state are float32 either way (mixed precision with `"bfloat16"`).
    """

    task: MQARConfig = MQARConfig()
    mixer: str = "gla"
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 2
    mlp_ratio: int = 2
    conv_size: int = 2
    steps: int = 400
    batch_size: int = 32
    learning_rate: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.01
    seed: int = 0
    dtype: str = "float32"


@dataclasses.dataclass
class History:
    """What a training run recorded, for the summary and the plot."""

    mixer: str
    steps: list[int] = dataclasses.field(default_factory=list)
    loss: list[float] = dataclasses.field(default_factory=list)
    accuracy: list[float] = dataclasses.field(default_factory=list)
    eval_steps: list[int] = dataclasses.field(default_factory=list)
    eval_accuracy: list[float] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    eval_seconds: float = 0.0  # of `seconds`, in the held-out evaluations
    parameters: int = 0

    def throughput(self, tokens_per_step: int):
        """The training steps' rate (`recurrax.nn.Throughput`), the evaluations' time left out."""
        from recurrax.nn import training_throughput

        return training_throughput(self.steps[-1] * tokens_per_step, self.seconds - self.eval_seconds, self.parameters)


def build_model(config: TrainConfig):
    """A fresh `LanguageModel` for `config`."""
    from flax import nnx

    from recurrax.nn import LanguageModel

    return LanguageModel(
        config.task.vocab_size, config.d_model, config.num_layers, config.num_heads,
        mixer=config.mixer, mlp_ratio=config.mlp_ratio, mixer_options={"conv_size": config.conv_size},
        dtype=jnp.dtype(config.dtype), param_dtype=jnp.float32, rngs=nnx.Rngs(config.seed),
    )


def masked_loss_and_accuracy(logits: Float[Array, "B T vocab"], batch: MQARBatch) -> tuple[Array, Array]:
    """Cross-entropy and accuracy of next-token predictions at the query positions only."""
    import optax

    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch.targets)
    weights = batch.mask.astype(jnp.float32)
    count = jnp.maximum(weights.sum(), 1.0)
    correct = (jnp.argmax(logits, -1) == batch.targets).astype(jnp.float32)
    return (losses * weights).sum() / count, (correct * weights).sum() / count


def make_functions(model, config: TrainConfig):
    """The model split into `(graphdef, params)`, the optimiser state, and jitted `train_step` and `evaluate`.

    Both draw their MQAR batch inside the jitted function from the PRNG key they are given.
    """
    import optax
    from flax import nnx

    graphdef, params = nnx.split(model)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, min(config.warmup, max(config.steps - 1, 1)), max(config.steps, 2),
        end_value=config.learning_rate * 0.05,
    )
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=config.weight_decay))

    def loss_fn(params, batch):  # the chunked loss: the [B, T, vocab] logits are never held whole
        losses, predictions = nnx.merge(graphdef, params).token_losses(batch.tokens, batch.targets, where=batch.mask,
                                                                       with_predictions=True)
        weights = batch.mask.astype(jnp.float32)
        count = jnp.maximum(weights.sum(), 1.0)
        return losses.sum() / count, ((predictions == batch.targets) * weights).sum() / count

    @jax.jit
    def train_step(params, opt_state, key: PRNGKeyArray):
        batch = mqar_batch(key, config.batch_size, config.task)
        (loss, accuracy), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, accuracy

    @jax.jit
    def evaluate(params, key: PRNGKeyArray):
        return loss_fn(params, mqar_batch(key, config.batch_size, config.task))

    return graphdef, params, optimizer.init(params), train_step, evaluate


def train(config: TrainConfig, *, eval_batches: int = 4, evals: int = 10, progress: bool = True,
          announce_compiling: bool = True):
    """Train a fresh model on MQAR; returns `(graphdef, params, history, evaluate)`.

    **Arguments:**
    - `config`: what to train and how.
    - `eval_batches`: held-out batches per evaluation.
    - `evals`: how many evaluations along the run (for the plot).
    - `progress`: show a tqdm progress bar with loss and accuracy.
    - `announce_compiling`: print a line while compiling, with its time (independent of
      `progress`: `recurrax demo --no-progress` keeps it).
    """
    graphdef, params, opt_state, train_step, evaluate = make_functions(build_model(config), config)
    train_key, held_out_key = split_key(config.seed, TRAIN), split_key(config.seed, HELD_OUT)
    train_step, evaluate = _compiled(train_step, evaluate, params, opt_state, train_key, announce_compiling)
    held_out = lambda params: held_out_accuracy(evaluate, params, held_out_key, eval_batches)  # noqa: E731
    history = History(config.mixer, parameters=sum(leaf.size for leaf in jax.tree.leaves(params)))
    eval_every = max(config.steps // max(evals, 1), 1)
    bar = _progress_bar(config, progress)
    start = time.perf_counter()
    for step in range(1, config.steps + 1):
        params, opt_state, loss, accuracy = train_step(params, opt_state, jax.random.fold_in(train_key, step))
        if step % 10 == 0 or step == config.steps:
            history.steps.append(step)
            history.loss.append(float(loss))
            history.accuracy.append(float(accuracy))
            bar.set_postfix(loss=f"{history.loss[-1]:.3f}", acc=f"{history.accuracy[-1]:.3f}")
        if step % eval_every == 0 or step == config.steps:
            jax.block_until_ready(params)  # the training steps before it count as training
            evaluating = time.perf_counter()
            history.eval_steps.append(step)
            history.eval_accuracy.append(held_out(params))
            history.eval_seconds += time.perf_counter() - evaluating
        bar.update(1)
    bar.close()
    history.seconds = time.perf_counter() - start
    return graphdef, params, history, evaluate


def _compiled(train_step, evaluate, params, opt_state, key, announce: bool):
    """Both functions compiled ahead of time, so that the progress bar's rate (and its ETA)
    counts training alone; the compile time is announced on its own line."""
    if announce:
        print("compiling the training step and the evaluation...", end="", file=sys.stderr, flush=True)
    start = time.perf_counter()
    train_step = train_step.lower(params, opt_state, key).compile()
    evaluate = evaluate.lower(params, key).compile()
    if announce:
        print(f" {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return train_step, evaluate


def held_out_accuracy(evaluate: Callable, params, held_out_key: PRNGKeyArray, batches: int) -> float:
    """Mean query accuracy over `batches` fixed held-out batches."""
    return float(np.mean([float(evaluate(params, jax.random.fold_in(held_out_key, i))[1]) for i in range(batches)]))


def _progress_bar(config: TrainConfig, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=config.steps, desc=f"train {config.mixer}", disable=not enabled, file=sys.stderr,
                dynamic_ncols=True, mininterval=0.5)


@dataclasses.dataclass
class DecodeReport:
    """Token-by-token decoding of held-out sequences against the parallel forward."""

    max_abs_diff: float
    tolerance: float
    accuracy: float
    tokens_per_second: float
    batch_size: int

    @property
    def matches(self) -> bool:
        return self.max_abs_diff <= self.tolerance


def decode_check(graphdef, params, config: TrainConfig, batch_size: int = 64, repeats: int = 3) -> DecodeReport:
    """Decode held-out sequences one token at a time with the state cache.

    Compares the logits with the parallel forward's, scores the decoded query predictions
    and times the decoding loop: a jitted one-token step called from Python, as a server
    would, timed over `repeats` passes after a warm-up pass (the fastest pass counts).

    **Arguments:**
    - `graphdef`, `params`: the trained model, split by `flax.nnx.split`.
    - `config`: its training configuration (task and seed of the held-out split).
    - `batch_size`: sequences decoded together; `repeats`: timed passes.
    """
    from flax import nnx

    batch = mqar_batch(jax.random.fold_in(split_key(config.seed, HELD_OUT), 10_000), batch_size, config.task)
    parallel = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))(params, batch.tokens)

    @jax.jit
    def step(params, token, cache):
        logits, cache = nnx.merge(graphdef, params)(token[:, None], cache=cache)
        return logits[:, 0], cache

    empty_cache = nnx.merge(graphdef, params).init_cache(batch_size)
    _decode_all(step, params, batch.tokens, empty_cache)  # compile and warm up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        decoded = _decode_all(step, params, batch.tokens, empty_cache)
        seconds.append(time.perf_counter() - start)
    scale = max(1.0, float(jnp.max(jnp.abs(parallel))))
    _, accuracy = masked_loss_and_accuracy(decoded, batch)
    return DecodeReport(
        max_abs_diff=float(jnp.max(jnp.abs(decoded - parallel))),
        tolerance=decode_tolerance(config.dtype) * scale,
        accuracy=float(accuracy),
        tokens_per_second=batch.tokens.size / min(seconds),
        batch_size=batch_size,
    )


def decode_tolerance(dtype: str) -> float:
    """The largest decode-vs-parallel logit difference accepted, relative to the logits' scale:
    1e-3 in float32, eight of the computation dtype's epsilons in a lower precision (bfloat16:
    2⁻⁴; the two orders of summation round differently)."""
    return max(1e-3, 8 * float(jnp.finfo(jnp.dtype(dtype)).eps))


def _decode_all(step: Callable, params, tokens, cache) -> Float[Array, "B T vocab"]:
    logits = []
    for t in range(tokens.shape[1]):
        step_logits, cache = step(params, tokens[:, t], cache)
        logits.append(step_logits)
    return jax.block_until_ready(jnp.stack(logits, axis=1))


def plot(histories: list[History], path: str) -> None:
    """Training loss and accuracy (training batches and held-out) per mixer, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for i, history in enumerate(histories):
        color = f"C{i}"
        loss_ax.plot(history.steps, history.loss, color=color, label=history.mixer)
        acc_ax.plot(history.steps, history.accuracy, color=color, alpha=0.35)
        acc_ax.plot(history.eval_steps, history.eval_accuracy, color=color, marker="o", ms=3,
                    label=f"{history.mixer} (held-out)")
    loss_ax.set(xlabel="step", ylabel="query loss", yscale="log", title="MQAR training loss")
    acc_ax.set(xlabel="step", ylabel="query accuracy", ylim=(0, 1.02),
               title="accuracy (faint: training batches)")
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


DEFAULTS = dict(steps=400, seq_len=64, num_pairs=8, lr=3e-3, warmup=50)
QUICK = dict(steps=150, seq_len=32, num_pairs=4, lr=1e-2, warmup=20)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="recurrax demo",
        description="Train a small recurrent-attention language model on multi-query associative recall "
        "(MQAR) on the CPU, check token-by-token decoding against the parallel forward, and plot the run.",
    )
    parser.add_argument("--mixer", default="gla", choices=(*mixer_names(), "all"), help="token mixer (default gla)")
    preset = lambda key, what: f"{what} (default {DEFAULTS[key]}, quick {QUICK[key]})"  # noqa: E731
    parser.add_argument("--steps", type=int, help=preset("steps", "training steps"))
    parser.add_argument("--seq-len", type=int, help=preset("seq_len", "tokens per sequence"))
    parser.add_argument("--num-pairs", type=int, help=preset("num_pairs", "key-value pairs per sequence"))
    parser.add_argument("--vocab-size", type=int, default=64, help="vocabulary size (default 64)")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step (default 32)")
    parser.add_argument("--d-model", type=int, default=64, help="model width (default 64)")
    parser.add_argument("--conv-size", type=int, default=2, help="short convolution taps, 0 for none (default 2)")
    parser.add_argument("--lr", type=float, help=preset("lr", "peak AdamW learning rate"))
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="computation dtype; parameters stay float32 (default auto: bfloat16 on a TPU or GPU, "
                        "float32 on a CPU)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation and data seed (default 0)")
    parser.add_argument("--out", default="recurrax_demo.png", help="plot path (default recurrax_demo.png)")
    parser.add_argument("--quick", action="store_true", help="a shorter, easier run (under a minute)")
    parser.add_argument("--no-progress", action="store_true",
                        help="hide the progress bar (the compiling line stays)")
    add_compilation_cache_option(parser)
    return parser.parse_args(argv)


def configs_from(args: argparse.Namespace) -> list[TrainConfig]:
    """One `TrainConfig` per mixer to train."""
    preset = QUICK if args.quick else DEFAULTS
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else preset[name]  # noqa: E731
    task = MQARConfig(vocab_size=args.vocab_size, seq_len=pick("seq_len"), num_pairs=pick("num_pairs"))
    from recurrax.nn import training_dtype

    mixers = mixer_names() if args.mixer == "all" else (args.mixer,)
    dtype = jnp.dtype(training_dtype()).name if args.dtype == "auto" else args.dtype
    return [
        TrainConfig(task=task, mixer=mixer, steps=pick("steps"), batch_size=args.batch_size, d_model=args.d_model,
                    conv_size=args.conv_size, learning_rate=pick("lr"), warmup=preset["warmup"], seed=args.seed,
                    dtype=dtype)
        for mixer in mixers
    ]


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns 0, or 1 when decoding does not match the parallel forward."""
    for module in ("flax.nnx", "optax", "tqdm", "matplotlib"):
        require(module, "demo", "recurrax demo")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start_compilation_cache(args)
    try:
        configs = configs_from(args)
    except ValueError as error:
        print(f"recurrax demo: {error}", file=sys.stderr)
        return 2
    task = configs[0].task
    print(f"MQAR: vocab {task.vocab_size}, {task.seq_len} tokens, {task.num_pairs} pairs, "
          f"{task.num_queries} queries per sequence; {configs[0].steps} steps of {configs[0].batch_size} "
          f"sequences on {jax.default_backend()}")
    start = time.perf_counter()
    results = [_run_one(config, progress=not args.no_progress) for config in configs]
    _print_summary(results)
    plot([history for history, _ in results], args.out)
    print(f"plot written to {args.out}; total {time.perf_counter() - start:.0f} s")
    return 0 if all(report.matches for _, report in results) else 1


def _run_one(config: TrainConfig, progress: bool) -> tuple[History, DecodeReport]:
    graphdef, params, history, evaluate = train(config, progress=progress)
    final = held_out_accuracy(evaluate, params, split_key(config.seed, HELD_OUT), 16)
    history.eval_accuracy[-1] = final
    report = decode_check(graphdef, params, config)
    print(f"{config.mixer}: held-out query accuracy {final:.1%} after {config.steps} steps ({history.seconds:.0f} s); "
          f"training {history.throughput(config.batch_size * config.task.seq_len)}")
    return history, report


def _print_summary(results: list[tuple[History, DecodeReport]]) -> None:
    batch = results[0][1].batch_size
    width = max(10, *(len(history.mixer) for history, _ in results))
    print(f"\n{'mixer':<{width}} held-out acc  decode acc  decode vs parallel (max |Δlogit|)  "
          f"decode tokens/s (batch {batch})")
    for history, report in results:
        verdict = "ok" if report.matches else f"MISMATCH (tolerance {report.tolerance:.1e})"
        print(f"{history.mixer:<{width}} {history.eval_accuracy[-1]:>11.1%}  {report.accuracy:>10.1%}  "
              f"{report.max_abs_diff:>12.2e} {verdict:<21} {report.tokens_per_second:>14,.0f}")
    if not math.isfinite(sum(h.loss[-1] for h, _ in results)):
        print("warning: the training loss is not finite", file=sys.stderr)
