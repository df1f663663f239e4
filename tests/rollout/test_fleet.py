"""rollout.placement=server on several servers (issue 64), the parts that need no vLLM: where a group goes, which
cores or GPU each server grpo-train starts takes, and the options' one-line refusals. The servers themselves are
tests/rollout/test_vllm_fleet.py's (make test-vllm)."""

from __future__ import annotations

import pytest
from conftest import TINY_TRAINER, VARIED_REWARD

from grpo_cli.base.errors import ConfigError
from grpo_cli.rollout.fleet import Replica, pick, placements
from grpo_cli.rollout.vllm_server import ServerAPI


def fleet(*in_flight: int, version: int = 3) -> list[Replica]:
    replicas = [Replica(i + 1, len(in_flight), ServerAPI(f"http://127.0.0.1:{8000 + i}/v1")) for i in range(
        len(in_flight))]
    for replica, busy in zip(replicas, in_flight, strict=True):
        replica.in_flight, replica.loaded = busy, {version: f"grpo-1-v{version}"}
    return replicas


def test_a_group_goes_to_the_server_with_the_least_work_outstanding_that_holds_its_version():
    replicas = fleet(3, 0, 1)
    assert pick(replicas, 3) is replicas[1]
    replicas[1].up = False  # taken out
    assert pick(replicas, 3) is replicas[2]
    replicas[2].loaded = {4: "grpo-1-v4"}  # back at a later version: not for a batch of version 3
    assert pick(replicas, 3) is replicas[0]
    assert pick(replicas, 4) is replicas[2]
    replicas[0].up = False
    assert pick(replicas, 3) is None
    assert pick(fleet(2, 2), 3).number == 1  # a tie: the first


def test_the_groups_of_a_batch_spread_over_the_servers_as_they_are_sent():
    """A batch's groups sent one after the other (each adds its G requests to its server's work) alternate between
    two idle servers, and fill an idle one before a busy one."""
    replicas, G = fleet(0, 0), 4
    chosen = []
    for _ in range(4):
        replica = pick(replicas, 3)
        replica.in_flight += G
        chosen.append(replica.number)
    assert chosen == [1, 2, 1, 2]
    replicas = fleet(8, 0)
    chosen = []
    for _ in range(3):
        replica = pick(replicas, 3)
        replica.in_flight += G
        chosen.append(replica.number)
    assert chosen == [2, 2, 1]


def test_each_server_grpo_train_starts_has_cores_of_its_own_while_there_are_enough():
    assert placements(2, 1, cores=[0, 1]) == [([0], None), ([1], None)]
    assert placements(2, 2, cores=[4, 5, 6, 7]) == [([4, 5], None), ([6, 7], None)]
    assert placements(3, 1, cores=[0, 1]) == [([0], None), ([1], None), ([0], None)]  # too few: shared in turn
    assert placements(1, 4, cores=[0, 1]) == [([0, 1], None)]
    assert placements(3, None, gpus=["0", "1"]) == [(None, "0"), (None, "1"), (None, "0")]


def test_the_server_names_in_lines_and_metrics():
    one, two = fleet(0)[0], fleet(0, 0)[1]
    assert (one.who, one.key) == ("vLLM's server", "server1")
    assert (two.who, two.key) == ("vLLM's server 2 of 2 (http://127.0.0.1:8001/v1)", "server2")


def test_server_url_takes_a_list_and_servers_is_refused_where_it_is_not_read(compose):
    from grpo_cli.config.schema import Config
    from grpo_cli.run.validate import validate

    urls = "rollout.server_url=[http://node1:8000/v1,http://node2:8000/v1]"
    cfg = compose([*TINY_TRAINER, *VARIED_REWARD, "rollout.placement=server", urls])
    assert validate(cfg) == []
    assert Config.of(cfg).rollout.server_url == ("http://node1:8000/v1", "http://node2:8000/v1")
    assert validate(compose([*TINY_TRAINER, "rollout.placement=server", "rollout.servers=2"])) == []

    def refusal(*overrides: str) -> str:
        with pytest.raises(ConfigError) as err:
            validate(compose([*TINY_TRAINER, *VARIED_REWARD, *overrides]))
        return str(err.value)

    assert refusal("rollout.placement=server", urls, "rollout.servers=2") == (
        "rollout.servers=2 is invalid: is the number of vLLM servers grpo-train starts with rollout.placement=server "
        "and no rollout.server_url; add rollout.placement=server, give the servers you run as a list in "
        "rollout.server_url instead, or drop rollout.servers")
    assert refusal("rollout.servers=2").startswith("rollout.servers=2 is invalid: is the number of vLLM servers")
    assert "needs an http(s):// base URL or a list of different ones" in refusal(
        "rollout.placement=server", "rollout.server_url=[http://node1:8000/v1,node2:8000]")
    assert "a list of different ones" in refusal(
        "rollout.placement=server", "rollout.server_url=[http://node1:8000/v1,http://node1:8000/v1]")
    assert "rollout.servers=0 is invalid" in refusal("rollout.placement=server", "rollout.servers=0")


def test_a_call_with_a_deadline_waits_no_longer_for_a_connection_while_the_others_are_out():
    """ServerRollouts.close unloads its adapters with timeout=5 while completions may hold every connection of the
    pool (it blocks at `concurrency`): the unload waited for one to come back, up to rollout.server_timeout_s."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from grpo_cli.base.errors import WorkerError

    release = threading.Event()

    class Busy(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path.endswith("/completions"):
                release.wait(30)  # a generation that takes its time
            body = b'{"choices": [{"text": ""}]}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    api = ServerAPI(f"http://127.0.0.1:{server.server_address[1]}/v1", timeout_s=600, concurrency=1)
    out = threading.Thread(target=api.call, args=("POST", "/completions", {"model": "m"}), daemon=True)
    try:
        out.start()
        time.sleep(0.3)  # the one connection is out
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"^POST http://127\.0\.0\.1:\d+/v1/unload_lora_adapter failed "):
            api.unload_adapter("grpo-1-v3", timeout=1)
        assert time.monotonic() - start < 5  # 1 s and the time to say so, not the completion's 30
    finally:
        release.set()
        out.join(10)
        server.shutdown()
        server.server_close()
