"""The `merged` engine (the CPU default): transformers' generate as in `hf`, each prompt prefilled once and its KV
cache repeated for its G completions, but on a merged inference copy of the policy instead of the peft model, so
that no decode step takes the per-layer LoRA detour (two small matmuls, a scale and an add in each adapted layer).
On the CPU the copy's layers run on prepacked weights too (model.prepack), packed again after each refresh, and
hold nothing else: the copy is lean (InferenceCopy), let go while the policy trains and rebuilt for the next rollout.
"""

from __future__ import annotations

from dataclasses import asdict

from grpo_cli.rollout.common import ENGINES, SamplingParams, StopFn
from grpo_cli.rollout.hf import HFEngine, generate
from grpo_cli.rollout.inference_copy import FollowsThePolicy


@ENGINES.register("merged")
class MergedEngine(FollowsThePolicy, HFEngine):
    """`hf`'s generation on an InferenceCopy, refreshed before the first generation after `policy_changed()`."""

    name = "merged"

    def __init__(self, model, tokenizer, device=None):
        super().__init__(model, tokenizer, device)
        self.follow(model, self.name, lean=True)

    def close(self) -> None:
        self.drop_copy()

    def generate(self, prompt_ids: list[list[int]], num_generations: int, sampling: SamplingParams,
                 stop: StopFn | None = None):
        """See Engine.generate."""
        return generate(self.inference_model(), self.tokenizer, prompt_ids, num_generations=num_generations,
                        device=self.device, stop=stop, **asdict(sampling))
