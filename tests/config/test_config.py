"""Every recipe and every group option composes and validates; bad values give one clear line."""

from __future__ import annotations

import pytest
from conftest import REPO, run_cli
from omegaconf import OmegaConf

from grpo_cli.config.compose import CONF_DIR, RECIPES_DIR, ConfigError, options_table
from grpo_cli.config.schema import OPTIONS, check_options, root_defaults
from grpo_cli.run.validate import validate

GROUPS = ["model", "reward", "optimizer", "data", "logger"]
RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def test_recipes_exist_on_disk():
    assert {"quickstart", "gsm8k"} <= set(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_every_recipe_composes_and_validates(compose, recipe):
    cfg = compose([f"+recipe={recipe}"])
    OmegaConf.resolve(cfg)
    validate(cfg)
    assert cfg.algo.num_generations >= 2


@pytest.mark.parametrize("group,option", [(g, p.stem) for g in GROUPS for p in sorted((CONF_DIR / g).glob("*.yaml"))])
@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_every_group_option_composes(compose, group, option):
    cfg = compose([f"{group}={option}"])
    OmegaConf.resolve(cfg)
    assert cfg[group] is not None
    check_options(cfg)  # each of its keys is declared in the schema, and its values pass


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
    ("logger.backend=mlflow", "logger.backend"),
    ("data.high=0", "data.high"),
    ("data.size=0", "data.size"),
    # not numbers, or not finite, where a number is wanted
    ("algo.beta=nan", "algo.beta"),
    ("algo.beta=inf", "algo.beta"),
    ("algo.beta=abc", "algo.beta"),
    ("optimizer.lr=-inf", "optimizer.lr"),
    ("algo.num_generations=inf", "algo.num_generations"),
    ("algo.num_generations=true", "algo.num_generations"),
    ("trainer.max_steps=abc", "trainer.max_steps"),
    ("trainer.max_steps=4.0", "trainer.max_steps"),
    ("reward.functions.correct.weight=nan", "reward.functions.correct.weight"),
    ("rollout.engine=sglang", "rollout.engine"),
    ("rollout.compile=1", "rollout.compile"),
    ("+algo.betas=[0.9,0.99]", "algo.betas"),  # a key no option declares
])
@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_validate_names_key_and_value(compose, override, key):
    with pytest.raises(ConfigError) as err:  # a value of the wrong type is refused as the config is composed
        validate(compose(["+recipe=quickstart", override]))
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
@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_group_specific_keys(compose, overrides, key):
    cfg = compose(["+recipe=quickstart", "model=tiny", *overrides])
    if key is None:
        validate(cfg)
        return
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value).startswith(key + "=") and "\n" not in str(err.value)


def test_optimizer_name_picks_the_torch_optimizer(config):
    import torch

    from grpo_cli.step.optim import build_optimizer

    params = [torch.nn.Parameter(torch.zeros(3))]
    sgd = build_optimizer(params, config(["optimizer=sgd", "optimizer.nesterov=true"]).optimizer)
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.9 and sgd.defaults["nesterov"] is True
    adamw = build_optimizer(params, config(["+recipe=quickstart", "optimizer.lr=3e-4"]).optimizer)
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
    from grpo_cli.run.validate import explicit_clip_warning

    on_policy = OmegaConf.create({"algo": {"mini_batches": 1, "num_iterations": 1}})
    line = explicit_clip_warning(on_policy, ["+recipe=quickstart", "algo.clip_eps=0.1"])
    assert line and line.startswith("algo.clip_eps has no effect") and "algo.mini_batches > 1" in line
    assert "algo.clip_eps_high" in explicit_clip_warning(on_policy, ["algo.clip_eps_high=0.3"])
    assert explicit_clip_warning(on_policy, ["+recipe=quickstart", "algo.beta=0.1"]) is None  # the recipe's own
    for off_policy in ({"mini_batches": 4, "num_iterations": 1}, {"mini_batches": 1, "num_iterations": 2}):
        assert explicit_clip_warning(OmegaConf.create({"algo": off_policy}), ["algo.clip_eps=0.1"]) is None
    cispo = OmegaConf.create({"algo": {"mini_batches": 1, "num_iterations": 1, "objective": "cispo"}})
    assert explicit_clip_warning(cispo, ["algo.clip_eps=0.1"]) is None  # it reads no clip: rules.inert_algo_options


@pytest.mark.parametrize("override,allowed", [
    ("algo.beta=inf", "needs beta >= 0"),
    ("algo.clip_eps=abc", "needs 0 < clip_eps < 1"),
    ("trainer.max_steps=abc", "needs an integer >= 1"),
    ("rollout.engine=sglang", "use one of auto, compiled, hf, merged, vllm"),
    ("optimizer.name=adam", "use one of adamw, sgd"),
    ("algo.check=maybe", "use true or false"),
    ("trainer.logprob_chunk_size=0", "needs an integer >= 1, or null"),
    ("+algo.betas=[0.9,0.99]", "no such option"),
])
@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_the_line_says_what_is_allowed(compose, override, allowed):
    with pytest.raises(ConfigError) as err:
        validate(compose(["+recipe=quickstart", override]))
    assert f" is invalid: {allowed}" in str(err.value), str(err.value)


def test_plug_in_choices_come_from_their_registries(compose, monkeypatch):
    """A loss type, optimizer or rollout engine added to its registry is a legal value at once, nothing else edited."""
    from grpo_cli import algorithm, rollout
    from grpo_cli.step import optim

    monkeypatch.setitem(algorithm.LOSS_TYPES, "toy_loss", algorithm.LOSS_TYPES["grpo"])
    monkeypatch.setitem(optim.OPTIMIZERS, "toy_optimizer", lambda params, *, lr, weight_decay: None)
    monkeypatch.setitem(rollout.ENGINES, "toy_engine", rollout.HFEngine)
    validate(compose(["+recipe=quickstart", "algo.loss_type=toy_loss", "optimizer=sgd", "optimizer.name=toy_optimizer",
                      "~optimizer.momentum", "~optimizer.nesterov", "rollout.engine=toy_engine"]))
    with pytest.raises(ConfigError, match="use one of grpo, bnpo, dapo, dr_grpo, toy_loss"):
        validate(compose(["+recipe=quickstart", "algo.loss_type=nope"]))


def test_root_defaults_are_declared_once_in_the_schema(compose):
    """algo, rollout, trainer and eval come from schema.OPTIONS (stored as grpo_defaults), not from a YAML copy."""
    text = (CONF_DIR / "config.yaml").read_text()
    for section in ("algo", "rollout", "trainer", "eval"):
        assert f"\n{section}:" not in text
        assert OmegaConf.to_container(compose([])[section]) == root_defaults()[section]


def test_the_options_table_is_the_schemas():
    page = (REPO / "docs" / "options.md").read_text()  # the README links to it
    block = page.split("<!-- options:start -->\n")[1].split("<!-- options:end -->")[0]
    assert block == options_table() + "\n", (
        "docs/options.md's table is out of date; paste the output of `python -m grpo_cli.config --markdown` "
        "between its <!-- options:start --> and <!-- options:end --> lines")
    rows = block.splitlines()[2:]
    for option in OPTIONS:  # every option is in the table, alone or in its parent's row
        leaf, parent = option.key.rpartition(".")[2], option.key.rpartition(".")[0].replace("*", "NAME")
        assert any(f"`{option.key.replace('*', 'NAME')}`" in row or (f"`{parent}.`{{" in row and leaf in row)
                   for row in rows), option.key


@pytest.mark.slow
def test_help_lists_every_option_with_its_value_here(tmp_path):
    proc = run_cli(["+recipe=gsm8k", "--help"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    listed = proc.stdout.split("== Options")[1]
    for option in OPTIONS:
        assert f" {option.key.replace('*', 'NAME')} " in listed, option.key
    assert any(line.split()[:2] == ["algo.mini_batches", "4"] for line in listed.splitlines())  # the recipe's value


@pytest.mark.slow
@pytest.mark.parametrize("override", ["algo.beta=inf", "trainer.max_steps=abc", "optimizer.lr=nan"])
def test_non_numbers_for_numbers_are_one_line_exit_2(tmp_path, override):
    proc = run_cli(["+recipe=quickstart", "model=tiny", override], tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"grpo-train: {override} is invalid: needs "), proc.stderr
