"""Argument types of the command-line options: a bad value ends the command with argparse's
usage error (exit 2) naming the option, never a traceback."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer ≥ 1."""
    return _int_from(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """An integer ≥ 0."""
    return _int_from(text, 0, "a non-negative integer")


def _int_from(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def positive_int_list(text: str) -> list[int]:
    """Comma-separated integers ≥ 1 (at least one), e.g. `256,1024`."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return [positive_int(item) for item in items]


def non_negative_float(text: str) -> float:
    """A finite number ≥ 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number ≥ 0, got {text}")
    return value


def probability(text: str) -> float:
    """A number in (0, 1]."""
    value = non_negative_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def add_compilation_cache_option(parser: argparse.ArgumentParser) -> None:
    """`--no-compilation-cache`: what turns off the persistent compilation cache a command starts
    (`recurrax.use_compilation_cache`; `RECURRAX_COMPILATION_CACHE=off` does it too)."""
    parser.add_argument("--no-compilation-cache", action="store_true",
                        help="compile everything afresh: no persistent compilation cache (default: "
                        "$RECURRAX_COMPILATION_CACHE, else $XDG_CACHE_HOME/recurrax/jax or ~/.cache/recurrax/jax; "
                        "RECURRAX_COMPILATION_CACHE=off turns it off too)")


def start_compilation_cache(args: argparse.Namespace) -> str | None:
    """The persistent compilation cache on unless `--no-compilation-cache`: its directory, or None."""
    from recurrax import use_compilation_cache

    return None if args.no_compilation_cache else use_compilation_cache()
