"""`python -m grpo_cli.sweep SWEEP_DIR` rewrites a sweep dir's summary and cells (e.g. after a sweep was killed)."""
import sys

from grpo_cli.sweep.callback import main

sys.exit(main())
