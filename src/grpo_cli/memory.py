"""Memory: how many tokens one forward/backward may hold, activation checkpointing where a budget needs it, and
what an out-of-memory error says.

    trainer.micro_batch_tokens   tokens (prompt + completion) of one forward/backward at most (auto: 2048 on the CPU)
    trainer.memory_budget_gb     a budget the step must fit: the tokens per micro-batch and checkpointing follow

A step's peak is the model and its engine (read off the process once they are loaded), then the larger of the
rollout's KV cache and the training pass: the activations autograd keeps for one micro-batch (per token, from the
model's widths) and the LM head's block of logits. The activation estimate counts the tensors a decoder layer
saves for its backward with LoRA on every linear layer,

    per token per layer:  6 x hidden + 2 x kv width + 4 x intermediate  values  (norms, q, k, v, attention out,
                                                                              MLP in/gate/up/act; measured with
                                                                              autograd's saved-tensor hooks)

times what the allocator holds beyond them, and with checkpointing a share of that. Both factors are measured on
SmolLM2-135M in fp32 on the 2-core CPU, from whole steps at 1024 and 4096 new tokens a row (2026-12-03, one row a
micro-batch: peak RSS over what the model, its engine and the head held, 3.3 and 3.1 MiB a token, against 1.2 MB of
saved tensors: 2.7) and from one row's pass at 2048 and 4096 tokens with and without checkpointing
(scripts/probe_row_memory.py: 1.43 against 1.80 and 1.32 against 1.49 MiB a token: 0.8). Most of it is freed blocks
glibc keeps, which checkpointing does not give back (docs/usage.md, "Known limit"). The first factors, 1.7 and 0.4,
were measured at 512-2048 tokens a micro-batch and planned steps that an 8 GiB cap killed at 2048 and 4096 new
tokens. On CUDA the caching allocator holds less, so the estimate errs high there.
"""

from __future__ import annotations

import os
import re
import resource
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from grpo_cli import prepack
from grpo_cli.errors import ConfigError

if TYPE_CHECKING:
    from grpo_cli.schema import TrainerConfig

GIB = 2**30
ALLOCATOR_FACTOR = 2.7       # peak RSS growth over the saved tensors' bytes (CPU, glibc), measured (above)
CHECKPOINTED_SHARE = 0.8     # a checkpointed pass's peak per token over a plain one's, measured (above)
CPU_MICRO_BATCH_TOKENS = 2048  # auto on the CPU: the products run at full speed from a few hundred tokens on
HEAD_BLOCKS = 3              # fp32 [chunk, vocab] blocks alive at once in the head pass (logits, p, onehot - p)


def micro_batch_tokens(setting, device: torch.device) -> int | None:
    """`trainer.micro_batch_tokens` resolved: auto = CPU_MICRO_BATCH_TOKENS on the CPU, no limit elsewhere."""
    if setting == "auto":
        return CPU_MICRO_BATCH_TOKENS if device.type == "cpu" else None
    return setting


def activation_bytes_per_token(config, dtype: torch.dtype, checkpointing: bool) -> float:
    """Peak bytes one token of a micro-batch adds to the policy's forward + backward (see the module docstring)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, layers = text.hidden_size, text.num_hidden_layers
    head_dim = getattr(text, "head_dim", None) or hidden // text.num_attention_heads
    kv = head_dim * getattr(text, "num_key_value_heads", text.num_attention_heads)
    saved = layers * (6 * hidden + 2 * kv + 4 * text.intermediate_size) * torch.finfo(dtype).bits // 8
    return saved * ALLOCATOR_FACTOR * (CHECKPOINTED_SHARE if checkpointing else 1.0)


def kv_cache_bytes(config, dtype: torch.dtype, rows: int, tokens: int) -> float:
    """The rollout's KV cache: every row's keys and values for `tokens` positions in every layer."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv = head_dim * getattr(text, "num_key_value_heads", text.num_attention_heads)
    return 2.0 * rows * tokens * text.num_hidden_layers * kv * torch.finfo(dtype).bits // 8


def in_use_bytes(device: torch.device) -> float:
    """What the process holds now: CUDA memory allocated on `device`, or the resident set on the CPU."""
    if device.type == "cuda":
        return float(torch.cuda.memory_allocated(device))
    with open("/proc/self/statm") as f:
        return float(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0


@dataclass(frozen=True)
class MemoryPlan:
    """What the memory settings decided for a run: tokens per micro-batch (None: a whole mini-batch), activation
    checkpointing, and for a budget the numbers behind it."""

    micro_batch_tokens: int | None
    checkpointing: bool
    budget_gb: float | None = None
    loaded_gb: float = 0.0       # the model and its engine, measured
    estimate_gb: float = 0.0     # the estimated peak of a step

    def line(self) -> str:
        tokens = f"at most {self.micro_batch_tokens} tokens" if self.micro_batch_tokens else "no token limit"
        checkpointing = "on" if self.checkpointing else "off"
        return (f"trainer.memory_budget_gb={self.budget_gb:g}: micro-batches of {tokens}, activation checkpointing "
                f"{checkpointing} (model and engine {self.loaded_gb:.1f} GiB with their packed weights; a step's "
                f"estimated peak {self.estimate_gb:.1f} GiB)")


def plan(tcfg: TrainerConfig, lm, engine=None, *, rows: int, longest_row: int, chunk_size: int | None) -> MemoryPlan:
    """The micro-batch token limit and checkpointing for trainer section `tcfg` (its micro_batch_tokens,
    gradient_checkpointing, memory_budget_gb) and the loaded model `lm`. `rows`: completions a step generates on
    this rank; `longest_row`: the most tokens (prompt + completion) one row can have. What the model and `engine` (a
    rollout Engine) hold is read off the process, plus what their weights will take once packed (model.prepack packs
    lazily, at the first product). Without a budget the settings
    stand as given. With one, the largest micro-batch that fits is taken (no more than micro_batch_tokens when
    that is a number; auto leaves it to the budget), without checkpointing if one whole row fits so, else with it;
    a budget that cannot hold one row even checkpointed is a ConfigError naming the knobs."""
    budget = tcfg.memory_budget_gb
    if budget is None:
        return MemoryPlan(micro_batch_tokens(tcfg.micro_batch_tokens, lm.device), bool(tcfg.gradient_checkpointing))
    tokens = None if tcfg.micro_batch_tokens == "auto" else tcfg.micro_batch_tokens  # auto: the budget decides
    config, dtype = lm.model.config, lm.dtype
    packed = [(lm.model, ("forward", "backward"))] + ([] if engine is None else engine.packed_models())
    loaded = in_use_bytes(lm.device) + prepack.pending_bytes(*packed)
    vocab = lm.model.get_output_embeddings().weight.shape[0]
    head = HEAD_BLOCKS * min(chunk_size or longest_row, longest_row) * vocab * 4.0
    room = budget * GIB * 0.95 - loaded - head  # 5 %: what the estimate does not see (records, the optimizer step)
    generation = kv_cache_bytes(config, dtype, rows, longest_row)
    for checkpointing in (bool(tcfg.gradient_checkpointing), True):
        per_token = activation_bytes_per_token(config, dtype, checkpointing)
        fits = int(room // per_token) if room > 0 else 0
        if fits >= longest_row and budget * GIB * 0.95 >= loaded + generation:
            chosen = fits if tokens is None else min(tokens, fits)
            estimate = loaded + max(generation, head + chosen * per_token)
            return MemoryPlan(chosen, checkpointing, budget, loaded / GIB, estimate / GIB)
    need = loaded + max(generation, head + longest_row * activation_bytes_per_token(config, dtype, True))
    raise ConfigError(f"trainer.memory_budget_gb={budget:g} is too small for rows of up to {longest_row} tokens "
                      f"(data.max_prompt_tokens + rollout.max_new_tokens): one row needs about {need / GIB:.1f} GiB "
                      f"even with activation checkpointing (the model and its engine take {loaded / GIB:.1f} GiB); "
                      "raise trainer.memory_budget_gb, or lower rollout.max_new_tokens or algo.num_generations")


def is_out_of_memory(error: BaseException) -> bool:
    """An allocation that failed: CUDA's OutOfMemoryError, the CPU allocator's RuntimeError, Python's MemoryError."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and ("can't allocate memory" in str(error) or "out of memory" in str(error))


def out_of_memory_line(error: BaseException, step: int, device: torch.device) -> str:
    """One line for an allocation that failed in `step`: what, how much was held, which knobs lower it."""
    asked = re.search(r"(?:tried to allocate|allocate) (\d+(?:\.\d+)?) ?(bytes|[KMG]iB)", str(error))
    scale = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    what = f"an allocation of {float(asked[1]) * scale[asked[2]] / GIB:.2f} GiB failed" if asked else \
        f"{type(error).__name__}"
    return (f"out of memory in step {step} on {device.type}: {what} (peak so far {peak_bytes(device) / GIB:.1f} "
            "GiB); set trainer.memory_budget_gb to the memory you have (micro-batches and activation checkpointing "
            "follow from it), or lower trainer.micro_batch_tokens, rollout.max_new_tokens or algo.num_generations")


def cut(rows: slice, tokens: list[int], max_rows: int | None, max_tokens: int | None) -> list[slice]:
    """Consecutive micro-batches of `rows` (tokens[i]: the tokens of row rows.start + i), each of at most `max_rows`
    rows and `max_tokens` tokens; a row over `max_tokens` alone is a micro-batch of its own."""
    parts, start, held = [], rows.start, 0
    for i in range(rows.start, rows.stop):
        n = tokens[i - rows.start]
        full = (max_rows is not None and i - start >= max_rows) or (max_tokens is not None and held + n > max_tokens)
        if i > start and full:
            parts.append(slice(start, i))
            start, held = i, 0
        held += n
    if rows.stop > start:
        parts.append(slice(start, rows.stop))
    return parts
