"""The LM-head block a memory budget chooses (MemoryPlan.head_chunk) is the one a real step's log-prob passes use:
each block of logits the head makes in GRPOTrainer.step is counted (torch's profiler records the shape of every
`logsumexp` over the vocabulary: one per block, rows = the block's positions), with more positions than one
block in the step's passes and a trainer.logprob_chunk_size four times the budget's block."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# one step of 4 prompts x 8 completions of 16 tokens (512 completion positions a pass) under a budget, in a process of
# its own: a budget has glibc return freed blocks process-wide (memory.return_freed_blocks), which would slow the
# tests that run after it in this one
ONE_STEP = r"""
import json, sys
import torch
from hydra import compose, initialize_config_dir
from grpo_cli.config.compose import CONF_DIR, composition_checked, register_recipes
from grpo_cli.config.schema import Config
from grpo_cli.step.trainer import GRPOTrainer

register_recipes()
with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"), composition_checked():
    cfg = compose("config", overrides=sys.argv[1:])
trainer = GRPOTrainer(Config.of(cfg))
vocab = trainer.model.get_output_embeddings().weight.shape[0]
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
    metrics, batch = trainer.step(0)
blocks = [e.input_shapes[0][0] for e in prof.events() if e.name == "aten::logsumexp" and e.input_shapes
          and len(e.input_shapes[0]) == 2 and e.input_shapes[0][1] == vocab]
print(json.dumps({"head_chunk": trainer.memory.head_chunk, "blocks": blocks,
                  "positions": int(batch.rollout.loss_mask().sum())}))
"""

STEP = ["+recipe=quickstart", "model=tiny", "trainer.device=cpu", "data.prompts_per_step=4", "algo.num_generations=8",
        "rollout.max_new_tokens=16", "rollout.min_new_tokens=16", "trainer.logprob_chunk_size=1024",
        "algo.beta=0.04", "trainer.max_steps=1"]


def one_step(*overrides: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", ONE_STEP, *STEP, *overrides], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two trainer processes
@pytest.mark.timeout(600)
def test_a_budgets_head_block_is_the_one_the_step_uses():
    from grpo_cli.step import memory

    budgeted = one_step("trainer.memory_budget_gb=6")
    assert budgeted["head_chunk"] == memory.BUDGET_HEAD_CHUNK < 1024
    assert budgeted["positions"] == 512  # more than one block's: the block size shows in the passes
    # the reference, the policy with entropy and its backward: blocks of the budget's size, the last of each pass less
    assert max(budgeted["blocks"]) == memory.BUDGET_HEAD_CHUNK, budgeted["blocks"]
    assert budgeted["blocks"].count(memory.BUDGET_HEAD_CHUNK) >= 4, budgeted["blocks"]
    plain = one_step()  # no budget: trainer.logprob_chunk_size, here more than a pass's positions
    assert plain["head_chunk"] is None and max(plain["blocks"]) == 512, plain["blocks"]
