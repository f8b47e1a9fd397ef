import atexit
import os
import shutil
import tempfile

import jax
import jax.experimental.pallas.fuser  # noqa: F401  (see below)
import pytest

# Pallas's interpret mode imports its fuser on first use, and that module registers a configuration that is part
# of jit's cache key: a test's first interpret-mode call would then trace under another key than its later calls,
# so tests that count a function's compilations (`_cache_size()`) passed or failed with test order. Importing it
# up front makes the key the same for every call.

# On a GPU the tests run in several pytest-xdist workers on one device (`make gpu-test`): each process then takes
# device memory as it needs it, rather than the three quarters of the GPU that JAX takes up front by default
# (the second worker would find none left). Set before the backend starts, below.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Off the GPU the suite's time is mostly XLA compiling small programs (Pallas kernels in interpret mode above
# all), each run a few times on tiny inputs: ask XLA for less optimisation work (LLVM -O0, no expensive passes;
# about 25-30% less CPU time per test). The programs compute the same values; only their compiled code is
# less tuned. Set in the environment too, so that the subprocesses (notebook kernels, the two-device checks)
# inherit it. JAX_DISABLE_MOST_OPTIMIZATIONS=0 keeps XLA's full optimisation.
if jax.default_backend() == "cpu":
  os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
  jax.config.update("jax_disable_most_optimizations",
                    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"].lower() in ("1", "true", "t", "yes", "y", "on"))

# Opt-in (JSPARSE_TEST_COMPILATION_CACHE=1): a compilation cache shared by the processes of this run, so that a
# program one xdist worker compiled is a file read for the other. Off by default: writing an entry serialises the
# executable, and jaxlib's CPU serialisation segfaulted a worker now and then (a CI run lost a worker in
# `put_executable_and_time` -> `executable.serialize()`, 2026-11-30), for about 4% of the suite's CPU time. Its
# directory is made by the first process (pytest itself, before it starts the workers, which inherit the variable,
# as do the notebook kernels and the subprocess checks) and removed when that process exits, so that every run
# compiles everything once: no cache outlives its run. Every compilation is cached (the default keeps only those
# over a second).
_RUN_CACHE = "JSPARSE_TEST_COMPILATION_CACHE"
if jax.default_backend() == "cpu" and os.environ.get(_RUN_CACHE, "0") != "0":
  if os.environ[_RUN_CACHE] == "1":
    os.environ[_RUN_CACHE] = tempfile.mkdtemp(prefix="jsparse-tests-xla-cache-")
    atexit.register(shutil.rmtree, os.environ[_RUN_CACHE], ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_RUN_CACHE]
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  jax.config.update("jax_compilation_cache_dir", os.environ[_RUN_CACHE])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


# Every program XLA compiles for the CPU keeps its machine code in a few memory mappings of its own for as long as
# jit's caches hold it, and Linux allows a process 65530 mappings (vm.max_map_count). A worker that runs several
# hundred tests passes that: mmap then fails inside the compiler, which surfaced as a segfault in XLA's CPU
# compiler or a MemoryError with most of the RAM free (2026-11-30; one module of tests adds about 7000 mappings).
# Between test modules, a process above a third of the limit drops jit's caches, which unmaps their code; a module
# that alone takes it past two thirds drops them after its next test (a test that counts compilations may then see
# one more, where a crash was certain).
_MAPPINGS_BETWEEN_MODULES = 65530 // 3
_MAPPINGS_WITHIN_A_MODULE = 2 * 65530 // 3


def _memory_mappings():
  try:
    with open("/proc/self/maps", "rb") as maps:
      return sum(1 for _ in maps)
  except OSError:  # not Linux: no such limit to keep under
    return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code_between_modules():
  yield
  if _memory_mappings() > _MAPPINGS_BETWEEN_MODULES:
    jax.clear_caches()


# Reading /proc/self/maps takes the kernel tens of milliseconds at tens of thousands of mappings, so within a
# module it is read every few tests (a test adds a few hundred mappings; the margin above two thirds is ~20000).
_TESTS_BETWEEN_READS = 8
_tests_since_read = 0


@pytest.fixture(autouse=True)
def _release_compiled_code_before_the_mapping_limit():
  global _tests_since_read
  yield
  _tests_since_read += 1
  if _tests_since_read >= _TESTS_BETWEEN_READS:
    _tests_since_read = 0
    if _memory_mappings() > _MAPPINGS_WITHIN_A_MODULE:
      jax.clear_caches()


@pytest.fixture(autouse=True)
def _full_float32_products_on_a_gpu(request):
  """On a GPU, the tests not marked `gpu` run under `jax.default_matmul_precision("float32")`.

  Their tolerances are the CPU's, where float32 products are exact float32; on a GPU, precision=None would give
  TF32 products, in jsparse's kernels and in the XLA references alike, about 1e-3 apart. Under JAX's own setting
  both compute full float32 (precision=None follows it). The `gpu` tests keep TF32, whose results they check."""
  if jax.default_backend() != "gpu" or request.node.get_closest_marker("gpu") is not None:
    yield
    return
  with jax.default_matmul_precision("float32"):
    yield


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
