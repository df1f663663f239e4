"""Where a step's time goes when generation runs in a worker (rollout.placement=worker rollout.max_staleness=1):
the phases of a quickstart step, each timed on the threads one side gets (one of two cores), in one process.

    python scripts/k1_phases.py [--steps 4] [--threads 1] [overrides ...]

Per step: generation (engine.generate, what the worker does first), the worker's sampler pass (its log-probs of
the tokens it sampled: rollout/ahead.rollout_logprobs, a second forward of the whole batch), the trainer's reference
pass (the frozen base's log-probs), and the trainer's update (GRPOTrainer.update: the reference pass again, the
policy's forward and backward, the optimizer). Worker = generation + sampler pass; trainer = update. The first step
warms up: read the others. docs/results/rollout-worker.md, "The worker's reference pass", uses it.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one side's share of the cores)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides after +recipe=quickstart trainer.device=cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from hydra import compose, initialize_config_dir

    from grpo_cli.config.compose import CONF_DIR, composition_checked, register_recipes
    from grpo_cli.config.schema import Config
    from grpo_cli.rollout.ahead import rollout_logprobs
    from grpo_cli.step.trainer import GRPOTrainer

    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"), composition_checked():
        cfg = compose("config", overrides=["+recipe=quickstart", "trainer.device=cpu", *args.overrides])
    trainer = GRPOTrainer(Config.of(cfg))
    for step in range(args.steps):
        t0 = time.perf_counter()
        generation = trainer.generate(step)
        t1 = time.perf_counter()
        rollout_logprobs(trainer.model, generation.rollout, trainer.roll.temperature, trainer.tcfg.logprob_chunk_size)
        t2 = time.perf_counter()
        batch = trainer.make_batch(generation, trainer.score(generation))
        ordered, minis = trainer.mini_batch_layout(batch)
        trainer.model.train()
        t3 = time.perf_counter()
        trainer._no_grad_logprobs(ordered, [rows for mini in minis for rows in mini.micro], adapter=False)
        t4 = time.perf_counter()
        trainer.update(step, batch)
        t5 = time.perf_counter()
        print(f"step {step}: generation {t1 - t0:.2f} s, sampler pass {t2 - t1:.2f} s (worker {t2 - t0:.2f} s); "
              f"reference pass {t4 - t3:.2f} s, update {t5 - t4:.2f} s (trainer); rows x tokens "
              f"{tuple(batch.mask.shape)}", flush=True)


if __name__ == "__main__":
    main()
