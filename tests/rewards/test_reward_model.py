"""A sequence classifier as a reward: a tiny randomly initialised one saved to a temp dir (no download)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import read_jsonl, run_cli

from grpo_cli.config.compose import ConfigError
from grpo_cli.config.schema import Config
from grpo_cli.model.loading import load_tokenizer
from grpo_cli.rewards import RewardSet
from grpo_cli.rewards.reward_model import RewardModel
from grpo_cli.run.validate import validate

TARGET = "grpo_cli.rewards.reward_model.RewardModel"
MESSAGES = [[{"role": "user", "content": f"What is {a} + {a + 1}?"}] for a in range(5)]
COMPLETIONS = ["9", "The answer is 3.", "", "4 + 5 = 9", "x" * 50]
NUM_LABELS = 3


def save_classifier(folder, chat_template: bool = True) -> str:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tokenizer = load_tokenizer("tiny-random")  # the embedded model's tokenizer: it has a chat template
    if not chat_template:
        tokenizer.chat_template = None
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, num_labels=NUM_LABELS,
                         pad_token_id=tokenizer.pad_token_id, max_position_embeddings=512)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> str:
    return save_classifier(tmp_path_factory.mktemp("rm") / "classifier")


def prompts_of(tokenizer) -> list[str]:
    return [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in MESSAGES]


def one_at_a_time(folder: str, texts: list[str], label: int, special_tokens: bool) -> list[float]:
    """The logit of `label` for each text alone (no batch, no padding): what batching must reproduce."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return [float(model(**tokenizer(t, return_tensors="pt", add_special_tokens=special_tokens)).logits[0, label])
                for t in texts]


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_scores_are_the_label_logit_of_the_chat_templated_conversation(classifier):
    rm = RewardModel(model=classifier, label=2, batch_size=2)  # 5 completions: batches of 2, 2, 1, padded
    prompts = prompts_of(rm.tokenizer)
    scores = rm(prompts, COMPLETIONS, messages=MESSAGES)
    assert len(scores) == len(COMPLETIONS) and all(isinstance(s, float) and math.isfinite(s) for s in scores)
    assert rm(prompts, COMPLETIONS, messages=MESSAGES) == scores  # deterministic: eval mode, no sampling
    conversations = [rm.tokenizer.apply_chat_template([*m, {"role": "assistant", "content": c}], tokenize=False)
                     for m, c in zip(MESSAGES, COMPLETIONS, strict=True)]
    assert all("<|im_start|>assistant" in text for text in conversations)  # the classifier's own template
    assert scores == pytest.approx(one_at_a_time(classifier, conversations, 2, False), abs=1e-5)
    assert len(set(scores)) == len(scores)
    first = RewardModel(model=classifier, batch_size=8)(prompts, COMPLETIONS, messages=MESSAGES)
    assert first != scores  # label 0 (the default) is another logit


@pytest.mark.slow
def test_without_chat_template_the_policy_prompt_text_plus_completion_is_scored(classifier, tmp_path):
    plain = save_classifier(tmp_path / "plain", chat_template=False)
    rm = RewardModel(model=plain)
    assert not rm.templated
    prompts = prompts_of(load_tokenizer("tiny-random"))
    scores = rm(prompts, COMPLETIONS, messages=MESSAGES)
    expected = one_at_a_time(plain, [p + c for p, c in zip(prompts, COMPLETIONS, strict=True)], 0, True)
    assert scores == pytest.approx(expected, abs=1e-5)


def test_standardize_and_dtype(classifier):
    rm = RewardModel(model=classifier, standardize=True, dtype=torch.bfloat16)
    assert next(rm.model.parameters()).dtype == torch.bfloat16 and not rm.model.training
    scores = torch.tensor(rm(prompts_of(rm.tokenizer), COMPLETIONS, messages=MESSAGES), dtype=torch.float64)
    assert abs(float(scores.mean())) < 1e-6 and float(scores.std(correction=0)) == pytest.approx(1.0, abs=1e-4)


def compose_with(compose, classifier: str, *extra: str):
    return compose(["+recipe=quickstart", "model=tiny", f"+reward.functions.rm._target_={TARGET}",
                    f"+reward.functions.rm.model={classifier}", "+reward.functions.rm.weight=0.5", *extra])


def test_mixes_with_rule_rewards_in_a_reward_set(compose, classifier):
    cfg = compose_with(compose, classifier, "+reward.functions.rm.label=1", "+reward.functions.rm.batch_size=3")
    validate(cfg)
    rewards = RewardSet.from_config(Config.of(cfg).reward, device=torch.device("cpu"), dtype=torch.float32)
    rm = next(rf.fn for rf in rewards.functions if rf.name == "rm")
    assert rm.batch_size == 3 and rm.label == 1  # built once, with its own options
    prompts = prompts_of(rm.tokenizer)
    fields = {"answer": ["9"] * 5, "messages": MESSAGES}  # what the trainer passes: the rule rewards ignore messages
    totals, per_fn, errors = rewards.score(prompts, COMPLETIONS, fields)
    assert set(per_fn) == {"correct", "bare", "rm"} and errors == 0
    assert per_fn["rm"] == pytest.approx(rm(prompts, COMPLETIONS, messages=MESSAGES))
    w = {name: cfg.reward.functions[name].weight for name in ("correct", "bare")}  # the recipe's own weights
    for i, total in enumerate(totals):
        assert total == pytest.approx(w["correct"] * per_fn["correct"][i] + w["bare"] * per_fn["bare"][i]
                                      + 0.5 * per_fn["rm"][i])


@pytest.mark.parametrize("override,words", [
    ("+reward.functions.rm.label=-1", ["reward.functions.rm.label=-1", ">= 0"]),
    ("+reward.functions.rm.lable=1", ["reward.functions.rm.lable=1", "takes no option lable", "label"]),
    ("+reward.functions.rm.batch_size=0", ["reward.functions.rm.batch_size=0"]),
    ("+reward.functions.rm.standardize=maybe", ["reward.functions.rm.standardize=maybe", "true or false"]),
    ("+reward.functions.rm.device=cuda", ["reward.functions.rm.device=cuda", "takes no option device"]),
])
@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_bad_options_are_one_line_before_anything_loads(compose, classifier, override, words):
    with pytest.raises(ConfigError) as err:
        validate(compose_with(compose, classifier, override))
    assert "\n" not in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_missing_model_dir_and_out_of_range_label(compose, classifier, tmp_path):
    with pytest.raises(ConfigError, match=r"reward.functions.rm.model=/no/such/dir is invalid: "
                                          r"no such model directory"):
        validate(compose_with(compose, "/no/such/dir"))
    with pytest.raises(ConfigError, match=r"reward.functions.rm.label=3 is invalid: "
                                          rf".* has {NUM_LABELS} output logits"):
        RewardSet.from_config(Config.of(compose_with(compose, classifier, "+reward.functions.rm.label=3")).reward)
    # longer than the classifier reads (512 positions): it was cut to 512 without a word
    with pytest.raises(ConfigError, match=r"reward.functions.rm.max_length=4096 is invalid: .* reads at most 512 "
                                          r"tokens; use max_length <= 512 \(null = 512\)"):
        RewardSet.from_config(Config.of(compose_with(compose, classifier,
                                                     "+reward.functions.rm.max_length=4096")).reward)
    assert RewardModel(model=classifier, max_length=100).max_length == 100
    assert RewardModel(model=classifier).max_length == 512


def test_plain_function_rewards_take_options_as_keyword_arguments(compose, tmp_path, monkeypatch):
    # a module name no other test writes: a `my_rewards` imported earlier in this process would be the one found
    (tmp_path / "option_rewards.py").write_text(
        "def longer_than(prompts, completions, min_chars=0, **_):\n"
        "    return [float(len(c) > min_chars) for c in completions]\n"
        "def strict(prompts, completions, answer):\n"
        "    return [0.0 for _ in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = compose(["+recipe=quickstart", "model=tiny", "+reward.functions.long._target_=option_rewards.longer_than",
                   "+reward.functions.long.min_chars=3", "+reward.functions.strict._target_=option_rewards.strict"])
    validate(cfg)
    totals, per_fn, _ = RewardSet.from_config(Config.of(cfg).reward).score(
        ["p"] * 3, ["12", "1234", "12345"], {"answer": ["3"] * 3, "messages": [[]] * 3})
    assert per_fn["long"] == [0.0, 1.0, 1.0] and per_fn["strict"] == [0.0] * 3  # no **kwargs: messages not passed
    bad = compose(["+recipe=quickstart", "model=tiny", "+reward.functions.strict._target_=option_rewards.strict",
                   "+reward.functions.strict.min_chars=2"])
    with pytest.raises(ConfigError, match="reward.functions.strict.min_chars=2 is invalid: "
                                          "option_rewards.strict takes no option"):
        validate(bad)


@pytest.mark.slow
def test_two_step_training_run_logs_the_reward_model(classifier, tmp_path):
    run = tmp_path / "run"
    proc = run_cli(["+recipe=quickstart", "model=tiny", "trainer.max_steps=2", "rollout.max_new_tokens=4",
                    f"+reward.functions.rm._target_={TARGET}", f"+reward.functions.rm.model={classifier}",
                    "+reward.functions.rm.weight=0.5", "+reward.functions.rm.standardize=true",
                    f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert {"reward/rm", "reward/correct", "reward/bare"} <= row.keys()
        assert abs(row["reward/rm"]) < 1e-6  # standardised over the step's completions: mean 0
        assert row["reward"] == pytest.approx(0.5 * (row["reward/correct"] + row["reward/bare"]), abs=1e-6)
