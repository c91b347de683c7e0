"""The prepared GPU run (issue 6, item 3): check every kernel against the reference on
the GPU, time forward and forward+backward (bf16) of the Pallas kernels, XLA chunk and
flash-linear-attention, and write `benchmarks/results/gpu.md`.

Run it through `benchmarks/gpu.sh`, which calls the steps in separate processes (JAX with
x64 for the float64 oracle, JAX without it for timing, PyTorch for fla) and then `report`:

    python benchmarks/gpu_bench.py check    --json /tmp/check.json
    python benchmarks/gpu_bench.py time-jax --json /tmp/jax.json
    python benchmarks/gpu_bench.py time-fla --json /tmp/fla.json
    python benchmarks/gpu_bench.py report   --json /tmp/check.json /tmp/jax.json /tmp/fla.json --out benchmarks/results/gpu.md

Every measurement is guarded: a kernel that fails to compile or run is reported with its
error instead of stopping the run, and each step stops starting new work past its
`--budget` seconds, so a partial table still comes back.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
import traceback

SHAPES = [(4, 4096, 16, 64, 64), (8, 2048, 32, 128, 128), (1, 16384, 8, 128, 128)]
"""(B, T, H, K, V) from issue 6."""
GATES = {"head": "per-head g (fla chunk_simple_gla)", "key": "per-channel gk (fla chunk_gla)"}
REPEATS = 10
PALLAS = "pallas_gpu"
"""The Pallas implementation under test; `--smoke` swaps in `pallas_interpret` to try this
script on a CPU with tiny shapes."""


def _import_algorithms():
    """recurrax with every algorithm registered (the Pallas kernels, and XLA chunk if present)."""
    import importlib

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    import recurrax

    for module in ("recurrax.chunk", "recurrax.pallas"):
        try:
            importlib.import_module(module)
        except ImportError as e:
            _log(f"{module} not available: {e}")
    return recurrax


def _log(*args):
    print(*args, file=sys.stderr, flush=True)


def _error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text[:300]


_PARTIAL = {"path": None}


def _checkpoint(**result):
    """Write what a step has so far, so a step killed by its timeout still reports."""
    if _PARTIAL["path"]:
        with open(_PARTIAL["path"], "w") as f:
            json.dump(result, f, indent=1, default=str)


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> bool:
        return time.monotonic() < self.end


# ----------------------------------------------------------------------------- check (JAX, x64)


def check(args) -> dict:
    import jax

    jax.config.update("jax_enable_x64", True)
    recurrax = _import_algorithms()
    from recurrax._inputs import request_of
    from recurrax._testing import Case, canonical, compare, default_tolerance, make_inputs

    budget = Budget(args.budget)
    names = recurrax.kernel_registry.names()
    base = dict(B=2, T=200, H=4, Hkv=2) if not args.smoke else dict(B=1, T=20, H=2, Hkv=1)
    wide, narrow = (64, 128) if not args.smoke else (16, 32)
    cases = []
    for dtype in ("float32", "bfloat16"):
        for gates in [(), ("g_head", "g_gamma"), ("g_channel",), ("g_head", "gk")]:
            cases.append(Case(**base, K=wide, V=wide, gates=gates, dtype=dtype))
        cases.append(Case(**base, K=narrow, V=max(16, wide // 2), gates=("gk",), reverse=True, dtype=dtype))
        cases.append(Case(**base, K=wide, V=wide, gates=("g_channel",), gate_low=-20.0, dtype=dtype))
        cu = (0, 3, 3, 100, 130, 400) if not args.smoke else (0, 3, 3, 20)
        cases.append(Case(**{**base, "B": 1}, K=wide, V=wide, gates=("g_head", "gk"), cu_seqlens=cu, dtype=dtype))
    impls = [n for n in (PALLAS, "chunk") if n in names]
    rows = []
    for impl in impls:
        for case in cases:
            if not budget.left():
                rows.append(dict(impl=impl, case=_case_words(case), status="skipped (time budget)"))
                continue
            t0 = time.monotonic()
            try:
                errors = compare(impl, case)
                tol = default_tolerance(case.dtype)
                worst = max(v for k, v in errors.items() if k not in _loose(case))
                status = "ok" if worst <= tol else f"FAIL (tol {tol:g})"
                rows.append(dict(impl=impl, case=_case_words(case), errors=errors, status=status,
                                 seconds=round(time.monotonic() - t0, 1)))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                rows.append(dict(impl=impl, case=_case_words(case), status="ERROR " + _error(e)))
            _log(rows[-1].get("impl"), rows[-1].get("case"), rows[-1].get("status"))
            _checkpoint(check=rows)

    dispatch = {}
    for gates in [(), ("g_head",), ("gk",), ("gv",)]:
        problem, _, _ = canonical(make_inputs(Case(B=1, T=64, H=2, Hkv=2, K=64, V=64, gates=gates, dtype="bfloat16")))
        dispatch["+".join(gates) or "none"] = recurrax.kernel_registry.get(None, request_of(problem)).name
    return dict(check=rows, dispatch=dispatch, implementations=names)


def _loose(case) -> tuple[str, ...]:
    """Gradients reported but not held to the tolerance (see tests/test_pallas.py): gate
    gradients under strong decays, and g_gamma's (a sum over T of cancelling terms) in
    half precision."""
    if case.gate_low < -1:
        return ("dg", "dg_gamma", "dgk")
    return ("dg_gamma",) if case.dtype in ("bfloat16", "float16") else ()


def _case_words(case) -> str:
    gates = "+".join(case.gates) or "none"
    extra = (" reverse" if case.reverse else "") + (f" gates≥{case.gate_low:g}" if case.gate_low != -1 else "")
    extra += f" cu_seqlens={list(case.cu_seqlens)}" if case.cu_seqlens else ""
    return f"B{case.B} T{case.T} H{case.H}/{case.Hkv} K{case.K} V{case.V} {gates} {case.dtype}{extra}"


# ----------------------------------------------------------------------------- timing helpers


def _median_ms(fn, sync, repeats: int = REPEATS) -> float:
    fn()
    sync()  # compile / autotune
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _measure(rows: list, row: dict, budget: Budget, run, sync, checkpoint: str | None = None) -> None:
    """Time `run` into `row` (median ms) and append it to `rows`: skipped past the budget, and
    an error recorded (not raised) if it fails; then log it and checkpoint `rows` as `checkpoint`."""
    if not budget.left():
        rows.append({**row, "status": "skipped (time budget)"})
        return
    try:
        row["ms"] = _median_ms(run(), sync)
        row["status"] = "ok"
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row["status"] = "ERROR " + _error(e)
    rows.append(row)
    _log(row)
    if checkpoint:
        _checkpoint(**{checkpoint: rows})


# ----------------------------------------------------------------------------- time-jax


def time_jax(args) -> dict:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    recurrax = _import_algorithms()
    budget = Budget(args.budget)
    names = recurrax.kernel_registry.names()
    impls = [n for n in (PALLAS, "chunk") if n in names]
    rows = []
    for impl in impls:  # the Pallas kernels first: the comparison with fla matters most
        forward = functools.partial(_recurrent, recurrax, impl)
        for shape in SHAPES:
            q, k, v, do, gates = _jax_inputs(shape)
            for gate, g in gates.items():
                for mode in ("fwd", "fwd+bwd"):

                    def run(forward=forward, mode=mode, g=g):
                        fn = _jax_fn(forward, mode)
                        return lambda: jax.block_until_ready(fn(q, k, v, g, do))  # noqa: B023

                    row = dict(shape=shape, gate=gate, impl=impl, mode=mode)
                    _measure(rows, row, budget, run, lambda: None, checkpoint="jax")
    return dict(jax=rows, sweep=_sweep(budget) if PALLAS == "pallas_gpu" else [],
                jax_version=jax.__version__, devices=[str(d) for d in jax.devices()])


SWEEP = [dict(block_v=bv, num_warps=w) for bv in (16, 32, 64) for w in (4, 8)]


def _sweep(budget: Budget) -> list[dict]:
    """With the time left: fwd+bwd of the per-channel kernels on one shape over a few
    tile choices, to check `recurrax.pallas.gpu_tiles` (chosen from offline compiles)."""
    import jax

    from recurrax._testing import call
    from recurrax.pallas import gpu_tiles, pallas_chunk_recurrent

    B, T, H, K, V = SHAPES[1]
    q, k, v, do, gates = _jax_inputs(SHAPES[1], seed=1)
    g = gates["key"]
    rows = []
    for tiles in SWEEP:
        row = dict(shape=(B, T, H, K, V), gate="key", mode="fwd+bwd", **tiles,
                   default=tiles["block_v"] == gpu_tiles(B, H, K, V)["block_v"] and tiles["num_warps"] == 8)
        algorithm = functools.partial(pallas_chunk_recurrent, target="triton", chunk_size=64, sub_size=16, **tiles)

        def run(algorithm=algorithm):
            fn = _jax_fn(lambda q, k, v, g: call(algorithm, query=q, key=k, value=v, g=g), "fwd+bwd")
            return lambda: jax.block_until_ready(fn(q, k, v, g, do))

        _measure(rows, row, budget, run, lambda: None)
    return rows


def _jax_inputs(shape, seed: int = 0):
    """bf16 q, k, v, do and float32 gates (log-sigmoid, mostly near 0) for one shape."""
    import jax
    import jax.numpy as jnp

    B, T, H, K, V = shape
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (B, T, H, K), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, T, H, K), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, T, H, V), jnp.bfloat16)
    do = jax.random.normal(keys[3], (B, T, H, V), jnp.bfloat16)
    gates = {
        "head": jax.nn.log_sigmoid(jax.random.normal(keys[4], (B, T, H), jnp.float32) + 4.0),
        "key": jax.nn.log_sigmoid(jax.random.normal(keys[4], (B, T, H, K), jnp.float32) + 4.0),
    }
    return q, k, v, do, gates


def _recurrent(recurrax, impl: str, q, k, v, g):
    return recurrax.recurrent(q, k, v, g=g, implementation=impl)


def _jax_fn(forward, mode: str):
    """The jitted program timed for `mode`: `forward(q, k, v, g) -> (o, state)` itself, or the
    gradients of <o, do> with respect to q, k, v and g. Both take (q, k, v, g, do)."""
    import jax
    import jax.numpy as jnp

    if mode == "fwd":
        return jax.jit(lambda q, k, v, g, do: forward(q, k, v, g))

    def loss(q, k, v, g, do):
        o, _ = forward(q, k, v, g)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


# ----------------------------------------------------------------------------- time-fla


def time_fla(args) -> dict:
    budget = Budget(args.budget)
    try:
        import torch
        import torch.nn.functional as F
        from fla.ops.gla import chunk_gla
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as e:  # noqa: BLE001
        return dict(fla=[], fla_error="flash-linear-attention unavailable: " + _error(e))
    import importlib.metadata as md

    versions = {}
    for name in ("torch", "triton", "fla-core", "flash-linear-attention"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    dev = "cuda"
    rows = []
    for shape in SHAPES:
        B, T, H, K, V = shape
        gen = torch.Generator(device=dev).manual_seed(0)
        randn = lambda *s: torch.randn(*s, device=dev, generator=gen)  # noqa: E731
        q, k = randn(B, T, H, K).bfloat16(), randn(B, T, H, K).bfloat16()
        v, do = randn(B, T, H, V).bfloat16(), randn(B, T, H, V).bfloat16()
        gates = {"head": F.logsigmoid(randn(B, T, H) + 4.0), "key": F.logsigmoid(randn(B, T, H, K) + 4.0)}
        for gate, g in gates.items():
            op = (lambda q, k, v, g: chunk_simple_gla(q, k, v, g=g)[0]) if gate == "head" else (
                lambda q, k, v, g: chunk_gla(q, k, v, g)[0])
            impl = "fla chunk_simple_gla" if gate == "head" else "fla chunk_gla"
            for mode in ("fwd", "fwd+bwd"):

                def run(op=op, mode=mode, g=g):
                    leaves = [x.detach().clone().requires_grad_(mode == "fwd+bwd") for x in (q, k, v, g)]

                    def step():
                        if mode == "fwd":
                            with torch.no_grad():
                                op(*leaves)
                        else:
                            for x in leaves:
                                x.grad = None
                            op(*leaves).backward(do)

                    return step

                row = dict(shape=shape, gate=gate, impl=impl, mode=mode)
                _measure(rows, row, budget, run, torch.cuda.synchronize, checkpoint="fla")
    return dict(fla=rows, fla_versions=versions, gpu=torch.cuda.get_device_name())


# ----------------------------------------------------------------------------- offline compile


def offline(args) -> dict:
    """Compile the Triton kernels for sm_90 on a machine without a GPU and report what
    ptxas says (registers, spills, shared memory, compile time) per configuration.

    Needs the `triton` package (which bundles ptxas) importable, e.g. `pip install
    --target /tmp/tritonpkg triton` and `PYTHONPATH=/tmp/tritonpkg`. The Triton IR comes
    from JAX's Pallas lowering (`lowering_platforms=("cuda",)`), captured per kernel.
    """
    import glob
    import subprocess
    import tempfile

    import jax
    import jax.numpy as jnp
    import triton
    from jax._src.pallas.triton import pallas_call_registration as registration
    from triton.backends.compiler import GPUTarget

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    from recurrax._inputs import canonicalize
    from recurrax.pallas import pallas_chunk_recurrent

    captured = []
    lower_module = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        result = lower_module(*a, **k)
        captured.append(result.module.operation.get_asm(enable_debug_info=False))
        return result

    registration.lowering.lower_jaxpr_to_triton_module = capture
    ptxas = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))[0]
    budget, rows = Budget(args.budget), []
    for config in args.configs:
        gate, K, V, chunk, sub, block_v, warps, stages, *packed = config.split(",")
        K, V, chunk, sub, block_v, warps, stages = map(int, (K, V, chunk, sub, block_v, warps, stages))
        cu_seqlens = jnp.asarray([0, chunk + 3, 4 * chunk], jnp.int32) if packed else None
        captured.clear()

        def loss(q, k, v, g, h0):
            g = None if gate == "none" else (g[..., 0] if gate == "head" else g)
            problem, cfg, _ = canonicalize(q, k, v, g, None, None, None, None, h0, False, cu_seqlens)
            o, s = pallas_chunk_recurrent(problem, scale=cfg.scale, reverse=False, chunk_size=chunk,
                                          sub_size=sub, block_v=block_v, num_warps=warps, num_stages=stages)
            return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

        S = jax.ShapeDtypeStruct
        B, T, H = 1, 4 * chunk, 2
        R = B if cu_seqlens is None else 2
        avals = (S((B, T, H, K), jnp.bfloat16), S((B, T, H, K), jnp.bfloat16), S((B, T, H, V), jnp.bfloat16),
                 S((B, T, H, K), jnp.float32), S((R, H, K, V), jnp.float32))
        jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))).trace(*avals).lower(lowering_platforms=("cuda",))
        for name, ir in zip(("fwd", "states", "bwd"), list(captured)):
            row = dict(config=config, kernel=name)
            if not budget.left():
                rows.append({**row, "status": "skipped (time budget)"})
                continue
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, f"{name}.ttir")
                with open(path, "w") as f:
                    f.write(ir)
                t0 = time.monotonic()
                try:
                    kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                            options={"num_warps": warps, "num_stages": stages})
                    row["compile_s"] = round(time.monotonic() - t0, 1)
                    row["shared_bytes"] = kernel.metadata.shared
                    with open(os.path.join(tmp, "k.ptx"), "w") as f:
                        f.write(kernel.asm["ptx"])
                    info = subprocess.run([ptxas, "-arch=sm_90a", "-v", os.path.join(tmp, "k.ptx"), "-o", os.devnull],
                                          capture_output=True, text=True).stderr
                    row["ptxas"] = " ".join(line.split(":", 1)[-1].strip() for line in info.splitlines()
                                            if "registers" in line or "spill" in line)
                    row["status"] = "ok" if kernel.metadata.shared <= 232448 else "TOO MUCH SHARED MEMORY (> 227 KiB)"
                except Exception as e:  # noqa: BLE001
                    row["status"] = "ERROR " + _error(e)
            rows.append(row)
            _log(row)
    return dict(offline=rows)


# ----------------------------------------------------------------------------- report


def report(args) -> str:
    data = {}
    for path in args.json:
        if os.path.exists(path):
            with open(path) as f:
                data.update(json.load(f))
    lines = ["# GPU results: Pallas chunk kernels vs XLA chunk vs flash-linear-attention", ""]
    lines.append(f"Written by `benchmarks/gpu.sh` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.")
    lines.append(f"GPU: {data.get('gpu', '?')}; JAX {data.get('jax_version', '?')} ({', '.join(data.get('devices', []))}); "
                 f"{', '.join(f'{k} {v}' for k, v in data.get('fla_versions', {}).items())}; "
                 f"Python {platform.python_version()}.")
    if "fla_error" in data:
        lines.append(f"\n**{data['fla_error']}**")
    lines += ["", "## Timing (bf16 inputs, float32 gates, no initial state; median of "
              f"{REPEATS} runs after warm-up, ms)", ""]
    timed = data.get("jax", []) + data.get("fla", [])
    lines += _timing_table(timed)
    lines += ["", "## Correctness on the GPU (max error relative to the largest reference value, float64 oracle)", ""]
    lines += _check_table(data.get("check", []))
    if data.get("sweep"):
        lines += ["", "## Tile sweep (pallas_gpu, per-channel decay, fwd+bwd, ms; C = 64, c = 16)", "",
                  "| B, T, H, K, V | block_v | num_warps | ms | default |", "|---|---|---|---|---|"]
        for r in data["sweep"]:
            ms = f"{r['ms']:.3f}" if r.get("status") == "ok" else r.get("status", "?")[:80]
            lines.append(f"| {', '.join(map(str, r['shape']))} | {r['block_v']} | {r['num_warps']} | {ms} | "
                         f"{'yes' if r.get('default') else ''} |")
    if data.get("dispatch"):
        lines += ["", "Dispatch with `implementation=None` on this GPU (bf16, K=V=64): "
                  + ", ".join(f"{k} → `{v}`" for k, v in data["dispatch"].items()) + "."]
    text = "\n".join(lines) + "\n"
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    return text


def _timing_table(rows) -> list[str]:
    out = [f"| B, T, H, K, V | decay | mode | {PALLAS} | XLA chunk | fla | fla / pallas |",
           "|---|---|---|---|---|---|---|"]
    cell = {}
    for r in rows:
        impl = "fla" if r["impl"].startswith("fla") else r["impl"]
        cell[(tuple(r["shape"]), r["gate"], r["mode"], impl)] = (
            f"{r['ms']:.3f}" if r.get("status") == "ok" else r.get("status", "?")[:80])
    for shape in SHAPES:
        for gate in GATES:
            for mode in ("fwd", "fwd+bwd"):
                get = lambda impl: cell.get((tuple(shape), gate, mode, impl), "—")  # noqa: E731
                ours, fla = get(PALLAS), get("fla")
                try:
                    ratio = f"{float(fla) / float(ours):.2f}×"
                except ValueError:
                    ratio = "—"
                out.append(f"| {', '.join(map(str, shape))} | {gate} | {mode} | {ours} | {get('chunk')} | {fla} | {ratio} |")
    return out


def _check_table(rows) -> list[str]:
    out = ["| implementation | case | status | worst output/gradient error | gate gradients |", "|---|---|---|---|---|"]
    gate_keys = ("dg", "dg_gamma", "dgk")
    for r in rows:
        errors = r.get("errors") or {}
        rest = {k: v for k, v in errors.items() if k not in gate_keys}
        worst = max(rest.items(), key=lambda kv: kv[1]) if rest else None
        worst_text = f"{worst[0]} {worst[1]:.1e}" if worst else ""
        gates_text = ", ".join(f"{k} {errors[k]:.1e}" for k in gate_keys if k in errors)
        out.append(f"| {r['impl']} | {r['case']} | {r['status']} | {worst_text} | {gates_text} |")
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=["check", "time-jax", "time-fla", "report", "offline"])
    parser.add_argument("--configs", nargs="+", default=["key,128,128,64,16,64,4,2"],
                        help="offline: gate,K,V,chunk,sub,block_v,num_warps,num_stages[,packed]")
    parser.add_argument("--json", nargs="+", default=[])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gpu.md"))
    parser.add_argument("--budget", type=float, default=170.0, help="seconds after which no new work starts")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode: try the script on a CPU")
    args = parser.parse_args(argv)
    if args.smoke:
        global SHAPES, PALLAS, REPEATS
        SHAPES, PALLAS, REPEATS = [(1, 64, 2, 16, 16)], "pallas_interpret", 2
    if args.step == "report":
        print(report(args))
        return
    _PARTIAL["path"] = args.json[0]
    result = {"check": check, "time-jax": time_jax, "time-fla": time_fla, "offline": offline}[args.step](args)
    with open(args.json[0], "w") as f:
        json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
