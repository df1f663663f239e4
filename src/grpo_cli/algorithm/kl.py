"""KL estimators (``algo.kl_estimator``, docs/algorithm.md section 3): per-token estimates of KL(pi || ref) from
``d = ref - logp`` (http://joschu.net/blog/kl-approx.html). Each is one function registered in
:data:`KL_ESTIMATORS` with :func:`register_kl_estimator`, its formula beside it.

``k1``, ``k2`` and ``abs`` are verl's ``kl_penalty`` of those names; ``k3`` is TRL's and the contract's, unclamped.
verl's own ``k3`` is an alias of its clamped ``low_var_kl``, which is ours ``low_var_kl``.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_cli.base.registry import Registry


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || ref), elementwise::

        kl = exp(ref - logp) - (ref - logp) - 1   (>= 0; exactly 0 where ref == logp)

    Computed as ``expm1(d) - d`` (clamped at 0) so rounding never makes it negative.
    """
    if logp.shape != ref_logp.shape:
        raise ValueError(
            f"ref_logp shape {tuple(ref_logp.shape)} does not match logp shape {tuple(logp.shape)}"
        )
    return k3(ref_logp - logp)


@dataclass(frozen=True)
class KLEstimator:
    """One ``algo.kl_estimator``: ``fn(d) -> kl`` elementwise, with ``d = ref_logp - logp``."""

    name: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    formula: str


KL_ESTIMATORS = Registry("KL estimator", key="algo.kl_estimator")  # name -> KLEstimator


def register_kl_estimator(name: str, *, formula: str) -> Callable:
    """Decorator: register ``fn(d) -> kl`` (``d = ref - logp``, elementwise) as ``algo.kl_estimator=name``."""

    def register(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        KL_ESTIMATORS.register(name)(KLEstimator(name, fn, formula))
        return fn

    return register


@register_kl_estimator("k3", formula="exp(ref - logp) - (ref - logp) - 1")
def k3(d: torch.Tensor) -> torch.Tensor:
    return (torch.expm1(d) - d).clamp_min(0.0)


@register_kl_estimator("k1", formula="logp - ref")
def k1(d: torch.Tensor) -> torch.Tensor:
    return -d


@register_kl_estimator("k2", formula="(logp - ref)^2 / 2")
def k2(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d.square()


@register_kl_estimator("abs", formula="|logp - ref|")
def abs_kl(d: torch.Tensor) -> torch.Tensor:
    return d.abs()


@register_kl_estimator("low_var_kl", formula="clamp(k3 with ref - logp clamped to [-20, 20], -10, 10)  (verl)")
def low_var_kl(d: torch.Tensor) -> torch.Tensor:
    d = d.clamp(-20.0, 20.0)
    return (torch.expm1(d) - d).clamp(-10.0, 10.0)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) by ``estimator`` (a name in :data:`KL_ESTIMATORS`); ``k3`` is
    :func:`kl_k3`."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {tuple(KL_ESTIMATORS)}, got kl_estimator={estimator!r}")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"ref_logp shape {tuple(ref_logp.shape)} does not match logp shape {tuple(logp.shape)}")
    return KL_ESTIMATORS[estimator].fn(ref_logp - logp)


def kl_estimators_table() -> str:
    """The table of KL estimators in docs/algorithm.md, written from the registry."""
    lines = ["| `algo.kl_estimator` | per-token kl |", "|---|---|"]
    lines += [f"| `{e.name}` | `{e.formula}` |" for e in KL_ESTIMATORS.values()]
    return "\n".join(lines)
