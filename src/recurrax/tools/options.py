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
