"""`grpo-train ... slurm.write_job=PATH` (issue 64): the run written as a SLURM batch script whose nodes have roles,
node 0 training and the inference nodes running one vLLM server per GPU, from the run's one config. The test renders
it with the real grpo-train, checks its lines, and runs it with bash on a stand-in cluster: `scontrol`, `srun` and
`curl` are small scripts on PATH that print the nodes, record each step's command and answer (no SLURM here); the
training step it would run is then composed and validated as grpo-train would."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from conftest import REPO, run_cli

TWO_NODE = ["+recipe=quickstart", "model=qwen2.5-0.5b-instruct", "rollout.placement=server",
            "rollout.max_staleness=1", "trainer.max_steps=20"]


def stand_in_cluster(folder: Path, nodes: list[str]) -> dict:
    """PATH with `scontrol show hostnames` printing `nodes`, an `srun` that records its arguments (one line a step;
    the servers' step waits to be stopped, as the servers would) and a `curl` that answers."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\nprintf '%s\\n' " + " ".join(nodes) + "\n")
    (bin_dir / "srun").write_text(f"#!/bin/bash\nprintf '%q ' \"$@\" >> {folder}/steps; echo >> {folder}/steps\n"
                                  "[[ \"$*\" == *serve_gpus* ]] && exec sleep 600\nexit 0\n")
    (bin_dir / "curl").write_text(f"#!/bin/bash\necho \"$@\" >> {folder}/answered\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "n[0-2]",
            "SLURM_JOB_ID": "77"}


def test_a_two_role_job_from_one_config_renders_runs_and_trains_on_its_servers(tmp_path, compose):
    from grpo_cli.run.validate import validate

    job, run = tmp_path / "job.sh", tmp_path / "run"
    proc = run_cli([*TWO_NODE, "slurm.inference_nodes=2", "slurm.gpus_per_node=4", "slurm.partition=a100",
                    "slurm.time_min=90", f"slurm.write_job={job}", f"hydra.run.dir={run}"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == (
        f"grpo-train: wrote the SLURM job {job} (node 0 trains, nodes 1-2 run 4 vLLM servers each, run dir {run}); "
        f"submit it with: sbatch {job}")
    text = job.read_text()
    assert subprocess.run(["bash", "-n", str(job)]).returncode == 0
    sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert sbatch == ["#SBATCH --job-name=grpo-train", "#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1",
                      "#SBATCH --gpus-per-node=4", "#SBATCH --time=90", "#SBATCH --partition=a100",
                      f"#SBATCH --output={run}/slurm-%j.out"]
    serve = next(line for line in text.splitlines() if "CUDA_VISIBLE_DEVICES=$gpu" in line)
    # the server's head is vLLM's beside grpo-train (`python -m vllm.entrypoints.openai.api_server --model M`) where
    # make setup-vllm made one, else the nodes' own `vllm serve M`
    assert "--model Qwen/Qwen2.5-0.5B-Instruct " in serve or "vllm serve Qwen/Qwen2.5-0.5B-Instruct " in serve, serve
    for flag in ("--served-model-name grpo-base", "--dtype bfloat16",
                 "--enable-lora", "--max-lora-rank 16", "--max-loras 2", "--logprobs-mode processed_logprobs",
                 "--host 0.0.0.0", "--port $((8000 + gpu))"):
        assert flag in serve, (flag, serve)
    assert run.is_dir() and not (run / "metrics.jsonl").exists()  # the job's dir, nothing trained here

    env = stand_in_cluster(tmp_path, ["n0", "n1", "n2"])
    done = subprocess.run(["bash", str(job)], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    serving, training = (tmp_path / "steps").read_text().splitlines()
    assert shlex.split(serving) == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=n1,n2",
                                    "--gpus-per-node=4", "bash", "-c", "serve_gpus"]
    urls = [f"http://{node}:{8000 + gpu}/v1" for node in ("n1", "n2") for gpu in range(4)]
    assert (tmp_path / "answered").read_text().splitlines() == [f"-sf --max-time 10 {url}/models" for url in urls]
    words = shlex.split(training)
    assert words[:4] == ["--nodes=1", "--ntasks=1", "--nodelist=n0", "--gpus-per-node=4"]
    assert Path(words[4]).name == "grpo-train"
    overrides = words[5:]
    assert overrides == [*TWO_NODE, f"rollout.server_url=[{','.join(urls)}]", f"hydra.run.dir={run}"]
    assert os.path.isdir(run / "tmp" / "77")  # the adapters' scratch dir (TMPDIR), in the shared run dir
    assert validate(compose(overrides[:-1])) == []  # the training step's config is one grpo-train runs


def test_servers_that_never_answer_stop_the_job_in_one_line_at_the_deadline(tmp_path, config):
    """A server that hangs while it loads (its step alive, its port silent): the job waited until SLURM's time
    limit. The deadline is GRPO_SERVERS_START_S seconds (900 unless set; 1 here)."""
    from grpo_cli.commands.slurm import render_job

    run = tmp_path / "run"
    job = tmp_path / "job.sh"
    job.write_text(render_job(config([*TWO_NODE, "slurm.write_job=job.sh"]), TWO_NODE, str(run), str(tmp_path)))
    env = stand_in_cluster(tmp_path, ["n0", "n1"])
    (tmp_path / "bin" / "curl").write_text("#!/bin/bash\nexit 7\n")  # connection refused, every time
    done = subprocess.run(["bash", str(job)], env={**env, "GRPO_SERVERS_START_S": "1"}, capture_output=True,
                          text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"grpo-train job: http://n1:8000/v1 did not answer within 1 s; see {run}/vllm-*.log (raise "
        "GRPO_SERVERS_START_S for a slow start)")
    assert len((tmp_path / "steps").read_text().splitlines()) == 1  # the servers' step; no training step


def test_the_servers_take_most_of_their_gpus_or_the_share_the_config_sets(config):
    from grpo_cli.commands.slurm import _serving

    def share(*overrides: str) -> str:
        serve = next(line for line in _serving(config([*TWO_NODE, "slurm.inference_nodes=1", *overrides]))
                     if "CUDA_VISIBLE_DEVICES=$gpu" in line)
        return serve.split("--gpu-memory-utilization ", 1)[1].split()[0]

    assert share() == "0.9"  # the default share (0.3) is one beside a trainer
    assert share("rollout.vllm_gpu_memory_utilization=0.6") == "0.6"


def test_a_job_refuses_what_its_nodes_cannot_run_in_one_line(compose):
    import pytest

    from grpo_cli.base.errors import ConfigError
    from grpo_cli.commands.slurm import check_job
    from grpo_cli.config.schema import Config

    def refusal(*overrides: str) -> str:
        with pytest.raises(ConfigError) as err:
            check_job(Config.of(compose([*overrides, "slurm.write_job=job.sh"])))
        return str(err.value)

    assert refusal("+recipe=quickstart", "model=qwen2.5-0.5b-instruct") == (
        "slurm.inference_nodes=1 is invalid: runs vLLM servers for rollout.placement=server; add "
        "rollout.placement=server (and rollout.max_staleness=K), or use slurm.inference_nodes=0")
    assert refusal("+recipe=quickstart", "model=tiny", "rollout.placement=server") == (
        "model.name_or_path=tiny-random is invalid: is built by grpo-train, and vLLM's servers on other "
        "nodes cannot load it; use a hub id or a local dir of the model")
    assert refusal(*TWO_NODE, "rollout.server_url=http://n1:8000/v1").startswith(
        "rollout.server_url=http://n1:8000/v1 is invalid: is written by the job")


def test_a_job_without_inference_nodes_is_one_training_step(tmp_path):
    job, run = tmp_path / "job.sh", tmp_path / "run"
    proc = run_cli(["+recipe=quickstart", "trainer.nproc=2", "slurm.inference_nodes=0", "slurm.gpus_per_node=2",
                    f"slurm.write_job={job}", f"hydra.run.dir={run}"], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = job.read_text()
    assert "#SBATCH --nodes=1" in text and "vllm" not in text
    assert text.strip().splitlines()[-1].endswith(
        'grpo-train +recipe=quickstart trainer.nproc=2 hydra.run.dir="$RUN_DIR"')


def test_a_job_path_from_a_recipe_is_one_line_not_a_run_here(tmp_path):
    """grpo-train writes a job only for slurm.write_job on its command line: one a recipe sets trained here."""
    (tmp_path / "recipes").mkdir()
    quickstart = (REPO / "src" / "grpo_cli" / "recipes" / "quickstart.yaml").read_text()
    (tmp_path / "recipes" / "cluster.yaml").write_text(quickstart + "\nslurm:\n  write_job: job.sh\n"
                                                       "  inference_nodes: 0\n")
    run = tmp_path / "run"
    proc = run_cli(["+recipe=cluster", "model=tiny", f"hydra.run.dir={run}"], tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "grpo-train: slurm.write_job=job.sh is read from the command line only (a recipe or config file set it here, "
        "and the run would train instead); give it on the command line"]
    assert not (run / "metrics.jsonl").exists() and not (tmp_path / "job.sh").exists()
