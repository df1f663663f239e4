"""Memory (grpo_cli/step/memory.py): micro-batches cut by tokens, the plan a budget gives (and its refusal), the same
update whatever the cut, and the one line of a budget that is too small or of an allocation that failed."""

from __future__ import annotations

import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import fixed_batch, gradients_at_step, make_trainer, run_cli, tiny_lora_policy

from grpo_cli.base.errors import ConfigError
from grpo_cli.step import memory


def test_cut_by_rows_and_tokens():
    rows = slice(4, 10)
    assert memory.cut(rows, [5] * 6, None, None) == [slice(4, 10)]
    assert memory.cut(rows, [5] * 6, 2, None) == [slice(4, 6), slice(6, 8), slice(8, 10)]
    assert memory.cut(rows, [5, 5, 5, 30, 5, 5], None, 12) == [slice(4, 6), slice(6, 7), slice(7, 8), slice(8, 10)]
    assert memory.cut(rows, [5] * 6, 2, 12) == [slice(4, 6), slice(6, 8), slice(8, 10)]


def trainer_section(**given):
    return SimpleNamespace(**{"micro_batch_tokens": "auto", "gradient_checkpointing": False,
                              "memory_budget_gb": None, **given})


def test_the_plan_without_a_budget_is_the_settings_as_given():
    lm = tiny_lora_policy()
    plan = memory.plan(trainer_section(), lm, rows=8, longest_row=100, chunk_size=1024)
    assert plan == memory.MemoryPlan(memory.CPU_MICRO_BATCH_TOKENS, False)
    plan = memory.plan(trainer_section(micro_batch_tokens=None, gradient_checkpointing=True), lm, rows=8,
                       longest_row=100, chunk_size=1024)
    assert plan == memory.MemoryPlan(None, True)


def test_a_budget_takes_the_most_tokens_that_fit_then_checkpointing_then_refuses():
    lm = tiny_lora_policy()
    now = memory.in_use_bytes(lm.device)
    plain = memory.activation_bytes_per_token(lm.model.config, lm.dtype, False)
    lean = memory.activation_bytes_per_token(lm.model.config, lm.dtype, True)
    vocab = lm.model.get_output_embeddings().weight.shape[0]
    head = memory.HEAD_BLOCKS * 64 * vocab * 4
    row = 20_000  # the tiny model's rows must weigh far more than the process's own drift between two readings

    def budget_for(per_token: float, tokens: int) -> float:  # GiB that leave room for `tokens` and a little more
        return (now + head + (tokens + row / 2) * per_token) / 0.95 / memory.GIB

    roomy = memory.plan(trainer_section(micro_batch_tokens=None, memory_budget_gb=budget_for(plain, 3 * row)), lm,
                        rows=4, longest_row=row, chunk_size=64)
    assert not roomy.checkpointing and 3 * row <= roomy.micro_batch_tokens < 4 * row
    assert "trainer.memory_budget_gb=" in roomy.line() and "activation checkpointing off" in roomy.line()
    capped = memory.plan(trainer_section(micro_batch_tokens=30_000, memory_budget_gb=budget_for(plain, 3 * row)), lm,
                         rows=4, longest_row=row, chunk_size=64)
    assert capped.micro_batch_tokens == 30_000
    between = (now + head + row * (plain + lean) / 2) / 0.95 / memory.GIB  # one row fits checkpointed, not plain
    tight = memory.plan(trainer_section(memory_budget_gb=between), lm, rows=4, longest_row=row, chunk_size=64)
    assert tight.checkpointing and row <= tight.micro_batch_tokens < 2 * row * plain / lean
    with pytest.raises(ConfigError, match=r"trainer.memory_budget_gb=[\d.]+ is too small for rows of up to 20000 "
                                          r"tokens .*raise trainer.memory_budget_gb"):
        memory.plan(trainer_section(memory_budget_gb=budget_for(lean, row // 2)), lm, rows=4, longest_row=row,
                    chunk_size=64)


def test_the_activation_estimate_follows_the_widths():
    small = SimpleNamespace(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=128)
    per_layer = 6 * 64 + 2 * 32 + 4 * 128
    assert memory.activation_bytes_per_token(small, torch.float32, False) == pytest.approx(
        2 * per_layer * 4 * memory.ALLOCATOR_FACTOR)
    # checkpointed: both layers' inputs kept, one layer's saved values recomputed at a time
    assert memory.activation_bytes_per_token(small, torch.bfloat16, True) == pytest.approx(
        (2 * 64 + per_layer) * 2 * memory.ALLOCATOR_FACTOR)


@pytest.mark.slow
def test_micro_batches_cut_by_tokens_give_the_whole_batchs_gradient(compose, tmp_path):
    """Rows of about 40 tokens, at most 90 a micro-batch: two rows each; the gradient of the step equals the one
    micro-batch gradient to fp32 reordering (the bound of test_mini_batches)."""
    whole = make_trainer(compose, tmp_path, "trainer.micro_batch_tokens=null", "optimizer.lr=1e-2")
    cut = make_trainer(compose, tmp_path, "trainer.micro_batch_tokens=90", "optimizer.lr=1e-2")
    batch = fixed_batch(whole, lambda i, G: (i * 7 % 5) % G)
    _, minis = cut.mini_batch_layout(batch)
    assert len(minis[0].micro) > 2 and all(s.stop - s.start <= 2 for s in minis[0].micro)
    grads = [gradients_at_step(t) for t in (whole, cut)]
    whole.update(0, batch)
    cut.update(0, batch)
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5 * float(want.abs().max()))


TINY = ["+recipe=quickstart", "model=tiny", "trainer.device=cpu", "rollout.max_new_tokens=4", "data.prompts_per_step=2",
        "algo.num_generations=2", "trainer.log_samples_every=0"]


@pytest.mark.slow
def test_a_budget_too_small_stops_in_one_line_and_keeps_the_last_checkpoint(tmp_path):
    run = tmp_path / "run"
    proc = run_cli([*TINY, "trainer.max_steps=2", "trainer.save_every=1", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    proc = run_cli([*TINY, "trainer.max_steps=4", "trainer.save_every=1", "trainer.memory_budget_gb=0.01",
                    "trainer.resume=auto", "trainer.resume_allow_changes=[trainer.max_steps]", f"hydra.run.dir={run}"],
                   tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(r"grpo-train: trainer.memory_budget_gb=0.01 is too small for rows of up to "
                                        r"\d+ tokens .* raise trainer.memory_budget_gb", lines[0]), lines
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == kept


@pytest.mark.slow
def test_an_allocation_that_fails_is_one_line_naming_the_knobs_and_the_kept_checkpoint(tmp_path):
    """A real out-of-memory: the data segment limited (RLIMIT_DATA) below what the resumed run's full logits need
    (no chunking, one micro-batch: 8 x 768 positions x 49k vocabulary, 1.2 GB a copy): exit 1, one line, the
    checkpoint kept."""
    run = tmp_path / "run"
    proc = run_cli([*TINY, "trainer.max_steps=1", "trainer.save_every=1", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    heavy = ["rollout.max_new_tokens=768", "rollout.min_new_tokens=768", "algo.num_generations=4",
             "trainer.logprob_chunk_size=null", "trainer.micro_batch_tokens=null", "trainer.max_steps=2",
             "trainer.resume=auto",
             "trainer.resume_allow_changes=[rollout.max_new_tokens,rollout.min_new_tokens,algo.num_generations,"
             "trainer.max_steps]", f"hydra.run.dir={run}"]
    proc = run_cli([*TINY[:3], TINY[4], *TINY[6:], *heavy], tmp_path, rlimits={"RLIMIT_DATA": (2 * 2**30, 2 * 2**30)})
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr
    assert re.match(r"grpo-train: out of memory in step 1 on cpu: an allocation of [\d.]+ GiB failed \(peak so far "
                    r"[\d.]+ GiB\); set trainer.memory_budget_gb .*; the "
                    r"checkpoint after 1 step\(s\), .*step-000001, is kept; resume with the same command plus "
                    r"trainer.resume=auto", lines[-1]), lines[-3:]
    assert (run / "checkpoints" / "step-000001").is_dir()


FREED_AFTER_FRAGMENTING = """
import sys, torch
from grpo_cli.step import memory
if sys.argv[1] == "returned":
    assert memory.return_freed_blocks()
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
first = torch.ones(2**21)
del first  # one freed 8 MiB block raises glibc's moving threshold past 8 MiB: later ones come from the heap
blocks, kept = [], []
for _ in range(40):
    blocks.append(torch.ones(2**21))  # 8 MiB: a long row's activation
    kept.append(torch.ones(2**14))    # 64 KiB that outlives it, above it in the heap
held = rss()
del blocks
print((held - rss()) / 2**20)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
@pytest.mark.parametrize("allocator", ["default", "returned"])
def test_freed_blocks_go_back_to_the_system_once_returned(allocator):
    """40 freed 8 MiB blocks, each below a 64 KiB one still held: glibc's default keeps them all (its heap can only
    shrink from the top); after return_freed_blocks (what a budget sets on the CPU) all 320 MiB leave the process."""
    proc = subprocess.run([sys.executable, "-c", FREED_AFTER_FRAGMENTING, allocator], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    freed = float(proc.stdout.split()[-1])
    assert freed >= 300 if allocator == "returned" else freed < 100, freed


REUSED_WHILE_GENERATING = """
import resource, torch
from grpo_cli.step import memory
assert memory.return_freed_blocks()
def faults_of_reuse():  # a decode step's pattern: the same 2 MiB block allocated, written and freed, over and over
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(100):
        torch.ones(2**19).sum()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
returned = faults_of_reuse()
with memory.keeping_freed_blocks_while_generating(True):
    kept = faults_of_reuse()
    blocks, held = [], []
    for _ in range(40):
        blocks.append(torch.ones(2**21))  # 8 MiB, from the heap while generating
        held.append(torch.ones(2**14))    # 64 KiB above each, still held after
    del blocks
    inside = rss()
print(returned, kept, (inside - rss()) / 2**20)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_generation_reuses_freed_blocks_and_returns_them_when_it_ends():
    """With freed blocks returned (a budget), a 2 MiB block allocated again and again page-faults every time (512
    faults of 4 KiB each); while generating glibc keeps it for reuse (next to none), and on leaving, the 320 MiB
    freed inside leave the process although 64 KiB blocks above them are still held (the heap is trimmed)."""
    proc = subprocess.run([sys.executable, "-c", REUSED_WHILE_GENERATING], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    returned, kept, freed = (float(x) for x in proc.stdout.split()[-3:])
    assert returned >= 100 * 400 and kept < 100 * 50, (returned, kept)
    assert freed >= 300, freed


def test_a_budget_takes_the_head_in_small_blocks_and_returns_freed_blocks_on_the_cpu():
    lm = tiny_lora_policy()
    section = trainer_section(memory_budget_gb=memory.in_use_bytes(lm.device) / memory.GIB + 2)
    plan = memory.plan(section, lm, rows=4, longest_row=2000, chunk_size=1024)
    assert plan.head_chunk == memory.BUDGET_HEAD_CHUNK and plan.returns_freed_blocks
    assert f"the LM head {memory.BUDGET_HEAD_CHUNK} positions at a time, freed blocks returned" in plan.line()
    assert memory.plan(section, lm, rows=4, longest_row=2000, chunk_size=64).head_chunk == 64
    assert memory.plan(trainer_section(), lm, rows=4, longest_row=2000, chunk_size=1024).head_chunk is None
