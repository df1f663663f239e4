"""The rules of grpo-cli's own values (a device, a data path, an adapter dir, dotted paths, ...) and of the
choices a plug-in registry holds (`registered`: its names read when a value is checked, so that the config lists
no engine, optimizer or loss type itself), for the declarations of schema.py and config/algo.py."""

from __future__ import annotations

import glob
import importlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Literal, TypeAlias

from omegaconf import ListConfig

from grpo_cli.config.rule import (
    TEXT,
    TEXT_LIST,
    Rule,
    is_int,
    is_number,
    number,
    one_of,
)


def registry_names(module: str, attribute: str, *, auto: bool = False) -> Callable[[], tuple]:
    """The names registered in `module.attribute` (a Registry or any dict/sequence of names), read when asked."""
    def names() -> tuple:
        found = tuple(str(n) for n in getattr(importlib.import_module(module), attribute))
        return ("auto", *(n for n in found if n != "auto")) if auto else found

    return names


def registered(module: str, attribute: str, *, auto: bool = False) -> Rule:
    """One of the names a plug-in registry holds when the value is checked."""
    return one_of(names=registry_names(module, attribute, auto=auto))


def _is_device(value) -> bool:
    return isinstance(value, str) and bool(re.fullmatch(r"auto|cpu|cuda(:\d+)?", value))


def _cuda_visible(value) -> bool:
    if not str(value).startswith("cuda"):
        return True
    import torch

    return torch.cuda.is_available()


def _existing_path(value) -> bool:
    return Path(str(value)).expanduser().exists()


def _data_path(value) -> bool:
    path = Path(str(value)).expanduser()
    return path.exists() or (glob.has_magic(str(value)) and bool(glob.glob(str(path))))


def _adapter_dir(value) -> bool:
    return (Path(str(value)).expanduser() / "adapter_config.json").is_file()


def _non_empty_texts(value) -> bool:
    return isinstance(value, ListConfig) and all(isinstance(t, str) and t for t in value)


def _target_modules(value) -> bool:
    return (isinstance(value, str) and bool(value)) or (isinstance(value, ListConfig) and len(value) > 0
                                                        and _non_empty_texts(value))


def _betas(value) -> bool:
    return isinstance(value, ListConfig) and len(value) == 2 and all(is_number(b) and 0 <= b < 1 for b in value)


def _http_url(value) -> bool:
    return isinstance(value, str) and value.startswith(("http://", "https://")) and len(value) > 8


def _dotted_paths(value) -> bool:
    return isinstance(value, ListConfig) and all(isinstance(t, str) and "." in t for t in value)


UNIT_OPEN = number(0, 1, low_open=True, high_open=True)
POSITIVE = number(0, low_open=True)
STOP_STRINGS = Rule(_non_empty_texts, "a list of non-empty strings",
                    failure="needs a list of non-empty strings, e.g. '{key}=[\"</answer>\"]' (quoted for "
                            "the shell)")
DEVICE = (Rule(_is_device, "auto, cpu, cuda or cuda:N", verb="use"),
          Rule(_cuda_visible, "", failure="no CUDA device is visible here; use {key}=auto or cpu"))
RESUME = Rule(lambda v: v == "auto" or _existing_path(v), "auto or a checkpoint / run dir",
              failure="no such checkpoint or run dir; use auto (with hydra.run.dir=RUN_DIR) or an existing path")
DATA_PATH = Rule(_data_path, "an existing file, glob or dir",
                 failure="no such file, glob match or dir; give a .jsonl, .json, .parquet, .csv or .arrow file, a "
                         "glob of them, or a save_to_disk dir")
ADAPTER = Rule(_adapter_dir, "a run's adapter/ dir",
               failure="holds no adapter_config.json; point it at a run's adapter/ folder")
TARGET_MODULES = Rule(_target_modules, "all-linear or [names]",
                      failure="give all-linear or a list of module names, e.g. [q_proj, v_proj]")
BETAS = Rule(_betas, "[beta1, beta2] in [0, 1)", failure="needs [beta1, beta2], each in [0, 1)")
DOTTED_PATH = Rule(lambda v: isinstance(v, str) and "." in v, "pkg.module.fn",
                   failure="give the dotted path of a callable, e.g. pkg.module.fn")
DOTTED_PATHS = Rule(_dotted_paths, "a list of pkg.module.fn",
                    failure="needs a list of dotted paths of callables, e.g. "
                            "'rollout.tools=[grpo_cli.calculator.calculator]'")
HTTP_URLS = Rule(lambda v: _http_url(v) or (isinstance(v, ListConfig) and len(v) > 0 and all(map(_http_url, v))
                                            and len(set(v)) == len(v)),
                 "an http(s):// URL or a list of them",
                 failure="needs an http(s):// base URL or a list of different ones, e.g. http://127.0.0.1:8000/v1 or "
                         "'[http://node1:8000/v1,http://node2:8000/v1]'")
AUTO_OR_COUNT = Rule(lambda v: v == "auto" or (is_int(v) and v >= 1), "auto or an integer >= 1", verb="use")
MODEL_NAME = Rule(TEXT.test, "hub id, dir, embedded:NAME, tiny-random",
                  failure="give a hub id, a local directory, embedded:NAME or tiny-random")
MODULE_NAMES = Rule(TEXT_LIST.test, TEXT_LIST.allowed,
                    failure="give a list of module names, e.g. plugins=[my_pkg.my_engine]")
ONE_SEED = Rule(lambda v: v == 1, "1",
                failure="averaging one trial over several seeds is not supported (hydra-optuna-sweeper runs exactly "
                        "one job per trial); use 1 and sweep trainer.seed=0,1,2 with the basic sweeper, whose "
                        "summary groups the seeds of a setting")
LOSS_TYPE = registered("grpo_cli.algorithm", "LOSS_TYPES")
DTYPE: TypeAlias = Literal["auto", "float32", "bfloat16", "float16"]
AUTO_OR_BOOL: TypeAlias = Literal["auto"] | bool
