"""The precision the frozen base runs in (`model.dtype`), and what `auto` picks where.

Only the frozen base (and its generation) takes this dtype. peft keeps the LoRA weights in float32 on a
half-precision base, so their gradients and the optimizer state are float32 too; the log-softmax, KL and loss
are computed in float32 from the head's logits whatever the base's dtype (algorithm/logprobs.py).
"""

from __future__ import annotations

import torch

from grpo_cli.base.errors import ConfigError
from grpo_cli.config.rules import beyond_the_machine
from grpo_cli.config.schema import Config, fail
from grpo_cli.model.prepack import wanted

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHOICES = ("auto", *DTYPES)
# Whether `auto` picks bf16 on a CPU with bf16 matrix instructions. Off: in the fp32-vs-bf16 learning table
# (docs/results/bf16-on-the-cpu.md), bf16's rise fell outside fp32's spread, and a default may not change what a
# run learns.
CPU_AUTO_BF16 = False


def device_of(name: str) -> torch.device:
    """The device `trainer.device=NAME` means: `auto` is CUDA when present, else the CPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def fast_cpu_bf16() -> bool:
    """The CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX), as torch's own CPU dispatch sees it.
    Without them oneDNN converts bf16 to fp32 around each matmul, and bf16 runs several times slower than fp32."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def cuda_bf16(device: torch.device) -> bool:
    """The GPU computes in bf16 natively (compute capability 8.0 and later)."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def auto_dtype(device: torch.device) -> torch.dtype:
    """`model.dtype=auto`: bf16 on CUDA; fp32 on the CPU (bf16 there once CPU_AUTO_BF16 allows it, and only
    where the CPU has fast bf16 matmuls)."""
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if CPU_AUTO_BF16 and fast_cpu_bf16() else torch.float32


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The torch dtype `model.dtype=NAME` means on `device`; ConfigError (one line) for one it cannot run:
    float16 on the CPU (no fp16 matmul kernels to speak of, and no loss scaling here to keep its gradients
    from underflowing), bfloat16 on a GPU older than compute capability 8.0."""
    if name == "auto":
        return auto_dtype(device)
    if name not in DTYPES:
        raise ConfigError(f"model.dtype={name} is invalid: use one of {', '.join(CHOICES)}")
    if name == "float16" and device.type == "cpu":
        raise ConfigError("model.dtype=float16 cannot run on the CPU (torch has no fast fp16 kernels there); use "
                          "model.dtype=bfloat16, float32 or auto")
    if name == "bfloat16" and device.type == "cuda" and not cuda_bf16(device):
        raise ConfigError(f"model.dtype=bfloat16 cannot run on {torch.cuda.get_device_name(device)} (compute "
                          f"capability {torch.cuda.get_device_capability(device)} < 8.0); use model.dtype=float16 or "
                          "float32")
    return DTYPES[name]


def slow_dtype_warning(dtype: torch.dtype, device: torch.device) -> str | None:
    """A warning for bf16 on a CPU without bf16 matmul instructions: it runs, emulated, many times slower."""
    if dtype == torch.bfloat16 and device.type == "cpu" and not fast_cpu_bf16():
        return ("model.dtype=bfloat16 on a CPU without bf16 matmul instructions (AVX512-BF16, AMX): torch emulates "
                "them and a training step runs many times slower than in float32; model.dtype=auto picks float32 here")
    return None


def check_precision(config: Config) -> list[str]:
    """model.dtype runs on trainer.device (ConfigError in one line if not), known before any weights load; a
    warning where it runs but slowly; what asks for more than the machine or the run holds (beyond_the_machine)."""
    device = device_of(config.trainer.device)
    dtype = resolve_dtype(config.model.dtype, device)
    if config.model.prepack is True and not wanted(True, device, dtype, config.model.quantization):
        fail("model.prepack", True, f"needs the CPU, an unquantized base and oneDNN's packed linear for {dtype} "
                                    "in this torch build; use model.prepack=auto")
    return [w for w in (slow_dtype_warning(dtype, device),) if w] + beyond_the_machine(config, device)
