"""The C allocator grpo-train runs on (grpo_cli/model/allocator.py): TCMalloc where installed (make setup installs it),
glibc's with GRPO_CLI_ALLOCATOR=system or a memory budget on the command line, one line for what cannot be."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import run_cli

from grpo_cli.model import allocator

# the entry points' own first call, in a fresh interpreter: it re-executes itself with the allocator preloaded
PROBE = ("import sys; from grpo_cli.commands.cli import preload_libraries; preload_libraries(sys.argv[1:]); "
         "from grpo_cli.model.allocator import in_use; print(in_use())")


def allocator_of(*argv: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.ENV, allocator.REEXECUTED)}
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_tcmalloc_is_installed_and_preloaded_by_default():
    assert allocator.tcmalloc_library(), f"TCMalloc is not installed ({allocator.INSTALL}; make setup does it)"
    assert allocator_of("+recipe=quickstart") == "tcmalloc"
    assert allocator_of(**{allocator.ENV: "tcmalloc"}) == "tcmalloc"


def test_glibc_when_asked_or_for_a_budget_on_the_command_line():
    assert allocator_of(**{allocator.ENV: "system"}) == "system"
    assert allocator_of("trainer.memory_budget_gb=4") == "system"
    assert allocator_of("trainer.memory_budget_gb=null") == "tcmalloc"


TINY = ["+recipe=quickstart", "model=tiny", "trainer.device=cpu", "rollout.max_new_tokens=4", "data.prompts_per_step=2",
        "algo.num_generations=2", "trainer.log_samples_every=0", "trainer.max_steps=1"]


def test_an_unknown_allocator_or_a_budget_on_tcmalloc_stops_in_one_line(tmp_path):
    proc = run_cli([*TINY, f"hydra.run.dir={tmp_path / 'a'}"], tmp_path, env={allocator.ENV: "jemalloc"})
    assert proc.returncode != 0
    assert len(proc.stderr.strip().splitlines()) == 1 and "GRPO_CLI_ALLOCATOR='jemalloc'" in proc.stderr
    proc = run_cli([*TINY, "trainer.memory_budget_gb=4", f"hydra.run.dir={tmp_path / 'b'}"], tmp_path,
                   env={allocator.ENV: "tcmalloc"})
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "trainer.memory_budget_gb=4" in lines[0] and "GRPO_CLI_ALLOCATOR=system" in lines[0]
