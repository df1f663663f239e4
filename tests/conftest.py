"""Shared helpers: run the real console scripts in a subprocess, read run outputs, build in-process configs."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import prewarmed
import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# The tests live in folders named after the packages they cover (tests/rollout/test_worker.py ...); a test module
# is imported by its file name (pytest's default import mode; every name is unique), so a test may import another's
# helpers (`from test_episodes import script`), and so may the grpo-train processes the tests start (they import
# tests/varied_reward.py, tests/scripted_engine.py): every test folder is on sys.path and on their PYTHONPATH.
TEST_DIRS = [str(Path(__file__).parent)] + sorted(str(d) for d in Path(__file__).parent.iterdir()
                                                  if d.is_dir() and any(d.glob("test_*.py")))
sys.path[:0] = [d for d in TEST_DIRS if d not in sys.path]
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [*TEST_DIRS, os.environ.get("PYTHONPATH")]))
# what .ci/run sets, set for a local run too: no hub, W&B offline; the console scripts the tests start get the same
for key, value in {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
                   "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(key, value)


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs two workers) each worker and the processes it starts get one torch
    thread: two workers of two threads each on two cores spend their time waiting for each other. The controller
    starts the prewarmed server that the workers share (tests/prewarmed.py) before it starts them."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)
    elif getattr(config.option, "numprocesses", None) and not config.option.collectonly:
        prewarmed.start_shared({**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(autouse=True)
def _environment_set_on_import_is_restored():
    """What a library sets in os.environ on import during one test (torch's compiler sets TOKENIZERS_PARALLELISM to
    0) does not leak into the next: the prewarmed server forks only for an environment equal to its own."""
    before = {key: os.environ.get(key) for key in prewarmed.SET_ON_IMPORT}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` are skipped, in one place, where no CUDA device is visible."""
    import torch

    if torch.cuda.is_available():
        return
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(no_cuda)


def script(name: str) -> str:
    path = BIN / name
    return str(path) if path.exists() else shutil.which(name) or name


def saved_base(folder: Path, overrides: list[str]) -> Path:
    """The base of the policy that `overrides` configure (grpo-train builds it from trainer.seed), written as vLLM
    loads it into folder/base; that path."""
    from hydra import compose, initialize_config_dir

    from grpo_cli.config.compose import CONF_DIR, register_recipes
    from grpo_cli.config.schema import Config
    from grpo_cli.model.loading import load_policy
    from grpo_cli.rollout.vllm import save_checkpoint

    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = Config.of(compose("config", overrides=overrides))
    lm = load_policy(cfg.model, "cpu", seed=cfg.trainer.seed)
    save_checkpoint(lm.model, lm.tokenizer, folder / "base", lm.dtype, with_adapter=False)
    return folder / "base"


@contextlib.contextmanager
def vllm_servers(model: Path, folder: Path, args: list[str], env: dict, count: int = 1, timeout_s: float = 300):
    """`count` vLLM OpenAI-compatible servers (vllm.entrypoints.openai.api_server, what `vllm serve` runs) of `model`
    on the CPU, on free ports of 127.0.0.1, started as a user starts them, with `args` and `env` added: [(base URL,
    process)] once each lists its models, terminated afterwards. Logs: folder/server.log (server-N.log of several)."""
    from grpo_cli.rollout.vllm_server import free_port

    servers, logs = [], []
    try:
        for number in range(1, count + 1):
            port, log = free_port(), (folder / (f"server-{number}.log" if count > 1 else "server.log")).open("w")
            logs.append(log)
            servers.append((f"http://127.0.0.1:{port}/v1", subprocess.Popen(
                [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype",
                 "float32", *args, "--host", "127.0.0.1", "--port", str(port)],
                env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **env}, stdout=log, stderr=subprocess.STDOUT)))
        for (url, server), log in zip(servers, logs, strict=True):
            wait_until_served(url, server, Path(log.name), timeout_s)
        yield servers
    finally:
        for _, server in servers:
            server.terminate()
        for _, server in servers:
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
        for log in logs:
            log.close()


def wait_until_served(url: str, server, log: Path, timeout_s: float) -> None:
    """Until the OpenAI-compatible server at `url` lists its models; its process `server` must stay up meanwhile
    (else the tail of its `log`), for at most `timeout_s` seconds."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        assert server.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"vLLM's server did not come up in {timeout_s:.0f} s"
        try:
            with urllib.request.urlopen(url + "/models", timeout=5) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(1)


def run_cli(args: list[str], cwd: Path, timeout: int = 300, env: dict | None = None, command: str = "grpo-train",
            rlimits: dict | None = None):
    """Run a console script in a process of its own (a fork of the prewarmed server: tests/prewarmed.py);
    returns CompletedProcess with text output. `rlimits` ({"RLIMIT_FSIZE": (soft, hard)}, say) are set in the child
    before the script starts."""
    full_env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    full_env.pop("WANDB_API_KEY", None)
    return prewarmed.run([script(command), *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                         timeout=timeout, rlimits=rlimits)


# a reward that varies with the completion (tests/varied_reward.py): with the quickstart reward alone every completion
# of the tiny random model scores 0, nothing is learned, and "the resumed adapter equals the straight one" says nothing
VARIED_REWARD = ["+reward.functions.varied._target_=varied_reward.by_length", "+reward.functions.varied.weight=1.0"]

# a short real run on the tiny model: 6 steps of 2 prompts x 4 completions of 4 tokens, a checkpoint every 2 steps,
# samples every step, a learning rate large enough that the adapter moves the logits, a reward that varies
TRAINED_TINY = ["+recipe=quickstart", "model=tiny", "trainer.device=cpu", "rollout.max_new_tokens=4",
                "data.prompts_per_step=2", "algo.num_generations=4", "trainer.max_steps=6", "trainer.save_every=2",
                "trainer.log_samples_every=1", "optimizer.lr=1e-2", *VARIED_REWARD]


def resume_command(args: list[str], run_dir: Path) -> str:
    """The command grpo-train's stop line gives to resume a run started with `args`: them, without a run dir, resume
    or overwrite of their own, plus trainer.resume=auto and the run dir."""
    import shlex

    kept = [a for a in args if a.partition("=")[0] not in ("hydra.run.dir", "trainer.resume", "trainer.overwrite")]
    return shlex.join(["grpo-train", *kept, "trainer.resume=auto", f"hydra.run.dir={run_dir}"])


def assert_learned(run_dir: Path) -> None:
    """The run had something to learn (rewards that differ within a group) and its adapter left its start (B = 0):
    a comparison of its adapter with another one can fail."""
    from safetensors.torch import load_file

    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert any(r["reward_std"] > 0 for r in rows), [r["reward_std"] for r in rows]
    weights = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert any(t.abs().max() > 0 for name, t in weights.items() if "lora_B" in name), "the adapter never moved"


@pytest.fixture(scope="session")
def trained_tiny_run(tmp_path_factory) -> Path:
    """The run dir of one real `grpo-train TRAINED_TINY`, trained once for every test that reads a finished run;
    a test that changes the run works on a copy."""
    cwd = tmp_path_factory.mktemp("trained_tiny")
    run = cwd / "run"
    proc = run_cli([*TRAINED_TINY, f"hydra.run.dir={run}"], cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def module_on_path(tmp_path_factory, name: str, source: str) -> dict:
    """An environment whose PYTHONPATH starts with a folder holding module `name` (its text `source`)."""
    folder = tmp_path_factory.mktemp(name)
    (folder / f"{name}.py").write_text(source)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


def straight_and_resumed(args: list[str], tmp_path: Path, env: dict, from_step: int = 2) -> tuple[Path, Path]:
    """Two grpo-train runs of `args`: one straight through, one resumed from the first's checkpoint at `from_step`
    (copied into an empty run dir); both must exit 0. Returns their run dirs."""
    import shutil

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = run_cli([*args, f"hydra.run.dir={straight}"], tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = f"step-{from_step:06d}"
    shutil.copytree(straight / "checkpoints" / step, resumed / "checkpoints" / step)
    proc = run_cli([*args, f"hydra.run.dir={resumed}", "trainer.resume=auto"], tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return straight, resumed


def finished_run(tmp_path_factory, label: str, args: list[str], env: dict) -> Path:
    """The run dir of a grpo-train run with `args` that finished (exit 0)."""
    run = tmp_path_factory.mktemp(label) / "run"
    proc = run_cli([*args, f"hydra.run.dir={run}"], run.parent, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def alive(pid: int) -> bool:
    """`pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def group_members(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (zombies, dead but not reaped, are not)."""
    members = []
    for proc in Path("/proc").iterdir():
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if proc.name.isdigit() and int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(proc.name))
    return members


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def compose():
    """Compose the packaged config like grpo-train does, without running it (a value of the wrong type is the
    ConfigError grpo-train says)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from grpo_cli.config.compose import CONF_DIR, composition_checked, register_recipes

    register_recipes()

    def _compose(overrides: list[str]):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"), composition_checked():
            return hydra_compose("config", overrides=overrides)

    return _compose


@pytest.fixture
def config(compose):
    """The typed config (schema.Config) of a composition, as grpo-train hands it to everything below its entry
    point."""
    from grpo_cli.config.schema import Config

    return lambda overrides: Config.of(compose(overrides))


TINY_TRAINER = ["+recipe=quickstart", "model=tiny", "rollout.max_new_tokens=6", "trainer.device=cpu"]


def data_config(**keys):
    """A typed data section (schema.DataConfig) of the hf source with `keys`, the rest as data=hf gives them."""
    from grpo_cli.config.schema import DataConfig, typed

    hf = {"source": "hf", "question_suffix": "", "system_prompt": None, "prompts_per_step": 4, "max_prompt_tokens": 256,
          "overlong": "truncate", "path": None, "eval_path": None}
    return typed(DataConfig, hf | keys)


def make_trainer(compose, tmp_path, *overrides, **collaborators):
    """An in-process GRPOTrainer on the tiny model (6 new tokens, CPU) with extra overrides; `tmp_path` is the
    run dir a test's `fit` gives it."""
    from grpo_cli.config.schema import Config
    from grpo_cli.step.trainer import GRPOTrainer

    return GRPOTrainer(Config.of(compose([*TINY_TRAINER, *overrides])), **collaborators)


def use_loss(trainer, loss_type: str, micro_batch_size: int | None) -> None:
    """Change the loss type and the micro-batch size of `trainer` between its updates. Its config sections are
    frozen: each changed one is a new section, and the loss settings derived from it are derived again."""
    import dataclasses

    from grpo_cli import algorithm

    trainer.algo = dataclasses.replace(trainer.algo, loss_type=loss_type)
    trainer.loss_settings = algorithm.loss_settings(trainer.algo, trainer.roll.max_new_tokens)
    trainer.tcfg = dataclasses.replace(trainer.tcfg, micro_batch_size=micro_batch_size)


def fit(trainer, run_dir):
    """The whole run of `trainer` in `run_dir`, as a program runs it (grpo_cli.run.train)."""
    from grpo_cli.run.runner import train

    return train(trainer.cfg, run_dir, trainer)


def randomise_lora(model, scale: float = 0.05, seed: int = 0) -> None:
    """A fresh adapter has B = 0 (policy == base); a random B makes the adapter change the policy."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=g) * scale).to(p.dtype))


TINY_LORA_SHAPE = {"hidden_size": 64, "num_layers": 2, "num_heads": 4}  # the model of tiny_lora_policy


def tiny_lora_policy():
    """The tiny random model (64 wide, 2 layers) on the CPU with a random LoRA adapter on every linear layer."""
    import torch

    from grpo_cli.model.loading import LoadedModel, attach_lora, load_base_model, load_tokenizer

    tokenizer = load_tokenizer("tiny-random")
    base = load_base_model("tiny-random", tokenizer, torch.float32, tiny=TINY_LORA_SHAPE)
    base.generation_config.pad_token_id = tokenizer.pad_token_id
    model = attach_lora(base, 8, 16, 0.0, "all-linear")
    randomise_lora(model)
    return LoadedModel(model, tokenizer, torch.device("cpu"), torch.float32)


def fixed_batch(trainer, rewards, step: int = 0):
    """The trainer's real batch of `step` (generated, its advantages and loss mask), scored by
    `rewards(completion index, G)` instead of the reward functions: a tiny random model earns no reward."""
    import torch

    from grpo_cli.step.batch import Scores

    generation = trainer.generate(step)
    n = generation.rollout.completion_ids.shape[0]
    scores = Scores(rewards(torch.arange(n, dtype=torch.float32), trainer.algo.num_generations), {}, 0)
    return trainer.make_batch(generation, scores)


def gradients_at_step(trainer) -> list:
    """The trainable gradients as `trainer`'s optimizer sees them (after clipping), recorded at each of its steps."""
    seen = []
    step = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        seen.extend(p.grad.detach().clone() for p in trainer.params)
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step
    return seen


@pytest.fixture
def signal_handlers_kept():
    """A sweep's on_multirun_start takes SIGINT/SIGTERM for the sweep; give pytest its own back."""
    import signal

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)
