"""Compiles native_kernels' CUDA sources on first use, caches the shared library, registers its XLA FFI targets.

`register()` finds nvcc (on PATH, else the binary of the `nvidia-cuda-nvcc` wheel when it is installed), compiles
the sources once per (sources, flags, nvcc version) into `~/.cache/jsparse/` (`$XDG_CACHE_HOME/jsparse` when that
is set), loads the library with ctypes and registers its handlers with `jax.ffi.register_ffi_target(...,
platform="CUDA")`. It never raises: it returns a `NativeStatus` that says why the kernels are absent (no nvcc,
a build error with the path of its log, a library that does not load). `native_status()` adds the one check
that needs a device: whether jax has a CUDA backend. Building needs no GPU (CI compiles the sources with nvcc
and lowers the custom calls on a CPU-only jax).

The library is built for sm_80 and sm_90 (Ampere and Hopper; mma.sp needs sm_80 or newer) with sm_90 PTX for
newer GPUs; the static CUDA runtime is linked in, so loading it needs only the driver, and only when a kernel runs.

A second library, `CUSPARSELT` (`cusparselt_gemm.cu`: host code calling NVIDIA's cuSPARSELt for gather-free 2:4
GEMMs), is built the same way by `register(CUSPARSELT)` when cuSPARSELt's header and shared library are found
(`find_cusparselt`: $CUSPARSELT_DIR, else the `nvidia-cusparselt-cu12` / `-cu13` wheel, else /usr); it links
libcusparseLt with an rpath, so it loads wherever the build found it.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

__all__ = ["NativeStatus", "Library", "CONV", "CUSPARSELT", "TARGETS", "SOURCES", "find_nvcc", "find_cusparselt",
           "nvcc_command", "build", "register", "native_status"]

HERE = Path(__file__).resolve().parent
# Ampere and Hopper machine code, plus Hopper PTX that newer GPUs compile at load time.
GENCODES = ("arch=compute_80,code=sm_80", "arch=compute_90,code=sm_90", "arch=compute_90,code=compute_90")
FLAGS = ("-O3", "-shared", "-Xcompiler", "-fPIC", "-std=c++17")


@dataclasses.dataclass(frozen=True)
class Library:
  """One shared library: its sources, the FFI targets it exports ((target name, handler symbol) pairs) and
  whether it links NVIDIA's cuSPARSELt."""

  name: str
  sources: tuple[str, ...]
  targets: tuple[tuple[str, str], ...]
  cusparselt: bool = False


CONV = Library("native_kernels", ("sparse24_conv.cu",),
               (("jsparse_sparse24_conv", "Sparse24Conv"), ("jsparse_mma_sp_probe", "MmaSpProbe")))
CUSPARSELT = Library("cusparselt_gemm", ("cusparselt_gemm.cu",),
                     (("jsparse_cslt_compress", "CsltCompress"), ("jsparse_cslt_matmul", "CsltMatmul")),
                     cusparselt=True)
SOURCES = CONV.sources
TARGETS = dict(CONV.targets)  # FFI target name -> the handler symbol the library exports


@dataclasses.dataclass(frozen=True)
class NativeStatus:
  """Whether the native kernels can run here (`available`) and, when not, why (`reason`); `library`: the
  built shared library's path, when one was built."""

  available: bool
  reason: str
  library: Path | None = None

  def __iter__(self):  # unpacks as (available, reason)
    return iter((self.available, self.reason))


def find_nvcc() -> str | None:
  """nvcc's path: the one on PATH, else the `nvidia-cuda-nvcc` wheel's binary if that package is installed."""
  found = shutil.which("nvcc")
  if found:
    return found
  try:
    import nvidia  # the namespace package of NVIDIA's CUDA wheels
  except ImportError:
    return None
  for root in getattr(nvidia, "__path__", []):
    for candidate in ("cuda_nvcc/bin/nvcc", "cu13/bin/nvcc", "cu12/bin/nvcc"):
      path = Path(root) / candidate
      if path.is_file() and os.access(path, os.X_OK):
        return str(path)
  return None


def _nvidia_roots() -> list[Path]:
  try:
    import nvidia  # the namespace package of NVIDIA's CUDA wheels
  except ImportError:
    return []
  return [Path(root) for root in getattr(nvidia, "__path__", [])]


def find_cusparselt(nvcc: str | None = None) -> tuple[tuple[Path, ...], Path] | None:
  """(include directories, shared library) of cuSPARSELt: under $CUSPARSELT_DIR, else in the nvidia-cusparselt
  wheel, else in the system's directories; its header includes cuSPARSE's `cusparse.h`, looked for beside it, in
  the nvidia-cusparse wheel and in the CUDA toolkit of nvcc. None when any of the three is missing."""
  roots = [Path(os.environ["CUSPARSELT_DIR"])] if os.environ.get("CUSPARSELT_DIR") else []
  roots += [root / "cusparselt" for root in _nvidia_roots()] + [Path("/usr/local/cuda"), Path("/usr")]
  found = None
  for root in roots:
    if (root / "include" / "cusparseLt.h").is_file():
      for lib in ("lib", "lib64", "lib/x86_64-linux-gnu"):
        for name in ("libcusparseLt.so.0", "libcusparseLt.so"):
          if found is None and (root / lib / name).is_file():
            found = root / "include", root / lib / name
  if found is None:
    return None
  toolkit = [Path(nvcc).resolve().parent.parent / "include"] if nvcc else []
  for include in [found[0], *(root / "cusparse" / "include" for root in _nvidia_roots()), *toolkit,
                  Path("/usr/local/cuda/include"), Path("/usr/include")]:
    if (include / "cusparse.h").is_file():
      return (found[0],) if include == found[0] else (found[0], include), found[1]
  return None


def cache_dir() -> Path:
  """Where built libraries live: $XDG_CACHE_HOME/jsparse or ~/.cache/jsparse."""
  base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
  return Path(base) / "jsparse"


def nvcc_command(nvcc: str, output: Path, library: Library = CONV) -> list[str]:
  """The nvcc command line that builds `library` into `output` (cuSPARSELt must be found for CUSPARSELT)."""
  gencode = [arg for code in GENCODES for arg in ("-gencode", code)]
  sources = [str(HERE / name) for name in library.sources]
  extra = []
  if library.cusparselt:
    includes, shared = find_cusparselt(nvcc)
    extra = [arg for include in includes for arg in ("-isystem", str(include))]
    extra += ["-Xlinker", str(shared), "-Xlinker", f"-rpath={shared.parent}"]
  # -isystem: XLA's headers are not ours to warn about.
  return [nvcc, *FLAGS, *gencode, "-isystem", jax.ffi.include_dir(), *sources, *extra, "-o", str(output)]


def _nvcc_version(nvcc: str) -> str:
  return subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout


def _library_key(nvcc: str, library: Library) -> str:
  digest = hashlib.sha256()
  for name in library.sources:
    digest.update((HERE / name).read_bytes())
  digest.update(repr((FLAGS, GENCODES, jax.ffi.include_dir())).encode())
  if library.cusparselt:
    includes, shared = find_cusparselt(nvcc)
    digest.update((includes[0] / "cusparseLt.h").read_bytes())
    digest.update(repr((includes, shared)).encode())
  digest.update(_nvcc_version(nvcc).encode())
  return digest.hexdigest()[:20]


def build(nvcc: str | None = None, directory: Path | None = None, library: Library = CONV) -> NativeStatus:
  """`library`, compiled now unless a build for these sources, flags and nvcc is cached; never raises."""
  nvcc = nvcc or find_nvcc()
  if nvcc is None:
    return NativeStatus(False, "no nvcc: not on PATH and the nvidia-cuda-nvcc wheel is not installed "
                               "(pip install nvidia-cuda-nvcc, or put CUDA's bin directory on PATH)")
  if library.cusparselt and find_cusparselt(nvcc) is None:
    return NativeStatus(False, "no cuSPARSELt: cusparseLt.h, libcusparseLt and cuSPARSE's cusparse.h not all found "
                               "($CUSPARSELT_DIR, the nvidia-cusparselt-cu12 and nvidia-cusparse-cu12 wheels, the "
                               "CUDA toolkit, /usr)")
  directory = Path(directory) if directory is not None else cache_dir()
  try:
    key = _library_key(nvcc, library)
  except (OSError, subprocess.SubprocessError) as err:
    return NativeStatus(False, f"nvcc at {nvcc} does not run: {err}")
  built = directory / f"{library.name}-{key}.so"
  if built.is_file():
    return NativeStatus(True, f"cached build {built}", built)
  log = directory / f"{library.name}-{key}.log"
  try:
    directory.mkdir(parents=True, exist_ok=True)
    # Build beside the final name and rename, so a concurrent process never loads a half-written library.
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
      partial = Path(tmp) / built.name
      command = nvcc_command(nvcc, partial, library)
      result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
      log.write_text(" ".join(command) + "\n\n" + result.stdout + result.stderr)
      if result.returncode != 0:
        return NativeStatus(False, f"nvcc failed (exit {result.returncode}); build log: {log}")
      os.replace(partial, built)
  except (OSError, subprocess.SubprocessError) as err:
    return NativeStatus(False, f"building the native kernels failed: {err} (build log: {log})")
  return NativeStatus(True, f"built {built}", built)


@functools.lru_cache(maxsize=None)
def _register_once(nvcc: str | None, library: Library) -> NativeStatus:
  status = build(nvcc, library=library)
  if not status.available:
    return status
  try:
    loaded = ctypes.cdll.LoadLibrary(str(status.library))
    for target, symbol in library.targets:
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(loaded, symbol)), platform="CUDA")
  except (OSError, AttributeError, ValueError, RuntimeError) as err:
    return NativeStatus(False, f"loading or registering {status.library} failed: {err}", status.library)
  names = ", ".join(target for target, _ in library.targets)
  return NativeStatus(True, f"registered {names} from {status.library}", status.library)


def register(library: Library = CONV) -> NativeStatus:
  """Builds (or finds the cached build of) `library` and registers its FFI targets for CUDA, once per nvcc;
  no GPU needed. Never raises."""
  return _register_once(find_nvcc(), library)


def _cuda_devices_problem() -> str | None:
  """None when jax has CUDA devices that can run mma.sp (compute capability 8.0 or newer), else what is wrong."""
  try:
    devices = jax.devices("cuda")
  except RuntimeError:
    return "no CUDA backend: jax has no CUDA device here"
  older = [d for d in devices if int(str(getattr(d, "compute_capability", "8.0")).split(".")[0]) < 8]
  if older:
    return f"mma.sp needs compute capability 8.0 or newer; {older[0]} has {older[0].compute_capability}"
  return None


def native_status(library: Library = CONV) -> NativeStatus:
  """(available, reason): whether `library` is built, registered and has a CUDA device to run on; reason says
  what is missing (nvcc, cuSPARSELt, a build that failed and its log, jax's CUDA backend) or what was loaded."""
  status = register(library)
  if not status.available:
    return status
  problem = _cuda_devices_problem()
  if problem is not None:
    return NativeStatus(False, f"{problem} (the library is built and registered: {status.library})",
                        status.library)
  return status
