"""Rewards computed elsewhere, against real HTTP servers on 127.0.0.1: the JSON verifier (rewards.remote) and the
LLM judge behind an OpenAI-compatible chat-completions endpoint (rewards.judge). Refusing, timing out and garbage
answers follow reward.on_error."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpo_cli.base.errors import ConfigError, RewardError
from grpo_cli.rewards import RewardFunction, RewardSet
from grpo_cli.rewards.judge import Judge, parse_score
from grpo_cli.rewards.remote import RemoteVerifier


class Server:
    """A real HTTP server in a thread: `answer(path, body) -> (status, bytes)` decides each reply; it records every
    request body by path and the most requests it had in flight at once."""

    def __init__(self, answer):
        self.answer, self.bodies, self.in_flight, self.most_in_flight = answer, [], 0, 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.bodies.append((self.path, body, dict(self.headers)))
                    server.in_flight += 1
                    server.most_in_flight = max(server.most_in_flight, server.in_flight)
                try:
                    status, data = server.answer(self.path, body)
                finally:
                    with server.lock:
                        server.in_flight -= 1
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (a timeout)
                    pass

            def log_message(self, *_):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def count(self, path: str) -> int:
        return sum(p == path for p, _, _ in self.bodies)


def json_reply(value, status: int = 200):
    return status, json.dumps(value).encode()


def verifier_answer(path, body):
    """/score: the completion's length; /bad: garbage for completions containing 'bad'; /slow: sleeps 1 s;
    /flaky: HTTP 503 for the first two tries of each completion; /teapot: HTTP 418."""
    completion = body["completion"]
    if path == "/slow":
        time.sleep(1.0)
    if path == "/bad" and "bad" in completion:
        return 200, b"<html>oops</html>" if completion == "bad" else json.dumps({"score": "high"}).encode()
    if path == "/flaky":
        verifier_answer.tries[completion] += 1
        if verifier_answer.tries[completion] <= 2:
            return 503, b"busy"
    if path == "/teapot":
        return 418, b"I am a teapot"
    if path == "/concurrent":
        time.sleep(0.1)
    return json_reply({"score": len(completion)} if path != "/bare" else len(completion))


verifier_answer.tries = Counter()


@pytest.fixture
def server():
    verifier_answer.tries.clear()
    s = Server(verifier_answer)
    yield s
    s.close()


def refusing_url() -> str:
    """A URL on 127.0.0.1 where nothing listens: every connection is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/score"


def rewards(fn, on_error: str = "raise") -> RewardSet:
    return RewardSet([RewardFunction("verified", fn, 1.0)], on_error=on_error)


# ---- the verifier ----------------------------------------------------------------------------------------------
def test_each_completion_is_posted_with_its_row_and_scored_in_order(server):
    verifier = RemoteVerifier(url=server.url + "/score", headers={"Authorization": "Bearer t0ken"})
    scores = verifier(["p0", "p1", "p2"], ["a", "bbb", "cc"], answer=["1", "2", "3"],
                      messages=[[{"role": "user", "content": f"q{i}"}] for i in range(3)])
    assert scores == [1.0, 3.0, 2.0]
    bodies = sorted((b for _, b, _ in server.bodies), key=lambda b: b["prompt"])
    assert bodies[1] == {"prompt": "p1", "completion": "bbb", "answer": "2",
                         "messages": [{"role": "user", "content": "q1"}]}
    assert all(h["Authorization"] == "Bearer t0ken" for _, _, h in server.bodies)
    assert RemoteVerifier(url=server.url + "/bare")(["p"], ["four"]) == [4.0]  # a bare number is an answer too


def test_retries_with_back_off_outlast_a_busy_server_and_give_up_after_them(server):
    start = time.monotonic()
    assert RemoteVerifier(url=server.url + "/flaky", retries=2, backoff_s=0.1)(["p"], ["x"]) == [1.0]
    assert server.count("/flaky") == 3 and time.monotonic() - start >= 0.1  # two 503s, then the answer
    with pytest.raises(RewardError, match=r"reward verified could not score completion 0 \(1 of 1 failed\): POST "
                                          r"http://127.0.0.1:\d+/flaky answered HTTP 503 after 2 tries: 'busy'; fix it "
                                          r"or set reward.on_error=zero"):
        rewards(RemoteVerifier(url=server.url + "/flaky", retries=1, backoff_s=0.0)).score(["p"], ["y"], {})


def test_a_refusing_server_stops_the_run_in_one_line_or_scores_0(server):
    url = refusing_url()
    verifier = RemoteVerifier(url=url, retries=1, backoff_s=0.0)
    with pytest.raises(RewardError) as raised:
        rewards(verifier).score(["p"] * 2, ["a", "b"], {})
    assert str(raised.value) == (f"reward verified could not score completion 0 (2 of 2 failed): POST {url} failed "
                                 "after 2 tries (Connection refused); fix it or set reward.on_error=zero")
    totals, _, errors = rewards(verifier, on_error="zero").score(["p"] * 2, ["a", "b"], {})
    assert totals == [0.0, 0.0] and errors == 2


def test_a_timeout_is_an_error_of_that_completion(server):
    verifier = RemoteVerifier(url=server.url + "/slow", timeout_s=0.3, retries=0)
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"POST http://127.0.0.1:\d+/slow failed after 1 try \(timed out\)"):
        rewards(verifier).score(["p"], ["a"], {})
    assert time.monotonic() - start < 0.9


def test_garbage_answers_zero_only_their_completions_without_posting_again(server):
    verifier = RemoteVerifier(url=server.url + "/bad", retries=2, backoff_s=0.0)
    totals, per_fn, errors = rewards(verifier, on_error="zero").score(["p"] * 4, ["good", "bad", "fine", "so bad"], {})
    assert totals == [4.0, 0.0, 4.0, 0.0] and errors == 2
    assert server.count("/bad") == 4  # garbage is not retried, and the scored ones are not posted again
    with pytest.raises(RewardError, match=r"could not score completion 1 \(1 of 2 failed\): "
                                          r"POST http://127.0.0.1:\d+/bad answered what is not JSON: "
                                          r"'<html>oops</html>'"):
        rewards(verifier).score(["p"] * 2, ["good", "bad"], {})
    no_number = r"the answer '\{\"score\": \"high\"\}' holds no finite number under \"score\""
    with pytest.raises(RewardError, match=no_number):
        rewards(verifier).score(["p"], ["so bad"], {})
    with pytest.raises(RewardError, match=r"answered HTTP 418: 'I am a teapot'; fix it"):
        rewards(RemoteVerifier(url=server.url + "/teapot")).score(["p"], ["a"], {})


def test_no_more_requests_in_flight_than_the_concurrency(server):
    RemoteVerifier(url=server.url + "/concurrent", concurrency=2)(["p"] * 8, ["x"] * 8)
    assert server.most_in_flight == 2
    RemoteVerifier(url=server.url + "/concurrent", concurrency=8)(["p"] * 8, ["x"] * 8)
    assert server.most_in_flight > 2


def test_bad_verifier_options_are_one_line():
    for options, message in [({"url": "localhost:8000"}, "url=localhost:8000 is invalid: needs an http"),
                             ({"url": "http://h", "retries": -1}, "retries=-1 is invalid: needs an integer >= 0"),
                             ({"url": "http://h", "concurrency": 0}, "concurrency=0 is invalid"),
                             ({"url": "http://h", "headers": {"a": 1}}, "headers=.* is invalid")]:
        with pytest.raises(ConfigError, match=message):
            RemoteVerifier.check_options("reward.functions.v", options)


# ---- the judge ----------------------------------------------------------------------------------------------
def chat_answer(path, body):
    """An OpenAI-compatible /v1/chat/completions: the reply is the text after `REPLY:` in the user's message
    (so the completion decides what the judge says); /broken/v1: not a chat completion."""
    assert path.endswith("/chat/completions")
    if path.startswith("/broken"):
        return json_reply({"object": "error", "message": "model not found"})
    content = body["messages"][-1]["content"]
    reply = content.split("REPLY:", 1)[1].split("\n")[0] if "REPLY:" in content else "Score: 5"
    return json_reply({"id": "x", "object": "chat.completion", "model": body["model"],
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                                    "finish_reason": "stop"}]})


@pytest.fixture
def chat_server():
    s = Server(chat_answer)
    yield s
    s.close()


def test_the_judge_fills_its_template_and_reads_each_score(chat_server):
    judge = Judge(url=chat_server.url + "/v1", model="smollm2", api_key="k3y", max_tokens=8,
                  template="Q: {question}\nGold: {answer}\nA: {completion}\nScore it.")
    completions = ["REPLY:Score: 8", "REPLY:I'd rate it 3/10.", "REPLY:<think>7?</think> rating: 10"]
    messages = [[{"role": "system", "content": "sys"}, {"role": "user", "content": f"question {i}"}] for i in range(3)]
    scores = judge(["p"] * 3, completions, messages=messages, answer=["4", "5", "6"])
    assert scores == [0.8, 0.3, 1.0]
    path, body, headers = next(b for b in chat_server.bodies if "Score: 8" in b[1]["messages"][0]["content"])
    assert path == "/v1/chat/completions" and headers["Authorization"] == "Bearer k3y"
    assert body == {"model": "smollm2", "temperature": 0.0, "max_tokens": 8, "messages": [
        {"role": "user", "content": "Q: question 0\nGold: 4\nA: REPLY:Score: 8\nScore it."}]}


def test_a_reply_without_a_score_or_not_a_chat_completion_follows_on_error(chat_server):
    judge = Judge(url=chat_server.url + "/v1", model="m")
    with pytest.raises(RewardError, match=r"could not score completion 1 \(1 of 2 failed\): the judge's reply holds no "
                                          r"score in \[0, 10\]: 'It is fine.'"):
        RewardSet([RewardFunction("judge", judge, 1.0)]).score(["p"] * 2, ["REPLY:Score: 4", "REPLY:It is fine."], {})
    totals, _, errors = RewardSet([RewardFunction("judge", judge, 1.0)], on_error="zero").score(
        ["p"] * 3, ["REPLY:Score: 4", "REPLY:Score: 12", "REPLY:9"], {})
    assert totals == [0.4, 0.0, 0.9] and errors == 1  # 12 is outside [0, 10]
    broken = Judge(url=chat_server.url + "/broken/v1", model="m", retries=0)
    with pytest.raises(RewardError, match=r"answered no chat completion \(no choices\[0\].message.content\)"):
        RewardSet([RewardFunction("judge", broken, 1.0)]).score(["p"], ["x"], {})
    with pytest.raises(RewardError, match=r"failed after 1 try \(Connection refused\)"):
        judge = Judge(url=refusing_url(), model="m", retries=0)
        RewardSet([RewardFunction("judge", judge, 1.0)]).score(["p"], ["x"], {})


def test_a_template_field_the_row_lacks_is_one_line(chat_server):
    judge = Judge(url=chat_server.url + "/v1", model="m", template="{question} {gold}")
    with pytest.raises(RewardError, match=r"raised ValueError on completion 0: the judge's template names \{gold\}, "
                                          r"which the data row lacks \(it has: answer, completion, prompt, question\)"):
        RewardSet([RewardFunction("judge", judge, 1.0)]).score(["p"], ["x"], {"answer": ["1"]})
    for template, message in [("{question", "template=\\{question is invalid"), ("{0}", "template=\\{0\\} is invalid")]:
        with pytest.raises(ConfigError, match=message):
            Judge.check_options("reward.functions.judge", {"url": "http://h/v1", "model": "m", "template": template})
    with pytest.raises(ConfigError, match="model=None is invalid: name the model the endpoint serves"):
        Judge.check_options("reward.functions.judge", {"url": "http://h/v1"})


def test_scores_are_parsed_from_the_usual_phrasings():
    cases = {"Score: 7": 7, "**Score**: 4.5": 4.5, "I'd rate it 8/10.": 8, "8 out of 10": 8, "Rating = 6": 6,
             "<think>it could be 2</think>Score: 9": 9, "The answer 42 is right. 9": 9, "Score: 11": None,
             "no number": None, "Score: -1": None, "": None}
    assert {reply: parse_score(reply, 10) for reply in cases} == cases
    assert parse_score("3 out of 5", 5) == 3 and parse_score("0.7", 1) == 0.7


@pytest.mark.slow  # the tiny model's first step, in-process
def test_a_run_whose_verifier_refuses_stops_at_its_first_step_in_one_line(compose, tmp_path):
    from conftest import fit, make_trainer

    url = refusing_url()
    trainer = make_trainer(compose, tmp_path, "rollout.max_new_tokens=2", "data.prompts_per_step=2",
                           "algo.num_generations=2", "trainer.max_steps=2",
                           "+reward.functions.verified._target_=grpo_cli.rewards.remote.RemoteVerifier",
                           f"+reward.functions.verified.url={url}", "+reward.functions.verified.retries=0")
    with pytest.raises(RewardError) as raised:
        fit(trainer, tmp_path)
    assert str(raised.value) == (f"reward verified could not score completion 0 (4 of 4 failed): POST {url} failed "
                                 "after 1 try (Connection refused); fix it or set reward.on_error=zero")
    assert not (tmp_path / "metrics.jsonl").exists() or not (tmp_path / "metrics.jsonl").read_text().strip()
