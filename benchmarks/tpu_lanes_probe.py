"""Lane-dense token-major blocks against head-major copies: what a TPU chunk kernel's inputs cost
(issue 45), timed side by side on one chip.

    source benchmarks/tpu_env.sh && python3 benchmarks/tpu_lanes_probe.py --out benchmarks/results
    python benchmarks/tpu_lanes_probe.py --smoke --out /tmp/lanes      # any machine: interpret mode, tiny

`recurrax.recurrent`'s TPU kernels read q, k, v as head-major copies [B, H, T, D] made in XLA
(and kᵀ [B, H, D, T]), because a block of one head of the token-major [B, T, H, D] puts the
head axis second-minor, which Mosaic's (8, 128) tiling refuses. The same bytes seen as
[B, T, H·D] (what a projection writes before the reshape into heads) have lane-dense blocks
[C, Hb·D] with Hb·D a multiple of 128: head i of a step is lanes [i·D, (i + 1)·D) of the tile,
kᵀ a transpose in VMEM. Forms, each on the grid (b, head block, chunk), the chunk axis
sequential, the state [Hb, K, V] float32 in VMEM:

| form          | inputs                                    | a grid step                               |
|---------------|-------------------------------------------|-------------------------------------------|
| `lanes copy`  | q, k, v [B, T, H·D]; A [B, T, H]          | o = q + k + v (the DMA and step floor)    |
| `lanes loop`  | the same                                  | the chunk maths, heads one after another  |
| `heads loop`  | head-major copies made before the timing  | the same maths (`tpu_kernel_probe`'s)     |

    o = scale · [ (q ⊙ e^{A}) S + (q kᵀ ⊙ D) v ],   D_ij = e^{A_i − A_j} (j ≤ i),   S' = e^{A_L} S + (kᵀ ⊙ e^{A_L − A}) v

Also timed, as XLA programs: `x · 2` of a [B, T, H, D] and of a [B, T, H·D] array, the
reshape [B, T, H, D] → [B, T, H·D] (a copy on a TPU when the layouts' tiles differ), the head-major
transpose; and `recurrent` as users call it (`pallas_tpu`, `chunk`). Each row: the time of one
call when calls run back to back (`--calls` dispatched, then waited for; the best of three rounds:
what a training step sees) and the median of `--repeats` calls each waited for (a host round trip
included), the HBM floor (q, k, v, o once at 819 GB/s), and the error against `recurrent`'s
float32 `reference` (max |x − y| / max |y|). Writes `tpu_lanes_probe.md` and `.json` to `--out`
(`tpu_lanes_probe_d128.*` with `--head-dim 128`, H = 8 then); about 2 minutes on a v5e. A tile
whose heads do not divide H is not run.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import recurrax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import back_to_back, timed  # noqa: E402
from tpu_kernel_probe import F32, chunk_local, chunk_maths, error, head_major, inputs, iota, probe  # noqa: E402


def column(x, j):
    """Column j (traced) of a [C, H] tile as [C, 1], by a masked lane sum (exact)."""
    return jnp.sum(jnp.where(iota(x.shape, 1) == j, x, 0.0), axis=1, keepdims=True)


def row_of(col):
    """A [C, 1] column as a [1, C] row, by a masked sublane sum (exact)."""
    C = col.shape[0]
    return jnp.sum(jnp.where(iota((C, C), 0) == iota((C, C), 1), col, 0.0), axis=0, keepdims=True)


def lanes_kernel(q_ref, k_ref, v_ref, a_ref, o_ref, S_ref, *, form, scale, heads, K, V):
    @pl.when(pl.program_id(2) == 0)
    def _():
        S_ref[...] = jnp.zeros(S_ref.shape, F32)

    if form == "copy":
        o_ref[...] = (q_ref[...].astype(F32) + k_ref[...].astype(F32) + v_ref[...].astype(F32)
                      + jnp.sum(a_ref[...])).astype(o_ref.dtype)
        return
    a_all = a_ref[...]  # [C, H]
    for i in range(heads):
        q = q_ref[:, i * K:(i + 1) * K]
        k = k_ref[:, i * K:(i + 1) * K]
        v = v_ref[:, i * V:(i + 1) * V]
        kT = k.astype(F32).T
        a_row = row_of(column(a_all, pl.program_id(1) * heads + i))
        o, S_ref[i] = chunk_maths(q, k, kT, v, a_row, S_ref[i], scale)
        o_ref[:, i * V:(i + 1) * V] = o.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("form", "heads", "chunk", "K", "vmem_mib", "interpret"))
def lanes(q, k, v, a, *, form, heads, chunk, K, vmem_mib, interpret=False):
    """o [B, T, H·V] of one form; q, k [B, T, H·K], v [B, T, H·V] bf16, A [B, T, H] float32."""
    B, T, HK = q.shape
    H = a.shape[-1]
    V = v.shape[-1] // H
    Hb, C = heads, chunk
    block = lambda D: pl.BlockSpec((None, C, Hb * D), lambda b, h, n: (b, n, h))  # noqa: E731
    specs = [block(K), block(K), block(V), pl.BlockSpec((None, C, H), lambda b, h, n: (b, n, 0))]
    params = None if interpret else pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=vmem_mib * 2**20 if vmem_mib else None)
    return pl.pallas_call(
        functools.partial(lanes_kernel, form=form, scale=K**-0.5, heads=Hb, K=K, V=V),
        grid=(B, H // Hb, T // C),
        in_specs=specs,
        out_specs=block(V),
        out_shape=jax.ShapeDtypeStruct((B, T, H * V), q.dtype),
        scratch_shapes=[pltpu.VMEM((Hb, K, V), F32)],
        compiler_params=params,
        interpret=pltpu.InterpretParams() if interpret else False,
    )(q, k, v, a)


def plan(smoke: bool, H: int) -> list[dict]:
    if smoke:
        return [dict(form=f, heads=h, chunk=128) for f in ("copy", "loop") for h in (2,)]
    rows = [dict(form="copy", heads=h, chunk=c) for h in (2, 8, 16) for c in (128, 256)]
    rows += [dict(form="loop", heads=h, chunk=c) for h in (2, 4, 8, 16) for c in (128, 256)]
    return [r for r in rows if H % r["heads"] == 0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--vmem-mib", type=int, default=64, help="scoped VMEM limit for the probe's kernels")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    D = args.head_dim
    shape = (dict(B=1, T=256, H=2, K=D, V=D) if args.smoke
             else dict(B=4, T=4096, H=16 * 64 // D, K=D, V=D))
    interpret = jax.default_backend() != "tpu"
    B, T, H = shape["B"], shape["T"], shape["H"]
    q, k, v, g = inputs(shape)
    reference = jax.jit(lambda q, k, v, g: recurrax.recurrent(q, k, v, g=g, implementation="reference")[0])(
        q.astype(F32), k.astype(F32), v.astype(F32), g)
    flat = lambda x: x.reshape(B, T, -1)  # noqa: E731
    q2, k2, v2 = (jax.block_until_ready(jax.jit(flat)(x)) for x in (q, k, v))
    qh, kh, vh = (jax.block_until_ready(jax.jit(head_major)(x)) for x in (q, k, v))
    floor_ms = 4 * B * T * H * D * 2 / 819e9 * 1e3
    results = []

    def record(label, fn, extra, to_tokens=None):
        try:
            out = jax.block_until_ready(fn())
            row = {**extra, "label": label, "ms": 1e3 * back_to_back(fn, args.calls),
                   "synced_ms": 1e3 * statistics.median(timed(fn, args.repeats))}
            row["x_floor"] = row["ms"] / floor_ms
            if to_tokens is not None:
                row["error"] = error(to_tokens(out), reference)
        except Exception as e:  # noqa: BLE001  a form that does not compile is a row, not the end
            row = {**extra, "label": label, "failed": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        results.append(row)
        print(json.dumps(row), flush=True)

    as_tokens = lambda o: o.reshape(B, T, H, D)  # noqa: E731
    for p in plan(args.smoke, H):
        C = p["chunk"]
        a = jax.block_until_ready(jnp.moveaxis(chunk_local(g, C)[:, :, 0, :], 1, 2))  # [B, T, H]
        record(f"lanes {p['form']} Hb{p['heads']} C{C}",
               functools.partial(lanes, q2, k2, v2, a, K=D, vmem_mib=args.vmem_mib, interpret=interpret, **p),
               {**p, "form": f"lanes {p['form']}"}, as_tokens if p["form"] == "loop" else None)
    for heads in ((2,) if args.smoke else (h for h in (8, 16) if H % h == 0)):
        a = chunk_local(g, 128)
        record(f"heads loop Hb{heads} C128",
               functools.partial(probe, qh, kh, vh, a, form="loop", heads=heads, chunk=128,
                                 vmem_mib=args.vmem_mib, interpret=interpret),
               dict(form="heads loop", heads=heads, chunk=128), lambda o: jnp.moveaxis(o, 1, 2))
    record("xla x·2 [B, T, H, D]", functools.partial(jax.jit(lambda x: x * 2), q), dict(form="xla x·2 [B,T,H,D]"))
    record("xla x·2 [B, T, H·D]", functools.partial(jax.jit(lambda x: x * 2), q2), dict(form="xla x·2 [B,T,H·D]"))
    record("xla reshape to [B, T, H·D]", functools.partial(jax.jit(flat), q), dict(form="xla reshape"))
    record("xla head-major transpose", functools.partial(jax.jit(head_major), q), dict(form="xla transpose"))
    for path in (("chunk",) if interpret else ("pallas_tpu", "chunk")):
        run = jax.jit(lambda q, k, v, g, path=path: recurrax.recurrent(q, k, v, g=g, implementation=path)[0])
        record(f"recurrent {path}", functools.partial(run, q, k, v, g), dict(form=f"recurrent {path}"), lambda o: o)
    write(Path(args.out), results, shape, floor_ms, "" if D == 64 else f"_d{D}")
    return 0


def write(out: Path, results: list[dict], shape: dict, floor_ms: float, suffix: str) -> None:
    """`tpu_lanes_probe{suffix}.md` and `.json` (the suffix names a head dim other than 64)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"tpu_lanes_probe{suffix}.json").write_text(json.dumps(dict(shape=shape, floor_ms=floor_ms, rows=results), indent=1))
    device = jax.devices()[0].device_kind
    lines = [f"# Lane-dense token-major blocks on {device}", "",
             f"JAX {jax.__version__}; `recurrent` with a per-head decay `g`, forward only, bf16, "
             f"B{shape['B']} T{shape['T']} H{shape['H']} K{shape['K']} V{shape['V']}; HBM floor (q, k, v, o once) "
             f"{floor_ms:.3f} ms. Written by `benchmarks/tpu_lanes_probe.py` (its docstring defines the forms). "
             "`ms`: one call of calls run back to back; `synced ms`: one call waited for.", "",
             "| form | heads a step | chunk | ms | synced ms | × floor | error vs float32 reference |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        err = f"{r['error']:.1e}" if "error" in r else ""
        tail = (f"{r['ms']:.3f} | {r['synced_ms']:.3f} | {r['x_floor']:.1f} | {err}" if "ms" in r
                else f"{r.get('failed')} | | | ")
        lines.append(f"| {r.get('form')} | {r.get('heads', '')} | {r.get('chunk', '')} | {tail} |")
    (out / f"tpu_lanes_probe{suffix}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
