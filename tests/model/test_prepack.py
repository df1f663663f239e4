"""model.prepack: the frozen linear layers multiply through oneDNN-prepacked weights on the CPU, with the numbers of
plain `F.linear` to rounding, the same parameters, and the reference policy unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_trainer, randomise_lora, tiny_lora_policy

from grpo_cli.base.errors import ConfigError
from grpo_cli.model import prepack
from grpo_cli.model.prepack import PackedLinear, prepack_frozen_linears
from grpo_cli.rollout import completion_logprobs
from grpo_cli.rollout.logprobs import plain_head
from grpo_cli.run.validate import validate

pytestmark = pytest.mark.skipif(not prepack.available(torch.float32), reason="this torch build has no oneDNN linear")


def frozen_linear(dtype=torch.float32, bias=True) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(48, 80, bias=bias, dtype=dtype).requires_grad_(False)


@pytest.mark.parametrize("shape", [(5, 48), (3, 7, 48), (16, 1, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_values_and_input_gradient_equal_plain_linear(shape, bias):
    plain = frozen_linear(bias=bias)
    packed = PackedLinear.of(plain)
    x = torch.randn(shape, requires_grad=True)
    y_plain, y_packed = plain(x), packed(x)
    torch.testing.assert_close(y_packed, y_plain, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y_plain)
    (g_plain,), (g_packed,) = torch.autograd.grad(y_plain, x, dy), torch.autograd.grad(y_packed, x, dy)
    assert g_plain.abs().max() > 0
    torch.testing.assert_close(g_packed, g_plain, rtol=1e-5, atol=1e-5)
    assert packed._packs.keys() == {"forward", "backward"}  # the products did go through the packed weights


def test_the_same_parameters_and_state_dict_and_no_weight_gradient():
    plain = frozen_linear()
    packed = PackedLinear.of(plain)
    assert packed.weight is plain.weight and packed.bias is plain.bias
    assert list(packed.state_dict()) == ["weight", "bias"]
    packed(torch.randn(2, 48, requires_grad=True)).sum().backward()
    assert plain.weight.grad is None and plain.bias.grad is None


def test_an_in_place_change_of_the_weight_is_followed():
    plain = frozen_linear()
    packed = PackedLinear.of(plain)
    x = torch.randn(4, 48)
    packed(x)
    with torch.no_grad():
        plain.weight.add_(1.0)  # a checkpoint loaded into the base, an inference copy refreshed
    torch.testing.assert_close(packed(x), plain(x), rtol=1e-5, atol=1e-5)


def test_a_deep_copy_packs_its_own_weights():
    packed = PackedLinear.of(frozen_linear())
    x = torch.randn(4, 48)
    packed(x)
    clone = copy.deepcopy(packed)
    assert clone.weight is not packed.weight and not clone._packs
    with torch.no_grad():
        clone.weight.mul_(2.0)
    torch.testing.assert_close(clone(x), 2 * packed(x) - packed.bias, rtol=1e-5, atol=1e-5)


def test_trainable_or_other_dtypes_take_the_plain_product():
    trainable = PackedLinear.of(torch.nn.Linear(8, 4))
    trainable(torch.randn(2, 8)).sum().backward()
    assert trainable.weight.grad is not None and not trainable._packs
    half = PackedLinear.of(frozen_linear(dtype=torch.float16))
    half(torch.randn(2, 48, dtype=torch.float16))
    assert not half._packs


def test_only_the_frozen_base_layers_and_the_head_are_swapped():
    lm = tiny_lora_policy()
    swapped = prepack_frozen_linears(lm.model)
    packed = {n for n, m in lm.model.named_modules() if isinstance(m, PackedLinear)}
    lora_layers = {n for n, m in lm.model.named_modules() if hasattr(m, "lora_A")}
    assert swapped == len(packed) == len(lora_layers) + 1
    assert {n.rpartition(".")[0] for n in packed if n.endswith(".base_layer")} == lora_layers
    assert any(n.endswith("lm_head") for n in packed)
    assert not any("lora_" in n for n in packed)  # the adapter itself trains as before
    assert plain_head(lm.model) is lm.model.get_output_embeddings()  # the head pass, not the logits path


def test_policy_reference_and_gradients_equal_the_unpacked_model():
    lm_plain = tiny_lora_policy()
    lm_packed = copy.copy(lm_plain)
    lm_packed.model = copy.deepcopy(lm_plain.model)
    prepack_frozen_linears(lm_packed.model)
    g = torch.Generator().manual_seed(0)
    from grpo_cli.rollout import Rollout

    P, G, T = 2, 3, 5
    rollout = Rollout(prompt_ids=torch.randint(5, 100, (P, 6), generator=g),
                      prompt_mask=torch.ones(P, 6, dtype=torch.long),
                      completion_ids=torch.randint(5, 100, (P * G, T), generator=g),
                      completion_mask=torch.ones(P * G, T, dtype=torch.long),
                      truncated=torch.zeros(P * G, dtype=torch.bool), texts=[""] * (P * G), group_size=G)
    results = []
    for lm in (lm_plain, lm_packed):
        lm.model.zero_grad(set_to_none=True)
        logp, _ = completion_logprobs(lm.model, rollout, slice(0, P * G), 1.0, None)
        logp.sum().backward()
        with torch.no_grad(), lm.model.disable_adapter():
            ref, _ = completion_logprobs(lm.model, rollout, slice(0, P * G), 1.0, None)
        grads = torch.cat([p.grad.flatten() for p in lm.model.parameters() if p.grad is not None])
        results.append((logp.detach(), ref, grads))
    (lp0, ref0, g0), (lp1, ref1, g1) = results
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref1, ref0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g1, g0, rtol=1e-4, atol=1e-5)
    assert not torch.equal(lp1, ref1)  # the adapter acts: these are two policies
    assert lm_packed.model.get_output_embeddings()._packs.keys() == {"forward", "backward"}  # the head pass's products


def test_a_fresh_adapter_is_exactly_the_reference_with_packing():
    lm = tiny_lora_policy()
    with torch.no_grad():
        for name, p in lm.model.named_parameters():
            if "lora_B" in name:
                p.zero_()
    prepack_frozen_linears(lm.model)
    ids = torch.randint(5, 100, (3, 9))
    with torch.no_grad():
        policy = lm.model(input_ids=ids).logits
        with lm.model.disable_adapter():
            reference = lm.model(input_ids=ids).logits
    assert torch.equal(policy, reference)
    randomise_lora(lm.model)
    with torch.no_grad():
        assert not torch.equal(lm.model(input_ids=ids).logits, reference)


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_auto_packs_the_cpu_policy_and_false_does_not(compose, tmp_path):
    packed = make_trainer(compose, tmp_path, "trainer.max_steps=1")
    plain = make_trainer(compose, tmp_path, "trainer.max_steps=1", "model.prepack=false")
    assert any(isinstance(m, PackedLinear) for m in packed.model.modules())
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    metrics, _ = packed.step(0)
    assert metrics["kl"] == 0.0  # the first step's policy is the reference, bit for bit, packed too


def test_prepack_true_where_it_cannot_act_is_one_clear_error(compose):
    with pytest.raises(ConfigError, match=r"model\.prepack=true is invalid: needs the CPU, an unquantized base"):
        validate(compose(["+recipe=quickstart", "model=tiny", "model.prepack=true", "model.quantization=nf4"]))
    validate(compose(["+recipe=quickstart", "model=tiny", "model.prepack=true", "trainer.device=cpu"]))


def test_the_inference_copy_shares_the_heads_packed_weight_and_packs_its_merged_layers_anew():
    """The merged engine's copy shares the frozen LM head with the policy, and so its packed copy (one packed LM
    head in memory, not two); its merged layers have weights of their own and pack those."""
    from grpo_cli.rollout import MergedEngine

    lm = tiny_lora_policy()
    assert prepack_frozen_linears(lm.model) > 0
    copy_model = MergedEngine(lm.model, lm.tokenizer, lm.device).inference_model()
    head, copy_head = lm.model.get_output_embeddings(), copy_model.get_output_embeddings()
    assert copy_head.weight is head.weight and copy_head._packs is head._packs
    merged = [m for n, m in copy_model.named_modules() if isinstance(m, PackedLinear) and m is not copy_head]
    assert merged and all(m._packs is not head._packs for m in merged)
    x = torch.randn(3, head.in_features)
    torch.testing.assert_close(copy_head(x), torch.nn.functional.linear(x, head.weight, head.bias))


def test_the_lean_copy_holds_packed_weights_only_and_lets_go_of_them_while_the_policy_trains():
    """On the CPU the merged engine's copy keeps no plain merged weight (its layers multiply through the packed
    one), lets go of the packed ones when an update begins, and after the adapter changed gives the policy's
    logits again; the memory plan counts its layers by their shape while they are let go."""
    from grpo_cli.rollout import MergedEngine

    lm = tiny_lora_policy()
    prepack_frozen_linears(lm.model)
    engine = MergedEngine(lm.model, lm.tokenizer, lm.device)
    merged = list(engine.copy.plain.values())
    head = lm.model.get_output_embeddings()  # shared with the policy, packed at the first product
    shapes = sum(m.in_features * m.out_features * 4 for m in [*merged, head])
    assert engine.copy.lean and not any(m._packs for m in merged)  # nothing held before the first rollout
    assert prepack.pending_bytes(*engine.packed_models()) == shapes
    ids = torch.tensor([[5, 9, 3, 7, 11]])
    with torch.no_grad():
        torch.testing.assert_close(engine.inference_model()(input_ids=ids).logits, lm.model(input_ids=ids).logits,
                                   rtol=0, atol=1e-5)
    assert all(m.weight.numel() == 0 and m._packs["forward"][0] == prepack.PACKED_ONLY for m in merged)
    assert prepack.pending_bytes(*engine.packed_models()) == 0

    engine.update_begins()
    assert engine.stale and not any(m._packs for m in merged)
    randomise_lora(lm.model, seed=1)  # what an optimizer step does to the adapter
    engine.policy_changed()
    with torch.no_grad():
        policy = lm.model(input_ids=ids).logits
        torch.testing.assert_close(engine.inference_model()(input_ids=ids).logits, policy, rtol=0, atol=1e-5)
