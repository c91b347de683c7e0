"""`recurrax compile --target h100|h200|b200|v5e|v6e`: compile what dispatch picks for a chip
this machine does not have, and print what each kernel needs (registers, spills, shared memory)
and how long compiling took.

A configuration is one call of `recurrax.recurrent` or `recurrax.delta_rule` (gates, head dims,
dtype, dense or packed) compiled as a forward program (output and final state) or a gradient program
(`value_and_grad` of a scalar loss). `REPRESENTATIVE` is what CI compiles; `--full` the product.

The report is one markdown table, a row as each configuration compiles; a configuration that
fails is a row with the compiler's first error line, and the rest still compile. A last line
sums up what fit (shared memory and registers on a GPU, scoped VMEM on a TPU). The exit status
is 1 when any configuration failed, 2 when nothing could be compiled (no toolchain).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import re
from collections.abc import Iterable

import jax
import jax.numpy as jnp

import recurrax
from recurrax import kernel_registry, targets
from recurrax.delta import kernel_registry as delta_registry

from .cases import DELTA_DIFF_ARGS, Case, DeltaCase, delta_options, make_delta_inputs, make_inputs, split_args

GATE_SETS = {"none": (), "head": ("g_head", "g_gamma"), "channel": ("g_channel",), "both": ("g_head", "gk")}
"""Every key-side gate kind: none, per head (g and g_gamma), per key channel, both."""
DELTA_GATE_SETS = {"none": (), "head": ("g",), "channel": ("gk",), "both": ("g", "gk")}
"""The same kinds for the delta rule: none, per-head `g`, per-key-channel `gk`, both."""
CU_SEQLENS = (0, 50, 50, 200)  # an empty sequence, boundaries inside chunks
T = 200


@dataclasses.dataclass(frozen=True)
class Configuration:
    """One program to compile: a `recurrent` call (or a `delta_rule` call, `delta`) and whether
    its gradient is taken."""

    gates: str
    K: int
    V: int
    dtype: str = "bfloat16"
    packed: bool = False
    reverse: bool = False
    gradient: bool = True
    delta: bool = False

    @property
    def label(self) -> str:
        flags = [self.dtype, "packed" if self.packed else "dense"] + (["reverse"] if self.reverse else [])
        operation = "delta_rule " if self.delta else ""
        return f"{operation}{self.gates} K{self.K} V{self.V} {' '.join(flags)} {'gradient' if self.gradient else 'forward'}"

    def case(self) -> Case:
        return Case(B=1 if self.packed else 2, T=T, H=2, Hkv=1, K=self.K, V=self.V, gates=GATE_SETS[self.gates],
                    dtype=self.dtype, reverse=self.reverse, cu_seqlens=CU_SEQLENS if self.packed else None)

    def delta_case(self) -> DeltaCase:
        """The delta rule's call: query/key shared by two value heads, `qk_l2norm`."""
        return DeltaCase(gates=DELTA_GATE_SETS[self.gates], B=1 if self.packed else 2, T=T, Hqk=1, H=2, K=self.K,
                         V=self.V, qk_l2norm=True, cu_seqlens=CU_SEQLENS if self.packed else None)

    def arguments(self) -> dict:
        """The operation's arguments (arrays in `dtype`; for the delta rule β, gates and state
        in float32)."""
        if not self.delta:
            return make_inputs(self.case())
        case = self.delta_case()
        arrays = {name: jnp.asarray(x, self.dtype if name in ("query", "key", "value") else jnp.float32)
                  for name, x in make_delta_inputs(case).items()}
        return {**arrays, **delta_options(case)}


def _product(gates, dims, dtypes, packed, reverse, gradient, delta: bool = False) -> list[Configuration]:
    return [Configuration(g, K, V, d, p, r, grad, delta)
            for g, (K, V), d, p, r, grad in itertools.product(gates, dims, dtypes, packed, reverse, gradient)]


GPU_DIMS = ((64, 64), (128, 128))
TPU_DIMS = tuple((K, V) for K in (64, 128, 256) for V in (64, 128, 256))
REPRESENTATIVE = {
    "gpu": _product(GATE_SETS, GPU_DIMS, ["bfloat16"], [False, True], [False], [False, True]),
    "tpu": (_product(GATE_SETS, [(128, 128)], ["bfloat16", "float32", "float16"], [False], [False], [True])
            + _product(["head", "channel"], [(64, 64), (128, 256), (256, 128)], ["bfloat16"], [False], [False], [True])
            + [Configuration(g, 64, 128, "bfloat16", p, r) for g in GATE_SETS
               for p, r in ((True, False), (False, True), (True, True))]
            + _product(GATE_SETS, [(128, 128)], ["bfloat16"], [False], [False], [True], delta=True)
            + [Configuration("both", 128, 128, "float32", True, delta=True),
               Configuration("channel", 64, 256, "bfloat16", delta=True)]),
}
"""What CI compiles. GPU: every gate kind × K = V ∈ {64, 128} × dense / packed × forward /
gradient, bf16 (32 programs). TPU: the configurations `tests/test_kernels_tpu.py` exports, and
the delta rule's kernels for every gate kind (gradient programs: forward, chunk states and
backward kernels), packed float32, and K = 64, V = 256."""
FULL = {
    "gpu": _product(GATE_SETS, [(64, 64), (64, 128), (128, 64), (128, 128)], ["bfloat16", "float16"],
                    [False, True], [False, True], [False, True]),
    "tpu": (_product(GATE_SETS, TPU_DIMS, ["bfloat16", "float32", "float16"], [False, True], [False, True], [True])
            + _product(GATE_SETS, TPU_DIMS, ["bfloat16", "float32"], [False, True], [False], [True], delta=True)),
}
"""The declared product (slow)."""


def program(configuration: Configuration, implementation: str | None = None):
    """`(fn, args)`: the configuration's program and its inputs, for `targets.compile_for`."""
    if configuration.delta:
        given = configuration.arguments()
        diff = {name: given.pop(name) for name in DELTA_DIFF_ARGS if name in given}
        rest = given
    else:
        diff, rest = split_args(make_inputs(configuration.case()))
    arrays = {name: value for name, value in rest.items() if hasattr(value, "shape")}
    static = {name: value for name, value in rest.items() if not hasattr(value, "shape")}
    operation = recurrax.delta_rule if configuration.delta else recurrax.recurrent

    def forward(diff, arrays):
        return operation(**diff, **arrays, **static, implementation=implementation)

    def loss(diff, arrays):
        output, state = forward(diff, arrays)
        return jnp.sum(output.astype(jnp.float32)) + jnp.sum(state)

    fn = jax.value_and_grad(loss) if configuration.gradient else forward
    return fn, (diff, arrays)


def selection(target: str, configuration: Configuration, implementation: str | None = None):
    """Which implementation dispatch picks for the configuration on `target`, and why."""
    registry = delta_registry if configuration.delta else kernel_registry
    with recurrax.target(target):
        return registry.select(**configuration.arguments(), implementation=implementation)


@dataclasses.dataclass(frozen=True)
class Result:
    """One configuration: the implementation dispatch picked and the compiled program, or the
    compiler's first error line when it did not compile."""

    configuration: Configuration
    implementation: str
    compiled: targets.CompiledProgram | None
    error: str | None = None


def compile_configuration(target: str, configuration: Configuration, implementation: str | None = None) -> Result:
    """Compile one configuration for `target` with what dispatch picks (or `implementation`)."""
    chosen = selection(target, configuration, implementation).name
    fn, args = program(configuration, implementation)
    return Result(configuration, chosen, targets.compile_for(target, fn, *args))


def attempt(target: str, configuration: Configuration, implementation: str | None = None) -> Result:
    """`compile_configuration`, a failure kept as the result's `error` (the compiler's first
    error line) instead of raised. The compiler's log on standard error (MLIR diagnostics,
    libtpu's messages) is read for that line and not shown."""
    with targets.captured_fd(2) as log:
        try:
            return compile_configuration(target, configuration, implementation)
        except Exception as error:  # noqa: BLE001  (any compiler's failure is a row of the report)
            failure = error
    try:
        chosen = selection(target, configuration, implementation).name or "none"
    except ValueError:
        chosen = implementation or "none"
    return Result(configuration, chosen, None, first_error_line(failure, "".join(log)))


def first_error_line(error: Exception, log: str) -> str:
    """The first `error:` line the compiler logged (from `error:` on, without the MLIR location),
    else the first line of the exception."""
    for line in log.splitlines():
        if "error:" in line:
            return line[line.index("error:"):].strip()
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return f"{type(error).__name__}: {lines[0]}"


HEADER = ("| configuration | implementation | compile s | kernel | registers | spill stores / loads (B) "
          "| shared memory per block | XLA temp / code (per device) |\n|---|---|---|---|---|---|---|---|")


def rows(result: Result) -> list[str]:
    """The table's rows of one result: a row per kernel (GPU) or per program (TPU), or the error."""
    head = f"| {result.configuration.label} | {result.implementation} "
    if result.compiled is None:
        return [head + f"| failed | {result.error.replace('|', '/')} | | | | |"]
    memory = result.compiled.memory()
    xla = f"{_kib(memory.temp_size_in_bytes)} / {_kib(memory.generated_code_size_in_bytes)}" if memory else "n/a"
    head += f"| {result.compiled.seconds:.1f} "
    tpu_kernels = mosaic_tpu_kernels(result.compiled) or "—"
    lines = [] if result.compiled.kernels else [head + f"| {tpu_kernels} | — | — | — | {xla} |"]
    for kernel in result.compiled.kernels:
        smem = "?" if kernel.smem_bytes is None else _kib(kernel.smem_bytes)
        lines.append(head + f"| {kernel.name} | {kernel.registers} | {kernel.spill_stores} / {kernel.spill_loads} "
                     f"| {smem} | {xla} |")
    for name in result.compiled.unreported:
        lines.append(head + f"| {name} | (compiled earlier in this process, not reported) | | | {xla} |")
    return lines


def mosaic_tpu_kernels(compiled: targets.CompiledProgram) -> str:
    """The Mosaic TPU kernels a compiled TPU program launches, by name ("" for none): its
    `tpu_custom_call` instructions, named after their `pallas_call`s."""
    if compiled.target.backend != "tpu":
        return ""
    calls = re.findall(r'%([\w-]+?)(?:\.\d+)? = [^\n]*custom_call_target="tpu_custom_call"', compiled.executable.as_text())
    return ", ".join(dict.fromkeys(calls))


def table(results: Iterable[Result]) -> str:
    """A markdown table: a row per kernel (GPU) or per program (TPU), a failure's error."""
    return "\n".join([HEADER] + [line for result in results for line in rows(result)])


def summary(target: targets.Target, results: list[Result]) -> str:
    """One line: how many configurations compiled, and how the largest fit the chip."""
    compiled = [result for result in results if result.compiled is not None]
    failed = len(results) - len(compiled)
    line = f"{target.name}: {len(compiled)} of {len(results)} configurations compiled"
    line += f", {failed} failed" if failed else ""
    if not compiled:
        return line
    fit = _gpu_fit(target, compiled) if target.backend == "gpu" else _tpu_fit(target, compiled)
    return f"{line}; {fit}"


def _gpu_fit(target: targets.Target, compiled: list[Result]) -> str:
    kernels = [kernel for result in compiled for kernel in result.compiled.kernels]
    if not kernels:
        return "no ptxas report (it covers Mosaic GPU kernels only)"
    smem = max(kernel.smem_bytes or 0 for kernel in kernels)
    spilling = sum(kernel.spills for kernel in kernels)
    return (f"shared memory per block at most {_kib(smem)} of {_kib(target.spec.smem_per_block_optin)}, "
            f"registers at most {max(kernel.registers for kernel in kernels)} of 255, {spilling} kernels spill")


def _tpu_fit(target: targets.Target, compiled: list[Result]) -> str:
    temp = {result.configuration.label: result.compiled.memory().temp_size_in_bytes for result in compiled}
    largest = max(temp, key=temp.get)
    return (f"every kernel fit the {target.spec.scoped_vmem_bytes >> 20} MiB scoped VMEM of {target.arch} "
            f"(Mosaic TPU's check when compiling); largest XLA temp {_kib(temp[largest])} ({largest})")


def _kib(size: int) -> str:
    return f"{size / 1024:.1f} KiB"


def _configurations(args: argparse.Namespace, backend: str) -> list[Configuration]:
    chosen = (FULL if args.full else REPRESENTATIVE)[backend]
    if args.shapes:
        dims = {tuple(int(x) for x in shape.lower().split("x")) for shape in args.shapes}
        chosen = list(dict.fromkeys(dataclasses.replace(c, K=K, V=V) for c in chosen for K, V in dims))
    if args.gates:
        chosen = [c for c in chosen if c.gates in args.gates]
    if args.forward_only:  # the forward program of each (the TPU sets hold only gradient programs)
        chosen = list(dict.fromkeys(dataclasses.replace(c, gradient=False) for c in chosen))
    return chosen[: args.limit] if args.limit else chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="recurrax compile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, choices=sorted(targets.TARGETS), help="the chip to compile for")
    parser.add_argument("--shapes", nargs="*", metavar="KxV", help="head dims instead of the set's, e.g. 64x64 128x128")
    parser.add_argument("--gates", nargs="*", choices=sorted(GATE_SETS), help="only these gate kinds")
    parser.add_argument("--implementation", help="force an implementation instead of dispatch's pick")
    parser.add_argument("--full", action="store_true", help="the declared product instead of the representative set")
    parser.add_argument("--forward-only", action="store_true", help="the forward program of each configuration, no gradient")
    parser.add_argument("--limit", type=int, help="compile at most this many configurations")
    parser.add_argument("--serialize", metavar="DIR", help="write each executable (serialize_executable) to DIR")
    args = parser.parse_args(argv)
    target = targets.get_target(args.target)
    with targets.captured_fd(2):  # libtpu's start-up messages (no TPU here, no metadata server)
        missing = targets.toolchain_missing(target)
    if missing:
        print(f"cannot compile for {target.name}: {missing}")
        return 2
    configurations = _configurations(args, target.backend)
    if not configurations:
        print(f"no configuration to compile for {target.name} with these options")
        return 2
    print(f"target {target.name} ({target.chip.kind}, {target.arch}); dispatch on the first configuration:")
    try:
        print(selection(target.name, configurations[0], args.implementation))
    except ValueError as refusal:  # a forced implementation that refuses it; each row says why
        print(refusal)
    print(HEADER, flush=True)
    results = []
    for configuration in configurations:
        result = attempt(target.name, configuration, args.implementation)
        results.append(result)
        if args.serialize and result.compiled is not None:
            _write(args.serialize, target.name, result)
        print("\n".join(rows(result)), flush=True)
    print(summary(target, results))
    return 1 if any(result.error for result in results) else 0


def _write(folder: str, target: str, result: Result) -> None:
    import pathlib
    import pickle

    path = pathlib.Path(folder) / f"{target}-{result.configuration.label.replace(' ', '-')}.pkl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(result.compiled.serialize()))
