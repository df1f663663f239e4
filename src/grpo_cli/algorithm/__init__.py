"""GRPO algorithm core: pure torch, one function per formula, each family a registry (docs/algorithm.md).

Shapes: ``N = P*G`` completions (rows ``g*G .. g*G+G-1`` share prompt ``g``), ``B`` rows in one (micro-)batch,
``T`` completion positions, ``V`` vocabulary size; ``m`` is the completion mask (1 on real tokens, 0 on padding).

The menu, one module per family::

    advantages.py          algo.advantage      ADVANTAGES        @register_advantage       rewards -> A
    logprobs.py            (the log-prob pass, from the logits or the hidden states)      -> logp, entropy
    kl.py                  algo.kl_estimator   KL_ESTIMATORS     @register_kl_estimator    logp, ref -> kl
    policy_losses.py       algo.objective      OBJECTIVES        @register_objective       ratio, A, logp -> l
    aggregation.py         algo.aggregation    LOSS_TYPES        @register_loss_type       l, m -> loss
    entropy.py             algo.top_entropy_quantile, algo.entropy_target (masks and the adaptive coefficient)
    sampler_correction.py  algo.sampler_correction (TRL's vllm_importance_sampling_*)
    loss.py                policy_loss: the above put together for one micro-batch, with its stats
    settings.py            the algo.* keys as the trainer reads them, and the combinations that make no sense

Adding an objective (or an estimator, a loss type) is one function and its registration line, in a module of
this package or in the user's own (``plugins=[...]``); validation, ``--help`` and the docs tables read the
registries. Everything public is importable from ``grpo_cli.algorithm`` itself.

May import: config, base.
"""

from grpo_cli.algorithm.advantages import (
    ADVANTAGES,
    AdvantageEstimator,
    Scale,
    advantages_of,
    advantages_table,
    group_advantages,
    group_std_mean,
    grpo_advantages,
    grpo_passk_advantages,
    opo_advantages,
    register_advantage,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
    zero_std_group_fraction,
)
from grpo_cli.algorithm.aggregation import (
    LOSS_TYPES,
    Accumulate,
    LossType,
    accumulated,
    accumulation_weight,
    bnpo_loss,
    dapo_loss,
    dr_grpo_loss,
    grpo_loss,
    loss_types_table,
    register_loss_type,
)
from grpo_cli.algorithm.entropy import AdaptiveEntropy, high_entropy_mask
from grpo_cli.algorithm.kl import (
    KL_ESTIMATORS,
    KLEstimator,
    kl_estimate,
    kl_estimators_table,
    kl_k3,
    register_kl_estimator,
)
from grpo_cli.algorithm.logprobs import (
    HeadProducts,
    head_token_logprobs,
    plain_head_products,
    token_logprobs,
    token_logprobs_and_entropy,
)
from grpo_cli.algorithm.loss import LossInputs, LossSettings, policy_loss
from grpo_cli.algorithm.policy_losses import (
    OBJECTIVES,
    RATIO_LEVELS,
    Objective,
    ObjectiveInputs,
    ObjectiveOptions,
    RatioLevel,
    check_objective,
    cispo_objective,
    grpo_objective,
    luspo_objective,
    objectives_table,
    off_policy_keep,
    register_objective,
    sapo_objective,
    vespo_objective,
    vespo_weights,
)
from grpo_cli.algorithm.sampler_correction import (
    SAMPLER_CORRECTIONS,
    SamplerCorrection,
    sampler_correction_weights,
    sampler_mismatch_stats,
)
from grpo_cli.algorithm.settings import (
    adaptive_entropy,
    config_problem,
    loss_settings,
    needs_entropy,
    needs_reference,
)

__all__ = [
    # advantages
    "ADVANTAGES", "AdvantageEstimator", "Scale", "advantages_of", "advantages_table", "group_advantages",
    "group_std_mean", "grpo_advantages", "grpo_passk_advantages", "opo_advantages", "register_advantage",
    "reinforce_plus_plus_baseline_advantages", "rloo_advantages", "zero_std_group_fraction",
    # log-probs
    "HeadProducts", "head_token_logprobs", "plain_head_products", "token_logprobs", "token_logprobs_and_entropy",
    # KL
    "KL_ESTIMATORS", "KLEstimator", "kl_estimate", "kl_estimators_table", "kl_k3", "register_kl_estimator",
    # policy losses
    "OBJECTIVES", "RATIO_LEVELS", "Objective", "ObjectiveInputs", "ObjectiveOptions", "RatioLevel", "check_objective",
    "cispo_objective", "grpo_objective", "luspo_objective", "objectives_table", "off_policy_keep",
    "register_objective", "sapo_objective", "vespo_objective", "vespo_weights",
    # aggregation
    "LOSS_TYPES", "Accumulate", "LossType", "accumulated", "accumulation_weight", "bnpo_loss", "dapo_loss",
    "dr_grpo_loss", "grpo_loss", "loss_types_table", "register_loss_type",
    # entropy, sampler correction, the loss, the settings
    "AdaptiveEntropy", "high_entropy_mask",
    "SAMPLER_CORRECTIONS", "SamplerCorrection", "sampler_correction_weights", "sampler_mismatch_stats",
    "LossInputs", "LossSettings", "policy_loss",
    "adaptive_entropy", "config_problem", "loss_settings", "needs_entropy", "needs_reference",
]
