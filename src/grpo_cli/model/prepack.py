"""`model.prepack`: the frozen linear layers of the base run on weights prepacked for oneDNN, on the CPU.

A GRPO step on the CPU is mostly matrix products with the frozen base's weights: every decode step of the rollout
(16 rows at a time), the reference pass, and the policy's forward and backward through the base under its LoRA
adapter. oneDNN multiplies faster from a weight it has laid out once in its own blocked format (what torch.compile's
CPU freezing and IPEX do), most at the decode step's few rows and for the LM head (the speed-ups, measured with
scripts/bench.py: docs/results/step-phases.md). The base never changes while training, so the layout is made once.

`PackedLinear` is an `nn.Linear` with the same weight and bias parameters (state dicts, peft, ties and merges see
the very same tensors) that multiplies through the packed copy when the weight is frozen and on the CPU. The
copy follows the weight: an in-place change (a checkpoint loaded into the base, an inference copy refreshed)
bumps the tensor's version and the next forward packs again. Its gradient with respect to the input goes through
a packed copy of the transposed weight, made at the first backward (the adapter's training only). The numbers are
fp32 (or bf16) products in another order: equal to `F.linear` to rounding, not bit for bit.
"""

from __future__ import annotations

import copy

import torch

SETTINGS = ("auto", True, False)
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
PACKED_ONLY = "packed only"  # the version of a pack whose plain weight was let go (PackedLinear.pack_only)


def available(dtype: torch.dtype) -> bool:
    """oneDNN's packed linear exists in this torch build for `dtype` (bf16 needs the CPU's bf16 support)."""
    if dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise") or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def wanted(setting, device: torch.device, dtype: torch.dtype, quantization: str | None) -> bool:
    """Whether `model.prepack` (auto | true | false) packs this base: auto = on the CPU, unquantized, where oneDNN
    has the dtype. true where it cannot is refused by the config check, not here."""
    if setting is False or quantization is not None or device.type != "cpu":
        return False
    return available(dtype)


def _frozen(linear: torch.nn.Linear) -> bool:
    return not linear.weight.requires_grad and (linear.bias is None or not linear.bias.requires_grad)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def _packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class _FrozenLinear(torch.autograd.Function):
    """y = x W^T + b through the packed W; dx = dy W through the packed W^T; no gradient for W or b (frozen)."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        return layer.product(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        return ctx.layer.product_back(dy), None


class PackedLinear(torch.nn.Linear):
    """An `nn.Linear` over the same parameters whose frozen CPU products go through oneDNN-packed weights."""

    # direction -> (the weight's version, or PACKED_ONLY; its data_ptr; the packed weight)
    _packs: dict[str, tuple[int | str, int, torch.Tensor]]

    @classmethod
    def of(cls, linear: torch.nn.Linear) -> PackedLinear:
        """A PackedLinear sharing `linear`'s weight and bias (no copy of the plain weights)."""
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.weight, layer.bias = linear.weight, linear.bias
        layer._packs = {}
        return layer

    def packed(self, direction: str) -> torch.Tensor:
        """The packed weight (`forward`) or transposed weight (`backward`), packed again when the weight changed."""
        version = self.weight._version
        found = self._packs.get(direction)
        if found is not None and found[0] == PACKED_ONLY:
            return found[2]
        if found is None or found[0] != version or found[1] != self.weight.data_ptr():
            weight = self.weight if direction == "forward" else self.weight.t().contiguous()
            found = (version, self.weight.data_ptr(), _pack(weight))
            self._packs[direction] = found
        return found[2]

    def pack_only(self, weight: torch.Tensor) -> None:
        """Multiply by `weight` through its packed copy alone, holding no plain weight: for a layer that is only
        ever multiplied with, forward and without a gradient (the CPU inference copy's merged layers), where the
        plain weight would double the layer's memory. `weight` is packed now; `self.weight` keeps its dtype and
        device but no elements."""
        self._packs = {"forward": (PACKED_ONLY, 0, _pack(weight))}
        self.weight.data = weight.new_empty(0)

    def release(self) -> None:
        """Let go of the weight and its packs (a packed-only layer until `pack_only` gives it a weight again)."""
        self._packs = {}
        self.weight.data = self.weight.data.new_empty(0)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T + b through the packed weight (a frozen layer on the CPU only)."""
        return _packed_product(x, self.packed("forward"), self.bias)

    def product_back(self, d: torch.Tensor) -> torch.Tensor:
        """d W through the packed transposed weight (a frozen layer on the CPU only)."""
        return _packed_product(d.contiguous(), self.packed("backward"), None)

    def frozen_on_cpu(self, x: torch.Tensor) -> bool:
        w = self.weight
        return _frozen(self) and w.device.type == "cpu" and x.dtype == w.dtype and w.dtype in PACKABLE_DTYPES \
            and x.dim() >= 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.frozen_on_cpu(x):
            return super().forward(x)
        if torch.is_grad_enabled() and x.requires_grad:
            return _FrozenLinear.apply(x, self)
        return self.product(x)

    def __deepcopy__(self, memo):
        """A copy without copies of the packed tensors (oneDNN's opaque tensors cannot be copied): a copy that
        shares the weight (the inference copy's LM head) shares its packs too, any other packs its own."""
        clone = type(self).__new__(type(self))
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy({k: v for k, v in self.__dict__.items() if k != "_packs"}, memo))
        clone._packs = self._packs if clone.weight is self.weight else {}
        return clone


def prepack_frozen_linears(model: torch.nn.Module) -> int:
    """Swap every plain `nn.Linear` of `model` whose parameters are frozen for a PackedLinear over the same
    parameters (inside peft's LoRA layers: their base layers; the LM head); returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and _frozen(child):
                setattr(parent, name, PackedLinear.of(child))
                swapped += 1
    return swapped


def pending_bytes(*models: tuple[torch.nn.Module, tuple[str, ...]]) -> int:
    """Bytes the packed copies of these models will take once used, beyond what is packed now: for each (model,
    directions), every PackedLinear's weight once per direction it has not packed yet ("forward" for inference,
    "backward" too for a model that trains). A weight shared between models (the LM head of the inference copy)
    counts once; oneDNN's blocked layout is the weight's size, give or take its padding."""
    seen: set[tuple[int, str]] = set()
    total = 0
    for model, directions in models:
        for module in model.modules():
            if not isinstance(module, PackedLinear):
                continue
            for direction in directions:
                key = (module.weight.data_ptr() or id(module), direction)  # 0: a weight let go
                if key not in seen and direction not in module._packs:
                    seen.add(key)  # by the layer's shape: a packed-only layer holds no plain weight to count
                    total += module.in_features * module.out_features * module.weight.element_size()
    return total
