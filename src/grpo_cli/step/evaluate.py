"""Accuracy of a policy on held-out prompts: greedy pass@1, and with k samples pass@k and majority@k.

Used by `grpo-eval` (base model or a trained adapter), by the trainer every `eval.every` steps, and once after
the last step with `eval.final` (its result in the run dir's `final_eval.json`, which the sweep summary reads).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import signal
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from rich.console import Console
from rich.table import Table

from grpo_cli.base.console import print_table
from grpo_cli.base.errors import ConfigError, Interrupted
from grpo_cli.base.metrics import replace_text
from grpo_cli.config.schema import Config, RewardConfig
from grpo_cli.model.adapter_fit import check_base_name, check_shapes
from grpo_cli.model.loading import config_context_length
from grpo_cli.rewards import as_conversation, build_reward, call_reward, is_native, to_scores
from grpo_cli.rewards.columns import check_columns
from grpo_cli.rollout import Engine, SamplingParams, as_engine, make_engine
from grpo_cli.rollout.episodes import EpisodeRunner, reward_field_names
from grpo_cli.tasks.prompts import encode_prompts, given_as_chat, where_of
from grpo_cli.tasks.sources import load_rows

EVAL_BATCH_PROMPTS = 16


def accuracy_function(cfg_reward: RewardConfig):
    """The reward function that judges correctness (0/1), named by `reward.accuracy`, with its entry's options."""
    name, functions = cfg_reward.accuracy, cfg_reward.functions or {}
    if name is None or name not in functions:
        raise ConfigError(f"reward.accuracy={name} is invalid: name one of reward.functions ({', '.join(functions)})")
    return build_reward(name, functions[name])


HELD_OUT_SEED = 0  # generated held-out splits use this, not trainer.seed: every job of a sweep scores the same prompts


def eval_rows(cfg: Config) -> list[dict]:
    """The held-out prompts: the first `eval.num_prompts` of the test split, the same whatever trainer.seed."""
    return load_rows(cfg.data, split="test", seed=HELD_OUT_SEED)[: cfg.eval.num_prompts]


def check_held_out_columns(cfg: Config, rows: list[dict], episodes: EpisodeRunner | None) -> None:
    """The held-out `rows` have every column reward.accuracy needs (DataError before the model loads)."""
    check_columns(cfg.reward, rows, reward_field_names(episodes), where=where_of, held_out=True)


def answer_reader(judge) -> Callable[[str], Hashable | None]:
    """How majority@k reads the answer a completion gives: the judge's own `parse_answer` (a reward module sets it
    beside its function, e.g. rewards.gsm8k.correctness), else the completion's text, stripped."""
    function = inspect.unwrap(judge)  # build_reward's wrapper, then the entry's options bound (functools.partial)
    function = getattr(function, "func", function)
    return getattr(function, "parse_answer", None) or (lambda text: (text or "").strip() or None)


def majority(texts: list[str], read_answer: Callable[[str], Hashable | None]) -> int | None:
    """The index of the first completion that gives the most common answer; None when none gives one."""
    answers = [read_answer(t) for t in texts]
    counts = Counter(a for a in answers if a is not None)
    return answers.index(counts.most_common(1)[0][0]) if counts else None


class Evaluator:
    def __init__(self, rows: list[dict], tokenizer, judge, *, samples: int, temperature: float, max_new_tokens: int,
                 max_prompt_tokens: int, sampling: SamplingParams | None = None,
                 episodes: EpisodeRunner | None = None):
        self.rows, self.tokenizer, self.judge = rows, tokenizer, judge
        self.judge_is_native = is_native(judge)  # grpo-cli's own reads text, whatever the prompts' form
        self.read_answer = answer_reader(judge)
        self.samples, self.temperature, self.max_prompt_tokens = samples, temperature, max_prompt_tokens
        # rollout's sampling (SamplingParams.of) at eval.max_new_tokens, no token forced: all of it for pass@k (at
        # eval.temperature), its stop strings for greedy (the greedy pass ignores the rest)
        self.sampling = replace(sampling or SamplingParams(max_new_tokens), max_new_tokens=max_new_tokens,
                                min_new_tokens=0)
        self.episodes = episodes  # rollout.tools / env._target_: the same episode loop as training

    @classmethod
    def from_config(cls, cfg: Config, tokenizer, rows: list[dict] | None = None) -> Evaluator:
        rows = eval_rows(cfg) if rows is None else rows
        return cls(rows, tokenizer, accuracy_function(cfg.reward), samples=cfg.eval.samples,
                   temperature=cfg.eval.temperature, max_new_tokens=cfg.eval.max_new_tokens,
                   max_prompt_tokens=cfg.data.max_prompt_tokens, sampling=SamplingParams.of(cfg.rollout),
                   episodes=EpisodeRunner.from_config(cfg))

    @classmethod
    def for_training(cls, cfg: Config, lm) -> Evaluator:
        return cls.from_config(cfg, lm.tokenizer)

    def _score(self, texts: list[str], rows: list[dict], prompts: list[str]) -> list[float]:
        """reward.accuracy's scores of `texts`, each of the row and prompt (its text) at the same place; called as in
        training (rewards.as_conversation: a function of the user's gets chat prompts in TRL's conversational form)."""
        fields: dict[str, Any] = {k: [r[k] for r in rows] for k in rows[0] if k != "messages"}
        name = getattr(self.judge, "__name__", "accuracy")
        completions: list = texts
        if not self.judge_is_native:  # called as in training: TRL's loggers (an eval keeps nothing), its chat form
            fields |= {"log_metric": lambda name, value: None, "log_extra": lambda column, values: None}
            chat = [r["messages"] for r in rows] if given_as_chat(rows[0]) else None
            prompts, completions = as_conversation(prompts, texts, chat)
        scores = to_scores(name, call_reward(self.judge, prompts, completions, fields), len(texts))
        return cast("list[float]", scores)  # without allow_none every score is a float

    @staticmethod
    def _check(roll, stop) -> None:
        if roll is None or roll.interrupted:  # None: stopped while a tool or the environment ran
            raise Interrupted(getattr(stop, "signum", None) or signal.SIGTERM)

    def _generate(self, engine: Engine, rows: list[dict], ids: list[list[int]], k: int, sampling: SamplingParams,
                  stop=None):
        """k completions per prompt: one turn, or with tools or an environment an episode each."""
        if self.episodes is None:
            return engine.generate(ids, k, sampling, stop)
        model = getattr(engine, "model", None)
        setup = self.episodes.setup(self.tokenizer, None if model is None else config_context_length(model.config))
        return setup.run(engine, rows, k, sampling, stop)

    def run(self, engine: Engine, stop=None) -> dict:
        """Metrics under the `eval/` prefix; the sampled part only when samples > 1. `engine` is the rollout
        engine to sample with (a bare model is wrapped in the `hf` engine). Raises Interrupted when `stop`
        (polled every decode step) turns true."""
        engine = as_engine(engine, self.tokenizer)
        greedy_correct, pass_k, majority_k, calls = [], [], [], []
        for start in range(0, len(self.rows), EVAL_BATCH_PROMPTS):
            rows = self.rows[start:start + EVAL_BATCH_PROMPTS]
            encoded = encode_prompts(self.tokenizer, rows, self.max_prompt_tokens)
            ids, prompts = encoded.ids, encoded.texts
            roll = self._generate(engine, rows, ids, 1, replace(self.sampling, greedy=True), stop)
            self._check(roll, stop)
            greedy_correct += self._score(roll.texts, rows, prompts)
            calls += roll.tool_use()
            if self.samples > 1:
                k = self.samples
                sampled = self._generate(engine, rows, ids, k, replace(self.sampling, temperature=self.temperature),
                                         stop)
                self._check(sampled, stop)
                scores = self._score(sampled.texts, [r for r in rows for _ in range(k)],
                                     [p for p in prompts for _ in range(k)])
                for i, row in enumerate(rows):
                    group = sampled.texts[i * k:(i + 1) * k]
                    pass_k.append(float(max(scores[i * k:(i + 1) * k])))
                    vote = majority(group, self.read_answer)
                    majority_k.append(0.0 if vote is None else self._score([group[vote]], [row], [prompts[i]])[0])
        n = len(greedy_correct)
        result = {"eval/accuracy": sum(greedy_correct) / n, "eval/num_prompts": n}
        if self.episodes is not None:  # the greedy episodes' tool use
            result |= episode_use(calls)
        if self.samples > 1:
            result[f"eval/pass@{self.samples}"] = sum(pass_k) / n
            result[f"eval/majority@{self.samples}"] = sum(majority_k) / n
        return result

    def __call__(self, engine: Engine, stop=None) -> dict:
        return self.run(engine, stop)


def episode_use(calls: list[tuple[int, int]]) -> dict[str, float]:
    """From (calls, failed calls) per episode: calls per episode, the share of episodes with a call that ran,
    and the failed-call rate."""
    made, failed = sum(c for c, _ in calls), sum(f for _, f in calls)
    return {"eval/tool_calls_per_episode": made / max(1, len(calls)),
            "eval/episodes_with_a_successful_call": sum(c > f for c, f in calls) / max(1, len(calls)),
            "eval/failed_call_rate": failed / made if made else 0.0}


def _fits_base(cfg: Config, base, adapter: Path) -> None:
    """An adapter trained on another base is refused in one line, as grpo-export refuses it."""
    fix = "pick the model it was trained on (model=NAME)"
    check_base_name(adapter, str(cfg.model.name_or_path), base, fix)
    check_shapes(base, adapter, str(cfg.model.name_or_path), fix)


def run_eval(cfg: Config, run_dir: Path, stop=None) -> dict:
    """`grpo-eval`: load the base model (and `eval.adapter` if given), evaluate, print a table, write eval.json."""
    from grpo_cli.model.loading import load_trained, load_within_context

    torch.manual_seed(cfg.trainer.seed)
    rows = eval_rows(cfg)  # bad data fails before the model loads
    check_held_out_columns(cfg, rows, EpisodeRunner.from_config(cfg))  # so do a bad tool, environment or column
    adapter = cfg.eval.adapter
    lm = load_within_context(cfg, ("eval.max_new_tokens",), lambda: load_trained(
        cfg.model, cfg.trainer.device, adapter, seed=cfg.trainer.seed, check_fit=partial(_fits_base, cfg)))
    label = str(Path(adapter).expanduser().resolve()) if adapter else "base"
    # the weights scored, named by their content: the folder may be trained again or replaced later
    weights = {"adapter_sha256": hashlib.sha256((Path(label) / "adapter_model.safetensors").read_bytes()).hexdigest()} \
        if adapter else {}
    evaluator = Evaluator.from_config(cfg, lm.tokenizer, rows)
    engine = make_engine(cfg.rollout, lm, max_prompt_tokens=cfg.data.max_prompt_tokens)
    console = Console()
    console.print(f"evaluating {label} on {len(evaluator.rows)} held-out prompts", markup=False, highlight=False)
    try:
        result = {"model": cfg.model.name_or_path, "adapter": label, **weights, **evaluator.run(engine, stop)}
    finally:
        engine.close()
    run_dir.mkdir(parents=True, exist_ok=True)
    replace_text(run_dir / "eval.json", json.dumps(result, indent=2) + "\n")  # whole or not at all
    table = Table(title=f"grpo-eval: {cfg.model.name_or_path} + {label}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.items():
        if key.startswith("eval/"):
            table.add_row(key[5:], f"{value:.4f}" if isinstance(value, float) else str(value))
    print_table(console, table)
    result["accuracy"] = result["eval/accuracy"]
    return result
