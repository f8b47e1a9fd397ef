import os
import sys

import jax
import pytest

# Test helpers (triton_lowering.py, reference.py) live beside the tests.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
  """Tests marked `gpu` run the real Triton kernels: skip them where there is no GPU."""
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make gpu-test` on a GPU machine)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
