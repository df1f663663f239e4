"""A plug-in engine (`plugins=[scripted_engine] rollout.engine=scripted`) that writes scripted turns, for episode
runs through the real CLI: the tiny random model never writes a tool call, and a test of tool tokens in training
needs some. It is `ChoosingPolicy` (tests/rollout/test_episodes.py):
alternatives drawn with torch's generator, so a resumed
run reproduces its episodes only when the sampling seeds are restored as they were. Imported only by the CLI
runs that name it (registering it in the test process would add a choice to every engine list there)."""

from __future__ import annotations

from test_episodes import ChoosingPolicy

from grpo_cli.rollout import ENGINES


@ENGINES.register("scripted")
class ScriptedEngine(ChoosingPolicy):
    name = "scripted"

    @classmethod
    def from_config(cls, cfg_rollout, lm, max_prompt_tokens=None):
        return cls(lm.tokenizer)
