#!/usr/bin/env sh
# bubblewrap, the strongest sandbox of the code reward (grpo_cli/rewards/sandbox.py), installed where it is missing and the
# system's package manager may install it (root, or sudo without a password). Never fails: without it the code
# reward falls back to unshare namespaces, or to rlimits alone with a warning; one line says so.
command -v bwrap >/dev/null 2>&1 && exit 0
if [ "$(id -u)" = 0 ]; then sudo=""; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; else sudo=no; fi
if [ "$sudo" != no ] && command -v apt-get >/dev/null 2>&1; then
  $sudo apt-get install -y -q bubblewrap >/dev/null 2>&1 ||
    { $sudo apt-get update -q >/dev/null 2>&1 && $sudo apt-get install -y -q bubblewrap >/dev/null 2>&1; }
elif [ "$sudo" != no ] && command -v dnf >/dev/null 2>&1; then
  $sudo dnf install -y -q bubblewrap >/dev/null 2>&1
fi
if command -v bwrap >/dev/null 2>&1; then
  echo "installed bubblewrap: the code reward's sandbox"
else
  echo "bubblewrap is not installed (no root, or no apt-get/dnf): the code reward's sandbox falls back to unshare" \
       "namespaces, else rlimits alone; install the bubblewrap package for the strongest one"
fi
exit 0
