"""`model.dtype` (precision.py, models.py): the frozen base in bf16 on the CPU with the LoRA weights, their
optimizer state and the log-softmax in fp32; the log-prob pass as exact as a full bf16 forward; a bf16 run
resumed bitwise; a dtype the device cannot run refused in one line."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from conftest import finished_run, module_on_path, randomise_lora, read_jsonl, run_cli
from safetensors import safe_open
from test_logprob_pass import CHUNKS, _lora_grads, full_sequence_logprobs

from grpo_cli.base.errors import ConfigError
from grpo_cli.config.schema import Config
from grpo_cli.model.loading import attach_lora, load_base_model, load_policy, load_tokenizer
from grpo_cli.model.precision import auto_dtype, fast_cpu_bf16, resolve_dtype
from grpo_cli.rollout import HFEngine, SamplingParams, completion_logprobs

CPU = torch.device("cpu")


# ---- the option ---------------------------------------------------------------------------------------------------
@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_the_dtypes_the_cpu_runs_are_taken(compose):
    from grpo_cli.run.validate import validate

    for value in ("auto", "float32", "bfloat16"):
        validate(compose(["+recipe=quickstart", "model=tiny", "trainer.device=cpu", f"model.dtype={value}"]))
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16 and resolve_dtype("float32", CPU) == torch.float32


@pytest.mark.parametrize(("value", "says"), [
    ("float16", "model.dtype=float16 cannot run on the CPU"),
    ("half", "model.dtype=half is invalid: use one of auto, float32, bfloat16, float16"),
])
@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_a_dtype_the_cpu_cannot_run_is_refused_in_one_line(compose, value, says):
    from grpo_cli.run.validate import validate

    with pytest.raises(ConfigError) as err:
        validate(compose(["+recipe=quickstart", "model=tiny", "trainer.device=cpu", f"model.dtype={value}"]))
    assert says in str(err.value) and "\n" not in str(err.value)


def test_auto_is_bf16_only_on_a_cpu_with_bf16_matmuls():
    """On a CPU without AVX512-BF16 or AMX, bf16 matmuls are emulated (several times slower than fp32)."""
    from grpo_cli.model import precision

    assert auto_dtype(CPU) == (torch.bfloat16 if precision.CPU_AUTO_BF16 and fast_cpu_bf16() else torch.float32)


def test_bf16_on_a_cpu_without_bf16_matmuls_runs_with_a_warning(compose):
    from grpo_cli.run.validate import validate

    warnings = validate(compose(["+recipe=quickstart", "model=tiny", "trainer.device=cpu", "model.dtype=bfloat16"]))
    slow = [w for w in warnings if w.startswith("model.dtype=bfloat16 on a CPU without bf16 matmul instructions")]
    assert len(slow) == (0 if fast_cpu_bf16() else 1)
    assert not any("model.dtype" in w for w in validate(compose(["+recipe=quickstart", "model=tiny",
                                                                 "trainer.device=cpu", "model.dtype=float32"])))


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_a_bf16_base_keeps_its_lora_weights_in_fp32(compose):
    lm = load_policy(Config.of(compose(["model=tiny", "model.dtype=bfloat16"])).model, "cpu")
    assert lm.dtype == torch.bfloat16
    trainable = {p.dtype for p in lm.model.parameters() if p.requires_grad}
    frozen = {p.dtype for p in lm.model.parameters() if not p.requires_grad}
    assert trainable == {torch.float32} and frozen == {torch.bfloat16}


# ---- the log-prob pass in bf16 against a full bf16 forward ----------------------------------------------------------
@pytest.fixture(scope="module")
def bf16_policy():
    """The tiny model in bf16 with a random fp32 adapter, a rollout sampled from it, and the same weights in fp32."""
    tokenizer = load_tokenizer("tiny-random")
    base = load_base_model("tiny-random", tokenizer, torch.bfloat16, tiny={"hidden_size": 64, "num_layers": 2,
                                                                            "num_heads": 4})
    base.generation_config.pad_token_id = tokenizer.pad_token_id
    model = attach_lora(base, 8, 16, 0.0, "all-linear")
    randomise_lora(model)
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("What is 2 + 3? Answer:", "Hi")]
    torch.manual_seed(0)
    roll = HFEngine(model, tokenizer).generate(prompts, 3, SamplingParams(max_new_tokens=9, temperature=1.0))
    roll.completion_mask[1, 4:] = 0
    return model, copy.deepcopy(model).float(), roll


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_bf16_logprob_pass_equals_a_full_bf16_forward(bf16_policy):
    """Tolerances: log-probs within 5e-3 nats and entropy within 1e-2 of the full bf16 forward. Both take bf16 logits
    and log-softmax them in fp32, but the pass runs each prompt once and its completions on the cached keys, so the
    two round at different places: usually 3e-6 and 3e-5 apart, on some draws of the tiny model (its init and the
    sampled rows vary between processes) up to 3e-3, within one bf16 rounding step of a logit (2^-8 relative). The
    LoRA gradient within 2 % (L2, relative) of the full forward's and no further from the fp32 gradient than twice
    the full bf16 forward is (measured 0.5-0.7 %): the pass's backward rounds in other places than autograd through
    full logits."""
    model, fp32, roll = bf16_policy
    real, rows = roll.completion_mask.bool(), slice(0, roll.completion_ids.shape[0])
    model.train()
    fp32.train()
    exact, _ = full_sequence_logprobs(fp32, roll, 0.7)
    (exact * roll.completion_mask).sum().backward()
    exact_grad = _lora_grads(fp32)
    model.zero_grad(set_to_none=True)
    full, full_ent = full_sequence_logprobs(model, roll, 0.7)
    (full * roll.completion_mask).sum().backward()
    full_grad = _lora_grads(model)
    assert full.dtype == torch.float32 and full_grad.dtype == torch.float32
    full_err = float((full_grad - exact_grad).norm() / exact_grad.norm())
    assert 0 < full_err < 0.05  # bf16 really ran: not the fp32 numbers
    for chunk in CHUNKS:
        model.zero_grad(set_to_none=True)
        logp, ent = completion_logprobs(model, roll, rows, 0.7, chunk, with_entropy=True)
        (logp * roll.completion_mask).sum().backward()
        grad = _lora_grads(model)
        torch.testing.assert_close(logp[real], full[real].detach(), rtol=0, atol=5e-3)
        torch.testing.assert_close(ent[real], full_ent[real].detach(), rtol=0, atol=1e-2)
        assert float((grad - full_grad).norm() / full_grad.norm()) <= 0.02
        assert float((grad - exact_grad).norm() / exact_grad.norm()) <= 2 * full_err


# ---- a bf16 run and its resume (real CLI) ---------------------------------------------------------------------------
REWARDS = '''
def char_sum(prompts, completions, **fields):
    return [sum(map(ord, str(c))) % 7 / 7 for c in completions]
'''
RUN = ["+recipe=quickstart", "model=tiny", "model.dtype=bfloat16", "trainer.device=cpu", "rollout.max_new_tokens=4",
       "data.prompts_per_step=2", "algo.num_generations=4", "optimizer.lr=1e-2", "trainer.max_steps=3",
       "trainer.save_every=1", "trainer.keep_last=3", "+reward.functions.char_sum._target_=bf16_rewards.char_sum",
       "+reward.functions.char_sum.weight=1.0"]
ADAPTER = "adapter/adapter_model.safetensors"


@pytest.fixture(scope="module")
def rewards_env(tmp_path_factory):
    return module_on_path(tmp_path_factory, "bf16_rewards", REWARDS)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, rewards_env):
    """A finished 3-step bf16 run with checkpoints after steps 1, 2 and 3 (not to be changed)."""
    return finished_run(tmp_path_factory, "straight", RUN, rewards_env)


def _lora_b(path) -> torch.Tensor:
    with safe_open(str(path), "pt") as f:
        return torch.cat([f.get_tensor(k).flatten() for k in sorted(f.keys()) if "lora_B" in k])


@pytest.mark.slow
def test_a_bf16_run_trains_fp32_lora_weights_with_fp32_optimizer_state(straight):
    records = read_jsonl(straight / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2] and any(r["grad_norm"] > 0 for r in records)
    b = _lora_b(straight / ADAPTER)
    assert b.dtype == torch.float32 and b.abs().max() > 0  # the adapter moved (a fresh one has B = 0)
    state = torch.load(straight / "checkpoints" / "step-000003" / "trainer_state.pt", weights_only=False)
    moments = [t for t in _tensors(state["optimizer"]["state"]) if t.dim() > 0]  # AdamW's exp_avg, exp_avg_sq
    assert moments and {t.dtype for t in moments} == {torch.float32}


def _tensors(node):
    if isinstance(node, torch.Tensor):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _tensors(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            yield from _tensors(value)


@pytest.mark.slow
def test_a_bf16_run_resumed_after_step_2_ends_bitwise_equal_to_the_straight_run(straight, tmp_path, rewards_env):
    resumed = tmp_path / "run"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-000003")
    shutil.rmtree(resumed / "adapter")
    proc = run_cli([*RUN, "trainer.resume=auto", f"hydra.run.dir={resumed}"], tmp_path, env=rewards_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (resumed / ADAPTER).read_bytes() == (straight / ADAPTER).read_bytes()
    assert not torch.equal(_lora_b(resumed / ADAPTER), _lora_b(straight / "checkpoints" / "step-000002" / ADAPTER))
    assert [r["step"] for r in read_jsonl(resumed / "metrics.jsonl")] == [0, 1, 2]


@pytest.mark.slow
def test_grpo_train_refuses_float16_on_the_cpu_in_one_line_before_loading(tmp_path):
    proc = run_cli(["+recipe=quickstart", "model=tiny", "trainer.device=cpu", "model.dtype=float16",
                    f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines == ["grpo-train: model.dtype=float16 cannot run on the CPU (torch has no fast fp16 kernels there); "
                     "use model.dtype=bfloat16, float32 or auto"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
