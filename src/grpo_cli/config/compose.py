"""Composing the config: the recipes (packaged, then ./recipes of the working directory) in Hydra's ConfigStore,
the resolvers (${system_prompt:...}, ${packaged_data:...}, help), the schema's typed node Hydra composes into (a
value of the wrong type is refused while Hydra composes: `composition_checked` says it in the option's one line),
and every `${...}` resolving (`checked`: the composed config typed, once its sections, interpolations and options
are checked). What it may hold beyond its types is checked in config/rules.py (several keys together) and
run/validate.py, which asks the components."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import GrammarParseError, InterpolationResolutionError

from grpo_cli.base.errors import ConfigError
from grpo_cli.config.prompts import SYSTEM_PROMPTS
from grpo_cli.config.schema import (
    Config,
    check_options,
    check_sections,
    composition_problem,
    options_help,
    options_markdown,
    raw_value,
    schema_node,
)

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # src/grpo_cli: conf/, recipes/, sample_data/
CONF_DIR = PACKAGE_DIR / "conf"
RECIPES_DIR = PACKAGE_DIR / "recipes"
SAMPLE_DATA_DIR = PACKAGE_DIR / "sample_data"


def packaged_data(name: str) -> str:
    """``${packaged_data:gsm8k/train.jsonl}`` in a config: the path of a data file shipped in the package."""
    return str(SAMPLE_DATA_DIR / name)


# Registered on import: every command and test that composes a config imports this module first.
OmegaConf.register_new_resolver("packaged_data", packaged_data, replace=True)


def recipe_dirs() -> list[Path]:
    """Packaged recipes first, then ./recipes of the working directory (which may override them)."""
    return [RECIPES_DIR, Path.cwd() / "recipes"]


def group_options_with(key: str) -> tuple[str, list[str]] | None:
    """(group, the options of that config group whose YAML, or one it builds on, has `key`), e.g. `data.prompt_column`
    -> ("data", ["gsm8k", "gsm8k_sample", "hf"]); None for a key outside the groups, or that no option has."""
    group, _, rest = key.partition(".")
    folder = CONF_DIR / group
    if not rest or not folder.is_dir():
        return None

    def has(option: str, seen: frozenset = frozenset()) -> bool:
        file = folder / f"{option}.yaml"
        if option in seen or not file.is_file():
            return False
        cfg = cast(DictConfig, OmegaConf.load(file))  # a group option's file is a mapping of keys
        if OmegaConf.select(cfg, rest, default=None, throw_on_missing=False) is not None or rest in cfg:
            return True
        bases = [d for d in _defaults_list(cfg) if isinstance(d, str) and d != "_self_"]
        return any(has(base, seen | {option}) for base in bases)

    def builds_on_another(option: str) -> bool:
        defaults = _defaults_list(cast(DictConfig, OmegaConf.load(folder / f"{option}.yaml")))
        return any(isinstance(d, str) and d != "_self_" for d in defaults)

    # the options that stand alone first (hf before gsm8k, its preset): the one to suggest
    having = sorted((f.stem for f in folder.glob("*.yaml") if has(f.stem)), key=lambda o: (builds_on_another(o), o))
    return (group, having) if having else None


def _defaults_list(option_file: DictConfig) -> list:
    """The Hydra defaults list of a group option's file (the options it builds on); empty where it has none."""
    return list(option_file["defaults"]) if "defaults" in option_file else []


def unknown_key_hint(message: str) -> str | None:
    """Hydra's "Could not override 'KEY'" for a key of another option of KEY's config group: the one-line fix is that
    option (data=hf), not the `+KEY` that Hydra suggests."""
    if not message.startswith("Could not override '"):
        return None
    key = message.split("'")[1]
    found = group_options_with(key)
    if found is None:
        return None
    group, having = found
    return (f"{key} is a key of {group}={', '.join(having)}, not of the {group} option in use; pick that option, e.g. "
            f"{group}={having[0]} (the {group} group is chosen with {group}=OPTION"
            + (", not data.source" if group == "data" else "") + ")")


def available_recipes() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for folder in recipe_dirs():
        if folder.is_dir():
            for file in sorted(folder.glob("*.yaml")):
                found[file.stem] = file
    return found


def register_recipes() -> None:
    """Store each recipe as option `recipe=NAME` (package _global_) in Hydra's ConfigStore, so that
    `+recipe=NAME` finds recipes that live beside conf/ rather than inside it, and the user's own. A file that
    does not read as a recipe is left out: it matters only where it is named (`read_recipe` says why then)."""
    store = ConfigStore.instance()
    for name, file in available_recipes().items():
        try:
            node = read_recipe(file)
        except ConfigError:
            continue
        store.store(group="recipe", name=name, node=node, package="_global_")


def read_recipe(file: Path) -> DictConfig:
    """A recipe file's config; a ConfigError naming the file and the line where its YAML breaks, or saying that it
    holds no mapping of keys."""
    try:
        node = OmegaConf.load(file)
    except yaml.YAMLError as err:
        raise ConfigError(f"recipe {file.stem}: {file}{_yaml_problem(err)}; fix the YAML there") from None
    if not isinstance(node, DictConfig):
        raise ConfigError(f"recipe {file.stem}: {file} holds no mapping of keys; write it as `key: value` lines "
                          "(see the packaged recipes)")
    return node


def _yaml_problem(err: yaml.YAMLError) -> str:
    """`, line 4 is not valid YAML: expected ',' or ']', but got ':' (while parsing a flow sequence from line 3)`:
    where PyYAML's error (a page with the text quoted) found the problem, and what it was reading then."""
    mark, context, context_mark = (getattr(err, name, None) for name in ("problem_mark", "context", "context_mark"))
    problem = getattr(err, "problem", None) or str(err).strip().splitlines()[0]
    line = f", line {mark.line + 1}" if mark is not None else ""
    begun = f" ({context} from line {context_mark.line + 1})" if context and context_mark is not None else ""
    return f"{line} is not valid YAML: {problem}{begun}"


def system_prompt(name: str) -> str:
    """`${system_prompt:gsm8k}` in a data config: one of config/prompts.py's SYSTEM_PROMPTS."""
    if name not in SYSTEM_PROMPTS:
        raise ConfigError(f"system_prompt:{name} is not a known prompt; known: {', '.join(SYSTEM_PROMPTS)}")
    return SYSTEM_PROMPTS[name]


def recipes_help() -> str:
    """`${recipes:}` in the --help templates: one line per recipe, NAME and the first line of its comment."""
    lines = []
    for name, file in sorted(available_recipes().items()):
        comment = []
        for line in file.read_text().splitlines():
            if not line.startswith("#"):
                break
            if "@package" not in line:
                comment.append(line.lstrip("#").strip())
        text = " ".join(comment)
        about = text.split(". ")[0].rstrip(".") + "." if text else ""
        lines.append(f"  {name:<12} {about}".rstrip())
    return "\n".join(lines).replace("$", "$$") or "  (none)"  # Hydra fills the template with string.Template


def options_help_resolver(*, _root_: DictConfig) -> str:
    """`${options:}` in the --help templates: the options of schema.OPTIONS with their values as composed."""
    return options_help(_root_).replace("$", "$$")  # Hydra fills the template with string.Template


def default_config() -> DictConfig:
    """conf/config.yaml composed without overrides (each group at its default option), unresolved."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config")


def options_table() -> str:
    """The table of every option in docs/options.md (`python -m grpo_cli.config --markdown` prints it)."""
    return options_markdown(default_config())


# Registered on import: every command and test that composes a config imports this module first.
OmegaConf.register_new_resolver("system_prompt", system_prompt, replace=True)
OmegaConf.register_new_resolver("recipes", recipes_help, replace=True)
OmegaConf.register_new_resolver("options", options_help_resolver, replace=True)
# conf/config.yaml composes everything into the schema's typed node first: the root sections' defaults (algo,
# rollout, trainer, eval, sweep) and the types of every key
ConfigStore.instance().store(name="grpo_schema", node=schema_node())


@contextmanager
def composition_checked() -> Iterator[None]:
    """Hydra composing: a value of the wrong type that it refuses (an override's, a recipe's, a group option's)
    becomes the option's one ConfigError line instead of Hydra's page; any other error passes unchanged."""
    try:
        yield
    except Exception as err:
        problem = composition_problem(err)
        if problem is None:
            raise
        raise problem from None


def check_interpolations(cfg: DictConfig) -> None:
    """Every `${...}` must resolve; otherwise one line naming the key, instead of Hydra's page."""
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except (InterpolationResolutionError, GrammarParseError) as err:
        key = getattr(err, "full_key", None) or "?"
        reason = str(err).strip().splitlines()[0]
        raise ConfigError(f"{key}={raw_value(cfg, key)} is invalid: it does not resolve ({reason}); refer to an "
                          "existing key such as ${rollout.max_new_tokens}, or give a plain value") from None


def checked(cfg: DictConfig) -> Config:
    """The composed config as the typed Config, once its sections, every `${...}` and every option's value are
    checked (ConfigError in one line)."""
    check_sections(cfg)  # `algo=3`: before an option in it, or an interpolation into it, is blamed
    check_interpolations(cfg)
    check_options(cfg)
    return Config.of(cfg)
