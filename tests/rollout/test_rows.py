"""Row operations (rollout/rows.py): selecting groups of a Batch and joining Batches (mini-batches, dynamic
sampling) carry every field of the batch and of its rollout, single-turn or episodes, each field present."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_cli.rollout import Rollout, rows
from grpo_cli.rollout.episodes import Episodes
from grpo_cli.step.batch import Batch
from grpo_cli.step.dynamic_sampling import concat_batches

PAD = 99
G = 2
WHOLE_RECORD = {"group_size", "interrupted", "stats", "logged"}  # fields that are the record's, not its rows'


class Env:
    def __init__(self, k):
        self.k = k


def rollout(kind: type, groups: int, width: int, start: int) -> Rollout:
    """A rollout of `groups` groups whose every field is present; values encode (row, position) from `start`."""
    n = groups * G
    ids = torch.arange(start, start + n * width).view(n, width)
    common = dict(prompt_ids=torch.arange(start, start + groups * 3).view(groups, 3), prompt_mask=torch.ones(groups, 3),
                  completion_ids=ids, completion_mask=torch.ones(n, width, dtype=torch.long),
                  truncated=torch.arange(n) % 2 == 0, texts=[f"t{start + i}" for i in range(n)], group_size=G,
                  sampler_logprobs=-ids.float() / 1000, ref_logprobs=-ids.float() / 2000)
    if kind is Rollout:
        return Rollout(**common)
    return Episodes(**common, model_mask=(ids % 3 > 0).long(), prompts=[f"p{start + i}" for i in range(n)],
                    messages=[[{"role": "user", "content": str(start + i)}] for i in range(n)],
                    tool_calls=torch.arange(start, start + n), failed_calls=torch.arange(n) % 2,
                    turns=torch.arange(n) + 1, cut=torch.arange(n) % 3 == 0, tool_outputs_cut=torch.arange(n) % 2,
                    environments=[Env(start + i) for i in range(n)])


def batch(kind: type, groups: int, width: int, start: int) -> Batch:
    roll = rollout(kind, groups, width, start)
    n = groups * G
    return Batch(roll, [f"q{start + i}" for i in range(n)], torch.arange(n, dtype=torch.float32) + start,
                 {"f": [float(start + i) for i in range(n)]}, torch.arange(n, dtype=torch.float32) - start,
                 torch.ones(n, width) * (start + 1), reward_errors=start, stats={"from": start},
                 reward_failures=[f"failed {start + i}" if i % 2 else None for i in range(n)])


def row_fields(record) -> dict[str, str]:
    """Every field of `record` declared per row, per token or per group, with its kind; fails on a field declared
    nowhere (a new field must say what it holds per row)."""
    kinds = {}
    for f in dataclasses.fields(record):
        kind = f.metadata.get(rows.KIND)
        assert kind is not None or f.name in WHOLE_RECORD, f"{type(record).__name__}.{f.name} has no row kind"
        if kind in ("row", "token", "group"):
            kinds[f.name] = kind
    return kinds


def as_rows(value) -> list:
    return value.tolist() if isinstance(value, torch.Tensor) else [getattr(v, "k", v) for v in value]


@pytest.mark.parametrize("kind", [Rollout, Episodes])
def test_select_groups_carries_every_field(kind):
    b = batch(kind, 3, 4, 0)
    picked = b.select_groups([2, 0])
    want_rows, want_groups = [4, 5, 0, 1], [2, 0]
    for record, source in ((picked, b), (picked.rollout, b.rollout)):
        for name, kind in row_fields(source).items():
            index = want_groups if kind == "group" else want_rows
            assert as_rows(getattr(record, name)) == [as_rows(getattr(source, name))[i] for i in index], name
    assert picked.per_function["f"] == [4.0, 5.0, 0.0, 1.0] and picked.reward_errors == 0
    assert picked.rollout.select_groups([1]).texts == ["t0", "t1"]


@pytest.mark.parametrize("kind", [Rollout, Episodes])
def test_join_carries_every_field_and_pads_to_the_widest(kind):
    narrow, wide = batch(kind, 1, 3, 0), batch(kind, 2, 5, 100)
    joined = concat_batches([narrow, wide], PAD)
    n = 2 + 4
    for record, parts in ((joined, (narrow, wide)), (joined.rollout, (narrow.rollout, wide.rollout))):
        for name in row_fields(parts[0]):
            value = getattr(record, name)
            assert len(value) == (3 if name.startswith("prompt_") else n), name
            if isinstance(value, torch.Tensor) and value.dim() == 2 and not name.startswith("prompt_"):
                assert value.shape[1] == 5, name
                assert value[:2, :3].tolist() == getattr(parts[0], name).tolist(), name  # right-padded
                assert value[2:].tolist() == getattr(parts[1], name).tolist(), name
            else:
                assert as_rows(value)[len(as_rows(getattr(parts[0], name))):] == as_rows(getattr(parts[1], name)), name
    roll = joined.rollout
    assert roll.completion_ids[:2, 3:].eq(PAD).all() and roll.completion_mask[:2, 3:].eq(0).all()
    assert roll.sampler_logprobs.shape == (6, 5)  # every completion keeps its sampler log-probs
    assert joined.mask[:2, 3:].eq(0).all()
    assert joined.per_function["f"] == [0.0, 1.0, *[100.0 + i for i in range(4)]]
    assert joined.reward_errors == 100 and joined.stats == {"from": 0}


def test_a_field_recorded_in_some_rollouts_only_is_refused():
    with_sampler, without = batch(Rollout, 1, 3, 0), batch(Rollout, 1, 3, 10)
    without = dataclasses.replace(without, rollout=dataclasses.replace(without.rollout, sampler_logprobs=None))
    with pytest.raises(ValueError, match="sampler_logprobs is recorded in some"):
        concat_batches([with_sampler, without], PAD)
    both_without = concat_batches([without, without], PAD)
    assert both_without.rollout.sampler_logprobs is None
