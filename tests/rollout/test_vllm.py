"""rollout.engine=vllm: the engine samples the policy being trained (greedy equal to the hf engine's after an
update), its seeds reproduce, the episode loop runs over it, a 2-step grpo-train run with the sampler correction,
and the refusals; and rewards.judge.Judge against vLLM's own OpenAI-compatible server of the embedded model.
Skipped where vllm is not importable (the main venv); `make test-vllm` runs them in .venv-vllm.

The tiny model here has one attention head (head_dim 64): vLLM's CPU attention has no kernel for the default
tiny model's head_dim 16."""

from __future__ import annotations

import pytest
import torch
from conftest import randomise_lora, read_jsonl, run_cli, vllm_servers
from test_engines import chat_prompts

from grpo_cli.base.errors import ConfigError
from grpo_cli.model.loading import LoadedModel, attach_lora, load_base_model, load_tokenizer
from grpo_cli.rollout import HFEngine, SamplingParams
from grpo_cli.rollout.episodes import EpisodeSetup, run_episodes
from grpo_cli.rollout.tools import ToolFormat
from grpo_cli.run.validate import validate

pytest.importorskip("vllm")
from grpo_cli.rollout.vllm import VLLMEngine, merged_weights  # noqa: E402

pytestmark = pytest.mark.slow  # one vLLM engine start per module (~10-25 s on 2 cores)
ONE_HEAD = ["model=tiny", "model.tiny.num_heads=1"]


@pytest.fixture(scope="module")
def lm():
    tokenizer = load_tokenizer("tiny-random")
    base = load_base_model("tiny-random", tokenizer, torch.float32, tiny={"hidden_size": 64, "num_layers": 2,
                                                                          "num_heads": 1})
    base.generation_config.pad_token_id = tokenizer.pad_token_id
    model = attach_lora(base, 8, 16, 0.0, "all-linear")
    randomise_lora(model, 0.5)
    return LoadedModel(model, tokenizer, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def engine(lm):
    engine = VLLMEngine(lm.model, lm.tokenizer, lm.device, dtype=torch.float32, max_model_len=256, kv_cache_gib=0.25)
    yield engine
    engine.close()


def test_greedy_equals_hf_before_and_after_an_update(lm, engine):
    prompts, hf = chat_prompts(lm.tokenizer), HFEngine(lm.model, lm.tokenizer, lm.device)
    greedy = SamplingParams(max_new_tokens=8, greedy=True)
    before = engine.generate(prompts, 2, greedy)
    assert torch.equal(before.completion_ids, hf.generate(prompts, 2, greedy).completion_ids)
    base = {k: v.clone() for k, v in lm.model.get_base_model().state_dict().items() if "lora_" not in k}
    randomise_lora(lm.model, 0.5, seed=7)  # what an optimizer step does to the adapter
    engine.policy_changed()
    after = engine.generate(prompts, 2, SamplingParams(max_new_tokens=8, greedy=True))
    want = hf.generate(prompts, 2, SamplingParams(max_new_tokens=8, greedy=True))
    assert not torch.equal(after.completion_ids, before.completion_ids)  # the update changed the policy's output
    assert torch.equal(after.completion_ids, want.completion_ids)
    assert torch.equal(after.completion_mask, want.completion_mask)
    assert engine.sync_s > 0
    for key, tensor in lm.model.get_base_model().state_dict().items():  # the frozen base is never written
        if key in base:
            assert torch.equal(tensor, base[key]), key


def test_sampler_logprobs_are_the_policys(lm, engine):
    from grpo_cli.rollout import completion_logprobs

    torch.manual_seed(0)
    roll = engine.generate(chat_prompts(lm.tokenizer), 2, SamplingParams(max_new_tokens=6, temperature=1.0))
    with torch.no_grad():
        trainer = completion_logprobs(lm.model, roll, slice(0, roll.completion_ids.shape[0]), 1.0, None)[0]
    real = roll.completion_mask.bool()
    assert float((trainer - roll.sampler_logprobs)[real].abs().max()) < 1e-3


def test_seeds_reproduce_and_differ(lm, engine):
    prompts = chat_prompts(lm.tokenizer)
    draws = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        draws.append(engine.generate(prompts, 3, SamplingParams(max_new_tokens=8, top_k=50, min_p=0.01)).completion_ids)
    assert torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[0], draws[2])


def test_stop_strings_end_completions(lm, engine):
    torch.manual_seed(3)
    free = engine.generate(chat_prompts(lm.tokenizer), 2, SamplingParams(max_new_tokens=12))
    word = lm.tokenizer.decode(free.completion_ids[0, 2:3])
    torch.manual_seed(3)  # the same draw, now ended at its third token's text
    roll = engine.generate(chat_prompts(lm.tokenizer), 2, SamplingParams(max_new_tokens=12, stop_strings=(word,)))
    assert word in roll.texts[0] and int(roll.completion_mask[0].sum()) <= 3


def test_episode_loop_runs_over_the_engine(lm, engine):
    rows = [{"messages": [{"role": "user", "content": "What is 2 * 5? Use the multiply tool."}]}]
    fmt = ToolFormat(lm.tokenizer)
    greedy, setup = SamplingParams(max_new_tokens=10, greedy=True), EpisodeSetup(fmt, max_tool_calls=1)
    got = run_episodes(engine, rows, 2, greedy, setup)
    want = run_episodes(HFEngine(lm.model, lm.tokenizer, lm.device), rows, 2, greedy, setup)
    assert torch.equal(got.completion_ids, want.completion_ids) and got.texts == want.texts


def test_merged_weights_name_the_plain_model(lm):
    merged = merged_weights(lm.model, torch.float32)
    plain = set(lm.model.get_base_model().state_dict()) - {k for k in lm.model.state_dict() if "lora_" in k}
    assert {k.replace(".base_layer.", ".") for k in plain if "lora_" not in k} == set(merged)


@pytest.mark.parametrize("variant", [{"use_dora": True}, {"modules_to_save": ["lm_head"]}], ids=["dora", "saved"])
def test_an_adapter_the_sync_would_change_is_refused_before_vllm_starts(compose, variant):
    """An adapter given as it is (a program's LoadedModel), past the config's check: the sync's merge leaves DoRA's
    magnitudes and a trained module copy out."""
    tokenizer = load_tokenizer("tiny-random")
    base = load_base_model("tiny-random", tokenizer, torch.float32, tiny={"hidden_size": 64, "num_layers": 2,
                                                                          "num_heads": 1})
    model = attach_lora(base, 8, 16, 0.0, "all-linear", **variant)
    lm = LoadedModel(model, tokenizer, torch.device("cpu"), torch.float32)
    with pytest.raises(ConfigError, match=r"^rollout.engine=vllm .*: it would sample from another policy than the one "
                                          r"trained; use rollout.engine=hf \(or auto\)$"):
        VLLMEngine.from_config(compose(ONE_HEAD).rollout, lm)


def test_refusals(compose):
    with pytest.raises(ConfigError, match="algo.sampler_correction"):
        validate(compose([*ONE_HEAD, "algo.sampler_correction=token_mask"]))  # hf: no sampler log-probs
    with pytest.raises(ConfigError, match="rollout.engine"):
        validate(compose([*ONE_HEAD, "rollout.engine=vllm", "model.quantization=nf4"]))
    with pytest.raises(ConfigError, match="vespo"):
        validate(compose([*ONE_HEAD, "rollout.engine=vllm", "algo.objective=vespo", "algo.loss_type=dapo",
                          "algo.sampler_correction=token_truncate"]))


def test_two_step_run(tmp_path):
    run = tmp_path / "run"
    proc = run_cli(["+recipe=quickstart", *ONE_HEAD, "rollout.engine=vllm", "rollout.vllm_kv_cache_gib=0.25",
             "rollout.max_new_tokens=8", "trainer.max_steps=2", "trainer.device=cpu", "algo.num_generations=4",
             "data.prompts_per_step=2", "algo.sampler_correction=token_truncate", "eval.final=false",
             f"hydra.run.dir={run}"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["gen_sync_s"] == 0.0 and rows[1]["gen_sync_s"] > 0  # step 1 samples the updated policy
    assert all(r["sampler/logp_diff_max"] < 1e-3 for r in rows)  # fp32 both sides: the same distribution
    assert (run / "adapter" / "adapter_config.json").is_file()


def test_lora_sync_samples_the_policy(lm):
    """rollout.vllm_sync=lora: vLLM holds the base and each request carries the saved adapter (built from a trained,
    non-zero adapter: it is applied once, not on top of merged weights)."""
    prompts, hf = chat_prompts(lm.tokenizer), HFEngine(lm.model, lm.tokenizer, lm.device)
    engine = VLLMEngine(lm.model, lm.tokenizer, lm.device, dtype=torch.float32, max_model_len=256, kv_cache_gib=0.25,
                        sync="lora")
    try:
        for seed in (11, 12):
            randomise_lora(lm.model, 0.5, seed=seed)
            engine.policy_changed()
            got = engine.generate(prompts, 2, SamplingParams(max_new_tokens=8, greedy=True))
            expected = hf.generate(prompts, 2, SamplingParams(max_new_tokens=8, greedy=True))
            assert torch.equal(got.completion_ids, expected.completion_ids)
            assert engine.sync_s > 0
    finally:
        engine.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """vLLM's OpenAI-compatible server (vllm.entrypoints.openai.api_server, what `vllm serve` runs) of the embedded
    model on the CPU, on a free port of 127.0.0.1; its base URL."""
    folder = tmp_path_factory.mktemp("smollm2")
    tokenizer = load_tokenizer("embedded:smollm2-135m")
    load_base_model("embedded:smollm2-135m", tokenizer, torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with vllm_servers(folder, folder, ["--served-model-name", "smollm2", "--max-model-len", "1024"], {},
                      timeout_s=420) as [(url, _)]:
        yield url


def test_the_judge_scores_through_vllms_openai_server(served):
    """The 135M model is no judge, but its replies come back as chat completions: each one with a score in it is
    that score / 10, each one without is an error of its completion (reward.on_error=zero: 0 and counted). Greedy,
    one request at a time, so the replies asked for again below are the judge's."""
    from grpo_cli.rewards import RewardFunction, RewardSet
    from grpo_cli.rewards.judge import Judge, parse_score

    template = ('Give a score from 0 to 10 to this answer. Start your reply with "Score:".\nQuestion: {question}\n'
                "Answer: {completion}")
    judge = Judge(url=served, model="smollm2", template=template, max_tokens=12, concurrency=1)
    questions = ["What is 2 + 2?", "What is the capital of France?", "What is 3 times 3?", "Name a color."]
    completions = ["4", "Paris", "The answer is 12.", "Blue"]
    messages = [[{"role": "user", "content": q}] for q in questions]

    def reply(completion: str, chat: list) -> str:
        asked = [{"role": "user", "content": judge.request("", completion, chat, {})}]
        answer = judge.service.post({"model": "smollm2", "messages": asked, **judge.sampling})
        return answer["choices"][0]["message"]["content"]

    replies = [reply(c, m) for c, m in zip(completions, messages, strict=True)]
    assert all(isinstance(r, str) and r.strip() for r in replies), replies
    expected = [parse_score(r, 10) for r in replies]
    assert any(e is not None for e in expected), replies  # "Score: N" comes back for some
    totals, _, errors = RewardSet([RewardFunction("judge", judge, 1.0)], on_error="zero").score(
        ["p"] * 4, completions, {"messages": messages})
    assert totals == [0.0 if e is None else e / 10 for e in expected], replies
    assert errors == sum(e is None for e in expected)
