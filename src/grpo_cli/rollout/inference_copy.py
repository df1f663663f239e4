"""The merged inference copy that the `merged` and `compiled` engines generate from: the policy with its LoRA
adapter folded into separate copies of the adapted weights, the frozen base untouched."""

from __future__ import annotations

import time
from typing import cast

import torch

from grpo_cli.base.errors import ModelLoadError
from grpo_cli.model.prepack import PackedLinear


def merge_obstacle(peft_model) -> str | None:
    """What keeps the adapter of `peft_model` from a plain merge (a LoRA variant such as DoRA, a layer that is not
    linear, a trainable copy from modules_to_save), phrased to follow "rollout.engine=NAME"; None if nothing."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in peft_model.get_base_model().named_modules():
        if isinstance(module, BaseTunerLayer):
            if type(module) is not LoraLinear or any(module.lora_variant.get(a) for a in module.active_adapters):
                return f"merges plain LoRA on linear layers only; {name} is a {type(module).__name__}"
        elif name and type(module).__name__ == "ModulesToSaveWrapper":
            return f"cannot merge the trainable copy of {name} (modules_to_save)"
    return None


class InferenceCopy:
    """A plain transformers model for generation that computes what the peft policy computes, without the
    per-layer LoRA detour: each LoRA-wrapped linear layer becomes an ordinary linear layer whose weight is
    `base + scaling * B @ A` (in float32, then rounded once to the base dtype).

    Only those merged weights are new memory; embeddings, norms, the LM head and every other frozen tensor
    are shared with the policy, and nothing of the policy is ever written: its frozen base is the reference
    policy and stays bit-exact. `refresh()` recomputes the merged weights in place (same storage, so a
    captured CUDA graph stays valid) and must run after each optimizer step that changed the adapter.

    `lean` (the `merged` engine on the CPU, where the adapted layers are model.prepack's PackedLinear): each merged
    layer holds only its packed weight, made at `refresh()`, and `release()` lets go of them all until the next
    `refresh()`, which recomputes every merged weight anyway; so between rollouts, while the policy trains, the
    copy takes no memory of its own (in fp32 the embedded model's adapted layers are 0.42 GB, and as many again
    packed).
    """

    def __init__(self, peft_model, engine: str = "merged", lean: bool = False):
        import copy

        from peft.tuners.lora import Linear as LoraLinear

        obstacle = merge_obstacle(peft_model)
        if obstacle:
            raise ModelLoadError(f"rollout.engine={engine} {obstacle}; use rollout.engine=hf")
        inner = peft_model.get_base_model()
        # the tuner layers: with no obstacle, every one is a plain LoRA Linear (merge_obstacle)
        self.layers = {name: m for name, m in inner.named_modules() if isinstance(m, LoraLinear)}
        memo = {id(t): t for t in (*inner.parameters(), *inner.buffers())}  # share everything ...
        for layer in self.layers.values():
            del memo[id(layer.get_base_layer().weight)]                    # ... but the weights that get merged
        model = copy.deepcopy(inner, memo)
        self.plain: dict[str, torch.nn.Linear] = {}  # the merged layers: plain linear layers of the copy
        for name in self.layers:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            plain = getattr(parent, child).get_base_layer()
            plain.weight.requires_grad_(False)
            setattr(parent, child, plain)
            self.plain[name] = plain
        model.generation_config = inner.generation_config  # shared too: EOS ids and defaults are the policy's
        self.model = model.eval()
        self.lean = lean and all(isinstance(m, PackedLinear) and m.weight.device.type == "cpu"
                                 for m in self.plain.values())
        if self.lean:
            self.release()
        else:
            self.refresh()

    @property
    def targets(self) -> dict[str, torch.Tensor]:
        """The merged weights, by layer name."""
        return {name: plain.weight for name, plain in self.plain.items()}

    @torch.no_grad()
    def refresh(self) -> None:
        for name, layer in self.layers.items():
            if layer.merged:
                raise ModelLoadError(f"{name} has its adapter merged in place; the reference policy is lost")
            merged = cast(torch.Tensor, layer.get_base_layer().weight).float()
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    merged = merged + layer.get_delta_weight(adapter).float()
            target = self.plain[name]
            if self.lean:
                cast(PackedLinear, target).pack_only(merged.to(target.weight.dtype))  # lean: all PackedLinear
            else:
                target.weight.copy_(merged)

    def release(self) -> None:
        """A lean copy lets go of its merged layers until the next `refresh()`; any other keeps them."""
        if self.lean:
            for plain in self.plain.values():
                cast(PackedLinear, plain).release()  # lean: all PackedLinear


class FollowsThePolicy:
    """What the engines that generate from an InferenceCopy (merged, compiled) share: the copy is marked stale by
    `policy_changed()` and refreshed before the next generation, whose `sync_s` (the step's `gen_sync_s`) times it.
    A plain model (grpo-eval of a base) has nothing to merge and is generated from as it is."""

    sync_s = 0.0

    def follow(self, model, engine: str, lean: bool = False) -> None:
        self.source = model
        self.copy = InferenceCopy(model, engine=engine, lean=lean) if hasattr(model, "get_base_model") else None
        self.stale = True  # refreshed at the first generation: after a checkpoint's adapter is loaded

    def policy_changed(self) -> None:
        self.stale = True

    def update_begins(self) -> None:
        """A lean copy is let go while the policy trains (Engine.update_begins); the next generation rebuilds it."""
        if self.copy is not None and self.copy.lean:
            self.copy.release()
            self.stale = True

    def inference_model(self):
        if self.copy is None:
            return self.source
        t0 = time.perf_counter()
        if self.stale:
            self.copy.refresh()
            self.stale = False
        self.sync_s = time.perf_counter() - t0
        return self.copy.model

    def packed_models(self) -> list:
        return [] if self.copy is None else [(self.copy.model, ("forward",))]

    def drop_copy(self) -> None:
        self.copy = self.source = None
