"""Generation for a sweep's jobs on one base (rollout/shared.py): one batch mixing several adapters (peft's
adapter_names) samples for each adapter the tokens it samples alone, from its own RNG, which it leaves where it would
alone; and a job's adapter is kept and written as a run's `default` adapter (model/adapters.py)."""

from __future__ import annotations

import types

import pytest
import torch
from conftest import randomise_lora, tiny_lora_policy
from safetensors.torch import load_file

from grpo_cli.config.schema import LoraConfig
from grpo_cli.model import adapters
from grpo_cli.rollout.common import SamplingParams
from grpo_cli.rollout.hf import generate
from grpo_cli.rollout.shared import Request, RngState, SharedGeneration

LORA = LoraConfig(r=8, alpha=16, dropout=0.0, target_modules="all-linear")


def two_adapters():
    """The tiny model with two random adapters: `default` and job 1's."""
    lm = tiny_lora_policy()
    adapters.add_adapter(lm, LORA, adapters.adapter_name(1))
    randomise_lora(lm.model, seed=1)  # the active one's B (and `default`'s, already random: again)
    return lm


@pytest.mark.slow
def test_a_mixed_batch_samples_for_each_adapter_what_it_samples_alone():
    lm = two_adapters()
    tok = lm.tokenizer
    jobs = [("default", ["What is 2 + 3?", "Say hi."], 11), (adapters.adapter_name(1), ["A much longer question here, "
                                                                                        "with more tokens in it?"], 12)]
    # a third of the vocabulary ends a row: rows end after a few tokens, one job's long before the other's
    lm.model.generation_config.eos_token_id = list(range(0, len(tok), 3))
    options = {"max_new_tokens": 12, "temperature": 0.9, "top_k": 50}
    alone, requests = [], []
    for adapter, texts, seed in jobs:
        ids = [tok(t).input_ids for t in texts]
        lm.model.set_adapter(adapter)
        torch.manual_seed(seed)
        start = RngState.now(lm.device)
        roll = generate(lm.model, tok, ids, num_generations=3, device=lm.device, **options)
        alone.append((roll, torch.get_rng_state()))
        requests.append(Request(adapter, ids, 3, SamplingParams(**options), lambda: False, start))
    lengths = [int(r.completion_mask.sum(dim=1).max()) for r, _ in alone]
    assert lengths[0] != lengths[1]  # the jobs stop drawing at different decode steps

    shared = SharedGeneration(lm, types.SimpleNamespace(engine="hf"))
    assert shared.mixed
    shared.run(requests)
    for (roll, rng), request in zip(alone, requests, strict=True):
        assert request.error is None
        together = request.rollout
        for field in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
            assert torch.equal(getattr(together, field), getattr(roll, field)), field
        assert together.texts == roll.texts
        assert torch.equal(request.rng_after.cpu, rng)  # the job's RNG where its own generation left it


def test_a_jobs_adapter_is_kept_and_written_as_a_runs_default_one(tmp_path):
    lm = two_adapters()
    name = adapters.adapter_name(1)
    state = adapters.trainable_state(lm.model, name)
    assert state and all(".default." in key for key in state)
    default = {k: v.clone() for k, v in adapters.trainable_state(lm.model.set_adapter("default") or lm.model).items()}
    assert set(default) == set(state)
    assert not all(torch.equal(default[k], state[k]) for k in state)  # two adapters, two weights

    lm.model.set_adapter(name)
    adapters.save_adapter(lm.model, tmp_path / "job", state, name)
    lm.model.set_adapter("default")
    adapters.save_adapter(lm.model, tmp_path / "alone", state)
    names = sorted(p.name for p in (tmp_path / "job").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "alone").iterdir()) and "adapter_config.json" in names
    job, alone = load_file(tmp_path / "job" / "adapter_model.safetensors"), \
        load_file(tmp_path / "alone" / "adapter_model.safetensors")
    assert job.keys() == alone.keys() and all(torch.equal(job[k], alone[k]) for k in job)
    assert (tmp_path / "job" / "adapter_config.json").read_text() == \
        (tmp_path / "alone" / "adapter_config.json").read_text()

    adapters.load_trainable_state(lm.model, default, name)  # `default`'s weights into job 1's adapter
    lm.model.set_adapter(name)
    assert all(torch.equal(v, default[k]) for k, v in adapters.trainable_state(lm.model, name).items())
    adapters.load_trainable_state(lm.model, job, name)  # and back, as a checkpoint holds them (peft's names)
    assert all(torch.equal(v, state[k]) for k, v in adapters.trainable_state(lm.model, name).items())
