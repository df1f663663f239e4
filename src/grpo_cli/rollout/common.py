"""What every engine shares: prompt encoding, the Rollout record, padding, masks, the stop hook, the sampling
record (SamplingParams) and stop strings."""

from __future__ import annotations

import bisect
import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from grpo_cli.base.registry import Registry
from grpo_cli.config.schema import RolloutConfig
from grpo_cli.rollout.inference_copy import merge_obstacle
from grpo_cli.rollout.rows import PAD_TOKEN, per_group, per_row, per_token, row_dataclass
from grpo_cli.rollout.rows import join as join_rows
from grpo_cli.rollout.rows import select as select_rows

if TYPE_CHECKING:
    from transformers import PreTrainedModel

StopFn = Callable[[], bool]
# rollout.engine: name -> an Engine class (anything with `from_config(cfg_rollout, lm, max_prompt_tokens)`)
ENGINES = Registry("rollout engine", key="rollout.engine")


@row_dataclass
class Rollout:
    """G completions for each of P prompts; completion row i belongs to prompt i // G. What each field holds per row
    is declared once (rollout/rows.py), so `select_groups` and `join` carry every field, a subclass's too."""

    prompt_ids: torch.Tensor = per_group(pad=PAD_TOKEN)  # [P, Lp] left-padded, one row per prompt (shared by its G)
    prompt_mask: torch.Tensor = per_group()              # [P, Lp]
    completion_ids: torch.Tensor = per_token(pad=PAD_TOKEN)  # [N, T] right-padded
    completion_mask: torch.Tensor = per_token()   # [N, T] 1 on real tokens, through EOS or a stop string's last token
    truncated: torch.Tensor = per_row()           # [N] bool: hit max_new_tokens without EOS or a stop string
    texts: list[str] = per_row()
    group_size: int
    interrupted: bool = False      # the caller's stop() fired during generation: partial, to be discarded
    # [N, T] the engine's own log-prob of each sampled token (vllm)
    sampler_logprobs: torch.Tensor | None = per_token(default=None)
    # [N, T] the reference policy's (the frozen base's) log-prob of each completion token, where the generator
    # computed it (rollout.placement=worker beside a trainer on the same CPU: rollout/worker.py); else the trainer does
    ref_logprobs: torch.Tensor | None = per_token(default=None)

    def select_groups(self, groups: list[int]) -> Rollout:
        """The rollout of the given prompt groups, in that order (each with its G rows)."""
        G = self.group_size
        return select_rows(self, [g * G + i for g in groups for i in range(G)], groups)

    @staticmethod
    def join(rollouts: list[Rollout], pad_token_id: int) -> Rollout:
        """One rollout of the given ones' groups, in order (prompts left-padded, completions right-padded)."""
        return join_rows(rollouts, pad_token_id)

    # ---- what a kind of rollout says of its rows (an episode says more: episodes.Episodes) ------------------
    def loss_mask(self) -> torch.Tensor:
        """The tokens that the loss, the ratio, the KL, the entropy and every token count see: those the model
        sampled, which of a single-turn completion are all its real tokens (its completion_mask)."""
        return self.completion_mask

    def prompt_texts(self, rendered: list[str]) -> list[str]:
        """The prompt text of each completion row, given each group's `rendered` prompt."""
        return [text for text in rendered for _ in range(self.group_size)]

    def reward_fields(self) -> dict[str, list]:
        """What rewards receive of the rollout beside the rows' fields (TRL's names; rewards.reward_arguments says
        which function gets which): `completion_ids`, each completion's tokens."""
        real = zip(self.completion_ids, self.completion_mask, strict=True)
        return {"completion_ids": [row[mask.bool()].tolist() for row, mask in real]}

    def metrics(self) -> dict[str, float]:
        """The step's metrics of this kind of rollout (logged as episodes/NAME): none of a single turn."""
        return {}

    def sample_fields(self, i: int) -> dict:
        """What samples.jsonl shows of row `i` beside its completion: nothing more of a single turn."""
        return {}

    def tool_use(self) -> list[tuple[int, int]]:
        """(tool calls made, of those failed) per row: none in a single turn."""
        return []


@dataclass
class Generation:
    """One step's completions on this rank, not yet scored."""

    rollout: Rollout
    rows: list[dict]                 # the data row of each prompt
    prompts: list[str]               # the prompt text of each completion (G per prompt)
    stats: dict                      # generation timing and prompt counts, for the metrics


DRAW_SEED = 7_919  # round d of a step (algo.filter_groups) samples with the step's seed + d * DRAW_SEED


def sampling_seed(seed: int, step: int, rank: int, draw: int = 0) -> int:
    """The seed a step's sampling starts from: (trainer.seed, step, rank, draw) alone decide it, so that resume is
    exact and a rollout worker samples what the training process would."""
    return seed * 100_003 + step * 1_009 + rank + draw * DRAW_SEED


def left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


def eos_ids(model, tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    configured = getattr(model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return sorted(i for i in ids if i is not None)


def completion_masks(completion_ids: torch.Tensor, eos: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask = 1 up to and including the first EOS; truncated = no EOS at all."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos, device=completion_ids.device))
    seen_before = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
    return (~seen_before).long(), ~is_eos.any(dim=1)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids of a left-padded batch: 0 at each row's first real token."""
    return (mask.cumsum(dim=1) - 1).clamp(min=0)


def stop_string_ends(tokenizer, completion: torch.Tensor, lengths: torch.Tensor,
                     stop_strings: Sequence[str]) -> torch.Tensor:
    """Per row, how many of its first `lengths` tokens it keeps when it ends at its first stop string: up to and
    including the token whose text completes the first occurrence; 0 where no stop string occurs."""
    ends = []
    for row, length in zip(completion.tolist(), lengths.tolist(), strict=True):
        def holds_a_stop(n: int, row=row) -> bool:
            text = tokenizer.decode(row[:n])
            return any(s in text for s in stop_strings)

        ends.append(bisect.bisect_left(range(length + 1), True, key=holds_a_stop) if holds_a_stop(length) else 0)
    return torch.tensor(ends, dtype=torch.long, device=completion.device)


def finish_rollout(tokenizer, eos: list[int], prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                   completion: torch.Tensor, num_generations: int, interrupted: bool,
                   stop_strings: Sequence[str] = ()) -> Rollout:
    """Masks, padding after EOS (or after a stop string's last token), texts: the part of a Rollout every engine
    builds the same way."""
    cmask, truncated = completion_masks(completion, eos)
    if stop_strings:
        ends = stop_string_ends(tokenizer, completion, cmask.sum(dim=1), stop_strings)
        stopped = ends > 0
        within = torch.arange(completion.shape[1], device=completion.device) < ends[:, None]
        cmask = torch.where(stopped[:, None], within.long(), cmask)
        truncated = truncated & ~stopped
    completion = torch.where(cmask.bool(), completion, torch.full_like(completion, tokenizer.pad_token_id))
    texts = tokenizer.batch_decode(completion, skip_special_tokens=True)
    return Rollout(prompt_ids, prompt_mask, completion, cmask, truncated, texts, num_generations, interrupted)


def hf_model(model) -> PreTrainedModel:
    """The transformers model under a peft wrapper (the LoRA layers stay injected in it), or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def cache_kwarg(model) -> str:
    """The cache argument of the model's forward/generate: `cache` in the transformers versions that have it
    (older ones know only `past_key_values`, newer ones warn on it)."""
    params = inspect.signature(type(hf_model(model)).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out):
    cache = out.get("cache")
    return cache if cache is not None else out.get("past_key_values")


def stop_criteria(stop: StopFn | None, stop_strings: Sequence[str] = (), tokenizer=None, prompt_width: int = 0):
    """A transformers StoppingCriteriaList that ends every row once `stop()` is true (polled each decode step),
    and remembers that it fired, and ends a row at the first of `stop_strings` in its completion (the tokens
    after `prompt_width`; finish_rollout cuts the mask at the same token); None when there is nothing to do."""
    from transformers import StoppingCriteria, StoppingCriteriaList, StopStringCriteria

    class InCompletion(StopStringCriteria):
        """transformers' stop-string matcher on the completion only: a stop string that begins in the prompt
        must not end a completion."""

        def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
            return super().__call__(input_ids[:, prompt_width:], scores, **kwargs)

    criteria = StoppingCriteriaList([InCompletion(tokenizer, list(stop_strings))] if stop_strings else [])
    if stop is None:
        return criteria or None, lambda: False

    asked: StopFn = stop  # not None from here: the criterion's method cannot see the check above

    class StopWhenAsked(StoppingCriteria):
        fired = False

        def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
            if not self.fired and asked():
                self.fired = True
            # a bool tensor: transformers annotates it with the legacy BoolTensor type, which torch.full never returns
            return cast(torch.BoolTensor,
                        torch.full((input_ids.shape[0],), self.fired, dtype=torch.bool, device=input_ids.device))

    criterion = StopWhenAsked()
    criteria.append(criterion)
    return criteria, lambda: criterion.fired


def prefill(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, **forward_args):
    """One forward over the P prompts; returns (logits at each prompt's last position [P, 1, V], KV cache).
    Gradients flow through the cache when grad is enabled, so G completions can share one prompt pass.
    `forward_args`: more for the model's forward (peft's adapter_names: each prompt's adapter)."""
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions(prompt_mask),
                use_cache=True, logits_to_keep=1, **forward_args)
    return out.logits, output_cache(out)


class Engine:
    """The rollout seam: everything that samples completions for the trainer and the evaluator.

    `generate` returns G completions per prompt (rows g*G .. g*G+G-1 share prompt g), sampled from the
    global torch RNG (the caller seeds it) as `sampling` (a SamplingParams) says (greedy ignores all but the
    lengths and `stop_strings`), each ended at EOS or at its first stop string, polling `stop()` at every decode
    step; `SamplingParams.of(cfg.rollout)` is the sampling of a config; `update_begins()` is called before
    the trainer's update and `policy_changed()` after every optimizer step that changed the policy's weights;
    `close()` frees what the engine holds. Log-probs for the loss never come from an engine: the trainer
    recomputes them, so an engine may sample with other numerics (merged bf16 weights, CUDA graphs) without
    biasing the update.
    """

    name = "base"
    compile_s = 0.0  # seconds spent compiling so far (0 for engines that do not compile)
    sync_s = 0.0     # seconds the last generate spent bringing the updated policy in (0 where nothing is copied)

    def __init__(self, model, tokenizer, device=None):
        self.model, self.tokenizer, self.device = model, tokenizer, device

    @classmethod
    def from_config(cls, cfg_rollout: RolloutConfig, lm, max_prompt_tokens: int | None = None) -> Engine:
        """The engine for `lm` (a models.LoadedModel: model, tokenizer, device, dtype) under the `rollout`
        section; an engine with options of its own reads them from `cfg_rollout` here."""
        return cls(lm.model, lm.tokenizer, lm.device)

    def generate(self, prompt_ids: list[list[int]], num_generations: int, sampling: SamplingParams,
                 stop: StopFn | None = None) -> Rollout:
        raise NotImplementedError

    def packed_models(self) -> list[tuple[torch.nn.Module, tuple[str, ...]]]:
        """Models of the engine's own (beside the policy) whose prepacked weights it multiplies through, with the
        directions it packs (prepack.pending_bytes): none here; an inference copy's, forward."""
        return []

    def update_begins(self) -> None:
        """The trainer is about to update the policy: what the engine rebuilds after `policy_changed()` anyway may
        be let go now, so the update has that memory (the `merged` engine's copy on the CPU). Nothing here."""

    def policy_changed(self) -> None:
        """The policy's trainable weights changed (an optimizer step, a loaded checkpoint)."""

    def close(self) -> None:
        """Free what the engine holds; it is not used afterwards."""


@ENGINES.register("auto")
class AutoEngine:
    """`rollout.engine=auto`: `compiled` on CUDA (where it pays), `merged` on the CPU, `hf` for a quantized or
    sharded base and for an adapter the inference copy cannot merge (both other engines generate from merged plain
    weights)."""

    @staticmethod
    def from_config(cfg_rollout, lm, max_prompt_tokens: int | None = None) -> Engine:
        name = "compiled" if lm.device.type == "cuda" else "merged"
        if getattr(lm, "quantization", None) is not None or getattr(lm, "sharded", False) or (
                hasattr(lm.model, "get_base_model") and merge_obstacle(lm.model)):
            name = "hf"  # no plain weights to merge into, or an adapter (DoRA, modules_to_save) with no plain merge
        return ENGINES[name].from_config(cfg_rollout, lm, max_prompt_tokens)


def sampling_kwargs(greedy: bool = False, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                    min_p: float = 0.0, repetition_penalty: float = 1.0, *, device: torch.device | None = None,
                    draw=None) -> dict:
    """transformers' generate arguments for our sampling, each one given even when off, so that a model's own
    generation_config (a hub model's top_k=20 or repetition_penalty) never adds to it. Greedy is the argmax of
    the model's distribution, unpenalised.

    On the CPU the draw itself is `GumbelSample`'s: transformers' own warpers (temperature, top_k, top_p, min_p, in
    generate's order) then the argmax of scores plus Gumbel noise, the same distribution as generate's
    `torch.multinomial`, whose CPU kernel draws an exponential per vocabulary entry: a few times slower at a 49k
    vocabulary (docs/results/step-phases.md). `draw`: a processor that draws in GumbelSample's place, on any device
    (rollout.shared's: each sweep job's rows from its own generator)."""
    if greedy:
        return {"do_sample": False, "repetition_penalty": 1.0}
    if draw is None and (device is None or device.type != "cpu"):
        return {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k or 0,
                "min_p": min_p or None, "repetition_penalty": repetition_penalty}
    from transformers import (
        LogitsProcessor,
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers: list[LogitsProcessor] = [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    warpers += [MinPLogitsWarper(min_p)] if min_p else []
    return {"do_sample": False, "repetition_penalty": repetition_penalty,
            "logits_processor": LogitsProcessorList([*warpers, draw or GumbelSample()])}


class GumbelSample:
    """A transformers logits processor, last in the list of a `do_sample=False` generate: `scores + g` with `g`
    standard Gumbel noise, so that generate's argmax is a draw from `softmax(scores)` (the Gumbel-max trick), from
    the global torch RNG."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        u = torch.rand_like(scores).clamp_(min=torch.finfo(scores.dtype).tiny)
        return scores - u.log_().neg_().log_()


ESCAPES = {"\\n": "\n", "\\t": "\t", "\\r": "\r", "\\\\": "\\"}


def unescape(text: str) -> str:
    """`\\n`, `\\t`, `\\r` and `\\\\` as the command line can type them (Hydra keeps the backslash) read as
    newline, tab, carriage return and one backslash."""
    return re.sub(r"\\[ntr\\]", lambda m: ESCAPES[m.group()], text)


@dataclass(frozen=True)
class SamplingParams:
    """How an engine samples each completion: built once from the `rollout` section (`of`), given whole to
    `Engine.generate` and to the episode loop; a variant (grpo-eval's greedy pass, an episode's turn) is a
    `dataclasses.replace` of it. Each option at its default changes nothing (transformers' meanings)."""

    max_new_tokens: int               # tokens per completion at most (an episode's: all its turns together)
    min_new_tokens: int = 0           # tokens before EOS may end a completion
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    greedy: bool = False              # the argmax, unpenalised: every option above but the lengths is ignored
    stop_strings: tuple[str, ...] = ()  # a completion ends at the first of these, which stays in it

    @classmethod
    def of(cls, cfg_rollout: RolloutConfig) -> SamplingParams:
        """The sampling of the `rollout` section (null = off; `rollout.stop` with its escapes read)."""
        return cls(max_new_tokens=cfg_rollout.max_new_tokens, min_new_tokens=cfg_rollout.min_new_tokens,
                   temperature=cfg_rollout.temperature, top_p=cfg_rollout.top_p, top_k=cfg_rollout.top_k or 0,
                   min_p=cfg_rollout.min_p or 0.0, repetition_penalty=cfg_rollout.repetition_penalty,
                   stop_strings=tuple(unescape(s) for s in cfg_rollout.stop))

    def generate_kwargs(self, device: torch.device | None) -> dict:
        """transformers' generate arguments of this sampling on `device` (`sampling_kwargs`), the lengths with them."""
        return {"max_new_tokens": self.max_new_tokens, "min_new_tokens": self.min_new_tokens,
                **sampling_kwargs(self.greedy, self.temperature, self.top_p, self.top_k, self.min_p,
                                  self.repetition_penalty, device=device)}
