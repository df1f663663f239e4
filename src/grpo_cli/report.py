"""`grpo-report DIR`: plots and an HTML page for a training run or a Hydra sweep.

A run dir holds `metrics.jsonl` and `.hydra/{config,overrides}.yaml`; a sweep dir holds
`multirun.yaml` and numbered job dirs `0/`, `1/`, ... that are run dirs.
"""

from __future__ import annotations

import argparse
import csv
import html
import math
from pathlib import Path

import yaml
from matplotlib.figure import Figure  # no pyplot: renders headless via Agg, no global state

from grpo_cli.errors import ReportError, one_line
from grpo_cli.metrics import final_mean, read_metrics
from grpo_cli.overrides import override_key

RUN_PLOTS = {  # file stem -> (metric key, y label)
    "kl": ("kl", "KL to reference"),
    "clip_fraction": ("clip_fraction", "clipped ratio fraction"),
    "completion_len": ("completion_len", "completion length (tokens)"),
    "entropy": ("entropy", "entropy (nats/token)"),
    "eval_accuracy": ("eval/accuracy", "eval accuracy"),
}
SWEEP_PLOTS = {"reward": "mean reward", "kl": "KL to reference", "clip_fraction": "clipped ratio fraction"}
Curve = tuple[str, list[float], list[float]]


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def final_value(rows: list[dict], key: str = "reward") -> float:
    """Mean of the last 10% (at least one) of the logged values."""
    return final_mean(series(rows, key)[1])


def overrides(run: Path) -> list[str]:
    f = run / ".hydra" / "overrides.yaml"
    return [str(o) for o in (yaml.safe_load(f.read_text()) or [])] if f.exists() else []


def config_text(run: Path) -> str:
    f = run / ".hydra" / "config.yaml"
    return f.read_text() if f.exists() else "(no .hydra/config.yaml)"


def _smooth(ys: list[float], alpha: float = 0.1) -> list[float]:
    out, acc = [], ys[0]
    for y in ys:
        acc = alpha * y + (1 - alpha) * acc
        out.append(acc)
    return out


def plot_curves(png: Path, title: str, ylabel: str, curves: list[Curve]) -> None:
    """Raw values per curve, plus a faint EMA when a curve is long enough to be noisy."""
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for label, xs, ys in curves:
        (line,) = ax.plot(xs, ys, lw=1, alpha=0.9 if len(ys) < 20 else 0.45, label=label)
        if len(ys) >= 20:
            ax.plot(xs, _smooth(ys), lw=2, color=line.get_color())
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    if len(curves) > 1:
        ax.legend(fontsize="small")
    fig.savefig(png, dpi=100)


def run_plots(rows: list[dict], out: Path) -> list[str]:
    reward_keys = sorted({k for r in rows for k in r if k.startswith("reward/")})
    curves = [(k, *series(rows, k)) for k in ["reward", *reward_keys]]
    pngs = {"reward.png": ("reward", "reward", [c for c in curves if c[1]])}
    for stem, (key, ylabel) in RUN_PLOTS.items():
        xs, ys = series(rows, key)
        if ys:
            pngs[f"{stem}.png"] = (key, ylabel, [(key, xs, ys)])
    for name, (title, ylabel, cs) in pngs.items():
        plot_curves(out / name, title, ylabel, cs)
    return list(pngs)


def split_overrides(ovs: list[str]) -> dict[str, str]:
    return {override_key(o): o.partition("=")[2] for o in ovs if "=" in o}


def _sort_key(v: str) -> tuple[int, float, str]:
    try:
        return (0, float(v), "")
    except ValueError:
        return (1, 0.0, v)


def final_plot(png: Path, jobs: list[tuple[Path, list[dict]]]) -> bool:
    """Heatmap of final reward over two swept keys, bars over one; False when neither applies."""
    params = [split_overrides(overrides(d)) for d, _ in jobs]
    keys = sorted({k for p in params for k in p if len({q.get(k) for q in params}) > 1})
    if len(keys) not in (1, 2):
        return False
    finals = [final_value(rows) for _, rows in jobs]
    axes = [sorted({p.get(k, "") for p in params}, key=_sort_key) for k in keys]
    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.add_subplot()
    if len(keys) == 1:
        vals = {p.get(keys[0], ""): f for p, f in zip(params, finals, strict=True)}
        ax.bar(axes[0], [vals.get(v, math.nan) for v in axes[0]])
        ax.set(xlabel=keys[0], ylabel="final reward")
    else:
        grid = [[math.nan] * len(axes[0]) for _ in axes[1]]
        for p, f in zip(params, finals, strict=True):
            grid[axes[1].index(p.get(keys[1], ""))][axes[0].index(p.get(keys[0], ""))] = f
        im = ax.imshow(grid, origin="lower", cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(axes[0])), axes[0])
        ax.set_yticks(range(len(axes[1])), axes[1])
        ax.set(xlabel=keys[0], ylabel=keys[1])
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if not math.isnan(v):
                    ax.text(j, i, f"{v:.3f}", ha="center", va="center", color="w")
        fig.colorbar(im, ax=ax, label="final reward")
    ax.set_title("final reward (mean of last 10% of steps)")
    fig.savefig(png, dpi=100)
    return True


def _page(title: str, body: list[str]) -> str:
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;max-width:1000px;margin:auto}img{max-width:100%}"
        "pre{background:#f4f4f4;padding:8px;overflow:auto}td,th{border:1px solid #ccc;padding:2px 6px}"
        "table{border-collapse:collapse}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def _imgs(names: list[str]) -> list[str]:
    return [f"<p><img src='{html.escape(n)}' alt='{html.escape(n)}'></p>" for n in names]


def _csv_table(f: Path) -> str:
    with f.open(newline="") as fh:
        rows = list(csv.reader(fh))
    cells = ["".join(f"<{t}>{html.escape(c)}</{t}>" for c in r) for t, r in
             [("th", rows[0])] + [("td", r) for r in rows[1:]]] if rows else []
    return "<table>" + "".join(f"<tr>{c}</tr>" for c in cells) + "</table>"


def run_report(run: Path, out: Path) -> str:
    rows = read_metrics(run / "metrics.jsonl")
    if not rows:
        raise ReportError(f"no metric rows in metrics.jsonl, {run}; let the run log at least one step")
    ovs = " ".join(overrides(run)) or "(none)"
    return _page(f"GRPO run: {run.name}", [
        f"<p>{len(rows)} steps; final reward {final_value(rows):.4f}; overrides: <code>{html.escape(ovs)}</code></p>",
        *_imgs(run_plots(rows, out)),
        "<h2>Resolved config</h2>", f"<pre>{html.escape(config_text(run))}</pre>",
    ])


def sweep_report(sweep: Path, out: Path) -> str:
    from grpo_cli.sweep import find_job_dirs

    dirs = find_job_dirs(sweep)
    jobs = [(d, read_metrics(d / "metrics.jsonl")) for d in dirs if (d / "metrics.jsonl").exists()]
    jobs = [(d, rows) for d, rows in jobs if rows]
    skipped = [job_name(sweep, d) for d in dirs if d not in {j[0] for j in jobs}]
    if not jobs:
        raise ReportError(f"no job with metrics.jsonl in sweep, {sweep}; wait for a job to log a step")
    labels = [" ".join(overrides(d)) or f"job {job_name(sweep, d)}" for d, _ in jobs]
    pngs = []
    for key, ylabel in SWEEP_PLOTS.items():
        curves = [(lab, *series(rows, key)) for lab, (_, rows) in zip(labels, jobs, strict=True)]
        plot_curves(out / f"sweep_{key}.png", f"{key} per job", ylabel, [c for c in curves if c[1]])
        pngs.append(f"sweep_{key}.png")
    if final_plot(out / "sweep_heatmap.png", jobs):
        pngs.append("sweep_heatmap.png")
    body = [f"<p>{len(jobs)} jobs with metrics.</p>"]
    if skipped:
        body.append(f"<p class='skipped'>Skipped jobs without metrics: {html.escape(', '.join(skipped))}</p>")
    if (sweep / "sweep_summary.csv").exists():
        body += ["<h2>Summary</h2>", _csv_table(sweep / "sweep_summary.csv")]
    body += _imgs(pngs) + ["<h2>Jobs</h2>"]
    for lab, (d, rows) in zip(labels, jobs, strict=True):
        body.append(f"<h3>job {job_name(sweep, d)}: <code>{html.escape(lab)}</code></h3><p>final reward "
                    f"{final_value(rows):.4f}</p><details><summary>resolved config</summary>"
                    f"<pre>{html.escape(config_text(d))}</pre></details>")
    return _page(f"GRPO sweep: {sweep.name}", body)


def job_name(sweep: Path, job_dir: Path) -> str:
    """A job as the sweep's summary names it: its dir relative to the sweep dir (`3`, or `a/3` for a nested subdir)."""
    return job_dir.relative_to(sweep).as_posix()


def make_report(path: Path, out: Path | None = None) -> Path:
    """Write the PNGs and `report.html` for a run or sweep dir into `out` (default: `path`)."""
    path = Path(path)
    if not path.is_dir():
        raise ReportError(f"no such directory, {path}; pass a Hydra run dir or multirun sweep dir")
    out = Path(out) if out is not None else path
    is_sweep = (path / "multirun.yaml").exists() or not (path / "metrics.jsonl").exists() and any(
        d.is_dir() and d.name.isdigit() for d in path.iterdir())
    if not is_sweep and not (path / "metrics.jsonl").exists():
        raise ReportError(f"no metrics.jsonl found, {path}; pass a run dir holding metrics.jsonl or a sweep dir")
    out.mkdir(parents=True, exist_ok=True)
    page = sweep_report(path, out) if is_sweep else run_report(path, out)
    (out / "report.html").write_text(page)
    return out / "report.html"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="grpo-report", description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="run dir (metrics.jsonl) or sweep dir (multirun.yaml)")
    ap.add_argument("--out", type=Path, default=None, help="output dir (default: DIR)")
    args = ap.parse_args(argv)
    with one_line("grpo-report"):
        print(make_report(args.dir, args.out))
    return 0
