"""Read by the type checker (`make lint` runs mypy on it), never run: the typed config an entry point hands
everything below it (schema.Config) gives each option its declared type, so an editor and a type checker see what
`cfg.algo.clip_eps` is. A regression (a section built at run time, an option typed Any) fails lint here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from typing_extensions import assert_type

from grpo_cli.config.schema import AUTO_OR_BOOL, DTYPE, Config, RewardFunctionConfig, TinyConfig


def options_have_their_declared_types(cfg: Config) -> None:
    assert_type(cfg.algo.clip_eps, float)
    assert_type(cfg.algo.clip_eps_high, float | None)
    assert_type(cfg.algo.eps_high, float)  # derived once, a property
    assert_type(cfg.algo.effective_aggregation, str)
    assert_type(cfg.algo.scale_rewards, Literal["group", "batch", "none"])
    assert_type(cfg.algo.num_generations, int)
    assert_type(cfg.algo.filter_groups, bool)
    assert_type(cfg.rollout.stop, tuple[str, ...])
    assert_type(cfg.rollout.compile, AUTO_OR_BOOL)
    assert_type(cfg.trainer.max_steps, int)
    assert_type(cfg.trainer.micro_batch_tokens, Literal["auto"] | int | None)
    assert_type(cfg.eval.final, AUTO_OR_BOOL)
    assert_type(cfg.model.lora.r, int)
    assert_type(cfg.model.tiny, TinyConfig | None)
    assert_type(cfg.model.dtype, DTYPE)
    assert_type(cfg.data.prompts_per_step, int)
    assert_type(cfg.data.system_prompt, str | None)
    assert_type(cfg.optimizer.lr, float)
    assert_type(cfg.reward.functions, Mapping[str, RewardFunctionConfig] | None)
    assert_type(cfg.env._target_, str | None)
