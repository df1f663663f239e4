"""A reward computed elsewhere: each completion posted as JSON to a verifier service, the score read from its answer.

    reward:
      functions:
        verified:
          _target_: grpo_cli.rewards.remote.RemoteVerifier
          weight: 1.0
          url: http://127.0.0.1:8000/score
          timeout_s: 10        # seconds for one request (connect and read)
          retries: 2           # more tries after a refused connection, a timeout or an HTTP 429 / 5xx
          backoff_s: 0.5       # the wait before the first retry, doubled before each next one
          concurrency: 8       # requests in flight at once
          headers: {}          # e.g. {Authorization: "Bearer ${oc.env:VERIFIER_TOKEN}"}

The body of each POST is `{"prompt": ..., "completion": ..., ...}`: the prompt text the policy saw, the completion,
and every field of the completion's data row (`messages`: its chat prompt as a list of messages); the answer is a
JSON number or an object with a number under "score".
An answer that is not that (garbage), an HTTP 4xx, or a failure that outlasts the retries is an error of that
completion: the others keep their scores, and reward.on_error decides (raise: the run stops with one line naming
the completion and the cause; zero: those completions score 0 and count in reward_errors), without posting the
batch again (rewards.CompletionsFailed).
"""

from __future__ import annotations

import json
import math
import queue
import threading
from typing import Any

from grpo_cli.base.errors import ConfigError
from grpo_cli.config.rule import is_int, is_number
from grpo_cli.rewards import CompletionsFailed

RETRIED_STATUS = (429, 500, 502, 503, 504)


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


class Service:
    """JSON POSTs to one URL, with urllib3's pool, timeouts and retries (exponential back-off, HTTP 429 / 5xx,
    refused connections, timeouts). `post` returns the decoded JSON answer or raises ServiceError, one line."""

    def __init__(self, url: str, timeout_s: float, retries: int, backoff_s: float, concurrency: int,
                 headers: dict[str, str] | None = None):
        import urllib3

        self.url = url
        retry = urllib3.Retry(total=retries, connect=retries, read=retries, status=retries, other=0,
                              backoff_factor=backoff_s, status_forcelist=RETRIED_STATUS, allowed_methods=None,
                              raise_on_status=False, respect_retry_after_header=False)
        self.pool = urllib3.PoolManager(num_pools=1, maxsize=concurrency, block=True, retries=retry,
                                        timeout=urllib3.Timeout(connect=timeout_s, read=timeout_s))
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.tries = retries + 1

    def post(self, body: dict) -> Any:
        import urllib3

        try:
            response = self.pool.request("POST", self.url, body=json.dumps(body, default=str).encode(),
                                         headers=self.headers)
        except urllib3.exceptions.MaxRetryError as err:
            raise ServiceError(f"POST {self.url} failed after {self.tries} {'try' if self.tries == 1 else 'tries'} "
                               f"({_reason(err.reason)})") from None
        except urllib3.exceptions.HTTPError as err:
            raise ServiceError(f"POST {self.url} failed ({_reason(err)})") from None
        if response.status >= 400:
            tried = f" after {self.tries} tries" if response.status in RETRIED_STATUS else ""
            raise ServiceError(f"POST {self.url} answered HTTP {response.status}{tried}: {_excerpt(response.data)}")
        try:
            return json.loads(response.data)
        except ValueError:
            raise ServiceError(f"POST {self.url} answered what is not JSON: {_excerpt(response.data)}") from None


class ServiceError(RuntimeError):
    """A request that failed for good, in one line."""


def _reason(err) -> str:
    text = " ".join(str(err).split())
    for marker in ("Connection refused", "timed out", "Name or service not known", "No route to host"):
        if marker.lower() in text.lower():
            return marker.lower() if marker == "timed out" else marker
    return text[:120] or type(err).__name__


def _excerpt(data: bytes) -> str:
    text = " ".join(data.decode(errors="replace").split())
    return repr(text[:80] + ("..." if len(text) > 80 else ""))


def check_service_options(prefix: str, options: dict[str, Any], extra: dict[str, tuple]) -> None:
    """ConfigError for a bad url, timeout_s, retries, backoff_s, concurrency or headers (and the `extra` rules:
    option -> (what it needs, test))."""
    url = options.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(f"{prefix}.url={url} is invalid: needs an http:// or https:// URL")
    rules = {
        "timeout_s": ("a number > 0", lambda v: is_number(v) and v > 0),
        "retries": ("an integer >= 0", lambda v: is_int(v) and v >= 0),
        "backoff_s": ("a number >= 0", lambda v: is_number(v) and v >= 0),
        "concurrency": ("an integer >= 1", lambda v: is_int(v) and v >= 1),
        "headers": ("a mapping of header names to strings", lambda v: isinstance(v, dict) and all(
            isinstance(k, str) and isinstance(x, str) for k, x in v.items())),
        **extra,
    }
    for key, (needs, test) in rules.items():
        if key in options and not test(options[key]):
            raise ConfigError(f"{prefix}.{key}={options[key]} is invalid: needs {needs}")


def check_answers(prefix: str, url: str, timeout_s: float, headers: dict[str, str] | None = None) -> None:
    """ConfigError, one line, when nothing answers at `url` within `timeout_s` (one GET, no retry; any HTTP status is
    an answer): a service that is down or hangs is found before the model loads, not at the first step."""
    import urllib3

    pool = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(connect=timeout_s, read=timeout_s))
    try:
        pool.request("GET", url, headers=headers or {}, preload_content=True)
    except urllib3.exceptions.HTTPError as err:
        raise ConfigError(f"{prefix}.url={url} does not answer ({_reason(err)} within {prefix}.timeout_s={timeout_s:g} "
                          "s, checked before the model loads); start the service or fix the url") from None
    finally:
        pool.clear()


def score_of(answer: Any) -> float:
    """The score in a verifier's answer: a JSON number, or a number under "score"; ServiceError otherwise."""
    score = _number(answer.get("score") if isinstance(answer, dict) else answer)
    if score is None:
        raise ServiceError(f"the answer {_excerpt(json.dumps(answer).encode())} holds no finite number under "
                           "\"score\" (the verifier must answer a number or {\"score\": number})")
    return score


def score_each(items: list, score, concurrency: int) -> list[float]:
    """`score(item)` for each item, `concurrency` at a time; CompletionsFailed when some raised ServiceError."""
    results: list[tuple] = [(None, None)] * len(items)
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for i in range(len(items)):
        todo.put(i)

    def work():
        while True:
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results[i] = score(items[i]), None
            except BaseException as err:  # noqa: BLE001  handed to the caller below
                results[i] = None, err

    # daemon threads, not a ThreadPoolExecutor (whose threads the interpreter joins at exit): a request that hangs
    # never holds up the end of a stopped or finished run
    threads = [threading.Thread(target=work, name="remote-reward", daemon=True)
               for _ in range(min(concurrency, len(items)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    other = next((err for _, err in results if err is not None and not isinstance(err, ServiceError)), None)
    if other is not None:
        raise other
    failed = [i for i, (_, err) in enumerate(results) if err is not None]
    if failed:
        raise CompletionsFailed(str(results[failed[0]][1]), [s for s, _ in results], failed)
    return [s for s, _ in results]


# what a verifier gets of trainer_state (transformers' TrainerState holds more: logging steps, a log history)
STATE_SENT = ("global_step", "max_steps", "epoch", "num_train_epochs")


class RemoteVerifier:
    """`RemoteVerifier(url=...)(prompts, completions, **row) -> list[float]`, one POST per completion."""

    @staticmethod
    def check_options(prefix: str, options: dict[str, Any]) -> None:
        """The options, then that the service answers (before the model loads)."""
        check_service_options(prefix, options, {})
        check_answers(prefix, options["url"], options.get("timeout_s", 10.0), options.get("headers"))

    def __init__(self, url: str, timeout_s: float = 10.0, retries: int = 2, backoff_s: float = 0.5,
                 concurrency: int = 8, headers: dict[str, str] | None = None, *, name: str = "verifier"):
        check_service_options(f"reward.functions.{name}", {"url": url, "timeout_s": timeout_s, "retries": retries,
                                                         "backoff_s": backoff_s, "concurrency": concurrency,
                                                         "headers": headers or {}}, {})
        self.service = Service(url, timeout_s, retries, backoff_s, concurrency, headers)
        self.concurrency = concurrency

    def __call__(self, prompts: list, completions: list, messages: list | None = None, **fields: Any) -> list[float]:
        if messages is not None:
            fields = {**fields, "messages": messages}
        state = fields.pop("trainer_state", None)  # the step's, one for every completion (the others: one each)
        whole = {} if state is None else {"trainer_state": {key: getattr(state, key) for key in STATE_SENT}}
        bodies = [{"prompt": prompt, "completion": completion, **{k: v[i] for k, v in fields.items()}, **whole}
                  for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True))]
        return score_each(bodies, lambda body: score_of(self.service.post(body)), self.concurrency)
