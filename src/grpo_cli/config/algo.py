"""The `algo` section: the GRPO objective, its menu (objectives, aggregations, advantage estimators, KL
estimators: docs/algorithm.md) and the sampler correction; one field per option, declared as schema.py declares the
others."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from grpo_cli.config.option_table import option
from grpo_cli.config.rule import (
    integer,
    number,
)
from grpo_cli.config.values import (
    LOSS_TYPE,
    POSITIVE,
    UNIT_OPEN,
    registered,
)


@dataclass(frozen=True, kw_only=True)
class AlgoConfig:
    """algo: the GRPO objective, the objective and aggregation menu (docs/algorithm.md, sections 1, 3 and 4)
    and the sampler correction (TRL's vllm_importance_sampling_*; docs/usage.md "vLLM")."""

    num_generations: int = option("G: completions per prompt (the group)", 8, integer(2))
    beta: float = option("KL coefficient; 0 skips the reference pass", 0.04, number(0))
    clip_eps: float = option("eps_low of the clipped ratio", 0.2, UNIT_OPEN, row="clip")
    clip_eps_high: float | None = option("eps_high; null = clip_eps", None, UNIT_OPEN, row="clip")
    adv_eps: float = option("stability constant in the advantage denominator (1e-4 is usual)", 1.0e-4, UNIT_OPEN)
    scale_rewards: Literal["group", "batch", "none"] = option(
        "advantages divided by the reward std of the group, the batch, or not (Dr. GRPO)", "group")
    loss_type: str = option("how token losses add up (see Loss types); TRL's name, kept as an alias of "
                            "algo.aggregation", "grpo", LOSS_TYPE)
    aggregation: str = option("how token losses add up: the same choices as algo.loss_type, which it overrides "
                              "when not grpo", "grpo", LOSS_TYPE)
    objective: str = option("the per-token policy loss: grpo (clipped surrogate), cispo, sapo, luspo, vespo",
                            "grpo", registered("grpo_cli.algorithm", "OBJECTIVES"))
    advantage: str = option("advantage estimator: grpo (group z-scores), rloo, reinforce_plus_plus_baseline, opo, "
                            "grpo_passk", "grpo", registered("grpo_cli.algorithm", "ADVANTAGES"))
    delta: float | None = option("two-sided clipping: the ratio capped at delta (INTELLECT-2; > 1 + "
                                 "clip_eps_high); null = off", None, number(1, low_open=True))
    cispo_max_ratio: float = option("cispo: cap of the detached ratio (TRL's epsilon_high for cispo)", 5.0,
                                    POSITIVE)
    sapo_temperature_pos: float = option("sapo: gate temperature where A > 0", 1.0, POSITIVE, row="sapo")
    sapo_temperature_neg: float = option("sapo: gate temperature where A <= 0", 1.05, POSITIVE, row="sapo")
    vespo_k_pos: float = option("vespo: gamma shape k where A >= 0", 2.0, number(0), row="vespo")
    vespo_lambda_pos: float = option("vespo: gamma rate lambda where A >= 0", 3.0, number(0), row="vespo")
    vespo_k_neg: float = option("vespo: gamma shape k where A < 0", 3.0, number(0), row="vespo")
    vespo_lambda_neg: float = option("vespo: gamma rate lambda where A < 0", 2.0, number(0), row="vespo")
    kl_estimator: str = option("per-token KL estimate in the beta term; k3 is TRL's and the contract's, "
                               "unclamped (verl's k3 is its clamped low_var_kl)", "k3",
                               registered("grpo_cli.algorithm", "KL_ESTIMATORS"))
    use_bias_correction_kl: bool = option("multiply the KL term by the importance ratio (TRL's default is true; "
                                          "ours false: plain k3)", False)
    off_policy_mask_threshold: float | None = option(
        "drop a sequence with A < 0 whose mean sampler - logp exceeds this (sampler: the engine's log-probs where "
        "it gives them, else old; DeepSeek-V3.2, TRL); null = off", None, number(0))
    top_entropy_quantile: float = option("policy loss on the highest-entropy share of each micro-batch's tokens "
                                         "only; 1 = all", 1.0, number(0, 1, low_open=True))
    entropy_coef: float = option("entropy bonus: loss - coef * token-mean entropy; the start value when "
                                 "entropy_target is set", 0.0, number(0), row="entropy")
    entropy_target: float | None = option("adaptive entropy bonus: coef rises by entropy_coef_delta per update "
                                          "while entropy <= target, falls otherwise; null = fixed coef", None,
                                          number(0), row="entropy")
    entropy_coef_delta: float = option("step of the adaptive entropy coefficient (within [0, 1])", 0.005,
                                       POSITIVE, row="entropy")
    filter_groups: bool = option("dynamic sampling (DAPO): drop groups whose rewards all agree and draw more "
                                 "prompts until data.prompts_per_step groups have signal", False, row="filter")
    filter_max_draws: int = option("generation rounds per step at most with filter_groups; at the bound the step "
                                   "trains on the groups it has", 4, integer(1), row="filter")
    ratio_level: Literal["token", "sequence"] = option("importance ratio per token, or per sequence (GSPO)",
                                                       "token")
    mini_batches: int = option("optimizer updates per rollout batch, on whole groups; 1 (and num_iterations 1) "
                               "= on-policy, clipping never acts", 1, integer(1), row="updates")
    num_iterations: int = option("mu: passes over the mini-batches of one rollout batch", 1, integer(1),
                                 row="updates")
    mask_truncated: bool = option("leave completions that hit max_new_tokens without EOS out of the loss", False)
    check: bool = option("live invariant checks (cheap)", True)
    sampler_correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = (
        option("weigh each token's policy term by exp(trainer - sampler log-prob), per token or summed per "
               "sequence, truncated to or masked outside the clip bounds (rollout.engine=vllm or "
               "rollout.placement=worker or server)", "none"))
    sampler_clip_min: float | None = option("lower bound of the sampler weight; null = none", None, number(0),
                                            row="sampler clip")
    sampler_clip_max: float | None = option("upper bound of the sampler weight; null = none", 3.0, number(0),
                                            row="sampler clip")

    @property
    def eps_high(self) -> float:
        """The upper clip bound: clip_eps_high, or clip_eps where it is null."""
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    @property
    def effective_aggregation(self) -> str:
        """The loss type in use: algo.aggregation, or its alias algo.loss_type (TRL's name) while aggregation is
        left at the default."""
        return self.aggregation if self.aggregation != "grpo" else self.loss_type
