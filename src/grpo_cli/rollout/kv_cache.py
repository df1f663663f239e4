"""A KV cache whose room for the rollout is reserved once, so that a decode step writes its token in place.

transformers' DynamicCache grows each layer's keys and values with `torch.cat` at every decode step: a copy of the whole
cache per token, O(L) work and a fresh allocation of the cache's size per layer per step, a cost that grows with the
context (docs/results/long-completions.md). `reserve` moves each layer of a prefilled DynamicCache into a buffer with
room for `extra` more tokens; attention then reads a view of the filled part, so its cost stays what attention over L
keys costs. The values are the same tensors' values: the tokens drawn are identical (tested against the plain cache).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class ReservedLayer(DynamicLayer):
    """A DynamicLayer whose keys and values live in a buffer with room reserved ahead; `update` writes in place and
    grows (by another `extra`) only when the room runs out. Everything else (reorder, select, repeat, crop) is
    DynamicLayer's, on the views, and the next update moves the result into a fresh buffer."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, extra: int):
        super().__init__()
        self.device, self.is_initialized, self.extra = keys.device, True, max(1, extra)
        self._move_into_buffer(keys, values)

    def _move_into_buffer(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        b, h, n, d = keys.shape
        self._keys = keys.new_empty((b, h, n + self.extra, d))
        self._values = values.new_empty((b, h, n + self.extra, d))
        self._keys[:, :, :n].copy_(keys)
        self._values[:, :, :n].copy_(values)
        self.keys, self.values = self._keys[:, :, :n], self._values[:, :, :n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = self.keys, self.values
        # built filled, and DynamicLayer's reorder, select, repeat and crop keep tensors (only its reset empties them)
        assert keys is not None and values is not None
        n, m = keys.shape[-2], key_states.shape[-2]
        holds_views = keys.data_ptr() == self._keys.data_ptr() and keys.shape[0] == self._keys.shape[0]
        if not holds_views or n + m > self._keys.shape[-2]:  # replaced by a reorder/select, or out of room
            self._move_into_buffer(keys, values)
        self._keys[:, :, n:n + m].copy_(key_states)
        self._values[:, :, n:n + m].copy_(value_states)
        self.keys, self.values = self._keys[:, :, :n + m], self._values[:, :, :n + m]
        return self.keys, self.values


def reserve(cache, extra: int):
    """`cache` (a DynamicCache of plain DynamicLayers, as `prefill` returns) with every layer moved into a
    ReservedLayer with room for `extra` more tokens; a cache of any other kind (sliding windows, a static cache) is
    returned as it is."""
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer or not layer.is_initialized for layer in layers):
        return cache
    cache.layers = [ReservedLayer(layer.keys, layer.values, extra) for layer in layers]
    return cache
