"""Copies the test-only packages that the GPU machines' image lacks into a folder to carry there.

    python scripts/gpu_test_deps.py [DEST]        # default .gpu_test_deps (git-ignored)

The GPU image has jax, torch and pytest but not pytest-xdist (the workers of `make gpu-test`) or hypothesis
(imported by some test files), and it is offline. This copies those distributions, files and metadata (pytest
finds the xdist plugin through its entry point), from the Python that runs it (the local venv) into DEST.
`make gpu-test` and `scripts/gpu_session.sh` put `.gpu_test_deps` on PYTHONPATH when it exists. Pure Python
packages only, so the copy works on the GPU machine's Python 3.12.
"""
from __future__ import annotations

import importlib.metadata as md
import pathlib
import shutil
import sys

PACKAGES = ("pytest-xdist", "execnet", "hypothesis", "sortedcontainers")


def copy_distribution(name: str, dest: pathlib.Path) -> int:
  dist = md.distribution(name)
  n = 0
  for f in dist.files or []:
    src = pathlib.Path(dist.locate_file(f))
    if f.parts[0] == ".." or "__pycache__" in f.parts or not src.is_file():
      continue  # scripts installed outside site-packages, and bytecode, stay behind
    target = dest / f
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, target)
    n += 1
  return n


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  dest = pathlib.Path(argv[0] if argv else ".gpu_test_deps")
  shutil.rmtree(dest, ignore_errors=True)
  dest.mkdir(parents=True)
  for name in PACKAGES:
    print(f"{name} {md.version(name)}: {copy_distribution(name, dest)} files -> {dest}")


if __name__ == "__main__":
  main()
