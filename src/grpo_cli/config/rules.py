"""The rules relating several config keys that the step asks while it runs: whether an update is on-policy (the
trainer), whether a prompt plus its completion fits the model's context (the model loader). They need no
component, so they sit on the ground: config.py, which also asks every component what it accepts, sits above
the step and uses them too."""

from __future__ import annotations

from operator import attrgetter

from grpo_cli.config.schema import AlgoConfig, Config, fail


def is_on_policy(algo: AlgoConfig) -> bool:
    """One optimizer update per rollout batch: the ratio is exactly 1, so clipping never acts; with more, old
    log-probs are needed and clipping acts."""
    return algo.mini_batches == 1 and algo.num_iterations == 1


def check_context_length(config: Config, context: int | None, keys: tuple[str, ...]) -> None:
    """max_new_tokens plus the longest prompt (data.max_prompt_tokens) must fit the model's context; `keys` name
    the max_new_tokens settings that apply (rollout.max_new_tokens, eval.max_new_tokens)."""
    if not context:
        return
    prompt = config.data.max_prompt_tokens
    for key in keys:
        new = attrgetter(key)(config)
        if new + prompt > context:
            fix = (f"use {key}<={context - prompt} or lower data.max_prompt_tokens" if context > prompt
                   else f"lower data.max_prompt_tokens below {context}")
            fail(key, new, f"with data.max_prompt_tokens={prompt} a sequence reaches {new + prompt} tokens, beyond "
                            f"the {context}-token context of {config.model.name_or_path}; {fix}")
