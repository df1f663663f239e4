"""Recipe registration and config validation: every bad value is caught here, before any model loads."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import GrammarParseError, InterpolationResolutionError

from grpo_cli.errors import ConfigError
from grpo_cli.overrides import override_key

PACKAGE_DIR = Path(__file__).resolve().parent
CONF_DIR = PACKAGE_DIR / "conf"
RECIPES_DIR = PACKAGE_DIR / "recipes"
SAMPLE_DATA_DIR = PACKAGE_DIR / "sample_data"

SCALE_REWARDS = ("group", "batch", "none")
RATIO_LEVELS = ("token", "sequence")
SCHEDULES = ("constant", "linear", "cosine")
ROLLOUT_ENGINES = ("auto", "hf", "compiled")


def packaged_data(name: str) -> str:
    """``${packaged_data:gsm8k/train.jsonl}`` in a config: the path of a data file shipped in the package."""
    return str(SAMPLE_DATA_DIR / name)


# Registered on import: every command and test that composes a config imports this module first.
OmegaConf.register_new_resolver("packaged_data", packaged_data, replace=True)


def recipe_dirs() -> list[Path]:
    """Packaged recipes first, then ./recipes of the working directory (which may override them)."""
    return [RECIPES_DIR, Path.cwd() / "recipes"]


def available_recipes() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder in recipe_dirs():
        if folder.is_dir():
            for file in sorted(folder.glob("*.yaml")):
                found[file.stem] = file
    return found


def register_recipes() -> None:
    """Store each recipe as option `recipe=NAME` (package _global_) in Hydra's ConfigStore, so that
    `+recipe=NAME` finds recipes that live beside conf/ rather than inside it, and the user's own."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for name, file in available_recipes().items():
        store.store(group="recipe", name=name, node=OmegaConf.load(file), package="_global_")


def system_prompt(name: str) -> str:
    """`${system_prompt:gsm8k}` in a data config: a system prompt kept in Python beside the reward that checks
    the format it asks for, so the prompt and the reward cannot drift apart."""
    from grpo_cli.rewards import gsm8k

    prompts = {"gsm8k": gsm8k.SYSTEM_PROMPT}
    if name not in prompts:
        raise ConfigError(f"system_prompt:{name} is not a known prompt; known: {', '.join(prompts)}")
    return prompts[name]


def recipes_help() -> str:
    """`${recipes:}` in the --help templates: one line per recipe, NAME and the first line of its comment."""
    lines = []
    for name, file in sorted(available_recipes().items()):
        comment = []
        for line in file.read_text().splitlines():
            if not line.startswith("#"):
                break
            if "@package" not in line:
                comment.append(line.lstrip("#").strip())
        text = " ".join(comment)
        about = text.split(". ")[0].rstrip(".") + "." if text else ""
        lines.append(f"  {name:<12} {about}".rstrip())
    return "\n".join(lines).replace("$", "$$") or "  (none)"  # Hydra fills the template with string.Template


# Registered on import: every command and test that composes a config imports this module first.
OmegaConf.register_new_resolver("system_prompt", system_prompt, replace=True)
OmegaConf.register_new_resolver("recipes", recipes_help, replace=True)


def _fail(key: str, value, allowed: str) -> None:
    raise ConfigError(f"{key}={value} is invalid: {allowed}")


def _check_range(cfg: DictConfig, key: str, test, allowed: str) -> None:
    value = OmegaConf.select(cfg, key)
    try:
        ok = value is not None and test(value)
    except TypeError:
        ok = False
    if not ok:
        _fail(key, value, allowed)


def _check_choice(cfg: DictConfig, key: str, choices) -> None:
    value = OmegaConf.select(cfg, key)
    if value not in choices:
        _fail(key, value, "use one of " + ", ".join(choices))


def _raw_value(cfg: DictConfig, key: str) -> str:
    """A value as written, `${...}` unresolved."""
    node = OmegaConf.to_container(cfg, resolve=False)
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return "?"
        node = node[part]
    return str(node)


def check_interpolations(cfg: DictConfig) -> None:
    """Every `${...}` must resolve; otherwise one line naming the key, instead of Hydra's page."""
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except (InterpolationResolutionError, GrammarParseError) as err:
        key = getattr(err, "full_key", None) or "?"
        reason = str(err).strip().splitlines()[0]
        raise ConfigError(f"{key}={_raw_value(cfg, key)} is invalid: it does not resolve ({reason}); refer to an "
                          "existing key such as ${rollout.max_new_tokens}, or give a plain value") from None


def ranks(cfg: DictConfig) -> int:
    """Processes of the job: torchrun's WORLD_SIZE inside one, else trainer.nproc (before grpo-train starts it)."""
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else int(cfg.trainer.nproc)


def check_context_length(cfg: DictConfig, context: int | None, keys: tuple[str, ...]) -> None:
    """max_new_tokens plus the longest prompt (data.max_prompt_tokens) must fit the model's context."""
    if not context:
        return
    prompt = int(cfg.data.max_prompt_tokens)
    for key in keys:
        new = int(OmegaConf.select(cfg, key))
        if new + prompt > context:
            fix = (f"use {key}<={context - prompt} or lower data.max_prompt_tokens" if context > prompt
                   else f"lower data.max_prompt_tokens below {context}")
            _fail(key, new, f"with data.max_prompt_tokens={prompt} a sequence reaches {new + prompt} tokens, beyond "
                            f"the {context}-token context of {cfg.model.name_or_path}; {fix}")


def validate(cfg: DictConfig) -> list[str]:
    """Raise ConfigError on the first bad value; return warnings for legal but doubtful ones."""
    warnings = []
    check_interpolations(cfg)
    r = _check_range
    r(cfg, "algo.num_generations", lambda v: int(v) == v and v >= 2, "needs an integer >= 2 (a group needs two completions)")
    r(cfg, "algo.beta", lambda v: v >= 0, "needs beta >= 0")
    r(cfg, "algo.clip_eps", lambda v: 0 < v < 1, "needs 0 < clip_eps < 1")
    if cfg.algo.get("clip_eps_high") is not None:
        r(cfg, "algo.clip_eps_high", lambda v: 0 < v < 1, "needs 0 < clip_eps_high < 1 (or null for clip_eps)")
    r(cfg, "algo.adv_eps", lambda v: 0 < v < 1, "needs 0 < adv_eps < 1 (1e-4 is usual)")
    if cfg.algo.adv_eps >= 1e-2:
        warnings.append(f"algo.adv_eps={cfg.algo.adv_eps} is near the reward scale and shrinks the advantages; 1e-4 is usual")
    _check_choice(cfg, "algo.scale_rewards", SCALE_REWARDS)
    from grpo_cli.algorithm import LOSS_TYPES  # the registry (imports torch)

    _check_choice(cfg, "algo.loss_type", tuple(LOSS_TYPES))
    _check_choice(cfg, "algo.ratio_level", RATIO_LEVELS)
    r(cfg, "algo.num_iterations", lambda v: int(v) == v and v >= 1, "needs an integer >= 1")
    r(cfg, "rollout.max_new_tokens", lambda v: int(v) == v and v >= 1, "needs an integer >= 1")
    r(cfg, "rollout.min_new_tokens", lambda v: 0 <= v <= cfg.rollout.max_new_tokens,
      f"needs 0 <= min_new_tokens <= rollout.max_new_tokens ({cfg.rollout.max_new_tokens})")
    r(cfg, "rollout.temperature", lambda v: v > 0, "needs temperature > 0")
    r(cfg, "rollout.top_p", lambda v: 0 < v <= 1, "needs 0 < top_p <= 1")
    _check_choice(cfg, "rollout.engine", ROLLOUT_ENGINES)
    if OmegaConf.select(cfg, "rollout.compile") not in ("auto", True, False):
        _fail("rollout.compile", OmegaConf.select(cfg, "rollout.compile"), "use auto, true or false")
    if OmegaConf.select(cfg, "trainer.gradient_checkpointing") not in (None, True, False):
        _fail("trainer.gradient_checkpointing", OmegaConf.select(cfg, "trainer.gradient_checkpointing"), "use true or false")
    r(cfg, "data.prompts_per_step", lambda v: int(v) == v and v >= 1, "needs an integer >= 1")
    r(cfg, "data.max_prompt_tokens", lambda v: int(v) == v and v >= 1, "needs an integer >= 1")
    _check_choice(cfg, "data.overlong", ("truncate", "drop"))
    for key in ("data.path", "data.eval_path"):
        value = OmegaConf.select(cfg, key)
        if value and not Path(value).expanduser().is_file():
            _fail(key, value, "no such file; give the path of an existing .jsonl file")
    r(cfg, "optimizer.lr", lambda v: v > 0, "needs lr > 0")
    r(cfg, "optimizer.weight_decay", lambda v: v >= 0, "needs weight_decay >= 0")
    r(cfg, "optimizer.warmup_steps", lambda v: int(v) == v and v >= 0, "needs an integer >= 0")
    _check_choice(cfg, "optimizer.schedule", SCHEDULES)
    r(cfg, "trainer.max_steps", lambda v: int(v) == v and v >= 1, "needs an integer >= 1")
    r(cfg, "trainer.max_grad_norm", lambda v: v > 0, "needs max_grad_norm > 0")
    r(cfg, "trainer.save_every", lambda v: int(v) == v and v >= 0, "needs an integer >= 0 (0 = final adapter only)")
    r(cfg, "trainer.keep_last", lambda v: int(v) == v and v >= 1, "needs an integer >= 1")
    r(cfg, "trainer.max_skipped", lambda v: int(v) == v and v >= 1, "needs an integer >= 1")
    r(cfg, "trainer.log_samples_every", lambda v: int(v) == v and v >= 0, "needs an integer >= 0 (0 = never)")
    device = str(cfg.trainer.device)
    if device not in ("auto", "cpu") and not (device == "cuda" or device.startswith("cuda:")):
        _fail("trainer.device", device, "use auto, cpu, cuda or cuda:N")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            _fail("trainer.device", device, "no CUDA device is visible here; use trainer.device=auto or cpu")
    r(cfg, "trainer.nproc", lambda v: int(v) == v and v >= 1, "needs an integer >= 1")
    n_ranks = ranks(cfg)
    if cfg.data.prompts_per_step % n_ranks:
        _fail("data.prompts_per_step", cfg.data.prompts_per_step,
              f"must divide over the {n_ranks} ranks (each takes whole prompt groups); use a multiple of {n_ranks}, "
              f"e.g. data.prompts_per_step={n_ranks * max(1, round(cfg.data.prompts_per_step / n_ranks))}")
    check_mini_batches(cfg, world_size=n_ranks)  # torchrun's real number of ranks inside a job
    r(cfg, "eval.every", lambda v: int(v) == v and v >= 0, "needs an integer >= 0 (0 = never)")
    r(cfg, "eval.num_prompts", lambda v: int(v) == v and v >= 1, "needs an integer >= 1")
    r(cfg, "eval.samples", lambda v: int(v) == v and v >= 1, "needs an integer >= 1")
    lora = cfg.model.lora
    r(cfg, "model.lora.r", lambda v: int(v) == v and v >= 1, "needs an integer >= 1")
    r(cfg, "model.lora.dropout", lambda v: 0 <= v < 1, "needs 0 <= dropout < 1")
    if lora.dropout > 0 and not is_on_policy(cfg) and cfg.algo.check:
        warnings.append("model.lora.dropout > 0 with mini_batches or num_iterations > 1: the ratio == 1 check is "
                        "relaxed by dropout noise")
    resume = cfg.trainer.get("resume")
    if resume not in (None, "auto") and not Path(str(resume)).expanduser().exists():
        _fail("trainer.resume", resume, "no such checkpoint or run dir; use auto (with hydra.run.dir=RUN_DIR) or an existing path")
    _check_choice(cfg, "reward.on_error", ("raise", "zero"))
    _validate_rewards(cfg)
    _validate_rest(cfg)
    return warnings


def check_mini_batches(cfg: DictConfig, world_size: int = 1) -> None:
    """Each of the `algo.mini_batches` optimizer updates of a step takes whole groups, as many on every rank,
    and `trainer.micro_batch_size` tiles one rank's share of a mini-batch (or covers it whole)."""
    _check_range(cfg, "algo.mini_batches", lambda v: int(v) == v and v >= 1,
                 "needs an integer >= 1 (optimizer updates per rollout batch)")
    prompts, mini = cfg.data.prompts_per_step, cfg.algo.mini_batches
    if world_size < 1 or prompts % world_size:
        return  # prompts that do not split over the ranks are reported on their own
    per_rank = prompts // world_size
    if per_rank % mini:
        share = (f"the {per_rank} prompts of each of {world_size} ranks" if world_size > 1
                 else f"data.prompts_per_step ({prompts})")
        _fail("algo.mini_batches", mini, f"must divide {share}: a mini-batch holds whole groups")
    completions = per_rank // mini * cfg.algo.num_generations
    what = ("data.prompts_per_step / algo.mini_batches" if world_size == 1
            else f"data.prompts_per_step / (algo.mini_batches x {world_size} ranks)")
    mbs = cfg.trainer.get("micro_batch_size")
    if mbs is not None:
        _check_range(cfg, "trainer.micro_batch_size",
                     lambda v: int(v) == v and v >= 1 and (v >= completions or completions % v == 0),
                     f"must divide the completions of one mini-batch on one rank ({what} x algo.num_generations "
                     f"= {completions}) or be at least that many")


def is_on_policy(cfg: DictConfig) -> bool:
    """One optimizer update per rollout batch: the ratio is exactly 1, so clipping never acts."""
    return cfg.algo.get("mini_batches", 1) == 1 and cfg.algo.num_iterations == 1


CLIP_KEYS = ("algo.clip_eps", "algo.clip_eps_high")


def on_policy_clip_warning(keys: list[str], sweep: bool = False) -> str:
    what = " and ".join(keys)
    subject = f"sweeping {what} measures nothing" if sweep else f"{what} has no effect"
    return (f"{subject} here: every update is on-policy (algo.mini_batches=1, algo.num_iterations=1), so the "
            "ratio is exactly 1 and nothing is clipped; set algo.mini_batches > 1 (e.g. 4) or "
            "algo.num_iterations > 1 to make clipping act")


def explicit_clip_warning(cfg: DictConfig, task_overrides: list[str]) -> str | None:
    """The warning for a single run whose command line (Hydra's overrides.task) sets a clip epsilon that
    cannot act; None otherwise. A recipe's own clip_eps is not the user's choice and gets no warning."""
    if not is_on_policy(cfg):
        return None
    keys = [k for k in CLIP_KEYS if any(override_key(line) == k for line in task_overrides)]
    return on_policy_clip_warning(keys) if keys else None


def _validate_rewards(cfg: DictConfig) -> None:
    functions = cfg.reward.get("functions") or {}
    if not functions:
        _fail("reward.functions", "{}", "list at least one reward function with _target_ and weight")
    for name, spec in functions.items():
        target = spec.get("_target_") if isinstance(spec, DictConfig) else None
        if not target:
            _fail(f"reward.functions.{name}._target_", target, "give the dotted path of a callable, e.g. pkg.module.fn")
        try:
            resolve_callable(target)
        except (ImportError, AttributeError, ValueError) as err:
            _fail(f"reward.functions.{name}._target_", target, f"cannot be imported ({err}); check the dotted path")
        weight = spec.get("weight", 1.0)
        if not isinstance(weight, (int, float)):
            _fail(f"reward.functions.{name}.weight", weight, "needs a number")
        _check_reward_options(f"reward.functions.{name}", resolve_callable(target), spec)


def resolve_callable(dotted: str):
    module, _, attr = str(dotted).rpartition(".")
    if not module:
        raise ValueError(f"{dotted!r} is not a dotted path")
    fn = getattr(importlib.import_module(module), attr)
    if not callable(fn):
        raise ValueError(f"{dotted} is not callable")
    return fn


def _check_reward_options(prefix: str, target, spec: DictConfig) -> None:
    """Keys of a reward entry besides _target_ and weight are the target's own options (a function's keyword
    arguments, a class's constructor arguments): each must be one it takes, and pass its own check_options."""
    import inspect

    from grpo_cli.rewards import reward_options

    options = reward_options(spec)
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        params = {}
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    free = any(p.kind is p.VAR_KEYWORD for p in params.values())
    reserved = ("prompts", "completions", "messages", *(("name", "device", "dtype") if inspect.isclass(target) else ()))
    for key, value in options.items():
        if key in reserved or not (free or key in named):
            takes = [n for n in named if n not in reserved]
            _fail(f"{prefix}.{key}", value, f"{target.__module__}.{target.__qualname__} takes no option {key}; "
                                            f"its options: {', '.join(takes) or 'none'}")
    check = getattr(target, "check_options", None)
    if callable(check):
        check(prefix, options)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validate_rest(cfg: DictConfig) -> None:
    """The keys validate() above does not cover: every key of conf/ is used by the code and checked here."""
    from grpo_cli.optim import COMMON_KEYS, OPTIMIZERS

    r = _check_range
    for key in ("algo.mask_truncated", "algo.check", "model.trust_remote_code"):
        if not isinstance(OmegaConf.select(cfg, key), bool):
            _fail(key, OmegaConf.select(cfg, key), "use true or false")
    r(cfg, "trainer.seed", lambda v: _is_int(v) and v >= 0, "needs an integer >= 0")
    chunk = cfg.trainer.get("logprob_chunk_size")
    if chunk is not None:
        r(cfg, "trainer.logprob_chunk_size", lambda v: _is_int(v) and v >= 1,
          "needs an integer >= 1 (token rows per log-softmax chunk), or null for one pass")
    name = cfg.model.get("name_or_path")
    if not isinstance(name, str) or not name.strip():
        _fail("model.name_or_path", name, "give a hub id, a local directory, embedded:NAME or tiny-random")
    r(cfg, "model.lora.alpha", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
      "needs a number > 0 (the LoRA scale is alpha / r; 2 x r is usual)")
    targets = cfg.model.lora.get("target_modules")
    if not (isinstance(targets, str) and targets) and not (
            OmegaConf.is_list(targets) and len(targets) and all(isinstance(t, str) and t for t in targets)):
        _fail("model.lora.target_modules", targets, "give all-linear or a list of module names, e.g. [q_proj, v_proj]")
    if cfg.model.get("tiny") is not None:
        for key in ("hidden_size", "num_layers", "num_heads"):
            r(cfg, f"model.tiny.{key}", lambda v: _is_int(v) and v >= 1, "needs an integer >= 1")
        r(cfg, "model.tiny.hidden_size", lambda v: v % cfg.model.tiny.num_heads == 0,
          f"must be a multiple of model.tiny.num_heads ({cfg.model.tiny.num_heads})")
    for key in ("size", "eval_size"):
        if cfg.data.get(key) is not None:
            r(cfg, f"data.{key}", lambda v: _is_int(v) and v >= 1, "needs an integer >= 1")
    if cfg.data.get("low") is not None or cfg.data.get("high") is not None:
        r(cfg, "data.low", lambda v: _is_int(v), "needs an integer")
        r(cfg, "data.high", lambda v: _is_int(v) and v >= cfg.data.low, f"needs an integer >= data.low ({cfg.data.low})")
    r(cfg, "eval.temperature", lambda v: v > 0, "needs temperature > 0")
    r(cfg, "eval.max_new_tokens", lambda v: _is_int(v) and v >= 1, "needs an integer >= 1")
    adapter = cfg.eval.get("adapter")
    if adapter and not (Path(str(adapter)).expanduser() / "adapter_config.json").is_file():
        _fail("eval.adapter", adapter, "holds no adapter_config.json; point it at a run's adapter/ folder")
    accuracy = cfg.reward.get("accuracy")
    if accuracy is not None and accuracy not in cfg.reward.functions:
        _fail("reward.accuracy", accuracy, f"name one of reward.functions ({', '.join(cfg.reward.functions)})")
    if accuracy is None and cfg.eval.every:
        _fail("reward.accuracy", None, "eval.every > 0 needs the 0/1 reward function that judges correctness; name one "
                                       f"of reward.functions ({', '.join(cfg.reward.functions)})")
    _check_choice(cfg, "logger.backend", ("none", "wandb"))
    if cfg.logger.backend == "wandb":
        from grpo_cli.tracking import WANDB_MODES

        _check_choice(cfg, "logger.wandb.mode", WANDB_MODES)
        for key in ("init_timeout", "finish_timeout"):
            r(cfg, f"logger.wandb.{key}", lambda v: v > 0, "needs a number of seconds > 0")
    _check_choice(cfg, "optimizer.name", tuple(OPTIMIZERS))
    allowed = (*COMMON_KEYS, *OPTIMIZERS[cfg.optimizer.name][1])
    for key in cfg.optimizer:
        if key not in allowed:
            _fail(f"optimizer.{key}", cfg.optimizer[key], f"optimizer.name={cfg.optimizer.name} does not use it "
                                                          f"(its keys: {', '.join(allowed)}); pick optimizer=NAME as a group")
    for key in OPTIMIZERS[cfg.optimizer.name][1]:
        if key not in cfg.optimizer:
            _fail(f"optimizer.{key}", None, f"optimizer.name={cfg.optimizer.name} needs it; pick optimizer="
                                            f"{cfg.optimizer.name} as a group rather than only optimizer.name")
    if cfg.optimizer.name == "adamw":
        r(cfg, "optimizer.betas", lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), "needs [beta1, beta2], each in [0, 1)")
    if cfg.optimizer.name == "sgd":
        r(cfg, "optimizer.momentum", lambda v: 0 <= v < 1, "needs 0 <= momentum < 1")
        if not isinstance(cfg.optimizer.nesterov, bool):
            _fail("optimizer.nesterov", cfg.optimizer.nesterov, "use true or false")
        if cfg.optimizer.nesterov and not cfg.optimizer.momentum > 0:
            _fail("optimizer.nesterov", True, "needs optimizer.momentum > 0")
