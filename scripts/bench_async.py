#!/usr/bin/env python
"""Time synchronous generation against generation in a worker one step ahead (rollout.max_staleness=1), on the
quickstart recipe (the embedded model by default), for issue 52's target: a K=1 step <= 0.75x the synchronous one.

    python scripts/bench_async.py                          # 2 rounds x (sync, K=1), 12 steps each, 2 threads
    python scripts/bench_async.py --steps 20 --rounds 3 --seeds 0,1,2   # the quickstart's 3-seed learning rule
    python scripts/bench_async.py --model tiny --steps 4 --rounds 1       # a smoke run

Each run is a real `grpo-train` (a process of its own) with OMP_NUM_THREADS=--threads: the synchronous run uses
them all for generation and training in turns; the K=1 run gives rollout.worker_threads=--worker-threads to the
worker and the rest to the trainer. Runs alternate sync, K=1, sync, K=1, so that load from other work hits both.
A run's step time is the median of step_time_s over its steps after the first two (the first starts the worker and
warms the caches). Per mode it reports that median, the means of gen_time_s and (K=1) rollout/wait_s and
rollout/worker_passes_s (the worker's log-prob passes after generating), the generating policy's log-prob gap
(sampler/logp_diff_mean, where a sampler correction asks for it) and the mean reward of the last half of the steps; and
the K=1 / sync ratio of each round and of the pooled medians. The last line printed is one JSON object.
Run it on idle cores: on a loaded machine the numbers say more about the load than about the placement.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODES = {"sync": [], "k1": ["rollout.placement=worker", "rollout.max_staleness=1"]}


def run(mode: str, seed: int, args, folder: Path) -> dict:
    run_dir = folder / f"{mode}-seed{seed}-{len(list(folder.iterdir()))}"
    command = [str(Path(sys.executable).parent / "grpo-train"), "+recipe=quickstart", f"model={args.model}",
               "trainer.device=cpu", f"trainer.max_steps={args.steps}", "trainer.save_every=0",
               "trainer.log_samples_every=0", "eval.final=false", f"trainer.seed={seed}", *MODES[mode],
               *([f"rollout.worker_threads={args.worker_threads}"] if mode == "k1" else []), *args.extra,
               f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{mode} run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = rows[2:] or rows

    def mean(key: str) -> float | None:
        values = [r[key] for r in timed if key in r]
        return statistics.fmean(values) if values else None

    return {"mode": mode, "seed": seed, "step_s": statistics.median(r["step_time_s"] for r in timed),
            "gen_s": mean("gen_time_s"), "wait_s": mean("rollout/wait_s"), "logp_gap": mean("sampler/logp_diff_mean"),
            "worker_passes_s": mean("rollout/worker_passes_s"),
            "late_reward": statistics.fmean(r["reward"] for r in rows[len(rows) // 2:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of a run in all")
    parser.add_argument("--worker-threads", type=int, default=1, help="of those, the K=1 run's worker's")
    parser.add_argument("extra", nargs="*", help="more grpo-train overrides for both modes")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        for round_ in range(args.rounds):
            for seed in (int(s) for s in args.seeds.split(",")):
                for mode in MODES:
                    result = {"round": round_, **run(mode, seed, args, Path(tmp))}
                    print(json.dumps(result), flush=True)
                    results.append(result)
    pooled = {mode: statistics.median(r["step_s"] for r in results if r["mode"] == mode) for mode in MODES}
    ratios = [k1["step_s"] / sync["step_s"] for sync, k1 in zip(results[::2], results[1::2], strict=True)]
    print(json.dumps({"date": _dt.date.today().isoformat(), "cpus": os.cpu_count(), "args": vars(args),
                      "median_step_s": pooled, "k1_over_sync": pooled["k1"] / pooled["sync"],
                      "k1_over_sync_per_round": ratios, "runs": results}))


if __name__ == "__main__":
    main()
