"""Several LoRA adapters on one loaded base: a sweep's jobs under hydra/launcher=shared_base train one each, as peft's
named adapters of one PeftModel. Each is kept and written as a run that had only its own would keep it: its weights
under their `default` names in a checkpoint, its adapter/ folder as peft writes a `default` adapter, so that resume,
grpo-eval and grpo-export never see the difference. With a single adapter (`default`) every function here is what
the trainer did before.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from grpo_cli.config.schema import LoraConfig, ModelConfig
from grpo_cli.model.loading import (
    LoadedModel,
    _on_device,
    _prepack,
    _tokenizer_and_base,
    lora_config,
    resolve_device,
    sort_target_modules,
)

if TYPE_CHECKING:
    from peft import PeftModel

DEFAULT = "default"


def adapter_name(job: int) -> str:
    """The adapter of sweep job `job`: fixed width, so that no name is part of another (peft finds an adapter's
    weights by its name within theirs)."""
    return f"job{job:05d}"


def renamed(key: str, source: str, target: str) -> str:
    """A parameter name of adapter `source` as adapter `target`'s (`...lora_A.job00003.weight` <-> `...lora_A.default
    .weight`)."""
    return key if source == target else key.replace(f".{source}.", f".{target}.")


def _peft_config(lora: LoraConfig):
    return lora_config(lora.r, lora.alpha, lora.dropout, lora.target_modules, use_dora=lora.use_dora,
                       use_rslora=lora.use_rslora, modules_to_save=lora.modules_to_save)


def load_shared_base(cfg_model: ModelConfig, device_name: str, adapter: str, seed: int = 0,
                     chat_template_kwargs=None) -> LoadedModel:
    """What load_policy loads, its adapter named `adapter`: the base of a sweep's jobs with its first job's adapter.
    The adapter is drawn from the global RNG at the same point as load_policy's (loading the base draws nothing)."""
    from peft import get_peft_model

    device, dtype = resolve_device(device_name, cfg_model.dtype)
    tokenizer, base = _tokenizer_and_base(cfg_model, device, dtype, seed, chat_template_kwargs)
    model = get_peft_model(base, _peft_config(cfg_model.lora), adapter_name=adapter)
    sort_target_modules(model)
    model = _on_device(model, device, cfg_model.quantization)
    _prepack(model, cfg_model, device, dtype)
    return LoadedModel(model=model, tokenizer=tokenizer, device=device, dtype=dtype,
                       quantization=cfg_model.quantization, adapter=adapter)


def add_adapter(lm: LoadedModel, lora: LoraConfig, adapter: str) -> LoadedModel:
    """A fresh adapter `adapter` of `lora` on the base of `lm`, made the active one: drawn from the global RNG as
    load_policy draws a run's (peft initialises it the same way)."""
    model = cast("PeftModel", lm.model)
    model.add_adapter(adapter, _peft_config(lora))  # on the device of each layer it adapts
    sort_target_modules(model)
    model.set_adapter(adapter)
    return LoadedModel(model=lm.model, tokenizer=lm.tokenizer, device=lm.device, dtype=lm.dtype,
                       quantization=lm.quantization, adapter=adapter)


def trainable_state(model, adapter: str = DEFAULT) -> dict[str, torch.Tensor]:
    """The trainable weights of the active adapter `adapter`, under their `default` names (what a checkpoint
    keeps)."""
    return {renamed(n, adapter, DEFAULT): p.detach() for n, p in model.named_parameters() if p.requires_grad}


def load_trainable_state(model, state: dict[str, torch.Tensor], adapter: str = DEFAULT) -> None:
    """`state` into adapter `adapter` of `model`: as a checkpoint holds it (peft's saved names, without an adapter's)
    or as trainable_state gives it (`default` names)."""
    from peft import set_peft_model_state_dict

    if adapter != DEFAULT:  # peft puts the adapter's name into saved names, not in place of another's
        state = {key.replace(f".{DEFAULT}.", "."): value for key, value in state.items()}
    set_peft_model_state_dict(model, state, adapter_name=adapter)


def save_adapter(model, folder: Path, state: dict[str, torch.Tensor], adapter: str = DEFAULT) -> None:
    """`state` (trainable_state's) as peft writes adapter `default` into `folder`: LoRA weights only (the base is not
    resized). peft writes any other adapter into a subfolder of its name: it is written so and moved up."""
    state = {renamed(key, DEFAULT, adapter): value for key, value in state.items()}
    if adapter == DEFAULT:
        model.save_pretrained(folder, state_dict=state, selected_adapters=[DEFAULT], save_embedding_layers=False)
        return
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".adapter-", dir=folder.parent) as scratch:
        model.save_pretrained(scratch, state_dict=state, selected_adapters=[adapter], save_embedding_layers=False)
        for written in [*Path(scratch, adapter).iterdir(), *(p for p in Path(scratch).iterdir() if p.is_file())]:
            os.replace(written, folder / written.name)


def remove_adapter(lm: LoadedModel) -> None:
    """A finished job's adapter leaves the shared base (its memory with it)."""
    model = cast("PeftModel", lm.model)
    names = list(model.peft_config)
    if lm.adapter in names and len(names) > 1:
        if model.active_adapter == lm.adapter:  # another one active first: peft would warn that it chose one
            model.set_adapter(next(name for name in names if name != lm.adapter))
        model.delete_adapter(lm.adapter)
