"""grpo-cli's Hydra launcher `hydra/launcher=shared_base`: a sweep's jobs as adapters of one loaded base
(grpo_cli.sweep.shared_base). Hydra finds it here, in the hydra_plugins namespace package, as it finds joblib's."""
