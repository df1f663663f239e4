"""The ground floor: what every other package may use and nothing of grpo-cli's own.

Owns the error types and the one-line route for errors and warnings (errors), plug-in registries (registry),
the one boundary user code runs behind (user_code), stop requests and signals (stopping), the record file
names and the metrics.jsonl reader (metrics), which process of a torchrun job speaks (ranks), printing a table
(console), and a process group that ends with the process that started it (guard).

May import: nothing of grpo_cli (the standard library, and third-party packages light to import: rich)."""
