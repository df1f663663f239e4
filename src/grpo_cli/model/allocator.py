"""The C allocator grpo-train and grpo-eval run on: TCMalloc (gperftools' libtcmalloc_minimal) where it is
installed, else the C library's.

Why: on the CPU a step's tensors are the C allocator's blocks, and glibc's malloc keeps the freed blocks of one pass
where the next pass's blocks do not fit them, so a step's peak holds more freed memory than tensors. TCMalloc keeps
freed blocks in size classes: a lower peak at the same step time (docs/results/long-completions.md, "The C allocator",
has the numbers). TCMalloc is what PyTorch's CPU tuning guide and vLLM's CPU docs recommend preloading. It cannot be
swapped in a running process, so the command re-executes itself once with it in LD_PRELOAD (`preload`).

    GRPO_CLI_ALLOCATOR=tcmalloc   TCMalloc, an error where it is not installed
    GRPO_CLI_ALLOCATOR=system     the C library's (glibc's) allocator
    unset                         TCMalloc where installed, else the C library's

`trainer.memory_budget_gb` plans with glibc's allocator (it has glibc return freed blocks,
grpo_cli/step/memory.py), so a budget on the command line keeps it; a budget set in a config file under TCMalloc
stops in one line (`check_budget`).
"""

from __future__ import annotations

import ctypes.util
import os
from pathlib import Path

from grpo_cli.base.errors import ConfigError

ENV = "GRPO_CLI_ALLOCATOR"
CHOICES = ("tcmalloc", "system")
REEXECUTED = "GRPO_CLI_PRELOADED"  # set in the re-executed command's environment
INSTALL = "apt-get install libtcmalloc-minimal4 (Debian, Ubuntu) or dnf install gperftools-libs"


def tcmalloc_library() -> str | None:
    """The TCMalloc shared library the dynamic loader finds (a name LD_PRELOAD takes), or None."""
    return ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")


def chosen() -> str:
    """GRPO_CLI_ALLOCATOR as given, checked: tcmalloc, system, or auto (unset)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value and value not in CHOICES:
        raise ConfigError(f"{ENV}={value!r} is not an allocator: use tcmalloc or system, or leave it unset")
    return value or "auto"


def budget_on_command_line(argv: list[str]) -> bool:
    return any(a.split("=", 1)[0].lstrip("+~") == "trainer.memory_budget_gb" and a.split("=", 1)[1] not in
               ("", "null", "None") for a in argv if "=" in a)


def libraries_to_preload(argv: list[str]) -> list[str]:
    """The allocator library this command should run on and does not yet: [] or [TCMalloc's]."""
    choice = chosen()
    if choice == "system" or in_use() == "tcmalloc" or (choice == "auto" and budget_on_command_line(argv)):
        return []
    library = tcmalloc_library()
    if library is None:
        if choice == "tcmalloc":
            raise ConfigError(f"{ENV}=tcmalloc: TCMalloc is not installed; {INSTALL}, or set {ENV}=system")
        return []
    return [library]


def preload(libraries: list[str]) -> None:
    """Re-execute this command once with `libraries` first in LD_PRELOAD (nothing when there are none)."""
    if not libraries or os.environ.get(REEXECUTED):  # once: a library the loader refused would not be in_use()
        return
    import sys
    preload_list = ":".join([*libraries, *filter(None, [os.environ.get("LD_PRELOAD")])])
    env = {**os.environ, "LD_PRELOAD": preload_list, REEXECUTED: "1"}
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def in_use() -> str:
    """tcmalloc when TCMalloc is mapped into this process, else system."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return "tcmalloc" if "libtcmalloc" in maps else "system"


def check_budget(budget_gb: float | None, device_type: str) -> None:
    """A budget on the CPU needs glibc's allocator (module docstring): one line where the process runs on TCMalloc."""
    if budget_gb is not None and device_type == "cpu" and in_use() == "tcmalloc":
        raise ConfigError(f"trainer.memory_budget_gb={budget_gb:g}: the budget plans with glibc's allocator, and this "
                          f"process runs on TCMalloc; give the budget on the command line (grpo-train then stays on "
                          f"glibc's) or set {ENV}=system")


def release_free_memory() -> None:
    """Give the pages the allocator holds free back to the system: after a whole base was cut into shards on the CPU,
    its freed bytes would otherwise stay in this process's RSS (TCMalloc keeps them for later allocations; glibc's
    malloc_trim returns what its heap top allows)."""
    process = ctypes.CDLL(None)
    release = getattr(process, "MallocExtension_ReleaseFreeMemory", None) if in_use() == "tcmalloc" else None
    if release is not None:
        release()
    elif hasattr(process, "malloc_trim"):
        process.malloc_trim(0)
