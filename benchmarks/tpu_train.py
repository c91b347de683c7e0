"""Training steps of 340M–0.8B models on one chip: step time, tokens/s, MFU, memory, compile time
and where the step's time goes.

    source benchmarks/tpu_env.sh && python3 benchmarks/tpu_train.py --out $OUT --budget 400   # TPU v5e, ≤ 7 min
    python benchmarks/tpu_train.py --smoke --out /tmp/t                                        # any machine, < 1 min

Models (random initialisation, `recurrax.nn.pretrained.CausalLM`, bfloat16 compute on float32
parameters, `remat="block"`, layers scanned (`scan_layers`, the default)); the step is
`jax.value_and_grad` of the mean `token_losses` (the chunked cross entropy) and optax's AdamW:
- `gla-340m`: fla's GLA 340M (`size_config("gla-340m")`: 1024 × 24, 4 heads, vocab 32,000, tied),
  0.34 G parameters;
- `gdn-340m`: fla's Gated DeltaNet 340M (flame's `gated_deltanet_340M.json`: 1024 × 21, 6 heads
  of 256, expand_v 2, short convolutions, vocab 32,000, untied), 0.51 G parameters as built
  (fla's name, its value heads of 512 and untied head make it larger than the name);
- `mamba2-370m`: state-spaces/mamba2-370m's shape (1024 × 48, 32 heads of 64, state 128), 0.37 G;
- `qwen3.5-0.8b`: a Qwen3.5-shaped hybrid (1024 × 24: three Gated DeltaNet layers of 16 heads
  of 128, then full attention of 8 heads of 256 (2 KV heads); MLP 3,584; vocab 248,320, tied),
  0.75 G parameters; its AdamW keeps the first moment in bfloat16 (`mu_dtype`) to fit 16 GiB. Its
  attention layers hold dense `[B, H, T, T]` float32 scores (recurrax's softmax attention has no
  flash kernel yet): at T = 16,384 that is 8.6 GB a layer, so that row may run out of memory (a
  failed row says why and the run goes on).

Rows, in priority order (`--budget` seconds: a row is not started when the longest row so far
would end past it; `--rows` picks some by name): every model at T = 4096 (4 × 4096 tokens a
step), then the layers unrolled (`scan_layers=False`) for GLA-340M at T = 4096 (its cold compile
only), then every model at T = 16,384 (1 × 16,384). Per row:
- step: the median of `--steps` timed steps after one warm-up (`block_until_ready`); tokens/s;
- MFU 6N: 6 · parameters (embedding included) · tokens/s over the peak (`recurrax.nn.PEAK_FLOPS`,
  `--peak-tflops` for another chip); MFU with mixers: (6N + the mixers' own FLOPs per token) ·
  tokens/s over the peak, the mixers' FLOPs being the chunk form's matmuls at C = 64 (forward
  plus backward, as in `tpu_paths.py`) or causal attention's 4·T·d per token and head forward
  (two products over half the keys) and twice that backward; a remat's recompute counts in
  neither;
- memory: the compiled step's arguments + temporaries + outputs (`memory_analysis`) and the
  device's peak in use so far (`memory_stats()["peak_bytes_in_use"]`, process-wide: it never
  falls between rows);
- compile: the cold `lower` + `compile` of the step (no persistent cache);
- profile: the step's share in mixers, MLPs, norms, the loss head and the optimizer, from
  separate jitted forward+backward programs of one layer's parts at the step's shapes
  (× the layers of each kind), the chunked cross entropy over the final hidden states, and
  AdamW's update; "other" is the rest of the step (embedding, residual adds, the remat's
  recompute of each layer's forward, the scan's stacking);
- trace: one step under `jax.profiler.trace`, read back with `jax.profiler.ProfileData` (no xprof
  needed): the device's self time by kind of XLA op (Pallas kernels by name, matmuls, fusions,
  copies, ...) and the longest ops, as shares of the step.

`tpu_train.md` and `tpu_train.json` are rewritten after every row (a stopped run keeps what it
measured) and `tpu_train.png` at the end. `--smoke`: tiny shapes of the same four families
(two layers per period) at T = 64, and the unrolled compile: every code path of the chip's run
(the T = 16,384 rows run the same code at another shape), on a CPU in about a minute.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import timed  # noqa: E402
from _trace import kind_of_op, self_times, traced_ops  # noqa: E402,F401  (the tests read them here too)

from recurrax.nn import PEAK_FLOPS, chunked_cross_entropy, parameter_count
from recurrax.nn.pretrained import CausalLM, size_config

C = 64
"""The chunk size the mixers' FLOP count assumes (`tpu_paths.py`'s)."""
QWEN3_5 = dict(
    model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], hidden_size=1024, num_hidden_layers=24,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6, linear_conv_kernel_dim=4,
    linear_key_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=16, linear_value_head_dim=128,
    num_attention_heads=8, num_key_value_heads=2, head_dim=256, intermediate_size=3584, vocab_size=248320,
    tie_word_embeddings=True, rms_norm_eps=1e-6, max_position_embeddings=32768, attention_bias=False,
    hidden_act="silu", rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25))
GDN_340M = dict(
    model_type="gated_deltanet", hidden_size=1024, num_hidden_layers=21, num_heads=6, head_dim=256, expand_v=2,
    hidden_ratio=4, intermediate_size=None, vocab_size=32000, tie_word_embeddings=False, use_short_conv=True,
    conv_size=4, use_gate=True, norm_eps=1e-6, attn_mode="chunk", hidden_act="swish")
MODELS = {
    "gla-340m": size_config("gla-340m"),
    "gdn-340m": GDN_340M,
    "mamba2-370m": size_config("mamba2-130m", hidden_size=1024, num_hidden_layers=48, num_heads=32),
    "qwen3.5-0.8b": QWEN3_5,
}
SMOKE = {
    "gla-340m": dict(hidden_size=64, num_hidden_layers=2, vocab_size=256),
    "gdn-340m": dict(hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=32, vocab_size=256),
    "mamba2-370m": dict(hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32, state_size=16,
                        vocab_size=256),
    "qwen3.5-0.8b": dict(hidden_size=64, num_hidden_layers=8, linear_key_head_dim=32, linear_num_key_heads=2,
                         linear_num_value_heads=2, linear_value_head_dim=32, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, intermediate_size=128, vocab_size=256,
                         layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2),
}
"""`--smoke`'s overrides: the same families, tiny."""
BF16_FIRST_MOMENT = {"qwen3.5-0.8b"}
"""Models whose AdamW keeps its first moment in bfloat16 (what fits 16 GiB)."""


def rows(smoke: bool) -> list[dict]:
    """Every row, in priority order."""
    long_T, short_T = 16384, 64 if smoke else 4096
    table = [dict(name=f"{model} T{short_T}", model=model, B=4, T=short_T, scan=True) for model in MODELS]
    table.append(dict(name=f"gla-340m T{short_T} unrolled", model="gla-340m", B=4, T=short_T, scan=False,
                      compile_only=True))
    if not smoke:  # the same code as the rows above, at another shape
        table += [dict(name=f"{model} T{long_T}", model=model, B=1, T=long_T, scan=True) for model in MODELS]
    return table


def config_of(model: str, smoke: bool) -> dict:
    return {**MODELS[model], **(SMOKE[model] if smoke else {})}


def build(model: str, smoke: bool, scan: bool) -> CausalLM:
    built = CausalLM(config_of(model, smoke), dtype=jnp.bfloat16, param_dtype=jnp.float32, remat="block",
                     scan_layers=scan, rngs=nnx.Rngs(0))
    return built


def optimizer_for(model: str):
    mu_dtype = jnp.bfloat16 if model in BF16_FIRST_MOMENT else None
    return optax.adamw(3e-4, weight_decay=0.1, mu_dtype=mu_dtype)


def train_step(graphdef, optimizer):
    """The jitted step: loss, gradients, AdamW; parameters and optimizer state donated."""

    def loss(params, tokens):
        return nnx.merge(graphdef, params).token_losses(tokens[:, :-1], tokens[:, 1:]).mean()

    def step(params, opt_state, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1))


def mixer_flops_per_token(config: dict, T: int) -> float:
    """The mixers' own matmul FLOPs per token, forward + backward, summed over the layers (see
    the module's docstring): the chunk form at C = 64, causal attention's scores and values."""
    t = config["model_type"]
    L = config["num_hidden_layers"]
    recurrent = lambda H, K, V: H * (4 * K * V + 2 * C * (K + V) + 8 * K * V + 2 * C * (3 * K + 2 * V))  # noqa: E731
    delta = lambda H, K, V: 3 * H * (6 * K * V + 2 * C * (2 * K + V) + C * C * K / 3)  # noqa: E731
    attention = lambda H, d: 3 * H * 2 * T * d  # noqa: E731  (forward 4·(T/2)·d, backward twice)
    D = config["hidden_size"]
    if t == "gla":
        H = config["num_heads"]
        return L * recurrent(H, int(D * config["expand_k"]) // H, int(D * config["expand_v"]) // H)
    if t == "gated_deltanet":
        K = config["head_dim"]
        return L * delta(config["num_heads"], K, int(K * config["expand_v"]))
    if t == "mamba2":
        return L * recurrent(config["num_heads"], config["state_size"], config["head_dim"])
    kinds = config["layer_types"]
    linear = delta(config["linear_num_value_heads"], config["linear_key_head_dim"], config["linear_value_head_dim"])
    full = attention(config["num_attention_heads"], config["head_dim"])
    return sum(linear if kind == "linear_attention" else full for kind in kinds)


def kind_of(name: str) -> str:
    """A layer's part by its attribute name: norm, mlp or mixer."""
    if "norm" in name:
        return "norms"
    if any(word in name for word in ("mlp", "feed_forward", "ffn", "moe")):
        return "MLPs"
    return "mixers"


def parts(layer) -> list[tuple[str, nnx.Module]]:
    """A layer's direct sub-modules (its mixer, MLP and norms), by attribute name."""
    return [(name, value) for name, value in vars(layer).items() if isinstance(value, nnx.Module)]


def _bfloat16(x):
    """Floating-point parameters cast to bfloat16 (what `dtype=bfloat16` layers compute with)."""
    return x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x


def part_program(module, B: int, T: int, D: int):
    """A jitted forward+backward of `module` on a [B, T, D] bfloat16 input (its parameters cast to
    bfloat16 as the model's are), and its arguments."""
    graphdef, params = nnx.split(module)
    keywords = {name: None for name in ("cu_seqlens",) if name in inspect.signature(module.__call__).parameters}
    if "positions" in inspect.signature(module.__call__).parameters:
        keywords["positions"] = jnp.broadcast_to(jnp.arange(T), (B, T))

    def loss(params, x):
        part = nnx.merge(graphdef, jax.tree.map(_bfloat16, params))
        y = part(x, **keywords)
        y = y[0] if isinstance(y, tuple) else y
        return jnp.sum(y.astype(jnp.float32))

    x = jax.random.normal(jax.random.key(1), (B, T, D), jnp.bfloat16)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), (params, x)


def profile(model: CausalLM, params, opt_state, optimizer, B: int, T: int, step_seconds: float,
            repeats: int) -> dict:
    """Seconds per step in each part (see the module's docstring) and their shares of the step."""
    config = model.config
    D = config["hidden_size"]
    seconds = {"mixers": 0.0, "MLPs": 0.0, "norms": 0.0}
    timed_kinds = {}  # one program per distinct part (graphdef), its time reused for its twins
    for layer in model.body.layers:
        for name, module in parts(layer):
            key = (name, nnx.graphdef(module))
            if key not in timed_kinds:
                program, arguments = part_program(module, B, T, D)
                timed_kinds[key] = statistics.median(timed(lambda: program(*arguments), repeats))
            seconds[kind_of(name)] += timed_kinds[key]
    norm = model.body.norm if hasattr(model.body, "norm") else getattr(model.body, "final_norm", None)
    if norm is not None:
        program, arguments = part_program(norm, B, T, D)
        seconds["norms"] += statistics.median(timed(lambda: program(*arguments), repeats))
    head = (model.lm_head.kernel if model.lm_head is not None else model.body.embedding.embedding)[...]
    tied = model.lm_head is None
    targets = jax.random.randint(jax.random.key(2), (B, T), 0, model.vocab_size)
    head_program = jax.jit(jax.value_and_grad(
        lambda h, table: chunked_cross_entropy(h, table.astype(jnp.bfloat16), targets, tied=tied).mean(),
        argnums=(0, 1)))
    h = jax.random.normal(jax.random.key(3), (B, T, D), jnp.bfloat16)
    seconds["loss head"] = statistics.median(timed(lambda: head_program(h, head), repeats))
    grads = jax.tree.map(jnp.zeros_like, params)

    def update(grads, opt_state, params):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    update = jax.jit(update, donate_argnums=(1, 2))  # in place, as in the step (last: it consumes params)
    state = {"params": params, "opt_state": opt_state}

    def run_update():
        state["params"], state["opt_state"] = update(grads, state["opt_state"], state["params"])
        return state["params"]

    seconds["optimizer"] = statistics.median(timed(run_update, repeats))
    seconds["other"] = step_seconds - sum(seconds.values())
    return {"seconds": seconds, "share": {k: v / step_seconds for k, v in seconds.items()}}


def measure(row: dict, smoke: bool, repeats: int, peak: float | None) -> dict:
    model = build(row["model"], smoke, row["scan"])
    config = model.config
    N = parameter_count(model)
    graphdef, params = nnx.split(model)
    optimizer = optimizer_for(row["model"])
    opt_state = optimizer.init(params)
    B, T = row["B"], row["T"]
    tokens = jax.random.randint(jax.random.key(0), (B, T + 1), 0, model.vocab_size)
    step = train_step(graphdef, optimizer)
    start = time.perf_counter()
    compiled = step.lower(params, opt_state, tokens).compile()
    result = {**row, "parameters": N, "compile_s": time.perf_counter() - start, "device": jax.devices()[0].device_kind}
    memory = compiled.memory_analysis()
    if memory is not None:
        result["step_memory_gib"] = (memory.argument_size_in_bytes + memory.temp_size_in_bytes
                                     + memory.output_size_in_bytes - memory.alias_size_in_bytes) / 2**30
    if row.get("compile_only"):
        return result
    state = {"params": params, "opt_state": opt_state}

    def run():
        state["params"], state["opt_state"], loss = compiled(state["params"], state["opt_state"], tokens)
        return loss

    seconds = statistics.median(timed(run, repeats))
    stats = jax.devices()[0].memory_stats() or {}
    rate = B * T / seconds
    result.update(step_s=seconds, tokens_per_s=rate, loss=float(run()),
                  peak_memory_gib=stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None,
                  mixer_flops_per_token=mixer_flops_per_token(config, T))
    if peak is not None:
        result["mfu_6n"] = 6 * N * rate / peak
        result["mfu_with_mixers"] = (6 * N + result["mixer_flops_per_token"]) * rate / peak
    try:
        result["trace"] = traced_ops(run, seconds)
    except Exception as error:  # noqa: BLE001  (a profiler that cannot trace here: the row says why)
        result["trace_failed"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    live = nnx.merge(graphdef, state["params"])  # the model's own arrays were donated to the first step
    del model, params, opt_state, compiled
    try:
        result["profile"] = profile(live, state["params"], state["opt_state"], optimizer, B, T, seconds, repeats)
    except Exception as error:  # noqa: BLE001  (the step's figures stay; the profile says why it is missing)
        result["profile_failed"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return result


def percent(value) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def report(results: list[dict], peak: float | None, skipped: list[str]) -> str:
    device = results[0].get("device") if results else jax.devices()[0].device_kind
    peak_text = f"{peak / 1e12:g} TFLOP/s bf16" if peak else "unknown (no MFU)"
    lines = [f"# Training steps on {device}", "",
             f"JAX {jax.__version__}; peak {peak_text}. Written by `benchmarks/tpu_train.py` (its docstring defines "
             "every column): bfloat16 compute, float32 parameters, AdamW, `remat=\"block\"`, layers scanned unless "
             "the row says unrolled. MFU 6N counts 6 · parameters per token; MFU+mix adds the mixers' own FLOPs.", "",
             "| row | params | step ms | tokens/s | MFU 6N | MFU+mix | step memory GiB | peak in use GiB | compile s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "failed" in r:
            lines.append(f"| {r['name']} | failed: {r['failed']} | | | | | | | |")
            continue
        step = f"{1e3 * r['step_s']:,.0f}" if "step_s" in r else "—"
        rate = f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "—"
        peak_mem = f"{r['peak_memory_gib']:.2f}" if r.get("peak_memory_gib") is not None else "—"
        step_mem = f"{r['step_memory_gib']:.2f}" if "step_memory_gib" in r else "—"
        lines.append(f"| {r['name']} | {r['parameters'] / 1e6:,.3g} M | {step} | {rate} | {percent(r.get('mfu_6n'))} "
                     f"| {percent(r.get('mfu_with_mixers'))} | {step_mem} | {peak_mem} | {r['compile_s']:.1f} |")
    profiled = [r for r in results if "profile" in r]
    if profiled:
        kinds = list(profiled[0]["profile"]["share"])
        lines += ["", "Share of the step (separate forward+backward programs of each part; see the docstring):", "",
                  "| row | " + " | ".join(kinds) + " |", "|---|" + "---:|" * len(kinds)]
        for r in profiled:
            lines.append(f"| {r['name']} | " + " | ".join(percent(r["profile"]["share"][k]) for k in kinds) + " |")
    for r in (r for r in results if r.get("trace", {}).get("kind_share")):
        kinds = ", ".join(f"{k} {percent(v)}" for k, v in list(r["trace"]["kind_share"].items())[:10])
        lines += ["", f"{r['name']}, one step under `jax.profiler` (the device's self time by kind of XLA op, as a "
                  f"share of the step): {kinds}.", "", "| longest ops (self time) | share |", "|---|---:|"]
        lines += [f"| `{op}` | {percent(v)} |" for op, v in r["trace"]["op_share"].items()]
    for r in results:
        if "trace_failed" in r:
            lines += ["", f"{r['name']}: no trace ({r['trace_failed']})."]
    for r in results:
        if "profile_failed" in r:
            lines += ["", f"{r['name']}: no profile ({r['profile_failed']})."]
    scanned = {r["model"]: r["compile_s"] for r in results if r["scan"] and r["T"] == 4096 and "compile_s" in r}
    for r in results:
        if not r["scan"] and "compile_s" in r and r["model"] in scanned:
            lines += ["", f"Cold compile of {r['model']} at T = {r['T']}: {scanned[r['model']]:.1f} s scanned, "
                      f"{r['compile_s']:.1f} s unrolled."]
    if skipped:
        lines += ["", f"Skipped (budget): {', '.join(skipped)}."]
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    """Tokens/s and each row's profile shares (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("tpu_train: no matplotlib, no PNG", file=sys.stderr)
        return
    profiled = [r for r in results if "profile" in r]
    if not profiled:
        return
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(profiled) + 1.5))
    left = np.zeros(len(profiled))
    for kind in profiled[0]["profile"]["share"]:
        shares = np.array([max(r["profile"]["share"][kind], 0) for r in profiled])
        ax.barh(np.arange(len(profiled)), shares * 100, left=left, label=kind)
        left += shares * 100
    ax.set_yticks(np.arange(len(profiled)),
                  [f"{r['name']} ({r['tokens_per_s']:,.0f} tok/s, MFU {percent(r.get('mfu_6n'))})" for r in profiled],
                  fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("% of the training step")
    ax.legend(fontsize=7, ncols=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for tpu_train.md, .json and .png")
    parser.add_argument("--budget", type=float, default=400, help="seconds; rows after it are skipped")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row (after one warm-up)")
    parser.add_argument("--rows", help="comma-separated row names to run (default: all, in priority order)")
    parser.add_argument("--peak-tflops", type=float, help="the chip's bf16 peak (default: recurrax.nn.PEAK_FLOPS)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (any machine, under a minute)")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    peak = args.peak_tflops * 1e12 if args.peak_tflops else PEAK_FLOPS.get(device.device_kind)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chosen = rows(args.smoke)
    if args.rows:
        names = [name.strip() for name in args.rows.split(",")]
        unknown = sorted(set(names) - {row["name"] for row in chosen})
        if unknown:
            parser.error(f"unknown rows {unknown}; the rows: {[row['name'] for row in chosen]}")
        chosen = [row for row in chosen if row["name"] in names]
    start, results, skipped = time.perf_counter(), [], []
    print(f"tpu_train: {len(chosen)} rows on {device.device_kind}, budget {args.budget:.0f} s", flush=True)
    longest = 0.0  # the longest row so far: a row that would end past the budget is not started
    for row in chosen:
        if time.perf_counter() - start + longest > args.budget:
            skipped.append(row["name"])
            print(f"tpu_train: budget spent, skipping {row['name']}", flush=True)
            continue
        print(f"tpu_train: {row['name']} ...", flush=True)
        row_start = time.perf_counter()
        try:
            results.append(measure(row, args.smoke, max(args.steps, 1), peak))
        except Exception as error:  # noqa: BLE001  (a row that fails is a row saying why)
            results.append({**row, "failed": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"})
        jax.clear_caches()
        longest = max(longest, time.perf_counter() - row_start)
        (out / "tpu_train.md").write_text(report(results, peak, skipped))
        (out / "tpu_train.json").write_text(json.dumps(results, indent=1, default=str))
        last = results[-1]
        summary = last.get("failed") or (f"compile {last['compile_s']:.1f} s" + (
            f", step {1e3 * last['step_s']:.1f} ms, {last['tokens_per_s']:,.0f} tokens/s, "
            f"MFU {percent(last.get('mfu_6n'))}"
            if "step_s" in last else ""))
        print(f"tpu_train: {row['name']}: {summary} (at {time.perf_counter() - start:.0f} s)", flush=True)
    (out / "tpu_train.md").write_text(report(results, peak, skipped))
    plot(results, out / "tpu_train.png")
    print(report(results, peak, skipped), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
