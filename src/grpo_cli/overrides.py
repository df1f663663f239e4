"""Hydra override lines (`key=value`, `+key=value`, `++key=value`, `~key`) read without Hydra: kept free of
heavy imports, because the CLI reads them before anything else loads."""

from __future__ import annotations


def override_key(line: str) -> str:
    """The config key an override line (or a bare key) names, without Hydra's `+`, `++` or `~` prefix."""
    return str(line).partition("=")[0].lstrip("+~")
