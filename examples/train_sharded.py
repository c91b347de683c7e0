"""Fine-tune a pretrained model with optax on a mesh of devices: data, FSDP, tensor and sequence parallel.

The model (an fla or `transformers` checkpoint directory; by default the tiny GLA fixture of
the tests) is placed on a mesh with the axes `data`, `tensor` and `sequence`: the batch rows
split over `data`, the tokens over `sequence`, heads and MLP widths over `tensor`, and with
`--fsdp` the parameters and the optimizer state over `data` as well. One jitted step computes
the loss, its gradients and the optax update on every device at once. The task: each row
repeats a random block of 2 to 5 tokens, which the model learns to continue.

On a CPU the devices are simulated (`jax_num_cpu_devices`). The first step is checked against
the same step on one device (`max error` lines; non-zero exit above `--tolerance`), then the
loss is printed every step.

    pip install 'recurrax[examples,pretrained,checkpoint]'
    python examples/train_sharded.py                                   # 2 data × 2 tensor × 2 sequence
    python examples/train_sharded.py --mesh data=4,tensor=2 --fsdp     # FSDP over 4, tensor over 2
    python examples/train_sharded.py --num-processes 2                 # 2 processes × 4 devices

Checkpoints: `--checkpoint-dir DIR` saves parameters and optimizer state with orbax after the
last step (each device writes its own shards); run again with `--resume` to continue from the
saved step on any mesh layout (`--mesh`, `--fsdp` may differ from the saved run's).
`--save-pretrained DIR` writes the trained model as a single-host Hugging Face checkpoint that
`from_pretrained` (and fla or `transformers`) read.

With `--num-processes N` the script is a launcher (`examples/multiprocess.py`'s): it starts N
copies of itself joined by `jax.distributed` on 127.0.0.1, each with its share of the devices;
every process makes the same batches from the seed and holds only its devices' part of them.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
from pathlib import Path

AXES = ("data", "tensor", "sequence")
FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "fla" / "gla_basic"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=str(FIXTURE), help="fla or transformers checkpoint directory")
    parser.add_argument("--mesh", default="data=2,tensor=2,sequence=2",
                        help="mesh axis sizes, AXIS=SIZE,... over data, tensor, sequence (missing axes: 1)")
    parser.add_argument("--fsdp", action="store_true", help="shard parameters and optimizer state over data too")
    parser.add_argument("--remat", choices=("none", "block", "dots"), default="none",
                        help="what the backward keeps of each layer: everything, its input, or its matmul outputs")
    parser.add_argument("--steps", type=int, default=10, help="training steps")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (divisible by data)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (divisible by sequence)")
    parser.add_argument("--learning-rate", type=float, default=1e-2, help="adamw learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batches")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="largest accepted relative difference of the first step from one device's")
    parser.add_argument("--checkpoint-dir", default=None, help="save params and optimizer state here (orbax)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    parser.add_argument("--save-pretrained", default=None, help="write the trained model here (Hugging Face layout)")
    parser.add_argument("--num-processes", type=int, default=1, help="processes; > 1 launches them (jax.distributed)")
    parser.add_argument("--process-id", type=int, default=None, help="set by the launcher (or by you, per host)")
    parser.add_argument("--coordinator", default=None, help="HOST:PORT of process 0 (default: a free local port)")
    parser.add_argument("--local-devices", type=int, default=None,
                        help="simulated CPU devices per process (default: the mesh size / --num-processes)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before the launcher kills the processes")
    return parser.parse_args(argv)


def parse_mesh(text: str) -> dict[str, int]:
    """`data=2,tensor=2,sequence=2` → {'data': 2, 'tensor': 2, 'sequence': 2} (missing axes: 1)."""
    sizes = dict.fromkeys(AXES, 1)
    for item in filter(None, text.split(",")):
        name, _, size = item.partition("=")
        if name.strip() not in sizes or not size.strip().isdigit() or int(size) < 1:
            raise SystemExit(f"--mesh: {item!r} is not AXIS=SIZE with AXIS one of {AXES} and SIZE ≥ 1")
        sizes[name.strip()] = int(size)
    return sizes


def make_batch(seed: int, step: int, batch_size: int, seq_len: int, vocab_size: int):
    """Step `step`'s batch, (inputs, targets) `[B, T]` int32 numpy: rows follow the successor
    permutation of `seed` from random starts. The same in every process (seed and step decide)."""
    import numpy as np

    successor = np.random.default_rng(seed).permutation(vocab_size)
    tokens = [np.random.default_rng([seed, step]).integers(0, vocab_size, size=batch_size)]
    for _ in range(seq_len):
        tokens.append(successor[tokens[-1]])
    tokens = np.stack(tokens, axis=1).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(graphdef):
    """Mean next-token cross entropy of the model `graphdef` with parameters `params`, chunk by
    chunk (`token_losses`: the `[B, T, vocab]` logits are never held whole)."""
    from flax import nnx

    def loss(params, inputs, targets):
        return nnx.merge(graphdef, params).token_losses(inputs, targets).mean()

    return loss


def train_step(graphdef, optimizer):
    """`step(params, opt_state, inputs, targets) → (params, opt_state, loss)`, not yet jitted."""
    import jax
    import optax

    loss = loss_fn(graphdef)

    def step(params, opt_state, inputs, targets):
        value, grads = jax.value_and_grad(loss)(params, inputs, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


def make_mesh(sizes: dict[str, int]):
    """A mesh with the axes `data`, `tensor`, `sequence` over the first devices of the job."""
    import jax

    count = math.prod(sizes.values())
    if count > jax.device_count():
        raise SystemExit(f"--mesh {sizes} needs {count} devices; the job has {jax.device_count()}")
    return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES),
                         devices=jax.devices()[:count])


def rules(fsdp: bool):
    """The rules table: batch over `data` (with `fsdp`, the parameters' `embed` axis too), heads
    and MLP widths over `tensor`, tokens over `sequence` (`recurrax.nn.logical_rules`)."""
    import recurrax.nn as rnn

    return rnn.logical_rules("fsdp" if fsdp else "data", "tensor", "sequence")


def state_shardings(model, optimizer, mesh, fsdp: bool):
    """(parameter shardings, optimizer-state shardings) of `model` (concrete or abstract) on
    `mesh`: each optimizer moment is sharded like its parameter, step counts replicated."""
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    import recurrax.nn as rnn

    params_sharding = rnn.parameter_shardings(model, mesh, rules(fsdp))
    opt_sharding = optax.tree_map_params(optimizer, lambda _, sharding: sharding,
                                         jax.eval_shape(optimizer.init, nnx.state(model)), params_sharding,
                                         transform_non_params=lambda _: NamedSharding(mesh, PartitionSpec()))
    return params_sharding, opt_sharding


def jit_step(graphdef, optimizer, mesh, params_sharding, opt_sharding, donate: bool = False):
    """`train_step` jitted for the mesh: tokens `[B, T]` split over (`data`, `sequence`), the
    state kept in its shardings. Call (and trace) it inside `recurrax.nn.use_mesh(mesh, rules)`.
    On TPUs it compiles with `recurrax.targets.TPU_TRAINING_OPTIONS` (without them libtpu keeps
    every layer's FSDP collective-matmul buffers through the backward)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from recurrax.targets import TPU_TRAINING_OPTIONS

    tokens = NamedSharding(mesh, PartitionSpec("data", "sequence"))
    on_tpu = mesh.devices.flat[0].platform == "tpu"
    return jax.jit(train_step(graphdef, optimizer), in_shardings=(params_sharding, opt_sharding, tokens, tokens),
                   out_shardings=(params_sharding, opt_sharding, NamedSharding(mesh, PartitionSpec())),
                   donate_argnums=(0, 1) if donate else (), compiler_options=TPU_TRAINING_OPTIONS if on_tpu else None)


def to_mesh(host_tree, shardings):
    """Host arrays (the same in every process) → global arrays laid out by `shardings`; each
    process fills only its own devices."""
    import jax
    import numpy as np

    def place(value, sharding):
        value = np.asarray(value)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    return jax.tree.map(place, host_tree, shardings)


def abstract(tree, shardings):
    """Shapes, dtypes and the given shardings of `tree`: what orbax restores into."""
    import jax

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def save_checkpoint(directory: str, step: int, params, opt_state) -> None:
    """Save params and optimizer state after `step` with orbax: each process writes its shards."""
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(os.path.abspath(directory))
    try:
        manager.save(step, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))
        manager.wait_until_finished()
    finally:
        manager.close()


def restore_checkpoint(directory: str, target):
    """(step, {'params', 'opt_state'}) of the latest checkpoint in `directory`, restored into
    `target` (`abstract(...)`: shapes with the shardings of this run's mesh, whatever the saved one's)."""
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(os.path.abspath(directory))
    try:
        step = manager.latest_step()
        if step is None:
            raise SystemExit(f"--resume: no checkpoint in {directory}")
        return step, manager.restore(step, args=ocp.args.StandardRestore(target))
    finally:
        manager.close()


def relative_error(tree, reference) -> float:
    """max |tree − reference| / max |reference| over every leaf, on this process's shards only."""
    import jax
    import numpy as np

    leaves, references = jax.tree.leaves(tree), [np.asarray(r) for r in jax.tree.leaves(reference)]
    scale = max(float(np.abs(r).max(initial=0.0)) for r in references)
    worst = max(float(np.abs(np.asarray(shard.data) - r[shard.index]).max(initial=0.0))
                for x, r in zip(leaves, references) for shard in x.addressable_shards)
    return worst / max(scale, 1e-30)


def run_process(args: argparse.Namespace, sizes: dict[str, int]) -> int:
    """Train on the mesh: place, check the first step against one device, train, save."""
    import jax

    if args.process_id is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")   # cross-process collectives on CPUs
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id, initialization_timeout=int(args.timeout))
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    import recurrax.nn as rnn
    from recurrax.nn.pretrained import from_pretrained, save_pretrained

    me = f"[process {jax.process_index()}/{jax.process_count()}]"
    mesh = make_mesh(sizes)
    if mesh.size != jax.device_count():
        raise SystemExit(f"--mesh {sizes} has {mesh.size} devices; the job has {jax.device_count()}")
    model = from_pretrained(args.model, remat=None if args.remat == "none" else args.remat)
    graphdef, host_params = nnx.split(model)
    optimizer = optax.adamw(args.learning_rate)
    params_sharding, opt_sharding = state_shardings(model, optimizer, mesh, args.fsdp)
    batch_sharding = NamedSharding(mesh, PartitionSpec("data", "sequence"))
    step_fn = jit_step(graphdef, optimizer, mesh, params_sharding, opt_sharding)
    print(f"{me} {jax.local_device_count()} local of {jax.device_count()} {jax.devices()[0].platform} devices; "
          f"mesh {dict(mesh.shape)}{' with FSDP' if args.fsdp else ''}", flush=True)

    first = 0
    if args.resume:
        first, state = restore_checkpoint(args.checkpoint_dir, abstract(
            {"params": host_params, "opt_state": jax.eval_shape(optimizer.init, host_params)},
            {"params": params_sharding, "opt_state": opt_sharding}))
        params, opt_state = state["params"], state["opt_state"]
        print(f"{me} resumed from step {first} of {args.checkpoint_dir}", flush=True)
    else:
        params = to_mesh(host_params, params_sharding)
        opt_state = jax.jit(optimizer.init, out_shardings=opt_sharding)(params)

    failed = False
    for step in range(first, first + args.steps):
        inputs, targets = make_batch(args.seed, step, args.batch_size, args.seq_len, model.vocab_size)
        if step == first and not args.resume:   # the first step against the same step on one device
            reference = jax.jit(train_step(graphdef, optimizer))(host_params, optimizer.init(host_params),
                                                                  inputs, targets)
        with rnn.use_mesh(mesh, rules(args.fsdp)):
            new = step_fn(params, opt_state, to_mesh(inputs, batch_sharding), to_mesh(targets, batch_sharding))
        if step == first and not args.resume:
            errors = {"loss": abs(float(new[2]) - float(reference[2])) / abs(float(reference[2])),
                      "optimizer state": relative_error(new[1], reference[1])}
            for name, value in errors.items():
                print(f"{me} max error, first step {name} vs one device: {value:.3e}", flush=True)
            failed = max(errors.values()) > args.tolerance
        params, opt_state, loss = new
        print(f"{me} step {step:3d} loss {float(loss):.4f}", flush=True)

    if args.checkpoint_dir:
        save_checkpoint(args.checkpoint_dir, first + args.steps, params, opt_state)
        print(f"{me} saved step {first + args.steps} to {args.checkpoint_dir}", flush=True)
    if args.save_pretrained:
        nnx.update(model, params)
        save_pretrained(model, args.save_pretrained)
        print(f"{me} wrote {args.save_pretrained}", flush=True)
    if args.process_id is not None:
        jax.distributed.shutdown()
    if failed:
        print(f"{me} FAILED: the first step differs from one device's by more than --tolerance {args.tolerance}")
    return int(failed)


def launcher():
    """`examples/multiprocess.py`'s launcher, imported by path (examples/ is no package)."""
    spec = importlib.util.spec_from_file_location("multiprocess_example", Path(__file__).with_name("multiprocess.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.launch


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    sizes = parse_mesh(args.mesh)
    if args.resume and not args.checkpoint_dir:
        raise SystemExit("--resume needs --checkpoint-dir")
    if args.num_processes > 1 and args.process_id is None:
        return launcher()(args, argv, script=__file__)
    import jax

    local = args.local_devices or math.prod(sizes.values()) // args.num_processes
    jax.config.update("jax_num_cpu_devices", local)   # before the first use of a device; CPUs only
    started = time.perf_counter()
    code = run_process(args, sizes)
    print(f"done in {time.perf_counter() - started:.1f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
