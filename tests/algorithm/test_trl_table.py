"""docs/coming-from-trl.md: every default its table states is TRL 1.16's (`trl.GRPOConfig`) and ours (the composed
config), so the page a TRL user reads first cannot drift from either."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[2] / "docs" / "coming-from-trl.md"
ROW = re.compile(r"^\| `(\w+)` \| `([^`]+)` \| `([\w.\[\]]+)` \| `([^`]+)` \|")


def table_rows() -> list[tuple[str, object, str, object]]:
    rows = [ROW.match(line) for line in PAGE.read_text().splitlines()]
    return [(m[1], ast.literal_eval(m[2]), m[3], ast.literal_eval(m[4])) for m in rows if m]


def ours(cfg, key: str):
    """The value at `optimizer.betas[1]` or `algo.beta` of a composed config."""
    from omegaconf import OmegaConf

    path, index = re.fullmatch(r"([\w.]+)(?:\[(\d+)\])?", key).groups()
    value = OmegaConf.select(cfg, path, throw_on_missing=True)
    return value[int(index)] if index is not None else value


def test_the_table_has_the_options_a_trl_user_sets_first():
    names = {row[0] for row in table_rows()}
    assert {"learning_rate", "beta", "loss_type", "max_completion_length", "use_bias_correction_kl",
            "vllm_importance_sampling_mode", "epsilon", "scale_rewards"} <= names


def test_our_defaults_in_the_table_are_the_configs(compose):
    cfg = compose([])
    for trl_name, _, key, value in table_rows():
        got = ours(cfg, key)
        differs = f"{trl_name}: {key} is {got!r}, the table says {value!r}"
        assert got == value or (value is None and got is None), differs


@pytest.mark.slow  # imports TRL
def test_trls_defaults_in_the_table_are_trls():
    from trl import GRPOConfig

    defaults = {}
    for f in dataclasses.fields(GRPOConfig):
        defaults[f.name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    for trl_name, value, _, _ in table_rows():
        assert trl_name in defaults, f"GRPOConfig has no {trl_name}"
        assert defaults[trl_name] == value, f"GRPOConfig.{trl_name} defaults to {defaults[trl_name]!r}, not {value!r}"
