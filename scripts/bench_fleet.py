#!/usr/bin/env python
"""One vLLM server against several (issue 64; docs/results/fleet.md): the same grpo-train run with
rollout.placement=server on 1 and on N
servers that grpo-train starts, each server on cores of its own (rollout.worker_threads each: on the CPU each is
pinned), generation tokens/s and the step time read from metrics.jsonl.

    python scripts/bench_fleet.py                                   # embedded SmolLM2-135M, 1 vs 2 servers, 1 core each
    python scripts/bench_fleet.py --model tiny --rounds 1 --steps 2 # a quick look
    python scripts/bench_fleet.py --device cuda --servers 1,2       # on CUDA: the servers take the GPUs in turn

The runs are on-policy (rollout.max_staleness=0): the trainer waits while the servers generate, so generation has
the cores (or GPUs) to itself and gen_tokens_per_s is the servers' throughput on a step's batch (P prompts x G
completions of exactly T tokens: min_new_tokens = max_new_tokens, every batch the same work). The first step of each
run is a warm-up and is left out. Rounds alternate the order of the configurations; the load average (`uptime`) is
recorded before and after each run, since a shared machine's other work shows up in the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def grpo_train() -> str:
    beside = Path(sys.executable).parent / "grpo-train"
    return str(beside) if beside.exists() else "grpo-train"


def load() -> float:
    return os.getloadavg()[0]


def one_run(args, servers: int, run_dir: Path) -> dict:
    """One grpo-train run on `servers` servers; its per-step numbers (warm-up left out) and the load it saw."""
    model = ["model=tiny", "model.tiny.num_heads=1"] if args.model == "tiny" else ["model=smollm2-135m"]
    command = [grpo_train(), "+recipe=quickstart", *model, f"trainer.device={args.device}",
               f"data.prompts_per_step={args.prompts}", f"algo.num_generations={args.G}",
               f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.min_new_tokens={args.max_new_tokens}",
               f"trainer.max_steps={args.steps + 1}", "trainer.log_samples_every=0", "trainer.save_every=0",
               "eval.final=false", "rollout.placement=server", "rollout.max_staleness=0",
               f"rollout.servers={servers}", f"rollout.vllm_kv_cache_gib={args.kv_cache_gib}",
               *([f"rollout.worker_threads={args.threads}"] if args.device == "cpu" else []),
               f"hydra.run.dir={run_dir}"]
    before, t0 = load(), time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                          env={**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"})
    wall, after = time.perf_counter() - t0, load()
    if proc.returncode != 0:
        raise SystemExit(f"bench_fleet: {servers} server(s) failed (exit {proc.returncode}): "
                         f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else '?'}; {run_dir}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()][1:]
    where = re.findall(r"started vLLM's server .*? (on core\(s\) \S+|on GPU \S+); its log", proc.stderr)
    return {"servers": servers, "gen_tokens_per_s": statistics.median(r["gen_tokens_per_s"] for r in rows),
            "gen_time_s": statistics.median(r["gen_time_s"] for r in rows),
            "step_time_s": statistics.median(r["step_time_s"] for r in rows), "steps": len(rows),
            "tokens_per_step": args.prompts * args.G * args.max_new_tokens, "load_before": before,
            "load_after": after, "wall_s": wall, "placed": where, "run_dir": str(run_dir)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--servers", default="1,2", help="the server counts to compare, e.g. 1,2")
    parser.add_argument("--threads", type=int, default=1, help="on the CPU: the cores (threads) of each server")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--G", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run (after one warm-up step)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds one run may take")
    parser.add_argument("--log-dir", type=Path, default=REPO / "bench_out" / "fleet")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    counts = [int(n) for n in args.servers.split(",")]
    print(f"bench_fleet: {args.model} on {args.device}, servers {counts}, {args.threads} core(s) each, "
          f"P x G x T = {args.prompts} x {args.G} x {args.max_new_tokens}, {args.steps} timed step(s), "
          f"{args.rounds} round(s); cores here: {len(os.sched_getaffinity(0))}", flush=True)
    results = []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for round_ in range(args.rounds):
        order = counts if round_ % 2 == 0 else counts[::-1]
        for servers in order:
            result = one_run(args, servers, args.log_dir / f"{stamp}-r{round_}-n{servers}")
            result["round"] = round_
            results.append(result)
            print(f"round {round_} servers {servers}: gen {result['gen_tokens_per_s']:.1f} tok/s, gen "
                  f"{result['gen_time_s']:.2f} s, step {result['step_time_s']:.2f} s, load "
                  f"{result['load_before']:.2f} -> {result['load_after']:.2f} ({', '.join(result['placed'])})",
                  flush=True)
    base = counts[0]
    print("\n| round | servers | gen tokens/s | x one | gen s/step | step s | load before -> after |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        one = next(x for x in results if x["round"] == r["round"] and x["servers"] == base)
        print(f"| {r['round']} | {r['servers']} | {r['gen_tokens_per_s']:.1f} | "
              f"{r['gen_tokens_per_s'] / one['gen_tokens_per_s']:.2f} | {r['gen_time_s']:.2f} | "
              f"{r['step_time_s']:.2f} | {r['load_before']:.2f} -> {r['load_after']:.2f} |")
    for servers in counts[1:]:
        ratios = [r["gen_tokens_per_s"] / next(x for x in results if x["round"] == r["round"] and x["servers"] == base)[
            "gen_tokens_per_s"] for r in results if r["servers"] == servers]
        print(f"\n{servers} servers / {base}: gen tokens/s ratio median {statistics.median(ratios):.2f} "
              f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)})")
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "args": {
            k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
