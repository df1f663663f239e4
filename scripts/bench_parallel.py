#!/usr/bin/env python
"""What sharding the base buys on the CPU (issue 63; docs/results/fsdp.md): the quickstart's GRPO step (the embedded
SmolLM2-135M, fp32, 4 prompts x 8 completions of 8 tokens) in one process, on 2 ranks under DDP and on 2 ranks under
FSDP (trainer.parallel), gloo, one thread per rank, the hf engine and no prepacked weights in every mode (what FSDP
runs; the CPU defaults pack weights and merge a copy, which costs memory of its own). Per rank: the bytes of frozen
base parameters it holds, its RSS after the load and its peak RSS (ru_maxrss), the median step time after a warm-up
step, and the loss of each step (DDP's and FSDP's agree).

    python scripts/bench_parallel.py                          # every mode, twice; a markdown table on stdout
    python scripts/bench_parallel.py --modes fsdp --extras    # + generation gathered once vs per layer, checkpoints

--extras (fsdp) also times: generating the step's completions with the base sharded (each layer all-gathered per
decode step: what the hf engine does) against gathered once for the whole generate (every unit unsharded first), with
the same greedy tokens; and the checkpoint's optimizer state gathered whole (today's file) against
torch.distributed.checkpoint (a file per rank). Workers run on the allocator grpo-train runs on (TCMalloc where
installed; --allocator system for glibc's). The machine's load average is printed with each run: time is only
comparable at a like load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("one", "ddp", "fsdp")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def trainer_for(mode: str, steps: int, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from grpo_cli.config.compose import CONF_DIR, register_recipes
    from grpo_cli.config.schema import Config
    from grpo_cli.step.trainer import GRPOTrainer

    register_recipes()
    args = ["+recipe=quickstart", "trainer.device=cpu", "model.prepack=false", "rollout.engine=hf",
            f"trainer.max_steps={steps}", f"trainer.parallel={'fsdp' if mode == 'fsdp' else 'ddp'}", *overrides]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return GRPOTrainer(Config.of(compose("config", overrides=args)))


@contextlib.contextmanager
def gathered_once(model):
    """Every FSDP unit unsharded for the whole block (the layers kept so after each forward), resharded after it."""
    from torch.distributed.fsdp import FSDPModule

    from grpo_cli.model.sharding import decoder_layers

    layers = decoder_layers(model)
    for layer in layers:
        layer.set_reshard_after_forward(False, recurse=False)
    for unit in [model, *layers]:
        assert isinstance(unit, FSDPModule)
        unit.unshard()
    try:
        yield
    finally:
        for layer in layers:
            layer.set_reshard_after_forward(True, recurse=False)
            layer.reshard()
        model.reshard()


def generation_extras(trainer) -> dict:
    """The step's completions (greedy) generated per layer sharded, then gathered once: seconds, RSS, same tokens."""
    from grpo_cli.rollout import SamplingParams

    rows, enc = trainer.prompts(0)
    sampling = SamplingParams(max_new_tokens=trainer.roll.max_new_tokens, greedy=True)
    out = {}
    for name, context in (("sharded", contextlib.nullcontext), ("gathered", lambda: gathered_once(trainer.model))):
        before = rss_mb()
        t0 = time.perf_counter()
        with context():
            gathered_s = time.perf_counter() - t0
            during = rss_mb()
            roll = trainer.engine.generate(enc.ids, trainer.algo.num_generations, sampling)
        out[name] = {"s": round(time.perf_counter() - t0, 3), "gather_s": round(gathered_s, 3),
                     "rss_before_mb": round(before), "rss_during_mb": round(max(during, rss_mb())),
                     "tokens": roll.completion_ids.tolist()}
    out["same_tokens"] = out["sharded"].pop("tokens") == out["gathered"].pop("tokens")
    return out


def checkpoint_extras(trainer) -> dict:
    """The optimizer state gathered whole (what trainer.state_dict gives: today's file, written by rank 0) against
    torch.distributed.checkpoint's sharded save (every rank writes its file): seconds and bytes."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    folder = Path(os.environ["BENCH_TMP"])
    dist.barrier()
    t0 = time.perf_counter()
    state = trainer.state_dict()
    if dist.get_rank() == 0:
        torch.save({"optimizer": state["optimizer"]}, folder / "trainer_state.pt")
    dist.barrier()
    gathered_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    dcp.save({"optimizer": get_optimizer_state_dict(trainer.model, trainer.optimizer)},
             checkpoint_id=str(folder / "dcp"))
    dist.barrier()
    dcp_s = time.perf_counter() - t0
    size = (folder / "trainer_state.pt").stat().st_size
    dcp_size = sum(p.stat().st_size for p in (folder / "dcp").iterdir())
    return {"gathered_s": round(gathered_s, 3), "gathered_mb": round(size / 2**20, 1), "dcp_s": round(dcp_s, 3),
            "dcp_mb": round(dcp_size / 2**20, 1), "dcp_files": len(list((folder / "dcp").iterdir()))}


def worker(mode: str, steps: int, out: Path, extras: bool, overrides: list[str]) -> None:
    import torch

    from grpo_cli.model.sharding import local_bytes

    torch.set_num_threads(1)
    trainer = trainer_for(mode, steps, overrides)
    record = {"mode": mode, "rank": trainer.dist.rank, "ranks": trainer.dist.world_size,
              "base_mb": round(local_bytes(trainer.model) / 2**20, 1),
              "lora_mb": round(local_bytes(trainer.model, frozen=False) / 2**20, 2),
              "rss_after_load_mb": round(rss_mb()), "step_s": [], "loss": [], "grad_norm": []}
    for step in range(steps):
        t0 = time.perf_counter()
        row, _batch = trainer.step(step)
        record["step_s"].append(round(time.perf_counter() - t0, 3))
        record["loss"].append(row["loss"])
        record["grad_norm"].append(row["grad_norm"])
    record["peak_rss_mb"] = round(peak_rss_mb())
    if extras and mode == "fsdp":
        record["generation"] = generation_extras(trainer)
        record["checkpoint"] = checkpoint_extras(trainer)
    out.with_suffix(f".rank{record['rank']}.json").write_text(json.dumps(record))
    trainer.close()
    from grpo_cli.step import distributed

    distributed.teardown()


def launch(mode: str, args, folder: Path) -> list[dict]:
    """One run of `mode` (its ranks as torchrun starts them); every rank's record."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "BENCH_TMP": str(folder)}
    if args.allocator == "tcmalloc":
        from grpo_cli.model.allocator import tcmalloc_library

        library = tcmalloc_library()
        if library is None:
            sys.exit("bench_parallel: TCMalloc is not installed; use --allocator system")
        env["LD_PRELOAD"] = library
    out = folder / mode
    me = [str(Path(__file__).resolve()), "--worker", mode, "--steps", str(args.steps), "--out", str(out),
          *(["--extras"] if args.extras else []), *[f"--override={o}" for o in args.override]]
    command = [sys.executable, *me] if mode == "one" else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *me]
    proc = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        sys.exit(f"bench_parallel: {mode} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted(folder.glob(f"{mode}.rank*.json"))]


def table(runs: dict[str, list[list[dict]]], warmup: int) -> str:
    """Markdown: one row per mode and repeat; ratios to the DDP run of the same repeat."""
    def ratio(mine: float, theirs: float | None) -> str:
        return "-" if theirs is None else f"{mine / theirs:.3f}"

    def median_step(ranks: list[dict]) -> float:
        return statistics.median(s for r in ranks for s in r["step_s"][warmup:])

    lines = ["| mode | ranks | repeat | load before | base MB/rank | x DDP | RSS after load MB | peak RSS MB/rank | "
             "x DDP | step s (median) | x DDP | loss per step (rank 0) |", "|" + "---|" * 12]
    for mode, repeats in runs.items():
        for k, ranks in enumerate(repeats):
            ddp = runs["ddp"][k] if len(runs.get("ddp", [])) > k else None
            peak = max(r["peak_rss_mb"] for r in ranks)
            cells = [mode, str(ranks[0]["ranks"]), str(k + 1), f"{ranks[0]['load_before']:.2f}",
                     f"{ranks[0]['base_mb']:.1f}", ratio(ranks[0]["base_mb"], ddp and ddp[0]["base_mb"]),
                     "/".join(str(r["rss_after_load_mb"]) for r in ranks),
                     "/".join(str(r["peak_rss_mb"]) for r in ranks),
                     ratio(peak, ddp and max(r["peak_rss_mb"] for r in ddp)),
                     f"{median_step(ranks):.2f}", ratio(median_step(ranks), ddp and median_step(ddp)),
                     ", ".join(f"{x:.9g}" for x in ranks[0]["loss"])]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help="one,ddp,fsdp (comma-separated)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="steps per run; the first is a warm-up")
    parser.add_argument("--extras", action="store_true", help="fsdp: generation and checkpoint comparisons")
    parser.add_argument("--allocator", choices=("tcmalloc", "system"), default="tcmalloc")
    parser.add_argument("--override", action="append", default=[], help="a config override for every mode")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--json-out", type=Path, help="every rank's record of every run")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out, args.extras, args.override)
        return
    modes = [m for m in args.modes.split(",") if m]
    runs: dict[str, list[list[dict]]] = {m: [] for m in modes}
    for k in range(args.repeats):
        for mode in modes:
            load = os.getloadavg()[0]
            with tempfile.TemporaryDirectory(prefix="bench-parallel-") as folder:
                ranks = launch(mode, args, Path(folder))
            for r in ranks:
                r["load_before"], r["load_after"] = load, os.getloadavg()[0]
            runs[mode].append(ranks)
            print(f"{mode} repeat {k + 1}: load {load:.2f} -> {os.getloadavg()[0]:.2f}, "
                  f"{json.dumps({key: v for key, v in ranks[0].items() if key not in ('generation',)})}",
                  file=sys.stderr, flush=True)
            for r in ranks:
                if "generation" in r:
                    print(f"  rank {r['rank']} generation {json.dumps(r['generation'])} checkpoint "
                          f"{json.dumps(r['checkpoint'])}", file=sys.stderr, flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(runs, indent=1))
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, allocator {args.allocator}, {args.steps} steps per run "
          f"(the first a warm-up), `{' '.join(sys.argv)}`\n")
    print(table(runs, warmup=1))


if __name__ == "__main__":
    main()
