"""`python -m grpo_cli.config --markdown` prints the table of every option (docs/options.md)."""
import sys

from grpo_cli.config.compose import options_table

if sys.argv[1:] != ["--markdown"]:
    sys.exit("usage: python -m grpo_cli.config --markdown   (prints the table of docs/options.md)")
print(options_table())
