"""Where a chunk kernel's grid step spends its time on a TPU: three forms of the per-head-decay
forward (`recurrent` with `g`), timed side by side on one chip (issue 45).

    source benchmarks/tpu_env.sh && python3 benchmarks/tpu_kernel_probe.py --out benchmarks/results
    python benchmarks/tpu_kernel_probe.py --smoke --out /tmp/p     # any machine: interpret mode, tiny

Every form reads head-major q, k, kᵀ, v [B, H, T, D] (bf16) and the chunk-local cumulative log
decay as rows [B, H, 1, T] (float32), writes o [B, H, T, V], on the grid (b, head block, chunk)
with the chunk axis sequential and the state S [Hb, K, V] float32 in VMEM across it:

| form      | a grid step                                                                  |
|-----------|------------------------------------------------------------------------------|
| `copy`    | o = q + k + v: the DMA and grid-step floor of these blocks, no maths          |
| `loop`    | the chunk maths once per head, 2-D matmuls, heads one after another (today)  |
| `batched` | the same maths once for all Hb heads, 3-D matmuls batched over heads          |
| `undecayed` | `batched` with every decay 0 (e^0 = 1): what the decays' element-wise work costs |

    scores = (q kᵀ) ⊙ D,  D_ij = e^{A_i − A_j} (j ≤ i)
    o      = scale · [ (q ⊙ e^{A}) S + scores v ]
    S'     = e^{A_C} S + (kᵀ ⊙ e^{A_C − A}) v

Also timed: `xla`, the same operation in plain XLA with every chunk's intra-chunk work at once
(state-independent terms batched over chunks, the state pass a `lax.scan` over chunks), and
`recurrent`'s paths as a user calls them (`pallas_tpu`, `chunk`), forward and forward+backward under
the profiler. Each row: median ms of `--repeats` calls, the HBM floor (q, k, v, o once at 819 GB/s), and the error
against `recurrent`'s float32 `reference` (max |x − y| / max |y|). `--vmem-mib` raises Mosaic's
scoped-VMEM limit for the forms whose blocks need more than the 16 MiB default.

Writes `tpu_kernel_probe.md` and `.json` to `--out`. About 4 minutes on a v5e.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import recurrax
from recurrax.tools.cases import call

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import timed  # noqa: E402
from _trace import traced_ops  # noqa: E402

F32, BF16 = jnp.float32, jnp.bfloat16


def iota(shape, axis):
    return lax.broadcasted_iota(jnp.int32, shape, axis)


def bmm(a, b, contract):
    """Batched over the leading axis: contract a's axis `contract[0]` with b's `contract[1]`;
    bf16 operands, float32 accumulation."""
    return lax.dot_general(a.astype(BF16), b.astype(BF16), (((contract[0],), (contract[1],)), ((0,), (0,))),
                           preferred_element_type=F32)


def mm(a, b, contract):
    return lax.dot_general(a.astype(BF16), b.astype(BF16), (((contract[0],), (contract[1],)), ((), ())),
                           preferred_element_type=F32)


def columns(rows):
    """[..., 1, C] rows as [..., C, 1] columns, by a masked lane sum (exact)."""
    C = rows.shape[-1]
    eye = iota((C, C), 0) == iota((C, C), 1)  # 2-D masks, broadcast over heads
    return jnp.sum(jnp.where(eye, rows, 0.0), axis=-1, keepdims=True)


def last_lane(rows):
    """[..., 1, C] -> [..., 1, 1], the last lane, by a masked sum."""
    C = rows.shape[-1]
    return jnp.sum(jnp.where(iota((1, C), 1) == C - 1, rows, 0.0), axis=-1, keepdims=True)


def chunk_maths(q, k, kT, v, a_row, S, scale, decays: bool = True):
    """The maths of one chunk for one head ([C, D] tiles, `mm`) or all Hb heads ([Hb, C, D], `bmm`);
    without `decays`, the causal mask alone (what the decay's element-wise work costs)."""
    if not decays:
        a_row = jnp.zeros_like(a_row)
    lead = q.ndim - 2
    dot = bmm if lead else mm
    shift = lead  # axis numbers move by the batch axis
    a_col = columns(a_row)
    C = q.shape[-2]
    causal = iota((C, C), 0) >= iota((C, C), 1)
    decay = jnp.exp(jnp.where(causal, a_col - a_row, -jnp.inf))
    scores = dot(q, k, (shift + 1, shift + 1)) * decay  # q kᵀ
    o = dot(q * jnp.exp(a_col), S, (shift + 1, shift)) + dot(scores, v, (shift + 1, shift))
    a_last = last_lane(a_row)
    S_next = jnp.exp(a_last) * S + dot(kT * jnp.exp(a_last - a_row), v, (shift + 1, shift))
    return scale * o, S_next


def kernel(q_ref, k_ref, kT_ref, v_ref, a_ref, o_ref, S_ref, *, form, scale):
    @pl.when(pl.program_id(2) == 0)
    def _():
        S_ref[...] = jnp.zeros(S_ref.shape, F32)

    if form == "copy":
        o_ref[...] = (q_ref[...].astype(F32) + k_ref[...].astype(F32) + v_ref[...].astype(F32)
                      + jnp.sum(kT_ref[...].astype(F32)) + jnp.sum(a_ref[...])).astype(o_ref.dtype)
        return
    if form in ("batched", "undecayed"):
        o, S_ref[...] = chunk_maths(q_ref[...], k_ref[...], kT_ref[...], v_ref[...], a_ref[...], S_ref[...], scale,
                                    decays=form == "batched")
        o_ref[...] = o.astype(o_ref.dtype)
        return
    for i in range(q_ref.shape[0]):  # "loop"
        o, S_ref[i] = chunk_maths(q_ref[i], k_ref[i], kT_ref[i], v_ref[i], a_ref[i], S_ref[i], scale)
        o_ref[i] = o.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("form", "heads", "chunk", "vmem_mib", "interpret"))
def probe(q, k, v, a, *, form, heads, chunk, vmem_mib, interpret=False):
    """o of one form; q, k, v head-major [B, H, T, D] bf16, a [B, H, 1, T] float32 chunk-local."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    Hb, C = heads, chunk
    kT = jnp.swapaxes(k, 2, 3)
    rows = lambda D: pl.BlockSpec((None, Hb, C, D), lambda b, h, n: (b, h, n, 0))  # noqa: E731
    specs = [rows(K), rows(K), pl.BlockSpec((None, Hb, K, C), lambda b, h, n: (b, h, 0, n)), rows(V),
             pl.BlockSpec((None, Hb, 1, C), lambda b, h, n: (b, h, 0, n))]
    params = None if interpret else pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=vmem_mib * 2**20 if vmem_mib else None)
    return pl.pallas_call(
        functools.partial(kernel, form=form, scale=K**-0.5),
        grid=(B, H // Hb, T // C),
        in_specs=specs,
        out_specs=rows(V),
        out_shape=jax.ShapeDtypeStruct((B, H, T, V), q.dtype),
        scratch_shapes=[pltpu.VMEM((Hb, K, V), F32)],
        compiler_params=params,
        interpret=pltpu.InterpretParams() if interpret else False,
    )(q, k, kT, v, a)


@functools.partial(jax.jit, static_argnames=("chunk",))
def xla_chunked(q, k, v, a, *, chunk):
    """The same operation in XLA: intra-chunk terms of every chunk at once, a scan for the state."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    N, C = T // chunk, chunk
    q, k, v = (x.reshape(B, H, N, C, -1) for x in (q, k, v))
    a = a.reshape(B, H, N, C)
    causal = jnp.tril(jnp.ones((C, C), bool))
    decay = jnp.exp(jnp.where(causal, a[..., :, None] - a[..., None, :], -jnp.inf))
    scores = jnp.einsum("bhnck,bhndk->bhncd", q, k, preferred_element_type=F32) * decay
    o = jnp.einsum("bhncd,bhndv->bhncv", scores.astype(BF16), v, preferred_element_type=F32)
    a_last = a[..., -1:]
    kv = jnp.einsum("bhnck,bhncv->bhnkv", (k * jnp.exp(a_last - a)[..., None]).astype(BF16), v,
                    preferred_element_type=F32)

    def step(S, xs):
        kv_n, g_n = xs
        return jnp.exp(g_n)[..., None] * S + kv_n, S

    _, entering = lax.scan(step, jnp.zeros((B, H, K, V), F32), (jnp.moveaxis(kv, 2, 0), jnp.moveaxis(a_last, 2, 0)))
    entering = jnp.moveaxis(entering, 0, 2)
    o = o + jnp.einsum("bhnck,bhnkv->bhncv", (q * jnp.exp(a)[..., None]).astype(BF16), entering.astype(BF16),
                       preferred_element_type=F32)
    return (K**-0.5 * o).reshape(B, H, T, V).astype(q.dtype)


def inputs(shape, seed=0):
    B, T, H, K, V = (shape[x] for x in "BTHKV")
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k = (jax.random.normal(keys[i], (B, T, H, K), F32) for i in (0, 1))
    v = jax.random.normal(keys[2], (B, T, H, V), F32)
    g = jax.nn.log_sigmoid(jax.random.normal(keys[3], (B, T, H), F32) + 4.0) / 16
    return q.astype(BF16), k.astype(BF16), v.astype(BF16), g


def chunk_local(g, C):
    """Token-major g [B, T, H] -> head-major chunk-local inclusive cumsum rows [B, H, 1, T]."""
    B, T, H = g.shape
    a = jnp.cumsum(jnp.moveaxis(g, 1, 2).reshape(B, H, T // C, C), axis=-1)
    return a.reshape(B, H, 1, T)


def head_major(x):
    return jnp.moveaxis(x, 2, 1)


def error(x, reference):
    x, reference = np.asarray(x, np.float64), np.asarray(reference, np.float64)
    return float(np.max(np.abs(x - reference)) / np.max(np.abs(reference)))


def plan(smoke: bool) -> list[dict]:
    if smoke:
        return [dict(form=f, heads=h, chunk=128) for f in ("copy", "loop", "batched") for h in (1, 2)]
    rows = [dict(form="copy", heads=h, chunk=c) for h in (1, 4, 16) for c in (128, 512)]
    rows += [dict(form="loop", heads=h, chunk=c) for h in (1, 4, 8) for c in (128, 256)]
    rows += [dict(form="batched", heads=h, chunk=c) for h in (1, 2, 4, 8, 16) for c in (128, 256, 512)]
    rows += [dict(form="undecayed", heads=h, chunk=c) for h in (1, 8) for c in (128, 256)]
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--vmem-mib", type=int, default=96, help="scoped VMEM limit for the probe's kernels")
    parser.add_argument("--budget", type=float, default=240, help="seconds; rows after it are skipped")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    shape = dict(B=1, T=256, H=2, K=64, V=64) if args.smoke else dict(B=4, T=4096, H=16, K=64, V=64)
    interpret = jax.default_backend() != "tpu"
    q, k, v, g = inputs(shape)
    reference, _ = jax.jit(lambda q, k, v, g: recurrax.recurrent(q, k, v, g=g, implementation="reference"))(
        q.astype(F32), k.astype(F32), v.astype(F32), g)
    reference = head_major(reference)
    floor_ms = 4 * shape["B"] * shape["T"] * shape["H"] * shape["K"] * 2 / 819e9 * 1e3
    start, results = time.perf_counter(), []

    def record(label, fn, extra):
        if time.perf_counter() - start > args.budget:
            results.append({**extra, "label": label, "skipped": "budget"})
            return
        try:
            out = jax.block_until_ready(fn())
            ms = statistics.median(timed(fn, args.repeats)) * 1e3
            row = {**extra, "label": label, "ms": ms, "x_floor": ms / floor_ms, "error": error(out, reference)}
        except Exception as e:  # noqa: BLE001  a form that does not compile is a row, not the end
            row = {**extra, "label": label, "failed": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
        results.append(row)
        print(json.dumps(row), flush=True)

    qh, kh, vh = (head_major(x) for x in (q, k, v))
    for p in plan(args.smoke):
        a = chunk_local(g, p["chunk"])
        record(f"{p['form']} Hb{p['heads']} C{p['chunk']}",
               functools.partial(probe, qh, kh, vh, a, vmem_mib=args.vmem_mib, interpret=interpret, **p), p)
    for c in (64, 128, 256):
        record(f"xla C{c}", functools.partial(xla_chunked, qh, kh, vh, chunk_local(g, c), chunk=c),
               dict(form="xla", chunk=c))
    for path in ("pallas_tpu", "chunk"):
        if path == "pallas_tpu" and interpret:
            continue
        call = jax.jit(lambda q, k, v, g, path=path: head_major(recurrax.recurrent(q, k, v, g=g, implementation=path)[0]))
        record(f"recurrent {path}", functools.partial(call, q, k, v, g), dict(form=path))
    traces = {} if interpret else profiles(q, k, v, g, args.repeats)
    write(Path(args.out), results, shape, floor_ms, traces)
    return 0


def recurrent_output(path, q, k, v, gates: dict):
    """`recurrent`'s output through a registered `implementation`, or an algorithm function."""
    if isinstance(path, str):
        return recurrax.recurrent(q, k, v, **gates, implementation=path)[0]
    return call(path, query=q, key=k, value=v, **gates)[0]


def profiles(q, k, v, g, repeats: int) -> dict:
    """`recurrent` as a user calls it, forward and forward+backward, under the profiler: the
    device's self time by kind of op and the longest ops (`_trace.traced_ops`)."""
    gk = jnp.broadcast_to(g[..., None], q.shape) / 4
    out = {}
    paths = {"pallas_tpu": "pallas_tpu", "chunk": "chunk"}
    for gate, gates in (("g", dict(g=g)), ("gk", dict(gk=gk))):
        for name, path in paths.items():
            forward = jax.jit(functools.partial(recurrent_output, path))
            both = jax.jit(jax.grad(lambda q, k, v, gates, path=path: jnp.sum(
                recurrent_output(path, q, k, v, gates).astype(F32) ** 2), argnums=(0, 1, 2, 3)))
            for kind, fn in (("forward", forward), ("forward+backward", both)):
                run = functools.partial(fn, q, k, v, gates)
                try:
                    seconds = statistics.median(timed(run, repeats))
                    out[f"{gate} {name} {kind}"] = {"ms": seconds * 1e3, **traced_ops(run, seconds, most=10)}
                except Exception as e:  # noqa: BLE001
                    out[f"{gate} {name} {kind}"] = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
                print(f"traced {gate} {name} {kind}", flush=True)
    return out


def write(out: Path, results: list[dict], shape: dict, floor_ms: float, traces: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "tpu_kernel_probe.json").write_text(json.dumps(dict(shape=shape, floor_ms=floor_ms, rows=results,
                                                               traces=traces), indent=1))
    device = jax.devices()[0].device_kind
    lines = [f"# A chunk kernel's grid step on {device}", "",
             f"JAX {jax.__version__}; `recurrent` with a per-head decay `g`, forward only, bf16, "
             f"B{shape['B']} T{shape['T']} H{shape['H']} K{shape['K']} V{shape['V']}; HBM floor (q, k, v, o once) "
             f"{floor_ms:.3f} ms. Written by `benchmarks/tpu_kernel_probe.py` (its docstring defines the forms).", "",
             "| form | heads a step | chunk | ms | × floor | error vs float32 reference |", "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        tail = (f"{r['ms']:.3f} | {r['x_floor']:.1f} | {r['error']:.1e}" if "ms" in r
                else f"{r.get('failed') or r.get('skipped')} | | ")
        lines.append(f"| {r.get('form')} | {r.get('heads', '')} | {r.get('chunk', '')} | {tail} |")
    for name, t in traces.items():
        lines += ["", f"## `recurrent` {name} under the profiler", ""]
        if "failed" in t:
            lines.append(t["failed"])
            continue
        lines += [f"{t['ms']:.2f} ms; device self time {1e3 * t['device_s']:.2f} ms.", "",
                  "| op (kind) | share |", "|---|---:|"]
        lines += [f"| `{op}` | {100 * share:.1f}% |" for op, share in t["op_share"].items()]
    (out / "tpu_kernel_probe.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
