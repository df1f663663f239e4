"""What a tuple of declared options gives: each value checked (one ConfigError line naming the key, the value and
what is allowed), a key no option declares refused, the typed views components read, the root sections'
defaults, the option list of --help and the docs' configuration table.

`Option` and `Rule` are the vocabulary of a declaration, with the rules most options use (integer, number,
one_of, BOOLEAN, ...); `OptionTable` is the machinery over a tuple of them. It knows no option of grpo-cli:
those are declared once, in schema.py, which binds this machinery to them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from omegaconf import DictConfig, ListConfig, OmegaConf

from grpo_cli.errors import ConfigError

FROM_GROUP = object()  # the default is the picked group option's value
ABSENT = object()


def shown(value) -> str:
    """A value as YAML spells it: true, false, null."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return str(value)


def fail(key: str, value, allowed: str):
    raise ConfigError(f"{key}={shown(value)} is invalid: {allowed}")


@dataclass(frozen=True)
class Rule:
    """A test of one value. `allowed` says what passes (a callable for a registry's names, read when asked);
    the error line says `verb allowed`, or `failure` where that reads better."""

    test: Callable[[object], bool]
    allowed: str | Callable[[], str]
    verb: str = "needs"
    failure: str = ""
    choices: Callable[[], tuple] | None = None  # a rule that allows a list of values: that list, read when asked

    def describe(self) -> str:
        return self.allowed() if callable(self.allowed) else self.allowed

    def message(self, name: str) -> str:
        """`{name}` in the text becomes the key's last part: `needs 0 < clip_eps < 1`."""
        return (self.failure or f"{self.verb} {self.describe()}").replace("{name}", name)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def integer(minimum: int | None = None) -> Rule:
    if minimum is None:
        return Rule(is_int, "an integer")
    return Rule(lambda v: is_int(v) and v >= minimum, f"an integer >= {minimum}")


def number(low: float | None = None, high: float | None = None, *, low_open: bool = False,
           high_open: bool = False) -> Rule:
    """A finite number within the bounds given; `*_open` leaves the bound itself out."""
    def test(v) -> bool:
        return is_number(v) and (low is None or (v > low if low_open else v >= low)) and (
            high is None or (v < high if high_open else v <= high))

    if low is None and high is None:
        return Rule(test, "a finite number")
    if high is None:
        return Rule(test, f"{{name}} {'>' if low_open else '>='} {low}")
    return Rule(test, f"{low} {'<' if low_open else '<='} {{name}} {'<' if high_open else '<='} {high}")


def one_of(*choices, names: Callable[[], tuple] | None = None) -> Rule:
    """One of `choices`, or of the names `names()` returns when asked (a plug-in registry)."""
    def current() -> tuple:
        return names() if names else choices

    return Rule(lambda v: any(v == c and type(v) is type(c) for c in current()),
                lambda: ", ".join(shown(c) for c in current()), verb="use one of", choices=current)


BOOLEAN = Rule(lambda v: isinstance(v, bool), "true or false", verb="use")
AUTO_OR_BOOLEAN = Rule(lambda v: v == "auto" or isinstance(v, bool), "auto, true or false", verb="use")
TEXT = Rule(lambda v: isinstance(v, str) and bool(v.strip()), "a non-empty string")
ANY_TEXT = Rule(lambda v: isinstance(v, str), "a string")
MAPPING = Rule(lambda v: isinstance(v, DictConfig), "a mapping")
TEXT_LIST = Rule(lambda v: isinstance(v, ListConfig) and all(isinstance(t, str) for t in v), "a list of strings")


@dataclass(frozen=True)
class Option:
    """One config key. `nullable`: null is allowed too; `optional`: only some group options have the key;
    `free`: what lies below the key (a mapping) is the user's (a reward's options, a generator's arguments)."""

    key: str
    check: Rule | tuple[Rule, ...]
    help: str
    default: object = FROM_GROUP
    nullable: bool = False
    optional: bool = False
    free: bool = False
    row: str = ""  # options of one section with the same row share a line of the options table (docs/options.md)

    @property
    def rules(self) -> tuple[Rule, ...]:
        return self.check if isinstance(self.check, tuple) else (self.check,)

    def allowed(self) -> str:
        text = self.rules[0].describe()
        return f"{text}, or null" if self.nullable else text



# ---- helpers that need no table --------------------------------------------------------------------
def _annotation(option: Option) -> object:
    default = option.default
    if default is FROM_GROUP or default is None or isinstance(default, str) and default.startswith("${"):
        return object
    return tuple if isinstance(default, list) else type(default)


def _expand(cfg: DictConfig, key: str) -> Iterator[str]:
    """The keys of `cfg` that `key` names: itself, or one per entry where a part is `*`."""
    head, star, tail = key.partition(".*.")
    if not star:
        yield key
        return
    entries = OmegaConf.select(cfg, head)
    for name in entries.keys() if isinstance(entries, DictConfig) else ():
        yield from _expand(cfg, f"{head}.{name}.{tail}")


def _matches(pattern: str, key: str, *, prefix: bool = False) -> bool:
    """`key` is the option key `pattern` (a `*` part matches any name), or with prefix=True lies above it."""
    wanted, parts = pattern.split("."), key.split(".")
    if len(parts) > len(wanted) or (not prefix and len(parts) != len(wanted)):
        return False
    return all(w in ("*", k) for w, k in zip(wanted, parts, strict=False))


def raw_value(cfg: DictConfig | dict, key: str) -> str:
    """The value of `key` in `cfg` (or in its unresolved container) as written (`${...}` unresolved), or "-" where
    the composition lacks it."""
    node = cfg if isinstance(cfg, dict) else OmegaConf.to_container(cfg, resolve=False)
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return "-"
        node = node[part]
    return ("{...}" if node else "{}") if isinstance(node, dict) else shown(node)


def _display_key(option: Option) -> str:
    return option.key.replace("*", "NAME")


def _markdown_cells(cfg: DictConfig, option: Option) -> tuple[str, str, str]:
    """(default, allowed, help) of one option as the docs table shows them."""
    if "*" in option.key:
        default = ""
    elif option.default is FROM_GROUP:
        default = raw_value(cfg, option.key)
    else:
        default = shown(option.default)
    default = f"`{default}`" if default not in ("", "-") else default
    return default, option.allowed().replace("{name}", option.key.rpartition(".")[2]), option.help


class OptionTable:
    """The declared options, in order (the order of --help and of the docs table)."""

    def __init__(self, options: tuple[Option, ...]):
        self.options = options
        self._view_types: dict[str, type] = {}

    # ---- typed views: what a component reads of a section, one field per option ----------------------
    def section_options(self, section: str) -> tuple[Option, ...]:
        """The options directly under `section` (algo, rollout, trainer, eval, ...)."""
        return tuple(o for o in self.options if o.key.rpartition(".")[0] == section and "*" not in o.key)

    def view_type(self, section: str) -> type:
        """The dataclass of `section`'s options (AlgoOptions, ...), generated from the options: a field per option;
        one class per section, so a view can be recognised by its type."""
        if section not in self._view_types:
            fields = [(o.key.rpartition(".")[2], _annotation(o)) for o in self.section_options(section)]
            self._view_types[section] = dataclasses.make_dataclass(f"{section.title()}Options", fields)
        return self._view_types[section]

    def view(self, cfg_section, section: str):
        """`cfg_section` (a config section, validated) as the typed view of `section`: each option's value there,
        else its declared default (an optional group key it lacks: None); lists as tuples. A view is returned as
        it is."""
        kind = self.view_type(section)
        if isinstance(cfg_section, kind):
            return cfg_section
        values = {}
        for option in self.section_options(section):
            name = option.key.rpartition(".")[2]
            value = OmegaConf.select(cfg_section, name, default=ABSENT) if isinstance(cfg_section, DictConfig) else \
                cfg_section.get(name, ABSENT)
            if value is ABSENT:
                value = None if option.default is FROM_GROUP else option.default
            if isinstance(value, (ListConfig, DictConfig)):
                value = OmegaConf.to_container(value, resolve=True)
            values[name] = tuple(value) if isinstance(value, list) else value
        return kind(**values)

    def default_of(self, key: str) -> object:
        """The default `key` is declared with; ABSENT when it has none of its own (a group option's value)."""
        option = next((o for o in self.options if o.key == key), None)
        return ABSENT if option is None or option.default is FROM_GROUP else option.default

    def root_defaults(self) -> dict:
        """The root sections' defaults as nested dicts: stored as `grpo_defaults` for conf/config.yaml."""
        tree: dict = {}
        for option in self.options:
            if option.default is not FROM_GROUP:
                *parents, leaf = option.key.split(".")
                node = tree
                for part in parents:
                    node = node.setdefault(part, {})
                node[leaf] = option.default
        return tree

    # ---- checks --------------------------------------------------------------------------------------
    def check(self, cfg: DictConfig) -> None:
        """Raise ConfigError, one line naming the key, the value and what is allowed, for the first value an
        option refuses, or for a key that no option declares."""
        for option in self.options:
            for key in _expand(cfg, option.key):
                value = OmegaConf.select(cfg, key, default=ABSENT)
                if (value is ABSENT and option.optional) or (value is None and option.nullable):
                    continue
                value = None if value is ABSENT else value
                for rule in option.rules:
                    if not rule.test(value):
                        message = rule.message(key.rpartition(".")[2])
                        fail(key, value, f"{message}, or null" if option.nullable else message)
        for key, value in self._undeclared(cfg, ""):
            fail(key, value, f"{self.no_such_option(key)}; `grpo-train --help` lists them")

    def declares(self, key: str) -> bool:
        """`key` is an option's, lies above options (a section: model.lora) or below a `free` option (a reward's
        options, a generator's arguments)."""
        parts = key.split(".")
        above = [".".join(parts[:n]) for n in range(1, len(parts))]
        return any(_matches(o.key, key, prefix=True) or o.free and any(_matches(o.key, a) for a in above)
                   for o in self.options)

    def closest(self, key: str) -> str | None:
        """The declared key closest to `key` (one no option declares), when one is close: the same name in another
        section (algo.max_steps: trainer.max_steps), else the likeliest typo (difflib; algo.clip_epss: algo.clip_eps)."""
        keys = [o.key for o in self.options if "*" not in o.key]
        name = key.rpartition(".")[2]
        close = [k for k in keys if k.rpartition(".")[2] == name] or difflib.get_close_matches(key, keys, n=1, cutoff=0.75)
        return close[0] if close else None

    def no_such_option(self, key: str) -> str:
        """What the line says of a key no option declares: that, and the closest option's name."""
        close = self.closest(key)
        return f"no such option; the closest is {close}" if close else "no such option"

    def _undeclared(self, node: DictConfig, prefix: str) -> Iterator[tuple[str, object]]:
        """(key, value) for each key below `node` that no option declares, nor lies above one; below a `free`
        option everything is the user's (a reward's options, a generator's arguments)."""
        for name in node.keys():
            key, child = f"{prefix}{name}", OmegaConf.select(node, str(name))
            option = next((o for o in self.options if _matches(o.key, key)), None)
            if option is not None and (option.free or not isinstance(child, DictConfig)):
                continue
            if isinstance(child, DictConfig) and any(_matches(o.key, key, prefix=True) for o in self.options):
                yield from self._undeclared(child, key + ".")
            elif option is None:
                yield key, OmegaConf.to_container(child) if isinstance(child, DictConfig) else child

    # ---- --help and the docs table ---------------------------------------------------------------------
    def help(self, cfg: DictConfig) -> str:
        """The option list of --help: per section, one line per option (key, its value in `cfg`, help)."""
        lines, section = [], None
        written = OmegaConf.to_container(cfg, resolve=False)  # once: every compose resolves the --help text
        for option in self.options:
            head = option.key.split(".")[0]
            if head != section:
                lines.append(f"  {head}:" if section is None else f"\n  {head}:")
                section = head
            value = raw_value(written, option.key) if "*" not in option.key else ""
            value = value if len(value) <= 24 else value[:21] + "..."
            lines.append(f"    {_display_key(option):<34} {value:<24} {option.help}")
        return "\n".join(lines)

    def markdown_rows(self, cfg: DictConfig) -> list[str]:
        """One row per option; options three or more levels deep that share a parent (model.lora.*,
        logger.wandb.*), and options of a section declared with the same `row`, share a row, each part named, so
        the table stays short."""
        rows: list[tuple[str, list[Option]]] = []
        for option in self.options:
            section = option.key.rpartition(".")[0]
            shared = f"{section}/{option.row}" if option.row else section if option.key.count(".") >= 2 else option.key
            if rows and rows[-1][0] == shared and shared != option.key:
                rows[-1][1].append(option)
            else:
                rows.append((shared, [option]))
        lines = []
        for _, options in rows:
            if len(options) == 1:
                cells = _markdown_cells(cfg, options[0])
                key = f"`{_display_key(options[0])}`"
            else:
                names = [o.key.rpartition(".")[2] for o in options]
                parts = [_markdown_cells(cfg, o) for o in options]
                cells = tuple("; ".join(f"{n}: {c[i]}" for n, c in zip(names, parts, strict=True) if c[i] not in ("", "-"))
                              for i in range(3))
                parent = options[0].key.rpartition(".")[0].replace("*", "NAME")
                key = f"`{parent}.`{{{', '.join(names)}}}"
            lines.append(f"| {key} | {cells[0]} | {cells[1]} | {cells[2]} |".replace("|  |", "| |"))
        return lines

    def markdown(self, cfg: DictConfig) -> str:
        """The docs' configuration table: key | default | allowed | what it does. A group's keys show the value
        of `cfg` (the default composition); the root sections' the default declared."""
        return "\n".join(["| key | default | allowed | what it does |", "|---|---|---|---|", *self.markdown_rows(cfg)])
