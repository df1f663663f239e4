"""Data sources plug in as engines do (one module, one registration line), and majority@k reads answers the way
the accuracy function does, not with one task's parser."""

from __future__ import annotations

import sys
import textwrap

import pytest
from omegaconf import OmegaConf

from grpo_cli.base.errors import ConfigError
from grpo_cli.base.registry import import_plugins
from grpo_cli.config.compose import CONF_DIR, available_recipes
from grpo_cli.rewards.arithmetic import correct_last_number
from grpo_cli.rewards.gsm8k import correctness
from grpo_cli.run.validate import validate, validated
from grpo_cli.step.evaluate import answer_reader, majority
from grpo_cli.tasks.sources import SOURCES, final_eval_on, load_rows

LETTERS = textwrap.dedent('''
    """A user's data source: one class and one registration line."""
    from grpo_cli.tasks.sources import SOURCES, Source


    @SOURCES.register("letters")
    class Letters(Source):
        def rows(self, cfg_data, split, seed):
            word = "abc" if split == "train" else "xyz"
            return [{"messages": [{"role": "user", "content": f"Spell {c}"}], "answer": c} for c in word]

        def has_held_out(self, cfg_data):
            return False
''')


@pytest.fixture
def letters(tmp_path, monkeypatch):
    (tmp_path / "letters_source.py").write_text(LETTERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import_plugins(["letters_source"])
    yield
    SOURCES.pop("letters")
    sys.modules.pop("letters_source")


def test_the_built_in_sources_are_registered():
    assert SOURCES.names() == ("sums", "reasoning_gym", "code_tasks", "humaneval", "hf", "jsonl")


def test_a_source_from_a_plugin_module_is_a_valid_choice_and_gives_the_rows(compose, letters):
    cfg = compose(["+recipe=quickstart", "model=tiny", "data.source=letters", "plugins=[letters_source]"])
    # it declares no `reads`: the quickstart's data.low, data.size, ... may be its own, and nothing is said of them
    assert not unread_said(compose, ["+recipe=quickstart", "model=tiny", "data.source=letters",
                                     "plugins=[letters_source]"])
    assert [r["answer"] for r in load_rows(cfg.data)] == ["a", "b", "c"]
    assert [r["answer"] for r in load_rows(cfg.data, split="test")] == ["x", "y", "z"]
    assert not final_eval_on(cfg, multirun=True)  # the source says it has no held-out split


def test_an_unregistered_source_names_the_registered_ones(compose):
    refused = r"data.source=letters is invalid: use one of sums, reasoning_gym, code_tasks, humaneval, hf, jsonl"
    with pytest.raises(ConfigError, match=refused):
        validate(compose(["+recipe=quickstart", "model=tiny", "data.source=letters"]))
    with pytest.raises(ConfigError, match=rf"^{refused}$"):
        load_rows(OmegaConf.create({"source": "letters"}))


def unread_said(compose, overrides: list[str]) -> list[str]:
    """The warnings of grpo-train's validation (run.validate.validated) that name source options left unread."""
    return [w for w in validated(compose(overrides))[1] if "nothing: data.source=" in w]


def test_a_source_option_the_source_does_not_read_is_a_warning_naming_the_sources_that_do(compose):
    """HumanEval's 164 problems are fixed: +data.size=50 there trained on all of them without a word."""
    assert unread_said(compose, ["+recipe=code", "data=humaneval", "+data.size=50"]) == [
        "data.size=50 changes nothing: data.source=humaneval does not read it (code_tasks, reasoning_gym, sums do); "
        "remove it (~data.size); a data option (data=humaneval) sets only what its source reads"]
    assert not unread_said(compose, ["+recipe=code", "data=code_tasks", "data.size=50"])


def test_a_recipes_source_options_beside_another_data_option_are_one_warning_and_the_fix_it_names_works(compose):
    """The calculator recipe's sums options (data.low, data.high, data.operation) come along to data=gsm8k_sample,
    whose table reads none of them."""
    base = ["+recipe=calculator", "model=tiny", "data=gsm8k_sample"]
    assert unread_said(compose, base) == [
        "data.low=100, data.high=999, data.operation=* change nothing: data.source=hf does not read them (sums does); "
        "remove them (~data.low ~data.high ~data.operation); a data option (data=hf) sets only what its source reads"]
    assert not unread_said(compose, [*base, "~data.low", "~data.high", "~data.operation"])


DATA_OPTIONS = sorted(p.stem for p in (CONF_DIR / "data").glob("*.yaml"))
TABLE_FILE = {"hf": ["data.name=openai/gsm8k"], "jsonl": ["data.path=rows.jsonl"]}  # those read no rows without one


@pytest.mark.slow  # a validation each
@pytest.mark.parametrize("overrides", [
    *([f"+recipe={name}"] for name in sorted(available_recipes())),
    *(["+recipe=quickstart", f"data={name}", *TABLE_FILE.get(name, [])] for name in DATA_OPTIONS),
])
def test_every_recipe_and_data_option_sets_only_options_its_source_reads(compose, overrides, tmp_path, monkeypatch):
    (tmp_path / "rows.jsonl").write_text('{"prompt": "What is 2 + 2?", "answer": "4"}\n')
    monkeypatch.chdir(tmp_path)
    assert not unread_said(compose, overrides)


def test_majority_reads_answers_as_the_accuracy_function_does():
    # quickstart: the last number is the answer, as correct_last_number judges it
    texts = ["the answer is 5", "3 + 4 = 7", "it is 7.0", "8"]
    assert majority(texts, answer_reader(correct_last_number)) == 1
    assert correct_last_number([None] * 2, texts[1:3], answer=["7", "7"]) == [1.0, 1.0]
    # GSM8K: the stated final answer, compared as a number ("#### 1,000" and "#### 1000" agree)
    gsm = ["so #### 12", "#### 1,000", "first 3 then\n#### 1000"]
    assert majority(gsm, answer_reader(correctness)) == 1
    # a judge without a reader of its own: the completions' text, stripped
    def exact(prompts, completions, answer, **_):
        return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]

    assert majority([" yes", "no", "yes "], answer_reader(exact)) == 0
    assert majority(["", "  "], answer_reader(exact)) is None


def test_a_judge_from_a_plugin_brings_its_own_reader():
    def judge(prompts, completions, answer, **_):
        return [float(c.lower().startswith(a)) for c, a in zip(completions, answer, strict=True)]

    judge.parse_answer = lambda text: text.split()[0].lower() if text.split() else None
    assert majority(["Lyon", "Paris is it", "PARIS surely"], answer_reader(judge)) == 1
    assert majority(["Lyon", "Paris is it", "PARIS surely"], answer_reader(lambda *a: None)) == 0  # text: all differ
