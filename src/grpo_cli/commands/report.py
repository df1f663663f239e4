"""`grpo-report DIR`: plots and an HTML page for a training run or a Hydra sweep.

A run dir holds `metrics.jsonl` and `.hydra/{config,overrides}.yaml`; a sweep dir holds
`multirun.yaml` and numbered job dirs `0/`, `1/`, ... that are run dirs. A sweep's report answers which
setting is best: its cells (jobs that differ only in trainer.seed, sweep.cells) ranked in the terminal and
the page, a heatmap of each cell's mean with its 95 % interval, and one reward curve per cell.
"""

from __future__ import annotations

import argparse
import csv
import html
from pathlib import Path

import yaml
from matplotlib.figure import Figure  # no pyplot: renders headless via Agg, no global state
from rich.console import Console
from rich.table import Table as RichTable

from grpo_cli.base.console import print_table
from grpo_cli.base.errors import MetricsError, ReportError, one_line, warn
from grpo_cli.base.metrics import ADAPTER_DIR, SAMPLES, final_mean, read_metrics
from grpo_cli.commands.cells import cell_name, cell_plot, html_cells, rich_cells
from grpo_cli.config.schema import default_of
from grpo_cli.run import monitors
from grpo_cli.sweep.stats import SEED_KEY, group_cells
from grpo_cli.sweep.summary import CELLS_CSV, SUMMARY_CSV, Summary, find_job_dirs, summarise, write_summary

RUN_PLOTS = {  # file stem -> (metric key, y label)
    "kl": ("kl", "KL to reference"),
    "clip_fraction": ("clip_fraction", "clipped ratio fraction"),
    "completion_len": ("completion_len", "completion length (tokens)"),
    "entropy": ("entropy", "entropy (nats/token)"),
    "eval_accuracy": ("eval/accuracy", "eval accuracy"),
}
SAMPLES_SHOWN = 16  # completions of the newest logged step on a run's page (two of the quickstart's groups)
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


MONITOR_PANELS = (  # metric key, title, the alarm's bounds (low, high: None = none)
    ("monitor/length_ratio", "completion length / its first 5 steps'", monitors.LENGTH_RATIO),
    ("monitor/top_reward_share", "largest weighted reward's share", (None, monitors.TOP_SHARE)),
    ("monitor/kl_acceleration", f"kl's acceleration (alarm with kl > {monitors.KL_FLOOR})",
     (None, monitors.KL_ACCELERATION)),
    ("truncated_frac", "truncated completions", (None, monitors.TRUNCATED_SHARE)),
)


def reward_weights(run: Path) -> dict[str, float]:
    """Each reward function's weight, from the run's resolved config (1 where it names none)."""
    f = run / ".hydra" / "config.yaml"
    functions = ((yaml.safe_load(f.read_text()) or {}).get("reward") or {}).get("functions") if f.exists() else None
    return {name: float((spec or {}).get("weight", default_of("reward.functions.*.weight")))
            for name, spec in (functions or {}).items()
            if isinstance(spec, dict) or spec is None}


def rewards_carrying_the_task(run: Path) -> set[str]:
    """reward.accuracy and reward.task_rewards of the run's resolved config: the dominance alarm leaves them out."""
    f = run / ".hydra" / "config.yaml"
    reward = ((yaml.safe_load(f.read_text()) or {}).get("reward") or {}) if f.exists() else {}
    return {str(n) for n in [reward.get("accuracy"), *(reward.get("task_rewards") or [])] if n is not None}


def monitor_panel(png: Path, rows: list[dict], said: list[tuple[int, str]]) -> None:
    """The reward-hacking monitors over the steps, each with its alarm threshold, and a line where an alarm fired."""
    fig = Figure(figsize=(10, 6), layout="constrained")
    axes = fig.subplots(2, 2).ravel()
    for ax, (key, title, (low, high)) in zip(axes, MONITOR_PANELS, strict=True):
        xs, ys = series(rows, key)
        ax.plot(xs, ys, lw=1.2, marker="." if len(ys) < 20 else None)
        for bound in (low, high):
            if bound is not None:
                ax.axhline(bound, color="tab:red", ls="--", lw=1)
        for step, line in said:
            if line.startswith(key):
                ax.axvline(step, color="tab:red", lw=2, alpha=0.6)
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)
        if not ys:
            ax.text(0.5, 0.5, "not defined in this run", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle("reward-hacking monitors: dashed = alarm threshold, red line = alarm (after 10 steps past it)")
    fig.savefig(png, dpi=100)


def monitor_section(run: Path, rows: list[dict], out: Path) -> list[str]:
    """The page's monitors: the panel and the alarms the run raised (computed again from its rows)."""
    seen, said = monitors.Monitors(reward_weights(run), rewards_carrying_the_task(run)).replay(rows)
    monitor_panel(out / "monitors.png", seen, said)
    alarms = "".join(f"<li>step {step}: {html.escape(line)}</li>" for step, line in said)
    return ["<h2>Reward-hacking monitors</h2>", f"<ul class='alarms'>{alarms}</ul>" if said else "<p>No alarm.</p>",
            *_imgs(["monitors.png"])]


def cell_curves(png: Path, sweep: Path, rows: list[dict], keys: list[str]) -> None:
    """Reward over steps, one line per cell: the mean over its seeds, a band from their min to their max."""
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for _values, jobs in group_cells(rows, keys):
        ok = [j for j in jobs if j["status"] == "ok"]  # a failed job's curve is no seed of its cell's mean
        per_step: dict[float, list[float]] = {}
        for job in list(ok):
            try:
                metrics = read_metrics(sweep / job["dir"] / "metrics.jsonl")
            except MetricsError:  # damaged: the summary's line names it
                ok.remove(job)
                continue
            for step, value in zip(*series(metrics, "reward"), strict=True):
                per_step.setdefault(step, []).append(value)
        if not per_step:
            continue
        steps = sorted(per_step)
        mean = [sum(per_step[s]) / len(per_step[s]) for s in steps]
        (line,) = ax.plot(steps, mean, lw=1.5, label=f"{cell_name(jobs[0], keys)} (n = {len(ok)})")
        if len(ok) > 1:
            ax.fill_between(steps, [min(per_step[s]) for s in steps], [max(per_step[s]) for s in steps],
                            color=line.get_color(), alpha=0.2)
    ax.set(xlabel="step", ylabel="reward", title="reward per cell: mean over seeds, band = min..max")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(png, dpi=100)


def _page(title: str, body: list[str]) -> str:
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;max-width:1000px;margin:auto}img{max-width:100%}"
        "pre{background:#f4f4f4;padding:8px;overflow:auto}td,th{border:1px solid #ccc;padding:2px 6px}"
        "table{border-collapse:collapse}tr.best{background:#c8f0c8;font-weight:bold}tr.tied{background:#fff0b8}"
        "tr.worse{color:#a33}tr.untested{color:#888}tr.leads{background:#e4f4e4}"
        ".unfinished{background:#ffe0b0;padding:6px;font-weight:bold}"
        "table.samples pre{white-space:pre-wrap;margin:0;padding:2px}tr.prompt{background:#eef}</style></head><body>"
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


def unfinished(run: Path, rows: list[dict]) -> str | None:
    """Why a run dir holds an unfinished run (still running, stopped or crashed), None when it finished: its final
    adapter is written and it logged trainer.max_steps steps (with trainer.epochs: its final adapter is written)."""
    config = run / ".hydra" / "config.yaml"
    trainer = (yaml.safe_load(config.read_text()) or {}).get("trainer") or {} if config.is_file() else {}
    # trainer.epochs: the steps come from the data's size, which .hydra/config.yaml does not hold (its max_steps is
    # the one that option replaced); only the final adapter tells
    by_epochs = isinstance(trainer, dict) and trainer.get("epochs") is not None
    max_steps = trainer.get("max_steps") if isinstance(trainer, dict) and not by_epochs else None
    adapter = (run / ADAPTER_DIR / "adapter_config.json").is_file()
    short = isinstance(max_steps, int) and len(rows) < max_steps
    if adapter and not short:
        return None
    logged = f"{len(rows)} of {max_steps} steps logged" if isinstance(max_steps, int) else f"{len(rows)} steps logged"
    return f"unfinished: {logged}{'' if adapter else ', no final adapter'} (still running, stopped or crashed)"


def samples_html(run: Path) -> list[str]:
    """The newest logged step's completions (samples.jsonl), each with its prompt and rewards: what the model writes."""
    rows = read_metrics(run / SAMPLES)
    if not rows:
        return ["<h2>Samples</h2>", "<p>No samples: samples.jsonl holds none (trainer.log_samples_every=0, or no "
                "step logged them yet).</p>"]
    step = rows[-1]["step"]
    newest = [r for r in rows if r["step"] == step]
    shown = newest[:SAMPLES_SHOWN]
    rewards = sorted({k for r in shown for k in r if k.startswith("reward/")})
    head = ["completion", "reward", "advantage", *rewards]
    lines = ["<table class='samples'><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    prompt = None
    for r in shown:
        if r.get("prompt") != prompt:  # a group's completions follow its prompt, shown once
            prompt = r.get("prompt")
            lines.append(f"<tr class='prompt'><td colspan='{len(head)}'>prompt:<pre>{html.escape(str(prompt))}</pre>"
                         "</td></tr>")
        text = r.get("conversation") or r.get("completion", "")  # an episode: the whole conversation
        lines.append(f"<tr><td><pre>{html.escape(str(text))}</pre></td>"
                     + "".join(f"<td>{_number(r.get(k))}</td>" for k in ["reward", "advantage", *rewards]) + "</tr>")
    return [f"<h2>Samples of step {html.escape(str(step))}</h2>",
            f"<p>{len(shown)} of its {len(newest)} completions (samples.jsonl).</p>", "".join(lines) + "</table>"]


def _number(value) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else html.escape(str(value if value is not None else "-"))


def run_report(run: Path, out: Path) -> str:
    rows = read_metrics(run / "metrics.jsonl")
    if not rows:
        raise ReportError(f"no metric rows in metrics.jsonl, {run}; let the run log at least one step")
    ovs = " ".join(overrides(run)) or "(none)"
    state = unfinished(run, rows)
    mark = [f"<p class='unfinished'>{html.escape(state)}; resume it with trainer.resume=auto "
            f"hydra.run.dir={html.escape(str(run.resolve()))}</p>"] if state else []
    return _page(f"GRPO run: {run.name}" + (" (unfinished)" if state else ""), [
        *mark,
        f"<p>{len(rows)} steps; final reward {final_value(rows):.4f}; overrides: <code>{html.escape(ovs)}</code></p>",
        *_imgs(run_plots(rows, out)),
        *samples_html(run),
        *monitor_section(run, rows, out),
        "<h2>Resolved config</h2>", f"<pre>{html.escape(config_text(run))}</pre>",
    ])


def sweep_report(sweep: Path, out: Path) -> tuple[str, RichTable | None]:
    """The sweep's page, and its ranked cell table for the terminal (None when no job has a result)."""
    summary = _current_summary(sweep)
    summary_rows, keys = summary.rows, summary.keys
    dirs = [sweep / row["dir"] for row in summary_rows]  # this sweep's jobs, as its summary counts them
    earlier = [job_name(sweep, d) for d in find_job_dirs(sweep) if d not in dirs]
    jobs, damaged = [], []
    for d in dirs:
        try:
            rows = read_metrics(d / "metrics.jsonl") if (d / "metrics.jsonl").exists() else []
        except MetricsError as err:  # one damaged job must not hide the others (the summary's line names it)
            damaged.append(f"{job_name(sweep, d)} ({err})")
            continue
        if rows:
            jobs.append((d, rows))
    skipped = [job_name(sweep, d) for d in dirs if d not in {j[0] for j in jobs}]
    if not jobs:
        raise ReportError(f"no job with metrics.jsonl in sweep, {sweep}; wait for a job to log a step")
    labels = [" ".join(overrides(d)) or f"job {job_name(sweep, d)}" for d, _ in jobs]
    swept = {row["dir"]: row["overrides"] for row in summary_rows}  # a legend names only what differs
    legends = [swept.get(job_name(sweep, d)) or lab for lab, (d, _) in zip(labels, jobs, strict=True)]
    pngs = []
    for key, ylabel in SWEEP_PLOTS.items():
        curves = [(lab, *series(rows, key)) for lab, (_, rows) in zip(legends, jobs, strict=True)]
        plot_curves(out / f"sweep_{key}.png", f"{key} per job", ylabel, [c for c in curves if c[1]])
        pngs.append(f"sweep_{key}.png")
    body = [f"<p>{len(jobs)} jobs with metrics.</p>"]
    if skipped:
        body.append(f"<p class='skipped'>Skipped jobs without metrics: {html.escape(', '.join(skipped))}"
                    + (f"; damaged: {html.escape('; '.join(damaged))}" if damaged else "") + "</p>")
    if earlier:
        body.append(f"<p class='skipped'>Left out, as an earlier sweep's in this dir (their status records name "
                    f"another sweep): {html.escape(', '.join(earlier))}</p>")
    table = summary.cells
    terminal = None
    if any(c["rank"] is not None for c in table):
        note = cell_plot(out / "sweep_heatmap.png", table, keys)
        cell_curves(out / "sweep_cell_curves.png", sweep, summary_rows, keys)
        terminal = rich_cells(table, keys)
        body += ["<h2>Cells</h2>", f"<p>Jobs that differ only in {SEED_KEY} form a cell; each cell's mean has a 95 % "
                 "Student-t interval over its seeds, and is compared with the best cell by Welch's t-test "
                 "(p &ge; 0.05: tied with best); the first is best only where another tested worse.</p>",
                 html_cells(table, keys)]
        body += [f"<p class='note'>{html.escape(note)}</p>"] if note else []
        body += _imgs(["sweep_heatmap.png", "sweep_cell_curves.png"])
    else:
        body.append("<p>No finished job has a result yet: no cells to rank.</p>")
    if (sweep / SUMMARY_CSV).exists():
        body += ["<h2>Summary</h2>", _csv_table(sweep / SUMMARY_CSV)]
    body += _imgs(pngs) + ["<h2>Jobs</h2>"]
    for lab, (d, rows) in zip(labels, jobs, strict=True):
        state = unfinished(d, rows)
        state_note = f"<p class='unfinished'>{html.escape(state)}</p>" if state else ""
        body.append(f"<h3>job {job_name(sweep, d)}: <code>{html.escape(lab)}</code></h3><p>final reward "
                    f"{final_value(rows):.4f}</p>" + state_note
                    + "<details><summary>resolved config</summary>"
                    f"<pre>{html.escape(config_text(d))}</pre></details>")
    return _page(f"GRPO sweep: {sweep.name}", body), terminal


def _current_summary(sweep: Path) -> Summary:
    """The sweep's summary rewritten from its job dirs, so the files on disk and the table shown here agree; each
    damaged or missing record of a finished job is one warning line."""
    try:
        summary = write_summary(sweep)
    except OSError as err:
        summary = summarise(sweep)
        warn(f"could not rewrite {CELLS_CSV} in {sweep} ({err.strerror or err}); the cells shown here are computed "
             "from the job dirs and may differ from it")
    for line in summary.problems:
        warn(line)
    return summary


def job_name(sweep: Path, job_dir: Path) -> str:
    """A job as the sweep's summary names it: its dir relative to the sweep dir (`3`, or `a/3` for a nested subdir)."""
    return job_dir.relative_to(sweep).as_posix()


def make_report(path: Path, out: Path | None = None, console: Console | None = None) -> Path:
    """Write the PNGs and `report.html` for a run or sweep dir into `out` (default: `path`); a sweep's ranked
    cell table is printed on `console` when given."""
    path = Path(path)
    if not path.is_dir():
        raise ReportError(f"no such directory, {path}; pass a Hydra run dir or multirun sweep dir")
    out = Path(out) if out is not None else path
    is_sweep = (path / "multirun.yaml").exists() or not (path / "metrics.jsonl").exists() and any(
        d.is_dir() and d.name.isdigit() for d in path.iterdir())
    if not is_sweep and not (path / "metrics.jsonl").exists():
        raise ReportError(f"no metrics.jsonl found, {path}; pass a run dir holding metrics.jsonl or a sweep dir")
    out.mkdir(parents=True, exist_ok=True)
    page, terminal = sweep_report(path, out) if is_sweep else (run_report(path, out), None)
    (out / "report.html").write_text(page)
    if terminal is not None and console is not None:
        print_table(console, terminal)  # in a pipe too, every column keeps its width
    return out / "report.html"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="grpo-report", description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="run dir (metrics.jsonl) or sweep dir (multirun.yaml)")
    ap.add_argument("--out", type=Path, default=None, help="output dir (default: DIR)")
    args = ap.parse_args(argv)
    with one_line("grpo-report"):
        print(make_report(args.dir, args.out, console=Console()))
    return 0
