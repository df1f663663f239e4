"""The docs hold together: every link between them lands on a file and a heading that exist, and every option name,
value, group option and recipe they show is one grpo-train accepts (schema.py's options, conf/, the recipes, the
registries). A renamed option, a choice the docs spell differently (`reinforce++` for
reinforce_plus_plus_baseline) or a section that moved fails here, not in a reader's shell."""

from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

from grpo_cli.config.compose import CONF_DIR, available_recipes
from grpo_cli.config.schema import OPTIONS, declares

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]  # docs/results/: one file per study
FENCED = re.compile(r"^```.*?^```", re.S | re.M)


def prose(text: str) -> str:
    """The text without its fenced code blocks (a link or heading inside one is code)."""
    return FENCED.sub("", text)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped (backticks, dots, parentheses; not `_` or
    `-`), spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """Every heading's anchor, a repeated heading's as GitHub numbers them (`name-1`, `name-2`)."""
    found: set[str] = set()
    for heading in re.findall(r"^#+ (.+)$", prose(doc.read_text()), re.M):
        anchor, n = github_anchor(heading), 0
        while (anchor if n == 0 else f"{anchor}-{n}") in found:
            n += 1
        found.add(anchor if n == 0 else f"{anchor}-{n}")
    return found


def broken_links(doc: Path) -> list[str]:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(doc.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: {file.name} has no such heading")
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(REPO)))
def test_every_link_between_the_docs_lands_on_a_file_and_a_heading(doc):
    assert broken_links(doc) == []


def test_the_link_check_sees_a_heading_that_moved(tmp_path):
    (tmp_path / "a.md").write_text("# A\n\n## Loss types (`algo.loss_type`)\n\nsee [b](b.md#gone) and [c](c.md)\n")
    (tmp_path / "b.md").write_text("# B\n")
    assert broken_links(tmp_path / "a.md") == ["b.md#gone: b.md has no such heading", "c.md: no such file"]
    assert "loss-types-algoloss_type" in anchors(tmp_path / "a.md")


def section(doc: Path, anchor: str) -> str:
    """The text under the heading with `anchor`, up to the next heading of its level or above."""
    text = prose(doc.read_text())
    for match in re.finditer(r"^(#+) (.+)$", text, re.M):
        if github_anchor(match.group(2)) == anchor:
            rest = text[match.end():]
            end = re.search(rf"^#{{1,{len(match.group(1))}}} ", rest, re.M)
            return rest[:end.start()] if end else rest
    return ""


def test_usage_points_to_the_section_that_holds_the_loss_type_table():
    """docs/usage.md's loss types paragraph links to where the registry's table is (it said "in the README's
    Extending section", long after the table had moved to docs/algorithm.md)."""
    from grpo_cli.algorithm import loss_types_table

    usage = REPO / "docs" / "usage.md"
    paragraph = section(usage, "mini-batches-clipping-and-loss-types")
    targets = [t for t in re.findall(r"\]\(([^)\s]+)\)", paragraph) if "#" in t]
    assert any(loss_types_table() in section((usage.parent / t.split("#")[0]).resolve(), t.split("#")[1])
               for t in targets), targets


# ---- option names and values -----------------------------------------------------------------------------------
GROUPS = sorted(d.name for d in CONF_DIR.iterdir() if d.is_dir() and d.name != "hydra")
SECTIONS = sorted({o.key.split(".")[0] for o in OPTIONS if "." in o.key})
OPTION_KEY = re.compile(rf"\+*((?:{'|'.join(SECTIONS)})\.[\w.*]+)")
FILE_NAME = re.compile(r"\.(py|jsonl?|yaml|md|csv|png|html|parquet|arrow|safetensors|wandb|txt)$")


def code_lines(text: str) -> list[str]:
    """The code a doc shows: its fenced and indented block lines and its inline code spans, each a line. A command
    shown failing on purpose (`$ grpo-train ...` followed by its `grpo-train: ...` error) is left out."""
    lines = []
    fenced = [line for block in FENCED.findall(text) for line in block.splitlines()[1:-1]]
    rest = FENCED.sub("", text).splitlines()
    for i, line in enumerate(rest):
        failing = line.strip().startswith("$ ") and i + 1 < len(rest) and re.match(r"\s*grpo-\w+: ", rest[i + 1])
        if line.startswith("    ") and not failing:
            lines.append(line.strip().removeprefix("$ "))
    spans = re.findall(r"`([^`\n]+)`", FENCED.sub("", re.sub(r"^    .*$", "", text, flags=re.M)))
    return [*fenced, *lines, *spans]


def words(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote in prose-like code
        return line.split()


def option(key: str):
    return next((o for o in OPTIONS if len(o.key.split(".")) == len(key.split(".")) and all(
        a in ("*", b) for a, b in zip(o.key.split("."), key.split("."), strict=True))), None)


def values_of(word: str) -> list:
    """The value(s) of an override as Hydra reads them (a sweep's comma list: each)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    override = OverridesParser.create().parse_override(word)
    return list(override.sweep_iterator()) if override.is_sweep_override() else [override.value()]


def placeholder(text: str) -> bool:
    """NAME, DIR, D, KEY=..., ${...}, $dtype, a key with a `*`: a slot for the reader's value, not a value."""
    return bool(re.search(r"\b[A-Z][A-Z_]*\b|\.\.\.|\$|\*", text))


def refused(word: str, plugins: bool = False) -> str | None:
    """Why grpo-train would refuse the override `word` of a doc (None: it takes it, or it is not one). With `plugins`
    (the line imports modules of the reader's) a registry's choice may be one they register: not checked."""
    key, eq, value = word.partition("=")
    name = key.lstrip("+~")
    if not eq or placeholder(word):
        return None
    if name == "recipe":
        return None if value in available_recipes() else f"{word}: no such recipe"
    if name in GROUPS:
        return None if (CONF_DIR / name / f"{value}.yaml").is_file() else f"{word}: no such {name} option"
    if not OPTION_KEY.fullmatch(key) or FILE_NAME.search(name):
        return None
    if not declares(name):
        return f"{word}: no such option"
    rule = option(name).rules[0] if option(name) else None
    if rule is None or rule.choices is None or plugins:
        return None
    alternatives = value.split("|")  # `logger.wandb.mode=auto|online|offline` lists the values one may give
    bad = [v for a in alternatives for v in values_of(f"{key}={a}") if not rule.test(v)]
    return f"{word}: {name} takes {rule.describe()}" if bad else None


def not_an_option(span: str) -> str | None:
    """Why a bare name in inline code (`algo.filter_groups`) is no option; None when it is one, or is no key at all
    (a file, a placeholder, grpo_cli code such as `rollout.completion_logprobs`)."""
    match = OPTION_KEY.fullmatch(span.strip())
    if match is None or FILE_NAME.search(span) or placeholder(span) or span.endswith("."):
        return None
    return None if declares(match.group(1)) or is_code(match.group(1)) else f"{span}: no such option"


def is_code(name: str) -> bool:
    """`name` is a module or attribute of grpo_cli (`rollout.compiled.CompiledEngine`)."""
    module, _, attribute = f"grpo_cli.{name}".rpartition(".")
    try:
        return hasattr(importlib.import_module(module), attribute)
    except ImportError:
        return False


def listed_choices(text: str) -> list[str]:
    """`KEY` (a, b, c) in prose lists the choices of KEY: each one must be a value KEY takes."""
    problems = []
    for key, items in re.findall(r"`([a-z_]+\.[a-z_.]+)` \(([^()]+)\)", prose(text)):
        names = [item.strip() for item in items.split(",")]
        rule = option(key).rules[0] if option(key) else None
        if rule is None or rule.choices is None or not all(re.fullmatch(r"[\w+@.-]+", n) for n in names):
            continue
        problems += [f"`{key}` ({items}): {n} is not one of {rule.describe()}" for n in names if not rule.test(n)]
    return problems


def doc_problems(text: str) -> list[str]:
    problems = listed_choices(text)
    for line in code_lines(text):
        if " is invalid: " in line:  # an error message quoted
            continue
        shown = words(line)
        plugins = any(w.startswith("plugins=") for w in shown)
        problems += [p for p in (refused(w, plugins) for w in shown) if p]
        problems += [p for p in map(not_an_option, shown) if p and "=" not in line]
    return sorted(set(problems))


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: str(d.relative_to(REPO)))
def test_every_option_value_and_group_option_the_docs_show_is_accepted(doc):
    assert doc_problems(doc.read_text()) == []


def test_the_option_check_sees_a_misnamed_option_a_wrong_choice_and_a_missing_recipe():
    text = ("`algo.advantage` (grpo, reinforce++)\n\n    grpo-train +recipe=nope algo.clip_epss=0.3 model=huge\n\n"
            "`algo.objective=cispo` and `rollout.engine=hf,turbo`, `trainer.max_step`\n\n"
            "    $ grpo-train +recipe=quickstart algo.clip_eps=2\n    grpo-train: algo.clip_eps=2 is invalid\n")
    assert doc_problems(text) == [
        "+recipe=nope: no such recipe", "`algo.advantage` (grpo, reinforce++): reinforce++ is not one of grpo, rloo, "
        "reinforce_plus_plus_baseline, opo, grpo_passk", "algo.clip_epss=0.3: no such option",
        "model=huge: no such model option", "rollout.engine=hf,turbo: rollout.engine takes auto, compiled, hf, "
        "merged, vllm", "trainer.max_step: no such option"]


def test_the_results_index_lists_every_study():
    """docs/results/README.md is the index of the measurements: a study file it does not link is one no reader finds
    from the README."""
    index = REPO / "docs" / "results" / "README.md"
    linked = {t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", prose(index.read_text()))}
    studies = {f.name for f in index.parent.glob("*.md")} - {index.name}
    assert len(studies) > 10 and studies <= linked, sorted(studies - linked)
