"""The ``algo.*`` settings as the trainer reads them: the :class:`LossSettings` of :func:`policy_loss`, whether
entropy is needed, the adaptive entropy coefficient, and the combinations of keys that make no sense. ``algo`` is
the typed config's section (schema.AlgoConfig), whose properties give the derived values (the upper clip bound,
the loss type in use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo_cli.algorithm.advantages import ADVANTAGES
from grpo_cli.algorithm.entropy import AdaptiveEntropy
from grpo_cli.algorithm.loss import LossSettings
from grpo_cli.algorithm.policy_losses import OBJECTIVES, ObjectiveOptions

if TYPE_CHECKING:
    from grpo_cli.config.schema import AlgoConfig


def loss_settings(algo: AlgoConfig, max_new_tokens: int | None = None) -> LossSettings:
    """The :class:`LossSettings` of ``algo``; ``max_new_tokens`` (rollout.max_new_tokens) is dr_grpo's normaliser.
    The adaptive entropy coefficient replaces its ``entropy_coef`` as it moves (AdaptiveEntropy)."""
    vespo = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
    options = ObjectiveOptions(
        eps_low=algo.clip_eps, eps_high=algo.eps_high, delta=algo.delta, cispo_max_ratio=algo.cispo_max_ratio,
        sapo_temperature_pos=algo.sapo_temperature_pos, sapo_temperature_neg=algo.sapo_temperature_neg,
        **{k: getattr(algo, k) for k in vespo})
    return LossSettings(
        beta=algo.beta, options=options, loss_type=algo.effective_aggregation, ratio_level=algo.ratio_level,
        max_new_tokens=max_new_tokens, objective=algo.objective, kl_estimator=algo.kl_estimator,
        use_bias_correction_kl=algo.use_bias_correction_kl, off_policy_mask_threshold=algo.off_policy_mask_threshold,
        top_entropy_quantile=algo.top_entropy_quantile, entropy_coef=algo.entropy_coef)


def needs_reference(algo: AlgoConfig) -> bool:
    """Whether the loss reads the reference policy's log-probs (the frozen base's: a KL term, algo.beta > 0); the
    trainer and the rollout worker ask before they make that pass."""
    return algo.beta > 0


def needs_entropy(algo: AlgoConfig) -> bool:
    """Whether every pass (not only the first, for the metric) needs the per-token entropy."""
    return algo.top_entropy_quantile < 1.0 or bool(algo.entropy_coef) or algo.entropy_target is not None


def adaptive_entropy(algo: AlgoConfig) -> AdaptiveEntropy | None:
    target = algo.entropy_target
    if target is None:
        return None
    return AdaptiveEntropy(coef=algo.entropy_coef, target=target, delta=algo.entropy_coef_delta)


def config_problem(algo: AlgoConfig, world_size: int = 1) -> tuple[str, object, str] | None:
    """(key, value, what is wrong) for a combination of algo.* keys that makes no sense (or is not supported), else
    None."""
    if algo.filter_groups and world_size > 1:
        return ("algo.filter_groups", True, f"is not supported over {world_size} ranks yet (each rank would keep a "
                                            "different number of groups); use trainer.nproc=1")
    loss_type, aggregation = algo.loss_type, algo.aggregation
    if loss_type != "grpo" and aggregation != "grpo" and loss_type != aggregation:
        return ("algo.loss_type", loss_type, f"is an alias of algo.aggregation, which says {aggregation}; set only "
                                             "algo.aggregation")
    objective = algo.objective
    entry = OBJECTIVES.get(objective)  # a registry: a plain dict of names
    if entry is not None and algo.ratio_level not in entry.ratio_levels:
        return ("algo.ratio_level", algo.ratio_level, f"does not suit algo.objective={objective}: use "
                                                      f"algo.ratio_level={entry.ratio_levels[0]}")
    in_use = algo.effective_aggregation
    if entry is not None and entry.aggregations is not None and in_use not in entry.aggregations:
        return ("algo.aggregation", in_use, f"does not suit algo.objective={objective}: use "
                                            f"algo.aggregation={entry.aggregations[0]}")
    advantage = ADVANTAGES.get(algo.advantage)
    if advantage is not None and not advantage.scales and algo.scale_rewards != "group":
        return ("algo.scale_rewards", algo.scale_rewards, f"is read by algo.advantage=grpo or grpo_passk only, not "
                                                          f"{advantage.name}; leave it at group")
    if algo.delta is not None and algo.delta <= 1 + algo.eps_high:
        return ("algo.delta", algo.delta, f"needs delta > 1 + clip_eps_high ({1 + algo.eps_high}) or the upper "
                                          "clip never acts")
    if algo.entropy_target is not None and algo.entropy_coef > 1.0:
        return ("algo.entropy_coef", algo.entropy_coef, "needs <= 1 with algo.entropy_target (the adaptive bound)")
    return None
