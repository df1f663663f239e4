"""Every config option, declared once: a field of the frozen dataclass of its section, with its type, its
default and a line of help (`option(help, default, check)`).

The sections of the root config (algo, rollout, env, trainer, eval, sweep) take their defaults from here; the
config groups (model, data, optimizer, logger, reward) take their values from the option picked
(`conf/GROUP/OPTION.yaml`), and a key only some options of a group have takes its default here when absent.
`TABLE.schema_node()`, stored in Hydra's ConfigStore as `grpo_schema` (conf/config.yaml composes it first), is
the typed node every value is composed into: a value of the wrong type fails the composition, in the option's
one line (`composition_problem`). Validation (`check_options`), the option list of `grpo-train --help`
(`options_help`) and the docs' configuration table (`options_markdown`) are read from the same fields; the
entry points turn the composed config into a `Config` (`Config.of`), and everything below them reads that.

Choices that plug-ins extend (objectives, advantage estimators, KL estimators, engines, ...) are `str` fields whose
rule reads their registry when a value is checked (config/values.py); a fixed set of choices is a `Literal`. The
`algo` section is declared in config/algo.py, `rollout` and `env` in config/rollout.py. Rules that relate several
keys live in run/validate.py, and those the step asks in config/rules.py. This module imports nothing heavy and lists
no engine, optimizer, logger or loss type itself."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal, cast

from omegaconf import DictConfig, OmegaConf

from grpo_cli.base.redaction import find_secrets, remember
from grpo_cli.config.algo import AlgoConfig
from grpo_cli.config.option_table import ABSENT, Option, OptionTable, extras, option, raw_value, section, typed
from grpo_cli.config.rollout import EnvConfig, RolloutConfig
from grpo_cli.config.rule import (
    ANY_TEXT,
    AUTO_OR_BOOLEAN,
    MAPPING,
    TEXT,
    TEXT_LIST,
    Rule,
    fail,
    integer,
    number,
    shown,
)
from grpo_cli.config.values import (
    ADAPTER,
    AUTO_OR_BOOL,
    AUTO_OR_COUNT,
    BETAS,
    DATA_PATH,
    DEVICE,
    DOTTED_PATH,
    DTYPE,
    MODEL_NAME,
    MODULE_NAMES,
    ONE_SEED,
    POSITIVE,
    RESUME,
    TARGET_MODULES,
    registered,
    registry_names,
)

__all__ = [
    "ABSENT", "OPTIONS", "TABLE", "AlgoConfig", "Config", "DataConfig", "EnvConfig", "EvalConfig", "LoggerConfig",
    "LoraConfig", "ModelConfig", "Option", "OptimizerConfig", "RewardConfig", "RewardFunctionConfig",
    "RolloutConfig", "Rule", "SlurmConfig", "SweepConfig", "TinyConfig", "TrainerConfig", "WandbConfig",
    "check_options", "composition_problem", "declares", "default_of", "fail", "markdown_rows", "no_such_option",
    "options_help", "options_markdown", "raw_value", "registry_names", "root_defaults", "schema_node", "shown", "typed",
]


# ---- the root sections -------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """trainer: the loop, memory, checkpoints."""

    max_steps: int = option("training steps (rollout batches)", 50, integer(1))
    epochs: float | None = option("passes over the training prompts (TRL's num_train_epochs): max_steps becomes "
                                  "ceil(epochs x prompts / data.prompts_per_step); null = max_steps decides", None,
                                  POSITIVE)
    seed: int = option("seed of sampling, data order and LoRA init", 0, integer(0))
    device: str = option("auto = the first CUDA device, else the CPU", "auto", DEVICE)
    micro_batch_size: int | None = option("completions per forward/backward; null = a whole mini-batch", None,
                                          integer(1))
    micro_batch_tokens: Literal["auto"] | int | None = option(
        "tokens (prompt + completion) per forward/backward at most; a longer row goes alone; auto = what "
        "memory_budget_gb fits, else 2048 on the CPU and none on CUDA; null = none", "auto", AUTO_OR_COUNT,
        row="memory")
    memory_budget_gb: float | None = option("memory a step must fit in (GiB): the tokens per micro-batch, "
                                            "activation checkpointing, the LM head's blocks and (CPU) glibc "
                                            "returning freed blocks follow, said in one line at start; null = "
                                            "none", None, POSITIVE, row="memory")
    max_grad_norm: float = option("gradient clipping norm", 1.0, POSITIVE)
    logprob_chunk_size: int | None = option("token rows per log-softmax chunk (bounds memory); null = one pass",
                                            256, integer(1))
    gradient_checkpointing: bool = option("recompute activations in the backward (less memory, ~1/3 more "
                                          "compute)", False)
    save_every: int = option("checkpoint every K steps; 0 = only the final adapter", 0, integer(0),
                             row="checkpoints")
    keep_last: int = option("checkpoints kept", 2, integer(1), row="checkpoints")
    resume: str | None = option("auto (with hydra.run.dir=RUN_DIR) or a checkpoint / run dir path; a used run dir "
                                "takes only auto or its own", None, RESUME)
    overwrite: bool = option("start over in a run dir that holds a run (deletes its records and checkpoints "
                             "first)", False)
    resume_allow_changes: tuple[str, ...] = option("keys (or sections) a resume may change on purpose, e.g. "
                                                   "[trainer.max_steps,optimizer.lr]", (), TEXT_LIST)
    max_skipped: int = option("stop after this many non-finite updates in a row", 3, integer(1))
    log_samples_every: int = option("write sample completions every K steps; 0 = never", 10, integer(0))
    nproc: int = option("processes; > 1 relaunches under torchrun", 1, integer(1))
    parallel: Literal["ddp", "fsdp"] = option("over ranks: ddp = every rank holds the whole base, LoRA gradients "
                                              "summed; fsdp = the frozen base sharded over the ranks (FSDP2), for a "
                                              "base one device cannot hold (docs/usage.md, Past one GPU)", "ddp")


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """eval: held-out accuracy (grpo-eval, and during training)."""

    every: int = option("evaluate every K training steps; 0 = never (needs reward.accuracy)", 0, integer(0))
    num_prompts: int = option("held-out prompts per evaluation", 50, integer(1), row="held-out")
    samples: int = option("k: pass@k and majority@k when > 1", 1, integer(1), row="held-out")
    temperature: float = option("sampling temperature when samples > 1", 0.8, POSITIVE, row="held-out")
    max_new_tokens: int = option("tokens per completion at most", "${rollout.max_new_tokens}", integer(1),
                                 row="held-out")
    adapter: str | None = option("grpo-eval: a trained adapter dir; null = the base model", None, ADAPTER)
    final: AUTO_OR_BOOL = option("greedy eval on the fixed held-out prompts after the last step "
                                 "(final_eval.json); auto = in a sweep when the data has a held-out split",
                                 "auto", AUTO_OR_BOOLEAN)


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    """sweep: how a multirun's summary ranks its cells (sweep_cells.csv), and averaging an Optuna trial over
    seeds."""

    metric: str = option("the summary column cells are ranked by (higher is better); auto = final_eval_accuracy "
                         "where every job has it, else mean_reward", "auto",
                         registered("grpo_cli.sweep.summary", "RANK_METRICS", auto=True))
    seeds: int = option("seeds per Optuna trial (only 1 for now)", 1, ONE_SEED)


@dataclass(frozen=True, kw_only=True)
class SlurmConfig:
    """slurm: the SLURM batch job `slurm.write_job=PATH` writes for this run instead of training (docs/usage.md
    "Many nodes with SLURM"): a training node, and inference nodes running vLLM's servers."""

    write_job: str | None = option("write this run as a SLURM batch script to this path and exit without training "
                                   "(submit it with sbatch); null = train here", None, TEXT)
    inference_nodes: int = option("nodes of the job that run vLLM's servers, one per GPU, given to the training node "
                                  "as rollout.server_url (needs rollout.placement=server); 0 = the training node "
                                  "alone", 1, integer(0))
    gpus_per_node: int = option("GPUs of each node of the job", 8, integer(1))
    partition: str | None = option("the job's partition; null = the cluster's default", None, TEXT)
    account: str | None = option("the job's account; null = yours by default", None, TEXT)
    time_min: int = option("the job's time limit in minutes", 240, integer(1))
    port: int = option("the port of the first vLLM server of each inference node (then port + 1, ...)", 8000,
                       integer(1024))


# ---- the config groups ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """model.lora: the adapter trained."""

    r: int = option("LoRA rank", check=integer(1))
    alpha: float = option("LoRA scale is alpha / r (2 x r is usual)", check=POSITIVE)
    dropout: float = option("LoRA dropout", check=number(0, 1, high_open=True))
    target_modules: str | tuple[str, ...] = option("modules that get adapters", check=TARGET_MODULES)
    use_dora: bool = option("DoRA, weight-decomposed LoRA (peft's use_dora); generation on rollout.engine=hf", False)
    use_rslora: bool = option("rank-stabilised LoRA: scale alpha / sqrt(r), not alpha / r (peft's use_rslora)", False)
    modules_to_save: tuple[str, ...] = option("modules trained whole beside the adapter, e.g. [lm_head] (peft's "
                                              "modules_to_save); generation on rollout.engine=hf", (), TEXT_LIST)


@dataclass(frozen=True, kw_only=True)
class TinyConfig:
    """model.tiny: the sizes of the tiny random model (model.name_or_path=tiny-random)."""

    hidden_size: int = option("tiny-random: width (a multiple of num_heads)", 64, integer(1))
    num_layers: int = option("tiny-random: layers", 2, integer(1))
    num_heads: int = option("tiny-random: attention heads", 4, integer(1))
    max_position_embeddings: int = option("tiny-random: context length", 1024, integer(1))


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """model=NAME: the base model and its adapter."""

    name_or_path: str = option("hub id, local dir, embedded:NAME or tiny-random", check=MODEL_NAME)
    trust_remote_code: bool = option("run a hub model's own code")
    lora: LoraConfig
    tiny: TinyConfig | None = option("tiny-random's sizes", None, optional=True)
    quantization: Literal["nf4", "fp4", "int8"] | None = option(
        "QLoRA: load the frozen base in 4 bits (nf4, fp4) or 8 bits (int8) through bitsandbytes; null = "
        "unquantized", None, optional=True)
    dtype: DTYPE = option("precision of the frozen base and its generation (LoRA weights, optimizer state, "
                          "log-softmax and loss stay float32); auto = bfloat16 on CUDA, float32 on the CPU")
    prepack: AUTO_OR_BOOL = option("the frozen linear layers multiply through oneDNN-prepacked weights (faster on "
                                   "the CPU; one more copy of those weights, two while training); auto = on the "
                                   "CPU, unquantized", "auto", AUTO_OR_BOOLEAN)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """data=NAME: where the prompts come from and how they are cut."""

    source: str = option("where prompts come from (hf: a hub id or local files through `datasets`; jsonl: the "
                         "same reader, named for a .jsonl data.path)",
                         check=registered("grpo_cli.tasks.sources", "SOURCES"))
    task: str | None = option("reasoning_gym: the generator", None, TEXT, optional=True, null=False,
                              row="reasoning_gym")
    task_args: Mapping[str, Any] = option("reasoning_gym: the generator's arguments", {}, MAPPING, optional=True,
                                          free=True, row="reasoning_gym")
    low: int | None = option("sums: smallest term", None, integer(), optional=True, null=False, row="generated")
    high: int | None = option("sums: largest term (>= low)", None, integer(), optional=True, null=False,
                              row="generated")
    operation: Literal["+", "*"] = option("sums: + (a + b), or * (a * b: the calculator recipe)", "+",
                                          optional=True, row="generated")
    size: int | None = option("generated training prompts", None, integer(1), optional=True, null=False,
                              row="generated")
    eval_size: int | None = option("generated held-out prompts", None, integer(1), optional=True, null=False,
                                   row="generated")
    question_suffix: str = option("appended to each question", check=ANY_TEXT)
    system_prompt: str | None = option("system turn; null = the model's own default", check=ANY_TEXT)
    prompts_per_step: int = option("prompts per step (each sampled G times)", check=integer(1))
    max_prompt_tokens: int = option("longest prompt in tokens", check=integer(1))
    overlong: Literal["truncate", "drop"] = option("a longer prompt: cut from the left, or dropped")
    path: str | None = option("training rows: .jsonl/.json/.parquet/.csv/.arrow file or glob, or a save_to_disk "
                              "dir; null = the source's own", check=DATA_PATH)
    eval_path: str | None = option("held-out rows, as data.path; null = the source's own", check=DATA_PATH)
    name: str | None = option("hf: a hub dataset id (data.path wins when both are set)", None, TEXT,
                              optional=True, row="hub")
    config: str | None = option("hf: the hub dataset's config (subset)", None, TEXT, optional=True, row="hub")
    split: str = option("hf: the training split of data.name or of a saved DatasetDict", "train", TEXT,
                        optional=True, row="hub")
    eval_split: str | None = option("hf: the held-out split of data.name or of a saved DatasetDict (or use "
                                    "data.eval_path)", None, TEXT, optional=True, row="hub")
    prompt_column: str = option("hf, jsonl: the column of prompts (text or chat messages); prompt falls back to "
                                "messages", "prompt", TEXT, optional=True, row="columns")
    answer_column: str | None = option("hf, jsonl: a column that reaches rewards as answer; null = every column "
                                       "under its own name", None, TEXT, optional=True, row="columns")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """optimizer=NAME: the common keys, and the keys its builder (optim.OPTIMIZERS) reads beyond them."""

    OPEN: ClassVar[str] = "the common keys below and exactly the keys its builder (optim.OPTIMIZERS) reads"

    name: str = option("the torch optimizer", check=registered("grpo_cli.step.optim", "OPTIMIZERS"))
    lr: float = option("learning rate (after warmup)", check=POSITIVE)
    weight_decay: float = option("decoupled weight decay", check=number(0))
    warmup_steps: int = option("linear warmup, in training steps", check=integer(0))
    schedule: Literal["constant", "linear", "cosine"] = option("learning rate after warmup")
    betas: tuple[float, float] | None = option("adamw: moment decay rates", None, BETAS, optional=True, null=False,
                                               row="own")
    momentum: float | None = option("sgd: momentum", None, number(0, 1, high_open=True), optional=True,
                                    null=False, row="own")
    nesterov: bool | None = option("sgd: Nesterov momentum (needs momentum > 0)", None, optional=True, null=False,
                                   row="own")
    plugin_keys: Mapping[str, Any] = extras()  # the keys a plug-in optimizer's builder reads


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """logger.wandb: the W&B run (logger=wandb)."""

    mode: str = option("auto = online with credentials, else offline", "auto",
                       registered("grpo_cli.tracking", "WANDB_MODES"))
    project: str = option("W&B project", "grpo-cli", TEXT)
    entity: str | None = option("W&B entity; null = yours", None, TEXT)
    name: str | None = option("run name; null = the overrides", None, TEXT)
    group: str | None = option("null = the recipe (and sweep dir)", None, TEXT)
    tags: tuple[str, ...] = option("W&B tags", (), TEXT_LIST)
    init_timeout: float = option("seconds to reach the server, then offline", 60.0, POSITIVE)
    finish_timeout: float = option("seconds to upload at the end", 300.0, POSITIVE)


@dataclass(frozen=True, kw_only=True)
class LoggerConfig:
    """logger=NAME: where metrics go besides metrics.jsonl and the console."""

    backend: str = option("where metrics go besides metrics.jsonl and the console",
                          check=registered("grpo_cli.tracking", "LOGGERS"))
    wandb: WandbConfig | None = option("the W&B run's settings", None, optional=True)


@dataclass(frozen=True, kw_only=True)
class RewardFunctionConfig:
    """reward.functions.NAME: one reward function, its weight, and its own options (the function's keyword
    arguments, or its class's constructor arguments)."""

    _target_: str = option("dotted path of the function or class", check=DOTTED_PATH)
    weight: float = option("its weight in the summed reward (1 when left out)", 1.0, number(), optional=True)
    options: Mapping[str, Any] = extras()


@dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """reward=NAME: the reward functions and what a failing one does."""

    on_error: Literal["raise", "zero"] = option("a reward that raises: stop, or score 0 and count it")
    aggregation: Literal["sum", "normalize_then_sum"] = option(
        "the rewards' weighted sum, or each reward z-scored within its group first (GDPO); sum when left out "
        "(+reward.aggregation=... to set it)", "sum", optional=True)
    timeout_s: float | None = option("seconds a reward call may take; over it is an error per on_error; null = no "
                                     "limit", check=POSITIVE)
    accuracy: str | None = option("the 0/1 function of reward.functions that judges correctness", check=TEXT)
    functions: Mapping[str, RewardFunctionConfig] | None = option(
        "NAME: {_target_, weight, options...} per reward function; null = only the environment's get_reward()",
        check=MAPPING, free=True)
    only: tuple[str, ...] = option("use only these reward functions (TRL's reward_funcs): dotted paths of yours, "
                                   "weight 1 each, named after the function, or names of reward.functions entries "
                                   "to keep; [] = all of reward.functions", (), TEXT_LIST)
    task_rewards: tuple[str, ...] = option("entries of reward.functions that carry the task besides reward.accuracy: "
                                           "the reward-dominance alarm does not fire on them", (), TEXT_LIST)

    def chosen(self) -> RewardConfig:
        """The functions in use: reward.only's, in its order, in place of reward.functions (reward.accuracy kept
        where it names one of them, else null); as it is without reward.only. A name reward.only cannot place, two
        of its functions with one name, or a reward.task_rewards name that is none of them is a ConfigError."""
        reward = self._only_applied()
        functions = reward.functions or {}
        for name in self.task_rewards:
            if name not in functions:
                fail("reward.task_rewards", f"[{','.join(self.task_rewards)}]",
                     f"{name} is not a reward function in use ({', '.join(functions) or 'none'})")
        return reward

    def _only_applied(self) -> RewardConfig:
        if not self.only:
            return self
        functions, chosen = self.functions or {}, {}
        for item in self.only:
            name = item if item in functions else item.rpartition(".")[2]
            if item not in functions and "." not in item:
                fail("reward.only", f"[{','.join(self.only)}]", f"{item} is neither an entry of reward.functions "
                     f"({', '.join(functions) or 'none'}) nor a dotted path of a function (my_rewards.fn)")
            if name in chosen:
                fail("reward.only", f"[{','.join(self.only)}]", f"names two functions {name}; give each another "
                     f"name with +reward.functions.NAME._target_={item}")
            chosen[name] = functions[item] if item in functions else RewardFunctionConfig(_target_=item)
        return replace(self, functions=chosen, accuracy=self.accuracy if self.accuracy in chosen else None)

    def carrying_the_task(self) -> frozenset[str]:
        """The reward functions that carry the task: reward.accuracy's and reward.task_rewards."""
        return frozenset((*(() if self.accuracy is None else (self.accuracy,)), *self.task_rewards))


# ---- the root config -------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Config:
    """The whole config, typed: what everything below the entry points reads (`Config.of` a composed one)."""

    plugins: tuple[str, ...] = option("your modules to import first: what they register becomes a choice", (),
                                      MODULE_NAMES)
    algo: AlgoConfig = section(AlgoConfig)
    rollout: RolloutConfig = section(RolloutConfig)
    env: EnvConfig = section(EnvConfig)
    trainer: TrainerConfig = section(TrainerConfig)
    eval: EvalConfig = section(EvalConfig)
    sweep: SweepConfig = section(SweepConfig)
    slurm: SlurmConfig = section(SlurmConfig)
    model: ModelConfig = section()
    data: DataConfig = section()
    optimizer: OptimizerConfig = section()
    logger: LoggerConfig = section()
    reward: RewardConfig = section()
    # the composed config as plain values (Hydra's part left out): what a run's records pin and log (the
    # checkpoint fingerprint, the W&B config), in the shape the run dir's .hydra/config.yaml has
    composed: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # `composed` with each secret (grpo_cli.base.redaction) as written (the interpolation) or hashed: what records keep
    recorded: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    secret_keys: tuple[str, ...] = field(default=(), compare=False, repr=False)  # the dotted keys of the secrets

    @classmethod
    def of(cls, cfg: DictConfig | Config) -> Config:
        """The typed config of a composed (and validated) one; a Config as it is."""
        if isinstance(cfg, Config):
            return cfg
        resolved = cast(dict, OmegaConf.to_container(cfg, resolve=True))
        composed = {str(k): v for k, v in resolved.items() if k != "hydra"}
        secrets = find_secrets(cfg)
        remember(secrets.values)  # never printed from now on
        config = typed(cls, composed)
        return replace(config, reward=config.reward.chosen(), composed=composed, recorded=secrets.recorded(composed),
                       secret_keys=tuple(secrets.recorded_as))


# The machinery, bound to the fields above: these names are what the rest of grpo_cli calls.
TABLE = OptionTable(Config)
OPTIONS: tuple[Option, ...] = TABLE.options
default_of = TABLE.default_of
root_defaults = TABLE.root_defaults
schema_node = TABLE.schema_node
composition_problem = TABLE.composition_problem
check_options = TABLE.check
check_sections = TABLE.check_sections
declares = TABLE.declares
no_such_option = TABLE.no_such_option
options_help = TABLE.help
markdown_rows = TABLE.markdown_rows
options_markdown = TABLE.markdown
