"""Data-parallel GRPO on the CPU with gloo, through torchrun for real."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import REPO, read_jsonl

pytestmark = pytest.mark.slow  # every test here runs torchrun training jobs


def torchrun() -> list[str]:
    with socket.socket() as sock:  # a free loopback port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
            f"--master_port={port}"]

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}


def test_two_process_run_writes_once_from_rank_zero(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([*torchrun(), "-m", "grpo_cli.train", "+recipe=quickstart", "model=tiny", "trainer.max_steps=2",
                           "trainer.device=cpu", "rollout.max_new_tokens=4", "trainer.log_samples_every=1",
                           f"hydra.run.dir={run}"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    samples = read_jsonl(run / "samples.jsonl")
    assert len(samples) == 2 * 2 * 8  # 2 steps x rank 0's 2 of the 4 prompts x G=8, written once


WORKER = textwrap.dedent('''
    import json, os, sys, torch
    from hydra import compose, initialize_config_dir
    from grpo_cli.config import CONF_DIR, register_recipes
    from grpo_cli.trainer import Batch, GRPOTrainer
    from grpo_cli.rollout import Rollout

    out, overrides = sys.argv[1], json.loads(sys.argv[2])
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    trainer = GRPOTrainer(cfg, os.path.dirname(out))
    full = torch.load(sys.argv[3], weights_only=False)
    rank, world = trainer.dist.rank, trainer.dist.world_size
    G, P = full.rollout.group_size, full.rollout.prompt_ids.shape[0]
    p = slice(rank * P // world, (rank + 1) * P // world)
    r = slice(p.start * G, p.stop * G)
    roll = full.rollout
    part = Batch(Rollout(roll.prompt_ids[p], roll.prompt_mask[p], roll.completion_ids[r], roll.completion_mask[r],
                         roll.truncated[r], roll.texts[r], G), full.prompts[r], full.rewards[r], {},
                 full.advantages[r], full.mask[r])
    trainer.update(0, part)
    torch.save(torch.cat([q.grad.flatten() for q in trainer.params]), f"{out}.rank{rank}")
''')


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_two_ranks_one_prompt_equal_one_rank_two_prompts(tmp_path, loss_type):
    from hydra import compose, initialize_config_dir

    from grpo_cli import algorithm
    from grpo_cli.config import CONF_DIR, register_recipes
    from grpo_cli.trainer import GRPOTrainer

    overrides = ["+recipe=quickstart", "model=tiny", "trainer.device=cpu", f"algo.loss_type={loss_type}",
                 "algo.beta=0.04", "optimizer.lr=1e-30", "data.prompts_per_step=2", "trainer.micro_batch_size=4",
                 "rollout.max_new_tokens=6"]
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    single = GRPOTrainer(cfg, tmp_path)
    batch = single.rollout(0)
    n, G = batch.rewards.numel(), cfg.algo.num_generations
    batch.rewards = (torch.arange(n) % 3).float()
    batch.advantages = algorithm.group_advantages(batch.rewards, G)
    batch.mask[0, -2:] = 0  # uneven token counts across ranks
    torch.save(batch, tmp_path / "batch.pt")
    single.update(0, batch)
    expected = torch.cat([q.grad.flatten() for q in single.params])

    (tmp_path / "worker.py").write_text(WORKER)
    out = tmp_path / "grads"
    proc = subprocess.run([*torchrun(), str(tmp_path / "worker.py"), str(out), json.dumps(overrides),
                           str(tmp_path / "batch.pt")],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = torch.load(f"{out}.rank0"), torch.load(f"{out}.rank1")
    assert torch.equal(rank0, rank1)
    assert expected.abs().max() > 0
    torch.testing.assert_close(rank0, expected, rtol=1e-4, atol=1e-7)
