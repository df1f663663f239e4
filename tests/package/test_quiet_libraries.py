"""What libraries log on import is kept out of the run's lines where it is noise (grpo_cli/__init__.py's filters):
checked through the libraries' own loggers, in a fresh interpreter, on any CPU (bitsandbytes takes the path that logs
these only on CPUs with AVX-512 BF16, so a run on another machine would not show them)."""

import importlib.util
import os
import subprocess
import sys

import pytest

PROGRAM = """
import grpo_cli
import bitsandbytes
from bitsandbytes.backends.cpu import ops
from kernels._internals import hf_hub

hf_hub.logger.warning("Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes' because "
                      "Hugging Face Hub is in offline mode.")
ops.logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: not in the local cache")
ops.logger.warning("a line of bitsandbytes that says something else")
"""


@pytest.mark.slow  # a fresh interpreter imports torch (~6 s)
@pytest.mark.skipif(importlib.util.find_spec("kernels") is None or importlib.util.find_spec("bitsandbytes") is None,
                    reason="needs bitsandbytes and kernels (make setup installs both)")
def test_the_missing_hub_kernel_notes_are_not_printed_and_other_lines_are():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == ["a line of bitsandbytes that says something else"], proc.stderr
