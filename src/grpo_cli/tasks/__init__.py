"""What the policy is asked: prompt sources and their rows (sources: jsonl, hf, the built-in samples,
reasoning-gym), the code recipe's generated and HumanEval problems (code_tasks), the calculator recipe's tool
(calculator).

May import: model, config, base (model: the tokenizer, to encode prompts)."""
