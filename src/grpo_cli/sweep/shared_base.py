"""`hydra/launcher=shared_base`: the jobs of a sweep trained in one process on one loaded base, one LoRA adapter each
(peft's named adapters of one PeftModel), their generation run together (rollout.shared).

    check_shareable   before anything loads: every job differs from job 0 only in MAY_DIFFER, else one line naming
                      the first key that differs (the sweep is refused, not split into groups)
    launch            each job is Hydra's own `run_job` (its dir, .hydra/, the callbacks, job_status.json, the task:
                      grpo-train's, with its skip/resume decision, records, checkpoints, adapter, W&B run) in a thread
                      of its own; the threads take turns (turns.Turns), a job's turn ending where it asks for
                      generation; the turns of one round end in one generation for every job (SharedGeneration)
    job_loader        what grpo-train's task loads the policy with in such a job: the shared base, loaded by the
                      first job that asks, plus this job's adapter, drawn where a run alone draws its adapter

Each job is the run it is alone: its own RNG, Hydra config, working directory, active adapter, warnings route and
log handlers are restored at each of its turns (`JobContext`). A job that fails (a reward that raises, non-finite
updates) ends alone; a signal reaches every job (base.stopping: the main thread's request passes it on), each stops at
its safe point with its checkpoint, and the launcher exits as the basic one does.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict

from grpo_cli.base import errors
from grpo_cli.base.errors import ConfigError, exit_with
from grpo_cli.base.redaction import recorded
from grpo_cli.base.stopping import StopRequest
from grpo_cli.config.schema import Config
from grpo_cli.run.rundir import job_config
from grpo_cli.sweep.turns import Job, Turns

log = logging.getLogger(__name__)

# what the jobs of one sweep may differ in: nothing of the base (model, its precision and device), of the prompts
# (data), of generation (rollout) or of the process (plugins, env)
MAY_DIFFER = ("algo.*", "optimizer.*", "reward.*", "eval.*", "logger.*", "sweep.*",
              "model.lora.r", "model.lora.alpha", "model.lora.dropout", "model.lora.use_rslora",
              "trainer.seed", "trainer.max_steps", "trainer.epochs", "trainer.micro_batch_size",
              "trainer.micro_batch_tokens", "trainer.max_grad_norm", "trainer.logprob_chunk_size",
              "trainer.save_every", "trainer.keep_last", "trainer.max_skipped", "trainer.log_samples_every",
              "trainer.resume", "trainer.overwrite", "trainer.resume_allow_changes")
BUT = ("algo.num_generations",)  # rows per prompt: the batch's shape
LAUNCHER = "hydra/launcher=shared_base"


def may_differ(key: str) -> bool:
    return key not in BUT and any(fnmatch.fnmatchcase(key, pattern) for pattern in MAY_DIFFER)


# ---- before anything loads ------------------------------------------------------------------------
def flat(config: DictConfig) -> dict:
    """A job's composed config (with its Hydra part, for `${hydra:...}`) without that part, resolved, as dotted
    keys."""
    from hydra.core.hydra_config import HydraConfig

    before = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(config)
    try:
        return job_config(recorded(config))
    finally:
        HydraConfig.instance().cfg = before


def first_difference(jobs: list[dict]) -> tuple[int, str] | None:
    """(job index, key) of the first key, in job order then key order, in which a job differs from job 0 that the
    jobs of one base may not differ in; None when there is none."""
    for index, job in enumerate(jobs[1:], start=1):
        for key in sorted(set(job) | set(jobs[0])):
            if job.get(key, "<unset>") != jobs[0].get(key, "<unset>") and not may_differ(key):
                return index, key
            if key == "trainer.seed" and job.get(key) != jobs[0].get(key) \
                    and jobs[0].get("model.name_or_path") == "tiny-random":
                return index, key
    return None


def check_shareable(configs: list[DictConfig], names: list[str]) -> None:
    """A ConfigError, one line, when the jobs (`configs`, their names for the line) cannot share one base."""
    jobs = [flat(c) for c in configs]
    first = jobs[0]
    refusals = {
        "rollout.placement": (first.get("rollout.placement", "local") != "local",
                              "generates in a process of its own beside each job"),
        "rollout.engine": (first.get("rollout.engine") == "vllm", "keeps its own copy of the base in vLLM"),
        "trainer.memory_budget_gb": (first.get("trainer.memory_budget_gb") is not None,
                                     "reads the job's memory off the process, which holds every job"),
        "trainer.nproc": ((first.get("trainer.nproc") or 1) > 1, "runs each job under torchrun"),
        "trainer.parallel": (first.get("trainer.parallel", "ddp") == "fsdp", "shards one job's base over ranks"),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            raise ConfigError(f"{key}={first.get(key)} is invalid with {LAUNCHER}: it {why}; leave it at its default "
                              "or use hydra/launcher=basic")
    found = first_difference(jobs)
    if found is None:
        return
    index, key = found
    before, after = jobs[0].get(key, "<unset>"), jobs[index].get(key, "<unset>")
    why = ("model=tiny draws its random base from trainer.seed" if key == "trainer.seed" else
           f"the jobs on one base share it (they may differ in {', '.join(MAY_DIFFER)}, but "
           f"{', '.join(BUT)})")
    raise ConfigError(f"{LAUNCHER} trains every job on one loaded base: job {index} ({names[index]}) differs from "
                      f"job 0 ({names[0]}) in {key} ({before} -> {after}); {why}; sweep {key} with "
                      "hydra/launcher=basic or joblib")


# ---- a job's part of the process ------------------------------------------------------------------
@dataclass
class JobContext:
    """What a job of the sweep sets for the whole process, kept between its turns (turns.Turns)."""

    rng: tuple
    hydra: Any
    cwd: str
    warnings: tuple
    log_handlers: list
    console: str | None
    adapter: str | None

    @classmethod
    def save(cls) -> JobContext:
        from hydra.core.hydra_config import HydraConfig

        from grpo_cli import tracking
        from grpo_cli.run.checkpoint import rng_snapshot

        model = _active.lm.model if _active is not None and _active.lm is not None else None
        return cls(rng_snapshot(), HydraConfig.instance().cfg, os.getcwd(), errors.warnings_route(),
                   list(logging.getLogger().handlers), tracking.console_label(),
                   None if model is None else model.active_adapter)

    def restore(self) -> None:
        from hydra.core.hydra_config import HydraConfig

        from grpo_cli import tracking
        from grpo_cli.run.checkpoint import restore_rng

        restore_rng(self.rng)
        HydraConfig.instance().cfg = self.hydra
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
        errors.route_warnings(self.warnings)
        logging.getLogger().handlers[:] = self.log_handlers
        tracking.label_console(self.console)
        if self.adapter is not None and _active is not None and _active.lm is not None \
                and self.adapter in _active.lm.model.peft_config:
            _active.lm.model.set_adapter(self.adapter)


# ---- the sweep --------------------------------------------------------------------------------------
class SharedSweep:
    """The turns of a sweep's jobs and the base they share (loaded by the first job to ask: `load`)."""

    def __init__(self):
        self.turns = Turns(self.together, JobContext.save, on_end=self.job_ended)
        self.lm = None          # the shared base (model.loading.LoadedModel), once loaded
        self.generation = None  # rollout.shared.SharedGeneration
        self.adapters: dict[int, str] = {}  # job number -> its adapter

    def together(self, requests: list) -> None:
        try:
            self.generation.run(requests)
        except BaseException as error:  # every job that asked gets it, in its own thread
            for request in requests:
                request.error = request.error or error

    def job_ended(self, job: Job) -> None:
        """A finished job's adapter leaves the base (the adapter it saved is on disk)."""
        from grpo_cli.model.adapters import remove_adapter

        name = self.adapters.pop(job.num, None)
        if name is not None and self.lm is not None:
            remove_adapter(_named(self.lm, name))
            if self.generation is not None:
                self.generation.holds = None

    def loader(self, cfg: Config) -> Callable:
        """load_policy's stand-in for the job on this thread (its typed config `cfg`)."""
        job = self.turns.current()
        return partial(self.load, job.num, cfg)

    def load(self, num: int, cfg: Config, cfg_model, device_name: str, seed: int = 0, chat_template_kwargs=None):
        from grpo_cli.model.adapters import adapter_name, add_adapter, load_shared_base
        from grpo_cli.rollout.shared import JobModel, SharedGeneration

        name = adapter_name(num)
        if self.lm is None:
            lm = self.lm = load_shared_base(cfg_model, device_name, name, seed, chat_template_kwargs)
            self.generation = SharedGeneration(lm, cfg.rollout, cfg.data.max_prompt_tokens)
            print(f"grpo-train: loading {cfg_model.name_or_path} once for the sweep's jobs ({LAUNCHER}); "
                  f"generation: {self.generation.kind}", file=sys.stderr, flush=True)
        else:
            lm = add_adapter(self.lm, cfg_model.lora, name)
        self.adapters[num] = name
        return JobModel(model=lm.model, tokenizer=lm.tokenizer, device=lm.device, dtype=lm.dtype,
                        quantization=lm.quantization, adapter=name, submit=self.turns.ask, shared=self.generation)

    def close(self) -> None:
        if self.generation is not None:
            self.generation.close()


def _named(lm, name: str):
    import dataclasses

    return dataclasses.replace(lm, adapter=name)


_active: SharedSweep | None = None  # the sweep under way in this process


def job_loader(cfg: Config) -> Callable | None:
    """How grpo-train's task loads the policy of the job on this thread: from the shared base of a sweep under
    hydra/launcher=shared_base; None elsewhere (load_policy)."""
    if _active is None or _active.turns.current() is None:
        return None
    return _active.loader(cfg)


# ---- the launcher's work ------------------------------------------------------------------------------
def launch(config: DictConfig, hydra_context, task_function, job_overrides: Sequence[Sequence[str]],
           initial_job_idx: int) -> list:
    """Hydra's Launcher.launch for hydra/launcher=shared_base (hydra_plugins.grpo_shared_base_launcher)."""
    global _active
    from hydra.core.utils import configure_log, filter_overrides, run_job, setup_globals

    setup_globals()
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    Path(str(config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    configs: list[DictConfig] = []
    kept: list[Sequence[str]] = []  # each job's overrides less Hydra's own
    for index, overrides in enumerate(job_overrides):
        job = hydra_context.config_loader.load_sweep_config(config, list(overrides))
        with open_dict(job):
            job.hydra.job.id = job.hydra.job.num = initial_job_idx + index
        configs.append(job)
        kept.append(filter_overrides(overrides))
    common = set.intersection(*(set(n) for n in kept)) if kept else set()
    names = [" ".join(o for o in n if o not in common) for n in kept]  # a job by what the sweep varies in it
    try:
        check_shareable(configs, names)
    except ConfigError as err:
        exit_with(err)
    log.info(f"Launching {len(configs)} jobs on one base ({LAUNCHER})")
    sweep = _active = SharedSweep()
    try:
        with StopRequest("grpo-train", effect="every job stops at its next safe point and checkpoints").installed():
            for job_config in configs:
                sweep.turns.add(job_config.hydra.job.num, partial(
                    _run_job, run_job, hydra_context, task_function, job_config))
            jobs = sweep.turns.start()
    finally:
        _active = None
        sweep.close()
        configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    ended = [job.error for job in jobs if job.error is not None]
    if ended:  # a job that stopped the sweep (SystemExit), or an error outside its task (a callback's)
        raise next((e for e in ended if isinstance(e, SystemExit)), ended[0])
    return [job.result for job in jobs]


def _run_job(run_job, hydra_context, task_function, job_config: DictConfig):
    """Hydra's run of one job (its dir, its .hydra/, the callbacks, the task), its console lines labelled."""
    from grpo_cli import tracking

    tracking.label_console(f"job {job_config.hydra.job.num}")
    return run_job(hydra_context=hydra_context, task_function=task_function, config=job_config,
                   job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")

