"""Episodes: rollouts in which the model calls tools over several turns.

Design
------
An episode is one completion row that may span turns: the model writes until its end of turn (EOS) or until
it closes a tool call (the stop string `</tool_call>`); the call is parsed as data (`tools.ToolFormat.parse`)
and run under a deadline (`tools.call_tool`), and its result is appended as the tool message's tokens, rendered
through the chat template as a delta (`ToolFormat.tool_delta`); then the model continues. The conversation is
never re-rendered nor re-tokenized, so a row is `prompt + sampled + tool + sampled + ...` and the tokens the model
sampled are, id for id, the tokens the loss sees (TRL calls this a prefix-preserving template).

The loop is engine-agnostic: every turn is one `Engine.generate` call over the episodes still running (the first
turn samples G per prompt, later turns one per episode, each from its own sequence), so `hf`, `compiled` and any
later engine work unchanged. An episode stops at its end of turn without a call, at `max_tool_calls` executed
calls (a further call is left unexecuted), when its model tokens reach `max_new_tokens` (the budget of the whole
episode, not of a turn), or when its sequence reaches the model's context; the last two mark it `cut`.

A tool that raises, hangs past its deadline, is unknown, or gets arguments that do not fit its signature gives
the model an error message and counts as a failed call; it never ends the run. A result over
`tool_output_max_chars` is cut with a note. Environments follow TRL's `environment_factory` contract: one instance
per episode (states never mix), `reset(**row) -> str | None` (the row's columns, the prompt as `prompt`) whose
string is appended to the last user message (with no messages it is the prompt), public methods as tools, and an
optional `get_reward()`, a reward function of the caller's (rewards.environment_reward). Tools, the environment's
constructor and reset run behind the user-code boundary (grpo_cli.base.user_code): a stop request abandons them and
raises Interrupted; a tool or environment that exits, or an environment that raises or returns what it must not,
ends the run with a UserCodeError naming it.

The record is a `Rollout` (so the log-prob pass runs on it as it is) with, beside `completion_mask` (every real
token, for attention), `model_mask`: the tokens the model sampled, the only ones for the loss, the ratio, the KL,
the entropy and every token count (`Episodes.loss_mask`). Where the G prompts of a group differ (an environment
whose reset varies per instance), the group's common prefix is the prompt and each episode's remainder opens its
completion as non-model tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from grpo_cli.base.errors import ConfigError, Interrupted, UserCodeError
from grpo_cli.rollout.common import Engine, Rollout, SamplingParams, StopFn, eos_ids, left_pad
from grpo_cli.rollout.rows import per_row, per_token, row_dataclass
from grpo_cli.rollout.tools import (
    Tool,
    ToolFormat,
    call_tool,
    environment_class,
    environment_functions,
    environment_methods,
    import_object,
    make_tool,
    make_tools,
    new_environment,
    reset_environment,
    supports_tools,
)

if TYPE_CHECKING:
    from grpo_cli.config.schema import Config


def _counted(counts: torch.Tensor | None) -> torch.Tensor:
    """An Episodes' per-episode count (tool_calls, turns, cut, ...): `run_episodes` records each; a record built
    without it has none to report."""
    assert counts is not None
    return counts


@row_dataclass
class Episodes(Rollout):
    """A Rollout whose rows are episodes; `texts` are the model's own turns, joined by newlines."""

    # [N, T] 1 on tokens the model sampled (within completion_mask)
    model_mask: torch.Tensor | None = per_token(default=None)
    prompts: list[str] = per_row(default_factory=list)  # each episode's rendered prompt text (with any opener)
    messages: list[list[dict]] = per_row(default_factory=list)  # each episode's conversation, tool calls and results
    tool_calls: torch.Tensor | None = per_row(default=None)    # [N] calls the model made (run or failed)
    failed_calls: torch.Tensor | None = per_row(default=None)  # [N] of those, the ones that failed
    turns: torch.Tensor | None = per_row(default=None)         # [N] assistant turns
    cut: torch.Tensor | None = per_row(default=None)           # [N] bool: ended mid-turn (max_new_tokens, the context)
    tool_outputs_cut: torch.Tensor | None = per_row(default=None)  # [N] tool results cut to tool_output_max_chars
    environments: list = per_row(default_factory=list)  # one instance per episode (empty without an environment)

    def loss_mask(self) -> torch.Tensor:
        """Its model_mask: tool and environment tokens are in the sequence and in completion_mask, so the log-prob
        pass attends to them, but they are never trained on nor counted."""
        return self.completion_mask if self.model_mask is None else self.model_mask

    def prompt_texts(self, rendered: list[str]) -> list[str]:
        """Each episode's own rendered prompt (an environment's reset may vary it within a group)."""
        return self.prompts or super().prompt_texts(rendered)

    def reward_fields(self) -> dict[str, list]:
        """Beside `completion_ids`, `messages`, the whole conversation with its tool calls and results, and
        `environments`, the episode's instance (when there is an environment)."""
        return {**super().reward_fields(), "messages": self.messages,
                **({"environments": self.environments} if self.environments else {})}

    def sample_fields(self, i: int) -> dict:
        """The whole conversation as text (each message as `role: content`, tool calls and results included) and
        its counts."""
        conversation = "\n".join(f"{m['role']}: {m.get('content') or ''}" + (
            f" {[c['function'] for c in m['tool_calls']]}" if m.get("tool_calls") else "") for m in self.messages[i])
        return {"conversation": conversation, "tool_calls": int(_counted(self.tool_calls)[i]),
                "failed_calls": int(_counted(self.failed_calls)[i]), "turns": int(_counted(self.turns)[i]),
                "cut": bool(_counted(self.cut)[i])}

    def tool_use(self) -> list[tuple[int, int]]:
        return [(int(c), int(f)) for c, f in zip(_counted(self.tool_calls), _counted(self.failed_calls), strict=True)]

    def metrics(self) -> dict[str, float]:
        """tool calls per episode, the failed-call rate, turns per episode, the share cut by the budget."""
        tool_calls = _counted(self.tool_calls)
        calls = float(tool_calls.sum())
        return {"tool_calls_per_episode": float(tool_calls.float().mean()),
                "failed_call_rate": float(_counted(self.failed_calls).sum()) / calls if calls else 0.0,
                "turns_per_episode": float(_counted(self.turns).float().mean()),
                "cut_frac": float(_counted(self.cut).float().mean()),
                "tool_outputs_cut": float(_counted(self.tool_outputs_cut).sum())}


@dataclass
class Episode:
    """One episode while it runs."""

    prompt: list[int]
    prompt_text: str  # the rendered prompt, opener included
    tools: dict[str, Tool]
    messages: list[dict]
    env: object | None = None
    tokens: list[int] = field(default_factory=list)   # everything after the prompt
    sampled: list[int] = field(default_factory=list)  # 1 where the model sampled the token
    texts: list[str] = field(default_factory=list)
    calls: int = 0
    failed: int = 0
    outputs_cut: int = 0
    turns: int = 0
    cut: bool = False
    done: bool = False

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.tokens

    @property
    def model_tokens(self) -> int:
        return sum(self.sampled)


def start_episode(fmt: ToolFormat, row: dict, tools: Sequence[Tool], environment_factory: Callable | None,
                  stop: StopFn | None = None, environment_timeout_s: float | None = None) -> Episode:
    """The episode's environment instance (reset with the row's columns, each within environment_timeout_s), its
    tools and its prompt."""
    messages = [dict(m) for m in row.get("messages") or []]
    env, tools = None, list(tools)
    if environment_factory is not None:
        env = new_environment(environment_factory, stop, environment_timeout_s)
        observation = reset_environment(env, row, stop, environment_timeout_s)
        if observation is not None:
            if messages:
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
            else:
                messages = [{"role": "user", "content": observation}]
        tools += make_tools(environment_methods(env))
    if len({t.name for t in tools}) != len(tools):
        raise ConfigError(f"two tools share a name among {', '.join(t.name for t in tools)}; every tool needs its own")
    if not messages:
        raise ConfigError("a row without messages needs an environment whose reset(**row) returns the prompt")
    text = fmt.render_prompt(messages, tools)
    prompt = fmt.tokenizer(text, add_special_tokens=False)["input_ids"]
    messages = [*messages, {"role": "assistant", "content": fmt.opener}] if fmt.opener else messages
    return Episode(prompt, text, {t.name: t for t in tools}, messages, env)


@dataclass(frozen=True)
class EpisodeSetup:
    """What the episode loop runs under beside the sampling: the tool format of the model's tokenizer, the calls an
    episode may make, the model's context (None: unbounded), the standalone tools, the environment class, a call's
    deadline and the cap on its result. `EpisodeRunner.setup` gives a config's."""

    fmt: ToolFormat
    max_tool_calls: int
    context_length: int | None = None
    tools: Sequence[Callable] = ()
    environment_factory: Callable | None = None
    tool_timeout_s: float | None = None
    tool_output_max_chars: int | None = None
    environment_timeout_s: float | None = None  # env.timeout_s: building and resetting the environment

    def run(self, engine: Engine, rows: list[dict], num_generations: int, sampling: SamplingParams,
            stop: StopFn | None = None) -> Episodes | None:
        """run_episodes under this setup; None when a stop request came while a tool or the environment ran (it was
        abandoned: there is no record to keep)."""
        try:
            return run_episodes(engine, rows, num_generations, sampling, self, stop)
        except Interrupted:
            return None


def run_episodes(engine: Engine, rows: list[dict], num_generations: int, sampling: SamplingParams,
                 setup: EpisodeSetup, stop: StopFn | None = None) -> Episodes:
    """G episodes per row (rows g*G .. g*G+G-1 belong to row g), each turn of all running episodes in one
    `engine.generate` call with `sampling` (its max_new_tokens: the budget of a whole episode; its min_new_tokens:
    of each turn, never above the turn's room; the tool format's stop strings added to its own).
    A stop request during generation gives an `interrupted` record; one while user code runs raises Interrupted."""
    fmt, max_tool_calls, context_length = setup.fmt, setup.max_tool_calls, setup.context_length
    max_new_tokens = sampling.max_new_tokens
    if max_tool_calls < 0 or max_new_tokens < 1:
        raise ConfigError(f"max_tool_calls={max_tool_calls} and max_new_tokens={max_new_tokens} must be >= 0 and >= 1")
    G, stops = num_generations, tuple(sampling.stop_strings) + fmt.stop_strings
    standalone = make_tools(setup.tools)
    episodes = [start_episode(fmt, row, standalone, setup.environment_factory, stop, setup.environment_timeout_s)
                for row in rows for _ in range(G)]
    limits = ToolLimits(setup.tool_timeout_s, setup.tool_output_max_chars, stop)
    eos = end_ids(engine, fmt.tokenizer)
    interrupted, first = False, True
    while not interrupted and (running := [e for e in episodes if not e.done]):
        for e in running:
            if remaining(e, max_new_tokens, context_length) <= 0:
                e.done = e.cut = True
        if not (running := [e for e in running if not e.done]):
            break
        prompts, per_prompt = (([e.prompt for e in running[::G]], G) if first and same_within_groups(running, G)
                               else ([e.sequence for e in running], 1))
        room = [remaining(e, max_new_tokens, context_length) for e in running]
        turn = replace(sampling, max_new_tokens=max(room), min_new_tokens=min(sampling.min_new_tokens, max(room)),
                       stop_strings=stops)
        roll = engine.generate(prompts, per_prompt, turn, stop)
        interrupted, first = roll.interrupted, False
        if interrupted:  # the caller's stop(): a partial record it discards; no tool runs for it
            break
        for i, e in enumerate(running):
            new = roll.completion_ids[i][roll.completion_mask[i].bool()].tolist()[:room[i]]
            take_turn(fmt, e, new, eos, room[i], max_tool_calls, limits, context_length, max_new_tokens)
    return finish_episodes(episodes, G, fmt.tokenizer.pad_token_id, engine.device, interrupted)


def end_ids(engine: Engine, tokenizer) -> set[int]:
    """The ids that end a turn: the engine's model's EOS ids (its generation config's too), else the tokenizer's."""
    model = getattr(engine, "model", None) or getattr(engine, "policy", None)
    return set(eos_ids(model, tokenizer)) if model is not None else {tokenizer.eos_token_id}


def same_within_groups(episodes: list[Episode], G: int) -> bool:
    return len(episodes) % G == 0 and all(episodes[i].prompt == episodes[i - i % G].prompt
                                          for i in range(len(episodes)))


def remaining(e: Episode, max_new_tokens: int, context_length: int | None) -> int:
    """Tokens the episode may still sample: its budget's rest, and the context's."""
    room = max_new_tokens - e.model_tokens
    return room if context_length is None else min(room, context_length - len(e.sequence))


@dataclass(frozen=True)
class ToolLimits:
    """How a tool call runs: its deadline, the cap on its result, the stop request that abandons it."""

    timeout_s: float | None = None
    max_chars: int | None = None
    stop: StopFn | None = None


def take_turn(fmt: ToolFormat, e: Episode, new: list[int], eos: set[int], room: int, max_tool_calls: int,
              limits: ToolLimits, context_length: int | None, max_new_tokens: int) -> None:
    """Append the model's tokens of this turn; run its call and append the tool message, or end the episode."""
    # transformers' parser reads the text before the turn (a template may pre-write part of it); Hermes does not
    prefix = fmt.tokenizer.decode(e.sequence) if fmt.parser is not None else ""
    e.tokens += new
    e.sampled += [1] * len(new)
    e.turns += 1
    ended_turn = bool(new) and new[-1] in eos
    text = fmt.tokenizer.decode(new, skip_special_tokens=True)
    opener = fmt.opener if e.turns == 1 else ""
    e.texts.append(text)
    calls = fmt.parse(opener + text, prefix[:len(prefix) - len(opener)], list(e.tools.values()))
    if e.turns == 1 and opener:
        e.messages[-1] = fmt.assistant_message(opener + text, calls)
    else:
        e.messages.append(fmt.assistant_message(text, calls))
    e.cut = not ended_turn and not calls and len(new) >= room
    if not calls or e.calls + len(calls) > max_tool_calls or e.cut:
        e.done = True
        return
    results = [call_tool(e.tools, call, limits.timeout_s, limits.stop, limits.max_chars) for call in calls]
    e.calls += len(calls)
    e.failed += sum(r.failed for r in results)
    e.outputs_cut += sum(r.cut for r in results)
    delta = fmt.tokenizer(fmt.tool_delta(results, ended_turn), add_special_tokens=False)["input_ids"]
    if e.model_tokens >= max_new_tokens or (context_length is not None
                                            and len(e.sequence) + len(delta) >= context_length):
        e.done = e.cut = True  # no room left to read the result and answer: it stays out, as in TRL
        return
    e.messages += fmt.tool_messages(results)
    e.tokens += delta
    e.sampled += [0] * len(delta)


def common_prefix(seqs: list[list[int]]) -> int:
    n = min(len(s) for s in seqs)
    for i in range(n):
        if any(s[i] != seqs[0][i] for s in seqs):
            return i
    return n


def finish_episodes(episodes: list[Episode], G: int, pad_id: int, device, interrupted: bool) -> Episodes:
    """The record: each group's common prompt prefix left-padded, the rest of each row right-padded."""
    prompts, rows, sampled = [], [], []
    for g in range(0, len(episodes), G):
        group = episodes[g:g + G]
        shared = common_prefix([e.prompt for e in group])
        if shared == 0:
            raise ConfigError("the prompts of one group share no token; episodes of one row must share its prompt")
        prompts.append(group[0].prompt[:shared])
        for e in group:
            rows.append(e.prompt[shared:] + e.tokens)
            sampled.append([0] * (len(e.prompt) - shared) + e.sampled)
    prompt_ids, prompt_mask = left_pad(prompts, pad_id, device)
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    real = torch.zeros((len(rows), width), dtype=torch.long)
    model = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, s) in enumerate(zip(rows, sampled, strict=True)):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        real[i, :len(r)] = 1
        model[i, :len(s)] = torch.tensor(s, dtype=torch.long)
    count = lambda f: torch.tensor([f(e) for e in episodes], dtype=torch.long, device=device)  # noqa: E731
    cut = torch.tensor([e.cut for e in episodes], dtype=torch.bool, device=device)
    texts = ["\n".join(e.texts) for e in episodes]
    return Episodes(prompt_ids, prompt_mask, ids.to(device), real.to(device), cut, texts,
                    G, interrupted, model_mask=model.to(device), prompts=[e.prompt_text for e in episodes],
                    messages=[e.messages for e in episodes],
                    tool_calls=count(lambda e: e.calls), failed_calls=count(lambda e: e.failed),
                    turns=count(lambda e: e.turns), cut=cut, tool_outputs_cut=count(lambda e: e.outputs_cut),
                    environments=[e.env for e in episodes if e.env is not None])


# ---- what the trainer and the evaluator use ---------------------------------------------------------
TOOL_FORMATS = {"auto": None, "native": True, "hermes": False}

def reward_field_names(runner: EpisodeRunner | None) -> tuple[str, ...]:
    """What the rewards get of the rollout beside the rows' columns (Rollout.reward_fields, Episodes' with `runner`):
    what a reward's parameters may name that no data column gives."""
    if runner is None:
        return ("completion_ids",)
    return ("completion_ids", "messages", *(("environments",) if runner.environment_factory is not None else ()))


@dataclass
class EpisodeRunner:
    """The episode settings of a config (rollout.tools, env._target_, rollout.max_tool_calls, ...), resolved:
    `from_config` gives None when neither tools nor an environment is set (rollouts stay single-turn)."""

    tools: list[Callable]
    environment_factory: Callable | None
    max_tool_calls: int
    tool_timeout_s: float | None
    tool_format: str = "auto"
    call_opener: str = ""
    tool_output_max_chars: int | None = None
    environment_timeout_s: float | None = None
    environment_class: type | None = None  # what environment_factory builds (it may be a function)
    _formats: dict = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: Config) -> EpisodeRunner | None:
        """Imports every tool and the environment class, so a bad one fails in one line before the model loads."""
        roll, dotted, target = cfg.rollout, cfg.rollout.tools, cfg.env._target_
        if not dotted and target is None:
            return None
        tools = [import_object(d, f"rollout.tools[{i}]") for i, d in enumerate(dotted)]
        factory = import_object(target, "env._target_") if target is not None else None  # a class, or a function
        kind = environment_class(target, timeout_s=cfg.env.timeout_s) if target is not None else None
        # a tool without type hints or docstring, or two of one name, are refused now, not at the first call
        names = [make_tool(fn).name for fn in [*tools, *environment_functions(kind).values()]]
        if twice := sorted({name for name in names if names.count(name) > 1}):
            raise ConfigError(f"rollout.tools and the environment's methods offer {' and '.join(twice)} twice; every "
                              "tool needs its own name: drop one from rollout.tools or rename one")
        return cls(tools, factory, roll.max_tool_calls, roll.tool_timeout_s, roll.tool_format, roll.call_opener,
                   roll.tool_output_max_chars, cfg.env.timeout_s, kind)

    def format_for(self, tokenizer) -> ToolFormat:
        """How `tokenizer` shows the tools; ConfigError for rollout.tool_format=native on a template without
        tool support, or a template episodes cannot use (tools.ToolFormat)."""
        key = id(tokenizer)
        if key not in self._formats:
            if self.tool_format == "native" and not supports_tools(tokenizer):
                raise ConfigError("rollout.tool_format=native is invalid: the chat template of "
                                  f"{tokenizer.name_or_path} renders no tools (a tool's schema, a call and its result "
                                  "must all show); use rollout.tool_format=auto or hermes (the tools described in the "
                                  "system turn)")
            self._formats[key] = ToolFormat(tokenizer, native=TOOL_FORMATS[self.tool_format], opener=self.call_opener)
        return self._formats[key]

    def setup(self, tokenizer, context_length: int | None) -> EpisodeSetup:
        """These settings for a model's `tokenizer` and `context_length`: `.run(engine, rows, G, sampling, stop)`
        runs its episodes (ConfigError as `format_for`)."""
        return EpisodeSetup(self.format_for(tokenizer), self.max_tool_calls, context_length, self.tools,
                            self.environment_factory, self.tool_timeout_s, self.tool_output_max_chars,
                            self.environment_timeout_s)


def check_before_model_load(cfg: Config) -> None:
    """What an episode run would meet only once the model has loaded: a bad tool or environment class
    (EpisodeRunner.from_config), a chat template that cannot show the tools as rollout.tool_format asks, and an
    environment that cannot be built or reset on the run's first row (UserCodeError, here a ConfigError)."""
    from grpo_cli.model.loading import load_tokenizer
    from grpo_cli.tasks.sources import PromptSampler, load_rows

    runner = EpisodeRunner.from_config(cfg)
    if runner is None:
        return
    runner.format_for(load_tokenizer(cfg.model.name_or_path, cfg.model.trust_remote_code,
                                     cfg.rollout.chat_template_kwargs))
    if runner.environment_factory is None:
        return
    rows = load_rows(cfg.data, split="train", seed=cfg.trainer.seed)
    first = PromptSampler(rows, cfg.data.prompts_per_step, cfg.trainer.seed).batch(0)[0]
    try:
        timeout_s = runner.environment_timeout_s
        reset_environment(new_environment(runner.environment_factory, timeout_s=timeout_s), first, timeout_s=timeout_s)
    except UserCodeError as err:
        raise ConfigError(f"env._target_={cfg.env._target_} fails on the run's first row, before the model loads: "
                          f"{err}") from None
