"""The merged inference copy that the `merged` and `compiled` engines generate from: the policy with its LoRA
adapter folded into separate copies of the adapted weights, the frozen base untouched."""

from __future__ import annotations

import torch

from grpo_cli.errors import ModelLoadError


class InferenceCopy:
    """A plain transformers model for generation that computes what the peft policy computes, without the
    per-layer LoRA detour: each LoRA-wrapped linear layer becomes an ordinary linear layer whose weight is
    `base + scaling * B @ A` (in float32, then rounded once to the base dtype).

    Only those merged weights are new memory; embeddings, norms, the LM head and every other frozen tensor
    are shared with the policy, and nothing of the policy is ever written: its frozen base is the reference
    policy and stays bit-exact. `refresh()` recomputes the merged weights in place (same storage, so a
    captured CUDA graph stays valid) and must run after each optimizer step that changed the adapter.
    """

    def __init__(self, peft_model, engine: str = "merged"):
        import copy

        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.tuners_utils import BaseTunerLayer

        inner = peft_model.get_base_model()
        self.layers: dict[str, LoraLinear] = {}
        for name, module in inner.named_modules():
            if isinstance(module, BaseTunerLayer):
                if type(module) is not LoraLinear or any(module.lora_variant.get(a) for a in module.active_adapters):
                    raise ModelLoadError(
                        f"rollout.engine={engine} merges plain LoRA on linear layers only; {name} is a "
                        f"{type(module).__name__}; use rollout.engine=hf")
                self.layers[name] = module
            elif name and type(module).__name__ == "ModulesToSaveWrapper":
                raise ModelLoadError(f"rollout.engine={engine} cannot merge the trainable copy of {name} "
                                     "(modules_to_save); use rollout.engine=hf")
        memo = {id(t): t for t in (*inner.parameters(), *inner.buffers())}  # share everything ...
        for layer in self.layers.values():
            del memo[id(layer.get_base_layer().weight)]                    # ... but the weights that get merged
        model = copy.deepcopy(inner, memo)
        self.targets: dict[str, torch.Tensor] = {}
        for name in self.layers:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            plain = getattr(parent, child).get_base_layer()
            plain.weight.requires_grad_(False)
            setattr(parent, child, plain)
            self.targets[name] = plain.weight
        model.generation_config = inner.generation_config  # shared too: EOS ids and defaults are the policy's
        self.model = model.eval()
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        for name, layer in self.layers.items():
            if layer.merged:
                raise ModelLoadError(f"{name} has its adapter merged in place; the reference policy is lost")
            merged = layer.get_base_layer().weight.float()
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    merged = merged + layer.get_delta_weight(adapter).float()
            self.targets[name].copy_(merged)
