"""Every refusal names the key the user typed: advice of a rule that several keys share (a device) names the key
that failed, and a section given one value (`algo=3`, `rollout=foo` on the command line) is refused as that
section, not as an option in it or an interpolation into it that it broke."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_TRAINER, run_cli

from grpo_cli.base.errors import ConfigError


def refusal(compose, *overrides: str) -> str:
    from grpo_cli.run.validate import validate

    with pytest.raises(ConfigError) as err:
        validate(compose([*TINY_TRAINER, *overrides]))
    return str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_advice_names_the_device_key_that_was_typed(compose):
    worker = ("rollout.placement=worker", "rollout.max_staleness=1", "rollout.worker_device=cuda:1")
    assert refusal(compose, *worker) == ("rollout.worker_device=cuda:1 is invalid: no CUDA device is visible here; use "
                                         "rollout.worker_device=auto or cpu")
    assert refusal(compose, "trainer.device=cuda") == (
        "trainer.device=cuda is invalid: no CUDA device is visible here; use trainer.device=auto or cpu")


@pytest.mark.parametrize("override,line", [
    ("algo=3", "algo=3 is invalid: algo is a section of options, not one value; set the options in it, e.g. "
               "algo.num_generations=... (`grpo-train --help` lists them)"),
    ("rollout=foo", "rollout=foo is invalid: rollout is a section of options, not one value; set the options in it, "
                    "e.g. rollout.max_new_tokens=... (`grpo-train --help` lists them)"),
    ("trainer=null", "trainer=null is invalid: trainer is a section of options, not one value; set the options in it, "
                     "e.g. trainer.max_steps=... (`grpo-train --help` lists them)"),
    ("model.lora=3", "model.lora=3 is invalid: model.lora is a section of options, not one value; set the options in "
                     "it, e.g. model.lora.r=... (`grpo-train --help` lists them)"),
    ("+reward.functions.extra=3", "reward.functions.extra=3 is invalid: reward.functions.extra is a section of "
                                  "options, not one value; set the options in it, e.g. "
                                  "reward.functions.extra._target_=... (`grpo-train --help` lists them)"),
])
def test_a_section_given_one_value_is_refused_as_that_section(compose, override, line):
    assert refusal(compose, override) == line


def test_a_nested_section_may_be_null_where_its_group_option_has_none(compose):
    from grpo_cli.run.validate import validate

    validate(compose(["+recipe=quickstart", "rollout.max_new_tokens=6", "trainer.device=cpu"]))  # model.tiny: null


@pytest.mark.slow  # a grpo-train subprocess (no model is loaded)
def test_grpo_train_names_the_section_in_one_line(tmp_path):
    proc = run_cli([*TINY_TRAINER, "rollout=foo", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "grpo-train: rollout=foo is invalid: rollout is a section of options, not one value; set the options in it, "
        "e.g. rollout.max_new_tokens=... (`grpo-train --help` lists them)"]
