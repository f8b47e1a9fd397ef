#!/usr/bin/env bash
# Prints the path of a Python interpreter >= 3.12, or fails with a clear message.
# Tries, in order: $PYTHON, python3.12, pyenv's installed 3.12+ (oldest first), python3.13, python3, python.
# 3.12 first because the GPU machines run 3.12.
set -u
ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
cands=()
[ -n "${PYTHON:-}" ] && cands+=("$PYTHON")
cands+=(python3.12)
if command -v pyenv >/dev/null 2>&1; then
  for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])' | sort -V); do
    cands+=("$(pyenv root)/versions/$v/bin/python3")
  done
fi
cands+=(python3.13 python3 python)
for c in "${cands[@]}"; do
  p=$(command -v "$c" 2>/dev/null) || continue
  if ok "$p"; then
    # Resolve pyenv shims to the real interpreter so the venv does not depend on PYENV_VERSION.
    "$p" -c 'import sys; print(sys.executable)'; exit 0
  fi
done
echo "find_python: no Python >= 3.12 found (set PYTHON=/path/to/python3.12)" >&2
exit 1
