#!/usr/bin/env python
"""A sweep on one base against the launchers that load it per job (issue 65; docs/results/sweeps-on-one-base.md): the
README's sweep grid cut to 2 x 2 x 2 (algo.beta x algo.clip_eps x trainer.seed, 8 jobs of recipes' sweep_cpu,
shortened by --steps and --eval-prompts) run by `grpo-train -m` with hydra/launcher=shared_base, basic and joblib,
one after another in the order given. For each: the wall time of the whole command, and the peak of the summed RSS
of grpo-train and every process under it (read from /proc every 0.2 s: joblib's jobs run in processes of their
own, two at a time here, and their memory adds up); then every job's metrics and each cell of sweep_cells.csv
against the basic launcher's, as the largest relative difference of a number.

    python scripts/bench_sweeps.py                                  # shared_base, basic, joblib; table on stdout
    python scripts/bench_sweeps.py --launchers shared_base,basic --steps 3

The machine's load average is printed with each run: times are only comparable at a like load.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GRID = ["algo.beta=0.0,0.04", "algo.clip_eps=0.1,0.3", "trainer.seed=0,1"]
# model=tiny draws its random base from trainer.seed, so its jobs on one base sweep the learning rate instead
TINY_GRID = ["algo.beta=0.0,0.04", "algo.clip_eps=0.1,0.3", "optimizer.lr=5e-5,1e-4"]
TIMING = ("_time_s", "_per_s", "gen_compile_s", "gen_sync_s", "time_s")


def tree_rss_mb(root: int) -> float:
    """The summed RSS of `root` and every process under it."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            statm = (entry / "statm").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
        rss[int(entry.name)] = int(statm.split()[1])
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        stack.extend(children.get(pid, []))
    return total * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_sweep(launcher: str, folder: Path, args: argparse.Namespace) -> dict:
    grpo_train = Path(sys.executable).with_name("grpo-train")
    model = ["model=tiny", "rollout.temperature=1.0"] if args.model == "tiny" else []
    grid = TINY_GRID if args.model == "tiny" else GRID
    command = [str(grpo_train), "-m", "+recipe=sweep_cpu", *model, *grid, f"trainer.max_steps={args.steps}",
               f"eval.num_prompts={args.eval_prompts}", f"trainer.device={args.device}",
               f"hydra/launcher={launcher}", f"hydra.sweep.dir={folder}"]
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, cwd=folder.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL)
    peak = [0.0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss_mb(proc.pid))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate(timeout=args.timeout)
    wall = time.perf_counter() - t0
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"bench_sweeps: {launcher} exited {proc.returncode}:\n{out[-3000:]}")
    return {"launcher": launcher, "wall_s": round(wall, 1), "peak_rss_mb": round(peak[0]),
            "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2), "dir": str(folder)}


def numbers(row: dict) -> dict[str, float]:
    out = {}
    for key, value in row.items():
        if key.endswith(TIMING):
            continue
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue
    return out


def largest_difference(want: list[dict], got: list[dict]) -> float:
    """The largest |a - b| / max(|a|, 1e-12) over the numbers of rows taken in order (0 where both are NaN)."""
    assert len(want) == len(got), (len(want), len(got))
    worst = 0.0
    for a_row, b_row in zip(want, got, strict=True):
        a, b = numbers(a_row), numbers(b_row)
        assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
        for key in a:
            x, y = a[key], b[key]
            if math.isnan(x) and math.isnan(y):
                continue
            worst = max(worst, abs(x - y) / max(abs(x), 1e-12))
    return worst


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_csv(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def compare(basic: Path, other: Path) -> dict:
    jobs = sorted(p.name for p in basic.iterdir() if p.name.isdigit())
    metrics = max(largest_difference(read_jsonl(basic / j / "metrics.jsonl"), read_jsonl(other / j / "metrics.jsonl"))
                  for j in jobs)
    cells = largest_difference(read_csv(basic / "sweep_cells.csv"), read_csv(other / "sweep_cells.csv"))
    return {"jobs": len(jobs), "metrics_rel": metrics, "cells_rel": cells}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launchers", default="shared_base,basic,joblib")
    parser.add_argument("--steps", type=int, default=4, help="trainer.max_steps of each job")
    parser.add_argument("--eval-prompts", type=int, default=20, help="eval.num_prompts of each job's final eval")
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2",
                        help="the recipe's embedded SmolLM2-135M, or model=tiny (a quick look, a dry run)")
    parser.add_argument("--device", default="cpu", help="trainer.device of every job (cpu, cuda)")
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-sweeps-") as scratch:
        for launcher in args.launchers.split(","):
            folder = Path(scratch, launcher, "sweep")
            folder.parent.mkdir(parents=True)
            run = run_sweep(launcher, folder, args)
            print(f"{launcher}: {json.dumps(run)}", file=sys.stderr, flush=True)
            runs.append(run)
        basic = next((Path(r["dir"]) for r in runs if r["launcher"] == "basic"), None)
        for run in runs:
            run["vs_basic"] = compare(basic, Path(run["dir"])) if basic and run["launcher"] != "basic" else None
    reference = next((r for r in runs if r["launcher"] == "basic"), runs[0])
    grid = TINY_GRID if args.model == "tiny" else GRID
    print(f"8 jobs of sweep_cpu ({' '.join(grid)}), model {args.model} on {args.device}, {args.steps} steps, final "
          f"eval on {args.eval_prompts} prompts; {os.cpu_count()} cores\n")
    print("| launcher | wall s | x basic | peak RSS of the tree MB | x basic | metrics vs basic (largest rel.) | "
          "cells vs basic | load before -> after |")
    print("|---|---|---|---|---|---|---|---|")
    for run in runs:
        vs = run["vs_basic"]
        metrics, cells = ("-", "-") if vs is None else (f"{vs['metrics_rel']:.2e}", f"{vs['cells_rel']:.2e}")
        print(f"| {run['launcher']} | {run['wall_s']} | {run['wall_s'] / reference['wall_s']:.2f} | "
              f"{run['peak_rss_mb']} | {run['peak_rss_mb'] / reference['peak_rss_mb']:.2f} | {metrics} | {cells} "
              f"| {run['load_before']} -> {run['load_after']} |")
    if args.json_out:
        args.json_out.write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
