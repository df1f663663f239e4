#!/usr/bin/env python
"""Peak memory of one row's forward+backward through the LoRA policy (the embedded SmolLM2-135M, fp32, r=16 on all
linear layers, one thread): what the table of docs/results/long-completions.md, "Under a memory budget", reports
(and docs/usage.md's under "Why a budget changes the allocator on the CPU").

    python scripts/probe_row_memory.py 2048 gc 256   # T tokens, checkpointing on (nogc: off), head blocks (1024)
    MALLOC_MMAP_THRESHOLD_=1048576 python scripts/probe_row_memory.py 2048 gc 256  # glibc returning freed blocks,
                                                                                  # as trainer.memory_budget_gb sets

A warm-up pass packs the weights first (model.prepack). It prints the process's peak RSS before, after the decoder,
after the LM head's log-prob pass and after the backward, and the peak's growth per token. Run each setting in a
fresh process (ru_maxrss only grows).
"""

import resource
import sys
import time

import torch

from grpo_cli import algorithm
from grpo_cli.model.loading import attach_lora, enable_activation_checkpointing, load_base_model, load_tokenizer


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    T, checkpointing = int(sys.argv[1]), sys.argv[2] == "gc"
    chunk = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
    torch.set_num_threads(1)
    name = "embedded:smollm2-135m"
    base = load_base_model(name, load_tokenizer(name), torch.float32)
    model = attach_lora(base, 16, 32, 0.0, "all-linear")
    if checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    head = model.get_output_embeddings()

    def decoder(ids):
        return model.get_base_model().get_decoder()(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None],
                                                    use_cache=False).last_hidden_state

    warm = torch.zeros(1, 16, dtype=torch.long)  # packs the weights (model.prepack) before the measurement
    algorithm.head_token_logprobs(decoder(warm), head.weight, warm, chunk_size=chunk)[0].sum().backward()
    ids = torch.randint(0, base.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    before, start = peak_mib(), time.perf_counter()
    hidden = decoder(ids)
    after_decoder = peak_mib()
    logp, _ = algorithm.head_token_logprobs(hidden, head.weight, ids, chunk_size=chunk)
    after_head = peak_mib()
    logp.sum().backward()
    peak = peak_mib()
    print(f"T={T} checkpointing={checkpointing} head chunk {chunk}: peak RSS before {before:.0f} MiB, "
          f"after the decoder {after_decoder:.0f}, after the head {after_head:.0f}, after the backward {peak:.0f}: "
          f"{(peak - before) / T:.2f} MiB a token, "
          f"{time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
