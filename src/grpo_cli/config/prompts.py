"""System prompts that data configs name as `${system_prompt:NAME}`, kept in Python where the reward that checks
the format a prompt asks for imports it (rewards/gsm8k.py), so that the prompt and the reward cannot drift apart."""

ANSWER_FORMAT_INSTRUCTION = (
    "Think step by step, then give the final answer on its own last line as `#### <number>` "
    "(just the number, no units)."
)
SYSTEM_PROMPTS = {
    "gsm8k": f"You are a careful math tutor solving grade-school word problems. {ANSWER_FORMAT_INSTRUCTION}",
}
