"""sweep_stats: cells over seeds, t-intervals, Welch's test and labels, against values worked out by hand."""

import math

import pytest

from grpo_cli.sweep.stats import (
    BEST,
    LEADS,
    TIED,
    UNTESTED,
    WORSE,
    cell_table,
    describe,
    group_cells,
    paired_p,
    welch_p,
)

# two-sided 95 % Student-t quantiles, from a printed t-table
T_975 = {1: 12.7062, 2: 4.3027, 4: 2.7764}


def test_describe_n1_has_no_interval():
    assert describe([0.7]) == {"n": 1, "mean": 0.7, "std": None, "ci_low": None, "ci_high": None}
    assert describe([])["n"] == 0 and describe([float("nan")])["mean"] is None


def test_describe_n2_and_n5_t_interval():
    d = describe([0.5, 0.7])  # mean 0.6, std sqrt(0.02) = 0.141421, se 0.1
    assert d["n"] == 2 and d["mean"] == pytest.approx(0.6) and d["std"] == pytest.approx(0.1414214)
    assert d["ci_low"] == pytest.approx(0.6 - T_975[1] * 0.1, abs=1e-4)
    assert d["ci_high"] == pytest.approx(0.6 + T_975[1] * 0.1, abs=1e-4)
    d = describe([1, 2, 3, 4, 5])  # mean 3, std sqrt(2.5), se sqrt(0.5)
    half = T_975[4] * math.sqrt(0.5)
    assert (d["mean"], d["std"]) == (pytest.approx(3.0), pytest.approx(math.sqrt(2.5)))
    assert (d["ci_low"], d["ci_high"]) == (pytest.approx(3 - half, abs=1e-4), pytest.approx(3 + half, abs=1e-4))


def test_welch_p_by_hand():
    a, b = [1.0, 2.0, 3.0], [4.0, 6.0, 8.0, 10.0]
    # t = (2 - 7) / sqrt(1/3 + 6.6667/4) = -5 / sqrt(2) = -3.5355; Welch-Satterthwaite df = 4 / (1/18 + 25/27) = 4.0755
    from scipy import stats

    va, vb = 1.0 / 3, (20 / 3) / 4
    t = (2 - 7) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 3)
    assert t == pytest.approx(-3.5355, abs=1e-4) and df == pytest.approx(4.0755, abs=1e-3)
    assert welch_p(a, b) == pytest.approx(2 * stats.t.sf(abs(t), df))
    assert welch_p(a, b) != pytest.approx(stats.ttest_ind(a, b).pvalue)  # not Student's pooled test
    assert welch_p([1.0], b) is None
    assert welch_p([2.0, 2.0], [2.0, 2.0]) == 1.0 and welch_p([2.0, 2.0], [3.0, 3.0]) == 0.0


def job(beta, seed, reward, status="ok", clip=None):
    row = {"algo.beta": beta, "trainer.seed": seed, "final_reward": reward, "status": status}
    if clip is not None:
        row["algo.clip_eps"] = clip
    return row


def test_grouping_ignores_only_the_seed():
    rows = [job(0.0, s, 0.5, clip=c) for c in (0.1, 0.3) for s in (0, 1)] + [job(0.04, 0, 0.5, clip=0.1)]
    cells = group_cells(rows, ["algo.beta", "algo.clip_eps", "trainer.seed"])
    assert [(values, len(jobs)) for values, jobs in cells] == [((0.0, 0.1), 2), ((0.0, 0.3), 2), ((0.04, 0.1), 1)]
    assert [len(j) for _, j in group_cells(rows, ["trainer.seed"])] == [5]  # only seeds swept: one cell


def test_cell_table_labels_and_failed_job():
    rows = ([job(0.0, s, r) for s, r in enumerate([0.80, 0.82, 0.81, 0.79, 0.83])]      # n = 5, best
            + [job(0.02, s, r) for s, r in enumerate([0.77, 0.83])]                    # n = 2, overlaps
            + [job(0.04, s, r) for s, r in enumerate([0.40, 0.42, 0.41])]               # clearly worse
            + [job(0.04, 3, float("nan"), status="failed")]                              # its failed job
            + [job(0.08, 0, 0.9)])                                                        # n = 1
    table = cell_table(rows, ["algo.beta", "trainer.seed"], ["final_reward"], rank_by="final_reward")
    by_beta = {c["algo.beta"]: c for c in table}
    assert [c["algo.beta"] for c in table] == [0.08, 0.0, 0.02, 0.04]
    # the n = 1 cell has the highest mean: it is ranked first, and nobody can be tested against it, so none is best
    assert by_beta[0.08]["label"] == LEADS and by_beta[0.08]["final_reward_ci_low"] is None
    assert by_beta[0.0]["label"] == UNTESTED and by_beta[0.0]["p_vs_best"] is None

    table = cell_table([r for r in rows if r["algo.beta"] != 0.08], ["algo.beta", "trainer.seed"],
                       ["final_reward"], rank_by="final_reward")
    by_beta = {c["algo.beta"]: c for c in table}
    assert by_beta[0.0]["label"] == BEST and by_beta[0.0]["rank"] == 1 and by_beta[0.0]["final_reward_n"] == 5
    assert by_beta[0.02]["label"] == TIED and by_beta[0.02]["p_vs_best"] >= 0.05
    assert by_beta[0.04]["label"] == WORSE and by_beta[0.04]["p_vs_best"] < 0.05
    assert (by_beta[0.04]["jobs"], by_beta[0.04]["ok"], by_beta[0.04]["failed"]) == (4, 3, 1)
    assert by_beta[0.04]["final_reward_n"] == 3 and by_beta[0.04]["final_reward_mean"] == pytest.approx(0.41)


def test_runs_of_one_seed_are_one_sample_not_seeds():
    """A point a sweeper drew twice, with the seed not swept (both run the config's seed): two identical runs were
    n = 2 with a zero-width interval, and the other cell `worse` at p = 0."""
    repeated = [{"a": a, "final_reward": v, "status": "ok"} for a, v in ((1, 0.9), (1, 0.9), (2, 0.8), (2, 0.8))]
    table = cell_table(repeated, ["a"], ["final_reward"], rank_by="final_reward")
    assert [(c["a"], c["final_reward_n"], c["final_reward_mean"], c["final_reward_ci_low"], c["label"])
            for c in table] == [(1, 1, 0.9, None, LEADS), (2, 1, 0.8, None, UNTESTED)]
    # seeds swept, seed 0 run twice: seeds 0 and 1 are the cell's two samples, seed 0's at the mean of its runs
    twice = [job(0.0, 0, 0.9), job(0.0, 0, 0.7), job(0.0, 1, 0.6)]
    [cell] = cell_table(twice, ["algo.beta", "trainer.seed"], ["final_reward"], rank_by="final_reward")
    assert cell["final_reward_n"] == 2 and cell["final_reward_mean"] == pytest.approx(0.7)
    assert cell["jobs"] == 3 and cell["seeds"] == [0, 0, 1]


def test_paired_p_by_hand_takes_out_what_the_seed_shares():
    # the CPU sweep's held-out accuracy (docs/results/beta-clip-eps-sweeps.md): seed 0 is lower in both cells
    best, other = {0: 0.62, 1: 0.68, 2: 0.69}, {0: 0.59, 1: 0.67, 2: 0.68}
    # differences 0.03, 0.01, 0.01: mean 0.016667, std 0.011547, t = mean / (std / sqrt(3)) = 2.5, df 2
    from scipy import stats

    assert paired_p(other, best) == pytest.approx(2 * stats.t.sf(2.5, 2))
    assert paired_p(other, best) == pytest.approx(0.1296, abs=1e-4)
    assert welch_p(list(other.values()), list(best.values())) > 0.6  # unpaired, the seed's spread hides it
    assert paired_p({0: 0.5, 5: 0.6}, best) is None                # one shared seed: no test
    assert paired_p({0: 0.6, 1: 0.7}, {0: 0.5, 1: 0.6}) == 0.0      # the same difference on every seed
    assert paired_p({0: 0.42, 1: 0.40}, {0: 0.82, 1: 0.80}) == 0.0    # the same up to float rounding
    rows = [job(0.0, s, v) for s, v in best.items()] + [job(0.04, s, v) for s, v in other.items()] + [job(0.08, 0, 0.6)]
    table = cell_table(rows, ["algo.beta", "trainer.seed"], ["final_reward"], rank_by="final_reward")
    by_beta = {c["algo.beta"]: c for c in table}
    assert by_beta[0.0]["p_paired_vs_best"] is None and by_beta[0.08]["p_paired_vs_best"] is None
    assert by_beta[0.04]["p_paired_vs_best"] == pytest.approx(0.1296, abs=1e-4) and by_beta[0.04]["label"] == TIED
