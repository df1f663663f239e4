"""Recipe registration and config validation: every bad value is caught here, before any model loads."""

from __future__ import annotations

import importlib
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from grpo_cli.errors import ConfigError

PACKAGE_DIR = Path(__file__).resolve().parent
CONF_DIR = PACKAGE_DIR / "conf"
RECIPES_DIR = PACKAGE_DIR / "recipes"
SAMPLE_DATA_DIR = PACKAGE_DIR / "sample_data"

SCALE_REWARDS = ("group", "batch", "none")
LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
RATIO_LEVELS = ("token", "sequence")
SCHEDULES = ("constant", "linear", "cosine")


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


def validate(cfg: DictConfig) -> list[str]:
    """Raise ConfigError on the first bad value; return warnings for legal but doubtful ones."""
    warnings = []
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
    _check_choice(cfg, "algo.loss_type", LOSS_TYPES)
    _check_choice(cfg, "algo.ratio_level", RATIO_LEVELS)
    r(cfg, "algo.num_iterations", lambda v: int(v) == v and v >= 1, "needs an integer >= 1")
    r(cfg, "rollout.max_new_tokens", lambda v: int(v) == v and v >= 1, "needs an integer >= 1")
    r(cfg, "rollout.min_new_tokens", lambda v: 0 <= v <= cfg.rollout.max_new_tokens,
      f"needs 0 <= min_new_tokens <= rollout.max_new_tokens ({cfg.rollout.max_new_tokens})")
    r(cfg, "rollout.temperature", lambda v: v > 0, "needs temperature > 0")
    r(cfg, "rollout.top_p", lambda v: 0 < v <= 1, "needs 0 < top_p <= 1")
    r(cfg, "data.prompts_per_step", lambda v: int(v) == v and v >= 1, "needs an integer >= 1")
    r(cfg, "data.max_prompt_tokens", lambda v: int(v) == v and v >= 1, "needs an integer >= 1")
    _check_choice(cfg, "data.overlong", ("truncate", "drop"))
    for key in ("data.path", "data.eval_path"):
        value = OmegaConf.select(cfg, key)
        if value and not Path(value).expanduser().is_file():
            _fail(key, value, "no such file; give the path of an existing .jsonl file")
    completions = cfg.data.prompts_per_step * cfg.algo.num_generations
    mbs = cfg.trainer.get("micro_batch_size")
    if mbs is not None:
        r(cfg, "trainer.micro_batch_size", lambda v: int(v) == v and v >= 1 and completions % v == 0,
          f"must divide the step's completions (data.prompts_per_step x algo.num_generations = {completions})")
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
    r(cfg, "eval.every", lambda v: int(v) == v and v >= 0, "needs an integer >= 0 (0 = never)")
    r(cfg, "eval.num_prompts", lambda v: int(v) == v and v >= 1, "needs an integer >= 1")
    r(cfg, "eval.samples", lambda v: int(v) == v and v >= 1, "needs an integer >= 1")
    lora = cfg.model.lora
    r(cfg, "model.lora.r", lambda v: int(v) == v and v >= 1, "needs an integer >= 1")
    r(cfg, "model.lora.dropout", lambda v: 0 <= v < 1, "needs 0 <= dropout < 1")
    if lora.dropout > 0 and cfg.algo.num_iterations > 1 and cfg.algo.check:
        warnings.append("model.lora.dropout > 0 with num_iterations > 1: the ratio == 1 check is relaxed by dropout noise")
    resume = cfg.trainer.get("resume")
    if resume not in (None, "auto") and not Path(str(resume)).expanduser().exists():
        _fail("trainer.resume", resume, "no such checkpoint or run dir; use auto (with hydra.run.dir=RUN_DIR) or an existing path")
    _check_choice(cfg, "reward.on_error", ("raise", "zero"))
    _validate_rewards(cfg)
    return warnings


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


def resolve_callable(dotted: str):
    module, _, attr = str(dotted).rpartition(".")
    if not module:
        raise ValueError(f"{dotted!r} is not a dotted path")
    fn = getattr(importlib.import_module(module), attr)
    if not callable(fn):
        raise ValueError(f"{dotted} is not callable")
    return fn
