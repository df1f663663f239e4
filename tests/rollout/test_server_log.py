"""rollout/vllm_server.last_line: the one line that says why a server grpo-train started ended before it answered,
read from the last start in its log (a resumed run's server logs after the killed attempt's)."""

from __future__ import annotations

from grpo_cli.rollout.vllm_server import STARTS, last_line

# The end of the log of vLLM 0.32's server started on a folder without a model (measured, paths shortened)
NO_MODEL = """\
  File "/venv/lib/python3.11/site-packages/pydantic/_internal/_dataclasses.py", line 121, in __init__
    s.__pydantic_validator__.validate_python(ArgsKwargs(args, kwargs), self_instance=s)
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, Invalid repository ID or local directory specified: '/tmp/no-model'.
Please verify the following requirements:
1. Provide a valid Hugging Face repository ID.
 [type=value_error, input_value=ArgsKwargs((), {'model': ...nderer_num_workers': 1}), input_type=ArgsKwargs]
    For further information visit https://errors.pydantic.dev/2.14/v/value_error
"""
# An engine process's failure, which the server re-raises pointing back at it
ENGINE = """\
(EngineCore pid=5) Traceback (most recent call last):
(EngineCore pid=5) ValueError: the engine's own reason
(APIServer pid=4) ERROR 12-05 12:00:00 [core_client.py:1] Engine core failed
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def started(text: str) -> str:
    return f"{STARTS} by grpo-train (pid 7) at 2026-12-05 12:00:00\n{text}"


def test_the_raised_line_and_pydantic_s_failed_check(tmp_path):
    log = tmp_path / "vllm-server.log"
    log.write_text(started(NO_MODEL))
    assert last_line(log) == ("pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig "
                              "Value error, Invalid repository ID or local directory specified: '/tmp/no-model'.")


def test_the_engine_s_reason_rather_than_the_pointer_to_it(tmp_path):
    log = tmp_path / "vllm-server.log"
    log.write_text(started(ENGINE))
    assert last_line(log) == "(EngineCore pid=5) ValueError: the engine's own reason"


def test_only_the_last_start_is_read(tmp_path):
    log = tmp_path / "vllm-server.log"
    log.write_text(started(NO_MODEL) + started("INFO starting\nan unexpected end\n"))
    assert last_line(log) == "an unexpected end"
    log.write_text(started(NO_MODEL) + started(""))
    assert last_line(log) == "an empty log"


def test_a_log_without_a_start_line_and_without_a_traceback(tmp_path):
    log = tmp_path / "vllm-server.log"
    log.write_text("INFO one\nWARNING a deprecated error path\nINFO last\n")
    assert last_line(log) == "WARNING a deprecated error path"
    assert last_line(tmp_path / "missing.log") == "no log"
