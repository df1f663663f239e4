"""The one plug-in idiom: a named registry filled by a decorator.

    ENGINES = Registry("rollout engine", key="rollout.engine")

    @ENGINES.register("hf")
    class HFEngine: ...

Rollout engines, optimizers, loggers and loss types each have one registry, in the module that owns the
kind. Config validation reads the allowed names from it, so adding one is a module with a decorated
callable (plus a YAML file where a config group exists); nothing else lists the choices. A registry is a
dict (name -> the registered object) so lookups stay plain; `lookup` turns an unknown name into the one-line
ConfigError every entry point prints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from grpo_cli.errors import ConfigError

T = TypeVar("T")


class Registry(dict):
    """name -> registered object, for one kind of plug-in named by the config key `key`."""

    def __init__(self, kind: str, key: str):
        super().__init__()
        self.kind, self.key = kind, key

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: make the decorated object the `name` option of this registry."""

        def add(obj: T) -> T:
            if name in self:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self[name] = obj
            return obj

        return add

    def names(self) -> tuple[str, ...]:
        return tuple(self)

    def lookup(self, name: str):
        """The object registered as `name`, or the one-line ConfigError naming the choices."""
        if name in self:
            return self[name]
        raise ConfigError(f"{self.key}={name} is invalid: use one of {', '.join(self.names())}")
