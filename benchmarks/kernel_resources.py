"""What each kernel needs on the chips it is written for, compiled on this CPU (no device):

    python benchmarks/kernel_resources.py --cuda-python CUDA_PYTHON \
        --tpu-python TPU_PYTHON                     # -> benchmarks/results/kernel_resources.md
    python benchmarks/kernel_resources.py --targets v5e v6e ...   # rerun some; the others' sections stay
    python benchmarks/kernel_resources.py --targets h100 --before 410f1b1   # + that commit's figures beside

- **H100 (sm_90a)**: the `mosaic_gpu` kernels of every gate kind, K = V ∈ {64, 128}, dense and
  packed, forward and gradient programs, bf16 (`recurrax.tools.compile.REPRESENTATIVE["gpu"]`):
  ptxas's registers and spills per thread, and shared memory per block.
- **TPU v5e and v6e**: the `pallas_tpu` programs of `REPRESENTATIVE["tpu"]`: XLA's memory
  analysis per device and compile time.

Each target runs in a child process with the interpreter that has its toolchain
(`pip install 'recurrax[compile-cuda]'` / `'recurrax[compile-tpu]'`, in separate environments:
CUDA_PYTHON and TPU_PYTHON are their interpreters, default this one);
a target whose toolchain is missing is reported as such. Compile times are of a 2-core CPU
shared with other work: read them as orders of magnitude.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "kernel_resources.md"
TARGETS = {"h100": "cuda", "v5e": "tpu", "v6e": "tpu"}


def gpu_section(target: str) -> str:
    from recurrax.tools.compile import REPRESENTATIVE, compile_configuration

    rows = ["| kernel | gate | K = V | layout | program | registers | spill stores / loads (B) | SMEM per block "
            "| compile s |", "|---|---|---|---|---|---|---|---|---|"]
    for configuration in REPRESENTATIVE["gpu"]:
        result = compile_configuration(target, configuration, implementation="mosaic_gpu")
        for kernel in result.compiled.kernels:
            smem = "?" if kernel.smem_bytes is None else f"{kernel.smem_bytes / 1024:.1f} KiB"
            rows.append(f"| {kernel.name.removeprefix('recurrax_mgpu_')} | {configuration.gates} | {configuration.K} "
                        f"| {'packed' if configuration.packed else 'dense'} "
                        f"| {'gradient' if configuration.gradient else 'forward'} | {kernel.registers} "
                        f"| {kernel.spill_stores} / {kernel.spill_loads} | {smem} | {result.compiled.seconds:.1f} |")
        for name in result.compiled.unreported:
            rows.append(f"| {name} | {configuration.gates} | {configuration.K} | | | (reported above) | | | |")
        print(rows[-1], file=sys.stderr, flush=True)
    return "\n".join(rows)


def tpu_section(target: str) -> str:
    from recurrax.tools.compile import REPRESENTATIVE, compile_configuration

    rows = ["| configuration (gradient program) | argument | output | temporary | generated code | compile s |",
            "|---|---|---|---|---|---|"]
    for configuration in REPRESENTATIVE["tpu"]:
        result = compile_configuration(target, configuration, implementation="pallas_tpu")
        memory = result.compiled.memory()
        sizes = [memory.argument_size_in_bytes, memory.output_size_in_bytes, memory.temp_size_in_bytes,
                 memory.generated_code_size_in_bytes]
        label = configuration.label.removesuffix(" gradient")
        rows.append(f"| {label} | " + " | ".join(f"{size / 1024:.0f} KiB" for size in sizes)
                    + f" | {result.compiled.seconds:.1f} |")
        print(rows[-1], file=sys.stderr, flush=True)
    return "\n".join(rows)


def one(target: str) -> str:
    from recurrax import targets

    missing = targets.toolchain_missing(target)
    if missing:
        return f"Not compiled here: {missing}."
    import jax

    header = f"{targets.get_target(target).chip.kind}, {targets.get_target(target).arch}; JAX {jax.__version__}."
    body = gpu_section(target) if targets.get_target(target).backend == "gpu" else tpu_section(target)
    return header + "\n\n" + body


def _sections(text: str) -> dict[str, str]:
    """The committed file's sections by target (those not rerun are kept)."""
    parts = re.split(r"^## (\w+)\n", text, flags=re.M)
    return {name: f"## {name}\n{body.rstrip()}\n" for name, body in zip(parts[1::2], parts[2::2]) if name in TARGETS}


def _h100_rows(text: str) -> dict[tuple[str, ...], list[str]]:
    """{(kernel, gate, K, layout, program): [registers, spills]} of a file's h100 table."""
    rows = {}
    for line in _sections(text).get("h100", "").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 7 and cells[2].isdigit():
            rows[tuple(cells[:5])] = cells[5:7]
    return rows


def with_before(section: str, revision: str) -> str:
    """The h100 section with the registers and spills of `revision`'s committed table beside
    each kernel (a before/after table)."""
    committed = subprocess.run(["git", "show", f"{revision}:{RESULTS.relative_to(REPO)}"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout
    before = _h100_rows(committed)
    lines = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| kernel |"):
            line += f" registers at {revision} | spill stores / loads (B) at {revision} |"
        elif line.startswith("|---"):
            line += "---|---|"
        elif line.startswith("|") and len(cells) >= 7:
            line += " " + " | ".join(before.get(tuple(cells[:5]), ["?", "?"])) + " |"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuda-python", default=sys.executable, help="interpreter with recurrax[compile-cuda]")
    parser.add_argument("--tpu-python", default=sys.executable, help="interpreter with recurrax[compile-tpu]")
    parser.add_argument("--one", choices=sorted(TARGETS), help=argparse.SUPPRESS)  # the child's job
    parser.add_argument("--targets", nargs="*", default=list(TARGETS), choices=sorted(TARGETS))
    parser.add_argument("--before", metavar="REVISION", help="git revision whose h100 figures go beside the new ones")
    args = parser.parse_args()
    if args.one:
        print(one(args.one))
        return
    environment = {**os.environ, "PYTHONPATH": str(REPO / "src"), "JAX_PLATFORMS": "cpu",
                   "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", "TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    sections = _sections(RESULTS.read_text()) if RESULTS.exists() else {}
    for target in args.targets:
        python = args.cuda_python if TARGETS[target] == "cuda" else args.tpu_python
        child = subprocess.run([python, __file__, "--one", target], env=environment, capture_output=True, text=True)
        if child.returncode:
            raise SystemExit(f"{target} failed:\n{child.stderr[-4000:]}")
        body = child.stdout.strip()
        if args.before and target == "h100":
            body = with_before(body, args.before)
        sections[target] = f"## {target}\n\n{body}\n"
    sections = [sections[target] for target in TARGETS if target in sections]
    today = datetime.date.today().isoformat()
    RESULTS.write_text(
        "# Kernel resources, compiled for the chips without them\n\n"
        f"`python benchmarks/kernel_resources.py` ({today}; `recurrax compile --target NAME` prints the same "
        "per configuration). Registers and spills are ptxas's, per thread (255 is the ceiling); spills go "
        "to local memory. SMEM is dynamic + static per block, from the kernel's launch. TPU sizes are XLA's "
        "memory analysis per device. Compile times: a 2-core CPU shared with other work.\n\n" + "\n".join(sections)
    )
    print(RESULTS.read_text())


if __name__ == "__main__":
    main()
