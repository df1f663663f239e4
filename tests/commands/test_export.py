"""grpo-export: the merged model loads with transformers alone and gives the logits of base + adapter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from omegaconf import OmegaConf

from grpo_cli.commands.export import main as export_main
from grpo_cli.config.schema import Config
from grpo_cli.model.loading import load_base_model, load_policy, load_tokenizer

TINY = ["+recipe=quickstart", "model=tiny", "trainer.device=cpu"]
MESSAGES = [{"role": "user", "content": "What is 3 + 5? Answer with just the number."}]


def make_run(run_dir: Path, cfg, seed: int = 1, keep_model: bool = False):
    """A run dir as grpo-train leaves it (.hydra/config.yaml, adapter/), with an adapter whose B matrices are
    random (a fresh adapter has B = 0 and would merge into the base unchanged); with keep_model, also the
    peft model (base + that adapter) it was saved from."""
    lm = load_policy(Config.of(cfg).model, "cpu", seed=cfg.trainer.seed)
    perturb(lm.model, seed)
    (run_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    (run_dir / ".hydra" / "overrides.yaml").write_text("- model=tiny\n")
    lm.model.save_pretrained(run_dir / "adapter")
    return (run_dir, lm.model.eval()) if keep_model else run_dir


def perturb(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def reference_logits(cfg, adapter_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    """Logits of the run's base with the adapter applied by peft (no merging), in fp32."""
    from peft import PeftModel

    tokenizer = load_tokenizer(cfg.model.name_or_path)
    base = load_base_model(cfg.model.name_or_path, tokenizer, torch.float32, tiny=dict(cfg.model.get("tiny") or {}),
                           seed=cfg.trainer.seed)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def chat_ids(tokenizer) -> torch.Tensor:
    """MESSAGES as the model reads them: the chat template with the generation prompt."""
    return tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


def tiny_base(tiny_cfg, tokenizer):
    """The tiny run's base model in fp32, as grpo-train built it (its shape and seed)."""
    return load_base_model("tiny-random", tokenizer, torch.float32, tiny=dict(tiny_cfg.model.tiny),
                           seed=tiny_cfg.trainer.seed)


def exported_logits(out: Path) -> tuple[torch.Tensor, torch.Tensor, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = chat_ids(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits, ids, model


@pytest.fixture(scope="module")
def tiny_cfg():
    from hydra import compose, initialize_config_dir

    from grpo_cli.config.compose import CONF_DIR, register_recipes

    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=TINY)


@pytest.fixture(scope="module")
def tiny_run(tiny_cfg, tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("export") / "run", tiny_cfg)


@pytest.mark.slow
def test_merged_tiny_export_matches_base_plus_adapter(tiny_cfg, tiny_run, tmp_path, capsys):
    out = tmp_path / "merged"
    assert export_main([str(tiny_run), str(out), "--dtype", "fp32"]) == 0
    progress = [line for line in capsys.readouterr().out.splitlines() if line.startswith("grpo-export: [")]
    assert len(progress) == 5
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "README.md"} <= {
        p.name for p in out.iterdir()}
    assert not (out / "adapter_config.json").exists()
    assert len({(out / name).stat().st_mode for name in ("model.safetensors", "config.json", "README.md")}) == 1
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    merged, ids, model = exported_logits(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.generation_config.pad_token_id is not None
    reference = reference_logits(tiny_cfg, tiny_run / "adapter", ids)
    torch.testing.assert_close(merged, reference, atol=1e-4, rtol=0)
    base_only = load_base_model("tiny-random", load_tokenizer("tiny-random"), torch.float32,
                                tiny=dict(tiny_cfg.model.tiny), seed=tiny_cfg.trainer.seed)
    with torch.no_grad():
        assert (base_only(input_ids=ids).logits - merged).abs().max() > 1e-3  # the adapter did change something


@pytest.mark.slow
def test_export_keeps_the_chat_template_and_writes_the_dtype(tiny_run, tmp_path):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    out = tmp_path / "bf16"
    assert export_main([str(tiny_run), str(out)]) == 0  # bf16 is the default
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    original = load_tokenizer("tiny-random")
    assert AutoTokenizer.from_pretrained(out).chat_template == original.chat_template is not None
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.parametrize("base,hub", [("embedded:smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct"),
                                       ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
                                       ("tiny-random", None), ("{local}", None)])
def test_the_model_card_names_the_base_by_its_hub_id_or_not_at_all(tmp_path, base, hub):
    """The hub reads `base_model` as a hub id and links the model to it: `embedded:smollm2-135m` is none (its hub
    original is), a local dir or the tiny random model has none."""
    import yaml

    from grpo_cli.commands.export import Source, model_card

    base = base.format(local=tmp_path)
    model = {"name_or_path": base, "lora": {"r": 16, "alpha": 32}}
    cfg = OmegaConf.create({"model": model, "trainer": {"max_steps": 2}})
    card = model_card(Source(tmp_path, tmp_path / "adapter", cfg, "the run's final adapter"), base, merged=True,
                      dtype="bf16")
    front = yaml.safe_load(card.split("---\n")[1])
    assert front.get("base_model") == hub and front["library_name"] == "transformers"


@pytest.mark.slow
def test_adapter_only_is_a_clean_adapter_with_a_card(tiny_cfg, tiny_run, tmp_path):
    from peft import PeftModel

    out = tmp_path / "adapter"
    assert export_main([str(tiny_run), str(out), "--adapter-only"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny-random"
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: peft\n") and "PeftModel.from_pretrained" in card  # tiny: no hub id
    assert "More Information Needed" not in card
    tokenizer = load_tokenizer("tiny-random")
    ids = chat_ids(tokenizer)
    base = tiny_base(tiny_cfg, tokenizer)
    with torch.no_grad():
        logits = PeftModel.from_pretrained(base, out)(input_ids=ids).logits
    torch.testing.assert_close(logits, reference_logits(tiny_cfg, tiny_run / "adapter", ids))
    (out / "keep.txt").write_text("old")
    assert export_main([str(tiny_run), str(out), "--adapter-only", "--overwrite"]) == 0
    assert not (out / "keep.txt").exists() and (out / "adapter_model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary dirs left


@pytest.mark.slow
def test_checkpoint_export(tiny_cfg, tiny_run, tmp_path):
    """--checkpoint N and a checkpoints/step-N dir given as RUN_DIR both export that checkpoint's adapter."""
    import shutil

    from peft import PeftModel

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    step = run / "checkpoints" / "step-000003"
    step.mkdir(parents=True)
    (step / "state.json").write_text('{"step": 3}')
    lm = load_policy(Config.of(tiny_cfg).model, "cpu", seed=tiny_cfg.trainer.seed)
    perturb(lm.model, seed=7)
    lm.model.save_pretrained(step / "adapter")
    tokenizer = load_tokenizer("tiny-random")
    ids = chat_ids(tokenizer)
    expected = reference_logits(tiny_cfg, step / "adapter", ids)
    for name, args in (("by-number", [str(run), "--checkpoint", "3"]), ("by-dir", [str(step)])):
        out = tmp_path / name
        assert export_main([args[0], str(out), *args[1:], "--adapter-only"]) == 0
        base = tiny_base(tiny_cfg, tokenizer)
        with torch.no_grad():
            got = PeftModel.from_pretrained(base, out)(input_ids=ids).logits
        torch.testing.assert_close(got, expected)
        assert "checkpoint step-000003" in (out / "README.md").read_text()


def one_line_exit_2(capsys, argv: list[str], *words: str) -> str:
    with pytest.raises(SystemExit) as stop:
        export_main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("grpo-export: "), err
    for word in words:
        assert word in err[0], err[0]
    return err[0]


def fake_run(run: Path, cfg, adapter: bool = True) -> Path:
    """A run dir with the files export looks at first; the adapter files are placeholders (never loaded here)."""
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    if adapter:
        (run / "adapter").mkdir()
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            (run / "adapter" / name).write_text("{}")
    return run


def fake_checkpoint(run: Path, step: int) -> Path:
    """A checkpoint folder of `run` as export looks at it: its state.json and placeholder adapter files."""
    folder = run / "checkpoints" / f"step-{step:06d}"
    (folder / "adapter").mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (folder / "adapter" / name).write_text("{}")
    (folder / "state.json").write_text(json.dumps({"step": step}))
    return folder


def test_run_without_adapter_is_one_line(tiny_cfg, tmp_path, capsys):
    run = fake_run(tmp_path / "unfinished", tiny_cfg, adapter=False)
    one_line_exit_2(capsys, [str(run), str(tmp_path / "out")], "no adapter")
    one_line_exit_2(capsys, [str(run), str(tmp_path / "out"), "--checkpoint", "latest"], "--checkpoint latest", "none")
    one_line_exit_2(capsys, [str(tmp_path / "nowhere"), str(tmp_path / "out")], "not a directory")
    one_line_exit_2(capsys, [str(tmp_path), str(tmp_path / "out")], ".hydra/config.yaml")
    assert not (tmp_path / "out").exists()


def test_an_option_that_would_go_unused_is_one_line(tiny_cfg, tmp_path, capsys):
    """--checkpoint beside RUN_DIR that is a checkpoint folder already (the folder won), --dtype beside --adapter-only
    (nothing is cast): each refused before anything is written."""
    run = fake_run(tmp_path / "run", tiny_cfg)
    step = run / "checkpoints" / "step-000003"
    step.mkdir(parents=True)
    (step / "state.json").write_text('{"step": 3}')
    line = one_line_exit_2(capsys, [str(step), str(tmp_path / "out"), "--checkpoint", "latest"])
    assert line == (f"grpo-export: RUN_DIR={step} is a checkpoint, and --checkpoint latest names one too; give the "
                    "run dir with --checkpoint latest, or the checkpoint folder alone")
    one_line_exit_2(capsys, [str(run), str(tmp_path / "out"), "--adapter-only", "--dtype", "fp16"],
                    "--dtype fp16 is the merged weights' dtype", "leave out --dtype")
    assert not (tmp_path / "out").exists()


def test_non_empty_out_dir_is_refused_before_any_work(tiny_cfg, tmp_path, capsys):
    run = fake_run(tmp_path / "run", tiny_cfg)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    one_line_exit_2(capsys, [str(run), str(out)], "not empty", "--overwrite")
    assert (out / "keep.txt").read_text() == "mine"
    for target in (run, tmp_path):  # the run dir itself, or a dir holding it: never, even with --overwrite
        one_line_exit_2(capsys, [str(run), str(target), "--overwrite"], "is the run dir or holds it")
    assert (run / "adapter" / "adapter_config.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_an_out_dir_in_what_the_run_keeps_is_refused_even_with_overwrite(tiny_cfg, tmp_path, capsys):
    """`grpo-export RUN RUN/adapter --overwrite` replaced the trained adapter with the merged model, and a checkpoint
    exported over itself lost its optimizer state."""
    run = fake_run(tmp_path / "run", tiny_cfg)
    step = fake_checkpoint(run, 1)
    for source, out, kept in ((run, run / "adapter", "adapter"), (step, step, "checkpoints"),
                              (run, run / "checkpoints" / "merged", "checkpoints"), (run, run / ".hydra", ".hydra")):
        line = one_line_exit_2(capsys, [str(source), str(out), "--overwrite"])
        assert line == (f"grpo-export: OUT_DIR={out} is in the run's {kept}, which the run keeps (its adapter, "
                        "checkpoints, config); pick a directory outside them")
    assert sorted(p.name for p in (run / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert (step / "state.json").is_file() and not (run / "checkpoints" / "merged").exists()


def test_a_checkpoint_of_another_run_is_refused(tiny_cfg, tmp_path, capsys):
    """--checkpoint PATH of another run exported it under this run's name, config and seed."""
    run, other = fake_run(tmp_path / "run", tiny_cfg), fake_run(tmp_path / "other", tiny_cfg)
    step = other / "checkpoints" / "step-000001"
    step.mkdir(parents=True)
    (step / "state.json").write_text('{"step": 1}')
    line = one_line_exit_2(capsys, [str(run), str(tmp_path / "out"), "--checkpoint", str(step)])
    assert line == (f"grpo-export: --checkpoint {step} is not a checkpoint of {run} (it is one of {other}: give that "
                    "checkpoint folder alone); available: none (give N, latest or a checkpoints/step-N path)")


def test_files_written_to_out_dir_while_exporting_are_kept_without_overwrite(tmp_path):
    """OUT_DIR was found empty at the start; what another export wrote there meanwhile was replaced at the end."""
    from grpo_cli.base.errors import ExportError
    from grpo_cli.commands.export import _rename_into_place

    tmp, out = tmp_path / ".out.tmp-1", tmp_path / "out"
    tmp.mkdir()
    (tmp / "model.safetensors").write_text("this export")
    out.mkdir()
    (out / "model.safetensors").write_text("another export's")
    with pytest.raises(ExportError, match=r"^OUT_DIR=.* was written to while this export ran"):
        _rename_into_place(tmp, out)
    assert (out / "model.safetensors").read_text() == "another export's"
    _rename_into_place(tmp, out, overwrite=True)
    assert (out / "model.safetensors").read_text() == "this export"
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / ".new").mkdir()
    _rename_into_place(tmp_path / ".new", empty)  # an empty OUT_DIR made beforehand: taken
    assert empty.is_dir() and not (tmp_path / ".new").exists()


def test_a_stop_that_comes_as_out_dir_is_renamed_in_says_it_is_whole(tmp_path, monkeypatch):
    """The signal is held during the rename and came right after it: the line said OUT_DIR `was not written` (exit
    130), while it was there, whole, and an export it replaced was gone."""
    import os
    import signal

    from grpo_cli.commands import export as export_module

    rename = export_module._rename_into_place

    def interrupted_rename(tmp, out, overwrite=False):
        os.kill(os.getpid(), signal.SIGINT)  # held until the rename is done, on whatever thread it lands
        rename(tmp, out, overwrite)

    monkeypatch.setattr(export_module, "_rename_into_place", interrupted_rename)
    tmp, out = tmp_path / ".out.tmp-1", tmp_path / "out"
    tmp.mkdir()
    (tmp / "README.md").write_text("card")
    with export_module._stops_on_signals(), pytest.raises(export_module.ExportStopped) as stopped:
        export_module._finish_out(tmp, out, overwrite=False)
    assert stopped.value.written and (out / "README.md").read_text() == "card"


def test_the_base_flag_stands_in_for_a_config_without_one(tiny_cfg, tmp_path, capsys):
    """The line for a run config without model.name_or_path said to pass --base, and --base was refused the same."""
    cfg = OmegaConf.create(OmegaConf.to_container(tiny_cfg))
    del cfg.model["name_or_path"]
    run = fake_run(tmp_path / "run", cfg)
    one_line_exit_2(capsys, [str(run), str(tmp_path / "out"), "--adapter-only"],
                    "has no model.name_or_path; pass the base with --base NAME_OR_PATH")
    # past the name now: the placeholder weights are what fails, in one line (a SafetensorError traceback before)
    line = one_line_exit_2(capsys, [str(run), str(tmp_path / "out"), "--adapter-only", "--base", "tiny-random"])
    assert line.startswith(f"grpo-export: {run}/adapter/adapter_model.safetensors cannot be read (") and line.endswith(
        "): it is damaged or cut short; give another adapter or checkpoint")


def test_a_checkpoints_model_card_gives_the_final_reward_of_its_own_records(tiny_cfg, tmp_path):
    """The card of checkpoint step-1 gave the whole run's final reward (0.9 here), not its own (0.0)."""
    from grpo_cli.commands.export import find_source, model_card

    run = fake_run(tmp_path / "run", tiny_cfg)
    step = fake_checkpoint(run, 1)
    (step / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward": 0.0}) + "\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "reward": r}) + "\n"
                                               for i, r in enumerate([0.0, 0.9, 0.9])))
    assert "final reward (mean of the last 10 % of steps): 0.0000" in model_card(
        find_source(run, "1"), "tiny-random", merged=False, dtype=None)
    assert "final reward (mean of the last 10 % of steps): 0.9000" in model_card(
        find_source(run, None), "tiny-random", merged=False, dtype=None)


@pytest.mark.slow
def test_mismatched_base_is_one_line(tiny_cfg, tiny_run, tmp_path, capsys):
    # shapes: the run config says the tiny model is half as wide as the one the adapter was trained on
    run = tmp_path / "narrow"
    cfg = tiny_cfg.copy()
    cfg.model.tiny.hidden_size = 32
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    (run / "adapter").symlink_to(tiny_run / "adapter")
    for extra in ([], ["--adapter-only"]):
        one_line_exit_2(capsys, [str(run), str(tmp_path / "out"), *extra], "trained on another base",
                        "but base tiny-random has", "--base")
    # the name the adapter recorded is not the run's base
    run = tmp_path / "renamed"
    run.mkdir()
    (run / ".hydra").symlink_to(tiny_run / ".hydra")
    (run / "adapter").mkdir()
    config = json.loads((tiny_run / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "Qwen/Qwen2.5-0.5B-Instruct"
    (run / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    (run / "adapter" / "adapter_model.safetensors").symlink_to(tiny_run / "adapter" / "adapter_model.safetensors")
    out = str(tmp_path / "out")
    one_line_exit_2(capsys, [str(run), out], "Qwen/Qwen2.5-0.5B-Instruct", "model.name_or_path=tiny-random")
    assert export_main([str(run), out, "--base", "tiny-random", "--adapter-only"]) == 0  # --base: yours


@pytest.mark.slow
def test_embedded_model_export_matches_base_plus_adapter(tmp_path):
    """The embedded GGUF base, dequantised, merged with an adapter: same logits, loads without GGUF or peft."""
    from hydra import compose, initialize_config_dir

    from grpo_cli.config.compose import CONF_DIR, register_recipes

    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["+recipe=quickstart", "trainer.device=cpu"])
    run, base_plus_adapter = make_run(tmp_path / "run", cfg, keep_model=True)  # the GGUF is dequantised once here
    out = tmp_path / "merged"
    assert export_main([str(run), str(out), "--dtype", "fp32"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    merged, ids, _ = exported_logits(out)
    with torch.no_grad():
        reference = base_plus_adapter(input_ids=ids).logits
        with base_plus_adapter.disable_adapter():
            base = base_plus_adapter(input_ids=ids).logits
    # W + s*B@A in one matrix rounds differently from W@x + s*B@(A@x): over 30 layers that is ~1e-4 on logits of
    # magnitude ~20 in fp32, so the tolerance is 1e-4 of the logits' scale; the adapter itself moves them 1000x more
    scale = reference.abs().max().item()
    print(f"logit scale {scale:.2f}, merged vs base+adapter {(merged - reference).abs().max().item():.2e}, "
          f"adapter's own effect {(base - reference).abs().max().item():.2e}")
    torch.testing.assert_close(merged, reference, atol=1e-4 * scale, rtol=0)
    assert (base - reference).abs().max().item() > 100 * 1e-4 * scale


LOAD_WITHOUT_PEFT = """
import sys, torch
sys.modules["peft"] = None  # importing peft now fails: the export must not need it
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
ids = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 5?"}], add_generation_prompt=True,
                              return_tensors="pt", return_dict=True)["input_ids"]
with torch.no_grad():
    torch.save(model(input_ids=ids).logits, sys.argv[2])
print(tok.decode(model.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1]:], skip_special_tokens=True))
"""


@pytest.mark.slow
def test_grpo_export_console_script_on_a_trained_run(trained_tiny_run, tmp_path):
    """A run grpo-train made (2 steps) through grpo-export, for real; a fresh process without peft loads and
    generates."""
    from peft import PeftModel

    run = trained_tiny_run
    proc = run_cli([str(run), str(tmp_path / "merged"), "--dtype", "fp32"], tmp_path, command="grpo-export")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [line.split("]")[0] for line in proc.stdout.splitlines() if "[" in line] == [
        f"grpo-export: [{i}/5" for i in range(1, 6)]
    loader = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_PEFT, str(tmp_path / "merged"), str(tmp_path / "l.pt")],
                            capture_output=True, text=True, timeout=300)
    assert loader.returncode == 0, loader.stderr[-2000:]
    cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
    tokenizer = load_tokenizer("tiny-random")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 + 5?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    base = load_base_model("tiny-random", tokenizer, torch.float32, tiny=dict(cfg.model.tiny), seed=cfg.trainer.seed)
    with torch.no_grad():
        expected = PeftModel.from_pretrained(base, run / "adapter")(input_ids=ids).logits
    torch.testing.assert_close(torch.load(tmp_path / "l.pt"), expected, atol=1e-4, rtol=0)
    again = run_cli([str(run), str(tmp_path / "merged")], tmp_path, command="grpo-export")
    assert again.returncode == 2 and again.stderr.strip().splitlines()[-1].startswith("grpo-export: OUT_DIR=")
