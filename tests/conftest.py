import os

import jax
import pytest

# Off the GPU the suite's time is mostly XLA compiling small programs (Pallas kernels in interpret mode above
# all), each run a few times on tiny inputs: ask XLA for less optimisation work (LLVM -O0, no expensive passes;
# about 25-30% less CPU time per test). The programs compute the same values; only their compiled code is
# less tuned. Set in the environment too, so that the subprocesses (notebook kernels, the two-device checks)
# inherit it. JAX_DISABLE_MOST_OPTIMIZATIONS=0 keeps XLA's full optimisation.
if jax.default_backend() == "cpu":
  os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
  jax.config.update("jax_disable_most_optimizations",
                    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"].lower() in ("1", "true", "t", "yes", "y", "on"))


def pytest_collection_modifyitems(config, items):
  """Tests marked `slow` run first; tests marked `gpu` (the real Triton kernels) are skipped where there is no GPU.

  Longest first: pytest-xdist hands tests out in collection order, so a minutes-long notebook that starts late
  keeps one worker busy after the other has run out of tests. Started first, it runs beside everything else.
  The sort is stable (every worker collects the same order, as xdist requires) and changes no test."""
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make gpu-test` on a GPU machine)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
