"""QLoRA (`model.quantization`, models.py): LoRA on a bitsandbytes-quantized frozen base, trained, resumed bitwise,
evaluated and exported (merged into the dequantized base, loadable without peft or bitsandbytes)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import finished_run, module_on_path, read_jsonl, run_cli

from grpo_cli.base.errors import ConfigError
from grpo_cli.config.schema import Config

needs_bnb = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None,
    reason="bitsandbytes is not installed (pip install 'grpo-cli[qlora]', which `make setup` does)")

# a tiny model earns no reward for sums: this one varies with the text, so advantages and updates are not 0
REWARDS = '''
def char_sum(prompts, completions, **fields):
    return [sum(map(ord, str(c))) % 7 / 7 for c in completions]
'''
RUN = ["+recipe=quickstart", "model=tiny", "model.quantization=nf4", "rollout.max_new_tokens=4",
       "data.prompts_per_step=2", "algo.num_generations=4", "optimizer.lr=1e-2", "trainer.max_steps=3",
       "trainer.save_every=1", "trainer.keep_last=3", "trainer.device=cpu",
       "+reward.functions.char_sum._target_=qlora_rewards.char_sum", "+reward.functions.char_sum.weight=1.0"]
ADAPTER = "adapter/adapter_model.safetensors"


# ---- config (in-process) ------------------------------------------------------------------------------------------
@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_quantization_takes_nf4_fp4_int8_or_null_and_names_them(compose):
    from grpo_cli.run.validate import validate

    for value in ("nf4", "fp4", "int8", "null"):
        validate(compose(["+recipe=quickstart", "model=tiny", f"model.quantization={value}"]))
    with pytest.raises(ConfigError, match=r"model.quantization=q4 is invalid: use one of nf4, fp4, int8"):
        validate(compose(["+recipe=quickstart", "model=tiny", "model.quantization=q4"]))


def test_the_compiled_engine_refuses_a_quantized_base_in_one_line(compose):
    from grpo_cli.run.validate import validate

    with pytest.raises(ConfigError) as err:
        validate(compose(["+recipe=quickstart", "model=tiny", "model.quantization=nf4", "rollout.engine=compiled"]))
    assert "rollout.engine=compiled" in str(err.value) and "model.quantization=nf4" in str(err.value)
    assert "rollout.engine=hf" in str(err.value) and "\n" not in str(err.value)


# ---- a 3-step nf4 run, its resume, eval load and export ------------------------------------------------------------
@pytest.fixture(scope="module")
def rewards_env(tmp_path_factory):
    return module_on_path(tmp_path_factory, "qlora_rewards", REWARDS)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, rewards_env):
    """A finished 3-step nf4 run with checkpoints after steps 1, 2 and 3 (not to be changed)."""
    return finished_run(tmp_path_factory, "straight", RUN, rewards_env)


@needs_bnb
@pytest.mark.slow
def test_an_nf4_run_trains_the_adapter_with_a_finite_loss(straight):
    records = read_jsonl(straight / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(isinstance(r["loss"], float) and abs(r["loss"]) < 1e6 for r in records)
    assert any(r["grad_norm"] > 0 for r in records)  # the reward varies: the adapter really learns
    config = json.loads((straight / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny-random"
    first = (straight / "checkpoints" / "step-000001" / ADAPTER).read_bytes()
    assert (straight / ADAPTER).read_bytes() != first


@needs_bnb
@pytest.mark.slow
def test_an_nf4_run_resumed_after_step_2_ends_bitwise_equal_to_the_straight_run(straight, tmp_path, rewards_env):
    resumed = tmp_path / "run"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000003")
    shutil.rmtree(resumed / "adapter")
    proc = run_cli([*RUN, "trainer.resume=auto", f"hydra.run.dir={resumed}"], tmp_path, env=rewards_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (resumed / ADAPTER).read_bytes() == (straight / ADAPTER).read_bytes()
    assert [r["step"] for r in read_jsonl(resumed / "metrics.jsonl")] == [0, 1, 2]


@needs_bnb
@pytest.mark.slow
def test_the_export_is_the_trained_policy_merged_and_loads_without_peft_or_bitsandbytes(straight, tmp_path):
    """grpo-eval's loader (quantized base + adapter) and the merged fp32 export give the same logits; the export
    loads with transformers alone (peft and bitsandbytes blocked from import) and has no quantization config."""
    import torch
    from omegaconf import OmegaConf

    from grpo_cli.model.loading import load_trained

    out = tmp_path / "merged"
    proc = run_cli([str(straight), str(out), "--dtype", "fp32"], tmp_path, command="grpo-export")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    ids = [[1, 5, 42, 7, 300, 12], [9, 8, 7, 6, 5, 4]]
    logits_file = tmp_path / "logits.pt"
    load = ("import sys; sys.modules['peft'] = None; sys.modules['bitsandbytes'] = None\n"
            "import torch; from transformers import AutoModelForCausalLM\n"
            "model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
            "with torch.no_grad(): torch.save(model(input_ids=torch.tensor(eval(sys.argv[2]))).logits, sys.argv[3])\n")
    proc = subprocess.run([sys.executable, "-c", load, str(out), repr(ids), str(logits_file)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]

    cfg = OmegaConf.load(straight / ".hydra" / "config.yaml")
    lm = load_trained(Config.of(cfg).model, "cpu", straight / "adapter", seed=cfg.trainer.seed)
    assert type(lm.model.get_base_model().model.layers[0].mlp.up_proj.base_layer).__name__ == "Linear4bit"
    with torch.no_grad():
        policy = lm.model(input_ids=torch.tensor(ids)).logits
    merged = torch.load(logits_file)
    torch.testing.assert_close(merged, policy, atol=1e-4, rtol=1e-4)

