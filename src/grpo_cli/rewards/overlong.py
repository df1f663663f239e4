"""DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13), as a reward function.

With L_max = `max_tokens` and L_cache = `buffer`, a completion of |y| tokens gets

    0                                   |y| <= L_max - L_cache
    ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
    -1                                  |y| > L_max

|y| counts the completion text's tokens as the policy's tokenizer encodes it (`tokenizer`, e.g.
`${model.name_or_path}`); set `max_tokens` to `${rollout.max_new_tokens}` for DAPO's setting.
"""

from __future__ import annotations

from typing import Any

from grpo_cli.base.errors import ConfigError


def overlong_score(length: int, max_tokens: int, buffer: int) -> float:
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    if length <= max_tokens:
        return (start - length) / buffer
    return -1.0


def _positive_int(prefix: str, key: str, options: dict[str, Any]) -> int:
    value = options.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{prefix}.{key}={value} is invalid: needs an integer >= 1")
    return value


class OverlongPenalty:
    """reward.functions.NAME: {_target_: grpo_cli.rewards.overlong.OverlongPenalty, max_tokens, buffer, tokenizer}."""

    @staticmethod
    def check_options(prefix: str, options: dict[str, Any]) -> None:
        max_tokens, buffer = _positive_int(prefix, "max_tokens", options), _positive_int(prefix, "buffer", options)
        if buffer > max_tokens:
            raise ConfigError(f"{prefix}.buffer={buffer} is invalid: needs buffer <= max_tokens ({max_tokens})")
        if not isinstance(options.get("tokenizer"), str):
            raise ConfigError(f"{prefix}.tokenizer={options.get('tokenizer')} is invalid: name the policy's tokenizer, "
                              "e.g. ${{model.name_or_path}}")

    def __init__(self, max_tokens: int, buffer: int, tokenizer: str, name: str = "overlong", device=None, dtype=None):
        from grpo_cli.model.loading import load_tokenizer

        self.max_tokens, self.buffer = max_tokens, buffer
        self.tokenizer = load_tokenizer(tokenizer)

    def __call__(self, prompts, completions, **_) -> list[float]:
        lengths = [len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) for text in completions]
        return [overlong_score(n, self.max_tokens, self.buffer) for n in lengths]
