"""Episodes: tools and environments over several turns, through the Engine seam, and the masks the loss sees.

Most tests drive the loop with `ScriptedPolicy`, a deterministic policy behind the real Engine seam: each row's
user message carries its script (one line per assistant turn) and the policy writes the line of the current turn
(the number of tool messages so far), then its EOS. That is the honest way to force a given call (one that raises,
hangs, is malformed, or does not fit), which no small model writes on demand. The stop strings and masks are those
of every engine (`finish_rollout`). The real embedded model's calls, with the call opener prefilled, are the slow
test at the end.
"""

from __future__ import annotations

import random
import sys
import time

import pytest
import torch
from conftest import tiny_lora_policy

from grpo_cli import algorithm
from grpo_cli.base.errors import ConfigError, Interrupted, RunError
from grpo_cli.model.loading import load_tokenizer
from grpo_cli.rollout import HFEngine, completion_logprobs, positions
from grpo_cli.rollout.common import Engine, SamplingParams, finish_rollout, left_pad
from grpo_cli.rollout.episodes import Episodes, EpisodeSetup, run_episodes
from grpo_cli.rollout.tools import (
    ToolCall,
    ToolFormat,
    call_tool,
    environment_methods,
    make_tools,
    parse_hermes,
    supports_tools,
)


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def explode(x: int) -> int:
    """A tool that always fails.

    Args:
        x: Anything.
    """
    raise ValueError(f"cannot handle {x}")


def hang(x: int) -> int:
    """A tool that never answers in time.

    Args:
        x: Anything.
    """
    time.sleep(3)
    return x


def sleeps(seconds: int) -> str:
    """A tool that hangs for as long as it is told.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


def is_even(n: int) -> bool:
    """Whether a number is even.

    Args:
        n: The number.
    """
    return n % 2 == 0


def shout(n: int) -> str:
    """A tool whose result is as long as it is told.

    Args:
        n: How many characters.
    """
    return "A" * n


def exits(code: int) -> int:
    """A tool that ends the process instead of answering.

    Args:
        code: The exit status.
    """
    sys.exit(code)


def interrupts(x: int) -> int:
    """A tool that raises KeyboardInterrupt (its own: a real Ctrl-C is a stop request, which raises nothing).

    Args:
        x: Anything.
    """
    raise KeyboardInterrupt(f"pressed inside the tool at {x}")


TOOLS = (multiply, explode, hang)


class ScriptedPolicy(Engine):
    """Writes, for each row, the line of its script (`SCRIPT:line|||line...` in the user message) that belongs to
    the current turn, then EOS; it honours max_new_tokens and stop strings as every engine does."""

    name = "scripted"

    def __init__(self, tokenizer):
        super().__init__(None, tokenizer, torch.device("cpu"))
        self.calls: list[int] = []  # rows per generate call

    def generate(self, prompt_ids, num_generations, sampling, stop=None):
        tok, rows, max_new_tokens = self.tokenizer, [], sampling.max_new_tokens
        for ids in prompt_ids:
            text = tok.decode(ids)
            script = text.split("SCRIPT:", 1)[1].split(tok.eos_token, 1)[0].split("|||")
            turn = text.count("<|im_start|>tool") + text.count("<tool_response>")  # fallback, native template
            line = script[min(turn, len(script) - 1)]
            rows += [self.turn_tokens(line, max_new_tokens) for _ in range(num_generations)]
        self.calls.append(len(rows))
        width = max(len(r) for r in rows)
        completion = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
        ids, mask = left_pad(prompt_ids, tok.pad_token_id, None)
        fired = stop is not None and stop()  # polled once per call: enough to stand for a stop mid-generation
        return finish_rollout(tok, [tok.eos_token_id], ids, mask, completion, num_generations, fired,
                              sampling.stop_strings)

    def turn_tokens(self, line: str, max_new_tokens: int) -> list[int]:
        """What it writes for a turn whose script line is `line`: the chosen text and EOS, cut at max_new_tokens."""
        tok = self.tokenizer
        return (tok(self.choose(line), add_special_tokens=False)["input_ids"] + [tok.eos_token_id])[:max_new_tokens]

    def choose(self, line: str) -> str:
        return line


class ChoosingPolicy(ScriptedPolicy):
    """A ScriptedPolicy whose turn lines may list alternatives (`a~~b`), one drawn with torch's generator for each
    episode: the seeds of sampling then decide the episodes, as they do a model's."""

    def choose(self, line: str) -> str:
        options = line.split("~~")
        return options[int(torch.randint(len(options), ()))]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny-random")  # the embedded SmolLM2's tokenizer and chat template


def call(name: str, **arguments) -> str:
    import json

    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def script(*turns: str) -> dict:
    return {"messages": [{"role": "user", "content": "SCRIPT:" + "|||".join(turns)}]}


def episodes(tokenizer, rows, G=1, *, max_new_tokens=128, stop=None, **setup) -> Episodes:
    setup = {"max_tool_calls": 4, "tools": TOOLS, "tool_timeout_s": 0.5, **setup}
    return run_episodes(ScriptedPolicy(tokenizer), rows, G, SamplingParams(max_new_tokens),
                        EpisodeSetup(ToolFormat(tokenizer), **setup), stop)


def decoded(tokenizer, roll: Episodes, i: int, mask: torch.Tensor) -> str:
    return tokenizer.decode(roll.completion_ids[i][mask[i].bool()])


# ---- tools alone --------------------------------------------------------------------------------------------------
def test_schemas_come_from_transformers_and_a_tool_needs_a_docstring():
    from transformers.utils import get_json_schema

    (tool,) = make_tools([multiply])
    assert tool.name == "multiply" and tool.schema == get_json_schema(multiply)
    assert tool.schema["function"]["parameters"]["required"] == ["a", "b"]

    def undocumented(a: int) -> int:
        return a

    with pytest.raises(ConfigError, match="tool undocumented has no usable schema.*docstring"):
        make_tools([undocumented])


def test_the_embedded_template_has_no_tool_support_so_the_fallback_describes_them(tokenizer):
    assert not supports_tools(tokenizer)
    fmt = ToolFormat(tokenizer)
    text = fmt.render_prompt([{"role": "user", "content": "What is 3 * 4?"}], make_tools([multiply]))
    assert '"name": "multiply"' in text and "<tool_call>" in text and text.endswith("<|im_start|>assistant\n")
    assert text.index('"name": "multiply"') < text.index("What is 3 * 4?")  # in the system turn, before the user


# a ChatML template with tool support in the style of Qwen2.5's (tools in the system turn, calls as tool_calls,
# results as <tool_response> in a user turn), and transformers' response template that parses its calls
NATIVE_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}
# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>
{% elif messages[0].role != 'system' %}<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}{% if not tools %}<|im_start|>system
{{ m.content }}<|im_end|>
{% endif %}
{%- elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}
{%- for tc in m.tool_calls or [] %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
NATIVE_RESPONSE = {"defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n", "fields": {
    "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                   "transform": {"type": "function", "function": "{content}"}},
    "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"}}}


def test_a_template_with_tool_support_gets_them_natively_and_its_parser_reads_the_calls():
    native = load_tokenizer("tiny-random")
    native.chat_template, native.response_template = NATIVE_TEMPLATE, NATIVE_RESPONSE
    assert supports_tools(native)
    fmt = ToolFormat(native)
    assert fmt.native and fmt.parser is NATIVE_RESPONSE
    written = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": "4"}}\n</tool_call>'
    roll = run_episodes(ScriptedPolicy(native), [script(written, "The answer is 12.")], 1, SamplingParams(64),
                        EpisodeSetup(fmt, max_tool_calls=2, tools=TOOLS))
    assert native.decode(roll.prompt_ids[0]).count("# Tools") == 1
    assert roll.tool_calls.item() == 1 and roll.failed_calls.item() == 0  # "4" typed to 4 by the tool's schema
    assert roll.messages[0][1]["tool_calls"] == [{"type": "function", "function": {
        "name": "multiply", "arguments": {"a": 3, "b": 4}}}]
    tool = (roll.completion_mask - roll.model_mask)[0].bool()
    assert native.decode(roll.completion_ids[0][tool]) == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n12\n"
                                                           "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert decoded(native, roll, 0, roll.model_mask) == written + "The answer is 12.<|im_end|>"


def test_hermes_calls_are_parsed_as_data_never_run():
    assert parse_hermes(call("multiply", a=3, b=4)) == [ToolCall("multiply", {"a": 3, "b": 4})]
    assert parse_hermes("no call here") == []
    (bad,) = parse_hermes('<tool_call>{"name": "multiply", "arguments": {"a": 3,</tool_call>')
    assert "not valid JSON" in bad.problem
    (code,) = parse_hermes("<tool_call>__import__('os').system('touch /tmp/x')</tool_call>")
    assert code.problem is not None  # text that is not JSON is refused, not evaluated
    # left open (as the small model does): a complete object after the opener is the call, an incomplete one none
    assert parse_hermes('<tool_call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}, "output": 12 and so on') \
        == [ToolCall("multiply", {"a": 3, "b": 4})]
    assert parse_hermes('<tool_call>{"name": "multiply", "arguments": {"a": 3, "b"') == []


def test_a_call_that_raises_hangs_or_does_not_fit_fails_with_a_message():
    tools = {t.name: t for t in make_tools(TOOLS)}
    assert call_tool(tools, ToolCall("multiply", {"a": 3, "b": 4})).content == "12"
    raised = call_tool(tools, ToolCall("explode", {"x": 1}))
    assert raised.failed and "ValueError" in raised.content and "cannot handle 1" in raised.content
    start = time.monotonic()
    hung = call_tool(tools, ToolCall("hang", {"x": 1}), timeout_s=0.2)
    assert hung.failed and "did not return within 0.2 s" in hung.content and time.monotonic() - start < 2
    for arguments, words in (({"a": 3}, "do not fit"), ({"a": 3, "b": 4, "c": 5}, "do not fit"),
                             ({"a": "3", "b": 4}, "must be integer"), ({"a": True, "b": 4}, "must be integer")):
        result = call_tool(tools, ToolCall("multiply", arguments))
        assert result.failed and words in result.content, (arguments, result.content)
    assert call_tool(tools, ToolCall("divide", {})).failed


# ---- the loop -----------------------------------------------------------------------------------------------------
def test_a_call_its_result_and_the_answer_make_one_episode(tokenizer):
    roll = episodes(tokenizer, [script(call("multiply", a=3, b=4) + " and more", "The answer is 12.")], G=2)
    assert roll.tool_calls.tolist() == [1, 1] and roll.failed_calls.tolist() == [0, 0]
    assert roll.turns.tolist() == [2, 2] and not roll.cut.any()
    whole = decoded(tokenizer, roll, 0, roll.completion_mask)
    assert whole == (call("multiply", a=3, b=4) + "<|im_end|>\n<|im_start|>tool\n12<|im_end|>\n"
                     "<|im_start|>assistant\nThe answer is 12.<|im_end|>")  # the turn ends at the call's close
    assert decoded(tokenizer, roll, 0, roll.model_mask) == call("multiply", a=3, b=4) + "The answer is 12.<|im_end|>"
    assert [m["role"] for m in roll.messages[0]] == ["user", "assistant", "tool", "assistant"]
    assert roll.messages[0][2] == {"role": "tool", "name": "multiply", "content": "12"}
    assert roll.texts[0] == call("multiply", a=3, b=4) + "\nThe answer is 12."


def test_the_sequence_is_prompt_plus_sampled_plus_tool_tokens_never_retokenized(tokenizer):
    """Every turn's input is exactly the previous input, the tokens sampled, then the tool delta."""
    policy = ScriptedPolicy(tokenizer)
    seen = []
    original = policy.generate

    def recording(prompt_ids, *args, **kwargs):
        seen.append([list(p) for p in prompt_ids])
        return original(prompt_ids, *args, **kwargs)

    policy.generate = recording
    roll = run_episodes(policy, [script(call("multiply", a=2, b=5), call("multiply", a=10, b=1), "Done.")], 1,
                        SamplingParams(128), EpisodeSetup(ToolFormat(tokenizer), max_tool_calls=4, tools=TOOLS))
    prompt = roll.prompt_ids[0][roll.prompt_mask[0].bool()].tolist()
    full = prompt + roll.completion_ids[0][roll.completion_mask[0].bool()].tolist()
    assert len(seen) == 3
    for turn_input in seen[1:]:
        assert full[:len(turn_input[0])] == turn_input[0]  # each turn's input is a prefix of the final sequence
    assert roll.tool_calls.item() == 2 and roll.turns.item() == 3


def test_failures_reach_the_model_and_never_end_the_run(tokenizer):
    rows = [script(call("explode", x=1), "Sorry."), script(call("hang", x=1), "Late."),
            script('<tool_call>{"name": "multiply", "arguments": {"a": 3,</tool_call>', "Oops."),
            script(call("multiply", a=3), "Missing b."), script(call("nope"), "No such tool.")]
    start = time.monotonic()
    roll = episodes(tokenizer, rows, tool_timeout_s=0.2)
    assert time.monotonic() - start < 2.5  # the hanging tool was abandoned at its deadline
    assert roll.tool_calls.tolist() == [1] * 5 and roll.failed_calls.tolist() == [1] * 5
    assert roll.turns.tolist() == [2] * 5  # each episode went on after the failure
    results = [e[2]["content"] for e in roll.messages]
    for content, words in zip(results, ("raised ValueError", "did not return within", "not valid JSON", "do not fit",
                                        "no tool named 'nope'"), strict=True):
        assert content.startswith("error:") and words in content, content
    assert roll.metrics()["failed_call_rate"] == 1.0


def test_a_result_reaches_the_model_as_trl_renders_it(tokenizer):
    """TRL's tool loop writes `str(result)` into the tool message: True, not JSON's true; a dict in Python's form."""
    def lookup(key: str) -> dict:
        """A tool that returns a dict.

        Args:
            key: The key.
        """
        return {key: True, "n": None}

    roll = episodes(tokenizer, [script(call("is_even", n=4), "Yes."), script(call("lookup", key="a"), "Ok.")],
                    tools=(is_even, lookup))
    assert [m[2]["content"] for m in roll.messages] == ["True", "{'a': True, 'n': None}"]


def test_a_result_over_the_cap_is_cut_with_a_note_and_counted(tokenizer):
    rows = [script(call("shout", n=50), "Loud."), script(call("shout", n=5), "Quiet.")]
    roll = episodes(tokenizer, rows, tools=(shout,), tool_output_max_chars=20)
    assert roll.messages[0][2]["content"] == "A" * 20 + ("\n[cut: the result had 50 characters, over "
                                                         "rollout.tool_output_max_chars=20]")
    assert roll.messages[1][2]["content"] == "AAAAA" and roll.failed_calls.tolist() == [0, 0]
    assert roll.tool_outputs_cut.tolist() == [1, 0] and roll.metrics()["tool_outputs_cut"] == 1.0


@pytest.mark.parametrize(("tool", "line"), [
    (exits, "tool exits raised SystemExit: 0 instead of returning; a tool reports a failure by raising an Exception "
            "(the model reads it), never by exiting: fix it"),
    (interrupts, "tool interrupts raised KeyboardInterrupt: pressed inside the tool at 1 instead of returning; a tool "
                 "reports a failure by raising an Exception (the model reads it), never by exiting: fix it"),
], ids=["sys.exit(0)", "KeyboardInterrupt"])
def test_a_tool_that_exits_ends_the_run_in_one_line_without_a_thread_traceback(tokenizer, capfd, tool, line):
    with pytest.raises(RunError) as err:
        episodes(tokenizer, [script(call(tool.__name__, **({"code": 0} if tool is exits else {"x": 1})), "Never.")],
                 tools=(tool,))
    assert type(err.value).__name__ == "UserCodeError" and str(err.value) == line
    assert capfd.readouterr().err == ""  # no "Exception in thread tool-..." traceback


def test_a_stop_request_abandons_a_tool_that_hangs_without_a_deadline(tokenizer):
    """rollout.tool_timeout_s=null: the call waits for the tool as long as it takes, but not past a stop request."""
    start = time.monotonic()
    asked = lambda: time.monotonic() - start > 0.5  # noqa: E731  SIGTERM arrives half a second into the call
    with pytest.raises(Interrupted):
        episodes(tokenizer, [script(call("sleeps", seconds=20), "Late.")], tools=(sleeps,), tool_timeout_s=None,
                 stop=asked)
    assert time.monotonic() - start < 3


def test_max_tool_calls_leaves_a_further_call_unexecuted(tokenizer):
    roll = episodes(tokenizer, [script(call("multiply", a=1, b=2), call("multiply", a=3, b=4), "End.")],
                    max_tool_calls=1)
    assert roll.tool_calls.item() == 1 and roll.turns.item() == 2 and not roll.cut.item()
    assert [m["role"] for m in roll.messages[0]] == ["user", "assistant", "tool", "assistant"]


def test_the_budget_counts_the_model_tokens_of_the_whole_episode(tokenizer):
    answer = "The answer is twelve, and here is a long explanation of why that is so."
    first = len(tokenizer(call("multiply", a=3, b=4), add_special_tokens=False)["input_ids"])
    budget = first + 6
    roll = episodes(tokenizer, [script(call("multiply", a=3, b=4), answer), script("Short.")], max_new_tokens=budget)
    assert roll.cut.tolist() == [True, False] and roll.truncated.tolist() == [True, False]
    assert int(roll.model_mask[0].sum()) == budget  # both turns together, the tool tokens not counted
    assert int(roll.completion_mask[0].sum()) > budget
    assert roll.metrics()["cut_frac"] == 0.5


def test_the_context_ends_an_episode(tokenizer):
    row = script(call("multiply", a=3, b=4), "The answer is 12.")
    prompt = len(tokenizer(ToolFormat(tokenizer).render_prompt(row["messages"], make_tools(TOOLS)),
                           add_special_tokens=False)["input_ids"])
    written = len(tokenizer(call("multiply", a=3, b=4), add_special_tokens=False)["input_ids"])
    roll = episodes(tokenizer, [row], context_length=prompt + written + 5)  # room for the call, not the result
    assert roll.cut.item() and roll.turns.item() == 1
    assert int(roll.completion_mask[0].sum()) == written
    # the call ran; the result that did not fit is left out of the messages
    assert roll.tool_calls.item() == 1 and [m["role"] for m in roll.messages[0]] == ["user", "assistant"]


def test_a_stop_request_ends_the_loop_without_running_more_tools(tokenizer):
    policy = ScriptedPolicy(tokenizer)
    roll = run_episodes(policy, [script(call("multiply", a=1, b=2), call("multiply", a=3, b=4), "End.")], 1,
                        SamplingParams(128), EpisodeSetup(ToolFormat(tokenizer), max_tool_calls=4, tools=TOOLS),
                        stop=lambda: len(policy.calls) > 1)
    assert roll.interrupted and policy.calls == [1, 1] and roll.tool_calls.item() == 1


def test_the_loss_mask_excludes_tool_tokens_from_every_count(tokenizer):
    roll = episodes(tokenizer, [script(call("multiply", a=3, b=4), "12."), script("No tool needed.")], G=2)
    mask = roll.loss_mask()
    assert torch.equal(mask, roll.model_mask) and bool((mask <= roll.completion_mask).all())
    tool_tokens = roll.completion_mask - mask
    assert int(tool_tokens[0].sum()) > 0 and int(tool_tokens[2].sum()) == 0
    assert "<|im_start|>tool\n12" in tokenizer.decode(roll.completion_ids[0][tool_tokens[0].bool()])
    # a loss of 1 per trained token: dapo's normaliser counts the model's tokens only (the whole completion mask
    # would dilute it), and dr_grpo's numerator sums over them only
    per_token = mask.float()
    assert float(algorithm.dapo_loss(per_token, mask.float())) == pytest.approx(1.0)
    assert float(algorithm.dapo_loss(per_token, roll.completion_mask.float())) < 0.9
    B, budget = per_token.shape[0], 128
    assert float(algorithm.dr_grpo_loss(per_token, mask.float(), max_new_tokens=budget)) == pytest.approx(
        float(mask.sum()) / (B * budget))
    turn = call("multiply", a=3, b=4) + "12."
    sampled = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in (turn,))
    assert int(mask[0].sum()) == sampled  # the call, the answer and one EOS: nothing of the tool message
    plain = run_episodes(ScriptedPolicy(tokenizer), [script("Hi.")], 1, SamplingParams(8),
                         EpisodeSetup(ToolFormat(tokenizer), max_tool_calls=0))
    assert torch.equal(plain.loss_mask(), plain.completion_mask)


def test_one_generate_call_per_turn_batches_the_running_episodes(tokenizer):
    policy = ScriptedPolicy(tokenizer)
    rows = [script(call("multiply", a=1, b=1), "A."), script("B."), script(call("multiply", a=2, b=2), "C.")]
    run_episodes(policy, rows, 2, SamplingParams(64), EpisodeSetup(ToolFormat(tokenizer), 2, tools=TOOLS))
    assert policy.calls == [6, 4]  # all six episodes, then the four that called a tool, in one call each


# ---- environments (TRL's environment_factory contract) ---------------------------------------------------------------
class CounterEnv:
    """TRL's documented environment shape (docs/source/openenv.md, "Environment class requirements"), with a local
    counter in place of the remote client: __init__ without arguments, reset(**kwargs) -> str | None, public
    methods as tools, state read back for the reward."""

    def __init__(self):
        self.reward = 0.0

    def reset(self, **kwargs) -> str | None:
        self.reward = 0.0
        self.count = kwargs["start"]
        return f" Start at {self.count}."

    def increment(self, step: int) -> str:
        """
        Add a step to the counter.

        Args:
            step: How much to add.

        Returns:
            The counter after the step.
        """
        self.count += step
        self.reward = float(self.count)
        return f"count={self.count}"

    def get_reward(self) -> float:
        return self.reward


def test_a_trl_style_environment_runs_unchanged_one_instance_per_episode(tokenizer):
    rows = [{**script(call("increment", step=2), call("increment", step=3), "Done."), "start": 10},
            {**script(call("increment", step=5), "Done."), "start": 0}]
    roll = episodes(tokenizer, rows, G=2, tools=(), environment_factory=CounterEnv)
    assert len(roll.environments) == 4 and len({id(e) for e in roll.environments}) == 4
    assert [e.count for e in roll.environments] == [15, 15, 5, 5]  # each instance saw only its own calls
    assert [e.get_reward() for e in roll.environments] == [15.0, 15.0, 5.0, 5.0]
    assert [m["name"] for m in roll.messages[0] if m["role"] == "tool"] == ["increment", "increment"]
    assert roll.messages[0][0]["content"].endswith(" Start at 10.")  # reset's string joins the last user message
    assert [t.__name__ for t in environment_methods(CounterEnv())] == ["increment"]


class Recorder:
    """An environment whose reset names what it reads, as TRL's docs write one (no **kwargs): TRL passes the row's
    prompt as `prompt` and its other columns, so `messages` must not come too."""

    def reset(self, prompt, start) -> None:
        self.seen = (prompt, start)

    def look(self) -> str:
        """Nothing.
        """
        return ""


def test_reset_gets_the_prompt_under_trls_name_and_the_row_columns(tokenizer):
    row = {**script("Hi."), "start": 7}
    roll = episodes(tokenizer, [row], tools=(), environment_factory=Recorder)
    assert roll.environments[0].seen == (row["messages"], 7)
    kept = episodes(tokenizer, [row], tools=(), environment_factory=CounterEnv)  # reset(**kwargs): messages too
    assert kept.environments[0].count == 7


class Init:
    def __init__(self, table: str):  # TRL builds an environment without arguments
        self.table = table

    def reset(self, **kwargs) -> None:
        pass


class ResetRaises:
    def reset(self, **kwargs) -> None:
        raise ValueError("no state for this row")


class ResetExits:
    def reset(self, **kwargs) -> None:
        sys.exit(0)


class ResetGivesInt:
    def reset(self, **kwargs) -> int:
        return 3


class ResetGivesDict:
    def reset(self, **kwargs) -> dict:
        return {"observation": "hi"}


ENVIRONMENT_FAILURES = [  # (class, its one line); the row of these runs has messages and `start`
    (Init, "environment Init() raised TypeError: Init.__init__() missing 1 required positional argument: 'table'; an "
           "environment is built without arguments (TRL's environment_factory): fix its __init__"),
    (ResetRaises, "environment ResetRaises.reset raised ValueError: no state for this row (given prompt, start, "
                  "messages); fix it"),
    (ResetExits, "environment ResetExits.reset raised SystemExit: 0 (given prompt, start, messages); fix it"),
    (ResetGivesInt, "environment ResetGivesInt.reset returned int 3; it must return a string (added to the prompt) "
                    "or None"),
    (ResetGivesDict, "environment ResetGivesDict.reset returned dict {'observation': 'hi'}; it must return a string "
                     "(added to the prompt) or None"),
]
ENVIRONMENT_NAMES = [e.__name__ for e, _ in ENVIRONMENT_FAILURES]  # the test ids


@pytest.mark.parametrize(("environment", "line"), ENVIRONMENT_FAILURES, ids=ENVIRONMENT_NAMES)
def test_an_environment_that_fails_is_one_line_naming_its_class_and_method(tokenizer, capfd, environment, line):
    with pytest.raises(RunError) as err:
        episodes(tokenizer, [{**script("Hi."), "start": 1}], tools=(), environment_factory=environment)
    assert type(err.value).__name__ == "UserCodeError" and str(err.value) == line
    assert capfd.readouterr().err == ""


class SlowInit:
    def __init__(self):
        time.sleep(30)  # a connection that never answers

    def reset(self, **kwargs) -> None:
        pass


class SlowReset:
    def reset(self, **kwargs) -> None:
        time.sleep(30)


@pytest.mark.parametrize(("environment", "call"), [(SlowInit, "SlowInit()"), (SlowReset, "SlowReset.reset")])
def test_an_environment_past_its_deadline_is_one_line_and_abandoned(tokenizer, environment, call):
    """env.timeout_s: building or resetting an environment that hangs (a socket, a container that never starts)
    ends the episode loop in one line instead of stalling the run with no word."""
    t0 = time.monotonic()
    with pytest.raises(RunError) as err:
        episodes(tokenizer, [{**script("Hi."), "start": 1}], tools=(), environment_factory=environment,
                 environment_timeout_s=0.3)
    assert time.monotonic() - t0 < 10  # the 30 s call was abandoned at its deadline (with room for a slow machine)
    assert str(err.value) == (f"environment {call} took over 0.3 s (env.timeout_s) and was abandoned; fix it, or "
                              "raise env.timeout_s (null = no limit)")


ENV_URL = "https://my-env.hf.space"


class MyClient:
    """The stand-in the docs' example leaves to the reader ("MyClient"): a local object, nothing remote."""

    def __init__(self, base_url: str):
        self.base_url = base_url


# ---- copied verbatim from TRL's docs/source/openenv.md, "Environment class requirements" -------------------------
class MyEnv:
    def __init__(self):
        self.client = MyClient(base_url=ENV_URL)  # captured from enclosing scope
        self.reward = 0.0

    def reset(self, **kwargs) -> str | None:
        self.reward = 0.0
        return "Initial observation for the model"

    def my_tool(self, arg1: str, arg2: int) -> str:
        """
        Description of what this tool does.

        Args:
            arg1: Description of arg1
            arg2: Description of arg2

        Returns:
            The result message.
        """
        self.reward = 1.0
        return "Tool result"
# ---- end of the copy -------------------------------------------------------------------------------------------------


def test_the_environment_of_trls_docs_runs_unchanged(tokenizer):
    rows = [script(call("my_tool", arg1="x", arg2=3), "Thanks."), script("No tool.")]
    roll = episodes(tokenizer, rows, G=2, tools=(), environment_factory=MyEnv)
    assert [e.reward for e in roll.environments] == [1.0, 1.0, 0.0, 0.0]
    assert roll.messages[0][2] == {"role": "tool", "name": "my_tool", "content": "Tool result"}
    assert roll.messages[2][0]["content"].endswith("No tool.Initial observation for the model")
    assert '"name": "my_tool"' in roll.prompts[0]


# ---- copied verbatim from TRL's docs/source/grpo_trainer.md, "Environments" ------------------------------------------
class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter
# ---- end of the copy -------------------------------------------------------------------------------------------------


def test_the_environment_that_owns_its_reward_in_trls_docs_runs_unchanged(tokenizer):
    random.seed(0)
    targets = [random.randint(1, 6) for _ in range(2)]
    random.seed(0)
    roll = episodes(tokenizer, [script(call("increment", step=targets[0]), "Done."),
                                script(call("increment", step=targets[1] % 6 + 1), "Done.")],
                    tools=(), environment_factory=IncrementEnv)
    assert [e.target for e in roll.environments] == targets
    assert roll.messages[0][0]["content"].endswith(f"Increment the counter by {targets[0]}.")
    assert roll.messages[0][2]["content"] == str(targets[0])  # the int it returned, as str() renders it
    assert [e.get_reward() for e in roll.environments] == [1.0, 0.0]


def test_async_tools_run_and_names_must_differ(tokenizer):
    async def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first.
            b: The second.
        """
        return a + b

    roll = episodes(tokenizer, [script(call("add", a=2, b=3), "5.")], tools=(add,))
    assert roll.messages[0][2]["content"] == "5" and roll.failed_calls.item() == 0
    with pytest.raises(ConfigError, match="two tools share a name"):
        episodes(tokenizer, [script("Hi.")], tools=(multiply, multiply))


def test_an_environment_can_own_the_prompt_and_vary_it_within_a_group(tokenizer):
    """With no messages, reset's string is the prompt; G instances that say different things get their own
    prompts: the group shares the common prefix, and each rest opens its row as non-model tokens."""

    class Owner:
        made = 0

        def reset(self, **row) -> str:
            Owner.made += 1
            return f"SCRIPT:Instance {Owner.made}."

    roll = run_episodes(ScriptedPolicy(tokenizer), [{}], 2, SamplingParams(16),
                        EpisodeSetup(ToolFormat(tokenizer), max_tool_calls=1, environment_factory=Owner))
    assert roll.texts == ["Instance 1.", "Instance 2."]
    own = roll.completion_mask - roll.model_mask
    assert "1" in tokenizer.decode(roll.completion_ids[0][own[0].bool()])
    assert decoded(tokenizer, roll, 1, roll.model_mask) == "Instance 2.<|im_end|>"


# ---- the log-prob pass over interleaved masks ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def lm():
    return tiny_lora_policy()


@pytest.fixture(scope="module")
def policy_and_episodes(lm):
    rows = [script(call("explode", x=1), call("multiply", a=2, b=2), "Four."), script("No call.")]
    return lm.model, episodes(lm.tokenizer, rows, G=2, tools=(multiply, explode))  # short prompts: a cheap pass


def full_forward(model, roll):
    """Prompt + whole completion (model and tool tokens) in one plain forward: full logits, the reference."""
    G, Lp, T = roll.group_size, roll.prompt_ids.shape[1], roll.completion_ids.shape[1]
    owner = torch.arange(roll.completion_ids.shape[0]) // G
    p_mask = roll.prompt_mask[owner]
    ids = torch.cat([roll.prompt_ids[owner], roll.completion_ids], dim=1)
    mask = torch.cat([p_mask, roll.completion_mask], dim=1)
    pos = torch.cat([positions(p_mask), p_mask.sum(1, keepdim=True) + torch.arange(T)], dim=1)
    return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, Lp - 1:Lp - 1 + T]


def _lora_grads(model):
    return torch.cat([p.grad.flatten() for n, p in model.named_parameters() if "lora_" in n])


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
@pytest.mark.parametrize("chunk", (3, None))
def test_the_pass_attends_over_tool_tokens_and_matches_a_full_forward(policy_and_episodes, chunk):
    model, roll = policy_and_episodes
    model.train()
    mask = roll.loss_mask().float()
    assert 0 < mask.sum() < roll.completion_mask.sum()
    model.zero_grad(set_to_none=True)
    ref = algorithm.token_logprobs(full_forward(model, roll), roll.completion_ids)
    (ref * mask).sum().backward()
    ref_grad = _lora_grads(model)
    model.zero_grad(set_to_none=True)
    logp, _ = completion_logprobs(model, roll, slice(0, roll.completion_ids.shape[0]), 1.0, chunk)
    (logp * mask).sum().backward()
    real = roll.completion_mask.bool()
    torch.testing.assert_close(logp[real], ref[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_lora_grads(model), ref_grad, rtol=1e-4, atol=1e-5 * float(ref_grad.abs().max()))


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_a_tool_token_never_receives_gradient(policy_and_episodes):
    """The masked loss puts no gradient on the prediction of any tool token (its logits' gradient is exactly 0),
    while every model token's prediction gets one; tool tokens still shape the model tokens after them."""
    model, roll = policy_and_episodes
    model.train()
    logits = full_forward(model, roll)
    logits.retain_grad()
    mask = roll.loss_mask().float()
    (algorithm.token_logprobs(logits, roll.completion_ids) * mask).sum().backward()
    per_position = logits.grad.abs().sum(dim=-1)
    tool = (roll.completion_mask - roll.model_mask).bool()
    assert tool.any()
    assert bool((per_position[tool] == 0).all())
    assert bool((per_position[roll.model_mask.bool()] > 0).all())
    with torch.no_grad():  # ... and changing a tool result changes the model tokens' log-probs after it
        changed = roll.completion_ids.clone()
        first_tool = int(tool[0].nonzero()[0])
        changed[0, first_tool + 3] = (changed[0, first_tool + 3] + 7) % 1000
        after = roll.model_mask[0].bool() & (torch.arange(changed.shape[1]) > first_tool + 3)
        swapped = Episodes(**{**roll.__dict__, "completion_ids": changed})
        b = algorithm.token_logprobs(full_forward(model, swapped), changed)[0][after]
    assert not torch.allclose(algorithm.token_logprobs(logits.detach(), roll.completion_ids)[0][after], b)


# ---- real engines ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ("hf", "compiled"))
def test_real_engines_run_the_loop_and_cut_at_the_budget(lm, engine):
    """Real engines through the same loop (`compiled` without compiling, on the CPU): the tiny random model never
    closes a call, so its episodes end at the budget, every sampled token is the model's and in the loss."""
    from grpo_cli.rollout import CompiledEngine

    torch.manual_seed(0)
    rows = [{"messages": [{"role": "user", "content": "What is 3 * 4?"}]}]
    policy = (HFEngine(lm.model, lm.tokenizer) if engine == "hf" else
              CompiledEngine(lm.model, lm.tokenizer, torch.device("cpu"), compile=False))
    roll = run_episodes(policy, rows, 3, SamplingParams(6, temperature=1.0),
                        EpisodeSetup(ToolFormat(lm.tokenizer, opener='<tool_call>{"name": "'), 2, tools=TOOLS))
    assert roll.cut.all() and roll.turns.tolist() == [1, 1, 1]
    assert torch.equal(roll.model_mask, roll.completion_mask) and (roll.model_mask.sum(1) == 6).all()
    assert roll.messages[0][-1]["content"].startswith('<tool_call>{"name": "')  # the opener is in the turn


@pytest.mark.slow
def test_the_embedded_model_calls_a_tool_when_the_call_opener_is_prefilled():
    """SmolLM2-135M writes no call from scratch (0 of 16 in the probes); with the opener prefilled it completes
    one: the loop runs it, the result's tokens are in the row and out of the loss, and the model answers."""
    from grpo_cli.config.schema import LoraConfig, ModelConfig
    from grpo_cli.model.loading import load_policy

    lora = LoraConfig(r=8, alpha=16, dropout=0.0, target_modules="all-linear")
    lm = load_policy(ModelConfig(name_or_path="embedded:smollm2-135m", trust_remote_code=False, dtype="float32",
                                 lora=lora), "cpu")
    fmt = ToolFormat(lm.tokenizer, opener='<tool_call>{"name": "multiply", "arguments": {"a": ')
    torch.manual_seed(0)
    rows = [{"messages": [{"role": "user", "content": "What is 347 * 29? Use the multiply tool."}]}]
    sampling = SamplingParams(40, temperature=1.0, stop_strings=("}}",))  # flat arguments end the call
    roll = run_episodes(HFEngine(lm.model, lm.tokenizer), rows, 8, sampling, EpisodeSetup(fmt, 1, tools=[multiply]))
    # a call closed within the budget leaves room to answer (one whose "}}" comes late runs, then the budget ends)
    ran = [i for i in range(8) if roll.tool_calls[i] > roll.failed_calls[i] and roll.turns[i] == 2]
    assert ran, roll.messages
    i = ran[0]
    assert roll.turns[i] == 2 and roll.messages[i][2]["role"] == "tool"
    tool = (roll.completion_mask[i] - roll.model_mask[i]).bool()
    assert roll.messages[i][2]["content"] in lm.tokenizer.decode(roll.completion_ids[i][tool])
    assert int(roll.model_mask[i].sum()) <= 40


@pytest.mark.parametrize("option", ["rollout.max_tool_calls=8", "rollout.tool_timeout_s=30",
                                    "rollout.tool_format=native", "rollout.tool_output_max_chars=100",
                                    "rollout.call_opener=Call"])
def test_a_tool_option_without_tools_or_an_environment_is_one_line(compose, option):
    """Single-turn runs never read the tool options: one set there would go unused, so it is refused; with a tool
    the same option is taken."""
    from conftest import TINY_TRAINER

    from grpo_cli.run.validate import validate

    key, value = option.split("=")
    with pytest.raises(ConfigError) as err:
        validate(compose([*TINY_TRAINER, option]))
    assert str(err.value) == (f"{key}={value} is invalid: is read only with tools or an environment (rollout.tools, "
                              f"env._target_); add them, or drop {key}")
    validate(compose([*TINY_TRAINER, "rollout.tools=[grpo_cli.calculator.calculator]", option]))
    with pytest.raises(ConfigError, match=r"^env.timeout_s=5 is invalid: is read only with an environment "):
        validate(compose([*TINY_TRAINER, "rollout.tools=[grpo_cli.calculator.calculator]", "env.timeout_s=5"]))
