"""Every config option, declared once: what it accepts, a one-line help, and, for the sections of the root
config (algo, rollout, trainer, eval), its default.

Validation (`check_options`), the option list of `grpo-train --help` (`options_help`) and the docs'
configuration table (`options_markdown`) are all read from `OPTIONS`. The keys of the config groups (model,
data, optimizer, logger, reward) take their values from the group option picked (`conf/GROUP/OPTION.yaml`);
the root sections take theirs from here (`root_defaults`, stored in Hydra's ConfigStore as `grpo_defaults`,
which conf/config.yaml composes). Rules that relate several keys live in config.py, and those the step
asks in config_rules.py.

This module holds the declarations and the rules only grpo-cli's options use; the vocabulary of a declaration
(Option, Rule, integer, number, one_of, ...) and the machinery over the declared options (OptionTable: checks,
typed views, --help, the table) are option_table.py's, bound here to OPTIONS and importable from here.

Choices of plug-in kinds are read from their registries when a value is checked, so this module imports
nothing heavy and lists no engine, optimizer, logger or loss type itself.
"""

from __future__ import annotations

import glob
import importlib
import re
from collections.abc import Callable
from pathlib import Path

from omegaconf import ListConfig

from grpo_cli.option_table import (
    ABSENT,
    ANY_TEXT,
    AUTO_OR_BOOLEAN,
    BOOLEAN,
    FROM_GROUP,
    MAPPING,
    TEXT,
    TEXT_LIST,
    Option,
    OptionTable,
    Rule,
    fail,
    integer,
    is_int,
    is_number,
    number,
    one_of,
    raw_value,
    shown,
)

__all__ = [
    "ABSENT", "ANY_TEXT", "AUTO_OR_BOOLEAN", "BOOLEAN", "FROM_GROUP", "MAPPING", "OPTIONS", "TABLE", "TEXT",
    "TEXT_LIST", "Option", "Rule", "check_options", "declares", "default_of", "fail", "integer", "is_int",
    "is_number", "markdown_rows", "no_such_option", "number", "one_of", "options_help", "options_markdown",
    "raw_value", "registry_names", "root_defaults", "section_options", "shown", "view", "view_type",
]

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
AUTO_OR_COUNT = Rule(lambda v: v == "auto" or (is_int(v) and v >= 1), "auto or an integer >= 1", verb="use")
MODEL_NAME = Rule(TEXT.test, "hub id, dir, embedded:NAME, tiny-random",
                  failure="give a hub id, a local directory, embedded:NAME or tiny-random")


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
    Option("algo.kl_estimator", one_of(names=registry_names("grpo_cli.algorithm", "KL_ESTIMATORS")),
      "per-token KL estimate in the beta term; k3 is TRL's and the contract's, unclamped (verl's k3 is its "
      "clamped low_var_kl)", "k3"),
    Option("algo.use_bias_correction_kl", BOOLEAN, "multiply the KL term by the importance ratio (TRL's default is "
      "true; ours false: plain k3)", False),
    Option("algo.off_policy_mask_threshold", number(0), "drop a sequence with A < 0 whose mean sampler - logp "
      "exceeds this (sampler: the engine's log-probs where it gives them, else old; DeepSeek-V3.2, TRL); null = off",
      None, nullable=True),
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
    # ---- rollout: the sampling options TRL users expect (docs/usage.md "Sampling and the loss": what each does
    # to the loss's log-probs)
    Option("rollout.top_k", integer(0), "sample among the k likeliest tokens only; 0/null = off (the loss's "
      "log-probs stay the full softmax)", 0, nullable=True, row="truncation"),
    Option("rollout.min_p", number(0, 1), "drop tokens below min_p x the likeliest one's probability; 0/null = off "
      "(the loss's log-probs stay the full softmax)", 0.0, nullable=True, row="truncation"),
    Option("rollout.repetition_penalty", number(0, low_open=True), "penalise tokens already in the prompt or "
      "completion (a logit l becomes l/p if l > 0, l*p if not); 1 = off (the loss's log-probs stay unpenalised)", 1.0, row="truncation"),
    Option("rollout.stop", STOP_STRINGS, "a completion ends at the first of these strings, which stays in it (and in "
      "the loss); \\n and \\t read as newline and tab", []),
    Option("rollout.engine", one_of(names=registry_names("grpo_cli.rollout", "ENGINES", auto=True)),
      "auto = compiled on CUDA, merged on the CPU, hf for a quantized base", "auto"),
    Option("rollout.compile", AUTO_OR_BOOLEAN, "compiled engine: compile the decode step; auto = on CUDA, "
      "warn and go on if it fails; true = anywhere, fail if it fails", "auto"),
    # ---- rollout: tools and environments (multi-turn episodes; docs/usage.md "Tools and environments")
    Option("rollout.tools", DOTTED_PATHS, "tools the model may call: dotted paths of functions with type hints and "
      "a Google-style docstring, e.g. [grpo_cli.calculator.calculator]; [] and no env = single-turn", [], row="tools"),
    Option("rollout.max_tool_calls", integer(0), "tool calls an episode may run; a further call ends it", 4, row="tools"),
    Option("rollout.tool_timeout_s", number(0, low_open=True), "seconds a tool call may take; over it the model "
      "reads an error (null = no limit)", 10.0, nullable=True, row="tools"),
    Option("rollout.tool_output_max_chars", integer(1), "characters of a tool's result the model reads; a longer "
      "one is cut, with a note (episodes/tool_outputs_cut counts them); null = no limit", 10000, nullable=True,
      row="tools"),
    Option("rollout.tool_format", one_of("auto", "native", "hermes"), "auto = the chat template's tool support "
      "where it has one, else hermes: the tools in the system turn, calls as <tool_call>{json}</tool_call>",
      "auto", row="tools"),
    Option("rollout.call_opener", ANY_TEXT, "text prefilled at the start of the first assistant turn (in the prompt, "
      "not trained), e.g. the opening of a call for a small model that never starts one alone", "", row="tools"),
    Option("env._target_", DOTTED_PATH, "an environment class (TRL's environment_factory): one per episode, "
      "reset(**row) returns a string or None, public methods are tools, optional get_reward(); null = none", None,
      nullable=True),
    # ---- rollout: the vllm engine (rollout.engine=vllm; docs/usage.md "vLLM")
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
    Option("trainer.micro_batch_tokens", AUTO_OR_COUNT, "tokens (prompt + completion) per forward/backward at most; "
      "a longer row goes alone; auto = what memory_budget_gb fits, else 2048 on the CPU and none on CUDA; null = none", "auto", nullable=True,
      row="memory"),
    Option("trainer.memory_budget_gb", number(0, low_open=True), "memory a step must fit in (GiB): the tokens per "
      "micro-batch and activation checkpointing follow, said in one line at start; null = none", None,
      nullable=True, row="memory"),
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
    Option("model.prepack", AUTO_OR_BOOLEAN, "the frozen linear layers multiply through oneDNN-prepacked weights "
      "(faster on the CPU; one more copy of those weights, two while training); auto = on the CPU, unquantized",
      "auto", optional=True),
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
    Option("reward.functions", MAPPING, "NAME: {_target_, weight, options...} per reward function; null = only the "
      "environment's get_reward()", nullable=True, free=True),
    Option("reward.functions.*._target_", DOTTED_PATH, "dotted path of the function or class"),
    Option("reward.functions.*.weight", number(), "its weight in the summed reward (1 when left out)", optional=True),
    # ---- sweep: resuming a sweep, averaging an Optuna trial over seeds
)


# The machinery, bound to the options above: these names are what the rest of grpo_cli calls.
TABLE = OptionTable(OPTIONS)
section_options = TABLE.section_options
view_type = TABLE.view_type
view = TABLE.view
default_of = TABLE.default_of
root_defaults = TABLE.root_defaults
check_options = TABLE.check
declares = TABLE.declares
no_such_option = TABLE.no_such_option
options_help = TABLE.help
markdown_rows = TABLE.markdown_rows
options_markdown = TABLE.markdown
