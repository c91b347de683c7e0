"""Sequence parallelism: `recurrax.parallel.recurrent` with the tokens split over a device mesh.

On a CPU the devices are simulated (`jax_num_cpu_devices`, set before JAX starts its
backend); on GPUs or TPUs the same code runs over the real ones. Each device holds a block
of the tokens; the devices exchange one state each, so the traffic does not grow with the
sequence length. The script compares with `recurrax.recurrent` on one device: outputs,
final states and gradients (dense input, reversed, packed sequences crossing device
boundaries, and tokens × heads on a 2-D mesh). It prints one `max error` line per check and
exits non-zero when one exceeds `--tolerance`.

    python examples/sequence_parallel.py                      # 8 simulated CPU devices
    python examples/sequence_parallel.py --devices 4 --seq-len 32   # a smoke run
"""

from __future__ import annotations

import argparse
import sys


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (ignored on accelerators)")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per batch")
    parser.add_argument("--seq-len", type=int, default=256, help="divisible by --devices")
    parser.add_argument("--heads", type=int, default=4, help="heads")
    parser.add_argument("--head-dim", type=int, default=16, help="key and value head dimension")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="largest accepted difference from the reference")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)        # before the first use of a device
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import recurrax
    import recurrax.parallel

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("seq",))                      # every device on the token axis
    print(f"{len(devices)} {devices[0].platform} devices; tokens split {args.seq_len // len(devices)} per device")

    B, T, H, K = args.batch_size, args.seq_len, args.heads, args.head_dim
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (B, T, H, K)) for key in ks[:3])
    gk = jax.nn.log_sigmoid(jax.random.normal(ks[3], (B, T, H, K)))
    difference = lambda a, b: float(jnp.abs(a - b).max())         # noqa: E731
    errors = {}

    # Forward, both directions: outputs and final states.
    for reverse in (False, True):
        o, state = recurrax.parallel.recurrent(q, k, v, gk=gk, reverse=reverse, mesh=mesh, sequence_axis="seq")
        o_1, state_1 = recurrax.recurrent(q, k, v, gk=gk, reverse=reverse)
        name = "reverse" if reverse else "forward"
        errors[f"{name} output"], errors[f"{name} final state"] = difference(o, o_1), difference(state, state_1)
    print("output sharding:", o.sharding)

    # Gradients of every input, under jit.
    def loss(fn, **options):
        return lambda q, k, v, gk: (fn(q, k, v, gk=gk, **options)[0] ** 2).mean()

    grads = jax.jit(jax.grad(loss(recurrax.parallel.recurrent, mesh=mesh, sequence_axis="seq"), argnums=(0, 1, 2, 3)))(
        q, k, v, gk)
    grads_1 = jax.grad(loss(recurrax.recurrent), argnums=(0, 1, 2, 3))(q, k, v, gk)
    errors["gradients"] = max(difference(a, b) for a, b in zip(grads, grads_1))

    # Packed sequences that cross device boundaries (one empty): final states per sequence.
    N = B * T
    cu = jnp.array([0, N // 3, N // 3, N - 7, N])
    packed = [x.reshape(N, H, K) for x in (q, k, v, gk)]
    o, state = recurrax.parallel.recurrent(*packed[:3], gk=packed[3], cu_seqlens=cu, mesh=mesh, sequence_axis="seq")
    o_1, state_1 = recurrax.recurrent(*packed[:3], gk=packed[3], cu_seqlens=cu)
    errors["packed output"], errors["packed final states"] = difference(o, o_1), difference(state, state_1)

    # Tokens over one mesh axis, heads over another.
    if len(devices) % 2 == 0 and H % 2 == 0:
        mesh2 = Mesh(np.array(devices).reshape(-1, 2), ("seq", "heads"))
        o, state = recurrax.parallel.recurrent(q, k, v, gk=gk, mesh=mesh2, sequence_axis="seq", head_axis="heads")
        o_1, state_1 = recurrax.recurrent(q, k, v, gk=gk)
        errors["2-D mesh output"], errors["2-D mesh final state"] = difference(o, o_1), difference(state, state_1)

    for name, value in errors.items():
        print(f"max error, {len(devices)} devices vs one, {name}: {value:.3e}")
    worst = max(errors.values())
    if worst > args.tolerance:
        print(f"FAILED: {worst:.3e} exceeds --tolerance {args.tolerance}", file=sys.stderr)
        sys.exit(1)
    print("sharded == one device")
    return errors


if __name__ == "__main__":
    main()
