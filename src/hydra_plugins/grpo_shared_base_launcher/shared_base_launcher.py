"""The Launcher class and its ConfigStore entry (group hydra/launcher, name shared_base). Hydra imports this module
at every start to find its plugins: it imports nothing of grpo-cli until a sweep is launched with it. (No
`from __future__ import annotations`: Hydra runs the module outside sys.modules, where a dataclass cannot read
string annotations.)"""

from collections.abc import Sequence
from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


@dataclass
class SharedBaseLauncherConf:
    _target_: str = "hydra_plugins.grpo_shared_base_launcher.shared_base_launcher.SharedBaseLauncher"


ConfigStore.instance().store(group="hydra/launcher", name="shared_base", node=SharedBaseLauncherConf,
                             provider="grpo-cli")


class SharedBaseLauncher(Launcher):
    """Runs a sweep's jobs in one process on one loaded base, one LoRA adapter each, their generation together
    (grpo_cli.sweep.shared_base.launch); the jobs may differ only in what leaves the base and the batch's shape
    alone, and a sweep whose jobs differ elsewhere is refused before anything loads."""

    def __init__(self) -> None:
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context, self.task_function = config, hydra_context, task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from grpo_cli.sweep.shared_base import launch

        assert self.config is not None, "Hydra calls setup before launch"
        return launch(self.config, self.hydra_context, self.task_function, job_overrides, initial_job_idx)
