"""The log-prob pass: per-token log-probs (and entropy) of a Rollout's completions under a model.

The decoder runs each prompt once (not once per completion) and the completions on top of its KV cache;
the LM head, log-softmax and gather then run over blocks of positions (`algorithm.head_token_logprobs`),
so the logits `[rows, T, V]` of the batch never exist, neither in the forward nor in the backward.
"""

from __future__ import annotations

import torch

from grpo_cli import algorithm
from grpo_cli.prepack import PackedLinear
from grpo_cli.rollout.common import Rollout, cache_kwarg, hf_model, output_cache, positions, prefill


def loss_mask(rollout: Rollout) -> torch.Tensor:
    """The tokens that the loss, the ratio, the KL, the entropy and every token count see: those the model sampled.

    For an episode (`episodes.Episodes`) that is its `model_mask`: tool and environment tokens are in the sequence
    and in `completion_mask`, so the pass attends to them, but they are never trained on nor counted. For a
    single-turn Rollout every real completion token is the model's: its `completion_mask`."""
    model_mask = getattr(rollout, "model_mask", None)
    return rollout.completion_mask if model_mask is None else model_mask


def checkpointing(model) -> bool:
    """Gradient checkpointing is on and the model trains: transformers then drops the KV cache (5.17 even
    without grad), so a pass must run prompt and completion as one sequence."""
    decoder = hf_model(model).get_decoder()
    return decoder.training and any(getattr(m, "gradient_checkpointing", False) is True for m in decoder.modules())


def full_sequence(rollout: Rollout, rows: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, mask, positions) of each row's prompt + completion[:-1], with the positions and mask the cached
    pass uses, so that both give the same values."""
    G = rollout.group_size
    owner = torch.arange(rows.start, rows.stop, device=rollout.prompt_ids.device) // G
    p_ids, p_mask = rollout.prompt_ids[owner], rollout.prompt_mask[owner]
    c_ids, c_mask = rollout.completion_ids[rows], rollout.completion_mask[rows]
    c_pos = p_mask.sum(dim=1, keepdim=True) + torch.arange(c_ids.shape[1] - 1, device=c_ids.device)
    return (torch.cat([p_ids, c_ids[:, :-1]], dim=1), torch.cat([p_mask, c_mask], dim=1)[:, :-1],
            torch.cat([positions(p_mask), c_pos], dim=1))


def completion_logits(model, rollout: Rollout, rows: slice) -> torch.Tensor:
    """Logits [R, T, V] that predict the completion tokens of `rows`, computed only at completion positions.

    The prompts of `rows` are run once each (not once per completion) and their KV cache is indexed out
    to the rows; the gradient through the shared prompt pass is the sum over its rows, as with copies.
    Used only for models whose head is not a plain linear layer (see `plain_head`)."""
    G = rollout.group_size
    if checkpointing(model):
        ids, mask, pos = full_sequence(rollout, rows)
        width = rollout.prompt_ids.shape[1]
        return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits[:, width - 1:]
    first, last = rows.start // G, (rows.stop - 1) // G
    p_ids, p_mask = rollout.prompt_ids[first:last + 1], rollout.prompt_mask[first:last + 1]
    prompt_logits, cache = prefill(model, p_ids, p_mask)
    owner = torch.arange(rows.start, rows.stop, device=p_ids.device) // G - first
    cache.reorder_cache(owner)
    c_ids = rollout.completion_ids[rows]
    first_logits = prompt_logits[owner]
    if c_ids.shape[1] == 1:
        return first_logits
    full_mask = torch.cat([p_mask[owner], rollout.completion_mask[rows]], dim=1)
    c_pos = p_mask[owner].sum(dim=1, keepdim=True) + torch.arange(c_ids.shape[1] - 1, device=c_ids.device)
    out = model(input_ids=c_ids[:, :-1], attention_mask=full_mask[:, :-1], position_ids=c_pos,
                **{cache_kwarg(model): cache}, use_cache=True)
    return torch.cat([first_logits, out.logits], dim=1)


def plain_head(model) -> torch.nn.Linear | None:
    """The LM head when logits are exactly `head(decoder(x))` with a frozen linear head, else None.

    None for a trainable or adapted head (LoRA on lm_head, modules_to_save) and for models that scale or
    soft-cap their logits after the head (Gemma 2/3, Cohere): those take the logits path."""
    inner = hf_model(model)
    head = inner.get_output_embeddings()
    config = inner.config.get_text_config() if hasattr(inner.config, "get_text_config") else inner.config
    if type(head) not in (torch.nn.Linear, PackedLinear) or head.weight.requires_grad:
        return None
    if (head.bias is not None and head.bias.requires_grad) or getattr(config, "final_logit_softcapping", None) \
            or getattr(config, "logit_scale", None) not in (None, 1, 1.0):
        return None
    return head


def completion_hidden(model, rollout: Rollout, rows: slice) -> torch.Tensor:
    """The decoder's final hidden states [R, T, H] at the positions that predict the completion tokens of
    `rows` (what the LM head turns into `completion_logits`).

    Prompts run once each and their KV cache is indexed out to the rows, as in `completion_logits`. Under
    gradient checkpointing (which drops the KV cache while training) each row runs prompt and completion in
    one sequence instead, with the same positions and mask, so the result is the same."""
    decoder = hf_model(model).get_decoder()
    if checkpointing(model):
        ids, mask, pos = full_sequence(rollout, rows)
        out = decoder(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
        return out.last_hidden_state[:, rollout.prompt_ids.shape[1] - 1:]
    G = rollout.group_size
    first, last = rows.start // G, (rows.stop - 1) // G
    p_ids, p_mask = rollout.prompt_ids[first:last + 1], rollout.prompt_mask[first:last + 1]
    owner = torch.arange(rows.start, rows.stop, device=p_ids.device) // G - first
    c_ids, c_mask = rollout.completion_ids[rows], rollout.completion_mask[rows]
    T = c_ids.shape[1]
    c_pos = p_mask[owner].sum(dim=1, keepdim=True) + torch.arange(T - 1, device=c_ids.device)
    full_mask = torch.cat([p_mask[owner], c_mask], dim=1)[:, :-1]
    out = decoder(input_ids=p_ids, attention_mask=p_mask, position_ids=positions(p_mask), use_cache=True)
    first_hidden = out.last_hidden_state[:, -1:][owner]
    if T == 1:
        return first_hidden
    cache = output_cache(out)
    cache.reorder_cache(owner)
    rest = decoder(input_ids=c_ids[:, :-1], attention_mask=full_mask, position_ids=c_pos,
                   **{cache_kwarg(model): cache}, use_cache=True).last_hidden_state
    return torch.cat([first_hidden, rest], dim=1)


def completion_logprobs(model, rollout: Rollout, rows: slice, temperature: float, chunk_size: int | None,
                        with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs [R, T] (and entropy, else None) of the completion tokens of `rows` under `model`
    (a peft model answers for the policy, or for the reference inside `disable_adapter()`)."""
    tokens = rollout.completion_ids[rows]
    head = plain_head(model)
    if head is None:
        logits = completion_logits(model, rollout, rows)
        if with_entropy:
            return algorithm.token_logprobs_and_entropy(logits, tokens, temperature=temperature, chunk_size=chunk_size)
        return algorithm.token_logprobs(logits, tokens, temperature=temperature, chunk_size=chunk_size), None
    hidden = completion_hidden(model, rollout, rows)
    products = algorithm.HeadProducts(head.product, head.product_back) \
        if isinstance(head, PackedLinear) and head.frozen_on_cpu(hidden) else None
    return algorithm.head_token_logprobs(hidden, head.weight, tokens, bias=head.bias, temperature=temperature,
                                         chunk_size=chunk_size, with_entropy=with_entropy, products=products)
