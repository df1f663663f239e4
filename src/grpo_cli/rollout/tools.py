"""Tools for episodes: plain Python callables, their JSON schemas, the chat format that shows them to the model,
the parsing of the model's calls, and calling them under a deadline.

A tool is a function with type hints and a Google-style docstring (as for transformers' chat templates and TRL's
`tools=`); its schema comes from `transformers.utils.get_json_schema`. An environment (TRL's `environment_factory`
contract) is a class: one instance per episode, `reset(**row) -> str | None`, its public methods are its tools,
and an optional `get_reward() -> float`.

`ToolFormat` is everything that depends on the tokenizer:
- a chat template that renders tools (`supports_tools`) gets them through `apply_chat_template(tools=...)`;
- one that does not (the embedded SmolLM2's) gets the documented fallback: the tool schemas in the system turn
  and the Hermes syntax `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- calls are parsed with the tokenizer's own `response_template` (transformers' `parse_response`) where it has
  one, else from the Hermes syntax with `json.loads`. Model output is data: it is never executed.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from grpo_cli.base import user_code
from grpo_cli.base.errors import ConfigError, UserCodeError, error_line, warn
from grpo_cli.base.user_code import raised

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
HERMES_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
FALLBACK_SYSTEM = (
    "You can call these tools, described as JSON schemas:\n<tools>\n{schemas}\n</tools>\n"
    "To call one, write exactly one line <tool_call>{{\"name\": TOOL NAME, \"arguments\": {{ARGUMENT: VALUE, ...}}}}"
    "</tool_call> and stop; its result comes back in a tool message. Answer once you have what you need."
)
JSON_TYPES = {"integer": (int,), "number": (int, float), "string": (str,), "boolean": (bool,), "array": (list,),
              "object": (dict,), "null": (type(None),)}


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable
    schema: dict  # transformers' {"type": "function", "function": {"name", "description", "parameters"}}


@dataclass
class ToolCall:
    """One call the model wrote: `problem` says why it cannot run (malformed JSON, no name), else None."""

    name: str
    arguments: dict
    problem: str | None = None


@dataclass
class ToolResult:
    name: str
    content: str
    failed: bool
    cut: bool = False  # over rollout.tool_output_max_chars: cut, with a note


def make_tool(fn: Callable, schema: dict | None = None) -> Tool:
    """A Tool of `fn`, its schema from its type hints and docstring (or the one given, for a method whose class
    already gave it); a function without them is a ConfigError naming it."""
    from transformers.utils import get_json_schema

    name = getattr(fn, "__name__", repr(fn))
    if schema is None:
        try:
            schema = get_json_schema(fn)
        except Exception as err:  # TypeHintParsingException, DocstringParsingException
            raise ConfigError(f"tool {name} has no usable schema ({error_line(err)}); give it type hints and a "
                              "Google-style docstring with an Args: section") from None
    return Tool(schema["function"]["name"], fn, schema)


def make_tools(functions: Sequence[Callable]) -> list[Tool]:
    tools = [make_tool(fn) for fn in functions]
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ConfigError(f"two tools share a name among {', '.join(names)}; every tool needs its own")
    return tools


def environment_functions(cls) -> dict[str, Callable]:
    """The tools of an environment class as TRL finds them: its public functions other than `reset` and
    `get_reward`, by name (listed on the class, so properties are not evaluated); none for None."""
    return {name: fn for name, fn in inspect.getmembers(cls, predicate=inspect.isfunction)
            if not name.startswith("_") and name not in ("reset", "get_reward")} if cls is not None else {}


def environment_methods(env) -> list[Callable]:
    """The tools of an environment instance: its class's `environment_functions`, bound to it."""
    return [getattr(env, name) for name in environment_functions(type(env))]


def supports_tools(tokenizer) -> bool:
    """The chat template renders a tool's schema, an assistant's tool call and a tool message (all three must
    show in the text: some templates render only `content` and drop the rest silently)."""
    name, key, value, result = "tool_name_a8f3", "arg_key_b9d4", "arg_val_d6e7", "tool_result_c4f9"
    schema = {"type": "function", "function": {"name": name, "description": "d", "parameters": {
        "type": "object", "properties": {key: {"type": "string", "description": "d"}}, "required": [key]}}}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": name, "arguments": {key: value}}}]},
                {"role": "tool", "name": name, "content": result}]
    try:
        listed = tokenizer.apply_chat_template(messages[:1], tools=[schema], tokenize=False)
        rendered = tokenizer.apply_chat_template(messages, tools=[schema], tokenize=False)
    except Exception:  # a template that rejects the roles or the tool_calls field
        return False
    return name in listed and all(s in rendered for s in (name, key, value, result))


def parse_hermes(text: str) -> list[ToolCall]:
    """The `<tool_call>{json}</tool_call>` calls in `text`, each parsed with json.loads (never evaluated).

    A call opened and never closed (a small model writes on after its arguments, or a stop string such as `"}`
    ended the turn) counts when a complete JSON object follows the opener, or one that lacks only its last one
    or two closing braces: that object is the call, the rest is ignored. An unclosed opener with no such object
    after it is no call (the turn is text)."""
    calls = []
    for body in HERMES_CALL.findall(text):
        try:
            data = json.loads(body)
        except ValueError as err:
            calls.append(ToolCall("", {}, f"the call is not valid JSON ({err})"))
            continue
        calls.append(call_from_json(data))
    rest = HERMES_CALL.sub("", text)
    if CALL_OPEN in rest:
        body = rest.split(CALL_OPEN, 1)[1].lstrip()
        # a stop string such as '"}' may end the turn before the object's last braces: they are added back
        for closing in ("", "}", "}}"):
            try:
                data, _ = json.JSONDecoder().raw_decode(body + closing)
            except ValueError:
                continue
            calls.append(call_from_json(data))
            break
    return calls


def call_from_json(data) -> ToolCall:
    if isinstance(data, dict) and "function" in data and isinstance(data["function"], dict):
        data = data["function"]  # the OpenAI-style {"type": "function", "function": {...}} wrapper
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolCall("", {}, 'the call has no "name"')
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):  # some templates carry the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(data["name"], {}, '"arguments" is not a JSON object')
    return ToolCall(data["name"], arguments)


def argument_problem(tool: Tool, arguments: dict) -> str | None:
    """Why `arguments` do not fit the tool (its signature, then its schema's JSON types), or None."""
    try:
        inspect.signature(tool.fn).bind(**arguments)
    except TypeError as err:
        return f"the arguments do not fit {tool.name}{inspect.signature(tool.fn)}: {err}"
    properties = tool.schema["function"].get("parameters", {}).get("properties", {})
    for key, value in arguments.items():
        declared = properties.get(key, {}).get("type")
        kinds = [declared] if isinstance(declared, str) else list(declared or [])
        allowed = tuple(t for k in kinds for t in JSON_TYPES.get(k, (object,)))
        if allowed and (not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed)):
            return f"argument {key} of {tool.name} must be {' or '.join(kinds)}, got {json.dumps(value)}"
    return None


def call_tool(tools: dict[str, Tool], call: ToolCall, timeout_s: float | None = None, stop=None,
              max_chars: int | None = None) -> ToolResult:
    """Run one call behind the user-code boundary (grpo_cli.base.user_code.call) under `timeout_s` (None: no limit).
    A malformed call, an unknown tool, arguments that do not fit, an Exception or a deadline passed is a failed
    call whose content is the error the model reads (TRL's contract); a call past its deadline is abandoned, as a
    reward is. A tool that exits instead (SystemExit, a KeyboardInterrupt of its own) is a bug no message to the
    model can fix: UserCodeError, one line. A stop request (`stop()`) abandons the call: Interrupted. The result
    reaches the model as TRL renders it, `str(result)`; one over `max_chars` characters is cut, with a note."""
    if call.problem is not None:
        return ToolResult(call.name or "unknown", f"error: {call.problem}", True)
    tool = tools.get(call.name)
    if tool is None:
        return ToolResult(call.name, f"error: no tool named {call.name!r}; the tools are {', '.join(tools)}", True)
    problem = argument_problem(tool, call.arguments)
    if problem is not None:
        return ToolResult(call.name, f"error: {problem}", True)
    try:
        content = user_code.call(functools.partial(rendered_result, tool.fn, call.arguments), name=f"tool-{tool.name}",
                                 timeout_s=timeout_s, stop=stop)
    except user_code.TimedOut:
        return ToolResult(call.name, f"error: {call.name} did not return within {timeout_s} s", True)
    except user_code.Raised as failure:
        if not isinstance(failure.error, Exception):
            raise UserCodeError(f"tool {qualified(tool.fn)} raised {raised(failure.error)} instead of returning; "
                                "a tool reports a failure by raising an Exception (the model reads it), never by "
                                "exiting: fix it") from None
        return ToolResult(call.name, f"error: {call.name} raised {error_line(failure.error)}", True)
    if max_chars is None or len(content) <= max_chars:
        return ToolResult(call.name, content, False)
    warn(f"a result of tool {call.name} was over rollout.tool_output_max_chars={max_chars} characters and was cut "
         "(the model reads the cut result and a note; episodes/tool_outputs_cut counts them); make the tool return "
         "less or raise the option")
    note = f"\n[cut: the result had {len(content)} characters, over rollout.tool_output_max_chars={max_chars}]"
    return ToolResult(call.name, content[:max_chars] + note, False, cut=True)


def rendered_result(fn: Callable, arguments: dict) -> str:
    """What the model reads of a tool's result: `str()` of what it returned (TRL's rendering: True, not true),
    an async tool's awaited on the process's event loop for user code (TRL allows them; user_code.event_loop)."""
    return str(user_code.awaited(fn(**arguments)))


def qualified(fn: Callable) -> str:
    """How a message names user code: `Class.method` for an environment's method, the function's name otherwise."""
    return getattr(fn, "__qualname__", None) or repr(fn)


class ToolFormat:
    """How one tokenizer shows tools to the model, reads its calls back, and renders a tool message as tokens to
    append (a delta, never a re-rendered conversation).

    `native` None = the chat template's own tool support where `supports_tools` finds it, else the fallback.
    `opener` is text put at the start of the first assistant turn, in the prompt (not sampled, not trained):
    for a small model that never starts a call by itself, e.g. '<tool_call>{"name": "calculator", "arguments": {'.
    """

    def __init__(self, tokenizer, native: bool | None = None, opener: str = ""):
        self.tokenizer = tokenizer
        self.native = supports_tools(tokenizer) if native is None else native
        self.opener = opener
        self.parser = getattr(tokenizer, "response_template", None) if self.native else None
        self.eos = tokenizer.eos_token
        self._end_of_turn = self._turn_end()

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """A turn ends at the close of its first call: what the model writes after it is not the tool's answer."""
        return (CALL_CLOSE,)

    def render_prompt(self, messages: list[dict], tools: Sequence[Tool]) -> str:
        """The prompt text of a conversation with `tools` on offer, up to the assistant turn and the opener."""
        schemas = [t.schema for t in tools]
        if not tools:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        elif self.native:
            text = self.tokenizer.apply_chat_template(messages, tools=schemas, add_generation_prompt=True,
                                                      tokenize=False)
        else:
            # the function part without its "return" entry: a small model copies it into its calls
            shown = [{k: v for k, v in s["function"].items() if k != "return"} for s in schemas]
            described = FALLBACK_SYSTEM.format(schemas="\n".join(json.dumps(s) for s in shown))
            if messages and messages[0]["role"] == "system":
                messages = [{**messages[0], "content": f"{messages[0]['content']}\n\n{described}"}, *messages[1:]]
            else:
                messages = [{"role": "system", "content": described}, *messages]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return text + self.opener

    def parse(self, text: str, prefix: str, tools: Sequence[Tool]) -> list[ToolCall]:
        """The calls in one assistant turn's `text` (with any opener at its start); `prefix` is the prompt text
        before it, which transformers' parser needs to see a pre-written part of the turn."""
        if self.parser is None:
            return parse_hermes(text)
        ended = text if text.endswith(self.eos) else text + self.eos
        # transformers >= 5.15 types the arguments from the schemas ("7" -> 7 for an integer)
        typed = {"tools": [t.schema for t in tools]} if "tools" in inspect.signature(
            self.tokenizer.parse_response).parameters else {}
        try:
            parsed = self.tokenizer.parse_response(ended, prefix=prefix, **typed)
        except Exception as err:  # the parser rejects a malformed call
            return [ToolCall("", {}, f"the call could not be parsed ({error_line(err)})")] if CALL_OPEN in text else []
        return [call_from_json(c) for c in (parsed or {}).get("tool_calls") or []]

    def assistant_message(self, text: str, calls: list[ToolCall]) -> dict:
        """The turn as a chat message: with `tool_calls` where the template renders them, else its raw text."""
        if not (self.native and calls):
            return {"role": "assistant", "content": text}
        head = text.split(CALL_OPEN, 1)[0].strip()
        return {"role": "assistant", "content": head, "tool_calls": [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}

    def tool_messages(self, results: list[ToolResult]) -> list[dict]:
        return [{"role": "tool", "name": r.name, "content": r.content} for r in results]

    def _dummy_turn(self, name: str) -> list[dict]:
        call = {"type": "function", "function": {"name": name, "arguments": {}}}
        call_text = f'{CALL_OPEN}{{"name": "{name}", "arguments": {{}}}}{CALL_CLOSE}'
        assistant = ({"role": "assistant", "content": "", "tool_calls": [call]} if self.native else
                     {"role": "assistant", "content": call_text})
        return [{"role": "user", "content": "dummy"}, assistant]

    def _turn_end(self) -> int:
        """Where, in a rendered [user, assistant] exchange, the assistant's end of turn (the EOS) begins: the
        model's tokens reach up to there; a ConfigError for a template without an EOS-ended turn."""
        before = self.tokenizer.apply_chat_template(self._dummy_turn("dummy"), tokenize=False)
        at = before.rfind(self.eos) if self.eos else -1
        if at < 0:
            raise ConfigError(f"the chat template does not end an assistant turn with the EOS token {self.eos!r}; "
                              "episodes need a template whose turns end with it")
        return len(before) - at

    def tool_delta(self, results: list[ToolResult], model_ended_turn: bool) -> str:
        """The text that follows the model's last sampled token: the end of its turn (unless it wrote the EOS
        itself), the tool messages and the next assistant header, rendered through the chat template on a
        dummy exchange (TRL's way), so the conversation so far is never re-rendered or re-tokenized."""
        dummy = self._dummy_turn(results[0].name)
        before = self.tokenizer.apply_chat_template(dummy, tokenize=False)
        after = self.tokenizer.apply_chat_template(dummy + self.tool_messages(results), add_generation_prompt=True,
                                                   tokenize=False)
        if not after.startswith(before):
            raise ConfigError("the chat template is not prefix-preserving: adding a tool message changes how the "
                              "turns before it render, so appended tokens would not match; use another template")
        start = len(before) - self._end_of_turn + (len(self.eos) if model_ended_turn else 0)
        return after[start:]



def import_object(dotted: str, key: str):
    """The object a dotted path names (pkg.module.name), or a ConfigError in one line naming `key`."""
    import importlib

    module, _, attr = str(dotted).rpartition(".")
    try:
        found = getattr(importlib.import_module(module), attr) if module else None
    except ImportError as err:
        raise ConfigError(f"{key}={dotted} cannot be imported ({err}); check the dotted path") from None
    except AttributeError:
        raise ConfigError(f"{key}={dotted}: {module} has no {attr}; check the dotted path") from None
    except BaseException as err:  # user code raised while its module was imported
        raise ConfigError(f"{key}={dotted}: importing {module} raised {error_line(err)}; fix the module") from None
    if found is None:
        raise ConfigError(f"{key}={dotted} is not a dotted path; give pkg.module.name")
    if not callable(found):
        raise ConfigError(f"{key}={dotted} is a {type(found).__name__}, not callable; name a function or a class")
    return found


def _too_slow(call: str, timeout_s: float | None) -> UserCodeError:
    return UserCodeError(f"environment {call} took over {timeout_s:g} s (env.timeout_s) and was abandoned; fix it, "
                         "or raise env.timeout_s (null = no limit)")


def new_environment(factory: Callable, stop=None, timeout_s: float | None = None):
    """One instance, built as TRL's environment_factory builds it (no arguments), behind the user-code boundary,
    within `timeout_s` seconds (env.timeout_s; None: no limit)."""
    name = getattr(factory, "__qualname__", factory)
    try:
        return user_code.call(factory, name="environment-init", stop=stop, timeout_s=timeout_s)
    except user_code.TimedOut:
        raise _too_slow(f"{name}()", timeout_s) from None
    except user_code.Raised as failure:
        fix = "its __init__" if inspect.isclass(factory) else "the function"
        raise UserCodeError(f"environment {name}() raised {raised(failure.error)}; "
                            f"an environment is built without arguments (TRL's environment_factory): fix {fix}"
                            ) from None


def reset_environment(env, row: dict, stop=None, timeout_s: float | None = None) -> str | None:
    """`env.reset(**reset_arguments)` behind the user-code boundary, within `timeout_s` seconds: its string (added
    to the prompt) or None; whatever it raises, exits with or returns besides is a UserCodeError naming the class."""
    name, arguments = type(env).__qualname__, reset_arguments(env.reset, row)
    try:
        observation = user_code.call(functools.partial(env.reset, **arguments), name="environment-reset", stop=stop,
                                     timeout_s=timeout_s)
    except user_code.TimedOut:
        raise _too_slow(f"{name}.reset", timeout_s) from None
    except user_code.Raised as failure:
        raise UserCodeError(f"environment {name}.reset raised {raised(failure.error)} (given {', '.join(arguments)}); "
                            "fix it") from None
    if observation is not None and not isinstance(observation, str):
        raise UserCodeError(f"environment {name}.reset returned {type(observation).__name__} "
                            f"{user_code.shown(observation)}; it must return a string (added to the prompt) or None")
    return observation


def reset_arguments(reset: Callable, row: dict) -> dict:
    """The keywords `reset` gets: the row's columns as TRL passes them, the prompt's chat messages as `prompt`
    (TRL's name), and the same as `messages` (grpo-cli's name) where reset names it or takes **kwargs. Copies:
    a reset that edits them leaves the data alone."""
    fields = {k: v for k, v in row.items() if k != "messages"}
    if not row.get("messages"):  # an environment that owns the prompt: nothing to pass
        return fields
    params: Mapping[str, inspect.Parameter]
    try:
        params = inspect.signature(reset).parameters
    except (TypeError, ValueError):
        params = {}
    takes_messages = "messages" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    copy = lambda: [dict(m) for m in row["messages"]]  # noqa: E731
    return {"prompt": copy(), **fields, **({"messages": copy()} if takes_messages else {})}


def environment_class(dotted: str, key: str = "env._target_", timeout_s: float | None = None):
    """The class of the environments `dotted` builds (TRL's environment_factory): the class it names, checked without
    building an instance, or, for a function that returns one (TRL takes any callable), the class of the instance
    one call returns (one call per process, within `timeout_s`: env.timeout_s)."""
    factory = import_object(dotted, key)
    if inspect.isclass(factory):
        cls, what = factory, f"{key}={dotted}"
    else:
        if factory not in _PROBED:
            try:
                _PROBED[factory] = type(new_environment(factory, timeout_s=timeout_s))
            except UserCodeError as err:
                raise ConfigError(f"{key}={dotted}: {err}") from None
        cls = _PROBED[factory]
        what = f"{key}={dotted} returns a {cls.__qualname__}, which"
    if not callable(getattr(cls, "reset", None)):
        raise ConfigError(f"{what} has no reset(**row) method; an environment needs reset(**row) -> str | None "
                          "and its tools as public methods (TRL's environment_factory)")
    return cls


_PROBED: dict[Callable, type] = {}  # a factory function's instances' class, found once


def reward_owning_environment(dotted: str | None, timeout_s: float | None = None):
    """The environment class of env._target_ (`dotted`) when it has a get_reward() method (imported: a bad path is
    its own one-line error), else None."""
    if dotted is None:
        return None
    cls = environment_class(dotted, timeout_s=timeout_s)
    return cls if callable(getattr(cls, "get_reward", None)) else None
