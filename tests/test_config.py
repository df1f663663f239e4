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
    ("algo.mini_batches=3", "algo.mini_batches"),
    ("algo.mini_batches=0", "algo.mini_batches"),
    ("+reward.functions.bad._target_=nowhere.fn", "reward.functions.bad._target_"),
    ("trainer.logprob_chunk_size=0", "trainer.logprob_chunk_size"),
    ("trainer.logprob_chunk_size=1.5", "trainer.logprob_chunk_size"),
    ("model.lora.alpha=0", "model.lora.alpha"),
    ("model.lora.alpha=big", "model.lora.alpha"),
    ("model.lora.target_modules=[]", "model.lora.target_modules"),
    ("optimizer.name=adam", "optimizer.name"),
    ("optimizer.name=sgd", "optimizer.betas"),  # adamw's group with only the name changed: betas would be unused
    ("optimizer.betas=[0.9,1.5]", "optimizer.betas"),
    ("algo.check=maybe", "algo.check"),
    ("algo.mask_truncated=1", "algo.mask_truncated"),
    ("trainer.seed=-1", "trainer.seed"),
    ("eval.temperature=0", "eval.temperature"),
    ("eval.max_new_tokens=0", "eval.max_new_tokens"),
    ("eval.adapter=/no/such/adapter", "eval.adapter"),
    ("reward.accuracy=nope", "reward.accuracy"),
    ("logger.backend=tensorboard", "logger.backend"),
    ("data.high=0", "data.high"),
    ("data.size=0", "data.size"),
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


@pytest.mark.parametrize("overrides,key", [
    (["optimizer=sgd", "logger=wandb", "eval.every=5"], None),
    (["model.tiny.hidden_size=65"], "model.tiny.hidden_size"),
    (["optimizer=sgd", "optimizer.momentum=1.0"], "optimizer.momentum"),
    (["optimizer=sgd", "optimizer.momentum=0", "optimizer.nesterov=true"], "optimizer.nesterov"),
    (["logger=wandb", "logger.wandb.mode=sometimes"], "logger.wandb.mode"),
    (["logger=wandb", "logger.wandb.init_timeout=0"], "logger.wandb.init_timeout"),
    (["eval.every=5", "reward.accuracy=null"], "reward.accuracy"),
])
def test_group_specific_keys(compose, overrides, key):
    cfg = compose(["+recipe=quickstart", "model=tiny", *overrides])
    if key is None:
        validate(cfg)
        return
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value).startswith(key + "=") and "\n" not in str(err.value)


def test_optimizer_name_picks_the_torch_optimizer(compose):
    import torch

    from grpo_cli.optim import build_optimizer

    params = [torch.nn.Parameter(torch.zeros(3))]
    sgd = build_optimizer(params, compose(["optimizer=sgd", "optimizer.nesterov=true"]).optimizer)
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.9 and sgd.defaults["nesterov"] is True
    adamw = build_optimizer(params, compose(["+recipe=quickstart", "optimizer.lr=3e-4"]).optimizer)
    assert type(adamw) is torch.optim.AdamW and adamw.defaults["betas"] == (0.9, 0.99) and adamw.defaults["lr"] == 3e-4


def test_gsm8k_system_prompt_lives_beside_its_reward(compose):
    from grpo_cli.rewards.gsm8k import SYSTEM_PROMPT

    for data in ("gsm8k", "gsm_symbolic"):
        assert compose([f"data={data}"]).data.system_prompt == SYSTEM_PROMPT
    for file in (CONF_DIR / "data").glob("*.yaml"):
        assert "careful math tutor" not in file.read_text(), file  # written once, in rewards/gsm8k.py
@pytest.mark.parametrize("overrides,key,words", [
    # quickstart: 4 prompts x 8 completions
    (["algo.mini_batches=2", "trainer.micro_batch_size=3"], "trainer.micro_batch_size", ["= 16"]),
    (["algo.mini_batches=4", "trainer.nproc=2"], "algo.mini_batches", ["2 prompts of each of 2 ranks"]),
])
def test_mini_batches_need_whole_groups_per_rank(compose, overrides, key, words):
    with pytest.raises(ConfigError) as err:
        validate(compose(["+recipe=quickstart", *overrides]))
    assert str(err.value).startswith(key + "=") and all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("overrides", [
    ["algo.mini_batches=4"],                                  # one group (8 completions) per mini-batch
    ["algo.mini_batches=2", "trainer.micro_batch_size=8"],    # 16 completions in two micro-batches
    ["algo.mini_batches=2", "trainer.micro_batch_size=32"],   # at least a mini-batch: one micro-batch
    ["algo.mini_batches=2", "trainer.nproc=2"],
])
def test_mini_batch_layouts_that_validate(compose, overrides):
    validate(compose(["+recipe=quickstart", *overrides]))


def test_clip_eps_on_the_command_line_of_an_on_policy_run_warns():
    from grpo_cli.config import explicit_clip_warning

    on_policy = OmegaConf.create({"algo": {"mini_batches": 1, "num_iterations": 1}})
    line = explicit_clip_warning(on_policy, ["+recipe=quickstart", "algo.clip_eps=0.1"])
    assert line and line.startswith("algo.clip_eps has no effect") and "algo.mini_batches > 1" in line
    assert "algo.clip_eps_high" in explicit_clip_warning(on_policy, ["algo.clip_eps_high=0.3"])
    assert explicit_clip_warning(on_policy, ["+recipe=quickstart", "algo.beta=0.1"]) is None  # the recipe's own
    for off_policy in ({"mini_batches": 4, "num_iterations": 1}, {"mini_batches": 1, "num_iterations": 2}):
        assert explicit_clip_warning(OmegaConf.create({"algo": off_policy}), ["algo.clip_eps=0.1"]) is None
