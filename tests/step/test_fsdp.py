"""trainer.parallel=fsdp: the frozen base sharded over the ranks with FSDP2, on the CPU with gloo through torchrun for
real. The gradient equalities with DDP and one process are in test_distributed.py (one torchrun for both)."""

from __future__ import annotations

import pytest
from conftest import run_cli

from grpo_cli.base.errors import ConfigError

FSDP = ["+recipe=quickstart", "model=tiny", "trainer.device=cpu", "trainer.nproc=2", "trainer.parallel=fsdp"]

# what a sharded base does not run: each refused in one line naming the key, before anything loads
REFUSED = {
    "one rank": (["trainer.nproc=1"], r"trainer.parallel=fsdp is invalid: shards the base over the ranks and this "
                                      r"job has 1; launch it under torchrun or add trainer.nproc=2"),
    "int8": (["model.quantization=int8"], r"model.quantization=int8 is invalid: does not run under "
                                          r"trainer.parallel=fsdp .*use model.quantization=nf4"),
    "prepack": (["model.prepack=true"], r"model.prepack=true is invalid: packs whole weights, and under "
                                        r"trainer.parallel=fsdp a rank holds a shard of each; use model.prepack=auto"),
    "merged": (["rollout.engine=merged"], r"rollout.engine=merged is invalid: generates from the whole base .*use "
                                          r"rollout.engine=hf \(or auto\)"),
    "compiled": (["rollout.engine=compiled"], r"rollout.engine=compiled is invalid: generates from the whole base"),
    "vllm": (["rollout.engine=vllm"], r"rollout.engine=vllm is invalid: generates from the whole base"),
    "budget": (["trainer.memory_budget_gb=4"], r"trainer.memory_budget_gb=4(\.0)? is invalid: plans for the whole "
                                               r"base on each rank.*trainer.micro_batch_tokens"),
    "tools": (["rollout.tools=[grpo_cli.tasks.calculator.calculator]"],
              r"rollout.tools=\['grpo_cli.tasks.calculator.calculator'\] is invalid: takes a different number of "
              r"turns on each rank"),
    "worker": (["rollout.placement=worker"], r"rollout.placement=worker is invalid: does not run more than one rank"),
    "server": (["rollout.placement=server"], r"rollout.placement=server is invalid: does not run more than one rank"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_a_sharded_base_does_not_run_is_refused_in_one_line(compose, case):
    from grpo_cli.run.validate import validate

    overrides, line = REFUSED[case]
    with pytest.raises(ConfigError, match=line):
        validate(compose([*FSDP, *overrides]))


def test_ddp_runs_what_fsdp_refuses(compose):
    """The refusals are fsdp's: the same settings validate under ddp (their own rules aside)."""
    from grpo_cli.run.validate import validate

    for case in ("int8", "merged", "compiled", "budget", "tools"):
        overrides, _ = REFUSED[case]
        validate(compose([*FSDP, "trainer.parallel=ddp", *overrides]))


@pytest.mark.timeout(120)
def test_grpo_train_refuses_before_torchrun_starts(tmp_path):
    """`grpo-train trainer.nproc=2 trainer.parallel=fsdp model.quantization=int8`: the one line and exit 2, from the
    one process that checks the config before relaunching under torchrun (nothing loads, no rank starts)."""
    proc = run_cli([*FSDP, "model.quantization=int8", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, timeout=100)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("grpo-train: model.quantization=int8 is invalid"), proc.stderr
    assert "torch.distributed" not in proc.stderr and not (tmp_path / "run").exists()
