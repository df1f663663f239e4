"""The algorithm menu: objectives, KL estimators, masks, the entropy bonus, advantage estimators, reward
aggregation, dynamic sampling and the truncation warning (docs/algorithm.md). Hand formulas here; TRL's own code in
tests/algorithm/test_trl_equivalence.py."""

import dataclasses
import math

import pytest
import torch
from conftest import fit, make_trainer, read_jsonl, straight_and_resumed

from grpo_cli import algorithm
from grpo_cli.algorithm import LossInputs, LossSettings, ObjectiveOptions, policy_loss
from grpo_cli.base.errors import ConfigError, RewardError
from grpo_cli.config.schema import Config
from grpo_cli.rewards.aggregation import combine, present_mean
from grpo_cli.rewards.overlong import overlong_score


def batch(b=4, t=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g) * 2
    old = logp + 0.4 * torch.randn(b, t, generator=g)
    ref = logp + 0.3 * torch.randn(b, t, generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:b]
    mask = torch.ones(b, t)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    return logp.requires_grad_(), old, ref, adv, mask


def loss_of(settings=None, beta=0.0, **kw):
    logp, old, ref, adv, mask = batch()
    settings = dataclasses.replace(settings or LossSettings(), beta=beta, **kw)
    loss, stats = policy_loss(LossInputs(logp, adv, mask, old, ref, settings=settings))
    return loss, stats, (logp, old, ref, adv, mask)


def grpo_mean(per_token, mask):
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp_min(1)).mean()


def test_default_settings_are_todays_loss():
    a, sa, _ = loss_of(None, beta=0.1)
    b, sb, _ = loss_of(LossSettings(), beta=0.1)
    assert torch.equal(a, b) and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("objective", ["cispo", "sapo", "vespo"])
def test_objectives_by_hand(objective):
    loss, stats, (logp, old, _, adv, mask) = loss_of(LossSettings(objective=objective, options=ObjectiveOptions(
        cispo_max_ratio=1.1)))
    r = (logp - old).exp()
    A = adv[:, None]
    if objective == "cispo":
        want = -r.clamp(max=1.1).detach() * A * logp
    elif objective == "sapo":
        tau = torch.where(A > 0, 1.0, 1.05)
        want = -torch.sigmoid(tau * (r - 1)) * 4 / tau * A
    else:
        log_w = ((logp - old) * mask).sum(-1, keepdim=True).detach()
        k, lam = torch.where(A >= 0, 2.0, 3.0), torch.where(A >= 0, 3.0, 2.0)
        want = -torch.exp(lam + k * log_w - lam * log_w.exp()) * A * logp
    torch.testing.assert_close(loss, grpo_mean(want, mask))
    (g,) = torch.autograd.grad(loss, logp)
    (w,) = torch.autograd.grad(grpo_mean(want, mask), logp)
    torch.testing.assert_close(g, w)
    assert g.abs().sum() > 0
    if objective == "cispo":
        assert 0 < float(stats["cispo_clip_fraction"]) < 1


def test_on_policy_the_vespo_weight_is_1_whatever_its_shape():
    """With old = logp (ratio 1: config.rules' warning that the shape options then change nothing), phi(1) =
    exp(lam + k * 0 - lam * 1) = 1 for every (k, lam): the loss and its gradient are REINFORCE's, -A * logp."""
    logp, _, _, adv, mask = batch()
    results = []
    for options in (ObjectiveOptions(), ObjectiveOptions(vespo_k_pos=0.5, vespo_lambda_pos=9.0, vespo_k_neg=7.0,
                                                         vespo_lambda_neg=0.25)):
        loss, _ = policy_loss(LossInputs(logp, adv, mask, None, None, settings=LossSettings(objective="vespo",
                                                                                          options=options)))
        results.append((loss, *torch.autograd.grad(loss, logp)))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    torch.testing.assert_close(results[0][0], grpo_mean(-adv[:, None] * logp, mask))


def test_luspo_is_the_sequence_sum():
    loss, _, (logp, old, _, adv, mask) = loss_of(LossSettings(objective="luspo"), ratio_level="sequence")
    n = mask.sum(-1)
    r = (((logp - old) * mask).sum(-1) / n).exp()[:, None]
    surr = -torch.minimum(r * adv[:, None], r.clamp(0.8, 1.2) * adv[:, None])
    torch.testing.assert_close(loss, ((surr * mask).sum(-1)).mean())


def test_delta_caps_the_ratio_for_negative_advantages():
    plain, _, _ = loss_of(None)
    capped, _, (logp, old, _, adv, mask) = loss_of(LossSettings(options=ObjectiveOptions(delta=1.05)))
    r = (logp - old).exp()
    A = adv[:, None]
    want = -torch.minimum(r.clamp(max=1.05) * A, r.clamp(0.8, 1.2) * A)
    torch.testing.assert_close(capped, grpo_mean(want, mask))
    assert not torch.isclose(plain, capped)


@pytest.mark.parametrize("estimator", algorithm.KL_ESTIMATORS)
def test_kl_estimators(estimator):
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-2.0, -1.0, -0.5])
    d = ref - logp
    want = {"k3": d.exp() - d - 1, "k1": -d, "k2": d ** 2 / 2, "abs": d.abs(), "low_var_kl": d.exp() - d - 1}[estimator]
    torch.testing.assert_close(algorithm.kl_estimate(logp, ref, estimator), want)
    assert float(algorithm.kl_estimate(logp[2:], ref[2:], estimator)) == 0.0


def test_bias_corrected_kl_is_k3_times_the_ratio():
    loss, stats, (logp, old, ref, adv, mask) = loss_of(LossSettings(use_bias_correction_kl=True), beta=0.5)
    plain, plain_stats, _ = loss_of(None, beta=0.5)
    r = (logp - old).exp()
    k3 = algorithm.kl_k3(logp, ref)
    torch.testing.assert_close(loss - plain, 0.5 * (grpo_mean(k3 * r, mask) - grpo_mean(k3, mask)))
    assert not torch.isclose(stats["kl"], plain_stats["kl"])


def test_off_policy_mask_drops_far_negative_sequences():
    logp, old, _, adv, mask = batch()
    keep = algorithm.off_policy_keep(logp, old, adv[:, None], mask, threshold=0.0)
    seq_kl = ((old - logp.detach()) * mask).sum(-1) / mask.sum(-1)
    assert keep.squeeze(1).tolist() == [float(a >= 0 or k <= 0) for a, k in zip(adv, seq_kl, strict=True)]
    loss, _, _ = loss_of(LossSettings(off_policy_mask_threshold=0.0))
    r = (logp - old).exp()
    want = -torch.minimum(r * adv[:, None], r.clamp(0.8, 1.2) * adv[:, None]) * keep
    torch.testing.assert_close(loss, grpo_mean(want, mask))


def test_top_entropy_quantile_keeps_the_high_entropy_tokens():
    entropy = torch.arange(20, dtype=torch.float32).view(4, 5)
    real = torch.ones(4, 5, dtype=torch.bool)
    kept = algorithm.high_entropy_mask(entropy, real, 0.25)
    assert int(kept.sum()) == 5 and bool(kept[3].all())
    with pytest.raises(ValueError, match="entropy=None"):
        loss_of(LossSettings(top_entropy_quantile=0.5))


def test_entropy_bonus_and_its_accumulation():
    logp, old, ref, adv, mask = batch()
    entropy = torch.rand(4, 5, requires_grad=True)
    loss, stats = policy_loss(LossInputs(logp, adv, mask, old, entropy=entropy,
                                         settings=LossSettings(entropy_coef=0.1)))
    plain, _ = policy_loss(LossInputs(logp, adv, mask, old))
    bonus = 0.1 * (entropy * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, plain - bonus)
    # dapo's weight is 1 per micro-batch; the bonus is still averaged over the update's micro-batches
    total = algorithm.accumulated(loss, stats, weight=1.0, micro_batches_total=4)
    torch.testing.assert_close(total, plain - bonus / 4)


def test_adaptive_entropy_controller():
    control = algorithm.AdaptiveEntropy(coef=0.01, target=0.5, delta=0.005)
    assert control.applied == 0.0  # no entropy measured yet
    control.update(0.4)
    assert control.coef == pytest.approx(0.015) and control.applied == pytest.approx(0.015)
    control.update(0.9)
    assert control.coef == pytest.approx(0.01) and control.applied == 0.0
    for _ in range(5):
        control.update(0.9)
    assert control.coef == 0.0
    again = algorithm.AdaptiveEntropy(coef=0.3, target=0.5, delta=0.005)
    again.restore(control.state())
    assert again.state() == control.state()


def test_advantage_estimators_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.25, 0.0, 0.5])
    lengths = torch.tensor([2.0, 4.0, 1.0, 1.0, 3.0, 3.0, 2.0, 0.0])
    rloo = algorithm.advantages_of("rloo", r, 4)
    assert rloo[0] == pytest.approx(1.0 - 0.0) and rloo[1] == pytest.approx(0.0 - 1 / 3)
    opo = algorithm.advantages_of("opo", r, 4, lengths=lengths)
    assert opo[0] == pytest.approx(1.0 - 2 / 8)
    passk = algorithm.advantages_of("grpo_passk", r, 4, eps=1e-4)
    assert passk[0] == pytest.approx(1.0 / (float(r[:4].std()) + 1e-4)) and passk[1:4].abs().sum() == 0
    assert passk[4:].abs().sum() == pytest.approx(0.5 / (float(r[4:].std()) + 1e-4))  # best minus second best
    rpp = algorithm.advantages_of("reinforce_plus_plus_baseline", r, 4, lengths=lengths)
    centered = r - r.view(2, 4).mean(1).repeat_interleave(4)
    tokens = torch.cat([torch.full((int(n),), float(c)) for c, n in zip(centered, lengths, strict=True)])
    want = (centered - tokens.mean()) / (tokens.var(unbiased=True) + 1e-8).sqrt()
    torch.testing.assert_close(rpp[lengths > 0], want[lengths > 0])
    assert float(rpp[7]) == 0.0
    torch.testing.assert_close(algorithm.advantages_of("grpo", r, 4), algorithm.group_advantages(r, 4))
    with pytest.raises(ValueError, match="takes no scale_rewards"):
        algorithm.advantages_of("rloo", r, 4, scale="batch")


@pytest.mark.parametrize("overrides, match", [
    (["algo.objective=luspo"], "algo.ratio_level=token is invalid: does not suit algo.objective=luspo"),
    (["algo.objective=vespo", "algo.ratio_level=sequence"], "use algo.ratio_level=token"),
    (["algo.objective=luspo", "algo.ratio_level=sequence", "algo.aggregation=dapo"], "use algo.aggregation=grpo"),
    (["algo.loss_type=dapo", "algo.aggregation=bnpo"], "algo.loss_type=dapo is invalid: is an alias"),
    (["algo.advantage=rloo", "algo.scale_rewards=batch"], "algo.scale_rewards=batch is invalid"),
    (["algo.delta=1.1"], r"algo.delta=1.1 is invalid: needs delta > 1 \+ clip_eps_high \(1.2\)"),
    (["algo.objective=ppo2"], "algo.objective=ppo2 is invalid: use one of grpo, cispo, sapo, luspo, vespo"),
    (["algo.kl_estimator=k4"], "algo.kl_estimator=k4 is invalid"),
    (["algo.filter_groups=true", "trainer.nproc=2"], "algo.filter_groups=true is invalid"),
    (["+reward.aggregation=mean"], "reward.aggregation=mean is invalid"),
])
@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_nonsense_combinations_are_one_line(compose, overrides, match):
    from grpo_cli.run.validate import validate

    with pytest.raises(ConfigError, match=match):
        validate(compose(["+recipe=quickstart", *overrides]))


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_aggregation_and_its_alias(compose):
    from grpo_cli.run.validate import validate

    for overrides, want in ((["algo.aggregation=dapo"], "dapo"), (["algo.loss_type=bnpo"], "bnpo"), ([], "grpo"),
                            (["algo.loss_type=dapo", "algo.aggregation=dapo"], "dapo")):
        cfg = compose(["+recipe=quickstart", *overrides])
        validate(cfg)
        assert Config.of(cfg).algo.effective_aggregation == want


def test_reward_aggregation_and_none():
    per_fn = {"a": [1.0, 0.0, None, 1.0], "b": [None, 2.0, 4.0, 0.0]}
    assert combine({"a": 1.0, "b": 0.5}, per_fn) == [1.0, 1.0, 2.0, 1.0]
    z = combine({"a": 1.0, "b": 1.0}, per_fn, "normalize_then_sum", group_size=4)
    a_std = torch.tensor([1.0, 0.0, 1.0]).std().item()
    b = torch.tensor([2.0, 4.0, 0.0])
    assert z[0] == pytest.approx((1 - 2 / 3) / (a_std + 1e-4))
    assert z[2] == pytest.approx((4 - 2) / (b.std().item() + 1e-4))
    with pytest.raises(RewardError, match="every reward function \\(a, b\\) returned None for completion 1"):
        combine({"a": 1.0, "b": 1.0}, {"a": [1.0, None], "b": [0.0, None]})
    assert present_mean([None, 1.0, 0.0]) == 0.5 and math.isnan(present_mean([None]))


def test_overlong_penalty_is_dapos_soft_buffer():
    assert [overlong_score(n, 20, 8) for n in (5, 12, 13, 16, 20, 21)] == [0.0, 0.0, -1 / 8, -0.5, -1.0, -1.0]


def test_a_user_objective_is_one_decorated_function():
    @algorithm.register_objective("test_plain_pg", formula="-A * logp", note="test only")
    def plain(x):
        return -x.adv * x.logp

    try:
        loss, _, (logp, _, _, adv, mask) = loss_of(LossSettings(objective="test_plain_pg"))
        torch.testing.assert_close(loss, grpo_mean(-adv[:, None] * logp, mask))
        with pytest.raises(ValueError, match="registered twice"):
            algorithm.register_objective("test_plain_pg", formula="x")(plain)
    finally:
        del algorithm.OBJECTIVES["test_plain_pg"]


@pytest.mark.slow
def test_a_run_that_only_truncates_is_warned(compose, tmp_path):
    """The tiny random model never ends before 2 new tokens: truncated_frac is 1 every step."""
    trainer = make_trainer(compose, tmp_path, "rollout.max_new_tokens=2", "trainer.max_steps=10", "algo.beta=0.0",
                           "data.prompts_per_step=1", "algo.num_generations=2", "trainer.log_samples_every=0")
    fit(trainer, tmp_path)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["truncated_frac"] for r in rows] == [1.0] * 10
    warned = [r["step"] for r in rows if "rollout.max_new_tokens" in r.get("warning", "")]
    assert warned == [9]


@pytest.mark.slow
def test_dynamic_sampling_fills_the_batch_with_signal(compose, tmp_path, monkeypatch):
    """Reward = parity of the completion's length: a group whose G completions agree has no signal and is dropped."""
    from grpo_cli.step import dynamic_sampling

    (tmp_path / "parity_reward.py").write_text(
        "def parity(prompts, completions, **_):\n    return [float(len(c) % 2) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    trainer = make_trainer(compose, tmp_path, "algo.filter_groups=true", "algo.filter_max_draws=3",
                           "data.prompts_per_step=4", "algo.num_generations=2", "~reward.functions",
                           "+reward.functions={parity: {_target_: parity_reward.parity, weight: 1.0}}",
                           "reward.accuracy=null")
    first = trainer.generate(0)
    again = trainer.generate(0, draw=1)
    assert first.rows != again.rows or not torch.equal(first.rollout.completion_ids, again.rollout.completion_ids)
    batch = dynamic_sampling.filtered_batch(trainer, 0)
    assert batch.rewards.numel() == 8
    stats = batch.stats
    assert 0.0 <= stats["filter_dropped_frac"] <= 1.0 and 1 <= stats["filter_draws"] <= 3
    found = int(stats["filter_groups_with_signal"])
    assert found >= 1 and len(dynamic_sampling.signal_groups(batch.rewards, 2)) == found
    assert stats["filter_bound_hit"] == float(found < 4)
    repeat = dynamic_sampling.filtered_batch(trainer, 0)  # a step's rounds depend only on (seed, step)
    assert torch.equal(repeat.rollout.completion_ids, batch.rollout.completion_ids)
    torch.testing.assert_close(repeat.advantages, batch.advantages)


@pytest.mark.slow
def test_dynamic_sampling_at_its_draw_limit_refills_exactly_the_missing_groups(compose, tmp_path, monkeypatch):
    """Each generation round has signal in its first group only (the reward scores the first G rows of its call):
    with 4 prompts a step and 2 rounds, 2 groups with signal are found, and the batch is filled with exactly the 2
    first quiet groups of round 0, in order."""
    from grpo_cli.step import dynamic_sampling

    (tmp_path / "first_group_reward.py").write_text(
        "def first_group(prompts, completions, **_):\n"
        "    return [float(i % 2) if i < 2 else 0.0 for i in range(len(completions))]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    trainer = make_trainer(compose, tmp_path, "algo.filter_groups=true", "algo.filter_max_draws=2",
                           "data.prompts_per_step=4", "algo.num_generations=2", "~reward.functions",
                           "+reward.functions={first: {_target_: first_group_reward.first_group, weight: 1.0}}",
                           "reward.accuracy=null")
    round0, round1 = trainer.generate(0), trainer.generate(0, draw=1)
    batch = dynamic_sampling.filtered_batch(trainer, 0)
    assert batch.rewards.numel() == 8 and batch.stats["filter_bound_hit"] == 1.0
    assert batch.stats["filter_groups_with_signal"] == 2.0 and batch.stats["filter_draws"] == 2
    assert dynamic_sampling.signal_groups(batch.rewards, 2) == [0, 1]
    ids = lambda roll, group: roll.completion_ids[2 * group:2 * group + 2]  # noqa: E731
    got = batch.rollout.completion_ids
    for row_group, (source, group) in enumerate([(round0, 0), (round1, 0), (round0, 1), (round0, 2)]):
        want = ids(source.rollout, group)
        assert torch.equal(got[2 * row_group:2 * row_group + 2, :want.shape[1]], want), row_group


@pytest.mark.slow
def test_resume_with_dynamic_sampling_and_adaptive_entropy_is_bitwise(tmp_path):
    """A run with algo.filter_groups, sapo and the adaptive entropy bonus, resumed from its step-2 checkpoint, ends
    with the same adapter and the same metrics as the straight run (extra rounds and the coefficient included)."""
    import os


    (tmp_path / "my_rewards.py").write_text("def varied(prompts, completions, **_):\n"
                                            "    return [float(len(c) % 3) for c in completions]\n")
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)}
    args = ["+recipe=quickstart", "model=tiny", "rollout.max_new_tokens=4", "data.prompts_per_step=2",
            "algo.num_generations=2", "algo.filter_groups=true", "algo.filter_max_draws=3", "algo.objective=sapo",
            "algo.entropy_coef=0.01", "algo.entropy_target=100.0", "optimizer.lr=1e-2", "trainer.max_steps=4",
            "trainer.save_every=2", "trainer.log_samples_every=0",
            "+reward.functions.varied._target_=my_rewards.varied"]
    straight, resumed = straight_and_resumed(args, tmp_path, env)
    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    keep = ("reward", "loss", "entropy", "filter_draws", "filter_dropped_frac", "filter_groups_with_signal")
    assert [{k: r[k] for k in keep} for r in a] == [{k: r[k] for k in keep} for r in b]
    assert any(r["filter_draws"] > 1 for r in a)  # some step drew more prompts
    final = (straight / "adapter" / "adapter_model.safetensors").read_bytes()
    assert final == (resumed / "adapter" / "adapter_model.safetensors").read_bytes()


def test_reward_set_leaves_out_none_and_refuses_a_completion_nobody_scored():
    from grpo_cli.rewards import RewardFunction, RewardSet

    def only_short(prompts, completions, **_):
        return [1.0 if len(c) < 3 else None for c in completions]

    def only_long(prompts, completions, **_):
        return [None if len(c) < 3 else 2.0 for c in completions]

    rewards = RewardSet([RewardFunction("short", only_short, 1.0), RewardFunction("long", only_long, 0.5)])
    totals, per_fn, errors = rewards.score(["p"] * 2, ["ab", "abcd"], {})
    assert totals == [1.0, 1.0] and per_fn == {"short": [1.0, None], "long": [None, 2.0]} and errors == 0
    gdpo = RewardSet([RewardFunction("short", only_short, 1.0), RewardFunction("long", only_long, 0.5)],
                     aggregation="normalize_then_sum")
    totals, _, _ = gdpo.score(["p"] * 4, ["ab", "abcd", "a", "abc"], {}, group_size=2)
    assert totals == pytest.approx([0.0, 0.0, 0.0, 0.0])  # one scored completion per function and group: z = 0
    lengths = RewardSet([RewardFunction("len", lambda p, c, **_: [float(len(x)) for x in c], 3.0),
                         RewardFunction("short", only_short, 1.0)], aggregation="normalize_then_sum")
    totals, _, _ = lengths.score(["p"] * 2, ["a", "abc"], {}, group_size=2)  # only_short scores "a" alone: z = 0
    assert totals == pytest.approx([-3 / (math.sqrt(2) + 1e-4), 3 / (math.sqrt(2) + 1e-4)])
    alone = RewardSet([RewardFunction("short", only_short, 1.0)])
    with pytest.raises(RewardError, match="every reward function \\(short\\) returned None for completion 1"):
        alone.score(["p"] * 2, ["ab", "abcd"], {})


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_overlong_penalty_from_the_config(compose):
    from grpo_cli.rewards import RewardSet
    from grpo_cli.run.validate import validate

    entry = "+reward.functions.overlong"
    overrides = ["+recipe=quickstart", "model=tiny", f"{entry}._target_=grpo_cli.rewards.overlong.OverlongPenalty",
                 f"{entry}.buffer=4", f"{entry}.max_tokens=" + "${rollout.max_new_tokens}", "rollout.max_new_tokens=8",
                 f"{entry}.tokenizer=" + "${model.name_or_path}", "+reward.aggregation=sum"]
    cfg = compose(overrides)
    validate(cfg)
    rewards = RewardSet.from_config(Config.of(cfg).reward)
    penalty = next(rf.fn for rf in rewards.functions if rf.name == "overlong")
    texts = ["one", " ".join(["word"] * 30)]
    assert penalty(["p"] * 2, texts) == [0.0, -1.0]
    with pytest.raises(ConfigError, match="buffer=9 is invalid: needs buffer <= max_tokens \\(8\\)"):
        validate(compose([o.replace(".buffer=4", ".buffer=9") for o in overrides]))
