"""The repository stands on its own: no file points outside it, and the GSM8K sample ships with it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

# Paths that exist only on some developer's machine or beside this checkout. The literal pieces are
# split so that this file does not match its own patterns.
_OUTSIDE = [
    (re.compile(r"\.\./+shared\b"), "a path into the shared folder beside the checkout"),
    (re.compile(r"(?<![\w.-])shared/(?:reference|data|design\.md|hooks)\b"), "the shared folder beside the checkout"),
    (re.compile(r"(?<![\w.:/~-])/(?:work|root)/"), "an absolute path of a developer machine"),
    (re.compile(r"(?<![\w.:/~-])/(?:home|Users)/[A-Za-z_][\w.-]*/"), "a home directory"),
    (re.compile(r"\b[A-Za-z]:\\+Users\\+"), "a Windows home directory"),
]
# Scratch paths are fine in code (mktemp, tempfile) but not in documentation or configs.
_TMP = re.compile(r"(?<![\w.:/~-])/tmp/")
_DOC_SUFFIXES = {".md", ".rst", ".txt", ".yaml", ".yml", ".toml", ".cfg", ".ini"}
_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+")
_SKIP_DIRS = {".git", ".venv", "__pycache__", "outputs", "multirun", "wandb", "build", "dist", ".pytest_cache",
              ".ruff_cache", ".gpu_wheels", "bench_out"}


def outside_references(text: str, suffix: str) -> list[str]:
    """Each reference in `text` to a path outside the repository, as 'line N: what (match)'."""
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = _URL.sub("", line)
        patterns = _OUTSIDE + ([(_TMP, "a scratch path")] if suffix in _DOC_SUFFIXES else [])
        for pattern, what in patterns:
            for match in pattern.finditer(line):
                found.append(f"line {lineno}: {what} ({match.group(0)!r})")
    return found


def repository_files() -> list[Path]:
    """Tracked and new (not ignored) files; a plain directory walk where there is no git checkout."""
    git = shutil.which("git")
    if git:
        proc = subprocess.run([git, "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                              capture_output=True, text=True)
        if proc.returncode == 0:
            return [REPO / name for name in proc.stdout.split("\0") if name]
    return [p for p in REPO.rglob("*") if p.is_file() and not (_SKIP_DIRS & set(p.relative_to(REPO).parts))
            and not any(part.endswith(".egg-info") for part in p.parts)]


def test_no_file_points_outside_the_repository() -> None:
    files = repository_files()
    assert any(f.name == "README.md" for f in files) and len(files) > 20
    problems = []
    for path in files:
        if path.is_symlink() or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # images and other binary files
        problems += [f"{path.relative_to(REPO)} {p}" for p in outside_references(text, path.suffix)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("text", "suffix"),
    [
        ("see ../" + "shared/" + "data/gsm8k/test.jsonl", ".py"),
        ("the contract in shared/" + "reference/grpo-algorithm.md", ".md"),
        ("python=/" + "work/main/.venv/bin/python", ".sh"),
        ('cd "/' + 'root/project"', ".py"),
        ("data.path=/" + "home/alice/gsm8k/train.jsonl", ".md"),
        ("open /" + "Users/bob/Downloads/x.jsonl", ".yaml"),
        ("C:\\" + "Users\\carol\\data", ".md"),
        ("hydra.run.dir=/" + "tmp/run1", ".md"),
    ],
)
def test_checker_flags_outside_paths(text: str, suffix: str) -> None:
    assert outside_references(text, suffix)


@pytest.mark.parametrize(
    ("text", "suffix"),
    [
        ("command -v nvidia-smi >/dev/null 2>&1", ".sh"),
        ("LOGS=$(mktemp -d /" + "tmp/gpu-check-logs.XXXXXX)", ".sh"),
        ("https://github.com/openai/grade-school-math/" + "work/x and https://example.org/" + "home/y/z", ".md"),
        ("a dir of shared/runs, shared prompt passes, the shared/ helpers", ".md"),
        ("~/" + "work/notes and $HOME/" + "work/x", ".md"),
        ("src/grpo_cli/sample_data/gsm8k/test.jsonl", ".md"),
    ],
)
def test_checker_leaves_legitimate_paths_alone(text: str, suffix: str) -> None:
    assert outside_references(text, suffix) == []


def test_gsm8k_sample_config_reads_the_packaged_rows(compose) -> None:
    from grpo_cli.config.compose import SAMPLE_DATA_DIR
    from grpo_cli.tasks.sources import load_rows

    cfg = compose(["+recipe=gsm8k", "model=smollm2-135m", "data=gsm8k_sample"])
    assert Path(cfg.data.path) == SAMPLE_DATA_DIR / "gsm8k" / "train.jsonl"
    train, test = load_rows(cfg.data, split="train"), load_rows(cfg.data, split="test")
    assert (len(train), len(test)) == (46, 48)
    # the answer column holds GSM8K's whole solution; the gsm8k reward reads the number after "####"
    assert test[0]["answer"].endswith("#### 18") and "Janet" in test[0]["messages"][-1]["content"]
    assert cfg.data.system_prompt and test[0]["messages"][0]["role"] == "system"
    assert (SAMPLE_DATA_DIR / "gsm8k" / "LICENSE").read_text().startswith("MIT License")


@pytest.mark.slow
def test_wheel_carries_the_gsm8k_sample_and_its_licence(tmp_path: Path) -> None:
    """A pip install has the sample too: build the wheel from a copy of the sources and look inside."""
    source = tmp_path / "src-copy"
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
                           "-w", str(tmp_path / "wheel"), str(source)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("grpo_cli-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("train.jsonl", "test.jsonl", "LICENSE", "README.md"):
        assert f"grpo_cli/sample_data/gsm8k/{name}" in names
    assert "grpo_cli/conf/data/gsm8k_sample.yaml" in names
