"""trainer.parallel=fsdp: the frozen base sharded over the ranks with FSDP2, on the CPU with gloo through torchrun for
real. The gradient equalities with DDP and one process are in test_distributed.py (one torchrun for both)."""

from __future__ import annotations

import pytest
import torch
from conftest import VARIED_REWARD, run_cli

from grpo_cli.base.errors import ConfigError

FSDP = ["+recipe=quickstart", "model=tiny", "trainer.device=cpu", "trainer.nproc=2", "trainer.parallel=fsdp"]

# what a sharded base does not run: each refused in one line naming the key, before anything loads
REFUSED = {
    "one rank": (["trainer.nproc=1"], r"trainer.parallel=fsdp is invalid: shards the base over the ranks and this "
                                      r"job has 1; launch it under torchrun or add trainer.nproc=2"),
    "int8": (["model.quantization=int8"], r"model.quantization=int8 is invalid: does not run under "
                                          r"trainer.parallel=fsdp .*use model.quantization=nf4"),
    "prepack": (["model.prepack=true"], r"model.prepack=true is invalid: packs whole weights, and under "
                                        r"trainer.parallel=fsdp a rank holds a shard of each; use model.prepack=auto"),
    "merged": (["rollout.engine=merged"], r"rollout.engine=merged is invalid: generates from the whole base .*use "
                                          r"rollout.engine=hf \(or auto\)"),
    "compiled": (["rollout.engine=compiled"], r"rollout.engine=compiled is invalid: generates from the whole base"),
    "vllm": (["rollout.engine=vllm"], r"rollout.engine=vllm is invalid: generates from the whole base"),
    "budget": (["trainer.memory_budget_gb=4"], r"trainer.memory_budget_gb=4(\.0)? is invalid: plans for the whole "
                                               r"base on each rank.*trainer.micro_batch_tokens"),
    "tools": (["rollout.tools=[grpo_cli.tasks.calculator.calculator]"],
              r"rollout.tools=\['grpo_cli.tasks.calculator.calculator'\] is invalid: takes a different number of "
              r"turns on each rank"),
    "worker": (["rollout.placement=worker"], r"rollout.placement=worker is invalid: does not run more than one rank"),
    "server": (["rollout.placement=server"], r"rollout.placement=server is invalid: does not run more than one rank"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_a_sharded_base_does_not_run_is_refused_in_one_line(compose, case):
    from grpo_cli.run.validate import validate

    overrides, line = REFUSED[case]
    with pytest.raises(ConfigError, match=line):
        validate(compose([*FSDP, *overrides]))


def test_ddp_runs_what_fsdp_refuses(compose):
    """The refusals are fsdp's: the same settings validate under ddp (their own rules aside)."""
    from grpo_cli.run.validate import validate

    for case in ("int8", "merged", "compiled", "budget", "tools"):
        overrides, _ = REFUSED[case]
        validate(compose([*FSDP, "trainer.parallel=ddp", *overrides]))


@pytest.mark.timeout(120)
def test_grpo_train_refuses_before_torchrun_starts(tmp_path):
    """`grpo-train trainer.nproc=2 trainer.parallel=fsdp model.quantization=int8`: the one line and exit 2, from the
    one process that checks the config before relaunching under torchrun (nothing loads, no rank starts)."""
    proc = run_cli([*FSDP, "model.quantization=int8", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, timeout=100)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("grpo-train: model.quantization=int8 is invalid"), proc.stderr
    assert "torch.distributed" not in proc.stderr and not (tmp_path / "run").exists()


# ---- whole runs: grpo-train under torchrun (trainer.nproc=2 relaunches it), fsdp against ddp --------------------
TIMES = {"step_time_s", "gen_tokens_per_s", "gen_time_s", "gen_compile_s", "gen_sync_s"}  # the clock's, not the math's
ENV = {"OMP_NUM_THREADS": "1"}


def train(tmp_path, name: str, args: list[str], timeout: int = 800):
    """A grpo-train run in tmp_path/NAME; its metrics.jsonl rows."""
    from conftest import read_jsonl

    run = tmp_path / name
    proc = run_cli([*args, f"hydra.run.dir={run}"], tmp_path, timeout=timeout, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_jsonl(run / "metrics.jsonl")


def assert_same_metrics(got: list[dict], want: list[dict], rel: float = 1e-5) -> None:
    """Every metric of every step equal to `rel` (the clock's aside); rewards, lengths, counts exactly."""
    assert [row["step"] for row in got] == [row["step"] for row in want]
    for mine, theirs in zip(got, want, strict=True):
        assert set(mine) == set(theirs)
        for key in sorted(set(mine) - TIMES):
            if isinstance(theirs[key], float) and key != "reward" and not key.startswith("reward/"):
                assert mine[key] == pytest.approx(theirs[key], rel=rel, abs=1e-8), (mine["step"], key)
            else:
                assert mine[key] == theirs[key], (mine["step"], key)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_quickstart_under_fsdp_has_ddps_metrics(tmp_path):
    """The issue's run: `grpo-train +recipe=quickstart trainer.parallel=fsdp` on 2 ranks (the embedded SmolLM2, fp32,
    gloo), 3 steps: the same completions, rewards, loss, KL, gradient norm as the DDP run that generates the same way
    (rollout.engine=hf, no prepacked weights: the CPU defaults sample through other numerics)."""
    args = ["+recipe=quickstart", "trainer.device=cpu", "trainer.nproc=2", "trainer.max_steps=3",
            "trainer.log_samples_every=0"]
    ddp = train(tmp_path, "ddp", [*args, "trainer.parallel=ddp", "rollout.engine=hf", "model.prepack=false"])
    fsdp = train(tmp_path, "fsdp", [*args, "trainer.parallel=fsdp"])
    assert len(fsdp) == 3 and fsdp[-1]["kl"] > 0 and any(row["reward"] > 0 for row in fsdp)
    assert_same_metrics(fsdp, ddp)


TINY = ["+recipe=quickstart", "model=tiny", "trainer.device=cpu", "trainer.nproc=2", "trainer.max_steps=3",
        "rollout.max_new_tokens=4", "optimizer.lr=1e-2", "trainer.log_samples_every=0", *VARIED_REWARD]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_rank_evaluates_under_fsdp_and_micro_batches_even_out(tmp_path):
    """eval.every under fsdp (each greedy decode step a collective: every rank takes part, rank 0 records it), with
    micro-batches of a few tokens (each rank cuts its own rows: uneven counts, padded with idle passes) and gradient
    checkpointing (one decoder call per pass): the DDP run's metrics. (Two mini-batches a step: test_distributed.py
    holds their weights to DDP's; a metric of the second, off-policy one amplifies AdamW's rounding of near-zero
    gradient elements past 1e-5.)"""
    args = [*TINY, "eval.every=2", "eval.num_prompts=4", "trainer.micro_batch_tokens=40", "data.prompts_per_step=4",
            "trainer.gradient_checkpointing=true"]
    ddp = train(tmp_path, "ddp", [*args, "trainer.parallel=ddp", "rollout.engine=hf"])
    fsdp = train(tmp_path, "fsdp", [*args, "trainer.parallel=fsdp"])
    assert "eval/accuracy" in fsdp[1] and fsdp[-1]["kl"] > 0
    assert_same_metrics(fsdp, ddp)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_qlora_nf4_base_shards_and_trains_as_under_ddp(tmp_path):
    """model.quantization=nf4 under fsdp: bitsandbytes' 4-bit weights sharded like any other; the DDP run's metrics."""
    ddp = train(tmp_path, "ddp", [*TINY, "model.quantization=nf4", "trainer.parallel=ddp"])
    fsdp = train(tmp_path, "fsdp", [*TINY, "model.quantization=nf4", "trainer.parallel=fsdp"])
    assert fsdp[-1]["kl"] > 0
    assert_same_metrics(fsdp, ddp)


# ---- a stop and resume, two launchers, a dead rank ----------------------------------------------------------------
def adapter_of(run) -> dict:
    from safetensors.torch import load_file

    return load_file(run / "adapter" / "adapter_model.safetensors")


def started(args: list[str], tmp_path, env: dict | None = None):
    """grpo-train with `args` in a process of its own (torchrun, once it relaunches), its output read line by line."""
    import os
    import subprocess

    import prewarmed
    from conftest import script

    full_env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", **ENV, **(env or {})}
    return prewarmed.popen([script("grpo-train"), *args], cwd=tmp_path, env=full_env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)


def read_until(child, text: str, output: list[str]) -> None:
    for line in child.stdout:
        output.append(line)
        if text in line:
            return
    raise AssertionError(f"the run ended before {text!r}:\n{''.join(output)[-3000:]}")


STOPPABLE = [*TINY, "trainer.max_steps=6", "rollout.max_new_tokens=24",
             "trainer.parallel=fsdp"]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_stop_and_resume_under_fsdp_ends_with_the_uninterrupted_adapter(tmp_path):
    """SIGTERM to torchrun after step 1 (it forwards it to both ranks; they agree where to stop, gather the adapter and
    the optimizer state, rank 0 writes the checkpoint), then trainer.resume=auto: the adapter of 6 steps is the
    uninterrupted run's, bit for bit, and so is every step's record."""
    import shutil
    import signal

    from conftest import assert_learned, read_jsonl

    straight = train(tmp_path, "straight", STOPPABLE)
    run, output = tmp_path / "stopped", []
    child = started([*STOPPABLE, f"hydra.run.dir={run}"], tmp_path)
    read_until(child, "step 1 done", output)
    child.send_signal(signal.SIGTERM)
    output += child.stdout.readlines()
    child.wait(timeout=300)
    stopped = [line for line in output if line.startswith("grpo-train: stopped by SIGTERM")]
    assert len(stopped) == 1 and "resume with:" in stopped[0], "".join(output)[-3000:]
    assert len(read_jsonl(run / "metrics.jsonl")) < 6
    shutil.copytree(run, tmp_path / "under-ddp")
    resumed = train(tmp_path, "stopped", [*STOPPABLE, "trainer.resume=auto"])
    assert_learned(tmp_path / "straight")
    want, got = adapter_of(tmp_path / "straight"), adapter_of(run)
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert_same_metrics(resumed, straight, rel=0)
    # the checkpoint is the one-process file (the adapter and the optimizer state whole): ddp resumes it too, to
    # rounding (AdamW normalises the rounding of near-zero gradient elements: 1 % of an update, as test_distributed)
    as_ddp = [a for a in STOPPABLE if a != "trainer.parallel=fsdp"]  # trainer.parallel is no part of the fingerprint
    train(tmp_path, "under-ddp", [*as_ddp, "trainer.parallel=ddp", "trainer.resume=auto"])
    under_ddp = adapter_of(tmp_path / "under-ddp")
    for key in want:
        torch.testing.assert_close(under_ddp[key], want[key], rtol=1e-4, atol=1e-4)


def launcher(node_rank: int, nnodes: int, port: int, args: list[str]) -> list[str]:
    """One torchrun launcher of a job of `nnodes` launchers (one process each), meeting at 127.0.0.1:PORT (c10d)."""
    import sys

    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc-per-node=1",
            f"--node-rank={node_rank}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=fsdp-test", "--max-restarts=0", "-m", "grpo_cli.train", *args]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_two_launchers_train_as_one_job(tmp_path):
    """Two torchrun launchers (`--nnodes=2 --node-rank=0/1`, one process each, c10d rendezvous on 127.0.0.1), as two
    nodes would start them: one fsdp job, with the metrics and the adapter of one launcher's 2 processes."""
    import os
    import socket
    import subprocess

    from conftest import read_jsonl

    args = [a for a in STOPPABLE if not a.startswith("trainer.nproc")] + ["trainer.max_steps=3"]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", **ENV}
    run = tmp_path / "two"
    nodes = [subprocess.Popen(launcher(k, 2, port, [*args, f"hydra.run.dir={run}"]), cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for k in (0, 1)]
    outputs = [node.communicate(timeout=900)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    one = train(tmp_path, "one", [*args, "trainer.nproc=2"])
    assert_same_metrics(read_jsonl(run / "metrics.jsonl"), one, rel=0)
    want, got = adapter_of(tmp_path / "one"), adapter_of(run)
    assert all(torch.equal(got[k], want[k]) for k in want)


def rank_process(launcher_pid: int, rank: int) -> int:
    """The pid of the worker of RANK=`rank` among the launcher's descendants (read from /proc)."""
    from pathlib import Path

    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" (", 1)
            children.setdefault(int(rest.rsplit(") ", 1)[1].split()[1]), []).append(int(pid))
        except (OSError, IndexError, ValueError):
            continue
    todo, found = [launcher_pid], []
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            try:
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ and b"LOCAL_RANK=" + str(rank).encode() in environ:
                found.append(child)
    assert len(found) == 1, found
    return found[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_that_dies_is_one_line_on_the_other_and_an_exit(tmp_path):
    """SIGKILL of rank 1 mid-run (fsdp: every pass is a collective): rank 0 says so in one line, with the checkpoint to
    resume from, and the job ends at once (gloo sees the closed connection), not at the group's timeout."""
    import os
    import signal
    import time

    run, output = tmp_path / "run", []
    child = started([*STOPPABLE, "trainer.max_steps=50", "trainer.save_every=1", f"hydra.run.dir={run}"], tmp_path,
                    env={"GRPO_DIST_TIMEOUT_S": "300"})
    read_until(child, "step 1 done", output)
    os.kill(rank_process(child.pid, 1), signal.SIGKILL)
    t0 = time.monotonic()
    output += child.stdout.readlines()
    child.wait(timeout=120)
    assert time.monotonic() - t0 < 100  # well under the 300 s timeout
    text = "".join(output)
    ours = [line for line in output if line.startswith("grpo-train:")]
    assert child.returncode != 0
    assert len(ours) == 1, text[-3000:]
    assert ours[0].startswith("grpo-train: this rank lost the others of the job (") and \
        f"resume with the same command plus trainer.resume=auto hydra.run.dir={run}" in ours[0], ours[0]
    assert "grpo_cli/" not in text, text[-3000:]  # no traceback through our code (torchrun prints its own report)


@pytest.mark.cuda
@pytest.mark.timeout(600)
def test_fsdp_on_two_gpus_over_nccl_has_ddps_metrics(tmp_path):
    """The GPU case (scripts/gpu_check.sh): 2 ranks on 2 GPUs over NCCL, the quickstart in fp32 for 2 steps, fsdp
    against ddp with the same engine. Looser than on the CPU: CUDA's kernels and NCCL's reductions round apart."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices, {torch.cuda.device_count()} visible")
    args = ["+recipe=quickstart", "trainer.nproc=2", "trainer.max_steps=2", "model.dtype=float32",
            "rollout.engine=hf", "trainer.log_samples_every=0"]
    ddp = train(tmp_path, "ddp", [*args, "trainer.parallel=ddp"], timeout=280)
    fsdp = train(tmp_path, "fsdp", [*args, "trainer.parallel=fsdp"], timeout=280)
    assert_same_metrics(fsdp, ddp, rel=1e-4)
