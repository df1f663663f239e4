"""The rollout seam: `hf` and `compiled` engines sample the same way; the merged inference copy computes the
policy and never touches the frozen base (the reference policy)."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import torch
from conftest import TINY_LORA_SHAPE, fixed_batch, randomise_lora, read_jsonl, run_cli, tiny_lora_policy

from grpo_cli.base.errors import ConfigError
from grpo_cli.config.schema import Config
from grpo_cli.model.loading import load_policy
from grpo_cli.rollout import HFEngine, SamplingParams, make_engine
from grpo_cli.rollout.compiled import CompiledEngine
from grpo_cli.run.validate import validate
from grpo_cli.step.evaluate import Evaluator
from grpo_cli.step.trainer import GRPOTrainer

TINY = ["+recipe=quickstart", "model=tiny", "rollout.max_new_tokens=6", "trainer.device=cpu"]
QUESTIONS = ("What is 2 + 3? Answer with just the number.", "Hi", "Name three colours of the rainbow, please.")


def chat_prompts(tokenizer, questions=QUESTIONS) -> list[list[int]]:
    return [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                    tokenize=False), add_special_tokens=False)["input_ids"]
            for q in questions]


@pytest.fixture(scope="module")
def tiny():
    return tiny_lora_policy()


def engines(lm, max_prompt_tokens: int = 64) -> tuple[HFEngine, CompiledEngine]:
    return (HFEngine(lm.model, lm.tokenizer, lm.device),
            CompiledEngine(lm.model, lm.tokenizer, lm.device, compile=False, max_prompt_tokens=max_prompt_tokens))


def assert_same_rollout(a, b) -> None:
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(a.completion_mask, b.completion_mask) and torch.equal(a.truncated, b.truncated)
    assert a.texts == b.texts and torch.equal(a.prompt_ids, b.prompt_ids) and not a.interrupted and not b.interrupted


# ---- config and the seam --------------------------------------------------------------------------
def test_engine_choice_from_config(compose, tiny):
    cfg = compose(TINY)
    assert cfg.rollout.engine == "auto" and cfg.rollout.compile == "auto"
    assert cfg.trainer.gradient_checkpointing is False
    assert isinstance(make_engine(cfg.rollout, tiny), HFEngine)  # auto on the CPU
    compiled = make_engine(compose([*TINY, "rollout.engine=compiled"]).rollout, tiny, max_prompt_tokens=32)
    assert isinstance(compiled, CompiledEngine) and compiled.compile is False and compiled.max_prompt_tokens == 32
    assert isinstance(make_engine(compose([*TINY, "rollout.engine=hf"]).rollout, tiny), HFEngine)


@pytest.mark.parametrize("override, message", [
    ("rollout.engine=sglang", "rollout.engine=sglang is invalid: use one of auto, compiled, hf, merged, vllm"),
    ("rollout.compile=sometimes", "rollout.compile=sometimes is invalid: use auto, true or false"),
    ("trainer.gradient_checkpointing=3", "trainer.gradient_checkpointing=3 is invalid: use true or false"),
])
def test_config_refuses_bad_engine_keys(compose, override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate(compose([*TINY, override]))


@pytest.mark.parametrize("option", ["rollout.vllm_dtype=float32", "rollout.vllm_max_model_len=512",
                                    "rollout.vllm_gpu_memory_utilization=0.5", "rollout.vllm_kv_cache_gib=2",
                                    "rollout.vllm_sync=lora"])
def test_a_vllm_option_without_vllm_is_one_line(compose, option):
    """The other engines never read them: set beside one, they would go unused."""
    key, value = option.split("=")
    with pytest.raises(ConfigError) as err:
        validate(compose([*TINY, option]))
    if key == "rollout.vllm_sync":  # a server is always given the adapter as a LoRA request
        assert str(err.value) == ("rollout.vllm_sync=lora is invalid: is read only with rollout.engine=vllm; add it "
                                  "or drop rollout.vllm_sync")
        return
    assert str(err.value) == (f"{key}={value} is invalid: is read only by vLLM (rollout.engine=vllm, or rollout."
                              f"placement=server); add one of them, or drop {key}")
    assert validate(compose([*TINY, "rollout.placement=server", option])) is not None  # the servers it starts


@pytest.mark.parametrize("adapter", ["model.lora.use_dora=true", "model.lora.modules_to_save=[lm_head]"])
def test_the_vllm_engine_refuses_an_adapter_its_merge_would_change(compose, adapter):
    """vLLM's weight sync merges B @ A * scaling into the base: DoRA's magnitudes and a trained copy of a module are
    left out, so it would sample from another policy (the merged and compiled engines refuse the same; auto takes hf).
    Said before the model loads, and before whether vLLM is installed here."""
    with pytest.raises(ConfigError) as err:
        validate(compose([*TINY, "rollout.engine=vllm", adapter]))
    assert str(err.value) == ("rollout.engine=vllm is invalid: samples from plain LoRA merged into the base, not from "
                              f"an adapter with {adapter}: it would sample from another policy than the one trained; "
                              "use rollout.engine=hf (or auto)")


# ---- the same tokens ------------------------------------------------------------------------------
def test_greedy_compiled_equals_hf_on_the_tiny_model(tiny):
    hf, compiled = engines(tiny)
    prompts = chat_prompts(tiny.tokenizer)
    assert_same_rollout(compiled.generate(prompts, 3, SamplingParams(max_new_tokens=12, greedy=True)),
                        hf.generate(prompts, 3, SamplingParams(max_new_tokens=12, greedy=True)))


@pytest.mark.slow
def test_greedy_compiled_equals_hf_on_the_embedded_model(config):
    lm = load_policy(config(["+recipe=quickstart", "trainer.device=cpu"]).model, "cpu")
    randomise_lora(lm.model, scale=0.01)
    hf, compiled = engines(lm)
    prompts = chat_prompts(lm.tokenizer)
    a = hf.generate(prompts, 2, SamplingParams(max_new_tokens=16, greedy=True))
    assert_same_rollout(compiled.generate(prompts, 2, SamplingParams(max_new_tokens=16, greedy=True)), a)
    assert any(len(t.strip()) > 3 for t in a.texts)


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_sampling_is_the_same_under_the_same_seed(tiny):
    """Temperature, top_p and min_new_tokens mean the same in both engines: same seed, same samples."""
    hf, compiled = engines(tiny)
    prompts = chat_prompts(tiny.tokenizer)[:2]
    sampling = SamplingParams(max_new_tokens=10, min_new_tokens=10, temperature=0.8, top_p=0.9)
    torch.manual_seed(7)
    a = hf.generate(prompts, 4, sampling)
    torch.manual_seed(7)
    b = compiled.generate(prompts, 4, sampling)
    torch.manual_seed(8)
    c = compiled.generate(prompts, 4, sampling)
    assert_same_rollout(b, a)
    assert not torch.equal(b.completion_ids, c.completion_ids)
    assert b.completion_ids.shape == (8, 10) and bool(b.completion_mask.all())  # min_new_tokens: no EOS early


def test_a_decode_step_that_fails_to_compile_costs_the_speed_up_not_the_run(tiny, capsys):
    """rollout.compile=auto: a compile failure (here a real one: a backend torch does not have) is one warning, and
    the engine generates uncompiled, exactly as with rollout.compile=false; rollout.compile=true raises it."""
    prompts = chat_prompts(tiny.tokenizer)
    expected = engines(tiny)[1].generate(prompts, 2, SamplingParams(max_new_tokens=5, greedy=True))
    broken = CompiledEngine(tiny.model, tiny.tokenizer, tiny.device, compile=True, max_prompt_tokens=64,
                            compile_fallback=True, compile_backend="no_such_backend")
    for _ in range(2):
        assert_same_rollout(broken.generate(prompts, 2, SamplingParams(max_new_tokens=5, greedy=True)), expected)
    warned = [line.split(": ", 1)[1] for line in capsys.readouterr().err.splitlines() if ": warning: " in line]
    assert len(warned) == 1 and warned[0].startswith("warning: rollout.compile=auto: compiling the decode step failed")
    assert "rollout.compile=false" in warned[0] and not broken.compile
    strict = CompiledEngine(tiny.model, tiny.tokenizer, tiny.device, compile=True, max_prompt_tokens=64,
                            compile_backend="no_such_backend")
    with pytest.raises(Exception, match="no_such_backend"):
        strict.generate(prompts, 2, SamplingParams(max_new_tokens=5, greedy=True))


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_compiled_engine_sizes_its_cache_once(tiny):
    """A smaller call reuses the first call's static cache (spare rows are padding) and still gives hf's tokens."""
    hf, compiled = engines(tiny, max_prompt_tokens=64)
    prompts = chat_prompts(tiny.tokenizer)
    compiled.generate(prompts, 3, SamplingParams(max_new_tokens=8, greedy=True))
    assert list(compiled.caches) == [(9, 64 + 8)]
    small = compiled.generate(prompts[1:], 2, SamplingParams(max_new_tokens=8, greedy=True))
    assert list(compiled.caches) == [(9, 64 + 8)]
    assert_same_rollout(small, hf.generate(prompts[1:], 2, SamplingParams(max_new_tokens=8, greedy=True)))
    compiled.generate(prompts[:1], 1, SamplingParams(max_new_tokens=20, greedy=True))  # longer: a second cache
    assert len(compiled.caches) == 2
    compiled.close()
    assert not compiled.caches


@pytest.mark.parametrize("which", ["hf", "compiled"])
@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_stop_ends_generation_early(tiny, which):
    engine = dict(zip(("hf", "compiled"), engines(tiny), strict=True))[which]
    prompts = chat_prompts(tiny.tokenizer)[:2]
    sampling = SamplingParams(max_new_tokens=40, min_new_tokens=40, greedy=True)
    full = engine.generate(prompts, 2, sampling, stop=lambda: False)
    assert full.completion_ids.shape[1] == 40 and not full.interrupted
    polls = itertools.count()
    cut = engine.generate(prompts, 2, sampling, stop=lambda: next(polls) >= 3)
    assert cut.interrupted and cut.completion_ids.shape[1] < 40
    assert torch.equal(cut.completion_ids, full.completion_ids[:, :cut.completion_ids.shape[1]])


# ---- the merged inference copy and the frozen base --------------------------------------------------
def compose_config(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from grpo_cli.config.compose import CONF_DIR, register_recipes

    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return Config.of(compose("config", overrides=overrides))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A trainer with rollout.engine=compiled after 3 real steps, and the base weights from before them."""
    cfg = compose_config([*TINY, "rollout.engine=compiled", "optimizer.lr=1e-2", "algo.beta=0.04"])
    trainer = GRPOTrainer(cfg)
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    lora_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    for step in range(3):
        trainer.update(step, varied_batch(trainer, step))
    return trainer, base_before, lora_before


def varied_batch(trainer: GRPOTrainer, step: int):
    """A real rollout with varied rewards (a random tiny model earns none: no gradient)."""
    return fixed_batch(trainer, lambda i, G: i % G, step)


@pytest.mark.slow  # three training updates
def test_frozen_base_is_bit_identical_after_training_with_compiled(trained):
    trainer, base_before, lora_before = trained
    assert isinstance(trainer.engine, CompiledEngine)
    after = dict(trainer.model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in base_before.items())
    assert any(not torch.equal(after[n], p) for n, p in lora_before.items())  # it did train
    merged = trainer.engine.inference_model()
    policy_weights = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    targets = trainer.engine.copy.targets
    assert targets and all(w.untyped_storage().data_ptr() not in policy_weights for w in targets.values())
    assert any(not torch.equal(targets[name], layer.get_base_layer().weight)
               for name, layer in trainer.engine.copy.layers.items())
    copied = trainer.engine.copy.layers.values()
    assert all(not isinstance(m, type(layer)) for m in merged.modules() for layer in copied)
    assert merged.get_input_embeddings().weight is trainer.model.get_input_embeddings().weight  # shared, not copied


@pytest.mark.slow  # three training updates
def test_merged_copy_gives_the_policy_logits_after_optimizer_steps(trained):
    trainer, _, _ = trained
    engine = trainer.engine
    ids = torch.tensor([chat_prompts(trainer.tokenizer)[0]])
    trainer.update(3, varied_batch(trainer, 3))  # an optimizer step: the copy is stale until the engine refreshes it
    with torch.no_grad():
        policy = trainer.model(input_ids=ids).logits
        stale = engine.copy.model(input_ids=ids).logits
        fresh = engine.inference_model()(input_ids=ids).logits
    assert engine.stale is False
    assert (stale - policy).abs().max() > 1e-4
    torch.testing.assert_close(fresh, policy, rtol=0, atol=1e-5)


def test_evaluator_gives_the_same_with_either_engine(config, tiny):
    cfg = config([*TINY, "eval.num_prompts=3", "eval.samples=2"])
    evaluator = Evaluator.for_training(cfg, tiny)
    hf, compiled = engines(tiny)
    results = []
    for engine in (hf, compiled, tiny.model):  # a bare model still works: wrapped in the hf engine
        torch.manual_seed(0)
        results.append(evaluator(engine))
    assert results[0] == results[1] == results[2]
    assert results[0]["eval/num_prompts"] == 3


def train_compiled(tmp_path, base: list[str], steps: int) -> tuple[Path, list[dict]]:
    """A `grpo-train` run of `steps` steps with the compiled engine: its run dir and its metrics rows."""
    run = tmp_path / "run"
    proc = run_cli([*base, f"trainer.max_steps={steps}", "rollout.engine=compiled", f"hydra.run.dir={run}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(steps))
    return run, rows


@pytest.mark.slow
def test_grpo_train_and_eval_with_the_compiled_engine(tmp_path):
    run, rows = train_compiled(tmp_path, TINY, 2)
    assert all(r["gen_compile_s"] == 0.0 for r in rows)  # no compile on CPU
    out = tmp_path / "eval"
    proc = run_cli([*TINY, "rollout.engine=compiled", "eval.num_prompts=2", f"eval.adapter={run / 'adapter'}",
                    f"hydra.run.dir={out}"], tmp_path, command="grpo-eval")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "eval.json").is_file()


# ---- CUDA (scripts/gpu_check.sh) --------------------------------------------------------------------
CUDA_TINY = ["+recipe=quickstart", "model=tiny", "rollout.max_new_tokens=16", "trainer.device=cuda"]


def teacher_forced_gap(model, roll) -> float:
    """Largest (max logp - chosen logp) over the real completion tokens, the completions fed back to `model`:
    0 for exact greedy decoding, small for greedy decoding with other rounding."""
    from grpo_cli.rollout import completion_logits

    with torch.no_grad():
        logits = completion_logits(model, roll, slice(0, roll.completion_ids.shape[0])).float()
    logp = logits.log_softmax(-1)
    chosen = logp.gather(-1, roll.completion_ids.unsqueeze(-1)).squeeze(-1)
    gap = logp.max(-1).values - chosen
    return float(gap[roll.completion_mask.bool()].max())


@pytest.mark.cuda
def test_cuda_compiled_engine_in_training(config, tmp_path):
    """bf16 on CUDA with the decode step compiled: compiled once, base bit-identical after 3 steps, the merged
    copy as close to an fp32 policy as the bf16 policy itself is, greedy decoding the policy's argmax."""
    cfg = config([*CUDA_TINY, "rollout.engine=auto", "optimizer.lr=1e-2"])
    trainer = GRPOTrainer(cfg)
    assert isinstance(trainer.engine, CompiledEngine) and trainer.engine.compile
    randomise_lora(trainer.model, scale=0.02)
    trainer.fresh_adapter = False  # policy != reference from the start
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    compile_after = []
    for step in range(3):
        metrics, _ = trainer.step(step)
        compile_after.append(trainer.engine.compile_s)
        assert metrics["gen_compile_s"] == (compile_after[0] if step == 0 else 0.0)
    assert compile_after[0] > 0 and compile_after[0] == compile_after[-1]
    trainer.update(3, varied_batch(trainer, 3))
    assert all(torch.equal(p, base_before[n]) for n, p in trainer.model.named_parameters() if "lora_" not in n)
    ids = torch.tensor([chat_prompts(trainer.tokenizer)[0]], device="cuda")
    reference = copy.deepcopy(trainer.model).float()
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        err_policy = float((trainer.model(input_ids=ids).logits.float() - want).abs().max())
        err_merged = float((trainer.engine.inference_model()(input_ids=ids).logits.float() - want).abs().max())
    assert err_merged <= 2 * err_policy + 1e-2 * float(want.abs().max()), (err_merged, err_policy)
    prompts = chat_prompts(trainer.tokenizer)
    greedy = SamplingParams(max_new_tokens=16, greedy=True)
    roll = trainer.engine.generate(prompts, 2, greedy)
    hf_roll = HFEngine(trainer.model, trainer.tokenizer, trainer.lm.device).generate(prompts, 2, greedy)
    assert teacher_forced_gap(trainer.model, roll) <= max(0.1, 4 * teacher_forced_gap(trainer.model, hf_roll))


def real_embedded_gguf() -> bool:
    """True when the embedded model's GGUF holds real weights (gpu_check.sh may lay out a tokenizer-only stand-in)."""
    try:
        from grpo_cli.model.loading import embedded_gguf

        folder, file = embedded_gguf("smollm2-135m")
        with open(Path(folder) / file, "rb") as f:
            return f.read(4) == b"GGUF"
    except Exception:
        return False


@pytest.mark.cuda
@pytest.mark.skipif(not real_embedded_gguf(), reason="the embedded GGUF is not here (or is gpu_check.sh's stand-in)")
def test_cuda_embedded_model_greedy_through_compiled(config):
    cfg = config(["+recipe=quickstart", "trainer.device=cuda"])
    lm = load_policy(cfg.model, "cuda")
    randomise_lora(lm.model, scale=0.01)
    engine = make_engine(cfg.rollout, lm, max_prompt_tokens=128)
    assert isinstance(engine, CompiledEngine)
    prompts = chat_prompts(lm.tokenizer)
    greedy = SamplingParams(max_new_tokens=24, greedy=True)
    roll = engine.generate(prompts, 2, greedy)
    hf_roll = HFEngine(lm.model, lm.tokenizer, lm.device).generate(prompts, 2, greedy)
    assert torch.equal(roll.completion_ids[:, 0], hf_roll.completion_ids[:, 0])
    assert teacher_forced_gap(lm.model, roll) <= max(0.1, 4 * teacher_forced_gap(lm.model, hf_roll))


@pytest.mark.cuda
def test_cuda_grpo_train_three_steps_compiled(tmp_path):
    _, rows = train_compiled(tmp_path, CUDA_TINY, 3)
    assert rows[0]["gen_compile_s"] > 0 and rows[1]["gen_compile_s"] == 0.0 and rows[2]["gen_compile_s"] == 0.0


# ---- merged: hf's generation on the inference copy (the CPU default) ------------------------------------------
@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_auto_on_the_cpu_is_merged_and_an_unmergeable_adapter_falls_back_to_hf(compose):
    import dataclasses

    from peft import LoraConfig, get_peft_model

    from grpo_cli.model.loading import load_base_model, load_tokenizer
    from grpo_cli.rollout import MergedEngine

    lm = tiny_lora_policy()
    assert type(make_engine(compose(TINY).rollout, lm)) is MergedEngine
    tokenizer = load_tokenizer("tiny-random")
    base = load_base_model("tiny-random", tokenizer, torch.float32, tiny=TINY_LORA_SHAPE)
    dora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True))
    assert type(make_engine(compose(TINY).rollout, dataclasses.replace(lm, model=dora))) is HFEngine


def test_the_merged_copy_computes_the_policys_logits_after_each_update():
    """The fast check that the inference copy follows the policy: after an update and policy_changed() its logits
    are the peft policy's (a copy left stale would keep the old policy's); before policy_changed() it is not
    refreshed at all."""
    from grpo_cli.rollout import MergedEngine

    lm = tiny_lora_policy()
    merged = MergedEngine(lm.model, lm.tokenizer, lm.device)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])

    def logits(model):
        with torch.no_grad():
            return model(input_ids=ids).logits

    torch.testing.assert_close(logits(merged.inference_model()), logits(lm.model), rtol=1e-5, atol=1e-5)
    old = logits(lm.model)
    for update in (1, 2):
        randomise_lora(lm.model, scale=0.2, seed=update)  # as an optimizer step would
        assert not torch.allclose(logits(lm.model), old, atol=1e-3)
        torch.testing.assert_close(logits(merged.copy.model), old)  # stale until told
        merged.policy_changed()
        torch.testing.assert_close(logits(merged.inference_model()), logits(lm.model), rtol=1e-5, atol=1e-5)
        old = logits(lm.model)


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_merged_samples_what_hf_samples_and_follows_the_policy():
    """Same seed, same tokens as hf (greedy and sampled); after the adapter changes, policy_changed() refreshes the
    copy and the tokens follow; the frozen base and the policy's own weights are never written."""
    from grpo_cli.rollout import MergedEngine

    lm = tiny_lora_policy()
    hf, merged = HFEngine(lm.model, lm.tokenizer, lm.device), MergedEngine(lm.model, lm.tokenizer, lm.device)
    prompts = chat_prompts(lm.tokenizer)
    before = {n: p.detach().clone() for n, p in lm.model.named_parameters()}

    def both(**options):
        out = []
        for engine in (hf, merged):
            torch.manual_seed(5)
            out.append(engine.generate(prompts, 3, SamplingParams(max_new_tokens=10, **options)))
        return out

    for options in ({"greedy": True}, {"temperature": 0.9, "top_p": 0.95}):
        assert_same_rollout(*both(**options))
    first = both(greedy=True)[1]
    randomise_lora(lm.model, scale=0.2, seed=1)  # as an optimizer step would
    stale = both(greedy=True)[1]
    assert torch.equal(stale.completion_ids, first.completion_ids)  # not refreshed yet: the old policy's tokens
    merged.policy_changed()
    now_hf, now_merged = both(greedy=True)
    assert_same_rollout(now_hf, now_merged)
    assert not torch.equal(now_merged.completion_ids, first.completion_ids)
    assert merged.sync_s > 0
    after = dict(lm.model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in before.items() if "lora_" not in n)


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_compiled_times_its_refresh_as_the_steps_sync():
    """gen_sync_s is the seconds of bringing the updated policy into the engine: for compiled, the copy's refresh
    after policy_changed(), and next to nothing when nothing changed."""
    lm = tiny_lora_policy()
    _, compiled = engines(lm)
    prompts = chat_prompts(lm.tokenizer)
    compiled.generate(prompts, 2, SamplingParams(max_new_tokens=4, greedy=True))
    refreshed = compiled.sync_s
    compiled.generate(prompts, 2, SamplingParams(max_new_tokens=4, greedy=True))
    assert 0 < compiled.sync_s < refreshed
