"""grpo-report on run and sweep dirs built the way the trainer and Hydra write them."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_cli.commands.report import final_value, main, make_report

SRC = Path(__file__).resolve().parents[2] / "src"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RUN_PNGS = ["reward.png", "kl.png", "clip_fraction.png", "completion_len.png", "entropy.png"]


def write_run(d: Path, ovs: list[str], steps: int = 30, beta: float = 0.04, eval_every: int = 0,
              metrics: bool = True) -> Path:
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in ovs))
    (d / ".hydra" / "config.yaml").write_text(
        f"model:\n  name: Qwen/Qwen2.5-0.5B-Instruct\nalgo:\n  beta: {beta}\n  clip_eps: 0.2\n"
        "reward:\n  fns: [correctness, format]\nnote: <a & b>\n")
    (d / "wandb").mkdir()
    (d / "job_status.json").write_text('{"status": "ok"}\n')  # as a sweep job that finished leaves it
    if not metrics:
        return d
    lines = []
    for s in range(1, steps + 1):
        corr, fmt = min(1.0, 0.1 + s / steps * 0.6), min(1.0, 0.3 + s / steps)
        row = {"step": s, "reward": corr + fmt, "reward_std": 0.4, "reward/correctness": corr,
               "reward/format": fmt, "frac_reward_zero_std": 0.1, "kl": beta * s * 0.01,
               "clip_fraction": 0.02 + 0.01 * math.sin(s), "loss": 0.01, "grad_norm": 0.5,
               "entropy": 1.2 - s * 0.01, "completion_len": 180 + s, "truncated_frac": 0.05,
               "lr": 1e-6, "step_time_s": 3.2, "gen_tokens_per_s": 900.0}
        if eval_every and s % eval_every == 0:
            row["eval/accuracy"] = 0.2 + s / steps * 0.3
        lines.append(json.dumps(row))
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return d


def write_sweep(d: Path, skip_job: int | None = None) -> Path:
    d.mkdir()
    (d / "multirun.yaml").write_text("hydra:\n  mode: MULTIRUN\n")
    jobs = [(b, c) for b in (0.0, 0.04) for c in (0.2, 0.3)]
    for i, (b, c) in enumerate(jobs):
        write_run(d / str(i), [f"algo.beta={b}", f"algo.clip_eps={c}"], beta=b, metrics=i != skip_job)
    (d / "sweep_summary.csv").write_text(
        "job,overrides,final_reward,status\n"
        + "".join(f'{i},"algo.beta={b} algo.clip_eps={c}",1.5,ok\n' for i, (b, c) in enumerate(jobs)))
    return d


def assert_png(f: Path) -> None:
    data = f.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 5000, f


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_run_dir(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", ["algo.beta=0.04"], eval_every=10)
    page = make_report(run).read_text()
    for name in [*RUN_PNGS, "eval_accuracy.png"]:
        assert_png(run / name)
        assert f"src='{name}'" in page
    assert "&lt;a &amp; b&gt;" in page and "Qwen/Qwen2.5-0.5B-Instruct" in page


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_run_dir_without_eval_and_out_dir(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", [])
    out = tmp_path / "out"
    assert main([str(run), "--out", str(out)]) == 0
    for name in RUN_PNGS:
        assert_png(out / name)
    assert not (out / "eval_accuracy.png").exists()
    assert "eval_accuracy" not in (out / "report.html").read_text()


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_sweep_heatmap(tmp_path: Path) -> None:
    sweep = write_sweep(tmp_path / "sweep")
    page = make_report(sweep).read_text()
    for name in ["sweep_reward.png", "sweep_kl.png", "sweep_clip_fraction.png", "sweep_heatmap.png"]:
        assert_png(sweep / name)
        assert f"src='{name}'" in page
    for i, (b, c) in enumerate([(0.0, 0.2), (0.0, 0.3), (0.04, 0.2), (0.04, 0.3)]):
        assert f"job {i}: <code>algo.beta={b} algo.clip_eps={c}</code>" in page
    assert "<table>" in page and "<th>final_reward</th>" in page
    assert "Skipped" not in page


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_sweep_skips_job_without_metrics(tmp_path: Path) -> None:
    sweep = write_sweep(tmp_path / "sweep", skip_job=2)
    page = make_report(sweep).read_text()
    assert "Skipped jobs without metrics: 2" in page
    assert "job 2:" not in page and "job 3:" in page
    assert_png(sweep / "sweep_heatmap.png")


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_one_varying_key_gives_bar_chart(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    for i, b in enumerate((0.0, 0.04, 0.1)):
        write_run(sweep / str(i), [f"algo.beta={b}", "algo.clip_eps=0.2"], beta=b)
    assert "sweep_heatmap.png" in make_report(sweep).read_text()
    assert_png(sweep / "sweep_heatmap.png")


def write_samples(run: Path, steps: list[int]) -> None:
    """samples.jsonl as the trainer writes it: per logged step, two prompts' completions."""
    rows = [{"step": s, "prompt": f"<|im_start|>user\nWhat is {p} + 1?", "completion": f"<b>{p + 1}</b> at step {s}",
             "reward": float(c), "advantage": c - 0.5, "reward/correctness": float(c)}
            for s in steps for p in (3, 4) for c in (0, 1)]
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def finish(run: Path, max_steps: int, adapter: bool) -> None:
    with (run / ".hydra" / "config.yaml").open("a") as f:
        f.write(f"trainer:\n  max_steps: {max_steps}\n")
    if adapter:
        (run / "adapter").mkdir()
        (run / "adapter" / "adapter_config.json").write_text("{}")


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_a_run_page_shows_the_newest_samples_and_marks_an_unfinished_run(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", [], steps=30)
    write_samples(run, [0, 29])
    finish(run, max_steps=40, adapter=False)
    page = make_report(run).read_text()
    assert "<h1>GRPO run: run (unfinished)</h1>" in page
    assert (f"<p class='unfinished'>unfinished: 30 of 40 steps logged, no final adapter (still running, stopped or "
            f"crashed); resume it with trainer.resume=auto hydra.run.dir={run}</p>") in page
    samples = page.split("<h2>Samples of step 29</h2>")[1].split("<h2>")[0]
    assert "4 of its 4 completions" in samples and samples.count("What is 3 + 1?") == 1  # a group's prompt once
    assert "&lt;b&gt;5&lt;/b&gt; at step 29" in samples and "at step 0" not in page  # the newest step, escaped
    assert "<td>1.000</td><td>0.500</td><td>1.000</td>" in samples  # reward, advantage, reward/correctness


def test_a_finished_run_is_not_marked_and_one_without_samples_says_so(tmp_path: Path) -> None:
    from grpo_cli.commands.report import samples_html, unfinished

    run = write_run(tmp_path / "run", [], steps=30)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert unfinished(run, rows) == "unfinished: 30 steps logged, no final adapter (still running, stopped or crashed)"
    finish(run, max_steps=30, adapter=True)
    assert unfinished(run, rows) is None
    assert unfinished(run, rows[:29]) == "unfinished: 29 of 30 steps logged (still running, stopped or crashed)"
    assert "No samples" in "".join(samples_html(run))
    epochs = write_run(tmp_path / "epochs", [], steps=12)  # trainer.epochs made 12 steps of the recipe's 30
    finish(epochs, max_steps=30, adapter=False)
    with (epochs / ".hydra" / "config.yaml").open("a") as f:
        f.write("  epochs: 2\n")
    rows = [json.loads(line) for line in (epochs / "metrics.jsonl").read_text().splitlines()]
    assert unfinished(epochs, rows) == ("unfinished: 12 steps logged, no final adapter (still running, stopped or "
                                        "crashed)")
    (epochs / "adapter").mkdir()
    (epochs / "adapter" / "adapter_config.json").write_text("{}")
    assert unfinished(epochs, rows) is None


def test_final_value_uses_last_tenth() -> None:
    rows = [{"step": s, "reward": float(s)} for s in range(1, 21)] + [{"step": 21, "kl": 0.1}]
    assert final_value(rows) == 19.5
    assert final_value(rows[:3]) == 3.0


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_bad_dir_returns_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], make: str) -> None:
    d = tmp_path / "nope"
    if make == "empty":
        d.mkdir()
    with pytest.raises(SystemExit) as stop:
        main([str(d)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("grpo-report: ") and str(d) in err and ";" in err


@pytest.mark.slow
def test_main_runs_headless_in_fresh_process(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", ["algo.beta=0.04"])
    env = {k: v for k, v in os.environ.items() if k not in ("MPLBACKEND", "DISPLAY")}
    env["PYTHONPATH"] = str(SRC)
    proc = subprocess.run(
        [sys.executable, "-c", "from grpo_cli.commands.report import main; raise SystemExit(main())", str(run)],
        env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(run / "report.html")
    assert_png(run / "reward.png")
