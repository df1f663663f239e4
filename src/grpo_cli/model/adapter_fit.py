"""Whether a trained LoRA adapter fits a base model, checked before it is loaded onto it: the base it recorded
and the shapes of its layers. grpo-export and grpo-eval both refuse an adapter trained on another base, in one
line each; it lives on the step floor so that the evaluator does not reach up into grpo-export for it."""

from __future__ import annotations

import json
from pathlib import Path

from grpo_cli.base.errors import CheckpointError, ExportError

PEFT_PREFIX = "base_model.model."
PASS_TRAINED_BASE = "pass the base it was trained on with --base"  # grpo-export's fix


def _adapter_shapes(adapter_dir: Path) -> dict[str, list[int]]:
    """The shape of each tensor of the adapter's weights; one line for weights that cannot be read (missing, cut
    short, another format: peft's safe_serialization=False writes adapter_model.bin)."""
    from safetensors import SafetensorError, safe_open

    weights = adapter_dir / "adapter_model.safetensors"
    if not weights.is_file():
        other = " (it holds adapter_model.bin: load it with peft and save it again, as safetensors)" \
            if (adapter_dir / "adapter_model.bin").is_file() else ""
        raise CheckpointError(f"{weights} is missing{other}; give an adapter as peft saves it by default")
    try:
        with safe_open(str(weights), framework="pt") as f:
            return {key: list(f.get_slice(key).get_shape()) for key in f.keys()}
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{weights} cannot be read ({' '.join(str(err).split())[:120]}): it is damaged or cut "
                              "short; give another adapter or checkpoint") from None


def check_shapes(model, adapter_dir: Path, base_name: str, fix: str = "pass the right one with --base") -> None:
    """Every LoRA layer of the adapter must sit on a layer of the base with matching in/out features."""
    for key, shape in _adapter_shapes(adapter_dir).items():
        for part, dim, feature in ((".lora_A.", 1, "in_features"), (".lora_B.", 0, "out_features")):
            if part not in key:
                continue
            module_name = key.split(part)[0].removeprefix(PEFT_PREFIX)
            try:
                layer = model.get_submodule(module_name)
            except AttributeError:
                raise ExportError(f"the adapter targets layer {module_name}, which base {base_name} lacks: it was "
                                  f"trained on another base; {fix}") from None
            expected = getattr(layer, feature, None)
            if expected is not None and expected != shape[dim]:
                raise ExportError(f"the adapter's {module_name} has {feature}={shape[dim]} but base {base_name} has "
                                  f"{expected}: it was trained on another base; {fix}")


def _recorded_base(adapter_dir: Path) -> str | None:
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    return config.get("base_model_name_or_path") or None


def check_base_name(adapter_dir: Path, base_name: str, model, fix: str = PASS_TRAINED_BASE) -> None:
    """The base the adapter recorded must be the run's configured base (a path to the same embedded model
    on another machine counts as the same)."""
    from grpo_cli.model.loading import EMBEDDED_PREFIX  # torch: only when a model is being checked

    recorded = _recorded_base(adapter_dir)
    if recorded is None:
        return
    loaded = str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or "")
    same = {base_name, loaded}
    if base_name.startswith(EMBEDDED_PREFIX) and loaded:
        same.add(Path(loaded).name)
        recorded_name = Path(recorded).name
    else:
        recorded_name = recorded
    if recorded not in same and recorded_name not in same:
        raise ExportError(f"the adapter {adapter_dir} was trained on base {recorded} but the config says "
                          f"model.name_or_path={base_name}; {fix}")
