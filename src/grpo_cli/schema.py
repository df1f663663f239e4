"""Every config option, declared once: what it accepts, a one-line help, and, for the sections of the root
config (algo, rollout, trainer, eval), its default.

Validation (`check_options`), the option list of `grpo-train --help` (`options_help`) and the README's
configuration table (`options_markdown`) are all read from `OPTIONS`. The keys of the config groups (model,
data, optimizer, logger, reward) take their values from the group option picked (`conf/GROUP/OPTION.yaml`);
the root sections take theirs from here (`root_defaults`, stored in Hydra's ConfigStore as `grpo_defaults`,
which conf/config.yaml composes). Rules that relate several keys live in config.py.

Choices of plug-in kinds are read from their registries when a value is checked, so this module imports
nothing heavy and lists no engine, optimizer, logger or loss type itself.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from grpo_cli.errors import ConfigError

FROM_GROUP = object()  # the default is the picked group option's value
ABSENT = object()


def shown(value) -> str:
    """A value as YAML spells it: true, false, null."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)


def fail(key: str, value, allowed: str):
    raise ConfigError(f"{key}={shown(value)} is invalid: {allowed}")


@dataclass(frozen=True)
class Rule:
    """A test of one value. `allowed` says what passes (a callable for a registry's names, read when asked);
    the error line says `verb allowed`, or `failure` where that reads better."""

    test: Callable[[object], bool]
    allowed: str | Callable[[], str]
    verb: str = "needs"
    failure: str = ""

    def describe(self) -> str:
        return self.allowed() if callable(self.allowed) else self.allowed

    def message(self, name: str) -> str:
        """`{name}` in the text becomes the key's last part: `needs 0 < clip_eps < 1`."""
        return (self.failure or f"{self.verb} {self.describe()}").replace("{name}", name)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def integer(minimum: int | None = None) -> Rule:
    if minimum is None:
        return Rule(is_int, "an integer")
    return Rule(lambda v: is_int(v) and v >= minimum, f"an integer >= {minimum}")


def number(low: float | None = None, high: float | None = None, *, low_open: bool = False,
           high_open: bool = False) -> Rule:
    """A finite number within the bounds given; `*_open` leaves the bound itself out."""
    def test(v) -> bool:
        return is_number(v) and (low is None or (v > low if low_open else v >= low)) and (
            high is None or (v < high if high_open else v <= high))

    if low is None and high is None:
        return Rule(test, "a finite number")
    if high is None:
        return Rule(test, f"{{name}} {'>' if low_open else '>='} {low}")
    return Rule(test, f"{low} {'<' if low_open else '<='} {{name}} {'<' if high_open else '<='} {high}")


def one_of(*choices, names: Callable[[], tuple] | None = None) -> Rule:
    """One of `choices`, or of the names `names()` returns when asked (a plug-in registry)."""
    def current() -> tuple:
        return names() if names else choices

    return Rule(lambda v: any(v == c and type(v) is type(c) for c in current()),
                lambda: ", ".join(shown(c) for c in current()), verb="use one of")


BOOLEAN = Rule(lambda v: isinstance(v, bool), "true or false", verb="use")
AUTO_OR_BOOLEAN = Rule(lambda v: v == "auto" or isinstance(v, bool), "auto, true or false", verb="use")
TEXT = Rule(lambda v: isinstance(v, str) and bool(v.strip()), "a non-empty string")
ANY_TEXT = Rule(lambda v: isinstance(v, str), "a string")
MAPPING = Rule(lambda v: isinstance(v, DictConfig), "a mapping")
TEXT_LIST = Rule(lambda v: isinstance(v, ListConfig) and all(isinstance(t, str) for t in v), "a list of strings")
STOP_STRINGS = Rule(lambda v: isinstance(v, ListConfig) and all(isinstance(t, str) and t for t in v),
                   "a list of non-empty strings",
                   failure="""needs a list of non-empty strings, e.g. 'rollout.stop=["</answer>"]' (quoted for the shell)""")


def registry_names(module: str, attribute: str, *, auto: bool = False) -> Callable[[], tuple]:
    """The names registered in `module.attribute` (a Registry or any dict/sequence of names), read when asked."""
    def names() -> tuple:
        found = tuple(str(n) for n in getattr(importlib.import_module(module), attribute))
        return ("auto", *(n for n in found if n != "auto")) if auto else found

    return names


def _is_device(value) -> bool:
    return isinstance(value, str) and bool(re.fullmatch(r"auto|cpu|cuda(:\d+)?", value))


def _cuda_visible(value) -> bool:
    if not str(value).startswith("cuda"):
        return True
    import torch

    return torch.cuda.is_available()


def _existing_path(value) -> bool:
    return Path(str(value)).expanduser().exists()


def _data_path(value) -> bool:
    path = str(value)
    return Path(path).expanduser().exists() or (glob.has_magic(path) and bool(glob.glob(str(Path(path).expanduser()))))


def _adapter_dir(value) -> bool:
    return (Path(str(value)).expanduser() / "adapter_config.json").is_file()


def _target_modules(value) -> bool:
    return (isinstance(value, str) and bool(value)) or (
        isinstance(value, ListConfig) and len(value) > 0 and all(isinstance(t, str) and t for t in value))


def _betas(value) -> bool:
    return isinstance(value, ListConfig) and len(value) == 2 and all(is_number(b) and 0 <= b < 1 for b in value)


DEVICE = (Rule(_is_device, "auto, cpu, cuda or cuda:N", verb="use"),
          Rule(_cuda_visible, "", failure="no CUDA device is visible here; use trainer.device=auto or cpu"))
RESUME = Rule(lambda v: v == "auto" or _existing_path(v), "auto or a checkpoint / run dir",
              failure="no such checkpoint or run dir; use auto (with hydra.run.dir=RUN_DIR) or an existing path")
DATA_PATH = Rule(_data_path, "an existing file, glob or dir",
                 failure="no such file, glob match or dir; give a .jsonl, .json, .parquet, .csv or .arrow file, a glob of "
                 "them, or a save_to_disk dir")
ADAPTER = Rule(_adapter_dir, "a run's adapter/ dir",
               failure="holds no adapter_config.json; point it at a run's adapter/ folder")
TARGET_MODULES = Rule(_target_modules, "all-linear or [names]",
                      failure="give all-linear or a list of module names, e.g. [q_proj, v_proj]")
BETAS = Rule(_betas, "[beta1, beta2] in [0, 1)", failure="needs [beta1, beta2], each in [0, 1)")
DOTTED_PATH = Rule(lambda v: isinstance(v, str) and "." in v, "pkg.module.fn",
                   failure="give the dotted path of a callable, e.g. pkg.module.fn")
DOTTED_PATHS = Rule(lambda v: isinstance(v, ListConfig) and all(isinstance(t, str) and "." in t for t in v),
                   "a list of pkg.module.fn", failure="needs a list of dotted paths of callables, e.g. "
                   "'rollout.tools=[grpo_cli.calculator.calculator]'")
MODEL_NAME = Rule(TEXT.test, "hub id, dir, embedded:NAME, tiny-random",
                  failure="give a hub id, a local directory, embedded:NAME or tiny-random")


@dataclass(frozen=True)
class Option:
    """One config key. `nullable`: null is allowed too; `optional`: only some group options have the key;
    `free`: what lies below the key (a mapping) is the user's (a reward's options, a generator's arguments)."""

    key: str
    check: Rule | tuple[Rule, ...]
    help: str
    default: object = FROM_GROUP
    nullable: bool = False
    optional: bool = False
    free: bool = False
    row: str = ""  # options of one section with the same row share a line of the README table

    @property
    def rules(self) -> tuple[Rule, ...]:
        return self.check if isinstance(self.check, tuple) else (self.check,)

    def allowed(self) -> str:
        text = self.rules[0].describe()
        return f"{text}, or null" if self.nullable else text


OPTIONS: tuple[Option, ...] = (
    Option("plugins", TEXT_LIST, "your modules to import first: what they register becomes a choice", []),
    # ---- algo: the GRPO objective
    Option("algo.num_generations", integer(2), "G: completions per prompt (the group)", 8),
    Option("algo.beta", number(0), "KL coefficient; 0 skips the reference pass", 0.04),
    Option("algo.clip_eps", number(0, 1, low_open=True, high_open=True), "eps_low of the clipped ratio", 0.2, row="clip"),
    Option("algo.clip_eps_high", number(0, 1, low_open=True, high_open=True), "eps_high; null = clip_eps", None,
      nullable=True, row="clip"),
    Option("algo.adv_eps", number(0, 1, low_open=True, high_open=True),
      "stability constant in the advantage denominator (1e-4 is usual)", 1.0e-4),
    Option("algo.scale_rewards", one_of("group", "batch", "none"),
      "advantages divided by the reward std of the group, the batch, or not (Dr. GRPO)", "group"),
    Option("algo.loss_type", one_of(names=registry_names("grpo_cli.algorithm", "LOSS_TYPES")),
      "how token losses add up (see Loss types); TRL's name, kept as an alias of algo.aggregation", "grpo"),
    # ---- algo: the objective and aggregation menu (docs/algorithm.md, sections 1, 3 and 4)
    Option("algo.aggregation", one_of(names=registry_names("grpo_cli.algorithm", "LOSS_TYPES")),
      "how token losses add up: the same choices as algo.loss_type, which it overrides when not grpo", "grpo"),
    Option("algo.objective", one_of(names=registry_names("grpo_cli.algorithm", "OBJECTIVES")),
      "the per-token policy loss: grpo (clipped surrogate), cispo, sapo, luspo, vespo", "grpo"),
    Option("algo.advantage", one_of(names=registry_names("grpo_cli.algorithm", "ADVANTAGES")),
      "advantage estimator: grpo (group z-scores), rloo, reinforce_plus_plus_baseline, opo, grpo_passk", "grpo"),
    Option("algo.delta", number(1, low_open=True), "two-sided clipping: the ratio capped at delta (INTELLECT-2; "
      "> 1 + clip_eps_high); null = off", None, nullable=True),
    Option("algo.cispo_max_ratio", number(0, low_open=True), "cispo: cap of the detached ratio (TRL's epsilon_high "
      "for cispo)", 5.0),
    Option("algo.sapo_temperature_pos", number(0, low_open=True), "sapo: gate temperature where A > 0", 1.0, row="sapo"),
    Option("algo.sapo_temperature_neg", number(0, low_open=True), "sapo: gate temperature where A <= 0", 1.05, row="sapo"),
    Option("algo.vespo_k_pos", number(0), "vespo: gamma shape k where A >= 0", 2.0, row="vespo"),
    Option("algo.vespo_lambda_pos", number(0), "vespo: gamma rate lambda where A >= 0", 3.0, row="vespo"),
    Option("algo.vespo_k_neg", number(0), "vespo: gamma shape k where A < 0", 3.0, row="vespo"),
    Option("algo.vespo_lambda_neg", number(0), "vespo: gamma rate lambda where A < 0", 2.0, row="vespo"),
    Option("algo.kl_estimator", one_of("k3", "k1", "k2", "abs", "low_var_kl"),
      "per-token KL estimate in the beta term (verl's names); k3 is the contract's", "k3"),
    Option("algo.use_bias_correction_kl", BOOLEAN, "multiply the KL term by the importance ratio (TRL's default is "
      "true; ours false: plain k3)", False),
    Option("algo.off_policy_mask_threshold", number(0), "drop a sequence with A < 0 whose mean old - logp exceeds "
      "this (DeepSeek-V3.2); null = off", None, nullable=True),
    Option("algo.top_entropy_quantile", number(0, 1, low_open=True), "policy loss on the highest-entropy share of "
      "each micro-batch's tokens only; 1 = all", 1.0),
    Option("algo.entropy_coef", number(0), "entropy bonus: loss - coef * token-mean entropy; the start value when "
      "entropy_target is set", 0.0, row="entropy"),
    Option("algo.entropy_target", number(0), "adaptive entropy bonus: coef rises by entropy_coef_delta per update "
      "while entropy <= target, falls otherwise; null = fixed coef", None, nullable=True, row="entropy"),
    Option("algo.entropy_coef_delta", number(0, low_open=True), "step of the adaptive entropy coefficient (within "
      "[0, 1])", 0.005, row="entropy"),
    Option("algo.filter_groups", BOOLEAN, "dynamic sampling (DAPO): drop groups whose rewards all agree and draw "
      "more prompts until data.prompts_per_step groups have signal", False, row="filter"),
    Option("algo.filter_max_draws", integer(1), "generation rounds per step at most with filter_groups; at the "
      "bound the step trains on the groups it has", 4, row="filter"),
    Option("algo.ratio_level", one_of("token", "sequence"), "importance ratio per token, or per sequence (GSPO)", "token"),
    Option("algo.mini_batches", integer(1), "optimizer updates per rollout batch, on whole groups; 1 (and "
      "num_iterations 1) = on-policy, clipping never acts", 1, row="updates"),
    Option("algo.num_iterations", integer(1), "mu: passes over the mini-batches of one rollout batch", 1, row="updates"),
    Option("algo.mask_truncated", BOOLEAN, "leave completions that hit max_new_tokens without EOS out of the loss",
      False),
    Option("algo.check", BOOLEAN, "live invariant checks (cheap)", True),
    # ---- algo: the sampler correction (TRL's vllm_importance_sampling_*; docs/usage.md "vLLM")
    Option("algo.sampler_correction", one_of("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
      "weigh each token's policy term by exp(trainer - sampler log-prob), per token or summed per sequence, "
      "truncated to or masked outside the clip bounds (rollout.engine=vllm)", "none"),
    Option("algo.sampler_clip_min", number(0), "lower bound of the sampler weight; null = none", None, nullable=True,
      row="sampler clip"),
    Option("algo.sampler_clip_max", number(0), "upper bound of the sampler weight; null = none", 3.0, nullable=True,
      row="sampler clip"),
    # ---- rollout: sampling the completions
    Option("rollout.max_new_tokens", integer(1), "tokens per completion at most", 64),
    Option("rollout.min_new_tokens", integer(0), "tokens before EOS may end a completion (<= max_new_tokens)", 0),
    Option("rollout.temperature", number(0, low_open=True), "sampling temperature", 1.0),
    Option("rollout.top_p", number(0, 1, low_open=True), "nucleus sampling mass; 1 = off (the loss's log-probs stay "
      "the full softmax)", 1.0),
    # ---- rollout: the sampling options TRL users expect (README "Sampling": what each does to the loss's log-probs)
    Option("rollout.top_k", integer(0), "sample among the k likeliest tokens only; 0/null = off (the loss's "
      "log-probs stay the full softmax)", 0, nullable=True, row="truncation"),
    Option("rollout.min_p", number(0, 1), "drop tokens below min_p x the likeliest one's probability; 0/null = off "
      "(the loss's log-probs stay the full softmax)", 0.0, nullable=True, row="truncation"),
    Option("rollout.repetition_penalty", number(0, low_open=True), "penalise tokens already in the prompt or "
      "completion (a logit l becomes l/p if l > 0, l*p if not); 1 = off (the loss's log-probs stay unpenalised)", 1.0, row="truncation"),
    Option("rollout.stop", STOP_STRINGS, "a completion ends at the first of these strings, which stays in it (and in "
      "the loss); \\n and \\t read as newline and tab", []),
    Option("rollout.engine", one_of(names=registry_names("grpo_cli.rollout", "ENGINES", auto=True)),
      "auto = compiled on CUDA, hf on the CPU", "auto"),
    Option("rollout.compile", AUTO_OR_BOOLEAN, "compiled engine: compile the decode step; auto = on CUDA, "
      "warn and go on if it fails; true = anywhere, fail if it fails", "auto"),
    # ---- rollout: tools and environments (multi-turn episodes; docs/usage.md "Tools and environments")
    Option("rollout.tools", DOTTED_PATHS, "tools the model may call: dotted paths of functions with type hints and "
      "a Google-style docstring, e.g. [grpo_cli.calculator.calculator]; [] and no env = single-turn", [], row="tools"),
    Option("rollout.max_tool_calls", integer(0), "tool calls an episode may run; a further call ends it", 4, row="tools"),
    Option("rollout.tool_timeout_s", number(0, low_open=True), "seconds a tool call may take; over it the model "
      "reads an error (null = no limit)", 10.0, nullable=True, row="tools"),
    Option("rollout.tool_format", one_of("auto", "native", "hermes"), "auto = the chat template's tool support "
      "where it has one, else hermes: the tools in the system turn, calls as <tool_call>{json}</tool_call>",
      "auto", row="tools"),
    Option("rollout.call_opener", ANY_TEXT, "text prefilled at the start of the first assistant turn (in the prompt, "
      "not trained), e.g. the opening of a call for a small model that never starts one alone", "", row="tools"),
    Option("env._target_", DOTTED_PATH, "an environment class (TRL's environment_factory): one per episode, "
      "reset(**row) returns a string or None, public methods are tools, optional get_reward(); null = none", None,
      nullable=True),
    # ---- rollout: the vllm engine (rollout.engine=vllm; README "vLLM", docs/usage.md "vLLM")
    Option("rollout.vllm_dtype", one_of("auto", "float32", "bfloat16", "float16"), "vllm engine: the dtype it "
      "samples in; auto = model.dtype", "auto", row="vllm"),
    Option("rollout.vllm_max_model_len", integer(1), "vllm engine: longest prompt + completion it serves; null = "
      "the model's context", None, nullable=True, row="vllm"),
    Option("rollout.vllm_gpu_memory_utilization", number(0, 1, low_open=True), "vllm engine on CUDA: the share of "
      "GPU memory it takes beside the trainer (weights and KV cache)", 0.3, row="vllm memory"),
    Option("rollout.vllm_kv_cache_gib", number(0, low_open=True), "vllm engine on the CPU: KV cache size in GiB",
      1.0, row="vllm memory"),
    Option("rollout.vllm_sync", one_of("merged", "lora"), "vllm engine: the policy after each update as merged "
      "weights reloaded in place, or as a LoRA request", "merged"),
    # ---- trainer: the loop, memory, checkpoints
    Option("trainer.max_steps", integer(1), "training steps (rollout batches)", 50),
    Option("trainer.seed", integer(0), "seed of sampling, data order and LoRA init", 0),
    Option("trainer.device", DEVICE, "auto = the first CUDA device, else the CPU", "auto"),
    Option("trainer.micro_batch_size", integer(1), "completions per forward/backward; null = a whole mini-batch",
      None, nullable=True),
    Option("trainer.max_grad_norm", number(0, low_open=True), "gradient clipping norm", 1.0),
    Option("trainer.logprob_chunk_size", integer(1), "token rows per log-softmax chunk (bounds memory); null = one "
      "pass", 1024, nullable=True),
    Option("trainer.gradient_checkpointing", BOOLEAN, "recompute activations in the backward (less memory, ~1/3 "
      "more compute)", False),
    Option("trainer.save_every", integer(0), "checkpoint every K steps; 0 = only the final adapter", 0, row="checkpoints"),
    Option("trainer.keep_last", integer(1), "checkpoints kept", 2, row="checkpoints"),
    Option("trainer.resume", RESUME, "auto (with hydra.run.dir=RUN_DIR) or a checkpoint / run dir path; a used "
      "run dir takes only auto or its own",
      None, nullable=True),
    Option("trainer.overwrite", BOOLEAN, "start over in a run dir that holds a run (deletes its records and "
      "checkpoints first)", False),
    Option("trainer.resume_allow_changes", TEXT_LIST, "keys (or sections) a resume may change on purpose, e.g. "
      "[trainer.max_steps,optimizer.lr]", []),
    Option("trainer.max_skipped", integer(1), "stop after this many non-finite updates in a row", 3),
    Option("trainer.log_samples_every", integer(0), "write sample completions every K steps; 0 = never", 10),
    Option("trainer.nproc", integer(1), "processes; > 1 relaunches under torchrun", 1),
    # ---- eval: held-out accuracy (grpo-eval, and during training)
    Option("eval.every", integer(0), "evaluate every K training steps; 0 = never (needs reward.accuracy)", 0),
    Option("eval.num_prompts", integer(1), "held-out prompts per evaluation", 50, row="held-out"),
    Option("eval.samples", integer(1), "k: pass@k and majority@k when > 1", 1, row="held-out"),
    Option("eval.temperature", number(0, low_open=True), "sampling temperature when samples > 1", 0.8, row="held-out"),
    Option("eval.max_new_tokens", integer(1), "tokens per completion at most", "${rollout.max_new_tokens}", row="held-out"),
    Option("eval.adapter", ADAPTER, "grpo-eval: a trained adapter dir; null = the base model", None, nullable=True),
    Option("eval.final", AUTO_OR_BOOLEAN, "greedy eval on the fixed held-out prompts after the last step "
      "(final_eval.json); auto = in a sweep when the data has a held-out split", "auto"),
    # ---- sweep: how a multirun's summary ranks its cells (sweep_cells.csv)
    Option("sweep.metric", one_of(names=registry_names("grpo_cli.sweep_summary", "RANK_METRICS", auto=True)),
      "the summary column cells are ranked by (higher is better); auto = final_eval_accuracy where every job "
      "has it, else mean_reward", "auto"),
    Option("sweep.seeds", Rule(lambda v: v == 1, "1", failure="averaging one trial over several seeds is not "
      "supported (hydra-optuna-sweeper runs exactly one job per trial); use 1 and sweep trainer.seed=0,1,2 "
      "with the basic sweeper, whose summary groups the seeds of a setting"), "seeds per Optuna trial (only 1 "
      "for now)", 1),
    # ---- model=NAME
    Option("model.name_or_path", MODEL_NAME, "hub id, local dir, embedded:NAME or tiny-random"),
    Option("model.trust_remote_code", BOOLEAN, "run a hub model's own code"),
    Option("model.lora.r", integer(1), "LoRA rank"),
    Option("model.lora.alpha", number(0, low_open=True), "LoRA scale is alpha / r (2 x r is usual)"),
    Option("model.lora.dropout", number(0, 1, high_open=True), "LoRA dropout"),
    Option("model.lora.target_modules", TARGET_MODULES, "modules that get adapters"),
    Option("model.tiny.hidden_size", integer(1), "tiny-random: width (a multiple of num_heads)", optional=True),
    Option("model.tiny.num_layers", integer(1), "tiny-random: layers", optional=True),
    Option("model.tiny.num_heads", integer(1), "tiny-random: attention heads", optional=True),
    Option("model.tiny.max_position_embeddings", integer(1), "tiny-random: context length", optional=True),
    Option("model.quantization", one_of("nf4", "fp4", "int8"), "QLoRA: load the frozen base in 4 bits (nf4, fp4) "
      "or 8 bits (int8) through bitsandbytes; null = unquantized", optional=True, nullable=True),
    Option("model.dtype", one_of("auto", "float32", "bfloat16", "float16"), "precision of the frozen base and its "
      "generation (LoRA weights, optimizer state, log-softmax and loss stay float32); auto = bfloat16 on CUDA, "
      "float32 on the CPU"),
    # ---- data=NAME
    Option("data.source", one_of(names=registry_names("grpo_cli.data", "SOURCES")), "where prompts come from (hf: a hub id or local "
      "files through `datasets`; jsonl: the same reader, named for a .jsonl data.path)"),
    Option("data.task", TEXT, "reasoning_gym: the generator", optional=True, row="reasoning_gym"),
    Option("data.task_args", MAPPING, "reasoning_gym: the generator's arguments", optional=True, free=True, row="reasoning_gym"),
    Option("data.low", integer(), "sums: smallest term", optional=True, row="generated"),
    Option("data.high", integer(), "sums: largest term (>= low)", optional=True, row="generated"),
    Option("data.operation", one_of("+", "*"), "sums: + (a + b), or * (a * b: the calculator recipe)", optional=True,
      row="generated"),
    Option("data.size", integer(1), "generated training prompts", optional=True, row="generated"),
    Option("data.eval_size", integer(1), "generated held-out prompts", optional=True, row="generated"),
    Option("data.question_suffix", ANY_TEXT, "appended to each question"),
    Option("data.system_prompt", ANY_TEXT, "system turn; null = the model's own default", nullable=True),
    Option("data.prompts_per_step", integer(1), "prompts per step (each sampled G times)"),
    Option("data.max_prompt_tokens", integer(1), "longest prompt in tokens"),
    Option("data.overlong", one_of("truncate", "drop"), "a longer prompt: cut from the left, or dropped"),
    Option("data.path", DATA_PATH, "training rows: .jsonl/.json/.parquet/.csv/.arrow file or glob, or a "
      "save_to_disk dir; null = the source's own", nullable=True),
    Option("data.eval_path", DATA_PATH, "held-out rows, as data.path; null = the source's own", nullable=True),
    Option("data.name", TEXT, "hf: a hub dataset id (data.path wins when both are set)", nullable=True, optional=True, row="hub"),
    Option("data.config", TEXT, "hf: the hub dataset's config (subset)", nullable=True, optional=True, row="hub"),
    Option("data.split", TEXT, "hf: the training split of data.name or of a saved DatasetDict", optional=True, row="hub"),
    Option("data.eval_split", TEXT, "hf: the held-out split of data.name or of a saved DatasetDict (or use "
      "data.eval_path)", nullable=True, optional=True, row="hub"),
    Option("data.prompt_column", TEXT, "hf, jsonl: the column of prompts (text or chat messages); prompt falls back "
      "to messages", optional=True, row="columns"),
    Option("data.answer_column", TEXT, "hf, jsonl: a column that reaches rewards as answer; null = every column "
      "under its own name", nullable=True, optional=True, row="columns"),
    # ---- optimizer=NAME
    Option("optimizer", MAPPING, "the common keys below and exactly the keys its builder (optim.OPTIMIZERS) reads",
      free=True),
    Option("optimizer.name", one_of(names=registry_names("grpo_cli.optim", "OPTIMIZERS")), "the torch optimizer"),
    Option("optimizer.lr", number(0, low_open=True), "learning rate (after warmup)"),
    Option("optimizer.weight_decay", number(0), "decoupled weight decay"),
    Option("optimizer.warmup_steps", integer(0), "linear warmup, in training steps"),
    Option("optimizer.schedule", one_of("constant", "linear", "cosine"), "learning rate after warmup"),
    Option("optimizer.betas", BETAS, "adamw: moment decay rates", optional=True, row="own"),
    Option("optimizer.momentum", number(0, 1, high_open=True), "sgd: momentum", optional=True, row="own"),
    Option("optimizer.nesterov", BOOLEAN, "sgd: Nesterov momentum (needs momentum > 0)", optional=True, row="own"),
    # ---- logger=NAME
    Option("logger.backend", one_of(names=registry_names("grpo_cli.tracking", "LOGGERS")), "where metrics go besides metrics.jsonl and the console"),
    Option("logger.wandb.mode", one_of(names=registry_names("grpo_cli.tracking", "WANDB_MODES")),
      "auto = online with credentials, else offline", optional=True),
    Option("logger.wandb.project", TEXT, "W&B project", optional=True),
    Option("logger.wandb.entity", TEXT, "W&B entity; null = yours", optional=True, nullable=True),
    Option("logger.wandb.name", TEXT, "run name; null = the overrides", optional=True, nullable=True),
    Option("logger.wandb.group", TEXT, "null = the recipe (and sweep dir)", optional=True, nullable=True),
    Option("logger.wandb.tags", TEXT_LIST, "W&B tags", optional=True),
    Option("logger.wandb.init_timeout", number(0, low_open=True), "seconds to reach the server, then offline",
      optional=True),
    Option("logger.wandb.finish_timeout", number(0, low_open=True), "seconds to upload at the end", optional=True),
    # ---- reward=NAME
    Option("reward.on_error", one_of("raise", "zero"), "a reward that raises: stop, or score 0 and count it"),
    Option("reward.aggregation", one_of("sum", "normalize_then_sum"), "the rewards' weighted sum, or each reward "
      "z-scored within its group first (GDPO); sum when left out (+reward.aggregation=... to set it)", optional=True),
    Option("reward.timeout_s", number(0, low_open=True), "seconds a reward call may take; over it is an error "
      "per on_error; null = no limit", nullable=True),
    Option("reward.accuracy", TEXT, "the 0/1 function of reward.functions that judges correctness", nullable=True),
    Option("reward.functions", MAPPING, "NAME: {_target_, weight, options...} per reward function", free=True),
    Option("reward.functions.*._target_", DOTTED_PATH, "dotted path of the function or class"),
    Option("reward.functions.*.weight", number(), "its weight in the summed reward (1 when left out)", optional=True),
    # ---- sweep: resuming a sweep, averaging an Optuna trial over seeds
)


# ---- typed views: what a component reads of a section, one field per option --------------------------
def section_options(section: str) -> tuple[Option, ...]:
    """The options directly under `section` (algo, rollout, trainer, eval, ...)."""
    return tuple(o for o in OPTIONS if o.key.rpartition(".")[0] == section and "*" not in o.key)


def _annotation(option: Option) -> object:
    default = option.default
    if default is FROM_GROUP or default is None or isinstance(default, str) and default.startswith("${"):
        return object
    return tuple if isinstance(default, list) else type(default)


@functools.cache
def view_type(section: str) -> type:
    """The dataclass of `section`'s options (AlgoOptions, ...), generated from OPTIONS: a field per option."""
    fields = [(o.key.rpartition(".")[2], _annotation(o)) for o in section_options(section)]
    return dataclasses.make_dataclass(f"{section.title()}Options", fields)


def view(cfg_section, section: str):
    """`cfg_section` (a config section, validated) as the typed view of `section`: each option's value there,
    else its declared default (an optional group key it lacks: None); lists as tuples. A view is returned as it
    is."""
    kind = view_type(section)
    if isinstance(cfg_section, kind):
        return cfg_section
    values = {}
    for option in section_options(section):
        name = option.key.rpartition(".")[2]
        value = OmegaConf.select(cfg_section, name, default=ABSENT) if isinstance(cfg_section, DictConfig) else \
            cfg_section.get(name, ABSENT)
        if value is ABSENT:
            value = None if option.default is FROM_GROUP else option.default
        if isinstance(value, (ListConfig, DictConfig)):
            value = OmegaConf.to_container(value, resolve=True)
        values[name] = tuple(value) if isinstance(value, list) else value
    return kind(**values)


def default_of(key: str) -> object:
    """The default `key` is declared with; ABSENT when it has none of its own (a group option's value)."""
    option = next((o for o in OPTIONS if o.key == key), None)
    return ABSENT if option is None or option.default is FROM_GROUP else option.default


def root_defaults() -> dict:
    """The root sections' defaults as nested dicts: stored as `grpo_defaults` for conf/config.yaml."""
    tree: dict = {}
    for option in OPTIONS:
        if option.default is not FROM_GROUP:
            *parents, leaf = option.key.split(".")
            node = tree
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = option.default
    return tree


def _expand(cfg: DictConfig, key: str) -> Iterator[str]:
    """The keys of `cfg` that `key` names: itself, or one per entry where a part is `*`."""
    head, star, tail = key.partition(".*.")
    if not star:
        yield key
        return
    entries = OmegaConf.select(cfg, head)
    for name in entries.keys() if isinstance(entries, DictConfig) else ():
        yield from _expand(cfg, f"{head}.{name}.{tail}")


def check_options(cfg: DictConfig) -> None:
    """Raise ConfigError, one line naming the key, the value and what is allowed, for the first value an
    option refuses, or for a key that no option declares."""
    for option in OPTIONS:
        for key in _expand(cfg, option.key):
            value = OmegaConf.select(cfg, key, default=ABSENT)
            if (value is ABSENT and option.optional) or (value is None and option.nullable):
                continue
            value = None if value is ABSENT else value
            for rule in option.rules:
                if not rule.test(value):
                    message = rule.message(key.rpartition(".")[2])
                    fail(key, value, f"{message}, or null" if option.nullable else message)
    for key, value in _undeclared(cfg, ""):
        fail(key, value, "no such option; `grpo-train --help` lists them")


def _matches(pattern: str, key: str, *, prefix: bool = False) -> bool:
    """`key` is the option key `pattern` (a `*` part matches any name), or with prefix=True lies above it."""
    wanted, parts = pattern.split("."), key.split(".")
    if len(parts) > len(wanted) or (not prefix and len(parts) != len(wanted)):
        return False
    return all(w in ("*", k) for w, k in zip(wanted, parts, strict=False))


def _undeclared(node: DictConfig, prefix: str) -> Iterator[tuple[str, object]]:
    """(key, value) for each key below `node` that no option declares, nor lies above one; below a `free`
    option everything is the user's (a reward's options, a generator's arguments)."""
    for name in node.keys():
        key, child = f"{prefix}{name}", OmegaConf.select(node, str(name))
        option = next((o for o in OPTIONS if _matches(o.key, key)), None)
        if option is not None and (option.free or not isinstance(child, DictConfig)):
            continue
        if isinstance(child, DictConfig) and any(_matches(o.key, key, prefix=True) for o in OPTIONS):
            yield from _undeclared(child, key + ".")
        elif option is None:
            yield key, OmegaConf.to_container(child) if isinstance(child, DictConfig) else child


def raw_value(cfg: DictConfig | dict, key: str) -> str:
    """The value of `key` in `cfg` (or in its unresolved container) as written (`${...}` unresolved), or "-" where
    the composition lacks it."""
    node = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=False)
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return "-"
        node = node[part]
    return ("{...}" if node else "{}") if isinstance(node, dict) else shown(node)


def _display_key(option: Option) -> str:
    return option.key.replace("*", "NAME")


def options_help(cfg: DictConfig) -> str:
    """The option list of --help: per section, one line per option (key, its value in `cfg`, help)."""
    lines, section = [], None
    written = OmegaConf.to_container(cfg, resolve=False)  # once: every compose resolves the --help text
    for option in OPTIONS:
        head = option.key.split(".")[0]
        if head != section:
            lines.append(f"  {head}:" if section is None else f"\n  {head}:")
            section = head
        value = raw_value(written, option.key) if "*" not in option.key else ""
        value = value if len(value) <= 24 else value[:21] + "..."
        lines.append(f"    {_display_key(option):<34} {value:<24} {option.help}")
    return "\n".join(lines)


def _markdown_cells(cfg: DictConfig, option: Option) -> tuple[str, str, str]:
    """(default, allowed, help) of one option as the README table shows them."""
    if "*" in option.key:
        default = ""
    elif option.default is FROM_GROUP:
        default = raw_value(cfg, option.key)
    else:
        default = shown(option.default)
    default = f"`{default}`" if default not in ("", "-") else default
    return default, option.allowed().replace("{name}", option.key.rpartition(".")[2]), option.help


def markdown_rows(cfg: DictConfig) -> list[str]:
    """One row per option; options three or more levels deep that share a parent (model.lora.*, logger.wandb.*),
    and options of a section declared with the same `row`, share a row, each part named, so the table stays short."""
    rows: list[tuple[str, list[Option]]] = []
    for option in OPTIONS:
        section = option.key.rpartition(".")[0]
        shared = f"{section}/{option.row}" if option.row else section if option.key.count(".") >= 2 else option.key
        if rows and rows[-1][0] == shared and shared != option.key:
            rows[-1][1].append(option)
        else:
            rows.append((shared, [option]))
    lines = []
    for parent, options in rows:
        if len(options) == 1:
            cells = _markdown_cells(cfg, options[0])
            key = f"`{_display_key(options[0])}`"
        else:
            names = [o.key.rpartition(".")[2] for o in options]
            parts = [_markdown_cells(cfg, o) for o in options]
            cells = tuple("; ".join(f"{n}: {c[i]}" for n, c in zip(names, parts, strict=True) if c[i] not in ("", "-"))
                          for i in range(3))
            parent = options[0].key.rpartition(".")[0].replace("*", "NAME")
            key = f"`{parent}.`{{{', '.join(names)}}}"
        lines.append(f"| {key} | {cells[0]} | {cells[1]} | {cells[2]} |".replace("|  |", "| |"))
    return lines


def options_markdown(cfg: DictConfig) -> str:
    """The README's configuration table: key | default | allowed | what it does. A group's keys show the
    value of `cfg` (the default composition); the root sections' the default declared here."""
    return "\n".join(["| key | default | allowed | what it does |", "|---|---|---|---|", *markdown_rows(cfg)])
