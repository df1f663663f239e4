"""GRPO fine-tuning from the command line."""

import logging

__version__ = "0.1.0"


def _no_kernels_note(record: logging.LogRecord) -> bool:
    """peft imports bitsandbytes whenever it is installed, quantized base or not; on a CPU that logs, every run,
    that an optional package (`kernels`) for its 4-bit matmul is missing, and bitsandbytes falls back to its own."""
    return "kernels-community" not in record.getMessage()


# here, once: every entry point and every program that imports grpo_cli gets it, however many runs it makes
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_no_kernels_note)
