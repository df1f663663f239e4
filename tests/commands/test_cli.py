"""The real grpo-train console script in a subprocess, from a directory outside the repository."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import read_jsonl, run_cli

METRIC_KEYS = {
    "step", "reward", "reward_std", "frac_reward_zero_std", "kl", "clip_fraction", "clip_fraction/low",
    "clip_fraction/high", "loss", "grad_norm",
    "entropy", "completion_len", "truncated_frac", "lr", "step_time_s", "gen_tokens_per_s",
}
TINY = ["+recipe=quickstart", "model=tiny", "rollout.max_new_tokens=6"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("outside")
    run_dir = cwd / "run"
    proc = run_cli([*TINY, "trainer.max_steps=2", "trainer.log_samples_every=1", f"hydra.run.dir={run_dir}"], cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.mark.slow
def test_metrics_have_every_contract_key(tiny_run):
    rows = read_jsonl(tiny_run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert METRIC_KEYS <= row.keys()
        assert {"reward/correct", "reward/bare"} <= row.keys()


@pytest.mark.slow
def test_kl_is_zero_at_step_zero(tiny_run):
    assert read_jsonl(tiny_run / "metrics.jsonl")[0]["kl"] == 0.0


@pytest.mark.slow
def test_adapter_and_samples_written(tiny_run):
    assert (tiny_run / "adapter" / "adapter_model.safetensors").is_file()
    assert (tiny_run / "adapter" / "adapter_config.json").is_file()
    samples = read_jsonl(tiny_run / "samples.jsonl")
    assert {s["step"] for s in samples} == {0, 1} and {"prompt", "completion", "reward"} <= samples[0].keys()
    assert (tiny_run / ".hydra" / "config.yaml").is_file()


@pytest.mark.slow
def test_issue_acceptance_command_outside_repo(tmp_path):
    proc = run_cli(["+recipe=quickstart", "model=tiny", "trainer.max_steps=2", "algo.beta=0.0", "algo.clip_eps=0.1",
                    "rollout.max_new_tokens=4"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((tmp_path / "outputs").glob("*/*/metrics.jsonl"))
    assert len(runs) == 1 and len(read_jsonl(runs[0])) == 2
    # the command sets algo.clip_eps on a fully on-policy run: one warning line says that it cannot act
    warned = [line for line in proc.stderr.splitlines() if "algo.clip_eps has no effect here" in line]
    assert len(warned) == 1 and warned[0].startswith("grpo-train: warning: "), proc.stderr[-3000:]
    assert "algo.clip_eps has no effect here" not in proc.stdout
    assert "kernels-community" not in proc.stderr + proc.stdout  # bitsandbytes' CPU note on every run, kept quiet


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_user_recipe_in_working_directory(tmp_path):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: tiny\nalgo:\n  num_generations: 3\n")
    proc = run_cli(["+recipe=mine", "--cfg", "job"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "num_generations: 3" in proc.stdout and "tiny-random" in proc.stdout


@pytest.mark.parametrize("command", ["grpo-train", "grpo-eval"])
@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_help_is_the_tools_own(tmp_path, command):
    """Hydra's help template per app: name, one usage line, the recipes, three examples, outputs, groups."""
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "mine.yaml").write_text("# @package _global_\n# My recipe: costs $5. More text.\n")
    proc = run_cli(["--help"], tmp_path, timeout=120, command=command)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith(f"{command}: ") and "powered by Hydra" not in out
    assert [line for line in out.splitlines() if line.startswith("Usage: ")] == [
        next(line for line in out.splitlines() if line.startswith(f"Usage: {command} "))]
    assert "quickstart   Quickstart: the embedded SmolLM2-135M-Instruct" in out
    assert "mine         My recipe: costs $5." in out  # the user's own recipes too
    examples = out.split("== Examples ==")[1].split("==")[0]
    assert len([line for line in examples.splitlines() if line.strip().startswith(command)]) == 3
    assert "outputs/DATE/TIME/" in out and "model: " in out and "tiny" in out


def test_unknown_recipe_is_one_line(tmp_path):
    proc = run_cli(["+recipe=nope"], tmp_path, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "nope" in lines[0] and "quickstart" in lines[0]


@pytest.mark.parametrize("sweep", [False, True])
def test_a_typo_in_an_option_name_names_the_closest_option(tmp_path, sweep):
    """Hydra's own advice, to add the key with `+`, only moved the refusal on (and a sweep got a page of it)."""
    proc = run_cli(["+recipe=quickstart", *(["-m"] if sweep else []), "algo.clip_epss=0.3,0.4"], tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["grpo-train: algo.clip_epss=0.3,0.4 is invalid: no such option; the "
                                                "closest is algo.clip_eps; `grpo-train --help` lists them"]


def test_an_eval_sweep_is_one_line_and_runs_nothing(tmp_path):
    """The sweep's summary would read each job's missing metrics.jsonl and advise deleting finished jobs."""
    proc = run_cli(["-m", "+recipe=quickstart", "model=tiny", "eval.num_prompts=1,2",
                    f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path, timeout=120, command="grpo-eval")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["grpo-eval: grpo-eval -m is not supported: a sweep's summary reads "
                                                "training runs (metrics.jsonl), not evals; run grpo-eval once per "
                                                "setting, each in a hydra.run.dir of its own"]
    assert not (tmp_path / "sweep").exists()


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_a_broken_recipe_is_one_line_where_it_is_named_and_nothing_where_not(tmp_path):
    (tmp_path / "recipes").mkdir()
    broken = tmp_path / "recipes" / "broken.yaml"
    broken.write_text("# @package _global_\ntrainer:\n  max_steps: [1\n  seed: 2\n")
    proc = run_cli(["+recipe=broken"], tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"grpo-train: recipe broken: {broken}, line 4 is not valid YAML: expected ',' or ']', but got ':' (while "
        "parsing a flow sequence from line 3); fix the YAML there"]
    proc = run_cli(["+recipe=quickstart", "--cfg", "job"], tmp_path, timeout=120)
    assert proc.returncode == 0 and "max_steps: 40" in proc.stdout and proc.stderr == ""


def test_a_module_of_the_working_directory_is_found(tmp_path, monkeypatch):
    """`_target_=my_rewards.fn` names a file beside the command, which a console script's sys.path lacks."""
    import importlib
    import sys

    from grpo_cli.commands.cli import _import_from_working_dir

    (tmp_path / "module_beside_the_command.py").write_text("VALUE = 7\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    _import_from_working_dir()
    assert importlib.import_module("module_beside_the_command").VALUE == 7
    assert sys.path[-1] == str(tmp_path)  # last: it shadows no library
    del sys.modules["module_beside_the_command"]


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_bad_value_is_one_line_before_model_load(tmp_path):
    proc = run_cli(["+recipe=quickstart", "algo.clip_eps=2"], tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["grpo-train: algo.clip_eps=2 is invalid: needs 0 < clip_eps < 1"]


@pytest.mark.slow
def test_grpo_eval_base_and_adapter(tiny_run, tmp_path):
    import json

    results = {}
    for label, extra in (("base", []), ("adapter", [f"eval.adapter={tiny_run / 'adapter'}"])):
        out = tmp_path / label
        proc = run_cli(["+recipe=quickstart", "model=tiny", "eval.num_prompts=3", "eval.samples=2",
                        "rollout.max_new_tokens=3", f"hydra.run.dir={out}", *extra], tmp_path, command="grpo-eval")
        assert proc.returncode == 0, proc.stderr[-2000:]
        results[label] = json.loads((out / "eval.json").read_text())
        assert "accuracy" in proc.stdout
    assert results["base"]["adapter"] == "base" and "adapter_sha256" not in results["base"]
    # the adapter scored, named by where it was (resolved) and by its content: a folder may be trained again later
    import hashlib

    weights = (tiny_run / "adapter" / "adapter_model.safetensors").read_bytes()
    assert results["adapter"]["adapter"] == str((tiny_run / "adapter").resolve())
    assert results["adapter"]["adapter_sha256"] == hashlib.sha256(weights).hexdigest()
    for r in results.values():
        assert r["eval/num_prompts"] == 3 and 0.0 <= r["eval/pass@2"] <= 1.0 and "eval/majority@2" in r


@pytest.mark.slow
def test_grpo_report_console_script(tiny_run, tmp_path):
    proc = run_cli([str(tiny_run), "--out", str(tmp_path / "report")], tmp_path, command="grpo-report")
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "report" / "report.html").is_file() and (tmp_path / "report" / "reward.png").is_file()
