"""Prefill and decode of the 2026 hybrids on one TPU v5e, beside the chip's floors (issue 47).

    source benchmarks/tpu_env.sh && python3 benchmarks/tpu_generate.py --out benchmarks/results --budget 330
    python benchmarks/tpu_generate.py --smoke --out /tmp/g        # anywhere, tiny shapes, under a minute on a CPU
    python3 benchmarks/tpu_generate.py --out benchmarks/results/decode_trace \
        --rows "gla-340m decode batch 1,gla-340m decode batch 8" --trace --no-k1   # about 3.5 minutes

With `--trace`, each decode row runs one more call under the profiler: the report gives the
device's self time per kind of op, as a share of the call, µs and ops per decode step and µs per
op, and the longest ops. `--no-k1` measures the decode rows at the default tokens per call only
(the k = 1 pools' step compiles left out).

One run takes at most `--budget` seconds plus the row under way (330 s: about 6 minutes with the
start-up). Models, random weights in bfloat16 (parameters and computation):
- `qwen3.5-0.8b`: Qwen/Qwen3.5-0.8B's text model (`qwen3_5.py`'s config, 0.75 G parameters: 24 layers, Gated
  DeltaNet with gated attention at every fourth layer, the tied 248,320-token head);
- `gla-340m`: fla's GLA-340M (`size_config("gla-340m")`);
- `kimi-linear-cut`: Kimi-Linear-48B-A3B's layer shapes (`kimi_linear.py`: KDA, MLA every fourth
  layer, sigmoid-routed experts, 8 per token, one shared) cut to 8 layers and 32 routed experts
  so that it fits the chip's 15.7 GiB (2.75 G parameters, 5.1 GiB; 1.18 G active).

Rows, in priority order (`rows`: what the issue's targets name first; the results are written
after every row, so a run stopped by its budget keeps what it measured):
- decode at batch 1, 8 and 64: `DecodePool.step` (the engine of `generate` and `recurrax serve`)
  after each row's prompt of 1,024 tokens. One call of `step` runs `tokens_per_call` = k decode
  steps in one compiled program and produces k tokens per row (their tokens come back to the host
  once per call); the step time is the median call's time / k, at the k `generate` and `recurrax
  serve` use by default (`TOKENS_PER_CALL`, 8) and, beside it, at k = 1 (one step per call: the
  host's dispatch, transfers and read-back in every token). The step time at the default k beside
  its floor: the bytes a step must read over 819 GB/s (`--hbm-gbs`): every
  active weight once (the input embedding, a lookup, left out unless tied to the head; of the
  routed experts the expected share a batch of B rows touches, 1 − (1 − k/E)^B with uniform
  routing) plus each row's cache (recurrent states, convolution buffers, the attention keys
  and values or MLA latents of its 1,024 + tokens), as `cache_bytes` computes from the shapes;
- prefill of one prompt of 1k, 8k and 32k tokens: `DecodePool.admit` (packed prefills of at most
  2,048 tokens, a longer prompt continuing from its slot: the engine's pieces), i.e. the time to
  first token of a lone request; tokens/s and MFU = 2·N FLOPs per token over 197 TFLOP/s
  (`--peak-tflops`), N the active parameters as above (attention's T² products are not in
  2·N: at 32k the MFU understates the chip's use; the floor column is 2·N·T over the peak, the
  target of a time to first token is twice it). A size whose caches
  would not fit the device's free memory is skipped, saying so;
- `generate` end to end: `generate_tokens` (a `DecodePool` of 8 slots) on 32 requests of mixed
  prompt lengths (log-uniform in [64, 1,177]) and 128 new tokens each, all submitted at once:
  time to first token per request (median, p90) and generated tokens/s; the same run first
  untimed, so that every shape it meets is compiled.

Compilations are shared where the engine allows: a model's prefill rows use one pool (one
slot, its capacity for the longest prompt, as `recurrax serve` sizes its pool by
`--max-model-len`; a 1k prompt there pays what it pays in such a server) and one packed length;
`generate`'s pool has decode batch 8's shapes (its step compiles once for both). Each decode
batch compiles its own step and admission.

Writes `tpu_generate.md`, `tpu_generate.json` and `tpu_generate.png` (matplotlib) in `--out`.
`--smoke` runs the same code on tiny models and short prompts (the prefill in pieces of 64).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kimi_linear import KIMI_LINEAR_48B_A3B, TINY as KIMI_TINY, config as kimi_config  # noqa: E402
from pretrained_340m import GLA_340M, TINY as GLA_TINY  # noqa: E402
from qwen3_5 import QWEN3_5_0_8B, TINY as QWEN_TINY, layer_types  # noqa: E402
from _trace import traced_ops  # noqa: E402

from recurrax import use_compilation_cache  # noqa: E402
from recurrax.generation import TOKENS_PER_CALL, DecodePool, Sampling, cache_capacity, generate_tokens  # noqa: E402
from recurrax.nn.pretrained import model_from_config  # noqa: E402

MODELS = ("qwen3.5-0.8b", "gla-340m", "kimi-linear-cut")
BATCHES = (1, 8, 64)


def cache_bytes(model, rows: int, capacity: int) -> int:
    """Bytes of `model.generation_cache(rows, capacity)`, from shapes only."""
    shapes = jax.eval_shape(lambda: model.generation_cache(rows, capacity))
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def available_bytes() -> int:
    """Free memory of the default device (its allocator's limit less what is in use); on a CPU,
    the host's available memory."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

def model_config(name: str, smoke: bool) -> dict:
    if name == "qwen3.5-0.8b":
        base, layers = (QWEN_TINY, 4) if smoke else (QWEN3_5_0_8B, 24)
        return {**base, "num_hidden_layers": layers, "layer_types": layer_types(layers)}
    if name == "gla-340m":
        return GLA_TINY if smoke else GLA_340M
    return kimi_config(KIMI_TINY, 4, 8) if smoke else kimi_config(KIMI_LINEAR_48B_A3B, 8, 32)


WARM_STEPS = 3
"""Decode calls run before the timed ones (the first compiles)."""


def shapes(smoke: bool) -> dict:
    """Prompt lengths, decode context and steps, the prefill piece, the generate workload. The
    longest `generate` request and its new tokens need the positions of a decode row (the
    prompt, the warm-up and timed steps), so that `generate`'s pool of 8 slots has batch 8's
    shapes: it compiles only the packed lengths of its admissions."""
    if smoke:
        s = dict(prefill=(100, 200, 300), context=40, steps=4, piece=64, requests=12, shortest=4, new_tokens=6)
    else:
        s = dict(prefill=(1024, 8192, 32768), context=1024, steps=32, piece=2048, requests=32, shortest=64,
                 new_tokens=128)
    return {**s, "slots": 8, "longest": decoded_context(s) - s["new_tokens"]}


def decoded_context(s: dict) -> int:
    """Positions a decode row fills: its prompt, the warm-up and timed calls of `TOKENS_PER_CALL`."""
    return s["context"] + (WARM_STEPS + s["steps"]) * TOKENS_PER_CALL + 1


def rows(smoke: bool) -> list[dict]:
    """Every row, in priority order: what the issue's targets name first (Qwen3.5's decode and
    its prefill at 8k and 32k, GLA's decode), then the rest of each model's rows."""
    short, middle, long = shapes(smoke)["prefill"]
    decode = lambda name: [dict(model=name, kind="decode", batch=b) for b in BATCHES]  # noqa: E731
    prefill = lambda name, sizes: [dict(model=name, kind="prefill", tokens=t) for t in sizes]  # noqa: E731
    generate = lambda name: [dict(model=name, kind="generate")]  # noqa: E731
    qwen, gla, kimi = MODELS
    return (decode(qwen) + prefill(qwen, (middle, long)) + decode(gla) + prefill(qwen, (short,)) + generate(qwen)
            + prefill(gla, (middle, long, short)) + generate(gla)
            + decode(kimi) + prefill(kimi, (middle, long, short)) + generate(kimi))


def label(row: dict) -> str:
    detail = {"decode": lambda: f"batch {row['batch']}", "prefill": lambda: f"{row['tokens']:,} tokens",
              "generate": lambda: "mixed requests"}[row["kind"]]()
    return f"{row['model']} {row['kind']} {detail}"


class Counts:
    """A model's parameter bytes and counts: all, routed experts (E, k), the input embedding
    when it is not the head."""

    def __init__(self, model, config: dict):
        self.total = self.routed = self.embedding = 0
        self.total_bytes = self.routed_bytes = self.embedding_bytes = 0
        tied = config.get("tie_word_embeddings", False)
        for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
            where = jax.tree_util.keystr(path)
            size, nbytes = x.size, x.size * jnp.dtype(x.dtype).itemsize
            self.total += size
            self.total_bytes += nbytes
            if "['experts']" in where:
                self.routed += size
                self.routed_bytes += nbytes
            elif ("embed_tokens" in where or "embeddings" in where) and not tied:
                self.embedding += size
                self.embedding_bytes += nbytes
        self.experts = config.get("num_experts", 0)
        self.per_token = config.get("num_experts_per_token", 0)

    def routed_share(self, rows: int) -> float:
        """Expected share of the routed experts that `rows` tokens touch (uniform routing)."""
        if not self.experts:
            return 0.0
        return 1 - (1 - self.per_token / self.experts) ** rows

    def active(self) -> float:
        """N: parameters one token uses (the input embedding out unless tied; k/E of the experts)."""
        return self.total - self.embedding - self.routed * (1 - self.routed_share(1))

    def step_weight_bytes(self, rows: int) -> float:
        """Weight bytes a decode step of `rows` rows reads."""
        return self.total_bytes - self.embedding_bytes - self.routed_bytes * (1 - self.routed_share(rows))


def build(name: str, smoke: bool):
    config = model_config(name, smoke)
    start = time.perf_counter()
    model = random_model(lambda: model_from_config(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                                   rngs=nnx.Rngs(0)))
    counts = Counts(model, config)
    log(f"{name}: built in {time.perf_counter() - start:.1f} s, {counts.total / 1e6:,.1f} M parameters, "
        f"{counts.active() / 1e6:,.1f} M active")
    return model, config, counts


def random_model(make):
    """The model `make()` builds, its weights drawn anew: traced without memory (`nnx.eval_shape`),
    then every floating array drawn from N(0, 0.02²) (vectors, the norms' scales and biases among
    them, 1 + that), on the device, by one small program per shape. The model's own initialisers
    in one compiled program took 75 s on the v5e for Qwen3.5-0.8B, nearly all of it compiling;
    a decode or prefill time does not depend on the weights' values."""
    graphdef, state = nnx.split(nnx.eval_shape(make))
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, [draw(key, leaf) for key, leaf in zip(keys, leaves)]))


def draw(key, leaf):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
        return _normal(key, shape=tuple(leaf.shape), dtype=leaf.dtype)
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return jax.random.key(0)
    return jnp.zeros(leaf.shape, leaf.dtype)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _normal(key, *, shape, dtype):
    x = 0.02 * jax.random.normal(key, shape, jnp.float32)
    return (x + 1 if len(shape) == 1 else x).astype(dtype)


def prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def measure_decode(model, counts: Counts, batch: int, s: dict, chip: dict, trace: bool = False,
                   k1: bool = True) -> dict:
    """Seconds per token (a call's / its tokens per row) of a pool of `batch` rows after prompts
    of `context` tokens, at `TOKENS_PER_CALL` tokens per call and (with `k1`) at 1, and the floor;
    with `trace`, one more call at `TOKENS_PER_CALL` under the profiler (`_trace.traced_ops`: self
    time and count by kind of op)."""
    capacity = cache_capacity(model, decoded_context(s))
    step, traced = {}, {}
    for k in (TOKENS_PER_CALL, 1) if k1 else (TOKENS_PER_CALL,):  # one pool at a time (batch 64's: GiBs)
        began = time.perf_counter()
        pool = DecodePool(model, batch, capacity, prefill_chunk=s["piece"], tokens_per_call=k)
        pool.admit(prompts(model.vocab_size, [s["context"]] * batch), [Sampling()] * batch)
        log(f"batch {batch}, k = {k}: pool made and prompts admitted in {time.perf_counter() - began:.1f} s")
        step[k] = time_calls(pool, s["steps"]) / k
        log(f"batch {batch}, k = {k}: {step[k] * 1e3:.3f} ms a token, {time.perf_counter() - began:.1f} s in all")
        if trace and k == TOKENS_PER_CALL:
            traced = {"trace": traced_ops(pool.step, step[k] * k)}
        del pool
    filled = s["context"] + (WARM_STEPS + s["steps"] // 2) * TOKENS_PER_CALL
    weight = counts.step_weight_bytes(batch)
    cache = cache_bytes(model, batch, filled)
    floor = (weight + cache) / (chip["hbm_gbs"] * 1e9)
    seconds = step[TOKENS_PER_CALL]
    one = {"step_k1_s": step[1], "k1_over_floor": step[1] / floor} if 1 in step else {}
    return dict(**traced, **one, tokens_per_call=TOKENS_PER_CALL, step_s=seconds, floor_s=floor,
                over_floor=seconds / floor, weight_bytes=weight, cache_bytes=cache, capacity=capacity,
                context=filled, tokens_per_s=batch / seconds)


def time_calls(pool: DecodePool, calls: int) -> float:
    """The median seconds of one `pool.step()` over `calls` calls, after `WARM_STEPS` (the
    first compiles)."""
    began = time.perf_counter()
    pool.step()  # the first call compiles
    log(f"first call (its compile) {time.perf_counter() - began:.1f} s")
    for _ in range(WARM_STEPS - 1):
        pool.step()
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        pool.step()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def fits_prefill(model, tokens: int, s: dict) -> str | None:
    """Why a pool for prompts of `tokens` would not fit the device (its pool's and prefill's
    caches, twice), or None."""
    capacity = cache_capacity(model, tokens + 1)
    needed = 2 * cache_bytes(model, 2, capacity)
    free = available_bytes()
    if needed > 0.8 * free:
        return f"needs about {needed / 2**30:.1f} GiB of caches, {free / 2**30:.1f} GiB free"
    return None


def prefill_pool(model, s: dict, kept: dict) -> DecodePool | None:
    """One pool of one slot for every prefill row of a model (kept in `kept`), its capacity for
    the longest prompt that fits (as `recurrax serve` sizes its pool by `--max-model-len`):
    every prefill row compiles one program, pieces of `piece` tokens."""
    if "pool" not in kept:
        fitting = [t for t in s["prefill"] if fits_prefill(model, t, s) is None]
        kept["pool"] = fitting and DecodePool(model, 1, cache_capacity(model, max(fitting) + 1),
                                              prefill_chunk=s["piece"])
    return kept["pool"] or None


def measure_prefill(model, counts: Counts, tokens: int, s: dict, chip: dict, kept: dict) -> dict:
    """Time of `DecodePool.admit` for one prompt of `tokens` (its first token out: the time to
    first token of a lone request), after an untimed call (the first compiles)."""
    reason = fits_prefill(model, tokens, s)
    if reason is not None:
        return dict(skipped=reason)
    pool = prefill_pool(model, s, kept)
    prompt = prompts(model.vocab_size, [tokens])
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        (slot, _), = pool.admit(prompt, [Sampling()], packed_length=s["piece"])
        seconds.append(time.perf_counter() - start)
        pool.release(slot)
    t = statistics.median(seconds[1:])
    flops = 2 * counts.active() * tokens
    return dict(seconds=t, tokens_per_s=tokens / t, mfu=flops / t / (chip["peak_tflops"] * 1e12),
                floor_s=flops / (chip["peak_tflops"] * 1e12), pieces=-(-tokens // s["piece"]))


def measure_generate(model, s: dict) -> dict:
    """`generate_tokens` on mixed requests: per-request time to first token, tokens/s."""
    rng = np.random.default_rng(3)
    lengths = np.exp(rng.uniform(np.log(s["shortest"]), np.log(s["longest"]), s["requests"])).astype(int)
    lengths[-1] = s["longest"]
    requests = prompts(model.vocab_size, lengths, seed=4)

    def run():
        first, count, start = {}, 0, time.perf_counter()
        for i, _ in generate_tokens(model, requests, s["new_tokens"], num_slots=s["slots"], stop_tokens=()):
            first.setdefault(i, time.perf_counter() - start)
            count += 1
        return first, count, time.perf_counter() - start

    run()  # compiles every packed length and the step
    first, count, wall = run()
    ttft = sorted(first.values())
    return dict(requests=s["requests"], slots=s["slots"], new_tokens=s["new_tokens"],
                prompt_tokens=int(lengths.sum()), ttft_median_s=statistics.median(ttft),
                ttft_p90_s=ttft[int(0.9 * (len(ttft) - 1))], tokens_per_s=count / wall, wall_s=wall)


def measure(row: dict, model, counts: Counts, s: dict, chip: dict, kept: dict, trace: bool = False,
            k1: bool = True) -> dict:
    try:
        if row["kind"] == "decode":
            return measure_decode(model, counts, row["batch"], s, chip, trace, k1)
        if row["kind"] == "prefill":
            return measure_prefill(model, counts, row["tokens"], s, chip, kept)
        return measure_generate(model, s)
    except Exception as error:  # noqa: BLE001  (out of memory, a failed compile: the row says why)
        return dict(failed=f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}")


def report(results: list[dict], skipped: list[str], chip: dict, models: dict) -> str:
    device = jax.devices()[0]
    lines = [f"# Prefill and decode on {device.device_kind}", "",
             f"JAX {jax.__version__}, bfloat16, random weights. Written by `benchmarks/tpu_generate.py` (its "
             f"docstring defines every column); floors at {chip['hbm_gbs']:g} GB/s and {chip['peak_tflops']:g} "
             "TFLOP/s.", ""]
    for name, info in models.items():
        lines.append(f"- `{name}`: {info['parameters'] / 1e9:.3f} G parameters, N = {info['active'] / 1e9:.3f} G "
                     "active")
    lines += ["", "## Decode step", "", f"One `DecodePool.step` call runs k decode steps and produces k tokens per "
              f"row; a step's time is the call's time / k, at k = {TOKENS_PER_CALL} (`generate`'s and `recurrax "
              "serve`'s default) and at k = 1 (one step per call).", "",
              f"| model | batch | step ms (k = {TOKENS_PER_CALL}) | floor ms | × floor | step ms (k = 1) | × floor "
              "(k = 1) | tokens/s | weights MB | caches MB |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in (r for r in results if r["kind"] == "decode"):
        if "step_s" in r:
            k1 = f"{1e3 * r['step_k1_s']:.2f} | {r['k1_over_floor']:.2f}" if "step_k1_s" in r else "– | –"
            lines.append(f"| {r['model']} | {r['batch']} | {1e3 * r['step_s']:.2f} | {1e3 * r['floor_s']:.2f} | "
                         f"{r['over_floor']:.2f} | {k1} | "
                         f"{r['tokens_per_s']:,.0f} | {r['weight_bytes'] / 1e6:,.0f} | {r['cache_bytes'] / 1e6:,.1f} |")
        else:
            lines.append(f"| {r['model']} | {r['batch']} | {r.get('failed', '')} | | | | | | | |")
    lines += ["", "## Prefill (one prompt; its time is the time to first token)", "",
              "| model | tokens | pieces | seconds | floor s | tokens/s | MFU |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in (r for r in results if r["kind"] == "prefill"):
        if "seconds" in r:
            lines.append(f"| {r['model']} | {r['tokens']:,} | {r['pieces']} | {r['seconds']:.3f} | "
                         f"{r['floor_s']:.3f} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% |")
        else:
            lines.append(f"| {r['model']} | {r['tokens']:,} | | {r.get('skipped') or r.get('failed')} | | | |")
    lines += ["", "## `generate` end to end (mixed prompt lengths, all requests at once)", "",
              "| model | requests | slots | prompt tokens | new tokens each | TTFT median s | TTFT p90 s | "
              "tokens/s |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in (r for r in results if r["kind"] == "generate"):
        if "tokens_per_s" in r:
            lines.append(f"| {r['model']} | {r['requests']} | {r['slots']} | {r['prompt_tokens']:,} | "
                         f"{r['new_tokens']} | {r['ttft_median_s']:.3f} | {r['ttft_p90_s']:.3f} | "
                         f"{r['tokens_per_s']:,.0f} |")
        else:
            lines.append(f"| {r['model']} | {r.get('failed', '')} | | | | | | |")
    for r in (r for r in results if "trace" in r):
        k = r["tokens_per_call"]
        call, count = k * r["step_s"], r["trace"].get("kind_count", {})
        lines += ["", f"## One decode call ({k} steps) under the profiler: {r['label']}", "",
                  f"Device self time {1e3 * r['trace']['device_s']:.2f} ms of a {1e3 * call:.2f} ms call; "
                  f"{sum(count.values()) / k:,.0f} ops a step. By kind of op (a step: the call's / {k}):", "",
                  "| kind of op | share of the call | µs a step | ops a step | µs an op |", "|---|---:|---:|---:|---:|"]
        for kind, share in list(r["trace"]["kind_share"].items())[:16]:
            ops = count.get(kind, 0)
            each = f"{1e6 * share * call / ops:.2f}" if ops else ""
            lines.append(f"| {kind} | {100 * share:.1f}% | {1e6 * share * call / k:.1f} | {ops / k:g} | {each} |")
        lines += ["", "| op | share of the call |", "|---|---:|"]
        lines += [f"| `{op}` | {100 * share:.1f}% |" for op, share in r["trace"]["op_share"].items()]
    if skipped:
        lines += ["", "Not run (the budget was spent): " + "; ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    """Decode step time over its floor, and prefill MFU (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("no matplotlib, no PNG")
        return
    decode = [r for r in results if r["kind"] == "decode" and "step_s" in r]
    prefill = [r for r in results if r["kind"] == "prefill" and "mfu" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.barh([f"{r['model']} B{r['batch']}" for r in decode], [r["over_floor"] for r in decode])
    left.axvline(1.0, color="k", lw=0.8)
    left.set_xlabel(f"decode step time (a call of {TOKENS_PER_CALL} / {TOKENS_PER_CALL}) / HBM floor (lower is better)")
    left.invert_yaxis()
    right.barh([f"{r['model']} {r['tokens']:,}" for r in prefill], [100 * r["mfu"] for r in prefill])
    right.set_xlabel("prefill MFU, % (2N per token)")
    right.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def log(text: str) -> None:
    print(f"tpu_generate: {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for tpu_generate.md, .json and .png")
    parser.add_argument("--budget", type=float, default=330, help="seconds; rows after it are skipped")
    parser.add_argument("--peak-tflops", type=float, default=197.0)
    parser.add_argument("--hbm-gbs", type=float, default=819.0)
    parser.add_argument("--smoke", action="store_true", help="tiny models and prompts (any machine)")
    parser.add_argument("--rows", help="comma-separated beginnings of row labels to run (e.g. 'qwen3.5-0.8b "
                        "prefill,gla-340m decode'); default: every row, in priority order")
    parser.add_argument("--trace", action="store_true", help="trace one decode call of each decode row")
    parser.add_argument("--no-k1", action="store_true", help="decode rows at the default tokens per call only "
                        "(not also at 1: half their compiles)")
    args = parser.parse_args(argv)
    if not args.smoke:  # a second call on a machine still warm compiles nothing (no compile time is reported)
        use_compilation_cache()
    chip = {"peak_tflops": args.peak_tflops, "hbm_gbs": args.hbm_gbs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    s = shapes(args.smoke)
    log(f"JAX {jax.__version__} on {jax.devices()[0].device_kind}; budget {args.budget:g} s")
    start, results, skipped, models = time.perf_counter(), [], [], {}
    table = rows(args.smoke)
    if args.rows:
        wanted = [w.strip() for w in args.rows.split(",")]
        table = [row for row in table if any(label(row).startswith(w) for w in wanted)]
    last = {row["model"]: i for i, row in enumerate(table)}
    loaded = {}  # name → (model, config, counts, kept pools), freed after the model's last row
    for i, row in enumerate(table):
        if time.perf_counter() - start > args.budget:
            skipped.append(label(row))
            continue
        name = row["model"]
        if name not in loaded:
            loaded[name] = (*build(name, args.smoke), {})
            models[name] = dict(parameters=loaded[name][2].total, active=loaded[name][2].active())
        model, _, counts, kept = loaded[name]
        result = {**row, "label": label(row), **measure(row, model, counts, s, chip, kept, args.trace, not args.no_k1)}
        if last[name] == i:
            del loaded[name], model, kept
            gc.collect()
        results.append(result)
        (out / "tpu_generate.md").write_text(report(results, skipped, chip, models))
        (out / "tpu_generate.json").write_text(json.dumps(dict(models=models, rows=results), indent=1))
        shown = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in result.items() if k not in row}
        log(f"{label(row)} at {time.perf_counter() - start:.0f} s: {shown}")
    if skipped:
        log(f"budget spent, not run: {'; '.join(skipped)}")
    (out / "tpu_generate.md").write_text(report(results, skipped, chip, models))
    plot(results, out / "tpu_generate.png")
    print(report(results, skipped, chip, models), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
