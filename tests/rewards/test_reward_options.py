"""A reward function's options are checked against its named parameters, a typo answered with the closest name, even
when it takes **kwargs; what is meant for its **kwargs is said as such, under `kwargs`."""

from __future__ import annotations

import pytest

from grpo_cli.base.errors import ConfigError
from grpo_cli.config.schema import Config
from grpo_cli.rewards import RewardSet
from grpo_cli.run.validate import validate

MODULE = ("def longer_than(prompts, completions, min_chars=0, **kwargs):\n"
          "    return [float(len(c) > min_chars) + len(kwargs.get('flavour', '')) for c in completions]\n")


@pytest.fixture
def longer_than(tmp_path, monkeypatch):
    (tmp_path / "typo_rewards.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return ["+recipe=quickstart", "model=tiny", "+reward.functions.long._target_=typo_rewards.longer_than"]


def test_a_typo_in_an_option_of_a_function_with_kwargs_is_one_line_with_the_closest_name(compose, longer_than):
    with pytest.raises(ConfigError) as err:
        validate(compose([*longer_than, "+reward.functions.long.min_char=3"]))
    assert str(err.value) == (
        "reward.functions.long.min_char=3 is invalid: typo_rewards.longer_than takes no option min_char (it takes "
        "**kwargs: give what is meant for them under reward.functions.long.kwargs.min_char); did you mean min_chars?")


def test_options_for_kwargs_are_said_under_kwargs(compose, longer_than):
    cfg = compose([*longer_than, "+reward.functions.long.min_chars=3", "+reward.functions.long.kwargs.flavour=ab"])
    validate(cfg)
    _, per_fn, _ = RewardSet.from_config(Config.of(cfg).reward).score(["p"] * 2, ["12", "1234"],
                                                                     {"answer": ["1", "1"]})
    assert per_fn["long"] == [2.0, 3.0]  # min_chars=3 as its keyword, flavour="ab" in its **kwargs
