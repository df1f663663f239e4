"""`grpo-train ... slurm.write_job=PATH`: the run as a SLURM batch script whose nodes have roles, written from the
run's one config instead of training (docs/usage.md "Many nodes with SLURM").

    node 0                 training: grpo-train with the command's own overrides (trainer.nproc ranks)
    nodes 1..M             inference (slurm.inference_nodes = M): one `vllm serve` of the base per GPU, with the
                           flags grpo-train gives the servers it starts (rollout/vllm_server.py), on ports
                           slurm.port, slurm.port + 1, ...; the training node gets their URLs as rollout.server_url
                           once every one answers

The adapters reach the servers as files, so the job's TMPDIR is a folder of the run dir (on the filesystem the
nodes share). The run dir is fixed when the job is written (hydra.run.dir, or outputs/DATE/TIME as grpo-train would
pick), so that every node and a later resume name the same one. vLLM's own server and API only: no proxy.
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from grpo_cli.base.errors import ConfigError
from grpo_cli.config.rules import is_set
from grpo_cli.config.schema import Config, fail
from grpo_cli.rollout.vllm_server import BASE_NAME, LORA_RANKS, START_DEADLINE_S, vllm_python

# overrides the job writes itself, or that only the writing reads
_WRITTEN = ("hydra.run.dir", "rollout.server_url")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def job_overrides(argv: list[str]) -> list[str]:
    """The command's overrides the training node runs with: all but slurm.* and those the job writes."""
    return [a for a in argv if "=" in a and not a.startswith("-") and not _key(a).startswith("slurm.")
            and _key(a) not in _WRITTEN]


def check_job(config: Config) -> None:
    """What a job with inference nodes needs of the config, each refusal one line."""
    slurm, rollout, model = config.slurm, config.rollout, config.model
    if not slurm.inference_nodes:
        return
    if rollout.placement != "server":
        fail("slurm.inference_nodes", slurm.inference_nodes, "runs vLLM servers for rollout.placement=server; add "
             "rollout.placement=server (and rollout.max_staleness=K), or use slurm.inference_nodes=0")
    if rollout.server_url is not None:
        fail("rollout.server_url", rollout.server_url, "is written by the job (the inference nodes' servers); drop it")
    if model.name_or_path.startswith("embedded:") or model.name_or_path == "tiny-random":
        fail("model.name_or_path", model.name_or_path, "is built by grpo-train, and vLLM's servers on other nodes "
             "cannot load it; use a hub id or a local dir of the model")


def render_job(config: Config, overrides: list[str], run_dir: str, workdir: str) -> str:
    """The batch script (bash) of `config`'s run: SBATCH lines, the servers' step, the training step."""
    check_job(config)
    slurm = config.slurm
    servers, gpus = slurm.inference_nodes, slurm.gpus_per_node
    beside = Path(sys.executable).parent / "grpo-train"  # this grpo-train, on the filesystem the nodes share
    train = [str(beside) if beside.exists() else "grpo-train", *overrides]
    roles = f"nodes 1-{servers} run vLLM servers, {gpus} each (one per GPU)" if servers else "no inference nodes"
    header = [
        "#!/bin/bash",
        f"# Written by `grpo-train ... slurm.write_job=...` (grpo-cli) on {time.strftime('%Y-%m-%d %H:%M')}; submit "
        "it with sbatch.",
        f"# Roles: node 0 trains; {roles}.",
        "#SBATCH --job-name=grpo-train",
        f"#SBATCH --nodes={1 + servers}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpus}",
        f"#SBATCH --time={slurm.time_min}",
        *([f"#SBATCH --partition={slurm.partition}"] if slurm.partition else []),
        *([f"#SBATCH --account={slurm.account}"] if slurm.account else []),
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        "set -euo pipefail",
        f"cd {shlex.quote(workdir)}",
        f"export RUN_DIR={shlex.quote(run_dir)}",
        'mkdir -p "$RUN_DIR"',
        'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        'TRAIN_NODE=${NODES[0]}',
    ]
    training = f'srun --nodes=1 --ntasks=1 --nodelist="$TRAIN_NODE" --gpus-per-node={gpus} {shlex.join(train)}'
    if not servers:
        return "\n".join([*header, "# role: training", f'{training} hydra.run.dir="$RUN_DIR"', ""])
    return "\n".join([*header, *_serving(config), "# role: training (node 0), on the servers' URLs",
                      f'{training} "rollout.server_url=[$(IFS=,; echo "${{URLS[*]}}")]" hydra.run.dir="$RUN_DIR" '
                      "|| status=$?",
                      'kill "$SERVERS" 2>/dev/null || true  # the servers\' step ends with the job in any case',
                      'exit "$status"', ""])


def _serving(config: Config) -> list[str]:
    """The inference role: a function each inference node runs (one server per GPU), its step, the URLs, the wait."""
    slurm, rollout, model = config.slurm, config.rollout, config.model
    servers, gpus = slurm.inference_nodes, slurm.gpus_per_node
    try:
        head, _, _ = vllm_python()
    except ConfigError:
        head = ["vllm", "serve"]  # no vLLM beside this grpo-train: the nodes' own
    dtype = next((d for d in (rollout.vllm_dtype, model.dtype) if d != "auto"), "bfloat16")  # auto on CUDA: bf16
    rank = next((r for r in LORA_RANKS if r >= model.lora.r), model.lora.r)
    # an inference node's GPUs are the servers' alone: most of each, where rollout.vllm_gpu_memory_utilization (the
    # share beside a trainer by default) is not set
    memory = rollout.vllm_gpu_memory_utilization if is_set(config, "rollout.vllm_gpu_memory_utilization") else 0.9
    serve = [*head, model.name_or_path, "--served-model-name", BASE_NAME, "--dtype", dtype, "--host", "0.0.0.0",
             "--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(rollout.max_staleness + 1),
             "--seed", str(config.trainer.seed), "--logprobs-mode", "processed_logprobs",
             "--gpu-memory-utilization", str(memory),
             *(["--max-model-len", str(rollout.vllm_max_model_len)] if rollout.vllm_max_model_len else [])]
    return [
        f'SERVE_NODES=("${{NODES[@]:1:{servers}}}")',
        "# the adapters the trainer writes are read by the servers: a scratch dir on the shared filesystem",
        'export TMPDIR="$RUN_DIR/tmp/$SLURM_JOB_ID"',
        'mkdir -p "$TMPDIR"',
        "# role: inference (nodes 1-N): vLLM's OpenAI server of the base on each GPU, LoRA adapters loaded at run time",
        "serve_gpus() {",
        "  export VLLM_ALLOW_RUNTIME_LORA_UPDATING=True",
        f"  for gpu in $(seq 0 {gpus - 1}); do",
        f"    CUDA_VISIBLE_DEVICES=$gpu {shlex.join(serve)} --port $(({slurm.port} + gpu)) \\",
        '      >"$RUN_DIR/vllm-$(hostname)-gpu$gpu.log" 2>&1 &',
        "  done",
        "  wait",
        "}",
        "export -f serve_gpus",
        f"srun --nodes={servers} --ntasks={servers} --ntasks-per-node=1 "
        f'--nodelist="$(IFS=,; echo "${{SERVE_NODES[*]}}")" --gpus-per-node={gpus} bash -c serve_gpus &',
        "SERVERS=$!",
        "URLS=()",
        'for node in "${SERVE_NODES[@]}"; do',
        f'  for gpu in $(seq 0 {gpus - 1}); do URLS+=("http://$node:$(({slurm.port} + gpu))/v1"); done',
        "done",
        "# every server answers before training starts, within the deadline (GRPO_SERVERS_START_S seconds, "
        f"{START_DEADLINE_S} unless set);",
        "# a server step that ended, or one past the deadline, stops the job in one line",
        f"deadline=$((SECONDS + ${{GRPO_SERVERS_START_S:-{START_DEADLINE_S}}}))",
        'for url in "${URLS[@]}"; do',
        '  until curl -sf --max-time 10 "$url/models" >/dev/null; do',
        '    kill -0 "$SERVERS" 2>/dev/null || { echo "grpo-train job: the vLLM servers ended before $url answered;'
        ' see $RUN_DIR/vllm-*.log" >&2; exit 1; }',
        '    (( SECONDS < deadline )) || { echo "grpo-train job: $url did not answer within'
        f' ${{GRPO_SERVERS_START_S:-{START_DEADLINE_S}}} s; see $RUN_DIR/vllm-*.log (raise GRPO_SERVERS_START_S for a'
        ' slow start)" >&2; kill "$SERVERS"; exit 1; }',
        "    sleep 5",
        "  done",
        "done",
        "status=0",
    ]


def write_job(config: Config, argv: list[str], run_dir: str | None) -> tuple[Path, str]:
    """Write the job of `config` (composed from `argv`) to slurm.write_job; its path and the run dir."""
    run_dir = run_dir or f"outputs/{time.strftime('%Y-%m-%d/%H-%M-%S')}"
    assert config.slurm.write_job is not None  # the command line set it: that is what asks for a job
    path = Path(config.slurm.write_job).expanduser()
    text = render_job(config, job_overrides(argv), run_dir, str(Path.cwd()))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        Path(run_dir).mkdir(parents=True, exist_ok=True)  # SLURM writes the job's output there, and makes no dir
    except OSError as err:
        raise ConfigError(f"slurm.write_job={config.slurm.write_job} is invalid: cannot be written ({err.strerror}); "
                          "pick another path") from None
    path.chmod(0o755)
    return path, run_dir
