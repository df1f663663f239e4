"""Rollouts: G completions per prompt behind one seam, and the log-prob pass over them.

    engine = make_engine(cfg.rollout, lm, max_prompt_tokens=...)   # rollout.engine: auto | hf | compiled
    roll = engine.generate(prompt_ids, G, max_new_tokens=..., temperature=..., stop=...)   # -> Rollout
    engine.policy_changed()                                          # after each optimizer step
    engine.close()

The trainer and the evaluator see only this; a new engine (vLLM, SGLang) is one module and one line in
ENGINES. Log-probs for the loss are recomputed by `completion_logprobs`, never taken from an engine.
"""

from __future__ import annotations

from grpo_cli.config import ROLLOUT_ENGINES
from grpo_cli.rollout.common import (
    EncodedPrompts,
    Engine,
    Rollout,
    StopFn,
    completion_masks,
    encode_prompts,
    eos_ids,
    left_pad,
    positions,
    prefill,
)
from grpo_cli.rollout.hf import HFEngine, generate
from grpo_cli.rollout.logprobs import completion_hidden, completion_logits, completion_logprobs

ENGINES = ROLLOUT_ENGINES

__all__ = [
    "ENGINES", "EncodedPrompts", "Engine", "HFEngine", "Rollout", "StopFn", "as_engine",
    "completion_hidden", "completion_logits", "completion_logprobs", "completion_masks", "encode_prompts",
    "eos_ids", "generate", "left_pad", "make_engine", "positions", "prefill", "resolve_engine",
]


def resolve_engine(name: str, device) -> str:
    """`auto`: `compiled` on CUDA (where it pays), `hf` elsewhere."""
    if name == "auto":
        return "compiled" if device.type == "cuda" else "hf"
    return name


def make_engine(cfg_rollout, lm, *, max_prompt_tokens: int | None = None) -> Engine:
    """The engine `rollout.engine` names, for `lm` (a models.LoadedModel or anything with model, tokenizer,
    device). `rollout.compile` (auto | true | false; auto = on CUDA only) applies to `compiled`."""
    name = resolve_engine(str(cfg_rollout.get("engine", "auto")), lm.device)
    if name == "hf":
        return HFEngine(lm.model, lm.tokenizer, lm.device)
    from grpo_cli.rollout.compiled import CompiledEngine  # the only other name config.validate lets through

    setting = cfg_rollout.get("compile", "auto")
    compile_ = lm.device.type == "cuda" if setting == "auto" else bool(setting)
    return CompiledEngine(lm.model, lm.tokenizer, lm.device, compile=compile_, max_prompt_tokens=max_prompt_tokens,
                          compile_fallback=setting == "auto")


def as_engine(engine_or_model, tokenizer, device=None) -> Engine:
    """An engine as given, or a bare model wrapped in the `hf` engine."""
    return engine_or_model if isinstance(engine_or_model, Engine) else HFEngine(engine_or_model, tokenizer, device)
