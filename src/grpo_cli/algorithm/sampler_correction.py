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


def sampler_mismatch_stats(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                           weights: torch.Tensor | None, mode: str) -> dict[str, float]:
    """``sampler/logp_diff_mean`` and ``_max``: |trainer - sampler| over the completion tokens (NaN left out);
    ``sampler/corrected_frac``: the share of tokens (token_*) or sequences (sequence_*) whose weight the bounds
    changed (masked to 0, or truncated)."""
    real = mask.bool()
    delta = (trainer_logp.detach().float() - sampler_logp.float()).abs()[real]
    delta = delta[~torch.isnan(delta)]
    stats = {"sampler/logp_diff_mean": float(delta.mean()) if delta.numel() else 0.0,
             "sampler/logp_diff_max": float(delta.max()) if delta.numel() else 0.0, "sampler/corrected_frac": 0.0}
    if weights is not None:
        raw = sampler_correction_weights(trainer_logp, sampler_logp, mask, mode.split("_")[0] + "_truncate",
                                         clip_min=None, clip_max=None)  # the weights before any bound
        changed = weights != raw
        chosen = changed[real] if mode.startswith("token") else changed[real.any(dim=-1)].flatten()
        stats["sampler/corrected_frac"] = float(chosen.float().mean()) if chosen.numel() else 0.0
    return stats


@dataclass
class SamplerCorrection:
    """``algo.sampler_correction`` as the trainer applies it: the weights of each micro-batch, and the mismatch
    metrics of the step's first pass, averaged over its micro-batches (this rank's)."""

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
            self.recorded.append(sampler_mismatch_stats(trainer_logp, sampler_logp, mask, w, self.mode))
        return w

    def metrics(self) -> dict[str, float]:
        """The recorded stats (a mean over micro-batches; the max of the maxima), then forgotten."""
        done, self.recorded = self.recorded or [], []
        if not done:
            return {}
        out = {k: sum(s[k] for s in done) / len(done) for k in done[0]}
        out["sampler/logp_diff_max"] = max(s["sampler/logp_diff_max"] for s in done)
        return out
