"""The `merged` engine (the CPU default): transformers' generate as in `hf`, each prompt prefilled once and its KV
cache repeated for its G completions, but on a merged inference copy of the policy instead of the peft model, so
that no decode step takes the per-layer LoRA detour (two small matmuls, a scale and an add in each adapted layer).
On the CPU the copy's layers run on prepacked weights too (model.prepack), packed again after each refresh.
"""

from __future__ import annotations

import time

from grpo_cli.rollout.common import ENGINES
from grpo_cli.rollout.hf import HFEngine, generate
from grpo_cli.rollout.inference_copy import InferenceCopy


@ENGINES.register("merged")
class MergedEngine(HFEngine):
    """`hf`'s generation on an InferenceCopy, refreshed lazily before the first generation after `policy_changed()`
    (the refresh's seconds are the step's `gen_sync_s`). A plain model (grpo-eval of a base) is used as it is."""

    name = "merged"

    def __init__(self, model, tokenizer, device=None):
        super().__init__(model, tokenizer, device)
        self.copy = InferenceCopy(model, engine=self.name) if hasattr(model, "get_base_model") else None
        self.stale = True  # refreshed at the first generation: after a checkpoint's adapter is loaded

    def policy_changed(self) -> None:
        self.stale = True

    def close(self) -> None:
        self.copy = None

    def generate(self, prompt_ids: list[list[int]], num_generations: int, **options):
        """See Engine.generate for the options."""
        return generate(self.inference_model(), self.tokenizer, prompt_ids, num_generations=num_generations,
                        device=self.device, **options)

    def inference_model(self):
        if self.copy is None:
            return self.model
        t0 = time.perf_counter()
        if self.stale:
            self.copy.refresh()
            self.stale = False
        self.sync_s = time.perf_counter() - t0
        return self.copy.model
