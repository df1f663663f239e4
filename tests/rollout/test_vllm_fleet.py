"""rollout.placement=server on several vLLM servers (issue 64): every server is given every adapter version and passes
the sync check; a prompt's G completions go to one server; a server that fails is taken out (one warning) and the run
goes on with the others; a server that does not take a version stops the run naming it; the completions are those
of one server. Two vLLM CPU servers in each test: two that grpo-train starts (rollout.servers=2, each pinned to a
core of its own), or two the module starts, given as a list in rollout.server_url.
Skipped where vllm is not importable (the main venv); `make test-vllm` runs them in .venv-vllm.

Each vLLM CPU server takes ~2.5 GB and its 1 GiB KV cache (rollout.vllm_kv_cache_gib=1, VLLM_CPU_KVCACHE_SPACE=1)."""

from __future__ import annotations

import os
import re

import pytest
from conftest import alive, assert_learned, read_jsonl, run_cli, saved_base, vllm_servers
from test_async_rollouts import signal_at, stopped_after
from test_vllm_server import LORA_SERVER_ARGS, LORA_SERVER_ENV, SERVER, STARTED, assert_no_server, served_models

pytest.importorskip("vllm")

TWO = [*SERVER, "rollout.servers=2", "trainer.log_samples_every=1"]
# 16 prompts x 8 completions: each server's half of a batch prefills more tokens than vLLM's CPU server takes in one
# engine step by default (2048), which vLLM then splits (chunked prefill), and a seeded request split so ends its
# engine (vllm-cpu 0.32: "CPU Generator does not use offset"); the servers grpo-train starts do not split prefills
WIDE = ["data.prompts_per_step=16", "algo.num_generations=8"]
TAKEN_OUT = re.compile(r"warning: vLLM's server (\d) of 2 \((\S+)\) is taken out at ")


def started(stderr: str) -> list[tuple[int, str, str]]:
    """(pid, URL, where) of each server grpo-train started, in order."""
    lines = [line for line in stderr.splitlines() if STARTED.search(line)]
    return [(int(STARTED.search(line).group(1)), STARTED.search(line).group(2),
             re.search(r"\) (on core\(s\) \S+|on GPU \S+); its log", line).group(1)) for line in lines]


@pytest.fixture(scope="module")
def on_two(tmp_path_factory):
    """The K=1 run on two servers grpo-train starts: (its run dir, its CompletedProcess)."""
    folder = tmp_path_factory.mktemp("on-two")
    return folder / "run", run_cli([*TWO, *WIDE, f"hydra.run.dir={folder / 'run'}"], folder, timeout=400)


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_a_k1_run_on_two_servers_it_started_syncs_both_and_spreads_the_groups(on_two):
    """Two servers, each on a core of its own, each with --max-loras 2; every version is loaded on both and
    both pass the check (the largest gap is the step's sync/logp_gap); each step's 16 prompts go 8 to each server
    (G = 8 completions each: 64 requests a server, more prefill than one engine step takes); both servers are gone
    when grpo-train exits."""
    run, proc = on_two
    assert proc.returncode == 0, proc.stderr[-3000:]
    servers = started(proc.stderr)
    assert len(servers) == 2 and servers[0][1] != servers[1][1], proc.stderr[-3000:]
    cores = sorted(os.sched_getaffinity(0))
    assert [where for _, _, where in servers] == [f"on core(s) {cores[0]}", f"on core(s) {cores[1 % len(cores)]}"]
    for pid, _, _ in servers:
        assert_no_server(pid)
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["rollout/version"] for r in rows] == [0, 0, 1, 2]
    for r in rows:
        gaps = [r["sync/logp_gap/server1"], r["sync/logp_gap/server2"]]
        assert max(gaps) == r["sync/logp_gap"] and 0 <= max(gaps) <= 1e-3, r
        assert (r["rollout/completions/server1"], r["rollout/completions/server2"]) == (64, 64), r
        assert r["rollout/servers_up"] == 2
    assert_learned(run)
    for number in (1, 2):
        log = (run / f"vllm-server-{number}.log").read_text()
        assert log.count("POST /v1/load_lora_adapter") == 3, number  # versions 0, 1, 2
        assert "'max_loras': 2" in log, number
    assert "taken out" not in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_a_server_killed_mid_run_is_taken_out_and_the_run_finishes_on_the_other(tmp_path):
    """kill -9 of server 1 (its process group) during step 1's scoring: its calls fail, one warning names it, its
    requests and the later batches go to server 2 (it is tried again at each version and stays out), and the run
    ends its 4 steps; no server is left."""
    run, record = tmp_path / "run", tmp_path / "servers"
    proc = run_cli([*TWO, f"hydra.run.dir={run}"], tmp_path, timeout=400, env=signal_at(1, "server", record))
    assert proc.returncode == 0, proc.stderr[-3000:]
    servers = started(proc.stderr)
    killed = int(record.read_text().split()[0])
    assert killed == servers[0][0]
    warnings = TAKEN_OUT.findall(proc.stdout + proc.stderr)
    assert warnings == [("1", servers[0][1])], proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["rollout/servers_up"] for r in rows][-1] == 1
    assert rows[-1]["rollout/completions/server1"] == 0 and rows[-1]["rollout/completions/server2"] == 8
    assert all(r["sync/logp_gap"] <= 1e-3 for r in rows)
    for pid, _, _ in servers:
        assert_no_server(pid)


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_a_server_that_hangs_is_taken_out_after_the_timeout_and_the_run_finishes_on_the_other(tmp_path):
    """SIGSTOP of server 1 (its process group) during step 1's scoring: its next call gets no answer within
    rollout.server_timeout_s=10, one warning names it and the timeout, the run ends its 4 steps on server 2 (the
    stopped server does not answer the later versions' retries within 5 s), and grpo-train's exit takes the stopped
    server down too."""
    run, record = tmp_path / "run", tmp_path / "servers"
    proc = run_cli([*TWO, "rollout.server_timeout_s=10", f"hydra.run.dir={run}"], tmp_path, timeout=400,
                   env=signal_at(1, "server-stop", record))
    assert proc.returncode == 0, proc.stderr[-3000:]
    servers = started(proc.stderr)
    assert int(record.read_text().split()[0]) == servers[0][0]
    output = proc.stdout + proc.stderr
    assert TAKEN_OUT.findall(output) == [("1", servers[0][1])], output[-3000:]
    assert "timed out" in next(line for line in output.splitlines() if TAKEN_OUT.search(line))
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and rows[-1]["rollout/completions/server2"] == 8
    for pid, _, _ in servers:
        assert_no_server(pid)


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_with_every_server_gone_the_run_stops_in_one_line_with_its_checkpoint(tmp_path):
    """kill -9 of both servers during step 1's scoring: the next version reaches no server, and the run stops in one
    line before step 2's update, the state after 2 steps checkpointed; exit 1."""
    run, record = tmp_path / "run", tmp_path / "servers"
    proc = run_cli([*TWO, "trainer.save_every=0", f"hydra.run.dir={run}"], tmp_path, timeout=400,
                   env=signal_at(1, "servers", record))
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("grpo-train: ") and last.endswith(stopped_after(2, run)), last
    assert "no vLLM server is left" in last or "ended with exit code" in last, last
    assert (run / "checkpoints" / "step-000002").is_dir()
    for pid in map(int, record.read_text().split()):
        assert_no_server(pid)


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    """Two vLLM OpenAI-compatible servers of SERVER's base (the tiny model grpo-train builds from trainer.seed),
    started here as a user would start them for rollout.server_url: their base URLs and processes."""
    folder = tmp_path_factory.mktemp("served")
    args = [*LORA_SERVER_ARGS, "--max-loras", "2", "--logprobs-mode", "processed_logprobs",
            "--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048"]
    with vllm_servers(saved_base(folder, SERVER), folder, args, {**LORA_SERVER_ENV, "OMP_NUM_THREADS": "1"},
                      count=2) as servers:
        yield servers


def given(*urls: str) -> str:
    return f"rollout.server_url=[{','.join(urls)}]"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_completions_of_two_servers_are_those_of_one(tmp_path, two_servers):
    """The same K=1 run (16 prompts x 8 completions a step) on server 1 alone and on servers 1 and 2 (each group on
    one of them, by the requests each has outstanding): every step's completions are the same, token for token, and
    so are the rewards and the steps' statistics that follow from them; the second run did use both servers."""
    (first, _), (second, _) = two_servers
    one, two = tmp_path / "one", tmp_path / "two"
    proc = run_cli([*SERVER, *WIDE, "trainer.log_samples_every=1", given(first), f"hydra.run.dir={one}"], tmp_path,
                   timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli([*SERVER, *WIDE, "trainer.log_samples_every=1", given(first, second), f"hydra.run.dir={two}"],
                   tmp_path, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = [[(s["step"], s["completion"]) for s in read_jsonl(run / "samples.jsonl")] for run in (one, two)]
    assert samples[0] == samples[1] and len(samples[0]) == 4 * 128
    rows = [read_jsonl(run / "metrics.jsonl") for run in (one, two)]
    assert [r["reward"] for r in rows[0]] == [r["reward"] for r in rows[1]]
    assert [r["completion_len"] for r in rows[0]] == [r["completion_len"] for r in rows[1]]
    assert all(r["rollout/completions/server1"] == r["rollout/completions/server2"] == 64 for r in rows[1])
    assert "sync/logp_gap/server1" not in rows[0][0]  # one server: no per-server keys
    assert_learned(two)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_server_that_skips_a_sync_stops_the_run_naming_it(tmp_path, two_servers):
    """The hook makes server 2 alone load version 0's adapter under version 1's name: server 1 passes, server 2's
    probe differs once the first update moved the adapter, and the run stops before step 2's update in one line
    naming server 2, checkpointed; both servers still run, without this run's adapters."""
    from grpo_cli.rollout.server import SKIP_SYNC_TEST_HOOK

    (first, server_1), (second, server_2) = two_servers
    run = tmp_path / "run"
    proc = run_cli([*SERVER, given(first, second), f"hydra.run.dir={run}"], tmp_path, timeout=280,
                   env={SKIP_SYNC_TEST_HOOK: second})
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"grpo-train: sync check failed at step 2: after the weight sync of policy version 1 "
                           f"vLLM's server 2 of 2 ({second})'s log-probs on the probe sequence differ from the "
                           "trainer's by "), last
    assert last.endswith(stopped_after(2, run)), last
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["sync/logp_gap/server2"] <= 1e-3 for r in rows] == [True, True]
    assert server_1.poll() is None and server_2.poll() is None and alive(server_2.pid)
    for url in (first, second):
        assert not [name for name in served_models(url) if name.startswith("grpo-")], served_models(url)
