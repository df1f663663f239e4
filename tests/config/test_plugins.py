"""The one plug-in idiom: a registry filled by a decorator, and a user's own module named in `plugins=[...]`
adding a rollout engine and a logger that the real grpo-train uses end to end."""

from __future__ import annotations

import os
import textwrap

import pytest
from conftest import read_jsonl, run_cli

from grpo_cli.base.errors import ConfigError
from grpo_cli.base.registry import Registry, import_plugins

TOY_PLUGINS = textwrap.dedent('''
    """A user's plug-ins: each is one class and one registration line."""
    import json

    import torch

    from grpo_cli.rollout import ENGINES, Engine, eos_ids, left_pad
    from grpo_cli.rollout.common import finish_rollout
    from grpo_cli.tracking import LOGGERS, NullSink

    ANSWER = "toy answer"


    @ENGINES.register("toy")
    class ToyEngine(Engine):
        """Answers every prompt with ANSWER, then EOS."""

        def generate(self, prompt_ids, num_generations, sampling, stop=None):
            ids, mask = left_pad(prompt_ids, self.tokenizer.pad_token_id, self.device)
            eos = eos_ids(self.model, self.tokenizer)
            tokens = (self.tokenizer(ANSWER, add_special_tokens=False)["input_ids"] + eos[:1])[:sampling.max_new_tokens]
            completion = torch.tensor([tokens] * (len(prompt_ids) * num_generations), device=self.device)
            return finish_rollout(self.tokenizer, eos, ids, mask, completion, num_generations, False)


    @LOGGERS.register("toy")
    class ToySink(NullSink):
        """Every row and the summary, in the run dir's toy_log.jsonl."""

        def __init__(self, cfg_logger, run):
            self.path = run.run_dir / "toy_log.jsonl"

        def log(self, row):
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\\n")

        def close(self, summary):
            with self.path.open("a") as f:
                f.write(json.dumps({"summary": summary}) + "\\n")
            return {"toy": str(self.path)}
''')


def test_registry_names_lookup_and_one_registration_per_name():
    things = Registry("thing", key="group.thing")

    @things.register("a")
    def make_a(): ...

    assert things.names() == ("a",) and things.lookup("a") is make_a
    with pytest.raises(ValueError, match="thing 'a' is registered twice"):
        things.register("a")(lambda: None)
    with pytest.raises(ConfigError, match=r"^group.thing=b is invalid: use one of a$"):
        things.lookup("b")


def test_a_plugin_module_that_cannot_be_imported_is_a_config_error():
    import_plugins([])
    with pytest.raises(ConfigError, match=r"^plugins=no_such_plugin_module is invalid: it cannot be imported "
                                          r"\(ModuleNotFoundError: No module named 'no_such_plugin_module'\)"):
        import_plugins(["no_such_plugin_module"])
    with pytest.raises(ConfigError, match="give a list of module names"):
        import_plugins("grpo_cli")


@pytest.mark.slow  # a grpo-train process; the message itself is checked in-process above
def test_bad_plugin_name_is_one_line_exit_2(tmp_path):
    proc = run_cli(["+recipe=quickstart", "model=tiny", "plugins=[no_such_plugin_module]"], tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "grpo-train: plugins=no_such_plugin_module is invalid: it cannot be imported (ModuleNotFoundError: No module "
        "named 'no_such_plugin_module'); put its folder on PYTHONPATH or fix the module name"]


@pytest.mark.slow
def test_a_toy_engine_and_a_toy_logger_from_a_plugin_module_train_end_to_end(tmp_path):
    (tmp_path / "toy_plugins.py").write_text(TOY_PLUGINS)
    run_dir = tmp_path / "run"
    proc = run_cli(["+recipe=quickstart", "model=tiny", "trainer.max_steps=2", "rollout.max_new_tokens=6",
                    "trainer.log_samples_every=1", "plugins=[toy_plugins]", "rollout.engine=toy", "logger.backend=toy",
                    f"hydra.run.dir={run_dir}"], tmp_path,
                   env={"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert {s["step"] for s in samples} == {0, 1}
    assert {s["completion"] for s in samples} == {"toy answer"}  # the toy engine generated every completion
    *rows, last = read_jsonl(run_dir / "toy_log.jsonl")
    assert rows == read_jsonl(run_dir / "metrics.jsonl") and [r["step"] for r in rows] == [0, 1]
    assert last["summary"]["steps"] == 2
    assert "toy_log.jsonl" in proc.stdout  # what the toy sink added to the summary, shown by the console


@pytest.mark.parametrize("override, message", [
    ("rollout.engine=toy", "rollout.engine=toy is invalid: use one of auto, compiled, hf, merged, vllm"),
    ("logger.backend=toy", "logger.backend=toy is invalid: use one of none, tensorboard, wandb"),
    ("optimizer.name=toy", "optimizer.name=toy is invalid: use one of adamw, sgd"),
])
@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_validation_names_the_registered_choices(compose, override, message):
    from grpo_cli.run.validate import validate

    with pytest.raises(ConfigError, match=f"^{message}$"):
        validate(compose(["+recipe=quickstart", "model=tiny", override]))


def test_a_registered_optimizer_reads_the_keys_its_builder_takes(compose):
    import torch

    from grpo_cli.config.schema import Config
    from grpo_cli.run.validate import validate
    from grpo_cli.step.optim import OPTIMIZERS, build_optimizer, optimizer_keys

    @OPTIMIZERS.register("toy_rmsprop")
    def toy_rmsprop(params, *, lr, weight_decay, alpha):
        return torch.optim.RMSprop(params, lr=lr, weight_decay=weight_decay, alpha=alpha)

    try:
        assert optimizer_keys("toy_rmsprop") == ("alpha",)
        cfg = compose(["+recipe=quickstart", "model=tiny", "optimizer=sgd", "optimizer.name=toy_rmsprop"])
        with pytest.raises(ConfigError, match="optimizer.momentum=0.9 is invalid: optimizer.name=toy_rmsprop does "
                                              "not use it"):
            validate(cfg)
        cfg = compose(["+recipe=quickstart", "model=tiny", "optimizer=sgd", "optimizer.name=toy_rmsprop",
                       "~optimizer.momentum", "~optimizer.nesterov", "+optimizer.alpha=0.5"])
        validate(cfg)
        optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(2))], Config.of(cfg).optimizer)
        assert isinstance(optimizer, torch.optim.RMSprop) and optimizer.defaults["alpha"] == 0.5
    finally:
        del OPTIMIZERS["toy_rmsprop"]
