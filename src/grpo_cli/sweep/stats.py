"""Seed-aware statistics of a sweep: jobs grouped into cells, each metric's spread over seeds, a ranking
that says which differences are real.

A *cell* is the set of jobs whose swept overrides match except for the seed (`trainer.seed`). For every
metric column a cell gets n (its seeds: runs of one seed count once, at their mean), mean, std (over its seeds,
ddof 1) and a 95 % Student-t confidence interval;
a cell with n = 1 gets no interval (its std and bounds are None). Cells are ranked by the sweep metric
(higher is better) and each is compared with the best cell by Welch's t-test (unequal variances: seeds of
different settings need not spread alike): `best`, `tied with best` (p >= 0.05, or the same mean) or `worse`. A
comparison that needs two seeds on both sides says `n = 1: not tested` instead of guessing. When every other cell
is tied with the first, no cell is best: each is `tied`. The first cell is `best` only when another tested worse;
else (cells of one seed, a lone cell) it is `highest mean, none tested worse`.

Jobs of one seed see the same prompts in the same order, so the seed often moves a job more than the swept
setting does. Beside Welch's p (which labels) each cell also gets `p_paired_vs_best`: a paired t-test of its
jobs against the best cell's jobs of the same seeds (two shared seeds at least), which takes that shared
part of the noise out.

Why Welch's t-test and not rliable's bootstrap: with 2-5 seeds a cell a bootstrap has too few distinct
resamples to give a stable interval, while the t-interval and Welch's test are exact under normal noise and
honest (wide) at small n. Both come from scipy.stats, not from code of ours.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

SEED_KEY = "trainer.seed"
CONFIDENCE = 0.95
ALPHA = 0.05
BEST, TIED, WORSE, UNTESTED = "best", "tied with best", "worse", "n = 1: not tested"
ALL_TIED = "tied"  # every cell, when none differs from the first: none is best
LEADS = "highest mean, none tested worse"  # the first cell, where no comparison found another worse


def describe(values: Sequence[float]) -> dict:
    """n, mean, std and the 95 % t-interval of the finite values; None where n is too small for it."""
    from scipy import stats

    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(xs)
    if n == 0:
        return {"n": 0, "mean": None, "std": None, "ci_low": None, "ci_high": None}
    mean = sum(xs) / n
    if n == 1:
        return {"n": 1, "mean": mean, "std": None, "ci_low": None, "ci_high": None}
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1) * std / math.sqrt(n)
    return {"n": n, "mean": mean, "std": std, "ci_low": mean - half, "ci_high": mean + half}


def welch_p(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Two-sided p-value of Welch's t-test of a against b; None when either has fewer than two values.
    Two samples without spread are equal (p = 1) or not (p = 0)."""
    from scipy import stats

    a, b = [float(x) for x in a], [float(x) for x in b]
    if len(a) < 2 or len(b) < 2:
        return None
    if max(a) == min(a) and max(b) == min(b):
        return 1.0 if a[0] == b[0] else 0.0
    return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def paired_p(a: dict, b: dict) -> float | None:
    """Two-sided p-value of a paired t-test of a against b, {seed: value} each, over the seeds both have; None
    with fewer than two shared seeds. Differences without spread are all zero (p = 1) or not (p = 0)."""
    from scipy import stats

    seeds = [s for s in a if s in b]
    if len(seeds) < 2:
        return None
    diffs = [float(a[s]) - float(b[s]) for s in seeds]
    if all(math.isclose(d, diffs[0], rel_tol=1e-9, abs_tol=1e-12) for d in diffs):  # 0.42 - 0.82 vs 0.40 - 0.80
        return 1.0 if math.isclose(diffs[0], 0.0, abs_tol=1e-12) else 0.0
    return float(stats.ttest_rel([a[s] for s in seeds], [b[s] for s in seeds]).pvalue)


def cell_keys(swept: Sequence[str]) -> list[str]:
    """The swept keys that define a cell: all of them but the seed."""
    return [k for k in swept if k != SEED_KEY]


def group_cells(rows: list[dict], swept: Sequence[str]) -> list[tuple[tuple, list[dict]]]:
    """(cell values, its job rows) in order of first appearance; a cell's values follow `cell_keys(swept)`."""
    keys = cell_keys(swept)
    cells: dict[tuple, list[dict]] = {}
    for row in rows:
        cells.setdefault(tuple(_hashable(row.get(k)) for k in keys), []).append(row)
    return list(cells.items())


def _hashable(value):
    return repr(value) if isinstance(value, (list, dict)) else value


def _metric_values(jobs: list[dict], metric: str) -> list[float]:
    return [v for _, v in _results(jobs, metric)]


def _results(jobs: list[dict], metric: str) -> list[tuple[object, float]]:
    """(seed, value) for each seed of the jobs that finished with a finite value of `metric`. Runs of one seed (a
    point a sweeper drew again; a cell whose seed is not swept, all of the config's one seed) are one sample, their
    mean: repeating a run is no new seed, and counted as one it would give an interval the seeds never showed."""
    by_seed: dict = {}
    for job in jobs:
        v = job.get(metric)
        if job.get("status", "ok") == "ok" and isinstance(v, (int, float)) and math.isfinite(v):
            by_seed.setdefault(_hashable(job.get(SEED_KEY)), []).append(float(v))
    return [(seed, sum(values) / len(values)) for seed, values in by_seed.items()]


def cell_table(rows: list[dict], swept: Sequence[str], metrics: Sequence[str], rank_by: str) -> list[dict]:
    """One row per cell: its swept values, jobs / ok / failed counts, `<metric>_{n,mean,std,ci_low,ci_high}`
    for every metric, and `rank`, `p_vs_best`, `label`, `p_paired_vs_best` by `rank_by`; best first."""
    keys = cell_keys(swept)
    cells = []
    for _values, jobs in group_cells(rows, swept):
        cell: dict[str, Any] = dict(zip(keys, (jobs[0].get(k) for k in keys), strict=True))
        ok = [j for j in jobs if j.get("status", "ok") == "ok"]
        cell.update(jobs=len(jobs), ok=len(ok), failed=len(jobs) - len(ok),
                    seeds=[j.get(SEED_KEY) for j in jobs if SEED_KEY in j])
        for metric in metrics:
            for stat, v in describe(_metric_values(jobs, metric)).items():
                cell[f"{metric}_{stat}"] = v
        results = _results(jobs, rank_by)
        cell["_values"] = [v for _, v in results]
        cell["_by_seed"] = {seed: v for seed, v in results if seed is not None}
        cells.append(cell)
    ranked = sorted(cells, key=lambda c: -math.inf if c[f"{rank_by}_mean"] is None else c[f"{rank_by}_mean"],
                    reverse=True)
    top = ranked[0] if ranked and ranked[0][f"{rank_by}_mean"] is not None else None
    # (values, by seed, mean) of the best cell, kept before the loop pops its values
    best = (top["_values"], top["_by_seed"], top[f"{rank_by}_mean"]) if top is not None else None
    for rank, cell in enumerate(ranked, 1):
        values, by_seed = cell.pop("_values"), cell.pop("_by_seed")
        cell["p_paired_vs_best"] = None
        if cell[f"{rank_by}_mean"] is None or best is None:
            cell.update(rank=None, p_vs_best=None, label="no result")
            continue
        cell["rank"] = rank
        if rank == 1:
            cell.update(p_vs_best=None, label=BEST)
            continue
        best_values, best_by_seed, best_mean = best
        p = welch_p(values, best_values)
        cell["p_vs_best"] = p
        same = math.isclose(cell[f"{rank_by}_mean"], best_mean, rel_tol=1e-12, abs_tol=1e-12)
        cell["label"] = TIED if same else UNTESTED if p is None else (TIED if p >= ALPHA else WORSE)
        cell["p_paired_vs_best"] = paired_p(by_seed, best_by_seed)
    ranked_cells = [c for c in ranked if c["rank"] is not None]
    if len(ranked_cells) > 1 and all(c["label"] == TIED for c in ranked_cells[1:]):
        for cell in ranked_cells:
            cell["label"] = ALL_TIED
    elif ranked_cells and not any(c["label"] == WORSE for c in ranked_cells):
        ranked_cells[0]["label"] = LEADS
    return ranked
