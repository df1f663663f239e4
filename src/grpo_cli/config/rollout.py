"""The `rollout` and `env` sections: sampling, tools, the engines and where generation runs, and the environment of
multi-turn episodes; one field per option, declared as schema.py declares the others."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from grpo_cli.config.option_table import option
from grpo_cli.config.rule import ANY_TEXT, AUTO_OR_BOOLEAN, MAPPING, integer, number
from grpo_cli.config.values import (
    AUTO_OR_BOOL,
    DEVICE,
    DOTTED_PATH,
    DOTTED_PATHS,
    DTYPE,
    HTTP_URLS,
    POSITIVE,
    STOP_STRINGS,
    registered,
)


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """rollout: sampling the completions, the sampling options TRL users expect (docs/usage.md "Sampling and the
    loss": what each does to the loss's log-probs), tools (docs/usage.md "Tools and environments") and the vllm
    engine (docs/usage.md "vLLM")."""

    max_new_tokens: int = option("tokens per completion at most", 64, integer(1))
    min_new_tokens: int = option("tokens before EOS may end a completion (<= max_new_tokens)", 0, integer(0))
    temperature: float = option("sampling temperature", 1.0, POSITIVE)
    top_p: float = option("nucleus sampling mass; 1 = off (the loss's log-probs stay the full softmax)", 1.0,
                          number(0, 1, low_open=True))
    top_k: int | None = option("sample among the k likeliest tokens only; 0/null = off (the loss's log-probs stay "
                               "the full softmax)", 0, integer(0), row="truncation")
    min_p: float | None = option("drop tokens below min_p x the likeliest one's probability; 0/null = off (the "
                                 "loss's log-probs stay the full softmax)", 0.0, number(0, 1), row="truncation")
    repetition_penalty: float = option("penalise tokens already in the prompt or completion (a logit l becomes l/p "
                                       "if l > 0, l*p if not); 1 = off (the loss's log-probs stay unpenalised)",
                                       1.0, POSITIVE, row="truncation")
    stop: tuple[str, ...] = option("a completion ends at the first of these strings, which stays in it (and in "
                                   "the loss); \\n and \\t read as newline and tab", (), STOP_STRINGS)
    engine: str = option("auto = compiled on CUDA, merged on the CPU, hf for a quantized base", "auto",
                         registered("grpo_cli.rollout", "ENGINES", auto=True))
    compile: AUTO_OR_BOOL = option("compiled engine: compile the decode step; auto = on CUDA, warn and go on if it "
                                   "fails; true = anywhere, fail if it fails", "auto", AUTO_OR_BOOLEAN)
    chat_template_kwargs: Mapping[str, Any] = option(
        "keyword arguments of the chat template wherever a prompt is rendered, e.g. {enable_thinking: false} "
        "(Qwen3; TRL's chat_template_kwargs)", {}, MAPPING, free=True)
    tools: tuple[str, ...] = option("tools the model may call: dotted paths of functions with type hints and a "
                                    "Google-style docstring, e.g. [grpo_cli.calculator.calculator]; [] and no "
                                    "env = single-turn", (), DOTTED_PATHS, row="tools")
    max_tool_calls: int = option("tool calls an episode may run; a further call ends it", 4, integer(0),
                                 row="tools")
    tool_timeout_s: float | None = option("seconds a tool call may take; over it the model reads an error (null = "
                                          "no limit)", 10.0, POSITIVE, row="tools")
    tool_output_max_chars: int | None = option("characters of a tool's result the model reads; a longer one is "
                                               "cut, with a note (episodes/tool_outputs_cut counts them); null = "
                                               "no limit", 10000, integer(1), row="tools")
    tool_format: Literal["auto", "native", "hermes"] = option(
        "auto = the chat template's tool support where it has one, else hermes: the tools in the system turn, "
        "calls as <tool_call>{json}</tool_call>", "auto", row="tools")
    call_opener: str = option("text prefilled at the start of the first assistant turn (in the prompt, not "
                              "trained), e.g. the opening of a call for a small model that never starts one alone",
                              "", ANY_TEXT, row="tools")
    vllm_dtype: DTYPE = option("vllm engine (and the server placement=server starts): the dtype it samples in; "
                               "auto = model.dtype", "auto", row="vllm")
    vllm_max_model_len: int | None = option("vllm engine: longest prompt + completion it serves; null = the "
                                            "model's context", None, integer(1), row="vllm")
    vllm_gpu_memory_utilization: float = option("vllm engine on CUDA: the share of GPU memory it takes beside the "
                                                "trainer (weights and KV cache); a SLURM job's inference nodes: "
                                                "0.9 unless set", 0.3, number(0, 1, low_open=True),
                                                row="vllm memory")
    vllm_kv_cache_gib: float = option("vllm engine on the CPU: KV cache size in GiB", 1.0, POSITIVE,
                                      row="vllm memory")
    vllm_sync: Literal["merged", "lora"] = option("vllm engine: the policy after each update as merged weights "
                                                  "reloaded in place, or as a LoRA request", "merged")
    placement: Literal["local", "worker", "server"] = option(
        "where generation runs: local = in the training process, taking turns with training; worker = a process of "
        "its own (docs/usage.md \"Generation in a worker process\"); server = vLLM's OpenAI-compatible server, the "
        "adapter loaded by name at each version (docs/usage.md \"Generation on vLLM's server\")", "local",
        row="worker")
    max_staleness: int = option("K: batches are generated up to K policy versions ahead of the update that uses "
                                "them (needs placement=worker or server); 0 = on-policy", 0, integer(0), row="worker")
    server_url: str | tuple[str, ...] | None = option(
        "placement=server: the base URL (http://HOST:PORT/v1) of a running vLLM server of the base model, started "
        "with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, or a list of them (replicas, each given every "
        "adapter version); null = grpo-train starts rollout.servers `vllm serve` and stops them at the end", None,
        HTTP_URLS, row="worker")
    servers: int = option("placement=server without server_url: the vLLM servers grpo-train starts, each given every "
                          "adapter version; on the CPU each pinned to cores of its own (rollout.worker_threads each), "
                          "on CUDA spread over the visible GPUs", 1, integer(1), row="worker")
    server_timeout_s: float = option("placement=server: seconds a server may take to answer a call; past it (or on "
                                     "an error) that server is taken out, its requests sent to the others, and it "
                                     "is tried again at the next policy version", 600.0, POSITIVE, row="worker")
    worker_threads: int | None = option("placement=worker on the CPU: the worker's torch threads, the trainer "
                                        "keeps the rest; null = half of the trainer's (at least 1 each); "
                                        "placement=server: the threads (and cores) of each server grpo-train "
                                        "starts; null = half of the trainer's, shared by the servers", None,
                                        integer(1), row="worker")
    worker_device: str = option("placement=worker: the device the worker generates on, e.g. cuda:1 beside a trainer "
                                "on cuda:0 (one device: the engine runs on one); auto = the trainer's", "auto", DEVICE,
                                row="worker")
    generator_timeout_s: float | None = option("placement=worker or server: seconds the trainer waits for the "
                                               "generator's next message once it is ready (a batch, a sync); past it "
                                               "the run stops in one line with its checkpoint; null = no limit",
                                               1800.0, POSITIVE, row="worker")


@dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """env: the environment of multi-turn episodes (docs/usage.md "Tools and environments")."""

    _target_: str | None = option("an environment class (TRL's environment_factory): one per episode, "
                                  "reset(**row) returns a string or None, public methods are tools, optional "
                                  "get_reward(); null = none", None, DOTTED_PATH)
    timeout_s: float | None = option("seconds an environment may take to be built or to reset(**row) (room for a "
                                     "remote one's cold start); past it the run stops in one line with its last "
                                     "checkpoint (null = no limit)", 300.0, POSITIVE)
