"""A plug-in engine (`plugins=[scripted_engine] rollout.engine=scripted`) that writes scripted turns, for episode
runs through the real CLI: the tiny random model never writes a tool call, and a test of tool tokens in training
needs some. Each turn's line may list alternatives (`a~~b`), one drawn with torch's generator, so a resumed run
reproduces its episodes only when the sampling seeds are restored as they were."""

from __future__ import annotations

import torch
from test_episodes import ScriptedPolicy

from grpo_cli.rollout import ENGINES


@ENGINES.register("scripted")
class ScriptedEngine(ScriptedPolicy):
    name = "scripted"

    @classmethod
    def from_config(cls, cfg_rollout, lm, max_prompt_tokens=None):
        return cls(lm.tokenizer)

    def choose(self, line: str) -> str:
        options = line.split("~~")
        return options[int(torch.randint(len(options), ()))]
