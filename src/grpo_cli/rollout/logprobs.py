"""The log-prob pass: per-token log-probs (and entropy) of a Rollout's completions under a model.

The decoder runs each prompt once (not once per completion) and the completions on top of its KV cache;
the LM head, log-softmax and gather then run over blocks of positions (`algorithm.head_token_logprobs`),
so the logits `[rows, T, V]` of the batch never exist, neither in the forward nor in the backward.
"""

from __future__ import annotations

import dataclasses

import torch

from grpo_cli import algorithm
from grpo_cli.model.prepack import PackedLinear
from grpo_cli.rollout.common import Rollout, cache_kwarg, hf_model, output_cache, positions, prefill


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
    `rows` (what the LM head turns into `completion_logits`), the shared-prompt way: prompts run once each and their
    KV cache is indexed out to the rows, as in `completion_logits`; the completions attend through a mask (padding
    and the prompt). Under gradient checkpointing, which drops the KV cache while training, `completion_logprobs`
    takes `unpadded_hidden` instead."""
    decoder = hf_model(model).get_decoder()
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


def real_lengths(rollout: Rollout, rows: slice) -> tuple[list[int], list[int]]:
    """(prompt length, completion length) of each row of `rows`: its real tokens, no padding."""
    G = rollout.group_size
    prompt = rollout.prompt_mask.sum(dim=1).tolist()
    completion = rollout.completion_mask[rows].sum(dim=1).tolist()
    return [int(prompt[i // G]) for i in range(rows.start, rows.stop)], [int(n) for n in completion]


def unpadded_hidden(model, rollout: Rollout, rows: slice) -> torch.Tensor:
    """The decoder's final hidden states [N, H] at the positions that predict the real completion tokens of `rows`
    (N of them, row after row): what `completion_hidden` gives at its real positions, computed without padding.

    Each row runs as its own sequence, its prompt's real tokens then its completion's, so no padding token is
    computed and attention is plain causal (SDPA's `is_causal`, no mask) within each sequence. Rows of equal length
    run as one batch. The prompt is run once per row, not once per group: this pays where completions are long
    and uneven (see `unpadded_pays`)."""
    decoder = hf_model(model).get_decoder()
    G = rollout.group_size
    prompt_lengths, lengths = real_lengths(rollout, rows)
    by_length: dict[int, list[int]] = {}
    for r, (lp, lc) in enumerate(zip(prompt_lengths, lengths, strict=True)):
        if lc:
            by_length.setdefault(lp + lc - 1, []).append(r)
    found: dict[int, torch.Tensor] = {}
    for width, members in by_length.items():
        ids = []
        for r in members:
            i, lp = rows.start + r, prompt_lengths[r]
            prompt = rollout.prompt_ids[i // G][rollout.prompt_mask[i // G].bool()]
            ids.append(torch.cat([prompt, rollout.completion_ids[i, :width - lp + 1][:-1]]))
        batch = torch.stack(ids)
        positions_ = torch.arange(width, device=batch.device).expand(len(members), -1)
        hidden = decoder(input_ids=batch, position_ids=positions_, use_cache=False).last_hidden_state
        for k, r in enumerate(members):
            found[r] = hidden[k, prompt_lengths[r] - 1:]
    if not found:
        return torch.zeros((0, hf_model(model).config.get_text_config().hidden_size), device=rollout.prompt_ids.device)
    return torch.cat([found[r] for r in sorted(found)])


def unpadded_pays(model, rollout: Rollout, rows: slice) -> bool:
    """Whether `unpadded_hidden` costs less than the shared-prompt pass for `rows`, by a FLOP count of each (R rows,
    prompts P_i, completions C_i, padded widths P_pad and T_pad):

        shared:    decoder tokens P_pad * groups + R * T_pad, the head at R * T_pad positions,
                   masked attention over R * T_pad * (P_pad + T_pad) query-key pairs
        unpadded:  decoder tokens sum_i (P_i + C_i) (each prompt once per row), the head at sum_i C_i positions,
                   causal attention over sum_i (P_i + C_i)^2 / 2 pairs

    A token costs 2 FLOPs per decoder weight, a head position 2 per head weight, a query-key pair 4 per layer and
    attention width; attention runs at 0.7 (masked: every block) and 0.55 (causal) of the products' speed (SDPA's CPU
    kernels against oneDNN at 1024 tokens: docs/results/long-completions.md). Short completions of one prompt favour
    sharing it, long or uneven ones the unpadded pass."""
    inner = hf_model(model)
    config = inner.config.get_text_config()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_pair = 4.0 * config.num_hidden_layers * heads * head_dim
    decoder = inner.get_decoder()
    per_token = 2.0 * sum(p.numel() for p in getattr(decoder, "layers", decoder).parameters())  # not the embedding
    per_position = 2.0 * inner.get_output_embeddings().weight.numel()
    prompt_lengths, lengths = real_lengths(rollout, rows)
    G, R = rollout.group_size, rows.stop - rows.start
    groups = (rows.stop - 1) // G - rows.start // G + 1
    p_pad, t_pad = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    shared = per_token * (p_pad * groups + R * t_pad) + per_position * R * t_pad \
        + per_pair * R * t_pad * (p_pad + t_pad) / 0.7
    unpadded = per_token * (sum(prompt_lengths) + sum(lengths)) + per_position * sum(lengths) \
        + per_pair * sum((p + c) ** 2 / 2 for p, c in zip(prompt_lengths, lengths, strict=True)) / 0.55
    return unpadded < shared


def full_sequence_hidden(model, rollout: Rollout, rows: slice) -> torch.Tensor:
    """What `completion_hidden` gives, from one decoder call over each row's prompt and completion (no KV cache)."""
    ids, mask, pos = full_sequence(rollout, rows)
    out = hf_model(model).get_decoder()(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
    return out.last_hidden_state[:, rollout.prompt_ids.shape[1] - 1:]


def widened(rollout: Rollout) -> Rollout:
    """The rollout with one more completion column, masked out: the same log-probs at its real tokens."""
    pad = torch.nn.functional.pad
    return dataclasses.replace(rollout, completion_ids=pad(rollout.completion_ids, (0, 1)),
                               completion_mask=pad(rollout.completion_mask, (0, 1)))


def completion_logprobs(model, rollout: Rollout, rows: slice, temperature: float, chunk_size: int | None,
                        with_entropy: bool = False, unpadded: bool | None = None,
                        uniform: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs [R, T] (and entropy, else None) of the completion tokens of `rows` under `model`
    (a peft model answers for the policy, or for the reference inside `disable_adapter()`); padding positions hold
    0 in the unpadded pass and a padded token's value in the shared-prompt pass: masks leave them out.

    `unpadded`: run `unpadded_hidden` (True), the shared-prompt pass (False), or whichever `unpadded_pays` (None);
    under gradient checkpointing always the unpadded pass (it needs no KV cache). The head, log-softmax and gather
    run on the real completion tokens only in the unpadded pass; both give the same numbers to rounding.
    `uniform` (a sharded base, whose every decoder call is a collective): the same calls whatever the rows, on every
    rank: the shared-prompt pass (two calls: a one-column completion is widened) or under gradient checkpointing one
    call over prompt and completion."""
    if uniform and rollout.completion_ids.shape[1] == 1:
        logp, entropy = completion_logprobs(model, widened(rollout), rows, temperature, chunk_size, with_entropy,
                                            uniform=True)
        return logp[:, :1], None if entropy is None else entropy[:, :1]
    tokens = rollout.completion_ids[rows]
    head = plain_head(model)
    if head is None:
        logits = completion_logits(model, rollout, rows)
        if with_entropy:
            return algorithm.token_logprobs_and_entropy(logits, tokens, temperature=temperature, chunk_size=chunk_size)
        return algorithm.token_logprobs(logits, tokens, temperature=temperature, chunk_size=chunk_size), None
    if uniform:
        hidden = full_sequence_hidden(model, rollout, rows) if checkpointing(model) else \
            completion_hidden(model, rollout, rows)
        return _head_logprobs(head, hidden, tokens, temperature, chunk_size, with_entropy)
    if checkpointing(model) or (unpadded if unpadded is not None else unpadded_pays(model, rollout, rows)):
        real = rollout.completion_mask[rows].bool()
        hidden = unpadded_hidden(model, rollout, rows)[None]
        logp, entropy = _head_logprobs(head, hidden, tokens[real][None], temperature, chunk_size, with_entropy)
        return _scattered(logp[0], real), None if entropy is None else _scattered(entropy[0], real)
    hidden = completion_hidden(model, rollout, rows)
    return _head_logprobs(head, hidden, tokens, temperature, chunk_size, with_entropy)


def _head_logprobs(head, hidden, tokens, temperature, chunk_size, with_entropy):
    products = algorithm.HeadProducts(head.product, head.product_back) \
        if isinstance(head, PackedLinear) and head.frozen_on_cpu(hidden) else None
    return algorithm.head_token_logprobs(hidden, head.weight, tokens, bias=head.bias, temperature=temperature,
                                         chunk_size=chunk_size, with_entropy=with_entropy, products=products)


def _scattered(values: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """[R, T] with `values` (one per real position, row after row) at the real positions, 0 elsewhere."""
    out = values.new_zeros(real.shape)
    out[real] = values
    return out
