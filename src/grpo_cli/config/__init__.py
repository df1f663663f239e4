"""The configuration: every option declared once (schema, over option_table's machinery), the rules that relate
several keys (rules), and composing a config from conf/, the recipes and the command line (compose).

May import: base. Below every component, which read their typed section (Config.of) from here; what a component
accepts of the config is asked of the component (run.validate), never listed here."""

from __future__ import annotations


def override_key(line: str) -> str:
    """The config key a Hydra override line (`key=value`, `+key=value`, `++key=value`, `~key`) or a bare key names,
    without Hydra: the CLI reads override lines before anything heavy loads."""
    return str(line).partition("=")[0].lstrip("+~")
