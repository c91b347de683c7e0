"""The `recurrax` command line: `check`, `bench`, `demo`, `generate`, `serve`, `compile`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS = {
    "check": ("recurrax.tools.check", "compare every implementation with the reference"),
    "bench": ("recurrax.tools.bench", "time and measure memory of the implementations"),
    "demo": ("recurrax.tools.demo", "train a small model on associative recall"),
    "generate": ("recurrax.tools.generate", "text from a checkpoint directory (a prompt or a chat), streamed"),
    "serve": ("recurrax.tools.serve", "an OpenAI-compatible HTTP server for a checkpoint directory"),
    "compile": ("recurrax.tools.compile", "compile for a GPU or TPU this machine does not have; kernel resources"),
}
TOOLCHAIN_ENVIRONMENT = {"JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1", "TPU_SKIP_MDS_QUERY": "1",
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
"""`recurrax.targets.ENVIRONMENT` (importing recurrax here would start JAX too early)."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="recurrax", description="linear-time recurrent attention for JAX")
    parser.add_argument("command", choices=sorted(COMMANDS), help="; ".join(f"{k}: {v[1]}" for k, v in COMMANDS.items()))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="options of the command (see `recurrax COMMAND -h`)")
    parsed = parser.parse_args(argv[:1])
    if parsed.command == "compile":  # before JAX starts its backends
        os.environ.update({name: value for name, value in TOOLCHAIN_ENVIRONMENT.items() if name not in os.environ})
    module = importlib.import_module(COMMANDS[parsed.command][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
