"""Argument types that every command line of the project shares: pjinfer's subcommands (pjinfer.cli) and the
measurement scripts run with `python -m pjinfer.measure...`. A bottom-level module: it imports no other pjinfer
module, so every layer of the app may import it."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1; anything else is the parser's one-line error."""
    return _whole_number(text, 1, "a whole number")


def layer_count(text: str) -> int | str:
    """argparse type: a whole number >= 0, or "all" (--offload-layers); the model's own bound is checked later."""
    return text if text == "all" else _whole_number(text, 0, "a number of layers or all")


def _whole_number(text: str, least: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value
