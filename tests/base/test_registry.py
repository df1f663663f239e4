"""registry.Registry: a name taken once by a decorator; an unknown name is the one-line ConfigError naming the
choices."""

from __future__ import annotations

import pytest

from grpo_cli.base.errors import ConfigError, UserError
from grpo_cli.base.registry import Registry


def test_the_decorator_registers_under_its_name_and_returns_the_object():
    engines = Registry("rollout engine", key="rollout.engine")

    @engines.register("toy")
    class Toy:
        pass

    @engines.register("other")
    def other():
        return "other"

    assert engines.names() == ("toy", "other")  # in registration order: the order of the error message
    assert engines.lookup("toy") is Toy and engines["other"] is other and other() == "other"


def test_a_name_registered_twice_is_refused():
    engines = Registry("rollout engine", key="rollout.engine")
    engines.register("toy")(object)
    with pytest.raises(ValueError, match="rollout engine 'toy' is registered twice"):
        engines.register("toy")(dict)
    assert engines["toy"] is object


def test_an_unknown_name_is_one_user_error_line_naming_the_key_and_the_choices():
    loggers = Registry("logger", key="logger.name")
    loggers.register("console")(object)
    loggers.register("wandb")(object)
    with pytest.raises(ConfigError) as err:
        loggers.lookup("tensorboard")
    assert isinstance(err.value, UserError)
    assert str(err.value) == "logger.name=tensorboard is invalid: use one of console, wandb"
