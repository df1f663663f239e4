"""The `tensorboard` logger (logger=tensorboard): each step's numbers as TensorBoard scalars in RUN_DIR/tensorboard/
(`tensorboard --logdir outputs` shows every run), written by torch's SummaryWriter, which needs the `tensorboard`
package (pip install 'grpo-cli[tensorboard]'; grpo-train refuses the logger before the model loads without it).
A resumed run purges what an earlier attempt wrote after the checkpoint's step, as metrics.jsonl is cut back."""

from __future__ import annotations

import math

from grpo_cli.base.errors import error_line, warn
from grpo_cli.base.metrics import TENSORBOARD_DIR
from grpo_cli.config.schema import LoggerConfig
from grpo_cli.tracking.sinks import LOGGERS, NullSink, RunInfo

FOLDER = TENSORBOARD_DIR


@LOGGERS.register("tensorboard")
def tensorboard_sink(cfg_logger: LoggerConfig, run: RunInfo) -> TensorBoardSink | None:
    """The run's TensorBoard writer; None (with a warning) when it cannot start."""
    try:
        return TensorBoardSink(run)
    except Exception as err:  # an unwritable folder, a broken install: metrics.jsonl keeps the data
        warn(f"TensorBoard could not start ({error_line(err)[:160]}); logging to metrics.jsonl and the console only")
        return None


class TensorBoardSink(NullSink):
    """Scalars per step: every finite number of the metrics row, under its own name (reward, kl, reward/NAME, ...)."""

    def __init__(self, run: RunInfo):
        from torch.utils.tensorboard import SummaryWriter

        self.folder = run.run_dir / FOLDER
        self.writer = SummaryWriter(str(self.folder), purge_step=run.start_step if run.resume else None)
        run.say(f"TensorBoard: logging to {self.folder}; see it with `tensorboard --logdir {self.folder}`")

    def log(self, row: dict) -> None:
        step = int(row["step"])
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value):
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self, summary: dict) -> dict | None:
        self.writer.close()
        return {"TensorBoard": str(self.folder)}
