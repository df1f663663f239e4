#!/usr/bin/env python
"""Long completions: our GRPO step against TRL 1.16's as the completions grow, and the longest completion each
fits in a memory cap (make bench-long).

    python scripts/bench_long.py --mode lengths                      # T in 256, 1024, 4096: s/step, peak RSS
    python scripts/bench_long.py --mode budget --caps 8,16           # the longest T (doubling from 256) under a cap

Both at P=1 prompt x G=8 completions of exactly T new tokens (min_new_tokens) on the embedded SmolLM2-135M, fp32,
LoRA r=16 on all linear layers, beta 0.04, one update per step; each cell is one step in a fresh subprocess
(scripts/bench_worker.py), one after another, alone on the machine. TRL runs at each of `--trl` settings: `nogc`
(the whole batch in one forward, no recomputation: TRL at its fastest), `default` (GRPOConfig's own defaults:
gradient_checkpointing=True) and `lean` (its documented memory settings: checkpointing and one completion per
forward, gradient accumulation over the batch). Ours runs at its defaults, with `--ours-budget GB` also with
trainer.memory_budget_gb=GB (its memory settings follow from the budget), and under a cap with
trainer.memory_budget_gb set to the cap. A cap is enforced on the whole process by a cgroup's memory limit (what it
holds in memory, as a container would count it; its OOM killer ends the worker at the cap), or RLIMIT_DATA where no
cgroup can be made; an allocation past it counts as "does not fit", and so does a cell past `--cell-timeout` seconds
(an hour) for the time table. With two threads (the default here: the machine is the benchmark's alone) OpenMP keeps
its own wait policy: PASSIVE, which the one-thread bench sets for a shared machine, makes each of a decode step's many
small products wait for sleeping threads (93 against 69 ms a decode step at T=256, 2026-12-03). `--warmup 0` (the
default here) times the first step: at these lengths the first step's extra costs are seconds against minutes. The
last line printed is one JSON object with every cell.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import DEFAULTS, fmt, note, print_table, spawn, versions

TRL_SIDES = ("nogc", "default", "lean")


CGROUP_V1 = Path("/sys/fs/cgroup/memory")


class MemoryCap:
    """A memory cap on one worker: a cgroup (v1 memory controller) whose limit counts what the process holds in
    memory, as a container or a small machine would, and whose OOM killer ends it at the cap; else, where no cgroup
    can be made, RLIMIT_DATA in the worker (stricter: it counts reserved memory too)."""

    def __init__(self, cap_gb: float | None, tag: str):
        self.cap, self.dir, self.kind = cap_gb, None, None
        if cap_gb is None:
            return
        try:
            self.dir = CGROUP_V1 / f"grpo-bench-{os.getpid()}-{tag}"
            self.dir.mkdir()
            (self.dir / "memory.limit_in_bytes").write_text(str(int(cap_gb * 2**30)))
            self.kind = "cgroup"
        except OSError:
            self.dir, self.kind = None, "rlimit_data"

    def spec(self, spec: dict) -> dict:
        return {**spec, "rlimit_gb": self.cap} if self.kind == "rlimit_data" else spec

    def preexec(self):
        if self.dir is None:
            return None
        tasks = self.dir / "tasks"
        return lambda: tasks.write_text(str(os.getpid()))

    def close(self) -> dict:
        """What the cap saw: its kind, the peak it charged (cgroup) and whether its OOM killer ended the worker."""
        if self.dir is None:
            return {"cap_gb": self.cap, "cap_kind": self.kind}
        peak = int((self.dir / "memory.max_usage_in_bytes").read_text()) / 2**20
        control = dict(line.split() for line in (self.dir / "memory.oom_control").read_text().splitlines())
        killed = int(control.get("oom_kill", 0)) > 0
        self.dir.rmdir()
        return {"cap_gb": self.cap, "cap_kind": self.kind, "cgroup_peak_mb": peak, "oom_killed": killed}


def run_cell(side: str, spec: dict, log_dir: Path, tag: str, timeout: int, cap_gb: float | None = None) -> dict:
    """One measurement: {"status": ok | oom | timeout | failed, ...the worker's numbers}, under `cap_gb` if given."""
    note(f"bench-long: {tag} ...")
    cap = MemoryCap(cap_gb, tag)
    try:
        res = spawn("trl" if side.startswith("trl") else "ours", cap.spec(spec), log_dir, tag, timeout,
                    preexec=cap.preexec())
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "timeout_s": timeout, **cap.close()}
    except SystemExit as failed:
        seen = cap.close()
        return {"status": "oom" if seen.get("oom_killed") else "failed", "error": str(failed)[-400:], **seen}
    res.update(cap.close())
    if res.get("oom"):  # an allocation past RLIMIT_DATA, which the worker reports
        return {"status": "oom", **res}
    step = res["steps"][0]
    rows = spec["prompts"] * spec["G"]
    out = {"status": "ok", "s": step["s"], "gen_s": step["gen_s"], "peak_mb": res["peak_mb"],
           "decode_ms_per_row_step": 1000.0 * step["gen_s"] / spec["max_new_tokens"] / rows,
           "phases": step.get("phases"), "memory_plan": res.get("memory_plan"), "wall_s": res["wall_s"],
           **{k: res[k] for k in ("cap_gb", "cap_kind", "cgroup_peak_mb") if k in res}}
    note(f"bench-long:   {tag}: {out['s']:.1f} s/step (generation {out['gen_s']:.1f} s), peak {out['peak_mb']:.0f} MB")
    return out


def spec_for(args, T: int, side: str, **extra) -> dict:
    spec = {**DEFAULTS, "prompts": 1, "G": args.G, "max_new_tokens": T, "model": "embedded", "model_dir": None,
            "device": "cpu", "steps": 1, "warmup": args.warmup, "threads": args.threads, "engine": "auto",
            "precision": "fp32", "omp_wait_policy": "" if args.threads > 1 else "PASSIVE", **extra}
    if side.startswith("trl-"):
        spec["trl"] = side.removeprefix("trl-")
    return spec


def shown(cell: dict | None, key: str, spec: str = ".1f") -> str:
    if cell is None:
        return "not run"
    if cell["status"] != "ok":
        return {"oom": "out of memory", "timeout": "> 1 h", "failed": "failed"}[cell["status"]]
    return fmt(cell[key], spec)


def lengths(args, log_dir: Path) -> dict:
    ours = ["ours", *(["ours-budget"] if args.ours_budget else [])]
    sides = [*ours, *(f"trl-{s}" for s in args.trl)]
    cells: dict[str, dict[int, dict]] = {side: {} for side in sides}
    budget = {"overrides": [f"trainer.memory_budget_gb={args.ours_budget}"]}
    for T in args.lengths:
        for side in sides:
            if side in args.skip.get(T, ()):
                continue
            spec = spec_for(args, T, side, **(budget if side == "ours-budget" else {}))
            cells[side][T] = run_cell(side, spec, log_dir, f"lengths-T{T}-{side}", args.cell_timeout)
    rows = []
    for T in args.lengths:
        for key, label, f in (("s", "s / step", ".1f"), ("gen_s", "generation s", ".1f"),
                              ("decode_ms_per_row_step", "decode ms / row-step", ".2f"),
                              ("peak_mb", "peak RSS MB", ".0f")):
            rows.append([f"T={T} {label}", *(shown(cells[s].get(T), key, f) for s in sides)])
        for mine in ours:
            for other in sides[len(ours):]:
                a, b = cells[mine].get(T), cells[other].get(T)
                if a and b and a["status"] == b["status"] == "ok":
                    rows.append([f"T={T} {mine} / {other}", *("" for _ in sides)])
                    rows[-1][1 + sides.index(other)] = f"{a['s'] / b['s']:.2f} time, " \
                                                       f"{a['peak_mb'] / b['peak_mb']:.2f} memory"
    print_table(f"GRPO step as completions grow: P=1 G={args.G}, exactly T new tokens, fp32, threads={args.threads}",
                ["", *sides], rows)
    return {"mode": "lengths", "cells": cells}


def budget(args, log_dir: Path) -> dict:
    """Caps in increasing order; a step that fits a cap fits every larger one, so under a larger cap each side starts
    at the first T that did not fit the smaller one (the cells it skips say so)."""
    sides = ["ours", *(f"trl-{s}" for s in args.trl)]
    found: dict[str, dict[float, dict]] = {side: {} for side in sides}
    for side in sides:
        longest, start = None, 0
        for cap in sorted(args.caps):
            tried = {T: {"status": "ok", "fits_a_smaller_cap": True} for T in args.lengths[:start]}
            for i, T in enumerate(args.lengths[start:], start):
                if side in args.skip.get(T, ()):
                    tried[T] = {"status": "not run"}
                    break
                extra = {"overrides": [f"trainer.memory_budget_gb={cap}"]} if side == "ours" else {}
                cell = run_cell(side, spec_for(args, T, side, **extra), log_dir, f"budget-{cap:g}g-T{T}-{side}",
                                args.cell_timeout, cap_gb=cap)
                tried[T] = cell
                if cell["status"] != "ok":
                    break
                longest, start = T, i + 1
            found[side][cap] = {"longest": longest, "cells": tried}
    rows = [[f"{cap:g} GiB", *(str(found[s][cap]["longest"] or "none") for s in sides)] for cap in sorted(args.caps)]
    print_table(f"the longest T (doubling from {args.lengths[0]}, at most {args.lengths[-1]}) whose step fits the cap: "
                f"P=1 G={args.G}, fp32, threads={args.threads}", ["cap", *sides], rows)
    return {"mode": "budget", "found": found}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("lengths", "budget"), default="lengths")
    p.add_argument("--lengths", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   help="T values; default 256,1024,4096 (lengths), 256,512,...,4096 (budget)")
    p.add_argument("--caps", type=lambda v: [float(x) for x in v.split(",")], default=[8.0, 16.0], help="GiB")
    p.add_argument("--trl", type=lambda v: v.split(","), default=None,
                   help="TRL settings to run; default nogc,default,lean (lengths), default,lean (budget)")
    p.add_argument("--skip", type=lambda v: {int(t): s.split("+") for t, s in (x.split(":") for x in v.split(","))},
                   default={}, help="cells not to run, e.g. 4096:trl-nogc+trl-default (said in the table)")
    p.add_argument("--ours-budget", type=float, default=None,
                   help="lengths: also ours with trainer.memory_budget_gb=GB (its memory settings, as TRL's lean)")
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--threads", type=int, default=2, help="torch threads per subprocess (2 = both cores here)")
    p.add_argument("--warmup", type=int, default=0, help="untimed steps before the timed one")
    p.add_argument("--cell-timeout", type=int, default=3600, help="seconds a cell may take")
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument("--log-dir", type=Path, default=None)
    args = p.parse_args(argv)
    args.lengths = args.lengths or ([256, 1024, 4096] if args.mode == "lengths" else [256, 512, 1024, 2048, 4096])
    args.trl = args.trl or (list(TRL_SIDES) if args.mode == "lengths" else ["default", "lean"])
    if not set(args.trl) <= set(TRL_SIDES):
        p.error(f"--trl takes {', '.join(TRL_SIDES)}")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="grpo-bench-long-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    note(f"bench-long: subprocess logs in {log_dir}")
    load_before = os.getloadavg()
    result = (lengths if args.mode == "lengths" else budget)(args, log_dir)
    result.update({"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "threads": args.threads,
                   "ours_budget_gb": args.ours_budget,
                   "G": args.G, "lengths": args.lengths, "trl_settings": args.trl, "cell_timeout_s": args.cell_timeout,
                   "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "loadavg_before": load_before,
                            "loadavg_after": os.getloadavg(), "avx512": "avx512f" in Path("/proc/cpuinfo").read_text()},
                   "versions": versions()})
    line = json.dumps(result, default=str)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(line + "\n")
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
