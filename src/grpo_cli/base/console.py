"""Printing a rich table so that it stays readable where it lands."""

from __future__ import annotations

from rich.console import Console, RenderableType
from rich.measure import Measurement

WIDEST = 400  # a pipe has no width of its own; a row wider than this is folded after all


def print_table(console: Console, table: RenderableType) -> None:
    """On a terminal as rich does (folded to its width). Off one (a pipe, a file, CI) rich assumes 80 columns and
    squashes a many-column table to slivers: print it at its own natural width there instead."""
    if console.is_terminal:
        console.print(table)
        return
    natural = Measurement.get(console, console.options.update(width=WIDEST), table).maximum
    before = console.width
    console.width = max(before, min(natural, WIDEST))  # print(width=) cannot go past the console's own width
    try:
        console.print(table)
    finally:
        console.width = before
