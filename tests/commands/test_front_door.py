"""The front door for a TRL user (issue 61): your data is read or refused, never ignored; only your rewards when you
say so; messages that say what they are."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from grpo_cli.base.errors import ConfigError
from grpo_cli.base.metrics import OWN_METRIC_PREFIXES, OWN_METRICS
from grpo_cli.run.validate import validate
from grpo_cli.tasks.sources import load_rows

ROWS = [{"prompt": "What is 2 + 2?", "answer": "4"}, {"prompt": "What is 3 + 4?", "answer": "7"}]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


# ---- your data -----------------------------------------------------------------------------------------------
def test_a_data_file_on_a_generated_source_is_refused_in_one_line_naming_data_jsonl(tmp_path):
    """The quickstart's data option generates its prompts: data.path there was ignored (exit 0, trained on sums)."""
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    proc = run_cli(["+recipe=quickstart", "model=tiny", "data.path=train.jsonl", f"hydra.run.dir={tmp_path / 'run'}"],
                   tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("grpo-train: data.path=train.jsonl is invalid: data.source=sums generates")
    assert "data=jsonl" in lines[0] and "data=hf" in lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_eval_file_on_a_generated_source_is_refused_too(compose, tmp_path):
    cfg = compose(["+recipe=quickstart", f"data.eval_path={write_jsonl(tmp_path / 'test.jsonl', ROWS)}"])
    with pytest.raises(ConfigError, match=r"^data.eval_path=.* is invalid: data.source=sums generates its prompts"):
        validate(cfg)


def test_data_jsonl_reads_the_file_on_top_of_a_recipe(config, compose, tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ROWS)
    overrides = ["+recipe=quickstart", "data=jsonl", f"data.path={path}"]
    validate(compose(overrides))
    cfg = config(overrides)
    rows = load_rows(cfg.data)
    assert [r["messages"][-1]["content"] for r in rows] == ["What is 2 + 2?", "What is 3 + 4?"]
    assert [r["answer"] for r in rows] == ["4", "7"]
    assert cfg.data.prompts_per_step == 4  # the recipe's


def test_data_jsonl_without_a_path_is_one_line(compose):
    with pytest.raises(ConfigError, match=r"^data.path=null is invalid: data.source=jsonl reads its rows from a file"):
        validate(compose(["+recipe=quickstart", "data=jsonl"]))


def test_the_question_suffix_is_added_once(config, tmp_path):
    """Rows written with the quickstart's suffix, read with the quickstart's data config (data.source=jsonl on top of
    it): the suffix was appended a second time."""
    suffix = " Answer with just the number."
    rows = [{"prompt": "What is 2 + 2?" + suffix, "answer": "4"},
            {"messages": [{"role": "user", "content": "What is 3 + 4?" + suffix}], "answer": "7"},
            {"prompt": "What is 5 + 1?", "answer": "6"}]
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = config(["+recipe=quickstart", "data.source=jsonl", f"data.path={path}"])
    assert cfg.data.question_suffix == suffix
    assert [r["messages"][-1]["content"] for r in load_rows(cfg.data)] == [
        "What is 2 + 2?" + suffix, "What is 3 + 4?" + suffix, "What is 5 + 1?" + suffix]
    from grpo_cli.tasks.prompts import with_suffix

    assert with_suffix("What is 2 + 2?", "\n") == "What is 2 + 2?\n"  # a suffix of blanks is added too, once
    assert with_suffix("What is 2 + 2?\n", "\n") == "What is 2 + 2?\n"


# ---- only your rewards -----------------------------------------------------------------------------------------
MINE = "def mine(completions, **kwargs):\n    return [float(len(c) < 20) for c in completions]\n"


def test_reward_only_replaces_a_recipes_functions(config, compose, tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(MINE)
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides = ["+recipe=quickstart", "reward.only=[my_rewards.mine]"]
    validate(compose(overrides))
    reward = config(overrides).reward
    assert list(reward.functions) == ["mine"]
    assert reward.functions["mine"]._target_ == "my_rewards.mine" and reward.functions["mine"].weight == 1.0
    assert reward.accuracy is None  # the recipe's `correct` is gone, and nothing judges eval/accuracy
    kept = config(["+recipe=quickstart", "reward.only=[correct,my_rewards.mine]"]).reward
    assert list(kept.functions) == ["correct", "mine"] and kept.accuracy == "correct"


@pytest.mark.parametrize("only,says", [
    ("[nothing]", r"nothing is neither an entry of reward.functions \(correct, bare\) nor a dotted path"),
    ("[a.mine,b.mine]", "names two functions mine"),
])
def test_reward_only_that_cannot_be_placed_is_one_line(config, only, says):
    with pytest.raises(ConfigError, match=r"^reward.only=\[.*\] is invalid: " + says):
        config(["+recipe=quickstart", f"reward.only={only}"])


@pytest.mark.slow
def test_reward_only_trains_with_your_function_alone(tmp_path):
    (tmp_path / "my_rewards.py").write_text(MINE)
    run = tmp_path / "run"
    proc = run_cli(["+recipe=quickstart", "model=tiny", "reward.only=[my_rewards.mine]", "trainer.max_steps=1",
                    "data.prompts_per_step=2", "algo.num_generations=2", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert sorted(k for k in row if k.startswith("reward/")) == ["reward/mine"]


CHAT = "What is 2 + 2?"


def test_on_chat_prompts_a_trl_reward_gets_trls_conversational_form_and_grpo_clis_own_get_text():
    """TRL passes a conversational dataset's prompts as their messages and each completion as [{"role":
    "assistant", "content": ...}]; its own trl.rewards.think_format_reward and its docs' rewards read
    completion[0]["content"], which on the text grpo-cli gave was a TypeError that stopped the run."""
    from trl.rewards import think_format_reward

    from grpo_cli.rewards import RewardFunction, RewardSet
    from grpo_cli.rewards.arithmetic import correct_last_number

    seen = {}

    def mine(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return [float(len(c[0]["content"] if isinstance(c, list) else c) < 20) for c in completions]

    rewards = RewardSet([RewardFunction("mine", mine, 1.0), RewardFunction("think", think_format_reward, 1.0),
                         RewardFunction("correct", correct_last_number, 1.0)])
    chat = [[{"role": "user", "content": CHAT}]] * 2
    texts = ["<think>2 and 2</think> 4", "it is 5"]
    _, per_function, _ = rewards.score(["<rendered prompt>"] * 2, texts, {"answer": ["4", "4"]}, chat_prompts=chat)
    assert seen == {"prompts": chat, "completions": [[{"role": "assistant", "content": text}] for text in texts]}
    assert per_function == {"mine": [0.0, 1.0], "think": [1.0, 0.0], "correct": [1.0, 0.0]}  # ours read the text
    RewardSet([RewardFunction("mine", mine, 1.0)]).score([CHAT] * 2, texts, {})  # prompts given as text: texts
    assert seen == {"prompts": ["What is 2 + 2?"] * 2, "completions": texts}


def test_log_metric_and_log_extra_reach_a_reward_as_trl_passes_them():
    """TRL passes `log_metric(name, value)` and `log_extra(column, values)` to every reward; here they were not
    passed: a function that used them logged nothing."""
    from grpo_cli.base.errors import RewardError
    from grpo_cli.rewards import RewardFunction, RewardSet

    def lengths(completions, log_extra=None, log_metric=None, **kwargs):  # as TRL's docs write one
        if log_extra:
            log_extra("length", [len(c) for c in completions])
        if log_metric:
            log_metric("mean_length", sum(len(c) for c in completions) / len(completions))
            log_metric("mean_length", 0.0)
        return [0.0] * len(completions)

    scoring = RewardSet([RewardFunction("lengths", lengths, 1.0)]).score_all(["p"] * 2, ["ab", "abcd"], {})
    assert scoring.logged == {"mean_length": (3.0, 2)} and scoring.extra == {"length": [2, 4]}  # 3.0 and 0.0
    misuses = [lambda metric, extra: metric("kl", 1.0), lambda metric, extra: metric("reward/x", 1.0),
               lambda metric, extra: extra("completion", ["a", "b"]), lambda metric, extra: metric("m", float("nan"))]
    for misuse in misuses:  # a name of grpo-cli's own metrics or sample fields, or not a number
        def bad(completions, log_metric, log_extra, _misuse=misuse, **kwargs):
            _misuse(log_metric, log_extra)
            return [0.0] * len(completions)

        with pytest.raises(RewardError, match=r"^reward bad raised RewardError on completion 0: log_"):
            RewardSet([RewardFunction("bad", bad, 1.0)]).score_all(["p"] * 2, ["a", "b"], {})


TRL_STYLE = """
def content_length(completions, **kwargs):  # as TRL's docs write a reward for conversational data
    return [min(len(completion[0]["content"]), 10) / 10 for completion in completions]


def logs(completions, log_extra=None, log_metric=None, **kwargs):
    log_extra("words", [len(completion[0]["content"].split()) for completion in completions])
    log_metric("completions_scored", len(completions))
    return [0.0] * len(completions)


def prompts_seen(prompts, completions, **kwargs):
    assert all(isinstance(p, list) and p[-1] == {"role": "user", "content": "What is 2 + 2?"} for p in prompts), prompts
    return [0.0] * len(completions)
"""


@pytest.mark.slow  # one training step and a final eval on the tiny model
def test_a_trl_reward_trains_and_judges_the_final_eval_on_chat_prompts_unchanged(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": CHAT}], "answer": "4"}] * 2
    write_jsonl(tmp_path / "train.jsonl", rows)
    write_jsonl(tmp_path / "test.jsonl", rows)
    (tmp_path / "trl_style.py").write_text(TRL_STYLE)
    run = tmp_path / "run"
    proc = run_cli(["+recipe=quickstart", "model=tiny", "data=jsonl", "data.path=train.jsonl",
                    "data.eval_path=test.jsonl", "data.question_suffix=''",
                    "reward.only=[trl_style.content_length,trl_style.prompts_seen,trl_style.logs,"
                    "trl.rewards.think_format_reward]", "reward.accuracy=logs", "eval.final=true",
                    "trainer.max_steps=1", "trainer.log_samples_every=1", "data.prompts_per_step=2",
                    "algo.num_generations=2", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert sorted(k for k in row if k.startswith("reward/")) == [
        "reward/content_length", "reward/logs", "reward/prompts_seen", "reward/think_format_reward"]
    assert row["completions_scored"] == 4  # log_metric's, under its name
    assert all(k in OWN_METRICS or k.startswith(OWN_METRIC_PREFIXES) for k in row if k != "completions_scored")
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["words"] for s in samples] == [len(s["completion"].split()) for s in samples]  # log_extra's column
    assert json.loads((run / "final_eval.json").read_text())["eval/accuracy"] == 0.0  # judged with TRL's loggers


def test_adding_a_function_by_a_mapping_says_how_instead_of_naming_the_option_in_use(tmp_path):
    """It said `reward.functions is a key of reward=arithmetic, code, gsm8k, not of the reward option in use`, naming
    the very option in use (arithmetic)."""
    proc = run_cli(["+recipe=quickstart", "model=tiny", "reward.functions={mine:{_target_: my_rewards.mine}}",
                    f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert "\n" not in line and "not of the reward option in use" not in line
    assert line.startswith("grpo-train: reward.functions={...} is merged into the reward.functions the config has, "
                           "which has no mine")
    assert "+reward.functions.mine._target_=my_module.mine" in line and "reward.only=[my_module.mine]" in line


# ---- the reward-dominance alarm -----------------------------------------------------------------------------------
def monitor_rows(steps: int, **means) -> list[dict]:
    """Metric rows whose reward/NAME means follow `means` (a function of the step each)."""
    return [{"step": s, "frac_reward_zero_std": 0.0, "truncated_frac": 0.0, "completion_len": 8.0, "kl": 0.0,
             **{f"reward/{name}": f(s) for name, f in means.items()}} for s in range(steps)]


def alarms(monitors, rows) -> list[str]:
    return [line for r in rows for line in monitors.observe(r)]


def test_the_dominance_alarm_leaves_the_task_reward_alone(config):
    """The README's brevity example: correct (weight 1, reward.accuracy) at 0.94-0.98, brevity (weight 0.1) next to
    nothing; correct carries the sum because it is the task, which the alarm called a hack."""
    from grpo_cli.run.monitors import Monitors

    reward = config(["+recipe=quickstart", "+reward.functions.brevity._target_=my_rewards.brevity",
                     "+reward.functions.brevity.weight=0.1"]).reward
    assert reward.carrying_the_task() == {"correct"}
    rows = monitor_rows(14, correct=lambda s: 0.94 + 0.01 * (s % 5), brevity=lambda s: 0.2 + 0.01 * (s % 3))
    weights = {name: spec.weight for name, spec in reward.functions.items()}
    assert alarms(Monitors(weights, reward.carrying_the_task()), rows) == []
    # a reward that is not the task and carries the sum still is an alarm
    hacked = monitor_rows(14, correct=lambda s: 0.01, brevity=lambda s: 0.5 + 0.01 * (s % 3))
    said = alarms(Monitors({"correct": 1.0, "brevity": 1.0}, reward.carrying_the_task()), hacked)
    assert len(said) == 1 and "reward/brevity" in said[0] and "may be learning brevity alone" in said[0]


def test_a_reward_the_user_marks_as_the_task_is_left_alone_too(config):
    from grpo_cli.run.monitors import Monitors

    reward = config(["+recipe=quickstart", "reward.accuracy=null", "reward.task_rewards=[correct]"]).reward
    rows = monitor_rows(14, correct=lambda s: 0.9 + 0.01 * (s % 5), bare=lambda s: 0.01)
    assert alarms(Monitors({"correct": 1.0, "bare": 1.0}, reward.carrying_the_task()), rows) == []
    with pytest.raises(ConfigError, match=r"^reward.task_rewards=\[corect\] is invalid: corect is not a reward "):
        config(["+recipe=quickstart", "reward.task_rewards=[corect]"])


def test_a_constant_reward_that_carries_the_sum_is_not_called_learning():
    """A format reward that every completion earns (1.0 every step) carries the sum: it teaches nothing (equal scores,
    no advantage), and the alarm said `the policy may be learning format alone`."""
    from grpo_cli.run.monitors import Monitors

    rows = monitor_rows(12, correct=lambda s: 0.02 * (s % 3), format=lambda s: 1.0)
    said = alarms(Monitors({"correct": 1.0, "format": 1.0}, {"correct"}), rows)
    assert len(said) == 1
    assert "learning" not in said[0]
    assert said[0].startswith("monitor/top_reward_share = ")
    assert "its mean has not moved in those steps, so it gives every completion the same score and teaches nothing" \
           in said[0]


# ---- messages that say what they are ------------------------------------------------------------------------------
def test_cells_that_are_all_tied_are_tied_and_none_is_best():
    """A sweep whose cells do not differ (the same mean, or Welch's p >= 0.05 for each) marked the first one best."""
    from grpo_cli.sweep.stats import ALL_TIED, BEST, TIED, WORSE, cell_table

    def job(beta, seed, value):
        return {"algo.beta": beta, "trainer.seed": seed, "final_reward": value, "status": "ok"}

    keys = ["algo.beta", "trainer.seed"]
    equal = [job(0.0, 0, 0.5), job(0.04, 0, 0.5)]  # one seed each, the same value
    assert [c["label"] for c in cell_table(equal, keys, ["final_reward"], "final_reward")] == [ALL_TIED, ALL_TIED]
    noisy = [job(b, s, v) for b, vs in {0.0: [0.61, 0.70, 0.66], 0.04: [0.60, 0.71, 0.64]}.items()
             for s, v in enumerate(vs)]
    table = cell_table(noisy, keys, ["final_reward"], "final_reward")
    assert [c["label"] for c in table] == [ALL_TIED, ALL_TIED] and table[1]["p_vs_best"] > 0.05
    # one that differs: the first is best again, and ties with it say so
    worse = noisy + [job(0.1, s, v) for s, v in enumerate([0.20, 0.22, 0.21])]
    labels = [c["label"] for c in cell_table(worse, keys, ["final_reward"], "final_reward")]
    assert labels == [BEST, TIED, WORSE]


def test_the_memory_budgets_plan_is_information_not_a_warning(tmp_path):
    """`grpo-train: warning: trainer.memory_budget_gb=...: micro-batches of ...` said what the budget chose."""
    proc = run_cli(["+recipe=quickstart", "model=tiny", "trainer.device=cpu", "trainer.memory_budget_gb=4",
                    "trainer.max_steps=1", "data.prompts_per_step=2", "algo.num_generations=2",
                    f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = [line for line in (proc.stdout + proc.stderr).splitlines() if "trainer.memory_budget_gb=4:" in line]
    assert len(plan) == 1 and plan[0].startswith("grpo-train: trainer.memory_budget_gb=4: micro-batches of"), plan
    assert "warning" not in plan[0]


def test_the_sandbox_in_use_is_named_once_at_start_up(compose, capsys):
    """The code recipe's two entries (tests, passed) each set the sandbox up; none said which level runs programs."""
    from grpo_cli.base.errors import send_warnings_to
    from grpo_cli.rewards.sandbox import resolve

    send_warnings_to(None)  # a fresh start: each text said once from here
    validate(compose(["+recipe=code", "model=tiny"]))
    err = capsys.readouterr().err.splitlines()
    kind = resolve("auto").kind
    named = [line for line in err if "sandbox" in line]
    assert len(named) == 1, err
    if kind != "rlimits":  # the weakest level is a warning of its own
        prog, text = named[0].split(": ", 1)  # PROG: the program's name (pytest's here)
        assert text.startswith(f"the code reward's programs run in the {kind} sandbox (sandbox=auto): "), named
        assert "warning" not in named[0]


def test_a_recipe_kept_in_the_repositorys_recipes_folder_lands_outside_the_package(tmp_path):
    """The top-level `recipes/` was a symlink into src/grpo_cli/recipes: a user's recipe written there became a
    packaged one. It is a folder of its own, found from the repository's root like any working directory's."""
    from conftest import REPO

    from grpo_cli.config.compose import RECIPES_DIR, available_recipes

    assert not (REPO / "recipes").is_symlink()
    assert (REPO / "recipes").resolve() != RECIPES_DIR.resolve()
    assert not (REPO / "recipes").resolve().is_relative_to((REPO / "src").resolve())
    assert {"quickstart", "code", "gsm8k"} <= set(available_recipes())  # the packaged ones, from anywhere


def group_options_markdown() -> str:
    """docs/options.md's list of the config groups: each group of conf/ with every option it has, conf/config.yaml's
    default first."""
    from omegaconf import DictConfig, OmegaConf

    from grpo_cli.config.compose import CONF_DIR

    defaults = [d for d in OmegaConf.load(CONF_DIR / "config.yaml").defaults if isinstance(d, DictConfig)]
    lines = []
    for group, default in ((str(g), str(o)) for d in defaults for g, o in d.items() if (CONF_DIR / str(g)).is_dir()):
        others = sorted({f.stem for f in (CONF_DIR / group).glob("*.yaml")} - {default})
        lines.append(f"- `{group}`: `{default}` (default), " + ", ".join(f"`{o}`" for o in others))
    return "\n".join(lines)


def test_the_docs_list_every_option_of_every_config_group():
    """docs/options.md's hand-written list lacked code_tasks, humaneval and reward=code."""
    from conftest import REPO

    page = (REPO / "docs" / "options.md").read_text()
    block = page.split("<!-- groups:start -->\n")[1].split("\n<!-- groups:end -->")[0]
    assert block == group_options_markdown(), (
        "docs/options.md's list of config groups is out of date; put this between its <!-- groups:start --> and "
        "<!-- groups:end --> lines:\n" + group_options_markdown())
    for option in ("`code_tasks`", "`humaneval`", "`jsonl`", "`code`"):
        assert option in block


# ---- progress while the model loads and while a step runs -----------------------------------------------------
def test_the_live_line_shows_what_the_step_under_way_is_doing():
    import io

    from rich.console import Console

    from grpo_cli.tracking import ConsoleView

    out = io.StringIO()
    # a capable terminal whatever TERM the suite runs under (TERM=dumb in CI: tests/tracking/test_console.py)
    view = ConsoleView(3, 0, Console(file=out, force_terminal=True, width=140, _environ={"TERM": "xterm-256color"}))
    view.phase(0, "generating")
    view.progress.refresh()
    assert "step 0: generating" in out.getvalue()
    view.phase(0, "updating")
    view.progress.refresh()
    view.close({"steps": 1})
    assert "step 0: updating" in out.getvalue()
    plain = io.StringIO()
    ConsoleView(3, 0, Console(file=plain, force_terminal=False)).phase(0, "generating")  # off a terminal: no line
    assert plain.getvalue() == ""


def test_loading_shows_a_spinner_on_a_terminal_and_a_line_off_it():
    import io

    from rich.console import Console

    from grpo_cli.tracking import loading

    live = io.StringIO()
    terminal = Console(file=live, force_terminal=True, width=120, _environ={"TERM": "xterm-256color"})
    with loading("tiny-random and its rollout engine", terminal):
        pass
    assert "loading tiny-random and its rollout engine" in live.getvalue()
    assert "loaded tiny-random and its rollout engine in " in live.getvalue()
    plain = io.StringIO()
    with loading("tiny-random", Console(file=plain, force_terminal=False, width=120)):
        plain.write("[the model loads here]\n")
    assert plain.getvalue().splitlines()[:2] == ["loading tiny-random", "[the model loads here]"]
    assert plain.getvalue().splitlines()[2].startswith("loaded tiny-random in ")
    dumb = io.StringIO()  # TERM=dumb cannot redraw a spinner in place: the plain lines
    with loading("tiny-random", Console(file=dumb, force_terminal=True, width=120, _environ={"TERM": "dumb"})):
        pass
    assert dumb.getvalue().splitlines()[0] == "loading tiny-random"
