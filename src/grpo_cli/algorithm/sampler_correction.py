"""Sampler correction (``algo.sampler_correction``, docs/algorithm.md section 3): the sampling engine (vLLM) and
the trainer compute different log-probs for the same tokens; TRL 1.16's ``vllm_importance_sampling_mode`` weighs
each token's policy term by their ratio.
"""

import math
from dataclasses import dataclass, field

import torch

SAMPLER_CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def sampler_correction_weights(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, mode: str,
                               clip_min: float | None = None, clip_max: float | None = 3.0) -> torch.Tensor | None:
    """Importance weights of TRL 1.16's ``vllm_importance_sampling_mode`` (None for ``none``), detached, that
    multiply the policy term of each token (not the KL term)::

        d_{i,t} = m * (trainer - sampler)           (NaN sampler log-probs count as d = 0)
        w       = exp(d_{i,t})        [B, T]        token_*
                  exp(sum_t d_{i,t})  [B, 1]        sequence_*
        *_truncate: w clamped to [clip_min, clip_max];  *_mask: w = 0 outside [clip_min, clip_max]

    ``trainer_logp`` is the trainer's log-prob of the policy that sampled (the old log-probs), ``sampler_logp``
    the engine's own; a bound of None is open."""
    if mode not in SAMPLER_CORRECTIONS:
        raise ValueError(f"sampler correction {mode!r} is not one of {', '.join(SAMPLER_CORRECTIONS)}")
    if mode == "none":
        return None
    diff = torch.nan_to_num((trainer_logp.detach().float() - sampler_logp.float()) * mask.float(), nan=0.0)
    weights = torch.exp(diff.sum(dim=-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        return weights if clip_min is None and clip_max is None else torch.clamp(weights, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return weights.masked_fill((weights < low) | (weights > high), 0.0)


@dataclass
class MismatchSums:
    """Sums behind the sampler metrics, so that micro-batches add up to token (or sequence) means of the step."""

    diff_sum: float = 0.0       # sum of |trainer - sampler| over the scored completion tokens
    diff_count: float = 0.0     # how many
    diff_max: float = 0.0
    corrected: float = 0.0      # tokens (token_*) or sequences (sequence_*) whose weight a bound changed
    weighed: float = 0.0        # tokens or sequences weighed

    def __add__(self, other: "MismatchSums") -> "MismatchSums":
        return MismatchSums(self.diff_sum + other.diff_sum, self.diff_count + other.diff_count,
                            max(self.diff_max, other.diff_max), self.corrected + other.corrected,
                            self.weighed + other.weighed)

    def stats(self) -> dict[str, float]:
        return {"sampler/logp_diff_mean": self.diff_sum / self.diff_count if self.diff_count else 0.0,
                "sampler/logp_diff_max": self.diff_max,
                "sampler/corrected_frac": self.corrected / self.weighed if self.weighed else 0.0}


def mismatch_sums(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                  weights: torch.Tensor | None, mode: str) -> MismatchSums:
    """The sums of :func:`sampler_mismatch_stats` for one micro-batch."""
    real = mask.bool()
    delta = (trainer_logp.detach().float() - sampler_logp.float()).abs()[real]
    delta = delta[~torch.isnan(delta)]
    sums = MismatchSums(float(delta.sum()), float(delta.numel()), float(delta.max()) if delta.numel() else 0.0)
    if weights is not None:
        raw = sampler_correction_weights(trainer_logp, sampler_logp, mask, mode.split("_")[0] + "_truncate",
                                         clip_min=None, clip_max=None)  # the weights before any bound
        assert raw is not None  # a *_truncate mode always weighs
        changed = weights != raw
        chosen = changed[real] if mode.startswith("token") else changed[real.any(dim=-1)].flatten()
        sums.corrected, sums.weighed = float(chosen.sum()), float(chosen.numel())
    return sums


def sampler_mismatch_stats(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                           weights: torch.Tensor | None, mode: str) -> dict[str, float]:
    """``sampler/logp_diff_mean`` and ``_max``: |trainer - sampler| over the completion tokens (NaN left out);
    ``sampler/corrected_frac``: the share of tokens (token_*) or sequences (sequence_*) whose weight the bounds
    changed (masked to 0, or truncated)."""
    return mismatch_sums(trainer_logp, sampler_logp, mask, weights, mode).stats()


@dataclass
class SamplerCorrection:
    """``algo.sampler_correction`` as the trainer applies it: the weights of each micro-batch, and the mismatch
    metrics of the step's first pass over all its micro-batches (this rank's): token means, not means of means."""

    mode: str = "none"
    clip_min: float | None = None
    clip_max: float | None = 3.0
    recorded: list = field(default_factory=list)

    @classmethod
    def of(cls, algo) -> "SamplerCorrection":
        return cls(algo.sampler_correction, algo.sampler_clip_min, algo.sampler_clip_max, [])

    def weights(self, logp, old, sampler_logprobs, rows: slice, mask, record: bool) -> torch.Tensor | None:
        """The weights for the micro-batch `rows` (its log-probs `logp`; `old`: the batch's old log-probs, None
        on-policy) of a rollout whose sampler log-probs are `sampler_logprobs` (None without correction, or without
        the sampler's log-probs: an engine sampling with the trainer's own numerics); `record`: keep its mismatch
        stats for `metrics`."""
        if sampler_logprobs is None:
            return None
        trainer_logp = logp.detach() if old is None else old[rows]
        sampler_logp = sampler_logprobs[rows].to(trainer_logp.device)
        w = sampler_correction_weights(trainer_logp, sampler_logp, mask, self.mode, self.clip_min, self.clip_max)
        if record:
            self.recorded.append(mismatch_sums(trainer_logp, sampler_logp, mask, w, self.mode))
        return w

    def metrics(self) -> dict[str, float]:
        """The recorded micro-batches' stats, pooled (token means over all of them; the max of the maxima), then
        forgotten."""
        done, self.recorded = self.recorded or [], []
        return sum(done[1:], done[0]).stats() if done else {}
