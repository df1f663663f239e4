"""A training run in its run dir, from the claim to the summary; `GRPOTrainer` only steps.

    Run(config, run_dir)     claims the dir: the lock, and the one resume decision (rundir.claim)
    run.train(...)           builds the trainer, restores the checkpoint, opens the sinks, runs the steps (each
                             recorded, checkpointed on schedule), saves the adapter, the final eval, the summary
    run.close()              releases the lock and leaves the process group (a `with` block does it)

`train(config, run_dir)` is all three for a program: it keeps the run-dir promises grpo-train keeps. Both take
the composed config (Hydra's compose) or its typed `schema.Config`; everything below reads the typed one.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

import grpo_cli.config.compose  # noqa: F401  registers the config's resolvers: a program's cfg resolves as grpo-train's does
from grpo_cli.base.errors import ConfigError, Interrupted, OutOfMemory, RunError, UserCodeError, WorkerError
from grpo_cli.base.metrics import ADAPTER_DIR, FINAL_EVAL, METRICS, final_mean, read_metrics, replace_text
from grpo_cli.base.ranks import is_rank_zero
from grpo_cli.base.stopping import StopRequest
from grpo_cli.config.schema import Config
from grpo_cli.run import checkpoint, rundir
from grpo_cli.run.checkpoint import restore_rng, rng_snapshot
from grpo_cli.run.monitors import Monitors
from grpo_cli.step import distributed
from grpo_cli.tracking import REWARD_WINDOW, Tracker, loading, open_tracker

if TYPE_CHECKING:  # the trainer (transformers, peft) loads only once the dir is claimed and the libraries quieted
    from grpo_cli.model.loading import LoadedModel
    from grpo_cli.step.batch import Batch
    from grpo_cli.step.trainer import GRPOTrainer

class Run:
    """One attempt of a training run in `run_dir`. Constructing it claims the dir (raises rundir.RunDirError,
    nothing written, when the dir cannot take this attempt); `decision` is a sweep job's, already made by
    sweep_rerun.decide_job. `warnings` are the claim's lines for the start (skipped checkpoints, nothing to resume)."""

    def __init__(self, cfg: Config | DictConfig, run_dir: Path, *, decision: rundir.ResumeDecision | None = None):
        self.cfg, self.run_dir = Config.of(cfg), Path(run_dir)
        self.tcfg = self.cfg.trainer
        self.claim = rundir.claim(self.cfg, self.run_dir, main=is_rank_zero(), decision=decision)
        self.warnings = list(self.claim.decision.warnings)
        self.trainer: GRPOTrainer | None = None
        self.built_trainer = False
        self.last_checkpoint: tuple[int, Path] | None = None  # (complete steps, folder) of the newest one
        self.logged_again: list[int] = []  # steps an earlier attempt logged past the checkpoint this one resumes
        self.main = is_rank_zero()
        self.monitors = Monitors({name: spec.weight for name, spec in (self.cfg.reward.functions or {}).items()},
                                 self.cfg.reward.carrying_the_task())

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop what generates ahead of the update, leave the process group (of a trainer this run built) and release
        the run dir."""
        try:
            if self.trainer is not None:
                self.trainer.close()
            if self.built_trainer:
                distributed.teardown()
        finally:
            self.claim.release()

    # ---- the run --------------------------------------------------------------------------------
    def train(self, trainer: GRPOTrainer | None = None, *, lm: LoadedModel | None = None,
              rows: list[dict] | None = None, stop: StopRequest | None = None,
              make_evaluator: Callable[[LoadedModel], Callable] | None = None, final_eval: bool | None = None,
              load_model: Callable[..., LoadedModel] | None = None) -> dict:
        """The whole run with `trainer`, or one built here from the config and the other arguments (see
        GRPOTrainer; `load_model`: how it loads the policy, load_policy unless given; beside a given `trainer` they are
        refused, since it would run without them). A stop request (SIGINT/SIGTERM) before the first step leaves the
        dir as if the run never started; during generation it discards the step in progress; during the update the
        step finishes; either way the state after the last complete step is checkpointed."""
        if trainer is not None:  # the stop request it polls is the run's: the same one given again is no conflict
            _refuse_collaborators_of_a_given_trainer(lm=lm, rows=rows, stop=None if stop is trainer.stop else stop,
                                                     make_evaluator=make_evaluator, final_eval=final_eval,
                                                     load_model=load_model)
        stop = self.stop = trainer.stop if trainer is not None else stop or StopRequest()
        # the CLI installs the handlers for the whole run (model load included); a program's run does it here
        with contextlib.nullcontext() if stop.installed_now else stop.installed(), self.one_line_if_ranks_part():
            if trainer is None:
                from grpo_cli.step.trainer import GRPOTrainer

                self.built_trainer = True
                model = f"{self.cfg.model.name_or_path} and its rollout engine"
                loads = is_rank_zero() and lm is None and load_model is None
                with loading(model) if loads else contextlib.nullcontext():
                    trainer = GRPOTrainer(self.cfg, lm=lm, rows=rows, stop=stop, make_evaluator=make_evaluator,
                                          final_eval=final_eval, log_dir=self.run_dir,
                                          **({"load_model": load_model} if load_model else {}))
            self.trainer = trainer
            start = self.resume()
            if self.claim.decision.checkpoint is None and distributed.any_rank(stop()):
                raise Interrupted(stop.signum or signal.SIGTERM, None, completed=0)  # a new run that wrote nothing yet
            if self.main:  # a final eval of an earlier attempt does not describe this one's weights
                (self.run_dir / FINAL_EVAL).unlink(missing_ok=True)
            tracker = self.open_tracker(start)
            if self.logged_again and self.cfg.logger.backend == "wandb":
                first, last = self.logged_again[0], self.logged_again[-1]
                steps = f"step {first}" if first == last else f"steps {first}-{last}"
                tracker.warn(f"W&B keeps {steps} as the earlier attempt logged them (it drops a step logged again), "
                             f"while this attempt trains them again from the checkpoint after {start} step(s); "
                             f"{METRICS} holds this attempt's")
            t_start = time.time()
            try:
                self.run_steps(tracker, start)
                adapter_dir = self.save_adapter()
                evaluation = self.final_evaluation(tracker)  # polls the stop request too
            except BaseException:
                tracker.end_live()  # the line that says how the run ended is printed whole, not folded under the bar
                raise
        return self.finish(tracker, adapter_dir, time.time() - t_start, evaluation)

    @property
    def _running(self) -> GRPOTrainer:
        """The trainer of `train`, which sets it before any step, checkpoint or eval."""
        assert self.trainer is not None
        return self.trainer

    def run_steps(self, tracker: Tracker, start: int) -> None:
        trainer = self._running
        last_complete = rng_snapshot()
        for step in range(start, self.tcfg.max_steps):
            try:
                result = trainer.step(step, on_phase=tracker.phase)  # the step's phases on the live line
            except (UserCodeError, WorkerError) as failed:  # before the update: the state after `step` steps is intact
                restore_rng(last_complete)
                raise self.keeping_the_last_state(failed, step) from None
            except OutOfMemory as error:
                raise self.out_of_memory(error) from None
            if result is None:  # stopped before the update: checkpoint the state after `step` complete steps
                restore_rng(last_complete)
                raise Interrupted(self.stop.signum or signal.SIGTERM, self.checkpoint_at(step),
                                  completed=step, discarded=True)
            self.record(tracker, step, *result)
            last_complete = rng_snapshot()
            self.checkpoint_if_due(step + 1)

    def out_of_memory(self, error: OutOfMemory) -> RunError:
        """The step's out-of-memory line, with the newest checkpoint on disk (kept) and the command that resumes
        from it: nothing of the failed step is saved (an update may have begun)."""
        return RunError(f"{error}; {self.kept()}")

    def kept(self) -> str:
        """What a run that cannot save now leaves to resume from."""
        return "no checkpoint was written yet" if self.last_checkpoint is None else (
            f"the checkpoint after {self.last_checkpoint[0]} step(s), {self.last_checkpoint[1]}, is kept; resume "
            f"with the same command plus trainer.resume=auto hydra.run.dir={self.run_dir}")

    @contextlib.contextmanager
    def one_line_if_ranks_part(self):
        """A collective that failed (another rank of the job died or stopped answering) ends this rank in one line,
        with the newest checkpoint, instead of a traceback: the other rank's own output says why it went."""
        try:
            yield
        except RuntimeError as error:
            if (reason := distributed.collective_failure(error)) is None:
                raise
            raise RunError(f"this rank lost the others of the job ({reason}): another rank died or stopped answering, "
                           f"its own output says why; {self.kept()}") from None

    def keeping_the_last_state(self, failed: UserCodeError | WorkerError, done: int) -> UserCodeError | WorkerError:
        """`failed`, its line extended by the checkpoint of the state after `done` complete steps and how to go on
        from it (user code: once it is fixed); as it is before this run's first step (nothing to keep) and under
        torchrun (the other ranks are not at a point where they could save)."""
        if (done == 0 and self.last_checkpoint is None) or distributed.world_size() > 1:
            return failed
        fix = "once fixed, " if isinstance(failed, UserCodeError) else ""
        return type(failed)(f"{failed}; the run stopped after {done} complete step(s), checkpoint "
                            f"{self.checkpoint_at(done)}; {fix}resume with the same command plus "
                            f"trainer.resume=auto hydra.run.dir={self.run_dir}")

    def resume(self) -> int:
        """Restore the checkpoint the claim decided on; returns the step to start at."""
        found = self.claim.decision.checkpoint
        if found is None:
            return 0
        state = checkpoint.load(found)
        self._running.load_state_dict(state)
        start = state["step"]
        self.last_checkpoint = (start, found)
        if self.main:
            logged = {r["step"] for r in read_metrics(self.run_dir / METRICS)} if (self.run_dir / METRICS).is_file() \
                else set()
            self.logged_again = sorted(step for step in logged if step >= start)
            rundir.roll_back_records(self.run_dir, start, found)
            self.monitors.replay([r for r in read_metrics(self.run_dir / METRICS) if r["step"] < start])
        return start

    def open_tracker(self, start: int) -> Tracker:
        """Rank 0 logs (metrics.jsonl, the logger's sink, the console); the other ranks' tracker has no sinks."""
        if not self.main:
            return Tracker([])
        config = dict(self.cfg.recorded or self.cfg.composed)  # secrets as written (grpo_cli.base.redaction)
        return open_tracker(self.run_dir, self.cfg.logger, config, self.tcfg.max_steps, start,
                            resume=self.claim.decision.checkpoint is not None)

    # ---- what a step leaves behind --------------------------------------------------------------
    def record(self, tracker: Tracker, step: int, metrics: dict, batch: Batch) -> None:
        """Everything a finished step leaves behind but the checkpoint: the monitors and their alarms, eval, metrics,
        samples."""
        for line in self.monitors.observe(metrics):
            metrics["warning"] = f"{metrics['warning']}; {line}" if "warning" in metrics else line
            tracker.warn(line)
        if metrics.get("reward_errors"):  # reward.on_error=zero: said at every step where it happens
            n, first = int(metrics["reward_errors"]), next(filter(None, batch.reward_failures or []), None)
            tracker.warn(f"step {step}: {n} reward score{'s' if n > 1 else ''} failed and count as 0 (reward.on_error="
                         f"zero){f'; the first: {first}' if first else ''}")
        every = self.cfg.eval.every
        if every and (step + 1) % every == 0:
            try:
                metrics.update(self._running.evaluate(say=tracker.say) or {})
            except Interrupted:
                tracker.warn(f"evaluation after step {step} was stopped; its metrics are left out")
            distributed.barrier()
        tracker.log(metrics)
        self.save_samples(tracker, step, batch)

    def save_samples(self, tracker: Tracker, step: int, batch: Batch) -> None:
        every = self.tcfg.log_samples_every
        if not every or step % every:
            return
        rows = []
        for i, text in enumerate(batch.rollout.texts):
            rows.append({"prompt": batch.prompts[i], "completion": text, "reward": float(batch.rewards[i]),
                         "advantage": float(batch.advantages[i]),
                         **{f"reward/{k}": v[i] for k, v in batch.per_function.items()},
                         **{f"outcome/{k}": v.texts[i] for k, v in batch.outcomes.items()},
                         **batch.rollout.sample_fields(i), **{k: v[i] for k, v in batch.extra.items()}})
        tracker.samples(step, rows)

    # ---- checkpoints and the adapter ------------------------------------------------------------
    def checkpoint_if_due(self, done: int) -> None:
        """Checkpoint every trainer.save_every steps, and on a stop request that came during the update (the
        step was finished; then raise Interrupted). Every rank stops at the same step."""
        stop = self.stop
        stopping = distributed.any_rank(stop())
        every = self.tcfg.save_every
        if (every and done % every == 0) or stopping:
            ckpt = self.save_checkpoint(done)
            if stopping:
                raise Interrupted(stop.signum or signal.SIGTERM, ckpt, completed=done)

    def checkpoint_at(self, done: int) -> Path:
        """A checkpoint of the state after `done` complete steps: the one this run last wrote or resumed from
        when it is that state, else a new one (weights, optimiser and RNG are still those after `done`)."""
        if self.last_checkpoint is not None and self.last_checkpoint[0] == done \
                and self.last_checkpoint[1].parent == checkpoint.checkpoint_root(self.run_dir):
            return self.last_checkpoint[1]
        return self.save_checkpoint(done)

    def save_checkpoint(self, done: int) -> Path:
        """The trainer's state after `done` steps (what it answers to state_dict), with the config's fingerprint."""
        state = self._running.state_dict()
        assert state["step"] == done, (state["step"], done)
        path = checkpoint.step_dir(self.run_dir, done)
        if self.main:
            path = checkpoint.save(self.run_dir, state, self._running.save_adapter,
                                   {"fingerprint": rundir.fingerprint(self.cfg)}, self.tcfg.keep_last)
        distributed.barrier()
        self.last_checkpoint = (done, path)
        return path

    def save_adapter(self) -> Path:
        out = self.run_dir / ADAPTER_DIR
        self._running.save_adapter(out)
        distributed.barrier()
        return out

    # ---- the end --------------------------------------------------------------------------------
    def final_evaluation(self, tracker: Tracker) -> dict | None:
        """eval.final: the greedy eval of the trained policy on the held-out prompts, written to final_eval.json
        (rank 0; None elsewhere or when off). An eval.every eval after the last step is reused: same prompts, same
        weights, greedy. A stop request here raises Interrupted with a checkpoint after the last step, whose
        resume runs only this eval."""
        steps = self.tcfg.max_steps
        try:
            result = self._running.evaluate(final=True, say=tracker.say)
        except Interrupted:
            raise Interrupted(self.stop.signum or signal.SIGTERM, self.checkpoint_at(steps), completed=steps) from None
        if result is not None:
            result = {"step": steps, **result}
            replace_text(self.run_dir / FINAL_EVAL, json.dumps(result, indent=2) + "\n")
        distributed.barrier()
        return result

    def finish(self, tracker: Tracker, adapter_dir: Path, seconds: float, final_eval: dict | None = None) -> dict:
        """The run's summary (rank 0: from metrics.jsonl, so a resumed run counts every step once)."""
        if not self.main:
            return {"final_reward": float("nan"), "adapter": str(adapter_dir)}
        rewards = [row["reward"] for row in read_metrics(self.run_dir / METRICS)]
        summary = {
            "steps": len(rewards),
            "first_reward": sum(rewards[:REWARD_WINDOW]) / max(1, len(rewards[:REWARD_WINDOW])),
            "last_reward": sum(rewards[-REWARD_WINDOW:]) / max(1, len(rewards[-REWARD_WINDOW:])),
            "final_reward": final_mean(rewards),
            **({"final_eval_accuracy": final_eval["eval/accuracy"]} if final_eval else {}),
            "time_s": seconds,
            "adapter": str(adapter_dir),
        }
        tracker.close(summary)
        return summary


def _refuse_collaborators_of_a_given_trainer(**given) -> None:
    """What builds a trainer (GRPOTrainer's arguments) would be silently unused beside a trainer the program built:
    refused in one line that names it."""
    unused = [name for name, value in given.items() if value is not None]
    if unused:
        named = ", ".join(f"{name}=" for name in unused)
        raise ConfigError(f"train() got a trainer and {named}, which only a trainer the run builds takes: the given "
                          f"trainer would run without it; pass {named} to GRPOTrainer(...) instead, or leave out "
                          "the trainer")


def train(cfg: Config | DictConfig, run_dir: Path, trainer: GRPOTrainer | None = None, **collaborators) -> dict:
    """One training run for a program, with grpo-train's run-dir promises: claim `run_dir`, train (with
    `trainer`, or one built from the config and `collaborators`, see Run.train), release the dir."""
    with Run(cfg, run_dir) as run:
        return run.train(trainer, **collaborators)
