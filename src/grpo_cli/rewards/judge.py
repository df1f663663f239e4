"""An LLM as the judge: each completion put in a prompt template, sent to an OpenAI-compatible chat-completions
endpoint (vLLM's `vllm serve`, any provider), the score parsed from the reply.

    reward:
      functions:
        judge:
          _target_: grpo_cli.rewards.judge.Judge
          weight: 1.0
          url: http://127.0.0.1:8000/v1   # the API's base URL; /chat/completions is appended
          model: NAME                     # the served model's name
          template: null                  # null = TEMPLATE below; {question}, {completion}, {prompt}, row fields
          max_score: 10                   # the reward is the parsed score / max_score
          temperature: 0.0
          max_tokens: 32
          api_key: null                   # sent as a bearer token, e.g. ${oc.env:OPENAI_API_KEY}
          timeout_s: 30
          retries: 2
          backoff_s: 0.5
          concurrency: 8

In the template, {question} is the last user message of the completion's chat prompt, {completion} the
completion, {prompt} the prompt text the policy saw, and any other name a field of the data row ({answer}); write
literal braces as {{ }}. The score is read from the reply (its <think> part left out): a labelled `Score: N` (or
`rating`), else `N/max_score` or `N out of max_score`, else the reply's last number; it must lie in
[0, max_score]. A reply with none, a reply that is not chat-completions JSON, a refused or timed-out request:
an error of that completion, which reward.on_error decides, as for rewards.remote.RemoteVerifier.
"""

from __future__ import annotations

import re
import string
from typing import Any

from grpo_cli.base.errors import ConfigError
from grpo_cli.config.rule import is_number
from grpo_cli.rewards.remote import Service, ServiceError, check_answers, check_service_options, score_each

TEMPLATE = ("Here is a question and an answer to it.\n\nQuestion: {question}\n\nAnswer: {completion}\n\n"
            "How good is the answer? Reply with one line, `Score: N`, with N from 0 (wrong or useless) to 10 "
            "(correct and complete).")
NUMBER = r"[-+]?\d+(?:\.\d+)?"
_THINK = re.compile(r"<think>.*?(?:</think>|\Z)", re.S | re.I)
_LABELLED = re.compile(rf"\b(?:score|rating|grade)\b[^\d\n+-]{{0,12}}({NUMBER})", re.I)
_NUMBER = re.compile(rf"(?<![\w.]){NUMBER}")


def parse_score(reply: str, max_score: float) -> float | None:
    """The score a judge's reply gives, in [0, max_score]; None when it gives none there."""
    text = _THINK.sub(" ", reply or "")
    top = re.escape(f"{max_score:g}")
    for pattern in (_LABELLED, re.compile(rf"({NUMBER})\s*(?:/|out of)\s*{top}\b", re.I)):
        found = pattern.findall(text)
        if found:
            value = float(found[-1])
            return value if 0 <= value <= max_score else None
    numbers = _NUMBER.findall(text)
    last = float(numbers[-1]) if numbers else None
    return last if last is not None and 0 <= last <= max_score else None


def template_names(template: str) -> list[str]:
    """The field names a template uses; ValueError for a malformed one."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]


def _last_user_text(messages) -> str | None:
    users = [m.get("content") for m in messages or () if isinstance(m, dict) and m.get("role") == "user"]
    return users[-1] if users and isinstance(users[-1], str) else None


class Judge:
    """`Judge(url=..., model=...)(prompts, completions, messages=..., **row) -> list[float]`, one chat request per
    completion, each score / max_score."""

    @classmethod
    def check_options(cls, prefix: str, options: dict[str, Any]) -> None:
        """The options, then that the endpoint answers (before the model loads)."""
        cls.check_values(prefix, options)
        headers = {"Authorization": f"Bearer {options['api_key']}"} if options.get("api_key") else None
        check_answers(prefix, options["url"], options.get("timeout_s", 30.0), headers)

    @staticmethod
    def check_values(prefix: str, options: dict[str, Any]) -> None:
        def valid_template(value) -> bool:
            try:
                return isinstance(value, str) and bool(value.strip()) and all(
                    n.isidentifier() for n in template_names(value))
            except ValueError:
                return False

        check_service_options(prefix, options, {
            "template": ("null or a text whose {fields} are plain names ({question}, {completion}; {{ }} for braces)",
                         lambda v: v is None or valid_template(v)),
            "max_score": ("a number > 0", lambda v: is_number(v) and v > 0),
            "temperature": ("a number >= 0", lambda v: is_number(v) and v >= 0),
            "max_tokens": ("an integer >= 1", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1),
            "api_key": ("null or a string", lambda v: v is None or isinstance(v, str)),
        })
        if not isinstance(options.get("model"), str) or not options["model"].strip():
            raise ConfigError(f"{prefix}.model={options.get('model')} is invalid: name the model the endpoint serves")

    def __init__(self, url: str, model: str, template: str | None = None, max_score: float = 10.0,
                 temperature: float = 0.0, max_tokens: int = 32, api_key: str | None = None, timeout_s: float = 30.0,
                 retries: int = 2, backoff_s: float = 0.5, concurrency: int = 8, *, name: str = "judge"):
        self.check_values(f"reward.functions.{name}", {
            "url": url, "model": model, "template": template, "max_score": max_score, "temperature": temperature,
            "max_tokens": max_tokens, "api_key": api_key, "timeout_s": timeout_s, "retries": retries,
            "backoff_s": backoff_s, "concurrency": concurrency})
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        endpoint = url.rstrip("/") + "/chat/completions"
        self.service = Service(endpoint, timeout_s, retries, backoff_s, concurrency, headers)
        self.model, self.template, self.max_score = model, template or TEMPLATE, float(max_score)
        self.sampling = {"temperature": temperature, "max_tokens": max_tokens}
        self.concurrency = concurrency

    def request(self, prompt, completion, messages, row: dict) -> str:
        """The judge's prompt for one completion; ValueError naming a template field the row lacks."""
        values = {**row, "prompt": prompt if isinstance(prompt, str) else "", "completion": completion or "",
                  "question": _last_user_text(messages) or (prompt if isinstance(prompt, str) else "")}
        missing = [n for n in template_names(self.template) if n not in values]
        if missing:
            raise ValueError(f"the judge's template names {{{missing[0]}}}, which the data row lacks (it has: "
                             f"{', '.join(sorted(values))})")
        return self.template.format_map(values)

    def score(self, text: str) -> float:
        answer = self.service.post({"model": self.model, "messages": [{"role": "user", "content": text}],
                                    **self.sampling})
        try:
            reply = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise ServiceError(f"POST {self.service.url} answered no chat completion (no choices[0].message.content): "
                               f"{str(answer)[:80]!r}") from None
        value = parse_score(reply if isinstance(reply, str) else "", self.max_score)
        if value is None:
            raise ServiceError(f"the judge's reply holds no score in [0, {self.max_score:g}]: {str(reply)[:80]!r}")
        return value / self.max_score

    def __call__(self, prompts: list, completions: list, messages: list | None = None, **fields: Any) -> list[float]:
        texts = [self.request(prompts[i], completions[i], messages[i] if messages else None,
                              {k: v[i] for k, v in fields.items()}) for i in range(len(completions))]
        return score_each(texts, self.score, self.concurrency)
