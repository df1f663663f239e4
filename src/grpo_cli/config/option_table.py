"""What a tree of frozen config dataclasses gives: each value checked (one ConfigError line naming the key, the
value and what is allowed), a key no option declares refused, the typed config built from a composed one, the
typed node Hydra composes into (its ConfigStore entry), the root sections' defaults, the option list of --help
and the docs' configuration table.

A field is declared once, with `option(help, default, check)`: its annotation is its type (`Literal[...]` for a
fixed set of choices, `X | None` where null is allowed), its default the dataclass's, and its check the rule (or
rules) its values must pass; bool and Literal fields need none, it follows from the type. `Rule` and the rules
most options use (integer, number, one_of, BOOLEAN, ...: config/rule.py) are the vocabulary of a declaration;
`OptionTable` is the machinery over a root dataclass. It knows no option of grpo-cli: those are declared once, in
schema.py, which binds this machinery to them.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeGuard, TypeVar, Union

from omegaconf import MISSING, DictConfig, IntegerNode, ListConfig, OmegaConf, StringNode, UnionNode
from omegaconf.errors import ValidationError
from omegaconf.nodes import BooleanNode

from grpo_cli.base.errors import ConfigError
from grpo_cli.config.rule import BOOLEAN, MAPPING, Rule, fail, one_of, shown

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ABSENT = object()
REQUIRED = dataclasses.MISSING  # a field without a default: the config group's option gives its value
T = TypeVar("T", bound="DataclassInstance")


# ---- declaring a field -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Declared:
    """What `option` puts in a field's metadata beside its type and default."""

    help: str
    checks: tuple[Rule, ...]  # empty: the rule follows from the type (bool, Literal)
    row: str = ""             # options of one section with one row share a line of the table (docs/options.md)
    optional: bool = False    # only some options of its config group have the key (its default stands in)
    free: bool = False        # what lies below the key (a mapping) is the user's: a reward's options, say
    null: bool | None = None  # None: null allowed where the type says `| None`; False: None only stands for absent


OPTION, GROUP, EXTRAS = "grpo_option", "grpo_group", "grpo_extras"


def option(help: str, default: Any = REQUIRED, check: Rule | tuple[Rule, ...] = (), *, row: str = "",
           optional: bool = False, free: bool = False, null: bool | None = None) -> Any:
    """A config field: its one line of help, its default (none: the picked option of its config group gives it)
    and the rule its values must pass. A mutable default (a dict) is kept read-only. `null=False`: the key is
    an optional one whose None default stands for its absence, and null is no value to give it."""
    checks = check if isinstance(check, tuple) else (check,)
    metadata = {OPTION: Declared(help, checks, row, optional, free, null)}
    if isinstance(default, dict):
        return dataclasses.field(default_factory=functools.partial(types.MappingProxyType, default),
                                 metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def section(kind: type | None = None) -> Any:
    """A section of the root config: with `kind`, a root section whose defaults are its fields' (algo, trainer,
    ...); without, a config group whose values its picked option gives (model=NAME, data=NAME, ...)."""
    if kind is None:
        return dataclasses.field(metadata={GROUP: True})
    return dataclasses.field(default_factory=kind)


def extras() -> Any:
    """The field of an open section (one with a class-level `OPEN` help line) that holds the keys it does not
    declare: a plug-in optimizer's own keys, a reward function's options."""
    return dataclasses.field(default_factory=dict, metadata={EXTRAS: True})


# ---- what an annotation says -------------------------------------------------------------------------
def _without_none(annotation) -> tuple[Any, bool]:
    """(the annotation less None, whether None is allowed)."""
    if typing.get_origin(annotation) in (Union, types.UnionType) and type(None) in typing.get_args(annotation):
        rest = tuple(a for a in typing.get_args(annotation) if a is not type(None))
        return (rest[0] if len(rest) == 1 else Union[rest]), True  # noqa: UP007 (a tuple of types)
    return annotation, False


def _members(annotation) -> tuple:
    """The types a union is made of (Literal choices read as their types), or the annotation alone."""
    members = typing.get_args(annotation) if typing.get_origin(annotation) in (Union, types.UnionType) else (
        annotation,)
    return tuple(type(typing.get_args(m)[0]) if typing.get_origin(m) is Literal else m for m in members)


def _is_dataclass(annotation: object) -> TypeGuard[type[DataclassInstance]]:
    return dataclasses.is_dataclass(annotation)  # of an annotation: a class, never an instance


def _entry(annotation) -> type[DataclassInstance] | None:
    """The dataclass of each value of a `Mapping[str, SomeConfig]` (reward.functions), else None."""
    if typing.get_origin(annotation) is Mapping or typing.get_origin(annotation) is dict:
        value = typing.get_args(annotation)[1]
        return value if _is_dataclass(value) else None
    return None


def _is_sequence(annotation) -> bool:
    return typing.get_origin(annotation) in (tuple, list)


def _checks_from(annotation) -> tuple[Rule, ...]:
    """The rule a bool or a Literal field's type says."""
    if annotation is bool:
        return (BOOLEAN,)
    if typing.get_origin(annotation) is Literal:
        return (one_of(*typing.get_args(annotation)),)
    raise TypeError(f"a field of type {annotation} needs its check declared")


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# ---- the options of a tree of dataclasses ----------------------------------------------------------
@dataclass(frozen=True)
class Option:
    """One config key. `nullable`: null is allowed too; `optional`: only some group options have the key;
    `free`: what lies below the key (a mapping) is the user's (a reward's options, a generator's arguments);
    `from_group`: a key of a config group, whose value the picked option gives (docs and --help show that)."""

    key: str
    rules: tuple[Rule, ...]
    help: str
    default: Any  # REQUIRED: the picked option of its config group gives it
    annotation: Any = Any
    nullable: bool = False
    optional: bool = False
    free: bool = False
    row: str = ""
    from_group: bool = False

    def allowed(self) -> str:
        text = self.rules[0].describe()
        return f"{text}, or null" if self.nullable else text

    def refusal(self, key: str, value) -> str | None:
        """What the error line says of `value` at `key` (one of this option's keys): None when it passes."""
        if value is None and self.nullable:
            return None
        for rule in self.rules:
            if not rule.test(value):
                message = rule.message(key)
                return f"{message}, or null" if self.nullable else message
        return None


def options_of(cls: type, prefix: str = "", *, from_group: bool = False,
               optional: bool = False) -> Iterator[Option]:
    """The options of dataclass `cls` under `prefix`, in field order: a nested dataclass's own, the entries of a
    mapping of dataclasses under `prefix.*`."""
    if open_help := getattr(cls, "OPEN", None):
        yield Option(prefix, (MAPPING,), open_help, REQUIRED, free=True, from_group=from_group)
    for field in dataclasses.fields(cls):
        if field.metadata.get(EXTRAS):
            continue
        key = f"{prefix}.{field.name}" if prefix else field.name
        declared: Declared | None = field.metadata.get(OPTION)
        annotation, nullable = _without_none(hints(cls)[field.name])
        in_group = from_group or bool(field.metadata.get(GROUP))
        below_optional = optional or (declared is not None and declared.optional)
        if _is_dataclass(annotation):
            yield from options_of(annotation, key, from_group=in_group, optional=below_optional)
            continue
        if declared is None:
            continue  # not an option: a record the typed config carries (Config.composed)
        nullable = nullable if declared.null is None else declared.null
        default = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
        yield Option(key, declared.checks or _checks_from(annotation), declared.help, default, annotation,
                     nullable, below_optional, declared.free, declared.row, in_group)
        entry = _entry(annotation)
        if entry is not None:
            yield from options_of(entry, f"{key}.*", from_group=in_group, optional=below_optional)


# ---- the typed config from a composed one ------------------------------------------------------------
def typed(cls: type[T], values: Mapping | DictConfig | None, prefix: str = "") -> T:
    """`values` (a config section, resolved; its absent keys take their defaults) as the frozen dataclass `cls`:
    lists become tuples, a nested section its dataclass, the keys an open section does not declare its extras
    field. A key no field declares is a ConfigError (validation refuses it first)."""
    if isinstance(values, DictConfig):
        values = typing.cast(dict, OmegaConf.to_container(values, resolve=True))
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    spare = next((name for name, f in fields.items() if f.metadata.get(EXTRAS)), None)
    known = {name: _typed_value(hints(cls)[name], value, f"{prefix}{name}")
             for name, value in values.items() if name in fields and name != spare}
    unknown = {name: value for name, value in values.items() if name not in fields}
    if unknown and spare is None:
        name, value = next(iter(unknown.items()))
        fail(f"{prefix}{name}", value, "no such option")
    return cls(**known, **({spare: unknown} if spare else {}))


def _typed_value(annotation, value, key: str):
    annotation, _ = _without_none(annotation)
    if value is None:
        return None
    if _is_dataclass(annotation):
        return typed(annotation, value, f"{key}.")
    entry = _entry(annotation)
    if entry is not None:
        return {name: typed(entry, spec, f"{key}.{name}.") for name, spec in value.items()}
    if isinstance(value, list):
        return tuple(value)
    return value


def plain(value):
    """A typed config (or a part of it) as YAML would hold it: dataclasses as dicts, tuples as lists."""
    if dataclasses.is_dataclass(value):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if f.metadata.get(OPTION) or dataclasses.is_dataclass(getattr(value, f.name))}
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    return value


# ---- the node Hydra composes into --------------------------------------------------------------------
def _value_node(annotation, nullable: bool, value):
    """The typed node of one field: OmegaConf's own int, bool and string nodes and a union of int and float for
    a number, none of them converting (its `convert` flag off: "3" is not read as 3, nor 1 as true), so a value
    of another type fails the composition and the option's rule says why; a list node that refuses a single
    value. What has no strict node (a mapping, a value of several kinds of which one is a list) is left untyped."""
    value = MISSING if value is REQUIRED else value
    strict = {"convert": False}
    if _is_sequence(annotation):
        return ListConfig(list(value) if isinstance(value, (tuple, list)) else value, is_optional=nullable,
                          ref_type=list[Any])
    members = _members(annotation)
    if members == (bool,):
        return BooleanNode(value, is_optional=nullable, flags=strict)
    if members == (int,):
        return IntegerNode(value, is_optional=nullable, flags=strict)
    if members == (float,):
        return UnionNode(value, Union[int, float], is_optional=nullable)  # noqa: UP007 (OmegaConf reads a Union)
    if members == (str,) or set(members) == {str}:
        return StringNode(value, is_optional=nullable, flags=strict)
    if all(m in (str, int, bool) for m in members):
        return UnionNode(value, Union[tuple(dict.fromkeys(members))], is_optional=nullable)  # noqa: UP007
    return value


def schema_node(cls: type, *, from_group: bool = False) -> DictConfig:
    """The typed node of dataclass `cls` as Hydra composes into it: every field a typed node holding its default,
    or missing (???) where the picked option of its config group gives it; the keys only some options of a group
    have are left out (their option adds them), so that a key of another option is refused as Hydra refuses it."""
    node = DictConfig({})
    for field in dataclasses.fields(cls):
        declared: Declared | None = field.metadata.get(OPTION)
        if field.metadata.get(EXTRAS) or (declared is not None and declared.optional):
            continue
        annotation, nullable = _without_none(hints(cls)[field.name])
        in_group = from_group or bool(field.metadata.get(GROUP))
        if _is_dataclass(annotation):
            node[field.name] = schema_node(annotation, from_group=in_group)
        elif declared is not None:
            default = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
            node[field.name] = _value_node(annotation, nullable, plain(default))
            if declared.free and isinstance(default, Mapping):  # the user's keys below it: an override adds them
                child = node._get_node(field.name)
                assert child is not None  # set just above
                child._set_flag("struct", False)
    return node


def composition_problem(err: BaseException, options: tuple[Option, ...]) -> ConfigError | None:
    """Hydra's error for a value of the wrong type (OmegaConf refused it while composing: an override, a recipe's
    or a group option's value) as the option's one line; None for any other error."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, ValidationError) and id(cause) not in seen:
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    if not isinstance(cause, ValidationError) or not cause.full_key:
        return None
    key, value = str(cause.full_key), cause.value
    option = next((o for o in options if _matches(o.key, key)), None)
    if option is None:
        return None
    refusal = option.refusal(key, value)
    if refusal is None:  # it passes the rule but not the type: the rule's own words say what is wanted
        refusal = option.rules[0].message(key)
    return ConfigError(f"{key}={shown(value)} is invalid: {refusal}")


# ---- helpers that need no table --------------------------------------------------------------------
def _expand(cfg: DictConfig, key: str) -> Iterator[str]:
    """The keys of `cfg` that `key` names: itself, or one per entry where a part is `*`."""
    head, star, tail = key.partition(".*.")
    if not star:
        yield key
        return
    entries = OmegaConf.select(cfg, head)
    for name in entries.keys() if isinstance(entries, DictConfig) else ():
        yield from _expand(cfg, f"{head}.{name!s}.{tail}")


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
    elif option.from_group:
        default = raw_value(cfg, option.key)
    else:
        default = shown(plain(option.default))
    default = f"`{default}`" if default not in ("", "-") else default
    return default, option.allowed().replace("{name}", option.key.rpartition(".")[2]), option.help


class OptionTable:
    """The options of a root config dataclass, in field order (the order of --help and of the docs table)."""

    def __init__(self, root: type):
        self.root = root
        self.options = tuple(options_of(root))

    def default_of(self, key: str) -> object:
        """The default `key` is declared with (a config group's key only when some options lack it); ABSENT for a
        key without one (its group's option gives the value) and for a key no option declares."""
        option = next((o for o in self.options if o.key == key), None)
        return ABSENT if option is None or option.default is REQUIRED else plain(option.default)

    def root_defaults(self) -> dict:
        """The root sections' defaults as nested dicts (what schema_node holds of them)."""
        tree: dict = {}
        for option in self.options:
            if not option.from_group and option.default is not REQUIRED and "*" not in option.key:
                *parents, leaf = option.key.split(".")
                node = tree
                for part in parents:
                    node = node.setdefault(part, {})
                node[leaf] = plain(option.default)
        return tree

    def schema_node(self) -> DictConfig:
        return schema_node(self.root)

    def composition_problem(self, err: BaseException) -> ConfigError | None:
        return composition_problem(err, self.options)

    # ---- checks --------------------------------------------------------------------------------------
    def check(self, cfg: DictConfig) -> None:
        """Raise ConfigError, one line naming the key, the value and what is allowed, for the first value an
        option refuses, or for a key that no option declares."""
        for option in self.options:
            for key in _expand(cfg, option.key):
                value = OmegaConf.select(cfg, key, default=ABSENT)
                if value is ABSENT and option.optional:
                    continue
                value = None if value is ABSENT else value
                refusal = option.refusal(key, value)
                if refusal is not None:
                    fail(key, value, refusal)
        for key, value in self._undeclared(cfg, ""):
            fail(key, value, f"{self.no_such_option(key)}; `grpo-train --help` lists them")

    def check_sections(self, cfg: DictConfig) -> None:
        """ConfigError for a section (algo, model.lora, reward.functions.NAME) given one value (`algo=3` on the command
        line, a top-level one null), naming that key: otherwise an option in it, or an interpolation into it, would be
        the key the refusal names."""
        keys = [o.key for o in self.options]  # in field order: the example is a section's first option
        sections = dict.fromkeys(".".join(k.split(".")[:n]) for k in keys for n in range(1, k.count(".") + 1))
        for section in (s for s in sections if s not in keys):
            for key in _expand(cfg, section + "." if section.endswith(".*") else section):
                key = key.rstrip(".")
                value = OmegaConf.select(cfg, key, default=ABSENT, throw_on_missing=False)
                if value is ABSENT or isinstance(value, DictConfig) or (value is None and "." in key):
                    continue
                example = next(k for k in keys if k.startswith(f"{section}.")).replace(section, key, 1)
                fail(key, value, f"{key} is a section of options, not one value; set the options in it, e.g. "
                                 f"{example.replace('*', 'NAME')}=... (`grpo-train --help` lists them)")

    def declares(self, key: str) -> bool:
        """`key` is an option's, lies above options (a section: model.lora) or below a `free` option (a reward's
        options, a generator's arguments)."""
        parts = key.split(".")
        above = [".".join(parts[:n]) for n in range(1, len(parts))]
        return any(_matches(o.key, key, prefix=True) or o.free and any(_matches(o.key, a) for a in above)
                   for o in self.options)

    def closest(self, key: str) -> str | None:
        """The declared key closest to `key` (one no option declares), when one is close: the same name in another
        section (algo.max_steps: trainer.max_steps), else the likeliest typo (difflib; algo.clip_epss:
        algo.clip_eps)."""
        keys = [o.key for o in self.options if "*" not in o.key]
        name = key.rpartition(".")[2]
        same_name = [k for k in keys if k.rpartition(".")[2] == name]
        close = same_name or difflib.get_close_matches(key, keys, n=1, cutoff=0.75)
        return close[0] if close else None

    def no_such_option(self, key: str) -> str:
        """What the line says of a key no option declares: that, and the closest option's name."""
        close = self.closest(key)
        return f"no such option; the closest is {close}" if close else "no such option"

    def _undeclared(self, node: DictConfig, prefix: str) -> Iterator[tuple[str, object]]:
        """(key, value) for each key below `node` that no option declares, nor lies above one; below a `free`
        option everything is the user's (a reward's options, a generator's arguments)."""
        for name in node.keys():
            key, child = f"{prefix}{name!s}", OmegaConf.select(node, str(name))
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
        lines, section_name = [], None
        # once: every compose resolves the --help text
        written = typing.cast(dict, OmegaConf.to_container(cfg, resolve=False))
        for option in self.options:
            head = option.key.split(".")[0]
            if head != section_name:
                lines.append(f"  {head}:" if section_name is None else f"\n  {head}:")
                section_name = head
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
            parent = option.key.rpartition(".")[0]
            nested = option.key.count(".") >= 2
            shared = f"{parent}/{option.row}" if option.row else parent if nested else option.key
            if rows and rows[-1][0] == shared and shared != option.key:
                rows[-1][1].append(option)
            else:
                rows.append((shared, [option]))
        return [self._markdown_row(cfg, options) for _, options in rows]

    @staticmethod
    def _markdown_row(cfg: DictConfig, options: list[Option]) -> str:
        if len(options) == 1:
            cells: tuple[str, ...] = _markdown_cells(cfg, options[0])
            key = f"`{_display_key(options[0])}`"
        else:
            names = [o.key.rpartition(".")[2] for o in options]
            parts = [_markdown_cells(cfg, o) for o in options]
            cells = tuple("; ".join(f"{name}: {cell[i]}" for name, cell in zip(names, parts, strict=True)
                                    if cell[i] not in ("", "-"))
                          for i in range(3))
            parent = options[0].key.rpartition(".")[0].replace("*", "NAME")
            key = f"`{parent}.`{{{', '.join(names)}}}"
        return f"| {key} | {cells[0]} | {cells[1]} | {cells[2]} |".replace("|  |", "| |")

    def markdown(self, cfg: DictConfig) -> str:
        """The docs' configuration table: key | default | allowed | what it does. A group's keys show the value
        of `cfg` (the default composition); the root sections' the default declared."""
        header = ["| key | default | allowed | what it does |", "|---|---|---|---|"]
        return "\n".join([*header, *self.markdown_rows(cfg)])
