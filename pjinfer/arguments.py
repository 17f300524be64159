"""Argument types that every command line of the project shares: pjinfer's subcommands (pjinfer.cli) and the
measurement scripts run with `python -m pjinfer.measure...`. A bottom-level module: it imports no other pjinfer
module, so every layer of the app may import it."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1; anything else is the parser's one-line error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def layer_count(text: str) -> int | str:
    """argparse type: a whole number >= 0, or "all" (--offload-layers); the model's own bound is checked later."""
    if text == "all":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of layers or all, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value
