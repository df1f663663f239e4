"""Atomic checkpoints and exact resume.

A checkpoint is a folder `checkpoints/step-NNNNNN/` holding the adapter (safetensors), the optimiser state and
the learning-rate schedule's update count (`trainer_state.pt`, tensors only, loaded with weights_only=True), RNG
states and the step (`state.json`, with the config fingerprint of grpo_cli.run.rundir), the metrics written so far, and
with rollout.placement=worker the adapters of the policy versions its in-flight batches need (ROLLOUT_VERSIONS).
It is written under a temporary name and renamed into place, so a crash mid-write leaves the previous checkpoint
whole.
`manifest.json`, written last, lists every other file with its size and sha256: resume checks a checkpoint
against it (and that its files load) and falls back to the newest intact one.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from grpo_cli.base.errors import CheckpointError, no_room
from grpo_cli.base.metrics import ADAPTER_DIR, CHECKPOINTS_DIR, METRICS

ROLLOUT_VERSIONS = "rollout_versions.safetensors"  # rollout.placement=worker: the adapters in-flight batches need
PREFIX = "step-"
TMP_PREFIX = ".tmp-"
MANIFEST = "manifest.json"


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / CHECKPOINTS_DIR


def step_dir(run_dir: Path, step: int) -> Path:
    """Where the checkpoint of the state after `step` complete steps lives (whether or not it exists)."""
    return checkpoint_root(run_dir) / f"{PREFIX}{step:06d}"


def is_checkpoint(path: Path) -> bool:
    """A complete checkpoint folder (a temporary folder of an interrupted write is not one)."""
    return (path / "state.json").is_file()


def checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first."""
    return [p for p in sorted(checkpoint_root(run_dir).glob(PREFIX + "*")) if is_checkpoint(p)]


def rng_snapshot() -> tuple:
    """Every RNG a step draws from (Python, NumPy, torch CPU, CUDA when present), to put back with restore_rng."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def restore_rng(snapshot: tuple) -> None:
    python, numpy_state, torch_state, cuda = snapshot
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(torch_state)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def _rng_files(snapshot: tuple) -> tuple[dict, dict]:
    """A snapshot as a checkpoint stores it: Python and NumPy as JSON (state.json), torch and CUDA as tensors
    (trainer_state.pt, which loads with weights_only=True)."""
    python, (kind, keys, *rest), torch_state, cuda = snapshot
    as_json = {"python": _jsonable(python), "numpy": [kind, keys.tolist(), *rest]}
    as_tensors = {"torch": torch_state, **({"cuda": cuda} if cuda is not None else {})}
    return as_json, as_tensors


def _rng_from_files(as_json: dict, as_tensors: dict) -> tuple:
    kind, keys, *rest = as_json["numpy"]
    return (_tupled(as_json["python"]), (kind, np.array(keys, dtype=np.uint32), *rest), as_tensors["torch"],
            as_tensors.get("cuda"))


def _jsonable(obj):
    return [_jsonable(x) for x in obj] if isinstance(obj, (tuple, list)) else obj


def _tupled(obj):
    return tuple(_tupled(x) for x in obj) if isinstance(obj, list) else obj


def save(run_dir: Path, state: dict, save_adapter: Callable[[Path, dict], None], extra: dict,
         keep_last: int) -> Path:
    """Write `state` (GRPOTrainer.state_dict: the state after state["step"] steps, so resume starts there), its
    adapter through `save_adapter(folder, tensors)`, the RNG and `extra` (state.json), and prune old checkpoints."""
    step, tensors = state["step"], state.get("rollout_versions")
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(run_dir, step)
    tmp = root / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        save_adapter(tmp / ADAPTER_DIR, state["adapter"])
        rng_json, rng_tensors = _rng_files(rng_snapshot())
        torch.save({"optimizer": state["optimizer"], "lr_schedule": state["lr_schedule"], "rng": rng_tensors},
                   tmp / "trainer_state.pt")
        (tmp / "state.json").write_text(json.dumps({"step": step, "rng": rng_json, **state["counters"], **extra}))
        if tensors:
            from safetensors.torch import save_file

            save_file({k: t.contiguous() for k, t in tensors.items()}, tmp / ROLLOUT_VERSIONS)
        metrics = run_dir / METRICS
        if metrics.is_file():
            shutil.copy2(metrics, tmp / METRICS)
        write_manifest(tmp)
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except Exception as err:
        shutil.rmtree(tmp, ignore_errors=True)  # a half-written checkpoint would hold space a full disk needs
        reason = no_room(err) or (err.strerror if isinstance(err, OSError) else None)
        if reason is None:
            raise
        earlier = [p for p in checkpoints(run_dir) if p != final]
        after = (f"the newest checkpoint, {earlier[-1].name}, is intact: free space and resume with trainer.resume=auto"
                 if earlier else "no checkpoint was written before it: free space and start again")
        raise CheckpointError(f"writing checkpoint {final} failed ({reason}); {after}") from None
    for old in sorted(root.glob(PREFIX + "*"))[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_tree(folder: Path) -> None:
    for file in folder.rglob("*"):
        if file.is_file():
            with file.open("rb") as f:
                os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()  # hashlib.file_digest is Python 3.11's; grpo-cli runs on 3.10 too
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    entries = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps({"files": entries}, indent=1))


def damage(folder: Path) -> str | None:
    """Why a checkpoint cannot be resumed from (a missing, resized, altered or unloadable file), or None."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        entries = json.loads((folder / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"no readable {MANIFEST} (its write did not finish)"
    for name in ("state.json", "trainer_state.pt", "adapter/adapter_model.safetensors"):
        if name not in entries:
            return f"{MANIFEST} does not list {name}"
    for name, entry in entries.items():
        file = folder / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != entry["size"]:
            return f"{name} has {file.stat().st_size} bytes, its manifest says {entry['size']}"
        if _sha256(file) != entry["sha256"]:
            return f"{name} does not match its sha256 in {MANIFEST}"
    try:
        state = json.loads((folder / "state.json").read_text())
        load_file(folder / ADAPTER_DIR / "adapter_model.safetensors")
    except (OSError, ValueError, SafetensorError) as err:
        return f"a file does not load ({type(err).__name__})"
    missing = [key for key in ("step", "fingerprint") if key not in state]  # resume reads both
    if missing:
        return f"state.json holds no {' and no '.join(missing)}"
    try:
        torch.load(folder / "trainer_state.pt", map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, pickle.UnpicklingError) as err:
        return (f"trainer_state.pt was refused ({type(err).__name__}): only plain tensors load; it may be tampered "
                "with")
    return None


def newest_intact(run_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint that passes `damage`, and the newer ones skipped with the reason for each
    (temporary folders of an interrupted write are not checkpoints)."""
    skipped: list[tuple[Path, str]] = []
    for folder in sorted(checkpoint_root(run_dir).glob(PREFIX + "*"), reverse=True):
        reason = damage(folder)
        if reason is None:
            return folder, skipped
        skipped.append((folder, reason))
    return None, skipped


def latest(run_dir: Path) -> Path | None:
    """The newest intact checkpoint."""
    return newest_intact(run_dir)[0]


def remove_orphans(run_dir: Path) -> list[Path]:
    """Temporary folders of checkpoint writes that never finished (only the run dir's lock holder writes)."""
    orphans = sorted(checkpoint_root(run_dir).glob(TMP_PREFIX + "*"))
    for folder in orphans:
        shutil.rmtree(folder, ignore_errors=True)
    return orphans


def find(run_dir: Path, resume: str) -> Path | None:
    """Resolve `trainer.resume` (auto or a path) to a checkpoint folder; None = start fresh."""
    if resume == "auto":
        return latest(run_dir)
    path = Path(resume).expanduser()
    if path.is_dir() and not is_checkpoint(path):
        path = latest(path) or path  # a run dir was given
    if not is_checkpoint(path):
        raise CheckpointError(f"trainer.resume={resume} is not a checkpoint (no state.json); "
                              "use auto or a checkpoints/step-N folder")
    return path


def load(path: Path) -> dict:
    """The state a checkpoint holds, as GRPOTrainer.load_state_dict takes it (the adapter as peft saved it, the
    optimizer's and the schedule's state, the counters and the rest of state.json, the rollout versions); the RNG
    is restored here."""
    from safetensors.torch import load_file

    adapter_file = path / ADAPTER_DIR / "adapter_model.safetensors"
    if not adapter_file.is_file():
        raise CheckpointError(f"{adapter_file} is missing; the checkpoint is incomplete, resume from an older one")
    try:
        trainer_state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointError(f"{path / 'trainer_state.pt'} was refused ({type(err).__name__}): only plain tensors "
                              "load; it may be tampered with") from None
    counters = json.loads((path / "state.json").read_text())
    restore_rng(_rng_from_files(counters.pop("rng"), trainer_state["rng"]))
    return {"step": counters.pop("step"), "adapter": load_file(adapter_file), "optimizer": trainer_state["optimizer"],
            "lr_schedule": trainer_state["lr_schedule"], "counters": counters,
            "rollout_versions": rollout_versions(path)}


def rollout_versions(path: Path) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint keeps for the rollout worker (empty where it keeps none)."""
    from safetensors.torch import load_file

    file = path / ROLLOUT_VERSIONS
    return load_file(file) if file.is_file() else {}
