"""The logits-free log-prob pass: chunked LM head + log-softmax over hidden states, against plain forwards."""

from __future__ import annotations

import pytest
import torch
from conftest import fixed_batch, tiny_lora_policy
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_cli import algorithm
from grpo_cli.model.loading import attach_lora, enable_activation_checkpointing, load_tokenizer
from grpo_cli.rollout import HFEngine, Rollout, SamplingParams, completion_logprobs, positions

CHUNKS = (1, 5, 64, None)


# ---- the autograd function alone --------------------------------------------------------------------
def _plain(hidden, weight, bias, tokens, temperature, with_entropy):
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if with_entropy:
        return algorithm.token_logprobs_and_entropy(logits, tokens, temperature=temperature)
    return algorithm.token_logprobs(logits, tokens, temperature=temperature), None


@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("temperature", (1.0, 0.7))
@pytest.mark.parametrize("entropy_in_loss", (False, True))
@pytest.mark.parametrize("trainable_head", (False, True))
def test_head_logprobs_equal_logits_path(chunk, temperature, entropy_in_loss, trainable_head):
    """Values and gradients (to the hidden states, and to a trainable head) equal autograd through full logits."""
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 3, 7, 16, 50
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=g)
    w_logp = torch.randn(B, T, generator=g, dtype=torch.float64)
    w_ent = torch.randn(B, T, generator=g, dtype=torch.float64)
    results = []
    for fn in ("plain", "chunked"):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_(trainable_head)
        b = bias.clone().requires_grad_(trainable_head)
        if fn == "plain":
            logp, ent = _plain(h, w, b, tokens, temperature, with_entropy=True)
        else:
            logp, ent = algorithm.head_token_logprobs(h, w, tokens, bias=b, temperature=temperature, chunk_size=chunk,
                                                      with_entropy=True)
        loss = (logp * w_logp).sum() + ((ent * w_ent).sum() if entropy_in_loss else 0.0)
        loss.backward()
        results.append((logp.detach(), ent.detach(), h.grad, w.grad, b.grad))
    (lp0, e0, gh0, gw0, gb0), (lp1, e1, gh1, gw1, gb1) = results
    assert lp1.dtype == torch.float32 and e1.dtype == torch.float32
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(e1, e0, rtol=1e-5, atol=1e-5)
    assert gh0.abs().max() > 0
    torch.testing.assert_close(gh1, gh0, rtol=1e-4, atol=1e-5)
    if trainable_head:
        torch.testing.assert_close(gw1, gw0, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(gb1, gb0, rtol=1e-4, atol=1e-5)
    else:
        assert gw1 is None and gb1 is None


def test_head_logprobs_without_entropy_and_without_grad():
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(2, 4, 8, generator=g), torch.randn(30, 8, generator=g)
    tokens = torch.randint(0, 30, (2, 4), generator=g)
    with torch.no_grad():
        logp, ent = algorithm.head_token_logprobs(hidden, weight, tokens, chunk_size=3)
    assert ent is None and not logp.requires_grad
    torch.testing.assert_close(logp, algorithm.token_logprobs(hidden @ weight.T, tokens), rtol=1e-5, atol=1e-5)


def test_head_logprobs_refuse_bad_shapes():
    with pytest.raises(ValueError, match="weight must be"):
        algorithm.head_token_logprobs(torch.zeros(1, 2, 8), torch.zeros(5, 7), torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        algorithm.head_token_logprobs(torch.zeros(1, 2, 8), torch.zeros(5, 8), torch.zeros(1, 2, dtype=torch.long),
                                      chunk_size=0)


# ---- on a real (tiny) peft policy, against a plain full-sequence forward -----------------------------
@pytest.fixture(scope="module")
def policy():
    lm = tiny_lora_policy()  # an adapter that changes the policy (a fresh one has B = 0)
    model, tokenizer = lm.model, lm.tokenizer
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("What is 2 + 3? Answer:", "Hi")]
    torch.manual_seed(0)
    roll = HFEngine(model, tokenizer).generate(prompts, 3, SamplingParams(max_new_tokens=9, temperature=1.0))
    roll.completion_mask[1, 4:] = 0  # an early EOS: padding after it must not change real positions
    return model, roll


def full_sequence_logprobs(model, roll: Rollout, temperature: float):
    """The plainest reference: each row's prompt + completion in one forward, full logits, log-softmax."""
    G, Lp = roll.group_size, roll.prompt_ids.shape[1]
    owner = torch.arange(roll.completion_ids.shape[0]) // G
    p_mask = roll.prompt_mask[owner]
    ids = torch.cat([roll.prompt_ids[owner], roll.completion_ids], dim=1)
    mask = torch.cat([p_mask, roll.completion_mask], dim=1)
    T = roll.completion_ids.shape[1]
    pos = torch.cat([positions(p_mask), p_mask.sum(1, keepdim=True) + torch.arange(T)], dim=1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, Lp - 1:Lp - 1 + T]
    return algorithm.token_logprobs_and_entropy(logits, roll.completion_ids, temperature=temperature)


def _lora_grads(model):
    return torch.cat([p.grad.flatten() for n, p in model.named_parameters() if "lora_" in n])


@pytest.mark.parametrize("temperature", (1.0, 0.7))
@pytest.mark.parametrize("with_entropy", (False, True))
@pytest.mark.parametrize("unpadded", (False, True), ids=("shared_prompt", "unpadded"))
@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_completion_logprobs_equal_full_forward(policy, temperature, with_entropy, unpadded):
    model, roll = policy
    model.train()
    rows = slice(0, roll.completion_ids.shape[0])
    real = roll.completion_mask.bool()
    model.zero_grad(set_to_none=True)
    ref_logp, ref_ent = full_sequence_logprobs(model, roll, temperature)
    (ref_logp * roll.completion_mask).sum().backward()
    ref_grad = _lora_grads(model)
    assert ref_grad.abs().max() > 0
    for chunk in CHUNKS:
        model.zero_grad(set_to_none=True)
        logp, ent = completion_logprobs(model, roll, rows, temperature, chunk, with_entropy, unpadded=unpadded)
        (logp * roll.completion_mask).sum().backward()
        torch.testing.assert_close(logp[real], ref_logp[real], rtol=1e-5, atol=1e-5)
        assert not unpadded or not logp[~real].any()  # the unpadded pass computes nothing at padding: 0
        if with_entropy:
            torch.testing.assert_close(ent[real], ref_ent[real], rtol=1e-5, atol=1e-4)
        else:
            assert ent is None
        torch.testing.assert_close(_lora_grads(model), ref_grad, rtol=1e-4, atol=1e-5 * float(ref_grad.abs().max()))


def test_micro_batch_rows_and_reference_policy(policy):
    """Rows that start inside a group, and the adapter disabled (the reference policy), match too."""
    model, roll = policy
    with torch.no_grad():
        full, _ = full_sequence_logprobs(model, roll, 1.0)
        part, _ = completion_logprobs(model, roll, slice(2, 5), 1.0, 4)
        with model.disable_adapter():
            ref_full, _ = full_sequence_logprobs(model, roll, 1.0)
            ref_part, _ = completion_logprobs(model, roll, slice(2, 5), 1.0, 4)
    real = roll.completion_mask[2:5].bool()
    torch.testing.assert_close(part[real], full[2:5][real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref_part[real], ref_full[2:5][real], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(part[real], ref_part[real])


def uneven_rollout(model, tokenizer) -> Rollout:
    """Three prompts of different lengths (left padding), two completions each, of six different lengths."""
    texts = ("What is 2 + 3? Answer:", "Hi", "Name a colour, then a number, then an animal:")
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    torch.manual_seed(1)
    roll = HFEngine(model, tokenizer).generate(prompts, 2, SamplingParams(max_new_tokens=12, min_new_tokens=12,
                                                                          temperature=1.0))
    for row, length in enumerate((12, 3, 7, 1, 10, 5)):
        roll.completion_mask[row, length:] = 0
    return roll


@pytest.mark.parametrize("with_entropy", (False, True))
def test_the_unpadded_pass_equals_the_padded_pass_on_uneven_completions(policy, with_entropy):
    """Log-probs, entropy and LoRA gradients of the unpadded pass (no padding computed, causal attention within
    each sequence) equal the shared-prompt pass's (padding and a mask) to rounding, the reference policy's too."""
    model, _ = policy
    roll = uneven_rollout(model, load_tokenizer("tiny-random"))
    real, rows = roll.completion_mask.bool(), slice(0, 6)
    model.train()
    out = []
    for unpadded in (False, True):
        model.zero_grad(set_to_none=True)
        logp, ent = completion_logprobs(model, roll, rows, 0.9, 5, with_entropy, unpadded=unpadded)
        (logp * roll.completion_mask * torch.linspace(-1, 1, 12)).sum().backward()
        with torch.no_grad(), model.disable_adapter():
            ref, _ = completion_logprobs(model, roll, slice(1, 5), 1.0, None, unpadded=unpadded)
        out.append((logp.detach(), ent, _lora_grads(model), ref))
    (lp0, e0, g0, r0), (lp1, e1, g1, r1) = out
    torch.testing.assert_close(lp1[real], lp0[real], rtol=1e-5, atol=1e-5)
    assert not lp1[~real].any()
    if with_entropy:
        torch.testing.assert_close(e1[real], e0[real], rtol=1e-5, atol=1e-4)
    assert g0.abs().max() > 0
    torch.testing.assert_close(g1, g0, rtol=1e-4, atol=1e-5 * float(g0.abs().max()))
    torch.testing.assert_close(r1[real[1:5]], r0[real[1:5]], rtol=1e-5, atol=1e-5)


def test_the_unpadded_pass_is_chosen_where_it_costs_less(policy):
    """One long prompt shared by short completions: the shared-prompt pass; long completions: the unpadded one."""
    from grpo_cli.rollout.logprobs import unpadded_pays

    model, _ = policy

    def rollout(prompt: int, completion: int) -> Rollout:
        return Rollout(torch.ones(1, prompt, dtype=torch.long), torch.ones(1, prompt, dtype=torch.long),
                       torch.ones(8, completion, dtype=torch.long), torch.ones(8, completion, dtype=torch.long),
                       torch.zeros(8, dtype=torch.bool), [""] * 8, 8)

    assert not unpadded_pays(model, rollout(60, 16), slice(0, 8))
    assert unpadded_pays(model, rollout(60, 1024), slice(0, 8))
    uneven = rollout(60, 1024)
    uneven.completion_mask[1:, 64:] = 0  # one long completion pads seven short ones
    assert unpadded_pays(model, uneven, slice(0, 8))


def test_gradient_checkpointing_gives_the_same_values_and_grads(policy):
    model, roll = policy
    model.train()
    rows = slice(0, roll.completion_ids.shape[0])
    out = []
    for checkpointing in (False, True):
        if checkpointing:
            enable_activation_checkpointing(model)
        model.zero_grad(set_to_none=True)
        logp, _ = completion_logprobs(model, roll, rows, 0.8, 16)
        (logp * roll.completion_mask).sum().backward()
        out.append((logp.detach(), _lora_grads(model)))
    (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    real = roll.completion_mask.bool()
    torch.testing.assert_close(out[1][0][real], out[0][0][real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1][1], out[0][1], rtol=1e-4, atol=1e-5 * float(out[0][1].abs().max()))


class LargestVocabTensor(TorchDispatchMode):
    """Records the largest tensor with a vocabulary-sized last dimension that any op produces."""

    def __init__(self, vocab: int, skip_storage: set[int]):
        super().__init__()
        self.vocab, self.skip, self.largest = vocab, skip_storage, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab \
                    and t.untyped_storage().data_ptr() not in self.skip:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_op_holds_the_logits_of_more_than_one_chunk(policy):
    """Forward and backward of the pass: no tensor of `positions x vocab` beyond one chunk's is ever made."""
    model, roll = policy
    model.train()
    head = model.get_output_embeddings()
    V, chunk = head.weight.shape[0], 4
    rows = slice(0, roll.completion_ids.shape[0])
    with LargestVocabTensor(V, {head.weight.untyped_storage().data_ptr()}) as seen:
        logp, _ = completion_logprobs(model, roll, rows, 1.0, chunk, with_entropy=True)
        logp.sum().backward()
    assert 0 < seen.largest <= chunk * V
    with LargestVocabTensor(V, {head.weight.untyped_storage().data_ptr()}) as old_path:  # what the logits path makes
        logits = model(input_ids=roll.completion_ids).logits
        algorithm.token_logprobs(logits, roll.completion_ids, chunk_size=chunk).sum().backward()
    assert old_path.largest >= roll.completion_ids.numel() * V


# ---- CUDA (scripts/gpu_check.sh): bf16, self-calibrated against fp32 --------------------------------

def _qwen_like(tokenizer, dtype, layers=2):
    """Qwen2.5-0.5B's widths (hidden 896, vocab 151936, GQA 14/2) with few layers: random, no hub."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


@pytest.mark.cuda
def test_cuda_bf16_logprob_pass_matches_full_forward_and_saves_memory():
    tokenizer = load_tokenizer("tiny-random")
    device = torch.device("cuda")
    lora = []
    for dtype in (torch.float32, torch.bfloat16):
        model = attach_lora(_qwen_like(tokenizer, dtype), 16, 32, 0.0, "all-linear").to(device)
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        lora.append(model)
    prompts = [tokenizer(f"Question {i}: what is {i} + {i}?", add_special_tokens=False)["input_ids"] for i in range(4)]
    torch.manual_seed(0)
    roll = HFEngine(lora[0], tokenizer, device).generate(prompts, 4,
                                                         SamplingParams(max_new_tokens=48, min_new_tokens=48))
    rows, real = slice(0, 16), roll.completion_mask.bool()
    ref, _ = full_sequence_logprobs(lora[0], roll, 1.0)
    ref = ref.detach()
    bf16 = lora[1]
    bf16.train()
    full, _ = full_sequence_logprobs(bf16, roll, 1.0)
    err_full = float((full.detach() - ref)[real].abs().max())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logp, _ = completion_logprobs(bf16, roll, rows, 1.0, 256, with_entropy=True)
    logp.sum().backward()
    chunked_peak = torch.cuda.max_memory_allocated() - base
    err_chunked = float((logp.detach() - ref)[real].abs().max())
    assert err_chunked <= 2 * err_full + 1e-2, (err_chunked, err_full)
    bf16.zero_grad(set_to_none=True)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    full, _ = full_sequence_logprobs(bf16, roll, 1.0)
    full.sum().backward()
    full_peak = torch.cuda.max_memory_allocated() - base
    assert chunked_peak < full_peak / 2, (chunked_peak, full_peak)


@pytest.mark.slow
def test_trainer_with_gradient_checkpointing_gives_the_same_update(compose, tmp_path):
    from grpo_cli.config.schema import Config
    from grpo_cli.step.trainer import GRPOTrainer

    grads = []
    batch = None
    for checkpointing in ("false", "true"):
        cfg = compose(["+recipe=quickstart", "model=tiny", "rollout.max_new_tokens=6", "trainer.device=cpu",
                       "optimizer.lr=1e-30", f"trainer.gradient_checkpointing={checkpointing}"])
        trainer = GRPOTrainer(Config.of(cfg))
        if batch is None:
            batch = fixed_batch(trainer, lambda i, G: i % G)
        assert trainer.model.get_base_model().get_decoder().gradient_checkpointing is (checkpointing == "true")
        trainer.update(0, batch)
        grads.append(torch.cat([p.grad.flatten() for p in trainer.params]))
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-5 * float(grads[0].abs().max()))


@pytest.mark.parametrize("with_checkpointing", (False, True))
@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_a_trainable_head_takes_the_logits_path(policy, with_checkpointing):
    """A head that trains (here: the tied embedding unfrozen) is not folded into the chunked head pass; the
    logits path gives the same values and a gradient for the head."""
    from grpo_cli.rollout.logprobs import plain_head

    model, roll = policy
    head = model.get_output_embeddings()
    model.train()
    head.weight.requires_grad_(True)
    try:
        if with_checkpointing:
            enable_activation_checkpointing(model)
        assert plain_head(model) is None
        model.zero_grad(set_to_none=True)
        logp, ent = completion_logprobs(model, roll, slice(0, roll.completion_ids.shape[0]), 0.9, 4, with_entropy=True)
        (logp * roll.completion_mask).sum().backward()
        assert head.weight.grad is not None and head.weight.grad.abs().max() > 0
        with torch.no_grad():
            ref, ref_ent = full_sequence_logprobs(model, roll, 0.9)
        real = roll.completion_mask.bool()
        torch.testing.assert_close(logp[real], ref[real], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent[real], ref_ent[real], rtol=1e-5, atol=1e-4)
    finally:
        head.weight.requires_grad_(False)
        head.weight.grad = None
        if with_checkpointing:
            (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    assert plain_head(model) is head
