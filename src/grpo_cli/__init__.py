"""GRPO fine-tuning from the command line, or from Python: `grpo_cli.train("+recipe=quickstart", ...)`."""

import importlib
import logging

__version__ = "0.1.0"

_FROM_API = ("train", "TrainResult")  # commands/api.py's, imported when first asked for: `import grpo_cli` stays cheap


def __getattr__(name: str):
    """`grpo_cli.train` and `grpo_cli.TrainResult` (grpo_cli/commands/api.py). The import is by name: the package is the
    ground floor and api an entry point (docs/architecture.md), the one lookup that goes up on purpose, as the
    schema's look into a registry does."""
    if name in _FROM_API:
        return getattr(importlib.import_module("grpo_cli.commands.api"), name)
    raise AttributeError(f"module 'grpo_cli' has no attribute {name!r}")


def _no_kernels_note(record: logging.LogRecord) -> bool:
    """peft imports bitsandbytes whenever it is installed, quantized base or not; on a CPU with AVX-512 BF16 it asks
    `kernels` for a 4-bit matmul from the Hub at import, and logs, every run, that it could not have it (kernels
    missing, or the Hub offline: then kernels logs that it skipped the publisher check too); bitsandbytes falls back
    to its own."""
    return "kernels-community" not in record.getMessage()


_logged_before: set[str] = set()


def _first_time_only(record: logging.LogRecord) -> bool:
    """An int8 base logs its input cast (float32 to float16) on every forward of every 8-bit layer: hundreds of
    lines a step. Said once it is news."""
    text = record.getMessage()
    seen = text in _logged_before
    _logged_before.add(text)
    return not seen


# here, once: every entry point and every program that imports grpo_cli gets it, however many runs it makes
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_no_kernels_note)
logging.getLogger("kernels._internals.hf_hub").addFilter(_no_kernels_note)
logging.getLogger("bitsandbytes.autograd._functions").addFilter(_first_time_only)
# urllib3 logs each retry of a remote reward's request ("Retrying (Retry(total=1, ...)) after connection broken by
# ...") around the run's lines: the request's end is said once, in its own line (rewards.remote.Service)
logging.getLogger("urllib3").setLevel(logging.ERROR)
