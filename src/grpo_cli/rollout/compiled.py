"""The `compiled` engine: transformers' generate on a merged inference copy of the policy, with a static KV
cache sized once and (on CUDA) the decode step compiled by transformers (torch.compile, CUDA graphs).

What it changes against `hf`, and why (measured on an H200: docs/results/speed-against-trl.md):
- no per-layer LoRA detour: the adapter is merged into a separate copy of the LoRA-wrapped weights
  (`InferenceCopy`), refreshed lazily before the first generation after `policy_changed()`;
- a static cache of `rows x (longest prompt + max_new_tokens)`, allocated once per shape and reset between
  calls, so every decode step has the same shapes and the compiled step is captured once;
- the prompts are prefilled per completion row (the static cache has one row per completion), not once per
  group: prefill is a few percent of a rollout on a GPU, and the cache trick needs a dynamic cache.
Sampling is transformers' own (temperature, top_p, top_k, min_p, repetition_penalty, min_new_tokens, EOS, stop
strings), from the caller-seeded global RNG: the same tokens as `hf` at the same seed.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from grpo_cli.base.errors import error_line, warn
from grpo_cli.config.schema import RolloutConfig
from grpo_cli.rollout.common import (
    ENGINES,
    Engine,
    Rollout,
    SamplingParams,
    StopFn,
    cache_kwarg,
    eos_ids,
    finish_rollout,
    left_pad,
    stop_criteria,
)
from grpo_cli.rollout.inference_copy import FollowsThePolicy

if TYPE_CHECKING:
    from transformers import StaticCache

log = logging.getLogger(__name__)
WARMUP_TOKENS = 4   # decode steps of the timed first call: compile, CUDA-graph warm-up, record, replay
MAX_CACHES = 2      # static caches kept (training rows, evaluation rows); the least recently used goes


@ENGINES.register("compiled")
class CompiledEngine(FollowsThePolicy, Engine):
    name = "compiled"

    def __init__(self, model, tokenizer, device: torch.device, *, compile: bool, max_prompt_tokens: int | None = None,
                 compile_fallback: bool = False, compile_backend: str = "inductor"):
        self.tokenizer, self.device = tokenizer, device
        self.compile = compile
        # rollout.compile=auto: a decode step that fails to compile (no Triton, an unsupported op) costs the speed-up,
        # not the run; with rollout.compile=true it is an error
        self.compile_fallback, self.compile_backend = compile_fallback, compile_backend
        self.max_prompt_tokens = max_prompt_tokens or 0
        self.follow(model, self.name)
        self.caches: OrderedDict[tuple[int, int], StaticCache] = OrderedDict()  # (rows, length) -> its cache
        self.compile_s = 0.0

    @classmethod
    def from_config(cls, cfg_rollout: RolloutConfig, lm, max_prompt_tokens: int | None = None) -> CompiledEngine:
        """`rollout.compile` (auto | true | false; auto = on CUDA only, and a failed compile only warns)."""
        setting = cfg_rollout.compile
        compile_ = lm.device.type == "cuda" if setting == "auto" else bool(setting)
        return cls(lm.model, lm.tokenizer, lm.device, compile=compile_, max_prompt_tokens=max_prompt_tokens,
                   compile_fallback=setting == "auto")

    # ---- the seam ---------------------------------------------------------------------------------
    def close(self) -> None:
        self.caches.clear()
        self.drop_copy()

    def generate(self, prompt_ids: list[list[int]], num_generations: int, sampling: SamplingParams,
                 stop: StopFn | None = None) -> Rollout:
        """See Engine.generate."""
        model = self.inference_model()
        max_new_tokens, stop_strings = sampling.max_new_tokens, sampling.stop_strings
        ids, mask = left_pad(prompt_ids, self.tokenizer.pad_token_id, self.device)
        rows = ids.shape[0] * num_generations
        key, fresh = self.cache_for(model.config, rows, max(ids.shape[1], self.max_prompt_tokens) + max_new_tokens)
        cache = self.caches[key]
        row_ids = ids.repeat_interleave(num_generations, dim=0)
        row_mask = mask.repeat_interleave(num_generations, dim=0)
        if key[0] > rows:  # a larger cache already compiled: fill the spare rows with copies of the last one
            spare = key[0] - rows
            row_ids = torch.cat([row_ids, row_ids[-1:].expand(spare, -1)])
            row_mask = torch.cat([row_mask, row_mask[-1:].expand(spare, -1)])
        eos = eos_ids(model, self.tokenizer)
        common = {"input_ids": row_ids, "attention_mask": row_mask, cache_kwarg(model): cache,
                  "pad_token_id": self.tokenizer.pad_token_id, "eos_token_id": eos, **self.compile_kwargs()}
        was_training = model.training
        model.eval()
        try:
            if fresh and self.compile:
                try:
                    self.warm_up(model, key, common, max_new_tokens)
                except Exception as err:
                    if not self.compile_fallback:
                        raise
                    self.stop_compiling(err)
                    common.update(self.compile_kwargs())
            cache.reset()
            criteria, fired = stop_criteria(stop, stop_strings, self.tokenizer, ids.shape[1])
            out = model.generate(**common, stopping_criteria=criteria, **sampling.generate_kwargs(self.device))
        finally:
            model.train(was_training)
        return finish_rollout(self.tokenizer, eos, ids, mask, out[:rows, ids.shape[1]:], num_generations, fired(),
                              stop_strings)

    # ---- parts ------------------------------------------------------------------------------------
    def cache_for(self, config, rows: int, length: int) -> tuple[tuple[int, int], bool]:
        """The smallest kept cache with enough rows and length (spare rows are padding), else a new one."""
        from transformers import StaticCache

        fits = [k for k in self.caches if k[0] >= rows and k[1] >= length]
        if fits:
            key = min(fits)
            self.caches.move_to_end(key)
            return key, False
        while len(self.caches) >= MAX_CACHES:
            self.caches.popitem(last=False)
        key = (rows, length)
        self.caches[key] = StaticCache(config=config, max_cache_len=length)
        return key, True

    def compile_kwargs(self) -> dict:
        if not self.compile:
            return {"disable_compile": True}
        from transformers import CompileConfig

        if self.device.type == "cuda":
            return {"compile_config": CompileConfig(mode="reduce-overhead", backend=self.compile_backend)}
        # no CUDA graphs off CUDA; transformers compiles on CUDA only unless told
        config = CompileConfig(mode="default", backend=self.compile_backend)
        config._compile_all_devices = True  # type: ignore[assignment]  # transformers declares it `= None`, untyped
        return {"compile_config": config}

    def stop_compiling(self, err: BaseException) -> None:
        warn(f"rollout.compile=auto: compiling the decode step failed ({error_line(err)[:240]}); generating uncompiled "
             "from here (set rollout.compile=false to skip the attempt, rollout.compile=true to make it an error)")
        self.compile = False
        torch._dynamo.reset()

    def warm_up(self, model, key: tuple[int, int], common: dict, max_new_tokens: int) -> None:
        """A short greedy generation on a new cache shape, timed: compiling and capturing the decode step
        happens here, once, and not inside a measured rollout. The RNG is left as it was (exact resume)."""
        devices = [torch.cuda.current_device() if self.device.index is None else self.device.index] \
            if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            t0 = time.perf_counter()
            self.caches[key].reset()
            steps = min(WARMUP_TOKENS, max_new_tokens)
            model.generate(**common, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - t0
        self.compile_s += seconds
        log.info("rollout.engine=compiled: compiled the decode step for %d rows x %d cache positions in %.1f s",
                 *key, seconds)
