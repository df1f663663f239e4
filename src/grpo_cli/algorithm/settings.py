"""The ``algo.*`` settings as the trainer reads them: which loss type, the :class:`LossSettings` of
:func:`policy_loss`, whether entropy is needed, and the combinations of keys that make no sense.
"""

from grpo_cli.algorithm.advantages import ADVANTAGES
from grpo_cli.algorithm.entropy import AdaptiveEntropy
from grpo_cli.algorithm.loss import LossSettings
from grpo_cli.algorithm.policy_losses import OBJECTIVES, ObjectiveOptions


def aggregation_of(algo) -> str:
    """The loss type of ``algo`` (its typed view or validated config): ``algo.aggregation``, or its alias ``algo.loss_type`` (TRL's name)
    when aggregation is left at the default."""
    aggregation = algo.aggregation
    return aggregation if aggregation != "grpo" else algo.loss_type


def loss_settings(algo, entropy_coef: float | None = None) -> LossSettings:
    """The :class:`LossSettings` of ``algo``; ``entropy_coef`` overrides algo.entropy_coef (the adaptive value)."""
    eps_high = algo.clip_eps_high if algo.clip_eps_high is not None else algo.clip_eps
    options = ObjectiveOptions(
        eps_low=algo.clip_eps, eps_high=eps_high, delta=algo.delta,
        cispo_max_ratio=algo.cispo_max_ratio,
        sapo_temperature_pos=algo.sapo_temperature_pos,
        sapo_temperature_neg=algo.sapo_temperature_neg,
        **{k: getattr(algo, k) for k in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")})
    return LossSettings(
        objective=algo.objective, options=options, kl_estimator=algo.kl_estimator,
        use_bias_correction_kl=bool(algo.use_bias_correction_kl),
        off_policy_mask_threshold=algo.off_policy_mask_threshold,
        top_entropy_quantile=algo.top_entropy_quantile,
        entropy_coef=algo.entropy_coef if entropy_coef is None else entropy_coef)


def needs_entropy(algo) -> bool:
    """Whether every pass (not only the first, for the metric) needs the per-token entropy."""
    return (algo.top_entropy_quantile < 1.0 or bool(algo.entropy_coef)
            or algo.entropy_target is not None)


def adaptive_entropy(algo) -> AdaptiveEntropy | None:
    target = algo.entropy_target
    if target is None:
        return None
    return AdaptiveEntropy(coef=algo.entropy_coef, target=target, delta=algo.entropy_coef_delta)


def config_problem(algo, world_size: int = 1) -> tuple[str, object, str] | None:
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
    entry = OBJECTIVES.get(objective)
    if entry is not None and algo.ratio_level not in entry.ratio_levels:
        return ("algo.ratio_level", algo.ratio_level, f"does not suit algo.objective={objective}: use "
                                                      f"algo.ratio_level={entry.ratio_levels[0]}")
    if entry is not None and entry.aggregations is not None and aggregation_of(algo) not in entry.aggregations:
        return ("algo.aggregation", aggregation_of(algo), f"does not suit algo.objective={objective}: use "
                                                          f"algo.aggregation={entry.aggregations[0]}")
    advantage = ADVANTAGES.get(algo.advantage)
    if advantage is not None and not advantage.scales and algo.scale_rewards != "group":
        return ("algo.scale_rewards", algo.scale_rewards, f"is read by algo.advantage=grpo or grpo_passk only, not "
                                                          f"{advantage.name}; leave it at group")
    delta, eps_high = algo.delta, algo.clip_eps_high if algo.clip_eps_high is not None else algo.clip_eps
    if delta is not None and delta <= 1 + eps_high:
        return ("algo.delta", delta, f"needs delta > 1 + clip_eps_high ({1 + eps_high}) or the upper clip never acts")
    if algo.entropy_target is not None and algo.entropy_coef > 1.0:
        return ("algo.entropy_coef", algo.entropy_coef, "needs <= 1 with algo.entropy_target (the adaptive bound)")
    return None

