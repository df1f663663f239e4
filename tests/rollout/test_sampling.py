"""rollout.top_k, min_p, repetition_penalty and stop: what each does to generation, in both engines, through the
trainer and the evaluator; the warning where they make the clipped ratio compare against another distribution;
bad values in one line."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import TINY_TRAINER, fixed_batch, make_trainer, run_cli, tiny_lora_policy
from test_engines import assert_same_rollout, chat_prompts, engines

from grpo_cli.base.errors import ConfigError
from grpo_cli.config.schema import Config
from grpo_cli.rollout import SamplingParams
from grpo_cli.run.validate import validate
from grpo_cli.step.evaluate import Evaluator
from grpo_cli.tasks.prompts import encode_prompts

NEW = 8  # tokens per completion: every row runs to the end (min_new_tokens) unless a stop string ends it


@pytest.fixture(scope="module")
def tiny():
    """tiny_lora_policy with its LoRA A matrices drawn from a seeded RNG: the same model (and greedy text) in
    every process."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return tiny_lora_policy()


@pytest.fixture(scope="module")
def prompts(tiny):
    return chat_prompts(tiny.tokenizer)


@pytest.fixture(scope="module")
def hf(tiny):
    return engines(tiny)[0]


def sample(engine, prompts, seed: int = 3, **options):
    torch.manual_seed(seed)
    return engine.generate(prompts, 2, SamplingParams(max_new_tokens=NEW, min_new_tokens=NEW, **options))


@pytest.fixture(scope="module")
def greedy(hf, prompts):
    return sample(hf, prompts, greedy=True)


@pytest.fixture(scope="module")
def plain(hf, prompts):
    """Sampled at temperature 1 with no option on."""
    return sample(hf, prompts)


def assert_ends_at_first_stop(tokenizer, full, cut, stop: str) -> None:
    """`cut` is `full` (the same sampling without stop strings) with each row ended at the first `stop` in it: the
    tokens up to the one that completes it are kept, the mask ends there, the rest is padding, and the row ended
    on its own (not truncated); rows without `stop` are as they were."""
    for i, ids in enumerate(full.completion_ids.tolist()):
        kept = int(cut.completion_mask[i].sum())
        assert cut.completion_ids[i, :kept].tolist() == ids[:kept]
        if stop not in tokenizer.decode(ids[:int(full.completion_mask[i].sum())]):
            assert_same_row(cut, full, i)
            continue
        assert stop in tokenizer.decode(ids[:kept]) and stop not in tokenizer.decode(ids[:kept - 1])
        assert stop in cut.texts[i] and not bool(cut.truncated[i])
        assert cut.completion_mask[i, :kept].all() and not cut.completion_mask[i, kept:].any()
        assert (cut.completion_ids[i, kept:] == tokenizer.pad_token_id).all()


def assert_same_row(a, b, i: int) -> None:
    width = min(a.completion_ids.shape[1], b.completion_ids.shape[1])
    assert torch.equal(a.completion_mask[i, :width], b.completion_mask[i, :width]) and a.texts[i] == b.texts[i]
    assert bool(a.truncated[i]) == bool(b.truncated[i])


# ---- what each option does ------------------------------------------------------------------------------
@pytest.mark.parametrize("truncation", [{"top_k": 1}, {"min_p": 0.999}], ids=["top_k=1", "min_p=0.999"])
def test_sampling_that_keeps_one_token_is_greedy(hf, prompts, greedy, plain, truncation):
    """top_k=1 keeps the likeliest token only, and so does min_p near 1: sampling at temperature 1 gives the greedy
    tokens, where plain sampling does not."""
    assert torch.equal(sample(hf, prompts, **truncation).completion_ids, greedy.completion_ids)
    assert not torch.equal(plain.completion_ids, greedy.completion_ids)


def test_repetition_penalty_pushes_down_tokens_already_seen(hf, prompts, greedy):
    """The tiny model's greedy completions repeat tokens; with a large penalty the likeliest token (top_k=1) is
    never one already in the prompt or the completion."""
    penalised = sample(hf, prompts, top_k=1, repetition_penalty=1e6).completion_ids.tolist()
    assert all(len(set(row)) < len(row) for row in greedy.completion_ids.tolist())
    for i, row in enumerate(penalised):
        assert len(set(row)) == len(row) and not set(row) & set(prompts[i // 2])


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_both_engines_sample_the_same_tokens_with_every_option(tiny, prompts):
    hf, compiled = engines(tiny)
    options = {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "min_p": 0.01, "repetition_penalty": 1.3}
    stop = sample(hf, prompts, **options).texts[0][4:7]
    assert_same_rollout(sample(compiled, prompts, **options, stop_strings=(stop,)),
                        sample(hf, prompts, **options, stop_strings=(stop,)))


def test_a_stop_string_ends_the_completion_at_its_first_occurrence(tiny, hf, prompts, plain):
    """The completion keeps the tokens up to the one that completes the stop string (so the string stays in it, as
    with vLLM's include_stop_str_in_output), the mask ends there, and every row is the same sample up to where it
    stops. A stop string acts before min_new_tokens too (that one holds back EOS only)."""
    assert bool(plain.completion_mask.all()) and bool(plain.truncated.all())
    stop = plain.texts[0][5:9]  # four characters in the middle of the first completion, likely across two tokens
    cut = sample(hf, prompts, stop_strings=(stop,))
    assert_ends_at_first_stop(tiny.tokenizer, plain, cut, stop)
    assert int(cut.completion_mask[0].sum()) < NEW


def test_greedy_ignores_sampling_options_but_not_stop_strings(tiny, hf, prompts, greedy):
    assert_same_rollout(sample(hf, prompts, greedy=True, top_k=5, repetition_penalty=9.0), greedy)
    stop = tiny.tokenizer.decode(greedy.completion_ids[0, :2])
    stopped = sample(hf, prompts, greedy=True, stop_strings=(stop,))
    assert_ends_at_first_stop(tiny.tokenizer, greedy, stopped, stop)
    assert int(stopped.completion_mask[0].sum()) <= 2


# ---- from the config -------------------------------------------------------------------------------------
def test_sampling_params_from_the_config(compose):
    sampling = SamplingParams.of(compose([*TINY_TRAINER, "rollout.top_k=null", "rollout.min_p=null"]).rollout)
    assert sampling == SamplingParams(max_new_tokens=6, temperature=0.8, top_p=1.0, top_k=0, min_p=0.0,
                                      repetition_penalty=1.0, stop_strings=())
    # the command line cannot type a newline: Hydra keeps `\n` as a backslash and an n, which is read as one
    cfg = compose([*TINY_TRAINER, "rollout.top_k=3", "rollout.min_p=0.1", "rollout.repetition_penalty=1.2",
                   r'rollout.stop=["\n\n", "</answer>", "a\\b"]'])
    assert SamplingParams.of(cfg.rollout) == SamplingParams(
        max_new_tokens=6, temperature=0.8, top_p=1.0, top_k=3, min_p=0.1, repetition_penalty=1.2,
        stop_strings=("\n\n", "</answer>", "a\\b"))
    assert validate(cfg) == []


@pytest.mark.slow
def test_the_trainer_samples_and_masks_as_the_config_says(compose, tmp_path):
    """trainer.generate passes rollout's options (top_k=1: the greedy tokens, newlines on this model; a stop
    string), and the loss mask of the step's batch ends at the stop string: such a completion ended on its own, so
    algo.mask_truncated keeps it in the loss."""
    trainer = make_trainer(compose, tmp_path, "rollout.top_k=1", 'rollout.stop=["\\n\\n"]', "algo.mask_truncated=true")
    batch = fixed_batch(trainer, lambda i, G: i % G)
    roll = batch.rollout
    ids = encode_prompts(trainer.tokenizer, trainer.sampler.batch(0), trainer.cfg.data.max_prompt_tokens).ids
    greedy = SamplingParams(greedy=True, max_new_tokens=trainer.roll.max_new_tokens,
                            min_new_tokens=trainer.roll.min_new_tokens, stop_strings=("\n\n",))
    assert_same_rollout(roll, trainer.engine.generate(ids, trainer.algo.num_generations, greedy))
    assert roll.texts == ["\n\n"] * len(roll.texts) and not roll.truncated.any()
    assert batch.mask.sum(dim=1).tolist() == [2.0] * len(roll.texts)


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_the_evaluator_stops_greedy_completions_and_samples_with_rollouts_options(compose, tiny, hf):
    """grpo-eval's greedy pass@1 ends at the stop strings and ignores the rest; its pass@k samples with rollout's
    options at eval.temperature (top_k=1 here: the greedy completions again)."""
    seen: list[list[str]] = []

    def judge(prompts, completions, **fields):
        seen.append(list(completions))
        return [0.0] * len(completions)

    def evaluate(*overrides) -> tuple[list[str], list[str]]:
        cfg = Config.of(compose([*TINY_TRAINER, "eval.samples=2", "rollout.top_k=1", "rollout.repetition_penalty=1.5",
                                 f"eval.max_new_tokens={NEW}", *overrides]))
        evaluator = Evaluator.from_config(cfg, tiny.tokenizer, rows)
        assert evaluator.sampling == replace(SamplingParams.of(cfg.rollout), max_new_tokens=NEW, min_new_tokens=0)
        evaluator.judge = judge  # records what it is given
        seen.clear()
        evaluator.run(hf)
        return seen[0], seen[1]

    rows = [{"messages": [{"role": "user", "content": q}]} for q in ("Hi", "What is 2 + 3?")]
    greedy, sampled = evaluate()
    assert sampled != [g for g in greedy for _ in range(2)]  # the penalty acts on sampling only
    stop = greedy[0][len(greedy[0]) // 2:][:3]
    stopped, sampled = evaluate("rollout.repetition_penalty=1.0", f'rollout.stop=["{stop}"]')
    assert sampled == [t for t in stopped for _ in range(2)]
    assert stop in stopped[0] and len(stopped[0]) < len(greedy[0])
    for full, cut in zip(greedy, stopped, strict=True):
        assert full.startswith(cut) and (cut == full if stop not in full else cut.index(stop) == full.index(stop))


# ---- the warning, and bad values -------------------------------------------------------------------------
OFF_POLICY = ["data.prompts_per_step=4", "algo.mini_batches=2"]


@pytest.mark.parametrize("overrides, warned", [
    (["rollout.top_k=20", *OFF_POLICY], "rollout.top_k=20"),
    (["rollout.min_p=0.05", "algo.num_iterations=2"], "rollout.min_p=0.05"),
    (["rollout.repetition_penalty=1.1", "rollout.top_p=0.9", *OFF_POLICY],
     "rollout.top_p=0.9, rollout.repetition_penalty=1.1"),
    (["rollout.top_k=20", "rollout.repetition_penalty=1.1"], None),  # on-policy: the ratio is exactly 1
    (['rollout.stop=["</answer>"]', *OFF_POLICY], None),  # a stop string only ends the completion
])
def test_reshaped_sampling_with_off_policy_updates_warns(compose, overrides, warned):
    warnings = [w for w in validate(compose([*TINY_TRAINER, *overrides])) if "full temperature softmax" in w]
    if warned is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and warnings[0].startswith(f"{warned} with algo.mini_batches or algo.num_iterations")
        assert "not the sampling one" in warnings[0]


@pytest.mark.parametrize("override, message", [
    ("rollout.top_k=-1", "rollout.top_k=-1 is invalid: needs an integer >= 0, or null"),
    ("rollout.top_k=2.5", "rollout.top_k=2.5 is invalid: needs an integer >= 0, or null"),
    ("rollout.min_p=1.5", "rollout.min_p=1.5 is invalid: needs 0 <= min_p <= 1, or null"),
    ("rollout.repetition_penalty=0", "rollout.repetition_penalty=0 is invalid: needs repetition_penalty > 0"),
    ('rollout.stop=[""]', "rollout.stop=[''] is invalid: needs a list of non-empty strings, e.g. 'rollout.stop="),
    ("rollout.stop=[1]", "rollout.stop=[1] is invalid: needs a list of non-empty strings"),
    ("rollout.stop=STOP", "rollout.stop=STOP is invalid: needs a list of non-empty strings"),
])
@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_bad_sampling_values_are_refused(compose, override, message):
    with pytest.raises(ConfigError) as err:
        validate(compose([*TINY_TRAINER, override]))
    assert str(err.value).startswith(message)


@pytest.mark.slow
def test_a_bad_stop_string_is_one_line_and_exit_2(tmp_path):
    proc = run_cli(["+recipe=quickstart", "model=tiny", 'rollout.stop=[""]'], tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "grpo-train: rollout.stop=[''] is invalid: needs a list of non-empty strings, e.g. "
        "'rollout.stop=[\"</answer>\"]' (quoted for the shell)"]


def test_the_cpu_draw_is_a_sample_of_the_warped_distribution():
    """On the CPU generate runs greedy over transformers' warpers and GumbelSample's noise: argmax(scores + Gumbel)
    is distributed as softmax(scores), which torch.multinomial draws elsewhere; a token a warper removed never comes."""
    from transformers import LogitsProcessorList

    from grpo_cli.rollout.common import GumbelSample, sampling_kwargs

    kwargs = sampling_kwargs(temperature=0.5, top_k=3, device=torch.device("cpu"))
    assert kwargs["do_sample"] is False and isinstance(kwargs["logits_processor"][-1], GumbelSample)
    assert sampling_kwargs(temperature=0.5, device=torch.device("meta"))["do_sample"] is True  # elsewhere: multinomial
    processors = LogitsProcessorList(kwargs["logits_processor"])
    logits = torch.tensor([[2.0, 1.0, 0.5, 3.0, -1.0]])
    torch.manual_seed(0)
    n = 20000
    draws = processors(None, logits.expand(n, 5).clone()).argmax(-1)
    freq = torch.bincount(draws, minlength=5).float() / n
    want = torch.zeros(5)
    top3 = logits[0].topk(3).indices
    want[top3] = torch.softmax(logits[0, top3] / 0.5, -1)
    assert freq[4] == 0 and freq[2] == 0  # outside the top 3
    assert (freq - want).abs().max() < 0.01, (freq, want)  # 4 binomial standard errors at n = 20000
