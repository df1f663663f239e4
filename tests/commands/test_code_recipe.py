"""The code recipe (+recipe=code): its problems (grpo_cli.tasks.code_tasks), their splits, pass@1 and pass@k in the
evaluator, and the outcomes of a training run in samples.jsonl and the metrics."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import read_jsonl

from grpo_cli.rewards.code import passes_tests
from grpo_cli.rollout import Engine
from grpo_cli.rollout.common import Rollout
from grpo_cli.step.evaluate import Evaluator, eval_rows
from grpo_cli.tasks import code_tasks
from grpo_cli.tasks.sources import load_rows


def fenced(code: str) -> str:
    return f"```python\n{code}```"


def questions(rows: list[dict]) -> set[str]:
    return {row["messages"][-1]["content"] for row in rows}


def test_the_generated_train_and_held_out_splits_share_no_task(compose):
    cfg = compose(["+recipe=code"])
    train = load_rows(cfg.data, split="train", seed=3)
    held_out = eval_rows(cfg)
    assert len(train) == 168 and len(held_out) == 87
    assert not questions(train) & questions(held_out)
    assert not {r["entry_point"] + r["tests"] for r in train} & {r["entry_point"] + r["tests"] for r in held_out}
    assert questions(train) == questions(load_rows(cfg.data, split="train", seed=4))  # another order, the same tasks
    assert all(r["messages"][-1]["content"].endswith("in a ```python code block.") for r in train)


def test_the_humaneval_splits_share_no_problem(compose):
    cfg = compose(["+recipe=code", "data=humaneval"])
    train, held_out = load_rows(cfg.data, split="train"), load_rows(cfg.data, split="test")
    assert len(train) == 123 and len(held_out) == 41
    assert not questions(train) & questions(held_out) and len(questions(train + held_out)) == 164
    assert all(r["preamble"] and "def check(candidate)" in r["tests"] for r in train + held_out)


@pytest.mark.slow  # 300 programs in the sandbox
def test_each_generated_task_passes_its_own_solution_and_fails_a_wrong_one():
    tasks = code_tasks.all_generated()
    right = passes_tests([None] * len(tasks), [fenced(t.solution) for t in tasks], [t.tests for t in tasks])
    assert right.outcomes == ["passed 3/3"] * len(tasks)
    firsts = list({t.question.split("` that ")[1]: t for t in reversed(tasks)}.values())  # one task of each template
    assert len(firsts) >= 40
    wrong = passes_tests([None] * len(firsts), [fenced(f"def {t.entry_point}(*args):\n    return None\n")
                                                for t in firsts], [t.tests for t in firsts])
    assert wrong.outcomes == ["failed 0/3"] * len(firsts)


@pytest.mark.slow  # 164 programs in the sandbox
def test_humaneval_canonical_solutions_pass_and_prose_fails():
    tasks = code_tasks.humaneval("train") + code_tasks.humaneval("test")
    n = len(tasks)
    fields = {"tests": [t.tests for t in tasks], "entry_point": [t.entry_point for t in tasks],
              "preamble": [t.preamble for t in tasks]}
    solved = passes_tests([None] * n, [fenced(t.solution) for t in tasks], **fields)
    assert n == 164 and list(solved) == [1.0] * n, [o for o in solved.outcomes if not o.startswith("passed")]
    assert sum(passes_tests([None] * n, ["I do not know."] * n, **fields)) == 0.0


# ---- pass@1 and pass@k in the evaluator --------------------------------------------------------------------
class KnownAnswers(Engine):
    """Greedy: the task's right function for the questions in `solved`, a wrong one for the others; sampling k:
    the right one first, then wrong ones, for every question. pass@1 is the share solved, pass@k is 1."""

    def __init__(self, tokenizer, solved: set[str]):
        super().__init__(None, tokenizer)
        self.solved, self.tasks = solved, {t.question: t for t in code_tasks.all_generated()}

    def generate(self, prompt_ids, num_generations, sampling, stop=None):
        texts = []
        for ids in prompt_ids:
            asked = re.search(r"Write a Python function .*?\.(?= Reply)", self.tokenizer.decode(ids)).group(0)
            task = self.tasks[asked]
            right, wrong = fenced(task.solution), fenced(f"def {task.entry_point}(*args):\n    return None\n")
            if sampling.greedy:
                texts.append(right if task.question in self.solved else wrong)
            else:
                texts += [right] + [wrong] * (num_generations - 1)
        empty = torch.zeros(len(texts), 1, dtype=torch.long)
        return Rollout(empty, empty, empty, empty, torch.zeros(len(texts), dtype=torch.bool), texts, num_generations)


@pytest.mark.slow  # 32 programs in the sandbox, and transformers' import for the tokenizer
def test_the_evaluator_reports_pass_at_1_and_pass_at_k(config):
    from grpo_cli.model.loading import load_tokenizer

    cfg = config(["+recipe=code", "eval.num_prompts=8", "eval.samples=3"])
    rows = eval_rows(cfg)
    tokenizer = load_tokenizer("tiny-random")
    engine = KnownAnswers(tokenizer, {r["messages"][-1]["content"].split(" Reply")[0] for r in rows[:3]})
    result = Evaluator.from_config(cfg, tokenizer, rows).run(engine)
    assert result["eval/accuracy"] == 3 / 8  # reward.accuracy is all or nothing: 0 of 3 tests is 0
    assert result["eval/pass@3"] == 1.0
    assert result["eval/num_prompts"] == 8


# ---- a training run: outcomes in samples.jsonl and the metrics ---------------------------------------------
@pytest.mark.slow  # 2 steps of the tiny model in-process, 16 programs in the sandbox
def test_a_code_run_writes_each_outcome_and_their_counts(config, tmp_path):
    from grpo_cli.run.runner import train
    from grpo_cli.step.trainer import GRPOTrainer

    cfg = config(["+recipe=code", "model=tiny", "trainer.device=cpu", "rollout.max_new_tokens=6",
                   "data.prompts_per_step=2", "algo.num_generations=4", "trainer.max_steps=2",
                   "trainer.log_samples_every=1", "eval.final=false"])
    train(cfg, tmp_path, GRPOTrainer(cfg))
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    kinds = ("passed", "failed", "timeout", "crashed", "refused")
    for row in rows:
        counts = {kind: row[f"outcomes/tests/{kind}"] for kind in kinds}
        assert sum(counts.values()) == 8, counts
        assert row["outcomes/passed/passed"] == counts["passed"]
    samples = read_jsonl(tmp_path / "samples.jsonl")
    assert len(samples) == 16
    assert all(s["outcome/tests"].split()[0].rstrip(":") in kinds for s in samples)
    seen = sum((row[f"outcomes/tests/{kind}"] for row in rows for kind in kinds if kind != "passed"), 0)
    assert seen == 16  # the tiny random model writes no passing program
