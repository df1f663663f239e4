"""Memory: how many tokens one forward/backward may hold, activation checkpointing where a budget needs it, and
what an out-of-memory error says.

    trainer.micro_batch_tokens   tokens (prompt + completion) of one forward/backward at most (auto: 2048 on the CPU)
    trainer.memory_budget_gb     a budget the step must fit: the tokens per micro-batch and checkpointing follow

A step's peak is the model and its engine (read off the process once they are loaded), then the larger of the
rollout's KV cache and the training pass: the activations autograd keeps for one micro-batch (per token, from the
model's widths) and the LM head's blocks of logits. The activation estimate counts the values a decoder layer saves
for its backward with LoRA on every linear layer,

    per token per layer:  6 x hidden + 2 x kv width + 4 x intermediate  values  (norms, q, k, v, attention out,
                                                                              MLP in/gate/up/act; measured with
                                                                              autograd's saved-tensor hooks)

every layer's without checkpointing; with it, every layer's input (hidden values) and one layer's saved values,
recomputed in the backward. A budget also takes the LM head in blocks of BUDGET_HEAD_CHUNK positions and, on the CPU,
has glibc return freed blocks to the system (return_freed_blocks): by default glibc keeps them, and a long row's peak is
then mostly freed blocks, not tensors. With blocks returned the estimate holds to a few per cent on one row of
SmolLM2-135M (scripts/probe_row_memory.py; the numbers: docs/results/long-completions.md, "Under a memory budget");
ALLOCATOR_FACTOR leaves room for what the rest of a step holds beside the pass. Without a budget nothing is estimated
and the settings stand as given, and the command runs on TCMalloc where installed (grpo_cli/model/allocator.py: it keeps
freed blocks in size classes, so a step's peak holds fewer of them than glibc's heap does, at glibc's speed); returning
blocks throughout would cost a page fault per 4 KiB each time one is allocated again. A budget plans with glibc's
allocator, whose freed blocks it can have returned.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import resource
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from grpo_cli.base.errors import ConfigError, inform
from grpo_cli.model import allocator, prepack
from grpo_cli.model.loading import enable_activation_checkpointing
from grpo_cli.rollout.logprobs import real_lengths

if TYPE_CHECKING:
    from grpo_cli.config.schema import TrainerConfig
    from grpo_cli.rollout.common import Rollout

GIB = 2**30
ALLOCATOR_FACTOR = 1.3       # room for the rest of a step over the estimate (one row alone: 1.04x, docstring's study)
CPU_MICRO_BATCH_TOKENS = 2048  # auto on the CPU: the products run at full speed from a few hundred tokens on
HEAD_BLOCKS = 3              # fp32 [chunk, vocab] blocks alive at once in the head pass (logits, p, onehot - p)
BUDGET_HEAD_CHUNK = 256      # positions a head block holds under a budget: 150 MB at a 49k vocabulary, as fast as 1024
MMAP_THRESHOLD = 2**20       # glibc serves blocks this large and larger from their own mappings, unmapped on free
GENERATION_MMAP_THRESHOLD = 32 * 2**20  # glibc's own ceiling for its moving threshold (64-bit): kept while generating
M_MMAP_THRESHOLD = -3        # mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1


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
    per_layer = 6 * hidden + 2 * kv + 4 * text.intermediate_size
    values = layers * hidden + per_layer if checkpointing else layers * per_layer
    return values * torch.finfo(dtype).bits // 8 * ALLOCATOR_FACTOR


def _mallopt():
    """glibc's mallopt, or None where the C library has none."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return mallopt


def return_freed_blocks(threshold: int = MMAP_THRESHOLD) -> bool:
    """Have glibc serve blocks of `threshold` bytes and more from their own mappings, which free() unmaps at
    once. By default glibc raises that threshold up to 32 MiB as large blocks are freed, so a long row's activations
    and head blocks come from its heap, whose freed blocks it keeps (module docstring). The heap's top is given back
    once twice that much is free there (glibc's own rule when it moves the threshold). Process-wide, for the
    allocations after the call. False where the C library has no mallopt (not glibc)."""
    mallopt = _mallopt()
    return mallopt is not None and mallopt(M_MMAP_THRESHOLD, threshold) == 1 \
        and mallopt(M_TRIM_THRESHOLD, 2 * threshold) == 1


def trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim, which also drops free pages amid the
    heap, not only at its top); nothing where the C library has none."""
    try:
        ctypes.CDLL(None).malloc_trim(ctypes.c_size_t(0))
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def keeping_freed_blocks_while_generating(returned: bool):
    """Where freed blocks are returned (`returned`: a budget on the CPU), let glibc keep blocks up to 32 MiB for
    reuse while the rollout runs, then return them and trim the heap. A decode step allocates the same blocks over
    and over (at 4096 tokens each layer's attention scores, ~1.2 MiB for 8 rows): unmapped at each free, every one
    page-faults anew when allocated again, which made a row-step 2.7x slower under a budget. The rollout's peak is
    its KV cache, which no free lowers, so keeping its blocks costs no peak; the training pass after it starts from
    a trimmed heap."""
    if not returned:
        yield
        return
    return_freed_blocks(GENERATION_MMAP_THRESHOLD)
    try:
        yield
    finally:
        return_freed_blocks()
        trim_heap()


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
    head_chunk: int | None = None  # positions a LM-head block holds under a budget; None: trainer.logprob_chunk_size
    returns_freed_blocks: bool = False  # under a budget on the CPU: glibc unmaps freed large blocks (apply)

    def micro_batches(self, rollout: Rollout, rows: slice, max_rows: int | None) -> list[slice]:
        """The micro-batches of `rows` of `rollout`: at most `max_rows` rows (trainer.micro_batch_size) and this
        plan's tokens (prompt and completion) each."""
        prompts, completions = real_lengths(rollout, rows)
        return cut(rows, [p + c for p, c in zip(prompts, completions, strict=True)], max_rows, self.micro_batch_tokens)

    def line(self) -> str:
        tokens = f"at most {self.micro_batch_tokens} tokens" if self.micro_batch_tokens else "no token limit"
        checkpointing = "on" if self.checkpointing else "off"
        returned = ", freed blocks returned to the system" if self.returns_freed_blocks else ""
        return (f"trainer.memory_budget_gb={self.budget_gb:g}: micro-batches of {tokens}, activation checkpointing "
                f"{checkpointing}, the LM head {self.head_chunk} positions at a time{returned} (model and engine "
                f"{self.loaded_gb:.1f} GiB with their packed weights; a step's estimated peak "
                f"{self.estimate_gb:.1f} GiB)")

    def generating(self):
        """The context a rollout runs in: with freed blocks returned, glibc keeps them while it generates
        (keeping_freed_blocks_while_generating); otherwise nothing changes."""
        return keeping_freed_blocks_while_generating(self.returns_freed_blocks)

    def apply(self, model) -> None:
        """Turns on what the plan chose for `model`: activation checkpointing, and glibc returning freed blocks; a
        budget's plan says what it chose, in one line of information (errors.inform: the run's console)."""
        if self.budget_gb is not None:
            inform(self.line())
        if self.checkpointing:
            enable_activation_checkpointing(model)
        if self.returns_freed_blocks:
            return_freed_blocks()


def plan(tcfg: TrainerConfig, lm, engine=None, *, rows: int, longest_row: int, chunk_size: int | None) -> MemoryPlan:
    """The micro-batch token limit and checkpointing for trainer section `tcfg` (its micro_batch_tokens,
    gradient_checkpointing, memory_budget_gb) and the loaded model `lm`. `rows`: completions a step generates on
    this rank; `longest_row`: the most tokens (prompt + completion) one row can have. What the model and `engine` (a
    rollout Engine) hold is read off the process, plus what their weights will take once packed (model.prepack packs
    lazily, at the first product). Without a budget the settings stand as given. With one, the LM head goes
    BUDGET_HEAD_CHUNK positions at a time (or chunk_size, if fewer), glibc returns freed blocks on the CPU, and the
    largest micro-batch that fits is taken (no more than micro_batch_tokens when that is a number; auto leaves it to
    the budget), without checkpointing if one whole row fits so, else with it; a budget that cannot hold one row even
    checkpointed is a ConfigError naming the knobs."""
    budget = tcfg.memory_budget_gb
    allocator.check_budget(budget, lm.device.type)
    if budget is None:
        return MemoryPlan(micro_batch_tokens(tcfg.micro_batch_tokens, lm.device), bool(tcfg.gradient_checkpointing))
    tokens = None if tcfg.micro_batch_tokens == "auto" else tcfg.micro_batch_tokens  # auto: the budget decides
    config, dtype = lm.model.config, lm.dtype
    packed = [(lm.model, ("forward", "backward"))] + ([] if engine is None else engine.packed_models())
    loaded = in_use_bytes(lm.device) + prepack.pending_bytes(*packed)
    vocab = lm.model.get_output_embeddings().weight.shape[0]
    head_chunk = min(chunk_size or BUDGET_HEAD_CHUNK, BUDGET_HEAD_CHUNK)
    head = HEAD_BLOCKS * min(head_chunk, longest_row) * vocab * 4.0
    returned = lm.device.type == "cpu" and _mallopt() is not None  # the start-up line says so only where it happens
    room = budget * GIB * 0.95 - loaded - head  # 5 %: what the estimate does not see (records, the optimizer step)
    generation = kv_cache_bytes(config, dtype, rows, longest_row)
    for checkpointing in (bool(tcfg.gradient_checkpointing), True):
        per_token = activation_bytes_per_token(config, dtype, checkpointing)
        fits = int(room // per_token) if room > 0 else 0
        if fits >= longest_row and budget * GIB * 0.95 >= loaded + generation:
            chosen = fits if tokens is None else min(tokens, fits)
            estimate = loaded + max(generation, head + chosen * per_token)
            return MemoryPlan(chosen, checkpointing, budget, loaded / GIB, estimate / GIB, head_chunk, returned)
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
