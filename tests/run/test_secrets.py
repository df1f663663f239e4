"""Secrets stay secret: a credential given through `${oc.env:...}` or typed in clear under a secret's name reaches
the code that uses it resolved, and is never written (the run dir, its checkpoints, the offline W&B run) nor printed
(the console, a refused resume)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_cli
from omegaconf import OmegaConf

ENV_KEY = "sk-env-" + "5ecre7" * 4           # given through ${oc.env:GRPO_TEST_API_KEY}
TYPED_TOKEN = "hf_typed" + "T0ken" * 4       # typed on the command line under a secret's name
ROTATED_TOKEN = "hf_rotated" + "K3y" * 5


def _leaks(root: Path, secrets: list[str]) -> list[str]:
    files = [p for p in root.rglob("*") if p.is_file()]
    assert len(files) > 10
    return [f"{p} holds {s[:8]}..." for p in files for s in secrets if s.encode() in p.read_bytes()]


def test_records_keep_the_interpolation_or_a_hash():
    from grpo_cli.base.redaction import find_secrets

    cfg = OmegaConf.create({"reward": {"functions": {"judge": {"api_key": "${oc.env:GRPO_TEST_API_KEY}",
                                                               "headers": {"Authorization": "Bearer xyz-123456"},
                                                               "url": "http://x", "weight": 1.0}}},
                            "data": {"path": "${oc.env:GRPO_TEST_DATA}"}})
    import os

    os.environ["GRPO_TEST_API_KEY"], os.environ["GRPO_TEST_DATA"] = ENV_KEY, "/no/such/file.jsonl"
    try:
        secrets = find_secrets(cfg)
        recorded = secrets.recorded(OmegaConf.to_container(cfg, resolve=True))
    finally:
        del os.environ["GRPO_TEST_API_KEY"], os.environ["GRPO_TEST_DATA"]
    judge = recorded["reward"]["functions"]["judge"]
    assert judge["api_key"] == "${oc.env:GRPO_TEST_API_KEY}"
    assert judge["headers"]["Authorization"].startswith("sha256:") and judge["url"] == "http://x"
    assert recorded["data"]["path"] == "${oc.env:GRPO_TEST_DATA}"
    assert set(secrets.values) == {ENV_KEY, "Bearer xyz-123456", "/no/such/file.jsonl"}


@pytest.mark.slow
def test_a_secret_is_never_written_or_printed(tmp_path):
    """A 2-step run with a checkpoint each step and logger=wandb offline, its reward given an API key from the
    environment and a token typed on the command line; then a resume with the token changed is refused naming the
    key, and a resume with the environment's key rotated goes on (a rotated key is not another config)."""
    run_dir = tmp_path / "run"
    args = ["+recipe=quickstart", "model=tiny", "trainer.device=cpu", "rollout.max_new_tokens=4",
            "data.prompts_per_step=2", "algo.num_generations=2", "trainer.max_steps=2", "trainer.save_every=1",
            "logger=wandb", "logger.wandb.mode=offline",
            "+reward.functions.varied._target_=varied_reward.by_length_with_credentials",
            "+reward.functions.varied.weight=1.0", "+reward.functions.varied.api_key=${oc.env:GRPO_TEST_API_KEY}",
            f"+reward.functions.varied.hf_token={TYPED_TOKEN}", f"hydra.run.dir={run_dir}"]
    env = {"GRPO_TEST_API_KEY": ENV_KEY, "EXPECTED_API_KEY": ENV_KEY, "EXPECTED_HF_TOKEN": TYPED_TOKEN,
           "WANDB_CACHE_DIR": str(tmp_path / "wb_cache"), "WANDB_DATA_DIR": str(tmp_path / "wb_data"),
           "WANDB_CONFIG_DIR": str(tmp_path / "wb_config")}
    proc = run_cli(args, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(run_dir.glob("wandb/offline-run-*/run-*.wandb")) and list(run_dir.glob("checkpoints/step-*"))
    assert not _leaks(tmp_path, [ENV_KEY, TYPED_TOKEN])
    assert ENV_KEY not in proc.stdout + proc.stderr and TYPED_TOKEN not in proc.stdout + proc.stderr

    changed = [a.replace(TYPED_TOKEN, ROTATED_TOKEN) for a in args if a != f"hydra.run.dir={run_dir}"]
    refused = run_cli([*changed, "trainer.max_steps=3", "trainer.resume=auto", f"hydra.run.dir={run_dir}"],
                      cwd=tmp_path, env={**env, "EXPECTED_HF_TOKEN": ROTATED_TOKEN}, timeout=600)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "reward.functions.varied.hf_token (a secret: its value is not shown)" in refused.stderr
    assert TYPED_TOKEN not in refused.stdout + refused.stderr and ROTATED_TOKEN not in refused.stdout + refused.stderr

    rotated = "sk-rotated-" + "n3w" * 6
    resumed = run_cli([*args[:-1], "trainer.max_steps=3", "trainer.resume_allow_changes=[trainer.max_steps]",
                       "trainer.resume=auto", f"hydra.run.dir={run_dir}"],
                      cwd=tmp_path, env={**env, "GRPO_TEST_API_KEY": rotated, "EXPECTED_API_KEY": rotated},
                      timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resum" in resumed.stdout + resumed.stderr
    assert not _leaks(tmp_path, [ENV_KEY, TYPED_TOKEN, rotated])
    assert rotated not in resumed.stdout + resumed.stderr


@pytest.mark.slow
def test_a_secret_typed_for_a_sweep_is_never_written_or_printed(tmp_path):
    """A sweep of 2 one-step jobs whose reward takes a token typed on the command line and a key from the environment:
    neither is in any file of the sweep dir (Hydra's multirun.yaml, each job's .hydra/, the sweep's summaries) nor
    in what the sweep printed (Hydra's launcher lists each job's overrides)."""
    sweep_dir = tmp_path / "sweep"
    args = ["-m", "+recipe=quickstart", "model=tiny", "trainer.device=cpu", "rollout.max_new_tokens=4",
            "data.prompts_per_step=2", "algo.num_generations=2", "trainer.max_steps=1", "eval.final=false",
            "+reward.functions.varied._target_=varied_reward.by_length_with_credentials",
            "+reward.functions.varied.weight=1.0", "+reward.functions.varied.api_key=${oc.env:GRPO_TEST_API_KEY}",
            f"+reward.functions.varied.hf_token={TYPED_TOKEN}", "algo.beta=0.0,0.1", f"hydra.sweep.dir={sweep_dir}"]
    env = {"GRPO_TEST_API_KEY": ENV_KEY, "EXPECTED_API_KEY": ENV_KEY, "EXPECTED_HF_TOKEN": TYPED_TOKEN}
    proc = run_cli(args, cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (sweep_dir / "multirun.yaml").is_file() and len(list(sweep_dir.glob("*/.hydra/overrides.yaml"))) == 2
    assert "<redacted>" in (sweep_dir / "multirun.yaml").read_text()
    assert not _leaks(sweep_dir, [ENV_KEY, TYPED_TOKEN])
    assert ENV_KEY not in proc.stdout + proc.stderr and TYPED_TOKEN not in proc.stdout + proc.stderr
