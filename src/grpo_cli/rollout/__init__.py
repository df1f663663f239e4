"""Rollouts: G completions per prompt behind one seam, and the log-prob pass over them.

    engine = make_engine(cfg.rollout, lm, max_prompt_tokens=...)   # rollout.engine: a name in ENGINES
    sampling = SamplingParams.of(cfg.rollout)                        # once: lengths, temperature, stop strings
    roll = engine.generate(prompt_ids, G, sampling, stop=...)
    engine.policy_changed()                                          # after each optimizer step
    engine.close()

The trainer and the evaluator see only this. A new engine (vLLM, SGLang) is one module with an Engine
subclass registered as `@ENGINES.register("NAME")` (imported here, or named in the config's `plugins`);
`Engine.from_config` builds it, so nothing else names the engines. Log-probs for the loss are recomputed by
`completion_logprobs`, never taken from an engine.

May import: tasks, algorithm, model, config, base.
"""

from __future__ import annotations

from grpo_cli.config.schema import RolloutConfig
from grpo_cli.rollout.common import (
    ENGINES,
    Engine,
    Generation,
    Rollout,
    SamplingParams,
    StopFn,
    completion_masks,
    eos_ids,
    left_pad,
    positions,
    prefill,
    sampling_seed,
)
from grpo_cli.rollout.compiled import CompiledEngine
from grpo_cli.rollout.hf import HFEngine, generate
from grpo_cli.rollout.inference_copy import InferenceCopy
from grpo_cli.rollout.logprobs import completion_hidden, completion_logits, completion_logprobs
from grpo_cli.rollout.merged import MergedEngine
from grpo_cli.rollout.shared import job_engine
from grpo_cli.rollout.vllm import VLLMEngine  # rollout.engine=vllm; imports vllm only when an engine is built

__all__ = [
    "ENGINES", "CompiledEngine", "Engine", "Generation", "HFEngine", "InferenceCopy", "MergedEngine",
    "Rollout", "SamplingParams",
    "StopFn", "as_engine",
    "completion_hidden", "completion_logits", "completion_logprobs", "completion_masks",
    "eos_ids", "generate", "left_pad", "make_engine", "positions", "prefill", "sampling_seed",
    "VLLMEngine",
]


def make_engine(cfg_rollout: RolloutConfig, lm, *, max_prompt_tokens: int | None = None) -> Engine:
    """The engine `rollout.engine` names (default auto), for `lm` (a models.LoadedModel or anything with model,
    tokenizer, device); for a sweep job's adapter on a shared base (rollout.shared.JobModel) the engine that hands its
    calls to the sweep."""
    return job_engine(lm) or ENGINES.lookup(cfg_rollout.engine).from_config(cfg_rollout, lm, max_prompt_tokens)


def as_engine(engine_or_model, tokenizer, device=None) -> Engine:
    """An engine as given, or a bare model wrapped in the `hf` engine."""
    return engine_or_model if isinstance(engine_or_model, Engine) else HFEngine(engine_or_model, tokenizer, device)
