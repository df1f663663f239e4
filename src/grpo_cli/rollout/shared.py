"""Generation for the jobs of a sweep on one base (hydra/launcher=shared_base). Each job's engine (`JobEngine`) hands
its call to the sweep as a `Request`; the sweep runs every job's request together (`SharedGeneration.run`):

    rollout.engine=hf        the rows of every job that asks with the same options in one batch, each row through its
                             own job's adapter (peft's mixed-adapter batches: adapter_names), each job's rows drawn
                             from its own generator (`JobDraws`): its tokens are those it samples alone, up to the
                             rounding of a wider batch
    merged, compiled, auto   one pass per job on the one engine of the base, the job's adapter active (merged into the
    (and hf with an adapter  engine's one inference copy before the pass): bit for bit what the job generates alone
     peft cannot mix: DoRA)

Either way a request carries its job's torch RNG state at the call (the job has just seeded it for its step) and
returns the state the job alone would have after the call, so that each job draws what it draws alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from grpo_cli.config.schema import RolloutConfig
from grpo_cli.model.loading import LoadedModel
from grpo_cli.rollout.common import ENGINES, Engine, Rollout, SamplingParams, StopFn, eos_ids, stop_criteria
from grpo_cli.rollout.hf import generate
from grpo_cli.rollout.inference_copy import merge_obstacle

if TYPE_CHECKING:
    from peft import PeftModel


@dataclass
class RngState:
    """The torch RNG a job samples from: the CPU generator's state, and the device's where it is CUDA."""

    cpu: torch.Tensor
    device: torch.Tensor | None = None

    @staticmethod
    def now(device: torch.device) -> RngState:
        cuda = device.type == "cuda"
        return RngState(torch.get_rng_state(), torch.cuda.get_rng_state(device) if cuda else None)

    def restore(self, device: torch.device) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            torch.cuda.set_rng_state(self.device, device)

    def generator(self, device: torch.device) -> torch.Generator:
        """A generator in this state, for draws on `device`."""
        generator = torch.Generator(device=device)
        state = self.device if device.type == "cuda" else self.cpu
        assert state is not None  # the state of a job on CUDA, taken there (`now`), holds the device's
        generator.set_state(state)
        return generator

    def after(self, generator: torch.Generator, device: torch.device) -> RngState:
        state = generator.get_state()
        return RngState(self.cpu, state) if device.type == "cuda" else RngState(state, self.device)


@dataclass
class Request:
    """One Engine.generate call of a job: its adapter, prompts, sampling, stop hook, RNG state and policy version (its
    engine's count of policy_changed); the sweep fills `rollout` and `rng_after`, or `error`."""

    adapter: str
    prompt_ids: list[list[int]]
    num_generations: int
    sampling: SamplingParams
    stop: StopFn | None
    rng: RngState
    version: int = 0
    rollout: Rollout | None = None
    rng_after: RngState | None = None
    error: BaseException | None = None

    def batch_key(self) -> tuple:
        """Requests with equal keys can share one generate call: the same sampling (the stop hooks may differ)."""
        return self.num_generations, self.sampling


@dataclass
class JobModel(LoadedModel):
    """A sweep job's adapter on the shared base: the engine made for it (make_engine) hands its generation to
    `submit`, which returns once the request is done."""

    submit: Callable[[Request], None] | None = field(default=None, repr=False)
    shared: SharedGeneration | None = field(default=None, repr=False)


class JobEngine(Engine):
    """The engine of one job of a sweep on one base: each generate call waits for the sweep to run it with the other
    jobs' (see the module docstring)."""

    name = "shared"

    def __init__(self, lm: JobModel):
        super().__init__(lm.model, lm.tokenizer, lm.device)
        self.lm, self.version = lm, 0

    def generate(self, prompt_ids: list[list[int]], num_generations: int, sampling: SamplingParams,
                 stop: StopFn | None = None) -> Rollout:
        request = Request(self.lm.adapter, prompt_ids, num_generations, sampling, stop, RngState.now(self.device),
                          self.version)
        assert self.lm.submit is not None  # job_engine makes a JobEngine only for a job with a sweep to submit to
        self.lm.submit(request)
        if request.rng_after is not None:
            request.rng_after.restore(self.device)
        if request.error is not None:
            raise request.error
        assert request.rollout is not None  # the sweep fills the rollout where no error ended the request
        return request.rollout

    def policy_changed(self) -> None:
        self.version += 1

    def update_begins(self) -> None:
        assert self.lm.shared is not None  # the sweep gives a job its SharedGeneration with its submit
        self.lm.shared.update_begins()


class SharedGeneration:
    """Runs the requests of a sweep's jobs on their shared base `lm` (a peft model holding every job's adapter) under
    the jobs' common `rollout` section. `mixed`: one batch across the adapters (rollout.engine=hf with plain LoRA),
    else one pass per adapter on one engine of the kind rollout.engine names."""

    def __init__(self, lm: LoadedModel, cfg_rollout: RolloutConfig, max_prompt_tokens: int | None = None):
        # a peft model holding every job's adapter
        self.model, self.tokenizer, self.device = cast("PeftModel", lm.model), lm.tokenizer, lm.device
        self.mixed = cfg_rollout.engine == "hf" and merge_obstacle(lm.model) is None
        self.engine = None if self.mixed else ENGINES.lookup(cfg_rollout.engine).from_config(
            cfg_rollout, lm, max_prompt_tokens)
        self.holds: tuple[str, int] | None = None  # (adapter, version) the engine's inference copy was made from

    @property
    def kind(self) -> str:
        """How it generates, for the sweep's line at the start."""
        if self.engine is None:  # mixed
            return "one batch across the jobs' adapters (hf)"
        return f"one pass per job on one {self.engine.name} engine"

    def run(self, requests: list[Request]) -> None:
        """Every request done: its rollout and RNG state after, or the error that ended its batch."""
        groups: dict[tuple, list[Request]] = {}
        for request in requests:
            groups.setdefault(request.batch_key(), []).append(request)
        for group in groups.values():
            for batch in [group] if self.mixed else [[r] for r in group]:
                try:
                    self._mixed(batch) if self.mixed else self._alone(batch[0])
                except Exception as error:  # each job of the batch fails with it, in its own thread
                    for request in batch:
                        request.error = error

    def _alone(self, request: Request) -> None:
        assert self.engine is not None  # not mixed: run() calls this only then
        self.model.set_adapter(request.adapter)
        if self.holds != (request.adapter, request.version):
            self.engine.policy_changed()  # its inference copy is made from this adapter at the call
            self.holds = (request.adapter, request.version)
        request.rng.restore(self.device)
        request.rollout = self.engine.generate(request.prompt_ids, request.num_generations, request.sampling,
                                               request.stop)
        request.rng_after = RngState.now(self.device)

    def _mixed(self, requests: list[Request]) -> None:
        G, sampling = requests[0].num_generations, requests[0].sampling
        stops = [r.stop for r in requests]
        prompts = [p for r in requests for p in r.prompt_ids]
        draw = None
        if not sampling.greedy:
            criteria, _ = stop_criteria(None, sampling.stop_strings, self.tokenizer, max(len(p) for p in prompts))
            draw = JobDraws([len(r.prompt_ids) * G for r in requests],
                            [r.rng.generator(self.device) for r in requests], eos_ids(self.model, self.tokenizer),
                            max(len(p) for p in prompts), criteria)
        roll = generate(self.model, self.tokenizer, prompts, num_generations=G, device=self.device,
                        stop=lambda: any(stop is not None and stop() for stop in stops),
                        adapters=[r.adapter for r in requests for _ in r.prompt_ids], draw=draw, **asdict(sampling))
        start = 0
        for i, request in enumerate(requests):
            groups = list(range(start, start + len(request.prompt_ids)))
            start += len(groups)
            request.rollout = trimmed(roll.select_groups(groups))
            request.rng_after = request.rng if draw is None else request.rng.after(draw.generators[i], self.device)

    def update_begins(self) -> None:
        """A job's update begins: a lean inference copy lets go of its weights (Engine.update_begins)."""
        if self.engine is not None:
            self.engine.update_begins()
            self.holds = None

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def trimmed(rollout: Rollout) -> Rollout:
    """One job's part of a batch as the job alone generates it: its prompts left-padded to its own longest, its
    completions as long as its own longest (generation ran as long as any row of it ran)."""
    width = int(rollout.prompt_mask.sum(dim=1).max())
    length = int(rollout.completion_mask.sum(dim=1).max())
    rollout.prompt_ids, rollout.prompt_mask = rollout.prompt_ids[:, -width:], rollout.prompt_mask[:, -width:]
    rollout.completion_ids = rollout.completion_ids[:, :length]
    rollout.completion_mask = rollout.completion_mask[:, :length]
    return rollout


class JobDraws:
    """GumbelSample's draw (a transformers logits processor) for a batch of several jobs' rows, `rows[j]` of job j in
    order: each job's noise from its own generator, and only while the job alone would still be drawing, that is
    while one of its rows has not ended (at an EOS token or, by `stop_strings`, a stop string); generation stops at the
    same point for a job alone, so its generator ends where the job's own RNG would."""

    def __init__(self, rows: list[int], generators: list[torch.Generator], eos: list[int], prompt_width: int,
                 stop_strings=None):
        bounds = torch.tensor([0, *rows]).cumsum(0).tolist()
        self.spans = list(zip(bounds[:-1], bounds[1:], strict=True))
        self.generators, self.eos, self.width, self.stop_strings = generators, torch.tensor(eos), prompt_width, \
            stop_strings
        self.ended: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.width:  # a token was chosen since the last call
            ended = torch.isin(input_ids[:, -1], self.eos.to(input_ids.device))
            if self.stop_strings:
                ended |= self.stop_strings(input_ids, scores).to(ended.device)
            self.ended = ended if self.ended is None else self.ended | ended
        scores = scores.clone()
        for (a, b), generator in zip(self.spans, self.generators, strict=True):
            if self.ended is not None and bool(self.ended[a:b].all()):
                continue
            u = torch.rand(scores[a:b].shape, generator=generator, dtype=scores.dtype, device=scores.device)
            u.clamp_(min=torch.finfo(scores.dtype).tiny)
            scores[a:b] = scores[a:b] - u.log_().neg_().log_()
        return scores


def job_engine(lm: LoadedModel) -> Engine | None:
    """The engine of a sweep job on a shared base (`lm` a JobModel), else None."""
    return JobEngine(lm) if isinstance(lm, JobModel) and lm.submit is not None else None

