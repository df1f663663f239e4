"""Every recipe and every group option composes and validates; bad values give one clear line."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from grpo_cli.config import CONF_DIR, RECIPES_DIR, ConfigError, validate

GROUPS = ["model", "reward", "optimizer", "data", "logger"]
RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def test_recipes_exist_on_disk():
    assert {"quickstart", "gsm8k"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_and_validates(compose, recipe):
    cfg = compose([f"+recipe={recipe}"])
    OmegaConf.resolve(cfg)
    validate(cfg)
    assert cfg.algo.num_generations >= 2


@pytest.mark.parametrize("group,option", [(g, p.stem) for g in GROUPS for p in sorted((CONF_DIR / g).glob("*.yaml"))])
def test_every_group_option_composes(compose, group, option):
    cfg = compose([f"{group}={option}"])
    OmegaConf.resolve(cfg)
    assert cfg[group] is not None


def test_recipe_overrides_its_groups(compose):
    cfg = compose(["+recipe=quickstart", "model=tiny"])
    assert cfg.model.name_or_path == "tiny-random"
    assert compose(["+recipe=quickstart"]).model.name_or_path == "embedded:smollm2-135m"


@pytest.mark.parametrize("override,key", [
    ("algo.num_generations=1", "algo.num_generations"),
    ("algo.beta=-0.1", "algo.beta"),
    ("algo.clip_eps=1.5", "algo.clip_eps"),
    ("algo.adv_eps=0", "algo.adv_eps"),
    ("algo.loss_type=ppo", "algo.loss_type"),
    ("rollout.top_p=0", "rollout.top_p"),
    ("trainer.micro_batch_size=5", "trainer.micro_batch_size"),
    ("+reward.functions.bad._target_=nowhere.fn", "reward.functions.bad._target_"),
])
def test_validate_names_key_and_value(compose, override, key):
    cfg = compose(["+recipe=quickstart", override])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    message = str(err.value)
    assert message.startswith(key + "=") and "\n" not in message


def test_large_adv_eps_warns(compose):
    warnings = validate(compose(["+recipe=quickstart", "algo.adv_eps=0.05"]))
    assert any("adv_eps" in w for w in warnings)
