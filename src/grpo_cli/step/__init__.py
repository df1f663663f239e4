"""One training step and what it needs: GRPOTrainer (the only place that calls backward), the memory plan
(micro-batches, checkpointing, the out-of-memory line), the optimizer and its schedule, data parallelism over
ranks, dynamic sampling, and evaluation (the held-out pass the run and grpo-eval share).

May import: rollout, rewards, algorithm, tasks, model, config, base. Knows no run directory and no resume: the run
asks (GRPOTrainer.state_dict) and the step answers."""
