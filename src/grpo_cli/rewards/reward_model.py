"""A reward model as a reward function: a sequence classifier scores each prompt + completion.

    reward:
      functions:
        helpful:
          _target_: grpo_cli.rewards.reward_model.RewardModel
          weight: 1.0
          model: OpenAssistant/reward-model-deberta-v3-large-v2   # hub id or local dir
          label: 0              # the score is this logit (0 = the first)
          batch_size: 16        # completions per forward pass
          standardize: false    # true: z-score the scores of each step (mean 0, std 1)

Any `AutoModelForSequenceClassification` checkpoint works. It is loaded once per run, on the policy's device
and in its dtype, in eval mode and without gradients. When its tokenizer has a chat template, the prompt's
chat messages plus the completion as the assistant's reply are rendered with that template (the reward
model's own format, not the policy's); otherwise the prompt text the policy saw plus the completion is scored.
Model output is only ever tokenized text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from grpo_cli.base.errors import ConfigError, ModelLoadError, error_line


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _looks_local(model: str) -> bool:
    return model.startswith(("/", ".", "~")) or Path(model).expanduser().exists()


class RewardModel:
    """`RewardModel(model=...)(prompts, completions, messages=...) -> list[float]`, one logit per completion."""

    @staticmethod
    def check_options(prefix: str, options: dict[str, Any]) -> None:
        """ConfigError for a bad option, before anything loads; `prefix` is `reward.functions.NAME`."""
        model = options.get("model")
        if not isinstance(model, str) or not model.strip():
            raise ConfigError(f"{prefix}.model={model} is invalid: give a hub id or the local directory of a "
                              "sequence-classification model")
        if _looks_local(model) and not (Path(model).expanduser() / "config.json").is_file():
            raise ConfigError(f"{prefix}.model={model} is invalid: no such model directory (no config.json); "
                              "point it at a saved AutoModelForSequenceClassification")
        label = options.get("label", 0)
        if not _is_int(label) or label < 0:
            raise ConfigError(f"{prefix}.label={label} is invalid: needs an integer >= 0 (the logit index)")
        batch_size = options.get("batch_size", 16)
        if not _is_int(batch_size) or batch_size < 1:
            raise ConfigError(f"{prefix}.batch_size={batch_size} is invalid: needs an integer >= 1")
        max_length = options.get("max_length")
        if max_length is not None and (not _is_int(max_length) or max_length < 1):
            raise ConfigError(f"{prefix}.max_length={max_length} is invalid: needs an integer >= 1, or null for the "
                              "model's own limit")
        for key in ("standardize", "trust_remote_code"):
            if not isinstance(options.get(key, False), bool):
                raise ConfigError(f"{prefix}.{key}={options[key]} is invalid: use true or false")

    def __init__(self, model: str, label: int = 0, batch_size: int = 16, standardize: bool = False,
                 max_length: int | None = None, trust_remote_code: bool = False, *, name: str = "reward_model",
                 device=None, dtype=None):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        prefix = f"reward.functions.{name}"
        self.check_options(prefix, {"model": model, "label": label, "batch_size": batch_size,
                                    "standardize": standardize, "max_length": max_length,
                                    "trust_remote_code": trust_remote_code})
        self.device = torch.device(device or "cpu")
        self.label, self.batch_size, self.standardize = label, batch_size, standardize
        path = str(Path(model).expanduser()) if _looks_local(model) else model
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                path, dtype=dtype or torch.float32, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"{prefix}.model={model} could not be loaded as a sequence classifier "
                                 f"({error_line(err)[:160]}); "
                                 "give a local directory or a hub id reachable from here") from None
        num_labels = self.model.config.num_labels
        if label >= num_labels:
            raise ConfigError(f"{prefix}.label={label} is invalid: {model} has {num_labels} output logits; use 0.."
                              f"{num_labels - 1}")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        if self.model.config.pad_token_id is None:  # the classifier finds each row's last token by it
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.truncation_side = "left"  # an over-long input keeps its end: the completion
        limits = [getattr(self.model.config, "max_position_embeddings", None),
                  self.tokenizer.model_max_length if self.tokenizer.model_max_length < 1e9 else None]
        reads = min((v for v in limits if v), default=None)  # the most tokens the classifier reads
        if max_length is not None and reads is not None and max_length > reads:
            raise ConfigError(f"{prefix}.max_length={max_length} is invalid: {model} reads at most {reads} tokens; "
                              f"use max_length <= {reads} (null = {reads})")
        self.max_length = max_length or reads
        self.model.to(self.device).eval().requires_grad_(False)
        self.templated = bool(getattr(self.tokenizer, "chat_template", None))

    def texts(self, prompts: list, completions: list, messages: list | None) -> tuple[list[str], bool]:
        """What the reward model reads for each completion, and whether it is chat-templated."""
        if messages is None and prompts and all(isinstance(p, list) for p in prompts):
            messages = prompts  # TRL-style conversational prompts
        if self.templated and messages is not None:
            # tokenize=False gives the text, which the stubs' return type (any of its forms) does not say
            return [cast(str, self.tokenizer.apply_chat_template([*m, {"role": "assistant", "content": str(c or "")}],
                                                                 tokenize=False))
                    for m, c in zip(messages, completions, strict=True)], True
        return [f"{p if isinstance(p, str) else ''}{c or ''}" for p, c in zip(prompts, completions, strict=True)], False

    def __call__(self, prompts: list, completions: list, messages: list | None = None, **_: Any) -> list[float]:
        import torch

        texts, templated = self.texts(prompts, completions, messages)
        scores: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                       truncation=self.max_length is not None, max_length=self.max_length,
                                       add_special_tokens=not templated)  # a template writes its own
                logits = self.model(**batch.to(self.device)).logits
                scores += logits[:, self.label].float().cpu().tolist()
        if self.standardize and len(scores) > 1:
            values = torch.tensor(scores, dtype=torch.float64)
            scores = ((values - values.mean()) / (values.std(correction=0) + 1e-8)).tolist()
        return scores
