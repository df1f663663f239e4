"""The sweep's ranked cells drawn (grpo-report): each cell's mean of the ranking metric with its 95 % interval as
a heatmap or bars, and the cell table for the terminal (rich) and the page (HTML), labelled as sweep.stats ranks
them."""

from __future__ import annotations

import html
import math
from pathlib import Path

from matplotlib.figure import Figure  # no pyplot: renders headless via Agg, no global state
from matplotlib.patches import Rectangle
from rich.table import Table as RichTable

from grpo_cli.sweep.stats import ALL_TIED, ALPHA, BEST, LEADS, TIED, WORSE, cell_keys


def sort_key(v: str) -> tuple[int, float, str]:
    try:
        return (0, float(v), "")
    except ValueError:
        return (1, 0.0, v)


CELL_STYLE = {BEST: ("bold green", "best", "★ "), TIED: ("yellow", "tied", "≈ "), ALL_TIED: ("yellow", "tied", "≈ "),
              WORSE: ("red", "worse", ""), LEADS: ("green", "leads", "")}


def half_width(cell: dict, metric: str) -> float | None:
    """The ± of a cell's 95 % interval of `metric`; None when it has none (n < 2)."""
    low, high = cell.get(f"{metric}_ci_low"), cell.get(f"{metric}_ci_high")
    return None if low is None or high is None else (high - low) / 2


def cell_name(cell: dict, keys: list[str]) -> str:
    return " ".join(f"{k}={cell[k]}" for k in cell_keys(keys)) or "all jobs"


def estimate(cell: dict, metric: str, digits: int = 3) -> str:
    mean, half = cell.get(f"{metric}_mean"), half_width(cell, metric)
    if mean is None:
        return "-"
    if half is None:
        return f"{mean:.{digits}f} (n = {cell[f'{metric}_n']})"
    return f"{mean:.{digits}f} ± {half:.{digits}f}"


def cell_plot(png: Path, table: list[dict], keys: list[str]) -> str:
    """Each cell's mean of the ranking metric with its 95 % interval, the best cell marked: a heatmap over the
    first two cell keys, else bars with error bars. Returns a line on what the figure leaves out ("" if nothing)."""
    rank_by, axes_keys = table[0]["rank_by"], cell_keys(keys)
    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.add_subplot()
    note = ""
    if len(axes_keys) >= 2:
        xk, yk = axes_keys[:2]
        if len(axes_keys) > 2:
            note = (f"the heatmap shows {xk} x {yk}; {', '.join(axes_keys[2:])} also swept: each square shows its "
                    "best cell (the table lists them all)")
        xs = sorted({str(c[xk]) for c in table}, key=sort_key)
        ys = sorted({str(c[yk]) for c in table}, key=sort_key)
        grid: list[list[dict | None]] = [[None] * len(xs) for _ in ys]
        for cell in table:  # best first: a square keeps its best cell
            i, j = ys.index(str(cell[yk])), xs.index(str(cell[xk]))
            grid[i][j] = grid[i][j] or cell
        means = [[math.nan if c is None or c[f"{rank_by}_mean"] is None else c[f"{rank_by}_mean"] for c in row]
                 for row in grid]
        # the colours span the intervals, not just the means: cells whose difference is noise look alike
        ends = [c[f"{rank_by}_mean"] + sign * (half_width(c, rank_by) or 0.0) for c in table
                if c[f"{rank_by}_mean"] is not None for sign in (-1, 1)]
        im = ax.imshow(means, origin="lower", cmap="viridis", aspect="auto", vmin=min(ends, default=None),
                       vmax=max(ends, default=None))
        fig.colorbar(im, ax=ax, label=rank_by)
        ax.set_xticks(range(len(xs)), xs)
        ax.set_yticks(range(len(ys)), ys)
        ax.set(xlabel=xk, ylabel=yk)
        for i, row in enumerate(grid):
            for j, square in enumerate(row):
                if square is None or square[f"{rank_by}_mean"] is None:
                    continue
                best = square["label"] == BEST
                label = {BEST: "best\n", TIED: "tied with best\n", ALL_TIED: "tied\n", WORSE: "worse\n",
                         LEADS: "highest mean\n"}.get(
                    square["label"], "")
                ax.text(j, i, label + estimate(square, rank_by).replace(" ± ", "\n± "),
                        ha="center", va="center", color="w", fontweight="bold" if best else "normal")
                if best:
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", lw=3))
    else:
        bars = sorted(table, key=lambda c: [sort_key(str(c[k])) for k in axes_keys])  # in the swept values' order
        heights = [math.nan if c[f"{rank_by}_mean"] is None else c[f"{rank_by}_mean"] for c in bars]
        ax.bar(range(len(bars)), heights, yerr=[half_width(c, rank_by) or 0.0 for c in bars], capsize=6,
               color=["tab:red" if c["label"] == BEST else "tab:blue" for c in bars])
        ticks = [f"{cell_name(c, keys)}\n{estimate(c, rank_by)}" + ("\nbest" if c["label"] == BEST else "")
                 for c in bars]
        ax.set_xticks(range(len(bars)), ticks, rotation=20 if len(bars) > 4 else 0)
        ax.set(ylabel=rank_by)
    n = sorted({c[f"{rank_by}_n"] for c in table})
    seeds = f"n = {n[0]}" if len(n) == 1 else f"n = {n[0]}..{n[-1]}"
    ax.set_title(f"{rank_by}: cell mean ± 95 % CI ({seeds} seeds; best marked)")
    fig.savefig(png, dpi=100)
    return note


def p_value(value: float | None) -> str:
    """A p-value in 2 significant digits, more where rounding would carry it across ALPHA (0.04997, not 0.05, for a
    cell labelled worse)."""
    if value is None:
        return "-"
    for digits in (2, 3, 4, 6):
        text = f"{value:.{digits}g}"
        if (float(text) < ALPHA) == (value < ALPHA):
            return text
    return repr(value)


def rich_cells(table: list[dict], keys: list[str]) -> RichTable:
    """The ranked cells for the terminal; the best in green, ties with it in yellow, worse in red."""
    rank_by = table[0]["rank_by"]
    out = RichTable(title=f"sweep cells ranked by {rank_by}: mean ± 95 % CI over seeds, "
                          "Welch's t-test against the best")
    for column in ["rank", *cell_keys(keys), "n", "mean ± CI", "p vs best", "paired p", "label"]:
        is_p_value = column.startswith(("p ", "paired"))
        out.add_column(column, justify="right" if column != "label" else "left",
                       no_wrap=column in ("mean ± CI", "label"), min_width=4 if is_p_value else None)
    for cell in table:
        style, _css, mark = CELL_STYLE.get(cell["label"], ("dim", "", ""))
        p = cell["p_vs_best"]
        label = mark + cell["label"] + (f"; {cell['note']}" if cell["note"] else "")
        out.add_row("-" if cell["rank"] is None else str(cell["rank"]), *(str(cell[k]) for k in cell_keys(keys)),
                    str(cell[f"{rank_by}_n"]), estimate(cell, rank_by, 4), p_value(p),
                    p_value(cell.get("p_paired_vs_best")), label, style=style)
    return out


def html_cells(table: list[dict], keys: list[str]) -> str:
    rank_by = table[0]["rank_by"]
    head = ["rank", *cell_keys(keys), "n", f"{rank_by} mean ± 95 % CI", "p vs best (Welch)", "paired p (same seeds)",
            "label"]
    lines = ["<table class='cells'><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    for cell in table:
        _style, css, mark = CELL_STYLE.get(cell["label"], ("", "untested", ""))
        p = cell["p_vs_best"]
        values = ["-" if cell["rank"] is None else cell["rank"], *(cell[k] for k in cell_keys(keys)),
                  cell[f"{rank_by}_n"], estimate(cell, rank_by, 4), p_value(p), p_value(cell.get("p_paired_vs_best")),
                  mark + cell["label"] + (f"; {cell['note']}" if cell["note"] else "")]
        lines.append(f"<tr class='{css}'>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in values) + "</tr>")
    return "".join(lines) + "</table>"
