"""What a TRL user reaches for (issue 61): rewards given the trainer's state, training by epochs, peft's DoRA,
rsLoRA and modules_to_save, the chat template's kwargs, a TensorBoard logger."""

from __future__ import annotations

import json

import pytest
from conftest import read_jsonl, run_cli
from transformers import TrainerState

from grpo_cli.rewards import RewardFunction, RewardSet


# ---- trainer_state ---------------------------------------------------------------------------------------------
def test_a_reward_that_names_trainer_state_or_takes_kwargs_gets_it_and_others_do_not():
    seen = {}

    def named(completions, trainer_state, **kwargs):
        seen["named"] = trainer_state
        return [0.0] * len(completions)

    def free(completions, **kwargs):
        seen["free"] = kwargs.get("trainer_state")
        return [0.0] * len(completions)

    def plain(prompts, completions):  # would fail with an unexpected keyword
        return [0.0] * len(completions)

    rewards = RewardSet([RewardFunction(f.__name__, f, 1.0) for f in (named, free, plain)])
    rewards.trainer_state = TrainerState(global_step=3, max_steps=10, epoch=0.75)
    rewards.score_all(["p", "p"], ["a", "b"], {})
    assert seen["named"] == seen["free"] == TrainerState(global_step=3, max_steps=10, epoch=0.75)
    assert (seen["named"].global_step, seen["named"].max_steps, seen["named"].epoch) == (3, 10, 0.75)


PROGRESS = """
def progress(completions, trainer_state, **kwargs):
    return [trainer_state.global_step / trainer_state.max_steps] * len(completions)

def epoch(completions, **kwargs):
    return [kwargs["trainer_state"].epoch] * len(completions)

def trl_fields(completions, trainer_state, **kwargs):  # what transformers' TrainerState holds beside them, as in TRL
    assert trainer_state.is_world_process_zero and trainer_state.is_local_process_zero
    return [trainer_state.num_train_epochs] * len(completions)
"""


@pytest.mark.slow
def test_rewards_see_the_step_and_the_epoch_during_training_by_epochs(tmp_path):
    """trainer.epochs=1.5 over 4 prompts, 2 a step: 3 steps; each reward sees the step and the epoch it is in."""
    (tmp_path / "shaping.py").write_text(PROGRESS)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)})
                                                 + "\n" for i in range(4)))
    run = tmp_path / "run"
    proc = run_cli(["+recipe=quickstart", "model=tiny", "data=jsonl", "data.path=rows.jsonl", "data.prompts_per_step=2",
                    "algo.num_generations=2", "rollout.max_new_tokens=2", "trainer.epochs=1.5",
                    "reward.only=[shaping.progress,shaping.epoch,shaping.trl_fields]", f"hydra.run.dir={run}"],
                   tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "trainer.epochs=1.5: 3 steps of 2 prompts over the 4 training prompts (trainer.max_steps=3)" in proc.stderr
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["reward/progress"] for r in rows] == pytest.approx([0.0, 1 / 3, 2 / 3])
    assert [r["reward/epoch"] for r in rows] == pytest.approx([0.0, 0.5, 1.0])  # 2 of 4 prompts a step
    assert [r["reward/trl_fields"] for r in rows] == [2, 2, 2]  # 3 steps of half a pass: 2 passes begun


# ---- trainer.epochs -------------------------------------------------------------------------------------------
def test_epochs_set_max_steps_from_the_training_prompts(config, tmp_path):
    from grpo_cli.run.rundir import changed_keys, fingerprint
    from grpo_cli.tasks.sources import steps_from_epochs

    rows = [json.dumps({"prompt": f"q{i}", "answer": "1"}) + "\n" for i in range(10)]
    (tmp_path / "rows.jsonl").write_text("".join(rows))
    base = ["+recipe=quickstart", "data=jsonl", f"data.path={tmp_path / 'rows.jsonl'}", "data.prompts_per_step=4"]
    resolved = steps_from_epochs(config([*base, "trainer.epochs=2"]))
    assert resolved.trainer.max_steps == 5 and resolved.composed["trainer"]["max_steps"] == 5  # 20 prompts, 4 a step
    # what the records pin: a resume with other epochs is a changed trainer.max_steps, refused unless allowed
    assert resolved.recorded["trainer"]["max_steps"] == 5 and fingerprint(resolved)["trainer.max_steps"] == 5
    three = steps_from_epochs(config([*base, "trainer.epochs=3"]))
    assert changed_keys(fingerprint(resolved), fingerprint(three)) == ["trainer.max_steps"]
    assert steps_from_epochs(config([*base, "trainer.epochs=0.5"])).trainer.max_steps == 2  # ceil(5 / 4)
    unset = config(base)
    assert steps_from_epochs(unset) is unset and unset.trainer.max_steps == 40  # the recipe's


# ---- peft's DoRA, rsLoRA and modules_to_save through model.lora -----------------------------------------------
def test_dora_rslora_and_modules_to_save_reach_peft_and_a_step_trains_them(compose, tmp_path):
    from conftest import VARIED_REWARD, make_trainer

    from grpo_cli.rollout import HFEngine

    trainer = make_trainer(compose, tmp_path, "model.lora.use_dora=true", "model.lora.use_rslora=true",
                           "model.lora.modules_to_save=[lm_head]", "data.prompts_per_step=2", "algo.num_generations=4",
                           "optimizer.lr=1e-2", *VARIED_REWARD)
    adapter = trainer.model.peft_config["default"]
    assert (adapter.use_dora, adapter.use_rslora, sorted(adapter.modules_to_save)) == (True, True, ["lm_head"])
    lora_layer = next(m for m in trainer.model.modules() if hasattr(m, "lora_magnitude_vector") and m.lora_A)
    assert lora_layer.scaling["default"] == pytest.approx(16 / 8 ** 0.5)  # rsLoRA: alpha / sqrt(r); tiny: 8, 16
    trained = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert any("lora_magnitude_vector" in n for n in trained) and any("modules_to_save" in n for n in trained)
    assert isinstance(trainer.engine, HFEngine)  # rollout.engine=auto: no plain merge of DoRA or a trained head
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "modules_to_save" in n}
    metrics, _batch = trainer.step(0)
    assert metrics["step"] == 0
    assert metrics["frac_reward_zero_std"] < 1  # a reward that varies: something to learn
    moved = [n for n, p in trainer.model.named_parameters() if n in before and not p.detach().equal(before[n])]
    assert moved  # the head, trained whole


# ---- rollout.chat_template_kwargs -------------------------------------------------------------------------------
THINKING_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                     "{% if add_generation_prompt %}<assistant>"
                     "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_every_prompt_the_trainer_renders(compose, config, tmp_path):
    """Qwen3's enable_thinking=false, as TRL's chat_template_kwargs gives it; the template here is Qwen3's idea."""
    import copy

    from conftest import make_trainer

    assert config(["+recipe=quickstart", "rollout.chat_template_kwargs.enable_thinking=false"]
                  ).rollout.chat_template_kwargs == {"enable_thinking": False}
    trainer = make_trainer(compose, tmp_path, "rollout.chat_template_kwargs={enable_thinking: false}")
    trainer.tokenizer.chat_template = THINKING_TEMPLATE
    _rows, encoded = trainer.prompts(0)
    assert encoded.texts and all(t.endswith("<assistant><think></think>") for t in encoded.texts)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    own = copy.deepcopy(trainer.tokenizer)  # the server placement's thread renders with a copy of its own
    assert own.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        "<user>What is 2 + 2?<assistant><think></think>"
    assert trainer.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                 enable_thinking=True) == "<user>What is 2 + 2?<assistant>"


# ---- logger=tensorboard ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_tensorboard_logger_writes_each_steps_numbers_as_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    proc = run_cli(["+recipe=quickstart", "model=tiny", "logger=tensorboard", "trainer.max_steps=2",
                    "data.prompts_per_step=2", "algo.num_generations=2", "rollout.max_new_tokens=2",
                    f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"TensorBoard: logging to {run / 'tensorboard'}" in proc.stdout
    lines = proc.stdout.splitlines()  # the model loading is said before the first step (issue 61)
    assert lines.index("loading tiny-random and its rollout engine") < next(
        i for i, line in enumerate(lines) if line.startswith("training 2 steps in"))
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    rows = read_jsonl(run / "metrics.jsonl")
    for key in ("reward", "kl", "reward/correct", "completion_len"):
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == [0, 1]
        assert [s.value for s in scalars] == pytest.approx([r[key] for r in rows])
