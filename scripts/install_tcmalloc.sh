#!/usr/bin/env sh
# TCMalloc (gperftools' libtcmalloc_minimal), the C allocator grpo-train and grpo-eval preload where it is installed
# (grpo_cli/model/allocator.py: a lower peak memory on the CPU at the same speed), installed where it is missing and the
# system's package manager may install it (root, or sudo without a password). Never fails: without it the commands
# run on the C library's allocator; tests/model/test_allocator.py says it is missing.
python3 -c "import ctypes.util, sys; sys.exit(not ctypes.util.find_library('tcmalloc_minimal'))" 2>/dev/null && exit 0
if [ "$(id -u)" = 0 ]; then sudo=""; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; else sudo=no; fi
if [ "$sudo" != no ] && command -v apt-get >/dev/null 2>&1; then
  $sudo apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 ||
    { $sudo apt-get update -q >/dev/null 2>&1 && $sudo apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; }
elif [ "$sudo" != no ] && command -v dnf >/dev/null 2>&1; then
  $sudo dnf install -y -q gperftools-libs >/dev/null 2>&1
fi
if python3 -c "import ctypes.util, sys; sys.exit(not ctypes.util.find_library('tcmalloc_minimal'))" 2>/dev/null; then
  echo "installed TCMalloc: the C allocator grpo-train runs on"
else
  echo "TCMalloc is not installed (no root, or no apt-get/dnf): grpo-train runs on the C library's allocator;" \
       "install libtcmalloc-minimal4 (gperftools-libs) for a lower peak memory"
fi
exit 0
