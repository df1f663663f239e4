"""Identical runs write identical adapter configs; an int8 base's cast warning is said once; rich tables keep their
columns in a pipe."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys

import pytest
from rich.console import Console
from rich.table import Table

from grpo_cli.base.console import print_table

SAVE_ADAPTER = """
import sys, torch
from grpo_cli.model.loading import attach_lora, load_base_model, load_tokenizer
tokenizer = load_tokenizer("tiny-random")
base = load_base_model("tiny-random", tokenizer, torch.float32)
attach_lora(base, 8, 16, 0.0, "all-linear").save_pretrained(sys.argv[1])
"""


@pytest.mark.slow  # two interpreters that import torch and peft
def test_identical_runs_write_the_same_adapter_config(tmp_path):
    """peft keeps target_modules as a set: its order followed the string hash seed, which differs per process."""
    texts = []
    for hash_seed in ("1", "2"):
        out = tmp_path / f"adapter-{hash_seed}"
        proc = subprocess.run([sys.executable, "-c", SAVE_ADAPTER, str(out)], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "PYTHONHASHSEED": hash_seed})
        assert proc.returncode == 0, proc.stderr[-2000:]
        texts.append((out / "adapter_config.json").read_text())
    assert texts[0] == texts[1]
    modules = json.loads(texts[0])["target_modules"]
    assert modules == sorted(modules) and len(modules) == 14  # 7 linear layers in each of the 2 blocks


@pytest.mark.slow  # an int8 base through bitsandbytes
def test_the_int8_cast_warning_is_said_once(caplog):
    import torch

    from grpo_cli.commands.cli import _quiet_libraries
    from grpo_cli.model.loading import load_base_model, load_tokenizer

    pytest.importorskip("bitsandbytes")
    _quiet_libraries()
    tokenizer = load_tokenizer("tiny-random")
    model = load_base_model("tiny-random", tokenizer, torch.float32, quantization="int8", device=torch.device("cpu"))
    ids = torch.tensor([[1, 2, 3, 4]])
    with caplog.at_level(logging.WARNING):
        for _ in range(3):  # 14 int8 layers, each logs its cast on every forward
            with torch.no_grad():
                model(input_ids=ids)
    casts = [r for r in caplog.records if "inputs will be cast" in r.getMessage()]
    assert len(casts) == 1, [r.getMessage() for r in caplog.records]


def test_a_wide_table_keeps_its_columns_in_a_pipe():
    """rich assumes 80 columns off a terminal and squashes a table wider than that to one-character slivers."""
    table = Table(title="sweep cells")
    headers = ["rank", "algo.beta", "algo.clip_eps", "rollout.temperature", "n", "mean ± CI", "p vs best", "paired p",
               "label"]
    for header in headers:
        table.add_column(header, no_wrap=header == "label")
    table.add_row("1", "0.04", "0.1", "0.7", "1", "0.5400 (n = 1)", "-", "-",
                  "★ best; n = 1: no interval (sweep trainer.seed for one)")
    out = io.StringIO()
    print_table(Console(file=out, width=80), table)
    header_line = next(line for line in out.getvalue().splitlines() if "rank" in line)
    assert [cell.strip() for cell in header_line.strip("┃ ").split("┃")] == headers
    assert "★ best; n = 1: no interval (sweep trainer.seed for one)" in out.getvalue()
