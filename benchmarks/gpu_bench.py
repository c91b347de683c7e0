"""The prepared accelerator run: check recurrax's kernels against the reference on the device,
time bf16 forward and forward+backward side by side with flash-linear-attention (fla) and
jax-linear-attention (jla), and write a markdown table and a PNG.

Run it through `benchmarks/gpu.sh` (or `benchmarks/tpu.sh`), which calls the steps in
separate processes — JAX with x64 for the float64 oracle, JAX without it for timing, PyTorch
for fla — and writes the report after each step, so a step killed by its timeout still
leaves a partial table:

    python benchmarks/gpu_bench.py check      --json /tmp/check.json
    python benchmarks/gpu_bench.py time-jax   --json /tmp/jax.json     # recurrax, XLA chunk, jla
    python benchmarks/gpu_bench.py time-torch --json /tmp/torch.json   # fla (PyTorch + Triton)
    python benchmarks/gpu_bench.py report     --json /tmp/*.json --out benchmarks/results/gpu.md

**Implementations.** recurrax's accelerator implementations are read from the registry: every
registered implementation whose backend is the one JAX runs on (on an H200: `pallas_gpu`,
and `mosaic_gpu` once registered; on a TPU: `pallas_tpu`; on a CPU, for `--smoke`:
`pallas_interpret`), plus the XLA `chunk` algorithm as the baseline every backend has.
Against them: fla's `chunk_simple_gla` (per-head decay `g`) and `chunk_gla` (per-key-channel
decay `gk`), and jla's `linear_attention("simple_gla" | "gla", impl="mosaic_gpu")`
(its Pallas Mosaic GPU kernels for Hopper).

**Inputs.** One input maker for all three libraries: `recurrax.tools.cases`
(`Case.benchmark(B, T, H, K, V, gates=..., dtype="bfloat16")`: standard normal q, k, v and
gates `log_sigmoid(normal) / 16`, all bf16, no initial state, scale K^-1/2); fla gets the very
same numbers as torch tensors. The forward returns the output and the final state in every
library; forward+backward differentiates `<output, d_output>` (d_output from
`make_cotangents`) with respect to q, k, v and the gate.

**Timing.** Compile / autotune and one more warm-up run first, then `--repeats` runs, each
ended by `jax.block_until_ready` or `torch.cuda.synchronize`; the median is reported.
Every measurement is guarded: one that fails is reported with its error, and a step starts
no new measurement past its `--budget` seconds.

**Check.** Each accelerator implementation against the `reference` implementation in
float64 through `recurrax.tools.cases.compare` (on a TPU, which has no float64, the reference
runs on the host CPU instead): every gate kind, packed variable-length input, reverse,
grouped heads, head dims 64 and 128, float32 and bfloat16. A call an implementation
declares it cannot take is reported as refused, with the reason its `Support` gives.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback

SHAPES = [(4, 4096, 16, 64, 64), (2, 8192, 16, 128, 128), (8, 2048, 32, 64, 64)]
"""(B, T, H, K, V) timed."""
SMOKE_SHAPES = [(1, 64, 2, 16, 16)]
GATES = {
    "g": ("per-head decay", "fla chunk_simple_gla", "simple_gla"),
    "gk": ("per-key-channel decay", "fla chunk_gla", "gla"),
}
"""Gate preset (of `recurrax.tools.cases.GATE_PRESETS`) → (words, fla op, jla kind)."""
MODES = ("fwd", "fwd+bwd")
BASELINE = "chunk"
"""The XLA chunk algorithm: timed beside the kernels on every backend."""


def _log(*args):
    print(*args, file=sys.stderr, flush=True)


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".replace("\n", " ")[:300]


class Step:
    """One step's results: a dict written to `--json` after every row (a checkpoint), and a
    time budget past which no new measurement starts."""

    def __init__(self, path: str, seconds: float, **result):
        self.path, self.end, self.result = path, time.monotonic() + seconds, result

    def left(self) -> bool:
        return time.monotonic() < self.end

    def add(self, table: str, row: dict) -> None:
        self.result.setdefault(table, []).append(row)
        _log(table, row)
        self.save()

    def save(self) -> None:
        with open(self.path, "w") as f:
            json.dump(self.result, f, indent=1, default=str)


def _shapes(args) -> list[tuple[int, ...]]:
    return SMOKE_SHAPES if args.smoke else SHAPES


def accelerator_implementations(args) -> tuple[list[str], str | None]:
    """recurrax's registered implementations for one backend (not those that run on `ANY`):
    `--backend`'s, default the one JAX runs on; with the reason when they cannot run here."""
    from recurrax import kernel_registry
    from recurrax.registry import current_backend

    here, wanted = current_backend(), args.backend or current_backend()
    names = [impl.name for impl in kernel_registry.implementations() if impl.backend.value == wanted]
    if not names:
        return [], f"no implementation for the {wanted} backend is registered"
    if wanted != here:
        return [], f"{', '.join(names)} need a {wanted.upper()}; JAX runs on {here} here"
    return names, None


def refusal(name: str, kwargs: dict) -> str | None:
    """Why implementation `name` declines these `recurrent` arguments (None: it takes them)."""
    from recurrax import kernel_registry

    (impl,) = [impl for impl in kernel_registry.implementations() if impl.name == name]
    return impl.refusal(request_of(kwargs))


# ----------------------------------------------------------------------------- check (JAX, x64)


def check_cases(smoke: bool) -> list:
    """The correctness cases, most telling first (the budget may cut the tail)."""
    from recurrax.tools.cases import Case

    small, large = (16, 32) if smoke else (64, 128)
    base = dict(B=1, T=40, H=2, Hkv=1) if smoke else dict(B=2, T=200, H=4, Hkv=2)
    packed = dict(base, B=1, cu_seqlens=(0, 3, 3, 30, 40) if smoke else (0, 3, 3, 100, 130, 400))
    cases = []
    for dtype in ("float32", "bfloat16"):  # the gate kinds the kernels take, packed, reverse, K = 128
        cases += [
            Case(**base, K=small, V=small, gates=("g_head",), dtype=dtype),
            Case(**base, K=small, V=small, gates=("gk",), dtype=dtype),
            Case(**packed, K=small, V=small, gates=("g_head", "gk"), dtype=dtype),
            Case(**base, K=large, V=small, gates=("gk",), reverse=True, dtype=dtype),
            Case(**base, K=large, V=large, gates=("g_head",), dtype=dtype),
        ]
    for gates in ((), ("g_gamma",), ("g_channel",), ("g_head", "gk"), ("gk", "gv")):  # the other kinds
        cases.append(Case(**base, K=small, V=small, gates=gates, dtype="float32"))
    cases += [
        Case(**base, K=large, V=large, gates=("gk",), dtype="float32"),
        Case(**packed, K=small, V=small, gates=("g_head",), reverse=True, dtype="float32"),
        Case(**base, K=small, V=small, gates=("g_channel",), gate_low=-20.0, dtype="float32"),
    ]
    return cases


def case_words(case) -> str:
    gates = "+".join(case.gates) or "none"
    extra = (" reverse" if case.reverse else "") + (f" gates≥{case.gate_low:g}" if case.gate_low != -1 else "")
    extra += f" cu_seqlens={list(case.cu_seqlens)}" if case.cu_seqlens else ""
    tokens = f"N{case.cu_seqlens[-1]}" if case.cu_seqlens else f"B{case.B} T{case.T}"
    return f"{tokens} H{case.H}/{case.Hkv} K{case.K} V{case.V} {gates} {case.dtype}{extra}"


def loose_keys(case) -> tuple[str, ...]:
    """Gradients reported but not held to the tolerance: gate gradients under strong decays,
    and g_gamma's (a sum over T of cancelling terms) in half precision."""
    if case.gate_low < -1:
        return ("dg", "dg_gamma", "dgk")
    return ("dg_gamma",) if case.dtype in ("bfloat16", "float16") else ()


def compare_on_host(name: str, case) -> dict[str, float]:
    """`recurrax.tools.cases.compare` with the float64 reference run on the host CPU (for a
    backend without float64, e.g. TPU): the same inputs, errors and floor."""
    import jax
    import numpy as np

    from recurrax.tools.cases import ZERO_FLOOR, make_inputs, max_rel_error, run_vjp

    cpu = jax.devices("cpu")[0]
    kwargs = make_inputs(case)
    o, state, grads = run_vjp(name, kwargs)
    with jax.default_device(cpu):
        exact = {k: (jax.device_put(np.asarray(v, np.float64), cpu) if hasattr(v, "dtype") and k != "cu_seqlens"
                     else v) for k, v in kwargs.items()}
        o_ref, state_ref, grads_ref = run_vjp("reference", exact)
    references = (o_ref, state_ref, *grads_ref.values())
    floor = max(ZERO_FLOOR * max(float(np.max(np.abs(np.asarray(y)), initial=0.0)) for y in references), 1e-30)
    errors = {"output": max_rel_error(o, o_ref, floor), "final_state": max_rel_error(state, state_ref, floor)}
    errors.update({"d" + k: max_rel_error(g, grads_ref[k], floor) for k, g in grads.items()})
    return errors


def check(args) -> None:
    import jax

    jax.config.update("jax_enable_x64", True)
    from recurrax import kernel_registry
    from recurrax.registry import current_backend
    from recurrax.tools.cases import Case, compare, default_tolerance, make_inputs

    backend = current_backend()
    kernels, reason = accelerator_implementations(args)
    names = kernels + ([BASELINE] if args.check_baseline else [])
    on_host = backend == "tpu" or args.oracle_on_host
    step = Step(args.json[0], args.budget, implementations=kernel_registry.names(), checked=names,
                oracle="reference, float64, " + ("host CPU" if on_host else backend), kernels_reason=reason)
    if reason:
        _log("kernels not checked:", reason)
    for case in check_cases(args.smoke):
        for name in names:
            row = dict(impl=name, case=case_words(case))
            if not step.left():
                step.add("check", {**row, "status": "skipped (time budget)"})
                continue
            start = time.monotonic()
            try:
                declined = refusal(name, make_inputs(case))
                if declined:
                    step.add("check", {**row, "status": "refused: " + declined})
                    continue
                errors = compare_on_host(name, case) if on_host else compare(name, case)
                tolerance = default_tolerance(case.dtype)
                worst = max(v for k, v in errors.items() if k not in loose_keys(case))
                row.update(errors=errors, status="ok" if worst <= tolerance else f"FAIL (tol {tolerance:g})")
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row["status"] = "ERROR " + _error(e)
            step.add("check", {**row, "seconds": round(time.monotonic() - start, 1)})
    dispatch = {}
    for gates in ("none", "g", "gk", "gk+gv"):
        kwargs = make_inputs(Case.benchmark(1, 64, 2, 64, 64, gates=gates, dtype="bfloat16"))
        dispatch[gates] = kernel_registry.get(None, request_of(kwargs)).name
    step.result["dispatch"] = dispatch
    step.save()


def request_of(kwargs: dict):
    """The registry's `Request` for `recurrent`'s keyword arguments (from `make_inputs`)."""
    from recurrax import Problem, Request

    arrays = {k: v for k, v in kwargs.items() if k not in ("reverse", "softmax_scale")}
    return Request.of(Problem.create(**arrays))


# ----------------------------------------------------------------------------- timing


def median_ms(run, sync, repeats: int) -> float:
    """Median wall milliseconds of `run(); sync()` after two warm-up calls (compile, autotune)."""
    for _ in range(2):
        run()
        sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(step: Step, row: dict, build, sync, repeats: int) -> None:
    """Time the callable `build()` returns into `row` (guarded, within the budget)."""
    if not step.left():
        step.add("timing", {**row, "status": "skipped (time budget)"})
        return
    try:
        row["ms"] = median_ms(build(), sync, repeats)
        row["status"] = "ok"
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row["status"] = "ERROR " + _error(e)
    step.add("timing", row)


def bench_case(shape, gate: str):
    from recurrax.tools.cases import Case

    return Case.benchmark(*shape, gates=gate, dtype="bfloat16")


def case_arrays(case):
    """(differentiable inputs, the other arguments, d_output) of a case, made once."""
    from recurrax.tools.cases import make_cotangents, make_inputs, split_args

    diff, rest = split_args(make_inputs(case))
    return diff, rest, make_cotangents(case)[0]


def jax_programs(forward, arrays):
    """Jitted (forward, forward+backward) of `forward(diff, rest) -> (output, final_state)` on
    `case_arrays`, and the differentiable inputs: forward+backward is the gradient of
    <output, d_output> with respect to every differentiable input."""
    import jax
    import jax.numpy as jnp

    diff, rest, d_output = arrays
    d_output = d_output.astype(jnp.float32)

    def loss(diff):
        return jnp.sum(forward(diff, rest)[0].astype(jnp.float32) * d_output)

    return jax.jit(lambda diff: forward(diff, rest)), jax.jit(jax.grad(loss)), diff


def recurrax_forward(name: str):
    from recurrax.tools.cases import call

    return lambda diff, rest: call(name, **diff, **rest)


def jla_forward(kind: str, impl: str):
    from jla.ops import linear_attention

    def forward(diff, rest):
        gate = diff["g"] if "g" in diff else diff["gk"]
        return linear_attention(kind, diff["query"], diff["key"], diff["value"], g=gate, impl=impl,
                                output_final_state=True)

    return forward


def jla_status(args) -> tuple[list[str], str | None]:
    """jla implementations to time, or why none."""
    if args.no_jla:
        return [], None
    try:
        import jla.ops  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return [], "jax-linear-attention unavailable: " + _error(e)
    return (["chunked"] if args.smoke else ["mosaic_gpu"]), None


def agreement(step: Step, shape, gate: str, outputs: dict) -> None:
    """Each timed implementation's forward output against XLA chunk's on the same inputs (max
    error relative to the largest value): the libraries compute the same function."""
    from recurrax.tools.cases import max_rel_error

    if BASELINE in outputs:
        for label, output in outputs.items():
            if label != BASELINE:
                step.add("agreement", dict(shape=list(shape), gate=gate, impl=label, vs=BASELINE,
                                           error=max_rel_error(output, outputs[BASELINE])))


def time_jax(args) -> None:
    import jax
    import numpy as np

    from recurrax.tools.bench.machine import machine_description

    jla_impls, jla_reason = jla_status(args)
    kernels, reason = accelerator_implementations(args)
    ours = kernels + [BASELINE]
    step = Step(args.json[0], args.budget, machine=machine_description(), devices=[str(d) for d in jax.devices()],
                recurrax_timed=ours, jla_timed=[f"jla {i}" for i in jla_impls], jla_reason=jla_reason,
                jla_version=_version("jax-linear-attention"), repeats=args.repeats, kernels_reason=reason)
    if reason:
        _log("kernels not timed:", reason)
    if jla_reason:
        _log("jla not timed:", jla_reason)
    sync = lambda: None  # noqa: E731  (each run ends in block_until_ready)
    for shape in _shapes(args):  # shape-major: a cut-off run still has whole shapes side by side
        for gate, (_, _, jla_kind) in GATES.items():
            arrays = case_arrays(bench_case(shape, gate))
            candidates = {name: recurrax_forward(name) for name in ours}
            candidates.update({f"jla {i}": jla_forward(jla_kind, i) for i in jla_impls})
            outputs = {}
            for label, forward in candidates.items():
                try:
                    programs = jax_programs(forward, arrays)
                except Exception as e:  # noqa: BLE001
                    programs = e
                for mode, index in zip(MODES, (0, 1)):

                    def build(programs=programs, index=index):
                        if isinstance(programs, Exception):
                            raise programs
                        fn, diff = programs[index], programs[2]
                        return lambda: jax.block_until_ready(fn(diff))

                    row = dict(shape=list(shape), gate=gate, mode=mode, impl=label)
                    measure(step, row, build, sync, args.repeats)
                    if mode == "fwd" and row["status"] == "ok":
                        outputs[label] = np.asarray(programs[0](programs[2])[0], np.float32)
            agreement(step, shape, gate, outputs)
    if not args.smoke and "pallas_gpu" in ours:
        tile_sweep(step, args)


TILE_SWEEP = [(block_v, warps) for block_v in (16, 32, 64) for warps in (4, 8)]


def tile_sweep(step: Step, args) -> None:
    """With the time left: pallas_gpu's forward+backward (per-channel decay, the K = V = 128
    shape) over a few tile choices, to check `recurrax.kernels.triton.gpu_tiles`."""
    import functools

    import jax

    from recurrax.kernels.triton import TritonTiles, gpu_tiles, triton_recurrent

    shape = SHAPES[1]
    default = gpu_tiles(shape[0], shape[2], shape[3], shape[4])
    arrays = case_arrays(bench_case(shape, "gk"))
    for block_v, warps in TILE_SWEEP:
        tiles = TritonTiles(default.chunk, default.sub, block_v, warps, default.num_stages)
        algorithm = functools.partial(triton_recurrent, tiles=tiles)

        def build(algorithm=algorithm):
            _, fwd_bwd, diff = jax_programs(recurrax_forward(algorithm), arrays)
            return lambda: jax.block_until_ready(fwd_bwd(diff))

        row = dict(shape=list(shape), gate="gk", mode="fwd+bwd", impl="pallas_gpu tiles", block_v=block_v,
                   num_warps=warps, default=tiles == default)
        if not step.left():
            return
        measure(step, row, build, lambda: None, args.repeats)
        step.result.setdefault("sweep", []).append(step.result["timing"].pop())
        step.save()


def time_torch(args) -> None:
    """fla on the same inputs (made by `recurrax.tools.cases` with JAX on the host CPU)."""
    os.environ["JAX_PLATFORMS"] = "cpu"  # JAX only makes the inputs here; the GPU is torch's
    step = Step(args.json[0], args.budget, repeats=args.repeats)
    try:
        import torch
        from fla.ops.gla import chunk_gla
        from fla.ops.simple_gla import chunk_simple_gla

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
    except Exception as e:  # noqa: BLE001
        step.result["fla_reason"] = "fla not timed: " + _error(e)
        _log(step.result["fla_reason"])
        step.save()
        return
    import numpy as np

    from recurrax.tools.cases import make_cotangents, make_inputs, max_rel_error

    step.result.update(gpu=torch.cuda.get_device_name(), fla_versions={
        n: _version(n) for n in ("torch", "triton", "fla-core", "flash-linear-attention")})
    ops = {"g": lambda q, k, v, g: chunk_simple_gla(q, k, v, g=g, output_final_state=True),
           "gk": lambda q, k, v, g: chunk_gla(q, k, v, g, output_final_state=True)}

    def tensor(x):
        return torch.from_numpy(np.asarray(x, np.float32)).cuda().to(torch.bfloat16)

    for shape in _shapes(args):
        for gate, (_, fla_name, _) in GATES.items():
            case = bench_case(shape, gate)
            kwargs = make_inputs(case)
            inputs = [tensor(kwargs[k]) for k in ("query", "key", "value", gate)]
            d_output = tensor(make_cotangents(case)[0])
            op = ops[gate]
            for mode in MODES:

                def build(op=op, mode=mode, inputs=inputs, d_output=d_output):
                    leaves = [x.detach().clone().requires_grad_(mode == "fwd+bwd") for x in inputs]

                    def run():
                        if mode == "fwd":
                            with torch.no_grad():
                                op(*leaves)
                        else:
                            for x in leaves:
                                x.grad = None
                            op(*leaves)[0].backward(d_output)

                    return run

                row = dict(shape=list(shape), gate=gate, mode=mode, impl=fla_name)
                measure(step, row, build, torch.cuda.synchronize, args.repeats)
            try:
                with torch.no_grad():
                    output = op(*inputs)[0][:1, :AGREEMENT_TOKENS].float().cpu().numpy()
                error = max_rel_error(output, host_output(kwargs, gate))
                step.add("agreement", dict(shape=list(shape), gate=gate, impl=fla_name, vs=BASELINE + " (host, "
                                           f"first row, first {AGREEMENT_TOKENS} tokens, float32)", error=error))
            except Exception as e:  # noqa: BLE001
                step.add("agreement", dict(shape=list(shape), gate=gate, impl=fla_name, error=None, status=_error(e)))
            del inputs, d_output


AGREEMENT_TOKENS = 256


def host_output(kwargs: dict, gate: str):
    """XLA chunk's output (float32, on the host CPU) for the first row and the first
    `AGREEMENT_TOKENS` tokens of `kwargs` (a causal recurrence: they need no later token)."""
    import numpy as np

    from recurrax.tools.cases import call

    cut = {k: np.asarray(kwargs[k][:1, :AGREEMENT_TOKENS], np.float32) for k in ("query", "key", "value", gate)}
    return np.asarray(call(BASELINE, **cut)[0])


def _version(name: str) -> str | None:
    import importlib.metadata as md

    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


# ----------------------------------------------------------------------------- report


def load(paths) -> dict:
    data = {"timing": [], "check": [], "agreement": []}
    for path in paths:
        if os.path.exists(path) and os.path.getsize(path):
            with open(path) as f:
                part = json.load(f)
            for table in ("timing", "check", "agreement"):
                data[table] += part.pop(table, [])
            data.update(part)
    return data


def timing_columns(data: dict) -> tuple[list[str], list[str], list[str]]:
    """(recurrax columns, other libraries' columns, all in order) present in the data."""
    seen = list(dict.fromkeys(r["impl"] for r in data["timing"]))
    ours = [n for n in data.get("recurrax_timed", []) if n in seen] or [
        n for n in seen if not n.startswith(("fla", "jla"))]
    others = [n for n in seen if n.startswith(("fla", "jla"))]
    return ours, others, ours + others


def timing_table(data: dict, shapes) -> list[str]:
    """One row per shape × decay × mode; ms per implementation; ratios other / best recurrax
    kernel (> 1: recurrax is faster)."""
    ours, others, columns = timing_columns(data)
    kernels = [n for n in ours if n != BASELINE] or ours
    cells = {(tuple(r["shape"]), r["gate"], r["mode"], "fla" if r["impl"].startswith("fla") else r["impl"]): r
             for r in data["timing"]}
    other_names = list(dict.fromkeys("fla" if n.startswith("fla") else n for n in others))
    header = ["B, T, H, K, V", "decay", "mode", *ours, *other_names, "best recurrax",
              *(f"{n} / recurrax" for n in other_names)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 3 + "---:|" * (len(header) - 3)]
    for shape in shapes:
        for gate in GATES:
            for mode in MODES:
                get = lambda n: cells.get((tuple(shape), gate, mode, n))  # noqa: E731
                ms = {n: get(n)["ms"] for n in ours + other_names if get(n) and get(n).get("status") == "ok"}

                def text(n):
                    r = get(n)
                    if r is None:
                        return "—"
                    return f"{r['ms']:.3f}" if n in ms else r.get("status", "?")[:60]

                best = min((n for n in kernels if n in ms), key=ms.get, default=None)
                ratios = [f"{ms[n] / ms[best]:.2f}×" if best and n in ms else "—" for n in other_names]
                lines.append("| " + " | ".join([", ".join(map(str, shape)), gate, mode, *map(text, ours + other_names),
                                                f"`{best}`" if best else "—", *ratios]) + " |")
    return lines


def check_table(rows) -> list[str]:
    out = ["| implementation | case | status | worst output/gradient error | gate gradients |", "|---|---|---|---|---|"]
    gate_keys = ("dg", "dg_gamma", "dgk", "dgv")
    for r in rows:
        errors = r.get("errors") or {}
        rest = {k: v for k, v in errors.items() if k not in gate_keys}
        worst = max(rest.items(), key=lambda kv: kv[1]) if rest else None
        worst_text = f"{worst[0]} {worst[1]:.1e}" if worst else ""
        gates_text = ", ".join(f"{k} {errors[k]:.1e}" for k in gate_keys if k in errors)
        out.append(f"| {r['impl']} | {r['case']} | {r['status'][:120]} | {worst_text} | {gates_text} |")
    return out


def plot(data: dict, shapes, path: str) -> str | None:
    """Grouped bars (log ms) per shape × decay × mode, one bar per implementation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: {e}"
    _, _, columns = timing_columns(data)
    ms = {(tuple(r["shape"]), r["gate"], r["mode"], r["impl"]): r["ms"] for r in data["timing"] if r.get("status") == "ok"}
    groups = [(tuple(s), g, m) for s in shapes for g in GATES for m in MODES]
    if not ms:
        return "no plot: no timing"
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(groups)), 4.5))
    width = 0.8 / max(1, len(columns))
    for i, name in enumerate(columns):
        xs = [j + i * width for j, key in enumerate(groups) if (*key, name) in ms]
        ys = [ms[(*key, name)] for key in groups if (*key, name) in ms]
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))],
                  [f"{','.join(map(str, s))}\n{g} {m}" for s, g, m in groups], fontsize=7)
    ax.set(yscale="log", ylabel="ms (median)", title="bf16 forward and forward+backward (lower is better)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def report(args) -> None:
    data = load(args.json)
    shapes = _shapes(args)
    machine = data.get("machine", {})
    backend = machine.get("backend", "?")
    title = args.title or {"gpu": "GPU", "cuda": "GPU", "tpu": "TPU", "?": "GPU"}.get(backend, backend.upper())
    png = os.path.splitext(args.out)[0] + ".png"
    others = any(r["impl"].startswith(("fla", "jla")) for r in data["timing"]) or data.get("fla_reason") \
        or data.get("jla_reason")
    lines = [f"# {title} results: recurrax's kernels vs XLA chunk" + (" vs fla vs jax-linear-attention" if others else ""),
             ""]
    if args.smoke:
        lines += ["**Smoke run (`--smoke`): tiny shapes on whatever backend was there — the figures mean nothing.**", ""]
    lines += [
        f"Written by `benchmarks/{'tpu' if title == 'TPU' else 'gpu'}.sh` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
        f" (commit {machine.get('commit', '?')}). Device: {', '.join(data.get('devices', [])) or '?'}"
        f"{'; ' + data['gpu'] if data.get('gpu') else ''}. "
        + ", ".join(f"{k} {v}" for k, v in {"Python": machine.get("python", platform.python_version()),
                                           "JAX": machine.get("jax", "?"), **data.get("fla_versions", {}),
                                           "jax-linear-attention": data.get("jla_version")}.items() if v) + ".",
        "",
        f"## Timing (ms, median of {data.get('repeats', '?')} runs after warm-up; bf16 q, k, v, gates; no initial state)",
        "",
        "Inputs from `recurrax.tools.cases.Case.benchmark(..., dtype=\"bfloat16\")`, the same numbers in every library.",
        "fwd returns output and final state; fwd+bwd is the gradient of <output, d_output> w.r.t. q, k, v and the gate.",
    ]
    if others:
        lines += [
            "Ratios are the other library's time over the fastest recurrax kernel's (> 1: recurrax is faster).",
            "Decay `g`: per head (fla `chunk_simple_gla`, jla `simple_gla`); `gk`: per key channel (fla `chunk_gla`, "
            "jla `gla`).",
        ]
    lines += [""]
    for key in ("kernels_reason", "jla_reason", "fla_reason"):
        if data.get(key):
            lines += [f"- not timed: {data[key]}"]
    lines += ["", *timing_table(data, shapes), "", f"![timing]({os.path.basename(png)})", ""]
    if data.get("sweep"):
        lines += ["## Tile sweep (`pallas_gpu`, per-channel decay, fwd+bwd, ms)", "",
                  "| B, T, H, K, V | block_v | num_warps | ms | default |", "|---|---|---|---:|---|"]
        for r in data["sweep"]:
            ms = f"{r['ms']:.3f}" if r.get("status") == "ok" else r.get("status", "?")[:80]
            lines.append(f"| {', '.join(map(str, r['shape']))} | {r['block_v']} | {r['num_warps']} | {ms} | "
                         f"{'yes' if r.get('default') else ''} |")
        lines.append("")
    if data.get("agreement"):
        lines += ["## Same function? (forward output vs XLA chunk on the same bf16 inputs, max error relative to "
                  "the largest value)", "", "| B, T, H, K, V | decay | implementation | vs | error |",
                  "|---|---|---|---|---:|"]
        for r in data["agreement"]:
            error = f"{r['error']:.1e}" if r.get("error") is not None else r.get("status", "?")[:80]
            lines.append(f"| {', '.join(map(str, r['shape']))} | {r['gate']} | {r['impl']} | {r.get('vs', '')} | {error} |")
        lines.append("")
    lines += [f"## Correctness on the device (max error relative to the largest reference value; oracle: "
              f"{data.get('oracle', '?')})", ""]
    lines += check_table(data["check"]) if data["check"] else ["(not run)"]
    if data.get("dispatch"):
        lines += ["", "Dispatch with `implementation=None` here (bf16, K = V = 64): "
                  + ", ".join(f"{k} → `{v}`" for k, v in data["dispatch"].items()) + "."]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    problem = plot(data, shapes, png)
    if problem:
        lines += ["", f"({problem})"]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=["check", "time-jax", "time-torch", "report"])
    parser.add_argument("--json", nargs="+", required=True, help="the step's output (report: its inputs)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gpu.md"),
                        help="report: the markdown (the PNG goes beside it)")
    parser.add_argument("--budget", type=float, default=170.0, help="seconds after which no new work starts")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (default 10)")
    parser.add_argument("--no-jla", action="store_true", help="time-jax: skip jax-linear-attention")
    parser.add_argument("--check-baseline", action="store_true", help="check: XLA chunk too")
    parser.add_argument("--oracle-on-host", action="store_true", help="check: float64 reference on the CPU")
    parser.add_argument("--backend", choices=["gpu", "tpu"], help="whose kernels (default: the backend JAX runs on)")
    parser.add_argument("--title", help="report: the heading's first word (default from the backend)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: try the script on a CPU in seconds")
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 2 if args.smoke else 10
    step = {"check": check, "time-jax": time_jax, "time-torch": time_torch, "report": report}[args.step]
    step(args)


if __name__ == "__main__":
    main()
