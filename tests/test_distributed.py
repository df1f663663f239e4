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


def torchrun(nproc: int = 2) -> list[str]:
    with socket.socket() as sock:  # a free loopback port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
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


# ---- placement: each rank owns cuda:LOCAL_RANK, bound before its model loads ------------------------------------
def torchrun_env(world: int, local_rank: int) -> dict:
    return {"WORLD_SIZE": str(world), "RANK": str(local_rank), "LOCAL_RANK": str(local_rank)}


def test_placement_is_a_function_of_the_environment():
    from grpo_cli.distributed import placement

    assert placement("auto", {}, cuda_devices=0) == "cpu"
    assert placement("auto", {}, cuda_devices=4) == "cuda"
    assert placement("cuda:2", {}, cuda_devices=4) == "cuda:2"  # one process: as asked
    for rank in range(4):
        assert placement("auto", torchrun_env(4, rank), cuda_devices=4) == f"cuda:{rank}"
        assert placement("cuda", torchrun_env(4, rank), cuda_devices=4) == f"cuda:{rank}"
        assert placement("auto", torchrun_env(4, rank), cuda_devices=0) == "cpu"
        assert placement("cpu", torchrun_env(4, rank), cuda_devices=4) == "cpu"
    assert placement("auto", torchrun_env(1, 0), cuda_devices=1) == "cuda:0"  # a one-rank torchrun job
    assert placement("cuda:1", torchrun_env(1, 0), cuda_devices=2) == "cuda:1"


def test_placement_refuses_what_would_share_or_miss_a_gpu():
    from grpo_cli.distributed import placement
    from grpo_cli.errors import ConfigError

    with pytest.raises(ConfigError, match=r"trainer.device=cuda:0 is invalid with 4 ranks"):
        placement("cuda:0", torchrun_env(4, 1), cuda_devices=4)
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=2 but only 2 CUDA device\(s\) are visible"):
        placement("auto", torchrun_env(4, 2), cuda_devices=2)


ORDER_WORKER = textwrap.dedent('''
    import json, os, sys, torch
    import torch.distributed as dist
    from hydra import compose, initialize_config_dir
    from grpo_cli import trainer as trainer_module
    from grpo_cli.config import CONF_DIR, register_recipes

    seen = {}
    real_load_policy = trainer_module.load_policy

    def recording_load_policy(cfg_model, device, seed=0):  # the real loader, with what held when it was called
        seen.update(group_ready=dist.is_initialized(), backend=dist.get_backend() if dist.is_initialized() else None,
                    device=device)
        return real_load_policy(cfg_model, device, seed=seed)

    trainer_module.load_policy = recording_load_policy
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=json.loads(sys.argv[2]))
    trainer = trainer_module.GRPOTrainer(cfg, os.path.dirname(sys.argv[1]))
    seen.update(model_device=str(trainer.lm.device), current_cuda=torch.cuda.current_device() if torch.cuda.is_available() else None,
                rank=trainer.dist.rank, world=trainer.dist.world_size)
    with open(f"{sys.argv[1]}.rank{trainer.dist.rank}", "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()
''')


def run_order_worker(tmp_path, nproc: int, device: str) -> list[dict]:
    (tmp_path / "order.py").write_text(ORDER_WORKER)
    out = tmp_path / "seen"
    overrides = ["+recipe=quickstart", "model=tiny", f"trainer.device={device}"]
    command = [*torchrun(nproc), str(tmp_path / "order.py"), str(out), json.dumps(overrides)]
    proc = subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(open(f"{out}.rank{rank}").read()) for rank in range(nproc)]


@pytest.mark.slow
def test_process_group_is_joined_before_the_model_loads(tmp_path):
    """Two real gloo ranks on the CPU: when the model loader runs, the group is up and the device decided."""
    seen = run_order_worker(tmp_path, 2, "auto")
    for rank, s in enumerate(seen):
        assert s["rank"] == rank and s["world"] == 2
        assert s["group_ready"] and s["backend"] == "gloo"
        assert s["device"] == "cpu" and s["model_device"] == "cpu"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_rank_binds_its_gpu_and_nccl_before_the_model_loads(tmp_path):
    seen = run_order_worker(tmp_path, 1, "auto")[0]
    assert seen["group_ready"] and seen["backend"] == "nccl"
    assert seen["device"] == "cuda:0" and seen["model_device"] == "cuda:0" and seen["current_cuda"] == 0


@pytest.mark.slow
def test_sigterm_stops_every_rank_at_the_same_point(tmp_path):
    """`grpo-train trainer.nproc=2` (torchrun underneath), SIGTERM mid-generation: torchrun forwards it to both ranks,
    they agree to discard the step, rank 0 alone writes the checkpoint and the resume line."""
    import signal
    import time

    from conftest import script

    run = tmp_path / "run"
    child = subprocess.Popen([script("grpo-train"), "+recipe=quickstart", "model=tiny", "trainer.nproc=2", "trainer.device=cpu",
                              "model.tiny.max_position_embeddings=200000", "rollout.max_new_tokens=100000",
                              "trainer.log_samples_every=0", f"hydra.run.dir={run}"], cwd=tmp_path, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    for line in child.stdout:
        output.append(line)
        if "training 50 steps" in line:
            break
    time.sleep(3)  # both ranks are generating (rank 1 reaches the loop as rank 0 does: the group was joined first)
    child.send_signal(signal.SIGTERM)
    output += child.stdout.readlines()
    child.wait(timeout=120)
    text = "".join(output)
    stopped = [line for line in output if line.startswith("grpo-train: stopped by SIGTERM")]
    assert stopped == [f"grpo-train: stopped by SIGTERM after 0 complete step(s); the unfinished step was discarded; "
                       f"checkpoint {run}/checkpoints/step-000000; resume with the same command plus trainer.resume=auto "
                       f"hydra.run.dir={run}\n"], text[-3000:]
    assert sum(line.startswith("grpo-train: SIGTERM received") for line in output) == 1
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-000000"]
    assert child.returncode != 0  # torchrun reports the signal it forwarded in its own words
