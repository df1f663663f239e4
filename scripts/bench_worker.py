#!/usr/bin/env python
"""One measurement of scripts/bench.py, in a subprocess of its own: one side (ours or TRL's GRPOTrainer) at one
configuration, a warm-up step and the timed steps; the numbers go to a JSON file.

    python scripts/bench_worker.py {ours,trl} SPEC_JSON RESULT_PATH
"""

from __future__ import annotations

import json
import resource
import sys
import tempfile
import time
from pathlib import Path

PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "auto": "auto"}  # model.dtype; QUANTIZED: model.quantization
QUANTIZED = ("nf4", "fp4", "int8")
# TRL's settings the bench runs: nogc (one forward of the whole batch, no recomputation: TRL at its fastest, what
# `make bench` compares against), default (GRPOConfig's own: gradient_checkpointing=True), lean (TRL's documented
# memory settings: checkpointing and one completion per forward, gradient accumulation over the batch)
TRL_SETTINGS = {"nogc": {"gradient_checkpointing": False, "rows": None},
                "default": {"gradient_checkpointing": True, "rows": None},
                "lean": {"gradient_checkpointing": True, "rows": 1}}
QUESTION = "State the final answer to the following arithmetic problem: {a} {op} {b} = Answer with just the number."


def bench_rows(n: int, seed: int = 0) -> list[dict]:
    """Single-digit sums and differences, made here so that both sides get the very same prompts offline."""
    import random
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, op = rng.randint(0, 9), rng.randint(0, 9), rng.choice("+-")
        rows.append({"messages": [{"role": "user", "content": QUESTION.format(a=a, op=op, b=b)}],
                     "answer": str(a + b if op == "+" else a - b)})
    return rows


def compose_cfg(spec: dict):
    from hydra import compose, initialize_config_dir

    from grpo_cli.config.compose import CONF_DIR, register_recipes
    from grpo_cli.run.validate import validate
    T, precision = spec["max_new_tokens"], spec["precision"]
    overrides = [
        "model=" + {"tiny": "tiny"}.get(spec["model"], "smollm2-135m"), "logger=none",
        f"data.prompts_per_step={spec['prompts']}", f"algo.num_generations={spec['G']}", f"algo.beta={spec['beta']}",
        "algo.num_iterations=1", "algo.loss_type=grpo", f"rollout.max_new_tokens={T}", f"rollout.min_new_tokens={T}",
        f"rollout.engine={spec['engine']}", "rollout.temperature=1.0", "rollout.top_p=1.0",
        f"trainer.device={spec['device']}", f"trainer.seed={spec['seed']}", "trainer.max_steps=100000",
        "trainer.log_samples_every=0", f"optimizer.lr={spec['lr']}", f"model.lora.r={spec['lora_r']}",
        f"model.lora.alpha={spec['lora_alpha']}", "model.lora.dropout=0.0", "model.lora.target_modules=all-linear",
        f"model.quantization={precision}" if precision in QUANTIZED else f"model.dtype={PRECISIONS[precision]}",
        f"model.prepack={str(spec.get('prepack', 'auto')).lower()}",
    ]
    if spec["engine"] == "vllm":  # vLLM's CPU attention has no head_dim 16 kernel (the tiny model's default)
        overrides += ["rollout.vllm_kv_cache_gib=1", *(["model.tiny.num_heads=1"] if spec["model"] == "tiny" else [])]
    if spec.get("model_dir"):
        overrides.append(f"model.name_or_path={spec['model_dir']}")
    overrides += list(spec.get("overrides", ()))  # ours only: e.g. trainer.memory_budget_gb=8
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    validate(cfg)
    return cfg


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter once (tied embeddings counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


class Memory:
    """Peak memory of this process: over its life, and since reset() (the training steps)."""

    def __init__(self, device):
        self.cuda, self.load_peak_mb, self.reset_ok = device.type == "cuda", None, False

    def now_peak_mb(self) -> float:
        import torch
        return torch.cuda.max_memory_allocated() / 2**20 if self.cuda else resource.getrusage(
            resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux

    def reset(self) -> None:
        import torch
        self.load_peak_mb = self.now_peak_mb()
        try:  # "5" resets the peak RSS (VmHWM, and with it ru_maxrss) to the current RSS; Linux >= 4.0
            torch.cuda.reset_peak_memory_stats() if self.cuda else Path("/proc/self/clear_refs").write_text("5")
            self.reset_ok = True
        except OSError:
            self.reset_ok = False

    def result(self) -> dict:
        train = self.now_peak_mb()
        return {"peak_mb": max(train, self.load_peak_mb or 0.0), "load_peak_mb": self.load_peak_mb,
                "train_peak_mb": train if self.reset_ok else None}


def sync(device) -> None:
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize()


# ---- worker: ours ----------------------------------------------------------------------------------
PHASES = {"reference": "_no_grad_logprobs", "policy forward+backward": "backward", "optimizer": "optimizer_step"}


def time_phases(trainer, device) -> dict:
    """Seconds per phase of each step, summed over its calls: the trainer's own methods, timed from outside.
    `generate` is the step's rollout (gen_time_s); `reference` the no-grad passes (reference, and old log-probs when
    off-policy); `policy forward+backward` the gradient passes of every micro-batch; `optimizer` clip + step."""
    seconds: dict[str, float] = {}

    def timed(name, method):
        def run(*args, **kwargs):
            sync(device)
            t0 = time.perf_counter()
            out = method(*args, **kwargs)
            sync(device)
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0
            return out
        return run

    for name, attribute in PHASES.items():
        setattr(trainer, attribute, timed(name, getattr(trainer, attribute)))
    return seconds


def worker_ours(spec: dict) -> dict:
    import torch
    cfg = compose_cfg(spec)
    n_steps = spec.get("warmup", 1) + spec["steps"]
    t_load = time.perf_counter()
    from grpo_cli.config.schema import Config
    from grpo_cli.step.trainer import GRPOTrainer
    # no run dir: it only steps
    trainer = GRPOTrainer(Config.of(cfg), rows=bench_rows(spec["prompts"] * n_steps, spec["seed"]))
    lm = trainer.lm
    load_s = time.perf_counter() - t_load
    mem = Memory(lm.device)
    mem.reset()
    steps, prompts = [], []
    phases = time_phases(trainer, lm.device)
    for k in range(n_steps):
        sync(lm.device)
        phases.clear()
        t0 = time.perf_counter()
        metrics, batch = trainer.step(k)
        sync(lm.device)
        roll = batch.rollout
        prompt_rows = zip(roll.prompt_ids, roll.prompt_mask, strict=True)
        prompts += [lm.tokenizer.decode(ids[mask.bool()]) for ids, mask in prompt_rows]
        steps.append({"s": time.perf_counter() - t0, "gen_s": metrics["gen_time_s"],
                      "compile_s": metrics["gen_compile_s"], "completion_tokens": int(roll.completion_ids.numel()),
                      "prompt_width": int(roll.prompt_ids.shape[1]), "phases": dict(phases)})
    warm = spec.get("warmup", 1)
    return {"side": "ours", "engine": cfg.rollout.engine if cfg.rollout.engine != "auto" else trainer.engine.name,
            "load_s": load_s, "warmup": steps[0] if warm else None, "steps": steps[warm:], "prompts": prompts,
            "memory_plan": trainer.memory.line() if trainer.memory.budget_gb is not None else None,
            "compile_s": sum(st["compile_s"] for st in steps), "weight_bytes": weight_bytes(lm.model),
            "dtype": str(lm.dtype), "threads": torch.get_num_threads(), **mem.result()}


# ---- worker: TRL -----------------------------------------------------------------------------------
TRL_ONLY_KWARGS = ("completion_ids", "trainer_state", "log_extra", "log_metric")  # TRL passes; our rewards do not take


def trl_reward_functions(cfg) -> tuple[list, list[float]]:
    """Our configured reward functions (the same code), adapted to TRL's conversational completions."""
    from grpo_cli.rewards import resolve_callable
    funcs, weights = [], []
    for name, fspec in cfg.reward.functions.items():
        fn = resolve_callable(fspec["_target_"])

        def wrapped(prompts, completions, _fn=fn, **kwargs):
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            kwargs = {k: v for k, v in kwargs.items() if k not in TRL_ONLY_KWARGS}
            return _fn(prompts, texts, **kwargs)

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

    from grpo_cli.model.loading import load_base_model, load_tokenizer, resolve_device
    from grpo_cli.tasks.sources import PromptSampler
    cfg = compose_cfg(spec)
    P, G, T = spec["prompts"], spec["G"], spec["max_new_tokens"]
    n_steps = spec.get("warmup", 1) + spec["steps"]
    settings = TRL_SETTINGS[spec.get("trl", "nogc")]
    sampler = PromptSampler(bench_rows(P * n_steps, spec["seed"]), P, spec["seed"])  # our order, unshuffled for TRL
    ordered = [r for k in range(n_steps) for r in sampler.batch(k)]
    dataset = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in ordered])
    t_load = time.perf_counter()
    device, dtype = resolve_device(cfg.trainer.device, cfg.model.dtype)
    tokenizer = load_tokenizer(cfg.model.name_or_path)
    base = load_base_model(cfg.model.name_or_path, tokenizer, dtype, tiny=dict(cfg.model.get("tiny") or {}),
                           seed=spec["seed"]).to(device)
    base.generation_config.pad_token_id = tokenizer.pad_token_id
    reward_funcs, reward_weights = trl_reward_functions(cfg)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), per_device_train_batch_size=settings["rows"] or P * G,
        num_generations=G, generation_batch_size=P * G, steps_per_generation=None, num_iterations=1,
        gradient_accumulation_steps=P * G // (settings["rows"] or P * G),
        max_completion_length=T, generation_kwargs={"min_new_tokens": T}, temperature=1.0, top_p=1.0, top_k=0,
        beta=spec["beta"], epsilon=0.2, loss_type="grpo", scale_rewards="group", reward_weights=reward_weights,
        use_vllm=False, learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0, max_steps=n_steps, shuffle_dataset=False,
        seed=spec["seed"], gradient_checkpointing=settings["gradient_checkpointing"],
        use_cpu=device.type == "cpu", bf16=dtype == torch.bfloat16, fp16=False, logging_strategy="no",
        save_strategy="no", eval_strategy="no", report_to="none", log_completions=False, disable_tqdm=True,
        dataloader_num_workers=0)
    peft_config = LoraConfig(r=spec["lora_r"], lora_alpha=spec["lora_alpha"], lora_dropout=0.0,
                             target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=base, reward_funcs=reward_funcs, args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config)
    load_s = time.perf_counter() - t_load
    mem, gen_log, steps = Memory(device), [], []
    inner_generate = trainer.model.generate

    def timed_generate(*a, **kw):  # TRL generates once per step, prefill included
        sync(device)
        t0 = time.perf_counter()
        out = inner_generate(*a, **kw)
        sync(device)
        width = kw["input_ids"].shape[1] if "input_ids" in kw else a[0].shape[1]
        gen_log.append({"gen_s": time.perf_counter() - t0, "prompt_width": int(width),
                        "completion_tokens": int(out.shape[0] * (out.shape[1] - width))})
        return out

    trainer.model.generate = timed_generate

    class Timer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            mem.reset()

        def on_step_begin(self, args, state, control, **kw):
            sync(device)
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync(device)
            steps.append(time.perf_counter() - self.begin)

    trainer.add_callback(Timer())
    trainer.train()
    if len(steps) != n_steps or len(gen_log) != n_steps:
        raise RuntimeError(f"TRL ran {len(steps)} optimizer steps and {len(gen_log)} generate calls, expected "
                           f"{n_steps} of each: the batch settings do not give one generation per step")
    timed = [{"s": s, **g} for s, g in zip(steps, gen_log, strict=True)]
    warm = spec.get("warmup", 1)
    return {"side": "trl", "settings": spec.get("trl", "nogc"), "load_s": load_s, "warmup": timed[0] if warm else None,
            "steps": timed[warm:],
            "prompts": [r["prompt"][0]["content"] for r in dataset], "weight_bytes": weight_bytes(trainer.model),
            "dtype": str(dtype), "threads": torch.get_num_threads(), **mem.result()}


def main(side: str, spec_json: str, result: str) -> None:
    spec = json.loads(spec_json)
    if spec.get("rlimit_gb"):  # a memory cap the whole process must keep: its data segment (heap and anonymous maps)
        cap = int(spec["rlimit_gb"] * 2**30)
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    if spec.get("threads"):
        import torch

        torch.set_num_threads(spec["threads"])
    try:
        out = worker_ours(spec) if side == "ours" else worker_trl(spec)
    except Exception as error:  # an allocation past the cap is a result ("does not fit"), not a crash of the bench
        from grpo_cli.step.memory import is_out_of_memory
        if not is_out_of_memory(error):
            raise
        out = {"side": side, "oom": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}",
               "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}
    from grpo_cli.model.allocator import in_use
    Path(result).write_text(json.dumps({**out, "allocator": in_use(), "spec": spec}))


if __name__ == "__main__":
    main(*sys.argv[1:])
