"""Prompt sources: reasoning-gym generators, GSM8K (hub or local jsonl), and any jsonl of rows.

A source is a list of rows; each row has `messages` (the chat prompt) and the fields rewards receive
(e.g. `answer`). Batches are a pure function of (seed, step), so a resumed run sees the same prompts.

A jsonl row gives its prompt in one of the forms TRL accepts: `prompt` as text, `prompt` as a list of chat
messages, or `messages` (a list of chat messages); a chat prompt ends with a user (or tool) turn, since the
model writes the next assistant turn. `data.system_prompt` is added to a chat prompt that has no system
message, and `data.question_suffix` to its last user message.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from grpo_cli.errors import DataError, error_line
from grpo_cli.rewards.parsing import gold_answer


def _messages(question: str, system_prompt: str | None, suffix: str = "") -> list[dict]:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return messages + [{"role": "user", "content": question + (suffix or "")}]


def numbered_jsonl(path: str | Path) -> list[tuple[int, dict]]:
    """(line number, row) of every non-blank line of a jsonl file; one line of error for a bad file or line."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"data file {path} does not exist; pass an existing file with data.path=FILE.jsonl")
    rows = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}:{lineno} is not valid UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1}); "
                                "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno} is not valid JSON ({err.msg}); fix or remove that line") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno} is a JSON {type(row).__name__}, not an object; each line holds one "
                                "row as a JSON object")
            rows.append((lineno, row))
    if not rows:
        raise DataError(f"data file {path} holds no rows; point data.path at a non-empty jsonl file")
    return rows


def read_jsonl(path: str | Path, required: Sequence[str]) -> list[dict]:
    rows = []
    for lineno, row in numbered_jsonl(path):
        missing = [k for k in required if k not in row]
        if missing:
            raise DataError(f"{Path(path).expanduser()}:{lineno} lacks field(s) {', '.join(missing)}; every row needs "
                            f"{', '.join(required)}")
        rows.append(row)
    return rows


def _reasoning_gym_rows(task: str, size: int, seed: int, task_args: dict, suffix: str, system_prompt) -> list[dict]:
    import reasoning_gym

    try:
        dataset = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_args)
    except Exception as err:  # reasoning-gym raises several types for an unknown task or bad args
        raise DataError(f"data.task={task} with {task_args} failed in reasoning-gym ({err}); check the task name and args") from None
    return [{"messages": _messages(x["question"], system_prompt, suffix), "answer": str(x["answer"])} for x in dataset]


def _sum_rows(size: int, seed: int, low: int, high: int, suffix: str, system_prompt) -> list[dict]:
    """`What is a + b?` with a, b drawn from [low, high]: the quickstart's task."""
    rng = random.Random(seed)
    pairs = [(rng.randint(low, high), rng.randint(low, high)) for _ in range(size)]
    return [{"messages": _messages(f"What is {a} + {b}?", system_prompt, suffix), "answer": str(a + b)} for a, b in pairs]


def _gsm8k_rows(path: str | None, split: str, system_prompt, suffix: str) -> list[dict]:
    if path:
        raw = read_jsonl(path, ("question", "answer"))
    else:
        try:
            import datasets

            raw = list(datasets.load_dataset("openai/gsm8k", "main", split=split))
        except Exception as err:
            raise DataError(
                f"openai/gsm8k could not be loaded from the hub ({error_line(err)[:120]}); offline, pass "
                "data.path=DIR/train.jsonl data.eval_path=DIR/test.jsonl (a local GSM8K copy), or data=gsm8k_sample"
            ) from None
    return [{"messages": _messages(r["question"], system_prompt, suffix), "answer": gold_answer(r["answer"])} for r in raw]


PROMPT_FORMS = ('"prompt" (text, or a list of chat messages) or "messages" (a list of chat messages), '
                'e.g. {"prompt": "What is 2 + 2?", "answer": "4"} or '
                '{"messages": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"}')


def _chat(where: str, key: str, messages, system_prompt, suffix: str) -> list[dict]:
    """A chat prompt as given, checked, with the configured system prompt and question suffix added."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages):
        raise DataError(f'{where}: "{key}" is not a list of chat messages like {{"role": "user", "content": "..."}}; '
                        f"every row needs {PROMPT_FORMS}")
    if messages[-1]["role"] == "assistant":
        raise DataError(f'{where}: "{key}" ends with an assistant turn; a prompt ends with the user\'s turn (the model '
                        "writes the answer): drop that turn, and put a reference answer in a field such as answer")
    messages = [dict(m) for m in messages]
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if suffix and users and isinstance(messages[users[-1]]["content"], str):
        messages[users[-1]]["content"] += suffix
    return messages


def _jsonl_rows(path: str, system_prompt, suffix: str) -> list[dict]:
    rows = []
    for lineno, row in numbered_jsonl(path):
        where = f"{Path(path).expanduser()}:{lineno}"
        fields = {k: v for k, v in row.items() if k not in ("prompt", "messages")}
        if isinstance(row.get("prompt"), str):
            messages = _messages(row["prompt"], system_prompt, suffix)
        elif "prompt" in row:
            messages = _chat(where, "prompt", row["prompt"], system_prompt, suffix)
        elif "messages" in row:
            messages = _chat(where, "messages", row["messages"], system_prompt, suffix)
        else:
            raise DataError(f"{where} lacks a prompt; every row needs {PROMPT_FORMS}")
        rows.append({**fields, "messages": messages})
    return rows


def load_rows(cfg_data, *, split: str = "train", seed: int = 0) -> list[dict]:
    """Rows of the configured source for `split` (train or test)."""
    source = cfg_data.source
    path = cfg_data.get("path") if split == "train" else cfg_data.get("eval_path")
    system_prompt = cfg_data.get("system_prompt")
    suffix = cfg_data.get("question_suffix") or ""
    if source == "reasoning_gym":
        size = cfg_data.size if split == "train" else cfg_data.get("eval_size", 200)
        # a different seed for the held-out split so its questions are not the training ones
        return _reasoning_gym_rows(cfg_data.task, size, seed if split == "train" else seed + 10_007,
                                   dict(cfg_data.get("task_args") or {}), suffix, system_prompt)
    if source == "sums":
        size = cfg_data.size if split == "train" else cfg_data.get("eval_size", 200)
        return _sum_rows(size, seed if split == "train" else seed + 10_007, cfg_data.low, cfg_data.high, suffix, system_prompt)
    if source == "gsm8k":
        return _gsm8k_rows(path, split, system_prompt, suffix)
    if source == "jsonl":
        if not path:
            raise DataError(f"data.source=jsonl needs data.{'path' if split == 'train' else 'eval_path'}=FILE.jsonl")
        return _jsonl_rows(path, system_prompt, suffix)
    raise DataError(f"data.source={source} is unknown; use reasoning_gym, sums, gsm8k or jsonl")


@dataclass
class PromptSampler:
    """Epoch-wise shuffled batches; batch(step) depends only on (seed, step), which makes resume exact."""

    rows: list[dict]
    batch_size: int
    seed: int

    def batch(self, step: int) -> list[dict]:
        n = len(self.rows)
        out = []
        for k in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, pos = divmod(k, n)
            out.append(self.rows[self._order(epoch)[pos]])
        return out

    def _order(self, epoch: int) -> list[int]:
        if getattr(self, "_cached_epoch", None) != epoch:
            order = list(range(len(self.rows)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._cached_epoch, self._cached_order = epoch, order
        return self._cached_order
