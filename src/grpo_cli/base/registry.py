"""The one plug-in idiom: a named registry filled by a decorator.

    ENGINES = Registry("rollout engine", key="rollout.engine")

    @ENGINES.register("hf")
    class HFEngine: ...

Rollout engines, data sources, optimizers, loggers and loss types each have one registry, in the module that owns the
kind. Config validation reads the allowed names from it, so adding one is a module with a decorated
callable (plus a YAML file where a config group exists); nothing else lists the choices. A registry is a
dict (name -> the registered object) so lookups stay plain; `lookup` turns an unknown name into the one-line
ConfigError every entry point prints.

A user's own plug-in lives in their own module, named in the config (`plugins=[my_pkg.my_engine]`): the
commands import those modules (`import_plugins`) before they validate, so its registration runs first.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TypeVar

from grpo_cli.base.errors import ConfigError, error_line

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


def import_plugins(modules: Sequence[str] | None) -> None:
    """Import each module of the config key `plugins` (its registrations run); a bad name is one ConfigError."""
    if not modules:
        return
    if isinstance(modules, str) or not all(isinstance(m, str) and m.strip() for m in modules):
        raise ConfigError(f"plugins={modules} is invalid: give a list of module names, e.g. plugins=[my_pkg.my_engine]")
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise ConfigError(f"plugins={name} is invalid: it cannot be imported ({error_line(err)}); "
                              "put its folder on PYTHONPATH or fix the module name") from None
        except BaseException as err:  # user code: a SyntaxError, sys.exit, anything its import raises is one line
            text = " ".join(str(err).split())
            raise ConfigError(f"plugins={name} is invalid: importing it raised {type(err).__name__}"
                              f"{': ' + text if text else ''}; fix the module") from None
