"""logger=wandb: the real grpo-train writes an offline W&B run; it is read back from its .wandb file.

wandb 0.31 has no Python reader for .wandb files any more (the old wandb.sdk.internal.datastore is gone; the
Go wandb-core writes them), so `wandb_records` below reads the format itself: a 7-byte file header
(":W&B", magic 0xBEE1, version 0), then LevelDB-log blocks of 32 KiB, each record chunk with a 7-byte header
(zlib CRC-32 of type byte + data, length, type FULL/FIRST/MIDDLE/LAST); the payloads are serialized
`wandb.proto.wandb_internal_pb2.Record` messages.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import prewarmed
import pytest
from conftest import read_jsonl, script

TINY = ["+recipe=quickstart", "model=tiny", "trainer.max_steps=3", "rollout.max_new_tokens=4"]
FAKE_KEY = "FAKEwandbKEY" + "0123456789abcdef" * 3  # 60 characters: W&B only checks the length offline
SECTION_6 = ["reward", "reward_std", "frac_reward_zero_std", "kl", "clip_fraction", "loss", "grad_norm", "entropy",
             "completion_len", "truncated_frac", "lr", "step_time_s", "gen_tokens_per_s"]

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path):
    """Yield every `Record` of a .wandb transaction log, checking the file header and each chunk's CRC."""
    from wandb.proto import wandb_internal_pb2  # imported here: the tests without a W&B run do not pay for it
    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"not a W&B log: {data[:HEADER]!r}"
    pos, parts = HEADER, []
    while True:
        if BLOCK - pos % BLOCK < HEADER:  # a block tail too short for a chunk header is zero padding
            pos += BLOCK - pos % BLOCK
        if pos + HEADER > len(data):
            return
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if crc == length == kind == 0:  # preallocated, never written
            return
        payload = data[pos + HEADER:pos + HEADER + length]
        assert len(payload) == length, "truncated record"
        if version == 0:
            assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"bad CRC at offset {pos}"
        pos += HEADER + length
        if kind in (FULL, FIRST):
            parts = [payload]
        else:
            parts.append(payload)
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            yield record


def _items(items) -> dict:
    """History/config/summary items as {"a/b": value}."""
    return {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in items}


def read_offline_run(run_dir: Path) -> dict:
    (wandb_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    out = {"history": {}, "config": {}, "run": None, "dir": wandb_file.parent}
    for record in wandb_records(wandb_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = _items(record.history.item)
            out["history"].setdefault(record.history.step.num, {}).update(row)
        elif kind == "run":
            out["run"] = record.run
            out["config"].update(_items(record.run.config.update))
        elif kind == "config":
            out["config"].update(_items(record.config.update))
    return out


def clean_env(**extra) -> dict:
    """The environment for a child process: no real W&B settings or credentials of whoever runs the tests."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "NETRC"}
    env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    """One real run with logger=wandb mode=offline and a (fake) WANDB_API_KEY in the environment."""
    cwd = tmp_path_factory.mktemp("wandb_run")
    run_dir = cwd / "run"
    env = clean_env(WANDB_API_KEY=FAKE_KEY, WANDB_CACHE_DIR=str(cwd / "wb_cache"), WANDB_DATA_DIR=str(cwd / "wb_data"),
                    WANDB_CONFIG_DIR=str(cwd / "wb_config"))
    t0 = time.time()
    proc = prewarmed.run([script("grpo-train"), *TINY, "trainer.log_samples_every=1", "logger=wandb",
                           "logger.wandb.mode=offline", "logger.wandb.tags=[ci]", f"hydra.run.dir={run_dir}"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"cwd": cwd, "run_dir": run_dir, "proc": proc, "seconds": time.time() - t0,
            "wandb": read_offline_run(run_dir)}


@pytest.mark.slow
def test_history_matches_metrics_jsonl(offline_run):
    rows = read_jsonl(offline_run["run_dir"] / "metrics.jsonl")
    history = offline_run["wandb"]["history"]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert sorted(history) == [0, 1, 2]
    for row in rows:
        logged = history[row["step"]]
        assert logged["_step"] == row["step"]
        for key in ("reward", "kl", "clip_fraction"):
            assert logged[key] == pytest.approx(row[key], rel=1e-6, abs=1e-9), (row["step"], key)
        for key in SECTION_6 + [k for k in row if k.startswith(("reward/", "eval/"))]:
            assert key in logged, (row["step"], key)
            assert logged[key] == pytest.approx(row[key], rel=1e-6, abs=1e-9, nan_ok=True), (row["step"], key)


@pytest.mark.slow
def test_config_is_the_resolved_hydra_config(offline_run):
    from omegaconf import OmegaConf

    config = offline_run["wandb"]["config"]
    resolved = OmegaConf.to_container(OmegaConf.load(offline_run["run_dir"] / ".hydra" / "config.yaml"), resolve=True)
    assert isinstance(config["algo"]["beta"], float) and config["algo"]["beta"] == resolved["algo"]["beta"]
    assert config["trainer"]["max_steps"] == 3
    assert config["rollout"]["max_new_tokens"] == 4  # a key with "token" in its name is not taken for a secret
    assert config["eval"]["max_new_tokens"] == 4  # ${rollout.max_new_tokens}, resolved
    assert config["logger"]["wandb"]["mode"] == "offline"
    assert FAKE_KEY not in json.dumps(config)
    # the whole of it: what Hydra saved in .hydra/config.yaml, resolved
    assert {k: v for k, v in config.items() if k != "_wandb"} == resolved


@pytest.mark.slow
def test_name_group_tags_from_hydra(offline_run):
    run = offline_run["wandb"]["run"]
    assert run.project == "grpo-cli"
    assert run.run_group == "quickstart"  # the recipe; a single run, so no sweep suffix
    # the job's overrides, joined as Hydra's override_dirname, without logger.* and the recipe
    assert run.display_name == "model=tiny,rollout.max_new_tokens=4,trainer.log_samples_every=1,trainer.max_steps=3"
    assert list(run.tags) == ["ci"]


@pytest.mark.slow
def test_samples_table_logged(offline_run):
    history, files = offline_run["wandb"]["history"], offline_run["wandb"]["dir"] / "files"
    samples = read_jsonl(offline_run["run_dir"] / "samples.jsonl")
    for step in (0, 1, 2):
        logged = history[step]
        assert logged["samples/_type"] == "table-file"
        table = json.loads((files / logged["samples/path"]).read_text())
        assert {"prompt", "completion", "reward"} <= set(table["columns"])
        assert len(table["data"]) == sum(1 for s in samples if s["step"] == step)


@pytest.mark.slow
def test_api_key_never_written_or_printed(offline_run):
    proc = offline_run["proc"]
    assert FAKE_KEY not in proc.stdout + proc.stderr
    files = [p for p in offline_run["cwd"].rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files) and len(files) > 10
    leaked = [str(p) for p in files if FAKE_KEY.encode() in p.read_bytes()]
    assert not leaked, leaked


@pytest.mark.slow
def test_console_is_plain_and_quiet_off_a_terminal(offline_run):
    out = offline_run["proc"].stdout
    step_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 3 and step_lines[-1].startswith("step 2 done (3/3)")
    assert all(k in step_lines[0] for k in ("reward", "kl", "clip", "tok/s", "eta"))
    assert "\x1b[" not in out and "\r" not in out  # no redraws, no colour codes in a log file
    sync_lines = [line for line in out.splitlines() if "wandb sync" in line and "offline-run-" in line]
    assert len(sync_lines) >= 1  # how to upload later, once at the start (and in the summary)
    assert "adapter" in out and "time, this attempt" in out
    # W&B's own banner ("wandb: Tracking run with wandb version ...", "wandb: Find logs at ...") stays off
    assert "wandb:" not in out + offline_run["proc"].stderr


# ---- mode selection and fallback (no model) ------------------------------------------------------------------
@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    for key in list(os.environ):
        if key.startswith("WANDB_") or key == "NETRC":
            monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_mode_auto_without_credentials_is_offline(no_credentials):
    from grpo_cli.tracking import has_wandb_credentials, resolve_wandb_mode

    assert not has_wandb_credentials()
    assert resolve_wandb_mode("auto") == ("offline", None)
    assert resolve_wandb_mode(None) == ("offline", None)
    mode, note = resolve_wandb_mode("online")
    assert mode == "offline" and "WANDB_API_KEY" in note
    assert resolve_wandb_mode("offline") == ("offline", None)
    assert resolve_wandb_mode("disabled") == ("disabled", None)


def test_mode_auto_with_credentials_is_online(no_credentials, monkeypatch):
    from grpo_cli.tracking import resolve_wandb_mode

    netrc = no_credentials / ".netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + FAKE_KEY + "\n")
    netrc.chmod(0o600)
    assert resolve_wandb_mode("auto") == ("online", None)
    netrc.unlink()
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    assert resolve_wandb_mode("auto") == ("online", None)
    monkeypatch.setenv("WANDB_MODE", "offline")  # an explicit WANDB_MODE wins over auto
    assert resolve_wandb_mode("auto") == ("offline", None)


def test_bad_mode_is_a_config_error(compose):
    from grpo_cli.config.compose import ConfigError
    from grpo_cli.run.validate import validate

    with pytest.raises(ConfigError, match="logger.wandb.mode=sometimes is invalid"):
        validate(compose(["+recipe=quickstart", "logger=wandb", "logger.wandb.mode=sometimes"]))


def test_scrub_secrets_drops_keys_and_values(monkeypatch):
    from grpo_cli.tracking import scrub_secrets

    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    cfg = {"a": {"api_key": "x", "hf_token": "y", "note": f"key={FAKE_KEY}"}, "b": [FAKE_KEY, 1],
           "rollout": {"max_new_tokens": 4, "tokenizer": "t"}, "wandbApiKey": "z", "client_secret": "s"}
    assert scrub_secrets(cfg) == {"a": {"note": "key=<redacted>"}, "b": ["<redacted>", 1],
                                  "rollout": {"max_new_tokens": 4, "tokenizer": "t"}}


FALLBACK = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from grpo_cli.config.schema import LoggerConfig, WandbConfig
    from grpo_cli.tracking import WandbSink, open_tracker
    run_dir = Path(sys.argv[1])
    cfg = LoggerConfig(backend="wandb", wandb=WandbConfig(mode="online", init_timeout=3, finish_timeout=10))
    tracker = open_tracker(run_dir, cfg, {"algo": {"beta": 0.04}}, total_steps=2)
    wandb = [s for s in tracker.sinks if isinstance(s, WandbSink)]
    assert len(wandb) == 1 and wandb[0].mode == "offline", tracker.sinks
    for step in range(2):
        tracker.log({"step": step, "reward": 0.5 + step, "kl": 0.0, "clip_fraction": 0.0, "gen_tokens_per_s": 1.0,
                     "step_time_s": 0.1})
    tracker.close({"steps": 2, "time_s": 1.0, "adapter": str(run_dir / "adapter")})
""")


@pytest.mark.slow
@pytest.mark.parametrize("server", ["closed_port", "silent_server"])
def test_online_init_failure_falls_back_to_offline(tmp_path, server):
    """A W&B server that refuses connections, or accepts them and never answers (loopback only), costs at most
    init_timeout and then the run logs offline; nothing crashes."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    if server == "closed_port":
        sock.close()
    else:
        sock.listen(16)  # the kernel completes the handshakes; nobody ever reads or answers
    try:
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        env = clean_env(WANDB_API_KEY=FAKE_KEY, WANDB_BASE_URL=f"http://127.0.0.1:{port}",
                        WANDB_CACHE_DIR=str(tmp_path / "wb_cache"), WANDB_DATA_DIR=str(tmp_path / "wb_data"),
                        WANDB_CONFIG_DIR=str(tmp_path / "wb_config"))
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-c", FALLBACK, str(run_dir)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        seconds = time.time() - t0
    finally:
        sock.close()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "W&B online init failed" in out and "logging offline instead" in out
    assert "wandb sync" in out
    assert FAKE_KEY not in out
    assert seconds < 60, seconds
    history = read_offline_run(run_dir)["history"]
    assert sorted(history) == [0, 1] and history[1]["reward"] == 1.5
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1]


@pytest.fixture
def hydra_job():
    """Make HydraConfig.get() answer like inside grpo-train, for given overrides; restored afterwards."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import read_write

    from grpo_cli.config.compose import CONF_DIR, register_recipes

    register_recipes()
    saved = HydraConfig.instance().cfg

    def _set(overrides: list[str], multirun_dir: str | None = None):
        from hydra.types import RunMode

        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
        with read_write(cfg.hydra):
            cfg.hydra.mode = RunMode.MULTIRUN if multirun_dir else RunMode.RUN
            if multirun_dir:
                cfg.hydra.sweep.dir = multirun_dir
        HydraConfig.instance().set_config(cfg)

    yield _set
    HydraConfig.instance().cfg = saved


@pytest.mark.slow  # over ~1 s: make test-fast stays under 45 s
def test_name_and_group_in_a_multirun(hydra_job):
    from grpo_cli.tracking import _hydra_names

    overrides = ["+recipe=quickstart", "model=tiny", "algo.beta=0.0", "logger=wandb", "logger.wandb.mode=offline"]
    hydra_job(overrides)
    assert _hydra_names({}) == ("algo.beta=0.0,model=tiny", "quickstart")
    hydra_job(overrides, multirun_dir="multirun/2026-01-02/03-04-05")
    assert _hydra_names({}) == ("algo.beta=0.0,model=tiny", "quickstart-2026-01-02_03-04-05")
    hydra_job(["algo.beta=0.1"], multirun_dir="sweeps/beta")
    assert _hydra_names({}) == ("algo.beta=0.1", "sweep-beta")
    hydra_job([])
    assert _hydra_names({}) == (None, None)


def test_names_outside_hydra():
    from hydra.core.hydra_config import HydraConfig

    from grpo_cli.tracking import _hydra_names

    if HydraConfig.initialized():
        pytest.skip("another test left a HydraConfig behind")
    assert _hydra_names({}) == (None, None)


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, offline_run):
    """The run id is kept in the run dir; the resumed segment logs under it (resume="allow"), from the checkpoint's step
    on. Offline each segment is its own folder named after that one id, and the sync hint uploads them together."""
    run_dir = tmp_path / "run"
    env = clean_env(WANDB_CACHE_DIR=str(tmp_path / "wb_cache"), WANDB_DATA_DIR=str(tmp_path / "wb_data"),
                    WANDB_CONFIG_DIR=str(tmp_path / "wb_config"))
    args = [script("grpo-train"), "+recipe=quickstart", "model=tiny", "rollout.max_new_tokens=4",
            "data.prompts_per_step=2", "algo.num_generations=2", "logger=wandb", "logger.wandb.mode=offline",
            "trainer.save_every=1", "trainer.log_samples_every=0", f"hydra.run.dir={run_dir}"]
    first = prewarmed.run([*args, "trainer.max_steps=2"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    second = prewarmed.run([*args, "trainer.max_steps=3", "trainer.resume=auto",
                             "trainer.resume_allow_changes=[trainer.max_steps]"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id

    segments = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert [p.parent.name.rsplit("-", 1)[1] for p in segments] == [run_id, run_id]
    steps = []
    for segment in segments:
        runs = [r.run for r in wandb_records(segment) if r.WhichOneof("record_type") == "run"]
        assert runs and all(r.run_id == run_id for r in runs)
        history = [r for r in wandb_records(segment) if r.WhichOneof("record_type") == "history"]
        steps.append(sorted({r.history.step.num for r in history}))
    assert steps == [[0, 1], [2]]
    assert f"wandb sync {run_dir}/wandb/offline-run-*-{run_id}" in second.stdout
    assert offline_run["wandb"]["run"].run_id != run_id  # another run dir, another W&B run
    assert "W&B keeps" not in second.stdout + second.stderr  # nothing past its checkpoint was logged before

    # from the checkpoint after 2 steps again: step 2 was logged, and W&B drops a step logged a second time
    third = prewarmed.run([*args, "trainer.max_steps=3", f"trainer.resume={run_dir}/checkpoints/step-000002",
                           "trainer.resume_allow_changes=[trainer.max_steps]"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, third.stderr[-3000:]
    assert ("warning: W&B keeps step 2 as the earlier attempt logged them (it drops a step logged again), while this "
            "attempt trains them again from the checkpoint after 2 step(s); metrics.jsonl holds this attempt's"
            ) in " ".join((third.stdout + third.stderr).split()), third.stdout + third.stderr


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_worker_run_logs_its_staleness_and_sync_gap_to_wandb(tmp_path):
    """rollout.placement=worker rollout.max_staleness=1 with logger=wandb offline: each step's policy version,
    staleness and sync gap are in the W&B history, equal to metrics.jsonl's."""
    from test_async_rollouts import TINY as WORKER_TINY
    from test_async_rollouts import WORKER

    run_dir = tmp_path / "run"
    env = clean_env(WANDB_CACHE_DIR=str(tmp_path / "wb_cache"), WANDB_DATA_DIR=str(tmp_path / "wb_data"),
                    WANDB_CONFIG_DIR=str(tmp_path / "wb_config"))
    proc = prewarmed.run([script("grpo-train"), *WORKER_TINY, *WORKER, "logger=wandb", "logger.wandb.mode=offline",
                          f"hydra.run.dir={run_dir}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, history = read_jsonl(run_dir / "metrics.jsonl"), read_offline_run(run_dir)["history"]
    assert [r["rollout/staleness"] for r in rows] == [0, 1, 1, 1]
    assert sorted(history) == [r["step"] for r in rows]
    for row in rows:
        for key in ("rollout/version", "rollout/staleness", "sync/logp_gap", "rollout/worker_passes_s"):
            assert history[row["step"]][key] == pytest.approx(row[key], rel=1e-6, abs=1e-9), (row["step"], key)
