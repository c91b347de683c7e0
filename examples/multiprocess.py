"""Sequence parallelism across processes: how a multi-host run starts, on one machine.

Every process of a multi-host job runs the same program: it calls
`jax.distributed.initialize(coordinator_address, num_processes, process_id)`, after which
`jax.devices()` lists the devices of all processes and a `Mesh` over them spans the job.
Each process then holds only its own block of the tokens (`jax.make_array_from_process_local_data`),
and `recurrax.parallel.recurrent` runs over the global mesh; the processes exchange states
through the backend's collectives (on CPUs: gloo, over TCP).

Run without `--process-id`, this script is the launcher: it picks a free port on
127.0.0.1, starts `--num-processes` copies of itself (each with `--local-devices` simulated
CPU devices), relays their output and kills them if they run past `--timeout`. Each process
checks its part of the outputs, final states and gradients against a one-process
`recurrax.recurrent` over the whole sequence (every process can make the whole input from the
seed) and prints `max error`; the launcher exits non-zero if any process fails.

    python examples/multiprocess.py                                       # 2 processes × 2 devices
    python examples/multiprocess.py --seq-len 16 --heads 2 --head-dim 8   # a smoke run

On real hosts, start one process per host with the coordinator's address instead:
`python examples/multiprocess.py --process-id I --num-processes N --coordinator HOST:PORT`.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--num-processes", type=int, default=2, help="processes to launch")
    parser.add_argument("--process-id", type=int, default=None, help="set by the launcher (or by you, per host)")
    parser.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (default: a free local port)")
    parser.add_argument("--local-devices", type=int, default=2, help="simulated CPU devices per process")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per batch")
    parser.add_argument("--seq-len", type=int, default=128, help="divisible by the total device count")
    parser.add_argument("--heads", type=int, default=4, help="heads")
    parser.add_argument("--head-dim", type=int, default=16, help="key and value head dimension")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="largest accepted difference from the reference")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds before the launcher kills the processes")
    return parser.parse_args(argv)


def free_local_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(args: argparse.Namespace, argv: list[str], script: str = __file__) -> int:
    """Start one copy of `script` (this one by default) per process with `argv`, relay their
    output, kill them on timeout. `args` holds `num_processes`, `coordinator` and `timeout`."""
    coordinator = args.coordinator or f"127.0.0.1:{free_local_port()}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    children = [
        subprocess.Popen([sys.executable, os.path.abspath(script), *argv, "--process-id", str(i),
                          "--coordinator", coordinator], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=env)
        for i in range(args.num_processes)
    ]
    print(f"launched {args.num_processes} processes, coordinator {coordinator}", flush=True)
    deadline, codes = time.monotonic() + args.timeout, []
    try:
        for i, child in enumerate(children):
            try:
                output, _ = child.communicate(timeout=max(deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                print(f"process {i} ran past --timeout {args.timeout:.0f} s: killing the processes", flush=True)
                return 124
            print(output, end="", flush=True)
            codes.append(child.returncode)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    failed = [i for i, code in enumerate(codes) if code != 0]
    print("all processes agree with one process" if not failed else f"FAILED: processes {failed} exited non-zero")
    return 1 if failed else 0


def run_process(args: argparse.Namespace) -> int:
    """One process of the job: join it, hold a block of tokens, compare with one process."""
    import jax

    jax.config.update("jax_num_cpu_devices", args.local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")   # cross-process collectives on CPUs
    jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id, initialization_timeout=int(args.timeout))
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import recurrax
    import recurrax.parallel

    me = f"[process {jax.process_index()}/{jax.process_count()}]"
    mesh = Mesh(np.array(jax.devices()), ("seq",))                   # every device of every process
    sharding = NamedSharding(mesh, PartitionSpec(None, "seq"))        # [B, T, H, D] split over T
    B, T, H, K = args.batch_size, args.seq_len, args.heads, args.head_dim
    ks = jax.random.split(jax.random.key(0), 4)
    whole = [jax.random.normal(key, (B, T, H, K)) for key in ks[:3]]  # the same in every process
    whole.append(jax.nn.log_sigmoid(jax.random.normal(ks[3], (B, T, H, K))))

    # This process's block of tokens, as a multi-host run would load it, then the global arrays.
    local_devices = jax.local_device_count()
    per_process = T // jax.process_count()
    start = jax.process_index() * per_process
    local = [np.asarray(x[:, start:start + per_process]) for x in whole]
    q, k, v, gk = (jax.make_array_from_process_local_data(sharding, x, (B, T, H, K)) for x in local)
    print(f"{me} {local_devices} local of {jax.device_count()} devices; holds tokens [{start}, {start + per_process})",
          flush=True)

    def loss(fn, **options):
        return lambda q, k, v, gk: (fn(q, k, v, gk=gk, **options)[0] ** 2).mean()

    parallel = jax.jit(lambda q, k, v, gk: recurrax.parallel.recurrent(q, k, v, gk=gk, mesh=mesh, sequence_axis="seq"))
    o, state = parallel(q, k, v, gk)
    grads = jax.jit(jax.grad(loss(recurrax.parallel.recurrent, mesh=mesh, sequence_axis="seq"),
                             argnums=(0, 1, 2, 3)))(q, k, v, gk)

    # One process over the whole sequence, on this process's first device.
    o_1, state_1 = recurrax.recurrent(*whole[:3], gk=whole[3])
    grads_1 = jax.grad(loss(recurrax.recurrent), argnums=(0, 1, 2, 3))(*whole)

    def local_error(global_array, reference) -> float:               # only this process's shards
        return max(float(np.abs(np.asarray(shard.data) - np.asarray(reference[shard.index])).max())
                   for shard in global_array.addressable_shards)

    errors = {"output": local_error(o, o_1), "final state": local_error(state, state_1),
              "gradients": max(local_error(g, g_1) for g, g_1 in zip(grads, grads_1))}
    for name, value in errors.items():
        print(f"{me} max error, {jax.device_count()} devices in {jax.process_count()} processes vs one, "
              f"{name}: {value:.3e}", flush=True)
    jax.distributed.shutdown()
    if max(errors.values()) > args.tolerance:
        print(f"{me} FAILED: exceeds --tolerance {args.tolerance}", flush=True)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.process_id is None:
        return launch(args, argv)
    return run_process(args)


if __name__ == "__main__":
    sys.exit(main())
