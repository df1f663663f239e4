"""Entropy controls (docs/algorithm.md sections 3 and 5): the high-entropy token mask
(``algo.top_entropy_quantile``) and the adaptive entropy coefficient (``algo.entropy_target``). The per-token
entropy itself comes with the log-probs (:mod:`grpo_cli.algorithm.logprobs`); the bonus is added in
:func:`grpo_cli.algorithm.loss.policy_loss`.
"""

import math
from dataclasses import dataclass

import torch


def high_entropy_mask(entropy: torch.Tensor, real: torch.Tensor, quantile: float) -> torch.Tensor:
    """The real tokens whose entropy is at least the ``1 - quantile`` quantile of this micro-batch's real tokens
    (``top_entropy_quantile``: the share kept)."""
    values = entropy.detach()[real].float()
    if values.numel() == 0:
        return torch.zeros_like(real)
    threshold = torch.quantile(values, 1.0 - quantile)
    return (entropy.detach() * real.float() >= threshold) & real


@dataclass
class AdaptiveEntropy:
    """``algo.entropy_target``: the entropy coefficient as a controller (TRL's use_adaptive_entropy). After each
    optimizer update with token-mean entropy ``H``: ``coef += delta`` when ``H <= target``, else ``coef -= delta``,
    within ``[0, coef_max]``; the bonus applies (with the coefficient of the previous update) only while the last
    measured ``H <= target``."""

    coef: float
    target: float
    delta: float
    coef_max: float = 1.0
    last_entropy: float = math.inf

    @property
    def applied(self) -> float:
        return self.coef if self.last_entropy <= self.target else 0.0

    def update(self, entropy: float) -> None:
        step = self.delta if entropy <= self.target else -self.delta
        self.coef = min(max(self.coef + step, 0.0), self.coef_max)
        self.last_entropy = entropy

    def state(self) -> dict:
        return {"entropy_coef": self.coef, "last_entropy": self.last_entropy}

    def restore(self, state: dict) -> None:
        self.coef = float(state.get("entropy_coef", self.coef))
        self.last_entropy = float(state.get("last_entropy", self.last_entropy))
