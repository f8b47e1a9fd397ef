"""The SubMConv3d suite: jsparse against FlexGEMM on FlexGEMM's own benchmark workloads.

    python -m benchmarks.suite [--rows 0,1,...] [--dtypes fp16,tf32] [--modes inference,train]
                               [--repeats 20] [--warmup 3] [--pipelined-calls 10] [--out DIR] [--smoke]
    python -m benchmarks.suite --report a.json [b.json ...] [--out DIR]   # merge runs, redraw table + chart

Each workload (workloads.SUITE): sphere-shell sites in a RES^3 grid, the 3x3x3 neighbour map built INSIDE
the timed function (as FlexGEMM's benchmark does), then L SubMConv3d C -> C layers with bias.
- inference: neighbour map + L forward layers.
- train: neighbour map + forward + gradient of sum(output) w.r.t. all weights and all biases, and w.r.t. the
  input features only with --input-grad, on both sides (FlexGEMM's train_benchmark.py skips it) (jsparse: one
  jitted jax.grad; FlexGEMM: backward with ones, as its train_benchmark.py).
- dtypes: fp16 (float16 features and weights), tf32 (float32, TF32 matmuls: jsparse precision=None,
  FlexGEMM allow_tf32), fp32 (float32 at full precision; not in the default set).
Both libraries get the same sites (same row order), features, weights and biases (~N(0, 1/sqrt(27 C)), so
fp16 values stay O(1)); jsparse holds its weights in --weight-layout (default ODHWI: (Cout, 3, 3, 3, Cin), the
layout FlexGEMM holds them in; DHWIO is flax's (3, 3, 3, Cin, Cout)), and the same timing: `warmup` calls,
then `repeats` calls each timed alone with time.perf_counter around the call plus a device synchronisation;
median and min are reported. This counts
each call's launch overhead and one synchronisation, like any eager user loop. Both sides are also timed
the way FlexGEMM's own benchmark times (--pipelined-calls, default 10): batches of calls issued back to back
with one synchronisation a batch, ms per call, median over batches; `pipelined_ratio` and its geomean in the
report. That hides the host's dispatch and wake-up behind the GPU's work, as a training loop does.

Outputs in --out (default $OUT or /tmp/jsparse_bench): suite.json (everything, rewritten after every
workload), suite.md (tables), suite.png (relative speed chart, if matplotlib imports). The markdown is
printed last. A workload that fails (OOM, compile error) is recorded and the suite goes on; SIGTERM (from
`timeout`) and --time-budget stop it early with the report of what ran.
"""
from __future__ import annotations

import os

# Before jax is imported: by default JAX reserves 75% of the GPU memory at start-up, which would leave
# PyTorch (FlexGEMM, same process, same GPU) too little. Unset, JAX grows its pool on demand instead.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jsparse  # noqa: E402
from jsparse.progress import progress_bar  # noqa: E402
from benchmarks import workloads  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("inference", "train")
# name -> (jax dtype, jsparse precision, FlexGEMM allow_tf32). FlexGEMM's benchmark sets allow_tf32 = True
# for every dtype (it only matters for float32).
DTYPES = {
    "fp16": (jnp.float16, None, True),
    "tf32": (jnp.float32, None, True),
    "fp32": (jnp.float32, "highest", False),
}
SMOKE_ROW = workloads.Row(8, 16, 2, 192, 2_544)


# ---- shared helpers (kernels.py uses them too) ------------------------------------------------------


class Interrupted(BaseException):
  """Raised by the SIGTERM handler: a BaseException, so the per-workload `except Exception` lets it through."""


def install_sigterm_handler():
  def handler(signum, frame):
    raise Interrupted(f"signal {signum}")

  signal.signal(signal.SIGTERM, handler)


def time_calls(call: Callable[[], Any], sync: Callable[[Any], Any], warmup: int, repeats: int) -> dict:
  """`warmup` untimed calls, then `repeats` calls each timed alone: perf_counter around call + sync(result)."""
  for _ in range(warmup):
    sync(call())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = call()
    sync(out)
    times.append((time.perf_counter() - t0) * 1e3)
    del out
  return {"median_ms": statistics.median(times), "min_ms": min(times), "times_ms": times}


def time_pipelined(call: Callable[[], Any], sync: Callable[[Any], Any], batches: int, calls: int) -> dict:
  """`batches` batches of `calls` calls issued back to back, one sync after each batch: ms per call (median over
  batches), the protocol of FlexGEMM's own benchmark (CUDA events around back-to-back calls) and of a training
  loop. One call's host dispatch and wake-up after its wait are paid once per batch here, once per call in
  time_calls."""
  sync(call())
  per_call = []
  for _ in range(batches):
    t0 = time.perf_counter()
    for _ in range(calls):
      out = call()
    sync(out)
    per_call.append((time.perf_counter() - t0) * 1e3 / calls)
    del out
  return {"pipelined_ms": statistics.median(per_call), "pipelined_min_ms": min(per_call),
          "pipelined_calls": calls}


def short_error(e: BaseException, limit: int = 300) -> str:
  """The exception type and the most useful line of its message (XLA puts RESOURCE_EXHAUSTED further down)."""
  lines = [l.strip() for l in str(e).splitlines() if l.strip()]
  msg = lines[0] if lines else ""
  for l in lines:
    if "RESOURCE_EXHAUSTED" in l or "out of memory" in l.lower():
      msg = l
      break
  return f"{type(e).__name__}: {msg}"[:limit]


def is_oom(msg: str) -> bool:
  return "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower() or "OutOfMemoryError" in msg


def git_commit() -> str | None:
  """$JSPARSE_COMMIT if set (the device machine gets no .git), else `git rev-parse HEAD` (+ -dirty), else None."""
  if os.environ.get("JSPARSE_COMMIT"):
    return os.environ["JSPARSE_COMMIT"]
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
    if head.returncode != 0:
      return None
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True, timeout=10).stdout.strip()
    return head.stdout.strip() + ("-dirty" if dirty else "")
  except Exception:
    return None


def metadata() -> dict:
  dev = jax.devices()[0]
  meta = {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "device_kind": dev.device_kind,
      "platform": dev.platform,
      "jax": jax.__version__,
      "python": platform.python_version(),
      "commit": git_commit(),
      "env": {k: os.environ.get(k) for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                             "XLA_FLAGS", "JAX_PLATFORMS")},
  }
  try:
    import jaxlib
    meta["jaxlib"] = jaxlib.__version__
  except Exception:
    pass
  return meta


def import_flexgemm():
  """((torch, flex_gemm), None) when FlexGEMM imports and torch sees a GPU, else (None, reason)."""
  try:
    import torch
  except Exception as e:  # not installed on the CPU development machine
    return None, f"torch not importable ({type(e).__name__})"
  if not torch.cuda.is_available():
    return None, "torch sees no CUDA device"
  try:
    import flex_gemm
    import flex_gemm.kernels.triton.spconv.config  # noqa: F401
    import flex_gemm.ops.spconv  # noqa: F401
  except Exception as e:
    return None, f"flex_gemm not importable ({short_error(e, 160)})"
  return (torch, flex_gemm), None


def device_peak_bytes() -> int | None:
  """JAX's peak_bytes_in_use on device 0: cumulative over the process (never reset); None where unknown."""
  try:
    stats = jax.devices()[0].memory_stats()
    return int(stats["peak_bytes_in_use"]) if stats and "peak_bytes_in_use" in stats else None
  except Exception:
    return None


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
  a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
  den = np.linalg.norm(ref)
  return float(np.linalg.norm(a - ref) / den) if den > 0 else float(np.linalg.norm(a - ref))


# ---- inputs ------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def row_inputs(row: workloads.Row, seed: int = 0):
  """coords int32 [N, 4], feats float32 [N, C], and L (weight (3,3,3,C,C), bias (C,)) float32 pairs."""
  coords = workloads.sphere_shell_coords(row.res)
  rng = np.random.default_rng([seed, row.res, row.channels, row.layers])
  c = row.channels
  feats = rng.standard_normal((len(coords), c), dtype=np.float32)
  std = 1.0 / math.sqrt(27 * c)
  params = []
  for _ in range(row.layers):
    w = rng.standard_normal((3, 3, 3, c, c), dtype=np.float32) * np.float32(std)
    b = rng.standard_normal((c,), dtype=np.float32) * np.float32(0.1)
    params.append((w, b))
  return coords, feats, params


# ---- jsparse -----------------------------------------------------------------------------------------


def jsparse_fns(implementation, precision, algorithm="auto", weight_layout="DHWIO", input_grad=True):
  """The two timed functions, (x, params) -> outputs; the neighbour map is built inside both. Weights in
  `weight_layout` (see `jsparse_weight`). train returns (d_feats, [(d_w, d_b), ...]); without `input_grad`,
  d_feats is None and layer 0's input gradient is never computed (FlexGEMM's benchmark does not compute it)."""

  def layers(x, params, cache):
    for w, b in params:
      x = jsparse.submconv3d(x, w, b, cache=cache, implementation=implementation, precision=precision,
                             algorithm=algorithm, weight_layout=weight_layout)
    return x.feats

  def inference(x, params):
    cache = jsparse.neighbor_map(x, kernel_size=3, dilation=1, implementation=implementation)
    return layers(x, params, cache)

  def train(x, params):
    cache = jsparse.neighbor_map(x, kernel_size=3, dilation=1, implementation=implementation)

    def loss(feats, params):
      return jnp.sum(layers(x.replace(feats=feats), params, cache).astype(jnp.float32))

    if not input_grad:
      return None, jax.grad(loss, argnums=1)(x.feats, params)
    return jax.grad(loss, argnums=(0, 1))(x.feats, params)

  return {"inference": inference, "train": train}


def jsparse_weight(w: np.ndarray, weight_layout: str) -> np.ndarray:
  """row_inputs' (3, 3, 3, C, C) weight in jsparse's `weight_layout` ("ODHWI": (Cout, 3, 3, 3, Cin))."""
  return np.ascontiguousarray(np.transpose(w, (4, 0, 1, 2, 3))) if weight_layout == "ODHWI" else w


# The config table the suite's jsparse functions are traced under (--autotune / --tuned); None = defaults.
TUNED: jsparse.ConfigTable | None = None
TUNED_ROWS: set = set()


def jsparse_inputs(row, dtype_name, args):
  """(x, params) of one workload in jsparse's types, from row_inputs."""
  coords, feats, wb = row_inputs(row, args.seed)
  jdtype = DTYPES[dtype_name][0]
  x = jsparse.SparseTensor.from_coords(coords, jnp.asarray(feats, jdtype), spatial_shape=(row.res,) * 3,
                                       batch_size=1, capacity="exact")  # FlexGEMM's N rows, as tuned
  params = [(jnp.asarray(jsparse_weight(w, args.weight_layout), jdtype), jnp.asarray(b, jdtype)) for w, b in wb]
  return x, params


def add_row_arguments(ap, row: int) -> None:
  """The options of a probe that compiles one suite row's jsparse side (see compile_row); `row` is the default."""
  ap.add_argument("--row", type=int, default=row, help="index into workloads.SUITE")
  ap.add_argument("--dtype", default="tf32", choices=list(DTYPES))
  ap.add_argument("--mode", default="inference", choices=["inference", "train"])
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--impl", default=None, help="jsparse implementation (None: pallas on a GPU, xla elsewhere)")
  ap.add_argument("--weight-layout", default="ODHWI", choices=("ODHWI", "DHWIO"))
  ap.add_argument("--input-grad", action="store_true",
                  help="train: also layer 0's input-feature gradient (the suite's --input-grad; off, as the suite)")


def compile_row(args):
  """(row, x, params, compiled) of the suite row named by add_row_arguments' options: the jsparse function of
  args.mode compiled for that row's inputs."""
  row = workloads.SUITE[args.row]
  x, params = jsparse_inputs(row, args.dtype, args)
  fn = jsparse_fns(args.impl, DTYPES[args.dtype][1], weight_layout=args.weight_layout,
                   input_grad=args.input_grad)[args.mode]
  return row, x, params, jax.jit(fn).lower(x, params).compile()


def bench_jsparse(row, dtype_name, mode, args):
  """Compiles and times one workload. Returns (result dict, array for the cross-check)."""
  x, params = jsparse_inputs(row, dtype_name, args)
  fns = jsparse_fns(args.impl, DTYPES[dtype_name][1], args.algorithm, args.weight_layout, args.input_grad)
  res = {}
  if TUNED is not None and args.autotune and (row.name, dtype_name) not in TUNED_ROWS:
    # Like FlexGEMM's Triton autotuning on its first calls: outside the timed region. The train function
    # runs every pass, so one tuning serves both modes.
    t0 = time.perf_counter()
    every_pass = jsparse_fns(args.impl, DTYPES[dtype_name][1], args.algorithm, args.weight_layout)["train"]
    table = jsparse.autotune(every_pass, x, params, repeats=5, warmup=1)
    TUNED.entries.update(table.entries)
    TUNED_ROWS.add((row.name, dtype_name))
    res["autotune_s"] = time.perf_counter() - t0
    TUNED.save(os.path.join(args.out, "tuned.json"))
    print(f"    autotuned in {res['autotune_s']:.1f} s", flush=True)
  fn = jax.jit(fns[mode])
  t0 = time.perf_counter()
  compiled = fn.lower(x, params).compile()
  res.update({"ok": True, "compile_s": time.perf_counter() - t0})
  try:
    m = compiled.memory_analysis()
    mem = {k: int(getattr(m, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                                           "temp_size_in_bytes", "peak_memory_in_bytes") if hasattr(m, k)}
    res["memory_analysis"] = mem
    res["peak_bytes"] = (mem["argument_size_in_bytes"] + mem["output_size_in_bytes"] + mem["temp_size_in_bytes"]
                         - mem.get("alias_size_in_bytes", 0))
  except Exception as e:  # memory_analysis is best effort on some backends
    res["memory_analysis_error"] = short_error(e)
  res.update(time_calls(lambda: compiled(x, params), jax.block_until_ready, args.warmup, args.repeats))
  if args.pipelined_calls:
    res.update(time_pipelined(lambda: compiled(x, params), jax.block_until_ready, pipelined_batches(args),
                              args.pipelined_calls))
  res["process_peak_bytes"] = device_peak_bytes()
  out = compiled(x, params)
  # Cross-check value: the output (inference) or the first layer's weight gradient (train, which depends on
  # every layer's backward pass).
  check = np.asarray(out if mode == "inference" else out[1][0][0], np.float32)
  if mode == "train" and args.weight_layout == "ODHWI":  # compared in (3, 3, 3, Cin, Cout)
    check = np.transpose(check, (1, 2, 3, 4, 0))
  return res, check


# ---- FlexGEMM ----------------------------------------------------------------------------------------


def flexgemm_call(fg, row, dtype_name, mode, args):
  """(call, params): FlexGEMM's masked implicit GEMM + split-K over the row's layers, called the way its
  tests/submconv/*_benchmark.py call it, and its [(weight, bias)] parameters."""
  torch, flex_gemm = fg
  spconv = flex_gemm.ops.spconv
  from flex_gemm.ops.spconv import SubMConv3dFunction, sparse_submanifold_conv3d

  spconv.set_algorithm(spconv.Algorithm.MASKED_IMPLICIT_GEMM_SPLITK)
  flex_gemm.kernels.triton.spconv.config.allow_tf32 = DTYPES[dtype_name][2]
  tdtype = {"fp16": torch.float16, "tf32": torch.float32, "fp32": torch.float32}[dtype_name]
  coords_np, feats_np, wb = row_inputs(row, args.seed)
  dev = torch.device("cuda")
  coords = torch.from_numpy(coords_np).to(dev).contiguous()
  feats = torch.from_numpy(feats_np).to(dev, tdtype).contiguous()
  shape = torch.Size([1, row.channels, row.res, row.res, row.res])
  params = []
  for w, b in wb:  # jsparse (Kx, Ky, Kz, Cin, Cout) -> FlexGEMM (Cout, Kx, Ky, Kz, Cin), same offset order
    wt = torch.from_numpy(w).to(dev).permute(4, 0, 1, 2, 3).to(tdtype).contiguous()
    params.append((torch.nn.Parameter(wt), torch.nn.Parameter(torch.from_numpy(b).to(dev, tdtype))))
  leaves = [p for wb_ in params for p in wb_]
  if mode == "train" and args.input_grad:
    feats.requires_grad_(True)
    leaves.append(feats)

  def inference():
    with torch.no_grad():
      cache = SubMConv3dFunction._compute_neighbor_cache(coords, shape, (3, 3, 3), (1, 1, 1), False)
      h = feats
      for w, b in params:
        h = sparse_submanifold_conv3d(h, coords, shape, w, b, cache)[0]
    return h

  def train():
    for p in leaves:  # zero the accumulated gradients in place, as its benchmark's zero_grad does
      if p.grad is not None:
        p.grad.zero_()
    cache = SubMConv3dFunction._compute_neighbor_cache(coords, shape, (3, 3, 3), (1, 1, 1), True)
    h = feats
    for w, b in params:
      h = sparse_submanifold_conv3d(h, coords, shape, w, b, cache)[0]
    h.backward(torch.ones_like(h))
    return h

  return {"inference": inference, "train": train}[mode], params


def pipelined_batches(args) -> int:
  return max(3, args.repeats // 4)


def bench_flexgemm(fg, row, dtype_name, mode, args):
  """Times FlexGEMM on one workload. Returns (result dict, array for the cross-check)."""
  torch = fg[0]
  call, params = flexgemm_call(fg, row, dtype_name, mode, args)
  sync = lambda _: torch.cuda.synchronize()  # noqa: E731
  for _ in range(args.warmup):  # the first call autotunes FlexGEMM's kernels
    sync(call())
  torch.cuda.synchronize()
  torch.cuda.reset_peak_memory_stats()
  res = {"ok": True}
  res.update(time_calls(call, sync, 0, args.repeats))
  res["peak_bytes"] = int(torch.cuda.max_memory_allocated())
  if args.pipelined_calls:
    res.update(time_pipelined(call, sync, pipelined_batches(args), args.pipelined_calls))
  out = call()
  sync(out)
  if mode == "inference":
    check = out.float().cpu().numpy()
  else:
    check = params[0][0].grad.permute(1, 2, 3, 4, 0).float().cpu().numpy()
  return res, check


# ---- the run -----------------------------------------------------------------------------------------


def guarded(fn, *a):
  """Runs one benchmark; an Exception becomes a recorded failure (the suite goes on)."""
  try:
    return fn(*a)
  except Exception as e:  # noqa: BLE001 (OOM, compile failures, ...)
    msg = short_error(e)
    print(f"    FAILED: {msg}", flush=True)
    return {"ok": False, "error": msg, "oom": is_oom(msg)}, None


def run_suite(args, rows, out_dir):
  data = {
      "meta": metadata(),
      "settings": {k: getattr(args, k) for k in ("dtypes", "modes", "repeats", "warmup", "seed", "impl", "algorithm",
                                                 "weight_layout", "smoke", "input_grad", "time_budget",
                                                 "pipelined_calls", "autotune", "tuned")},
      "results": [],
  }
  data["settings"]["rows"] = [r.name for r in rows]
  data["settings"]["timing"] = ("perf_counter around each call + device sync (jax.block_until_ready / "
                                "torch.cuda.synchronize); warmup calls untimed")
  data["settings"]["pipelined_timing"] = (
      f"{args.pipelined_calls} calls back to back, one sync, ms per call, median over "
      f"{pipelined_batches(args)} batches (FlexGEMM's own protocol)" if args.pipelined_calls else "not run")
  fg, why = import_flexgemm()
  data["meta"]["flexgemm"] = "available" if fg else f"not run: {why}"
  if fg:
    torch = fg[0]
    data["meta"]["torch"] = torch.__version__
    data["meta"]["torch_device"] = torch.cuda.get_device_name()
  print(f"device: {data['meta']['device_kind']} ({data['meta']['platform']}); jax {jax.__version__}; "
        f"FlexGEMM: {data['meta']['flexgemm']}", flush=True)
  json_path = os.path.join(out_dir, "suite.json")
  t_start = time.perf_counter()
  checked_rows = {}
  try:
    jobs = [(dtype_name, mode, row) for dtype_name in args.dtypes for mode in args.modes for row in rows]
    for dtype_name, mode, row in progress_bar(jobs, "suite", unit="workload"):
      rec = {"row": row.name, "res": row.res, "channels": row.channels, "layers": row.layers,
             "dtype": dtype_name, "mode": mode}
      if args.time_budget and time.perf_counter() - t_start > args.time_budget:
        rec["skipped"] = "time budget"
        data["results"].append(rec)
        continue
      try:
        run_workload(rec, row, dtype_name, mode, args, fg, why, checked_rows)
      except Exception as e:  # noqa: BLE001 (e.g. inputs that do not fit: record, go on)
        rec["error"] = short_error(e)
        print(f"    FAILED: {rec['error']}", flush=True)
      data["results"].append(rec)
      write_json(data, json_path)
  except (Interrupted, KeyboardInterrupt) as e:
    data["meta"]["interrupted"] = f"{type(e).__name__} {e} after {time.perf_counter() - t_start:.0f} s"
    print(f"interrupted: {data['meta']['interrupted']}", flush=True)
  data["meta"]["wall_s"] = time.perf_counter() - t_start
  write_json(data, json_path)
  return data


def run_workload(rec, row, dtype_name, mode, args, fg, why, checked_rows):
  """Fills `rec` with both libraries' results for one (row, dtype, mode)."""
  coords, _, _ = row_inputs(row, args.seed)
  rec["voxels"] = len(coords)
  rec["pairs"] = row.pairs if len(coords) == row.voxels else workloads.neighbor_pairs(coords, (row.res,) * 3)
  if row.name not in checked_rows:  # jsparse's neighbour map against the reference pair count
    checked_rows[row.name] = check_neighbor_map(row, coords, rec["pairs"], args.impl)
  rec["neighbor_map_check"] = checked_rows[row.name]
  rec["useful_gflop"] = workloads.useful_flops(rec["pairs"], row.channels, row.layers, mode == "train") / 1e9
  print(f"[{time.strftime('%H:%M:%S')}] {row.name} {dtype_name} {mode}", flush=True)
  js, js_check = guarded(bench_jsparse, row, dtype_name, mode, args)
  if fg:
    fgr, fg_check = guarded(bench_flexgemm, fg, row, dtype_name, mode, args)
    fg[0].cuda.empty_cache()  # its tensors are gone now: hand the cached blocks back (JAX grows on demand)
  else:
    fgr, fg_check = {"ok": False, "error": why, "not_run": True}, None
  for r in (js, fgr):
    if r.get("ok"):
      r["tflops"] = rec["useful_gflop"] / r["median_ms"]  # GFLOP / ms = TFLOP/s
  rec["jsparse"], rec["flexgemm"] = js, fgr
  if js.get("ok") and fgr.get("ok"):
    rec["ratio"] = fgr["median_ms"] / js["median_ms"]
    if "pipelined_ms" in js and "pipelined_ms" in fgr:
      rec["pipelined_ratio"] = fgr["pipelined_ms"] / js["pipelined_ms"]
  if js_check is not None and fg_check is not None:
    # The norms too: a rel_err of exactly 0 (seen once, H100 2026-11-23) must be told apart from two equal
    # degenerate arrays.
    rec["cross_check"] = {"what": "output" if mode == "inference" else "layer-0 weight gradient",
                          "rel_err": rel_err(js_check, fg_check),
                          "jsparse_norm": float(np.linalg.norm(np.asarray(js_check, np.float64))),
                          "flexgemm_norm": float(np.linalg.norm(np.asarray(fg_check, np.float64))),
                          "shapes": [list(np.shape(js_check)), list(np.shape(fg_check))]}
  del js_check, fg_check
  summary = f"    jsparse {fmt_ms(js)}"
  summary += f" | FlexGEMM {fmt_ms(fgr)}" if fg else ""
  summary += f" | ratio {rec['ratio']:.2f}" if "ratio" in rec else ""
  summary += f" | pipelined ratio {rec['pipelined_ratio']:.2f}" if "pipelined_ratio" in rec else ""
  summary += f" | rel err {rec['cross_check']['rel_err']:.1e}" if "cross_check" in rec else ""
  print(summary, flush=True)


def check_neighbor_map(row, coords, pairs, impl) -> dict:
  """Builds jsparse's neighbour map once outside jit (raises on hash-table overflow) and counts its pairs."""
  try:
    x = jsparse.SparseTensor.from_coords(coords, jnp.zeros((len(coords), 1), jnp.float32),
                                         spatial_shape=(row.res,) * 3, batch_size=1, capacity="exact")
    got = int(jsparse.neighbor_map(x, 3, 1, implementation=impl).num_pairs())
    return {"pairs": got, "ok": got == pairs}
  except Exception as e:  # noqa: BLE001
    return {"ok": False, "error": short_error(e)}


def write_json(data, path):
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(data, f, indent=1, default=str)
  os.replace(tmp, path)


# ---- the report --------------------------------------------------------------------------------------


def fmt_ms(r) -> str:
  if not r:
    return "-"
  if r.get("not_run"):
    return "n/a"
  if not r.get("ok"):
    return "OOM" if r.get("oom") else "FAILED"
  return f"{r['median_ms']:.3f}"


def fmt_mb(r) -> str:
  if not r or not r.get("ok") or r.get("peak_bytes") is None:
    return "-"
  return f"{r['peak_bytes'] / 1e6:.1f}"


def geomeans(results, key: str = "ratio") -> list[tuple[str, str, int, float]]:
  """(dtype, mode, rows, geometric mean of rec[key]) per (dtype, mode): key "ratio" (each call waited for) or
  "pipelined_ratio"."""
  groups: dict[tuple[str, str], list[float]] = {}
  for rec in results:
    if rec.get(key):
      groups.setdefault((rec["dtype"], rec["mode"]), []).append(rec[key])
  return [(d, m, len(v), math.exp(sum(math.log(r) for r in v) / len(v))) for (d, m), v in groups.items()]


def train_gradients(settings) -> str:
  """The report's line on what the training rows differentiate (runs before 2026-12-01 had jsparse compute layer
  0's input gradient while FlexGEMM did not, unless --flexgemm-input-grad)."""
  if "input_grad" in settings:
    return ("- train: both sides differentiate w.r.t. weights and biases"
            + (" and the input features (--input-grad)" if settings["input_grad"] else
               " only, as FlexGEMM's benchmark (no input-feature gradient of layer 0)"))
  return ("- train: jsparse differentiates w.r.t. input features, weights and biases; FlexGEMM "
          + ("likewise (--flexgemm-input-grad)" if settings.get("flexgemm_input_grad") else
             "w.r.t. weights and biases only, as its benchmark (no input-feature gradient of layer 0)"))


def render_markdown(data) -> str:
  meta, settings, results = data["meta"], data["settings"], data["results"]
  lines = [
      "# jsparse vs FlexGEMM: SubMConv3d suite", "",
      f"- device: {meta.get('device_kind')} ({meta.get('platform')}); date {meta.get('date')}; "
      f"jax {meta.get('jax')}; torch {meta.get('torch', '-')}; commit {meta.get('commit')}",
      f"- FlexGEMM: {meta.get('flexgemm')} (masked implicit GEMM + split-K, allow_tf32 as its benchmark)",
      f"- jsparse: implementation {settings.get('impl') or 'default'}, algorithm {settings.get('algorithm', 'auto')}, "
      f"weights {settings.get('weight_layout', 'DHWIO')}",
      f"- timing: {settings.get('timing')}; warmup {settings.get('warmup')}, repeats {settings.get('repeats')}; "
      "ms = median",
      train_gradients(settings),
      "- peak MB (1e6 bytes): jsparse = compiled executable's argument + output + temp bytes (memory_analysis); "
      "FlexGEMM = torch.cuda.max_memory_allocated over the timed calls (suite.json also has JAX's "
      "peak_bytes_in_use after each workload, cumulative over the process)",
      "- TFLOP/s = useful FLOPs (2 x pairs x C^2 x L, x3 for train) / median time",
  ]
  if meta.get("interrupted"):
    lines.append(f"- INTERRUPTED: {meta['interrupted']}")
  lines += ["", "## Details", "",
            "| row | dtype | mode | pairs | jsparse median / min ms | jsparse TFLOP/s | compile s | "
            "FlexGEMM median / min ms | FlexGEMM TFLOP/s | cross-check rel. err |",
            "|---|---|---|---|---|---|---|---|---|---|"]
  errors, skipped = [], []
  for rec in results:
    if rec.get("skipped"):
      skipped.append(f"{rec['row']} {rec['dtype']} {rec['mode']}")
      continue
    js, fg = rec.get("jsparse", {}), rec.get("flexgemm", {})
    if rec.get("error"):  # the workload failed outside both benchmarks (e.g. building its inputs)
      js = fg = {"ok": False, "error": rec["error"], "oom": is_oom(rec["error"])}
      errors.append(f"{rec['row']} {rec['dtype']} {rec['mode']}: {rec['error']}")
    cells = []
    for r in (js, fg):
      if r.get("ok"):
        cells += [f"{r['median_ms']:.3f} / {r['min_ms']:.3f}", f"{r['tflops']:.3g}"]
      else:
        cells += [fmt_ms(r), "-"]
    cc = rec.get("cross_check")
    nm = rec.get("neighbor_map_check", {})
    pairs = f"{rec['pairs']:,}" if "pairs" in rec else "-"
    if not nm.get("ok", True):
      pairs += " (jsparse map: MISMATCH)"
      errors.append(f"{rec['row']} {rec['dtype']} {rec['mode']} jsparse neighbour map: "
                    + (f"{nm['pairs']:,} pairs, expected {rec.get('pairs', 0):,}" if "pairs" in nm
                       else nm.get("error")))
    compile_s = f"{js['compile_s']:.1f}" if js.get("ok") else "-"
    cc_s = f"{cc['rel_err']:.1e}" if cc else "-"
    lines.append(f"| {rec['row']} | {rec['dtype']} | {rec['mode']} | {pairs} | {cells[0]} | {cells[1]} | "
                 f"{compile_s} | {cells[2]} | {cells[3]} | {cc_s} |")
    for name, r in (("jsparse", js), ("FlexGEMM", fg)):
      if r and not r.get("ok") and not r.get("not_run") and not rec.get("error"):
        errors.append(f"{rec['row']} {rec['dtype']} {rec['mode']} {name}: {r.get('error')}")
  lines += ["", "## Geometric-mean ratio (FlexGEMM time / jsparse time; > 1 = jsparse faster)", "",
            "| dtype | mode | rows | geomean ratio | geomean pipelined ratio |", "|---|---|---|---|---|"]
  pipelined = {(d, m): g for d, m, _, g in geomeans(results, "pipelined_ratio")}
  for d, m, n, g in geomeans(results):
    gp = f"{pipelined[d, m]:.2f}" if (d, m) in pipelined else "-"
    lines.append(f"| {d} | {m} | {n} | {g:.2f} | {gp} |")
  if errors:
    lines += ["", "## Errors", ""] + [f"- {e}" for e in errors]
  if skipped:
    lines += ["", "## Not run (time budget)", ""] + [f"- {s}" for s in skipped]
  lines += ["", "## Results", "",
            "| row | dtype | mode | jsparse ms | FlexGEMM ms | ratio | pipelined jsparse / FlexGEMM ms | "
            "pipelined ratio | jsparse peak MB | FlexGEMM peak MB |",
            "|---|---|---|---|---|---|---|---|---|---|"]
  for rec in results:
    if rec.get("skipped"):
      continue
    js, fg = rec.get("jsparse", {}), rec.get("flexgemm", {})
    if rec.get("error"):
      js = fg = {"ok": False, "error": rec["error"], "oom": is_oom(rec["error"])}
    ratio = f"{rec['ratio']:.2f}" if rec.get("ratio") else "-"
    piped = " / ".join(f"{r['pipelined_ms']:.3f}" if "pipelined_ms" in r else "-" for r in (js, fg))
    piped_ratio = f"{rec['pipelined_ratio']:.2f}" if rec.get("pipelined_ratio") else "-"
    lines.append(f"| {rec['row']} | {rec['dtype']} | {rec['mode']} | {fmt_ms(js)} | {fmt_ms(fg)} | {ratio} | "
                 f"{piped} | {piped_ratio} | {fmt_mb(js)} | {fmt_mb(fg)} |")
  return "\n".join(lines) + "\n"


def plot(data, path) -> str | None:
  """Relative speed per row (fastest of the two = 1.0), one panel per (dtype, mode). None if no matplotlib."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except Exception as e:  # noqa: BLE001
    return f"no chart: matplotlib not importable ({type(e).__name__})"
  groups: dict[tuple[str, str], list] = {}
  for rec in data["results"]:
    if not rec.get("skipped"):
      groups.setdefault((rec["dtype"], rec["mode"]), []).append(rec)
  if not groups:
    return "no chart: no results"
  fig, axes = plt.subplots(len(groups), 1, figsize=(10, 2.4 * len(groups)), squeeze=False)
  for ax, ((dtype, mode), recs) in zip(axes[:, 0], groups.items()):
    xs = np.arange(len(recs))
    for i, (name, key, color) in enumerate((("FlexGEMM", "flexgemm", "0.6"), ("jsparse", "jsparse", "#20a3c4"))):
      heights = []
      for rec in recs:
        times = [rec[k]["median_ms"] for k in ("jsparse", "flexgemm") if rec.get(k, {}).get("ok")]
        r = rec.get(key, {})
        heights.append(min(times) / r["median_ms"] if r.get("ok") else 0.0)
      bars = ax.bar(xs + (i - 0.5) * 0.38, heights, 0.36, label=name, color=color, edgecolor="black",
                    linewidth=0.6, zorder=2)
      for bar, h in zip(bars, heights):
        ax.text(bar.get_x() + bar.get_width() / 2, h, f"{h:.2f}" if h else "n/a", ha="center", va="bottom",
                fontsize=7)
    ratios = [(f"{rec['ratio']:.2f}x" if rec.get("ratio") else "-")
              + (f"\n{rec['pipelined_ratio']:.2f}x back to back" if rec.get("pipelined_ratio") else "")
              for rec in recs]
    ax.set_xticks(xs, [f"{rec['row']}\n{r}" for rec, r in zip(recs, ratios)], fontsize=8)
    ax.set_ylim(0, 1.25)
    ax.set_yticks([])
    ax.set_ylabel("relative speed\n(fastest = 1)", fontsize=8)
    ax.set_title(f"{dtype} {mode}: relative speed (fastest = 1.00); below: FlexGEMM time / jsparse time",
                 fontsize=9)
    for y in np.arange(0.2, 1.2, 0.2):
      ax.axhline(y, color="gray", linestyle="--", linewidth=0.5, alpha=0.6, zorder=0)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
  axes[-1, 0].set_xlabel("workload (RES, C, L)")
  fig.suptitle(f"SubMConv3d suite on {data['meta'].get('device_kind')}", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=150)
  plt.close(fig)
  return None


def write_report(data, out_dir) -> str:
  md = render_markdown(data)
  with open(os.path.join(out_dir, "suite.md"), "w") as f:
    f.write(md)
  note = plot(data, os.path.join(out_dir, "suite.png"))
  if note:
    print(note)
  return md


def merge(paths) -> dict:
  """Merges suite.json files; a later file's result for the same (row, dtype, mode) wins."""
  merged, order = None, {}
  for p in paths:
    with open(p) as f:
      d = json.load(f)
    if merged is None:
      merged = {"meta": d["meta"], "settings": d["settings"], "results": []}
    for rec in d["results"]:
      key = (rec["row"], rec["dtype"], rec["mode"])
      if rec.get("skipped") and key in order:
        continue
      order[key] = rec
  merged["meta"]["merged_from"] = list(paths)
  row_index = {r.name: i for i, r in enumerate(workloads.SUITE)}
  merged["results"] = sorted(order.values(), key=lambda r: (r["dtype"], MODES.index(r["mode"]) if r["mode"] in MODES
                                                            else 9, row_index.get(r["row"], 99)))
  return merged


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description="jsparse vs FlexGEMM SubMConv3d suite",
                               formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
  ap.add_argument("--rows", default=None, help="comma-separated indices into workloads.SUITE (default: all)")
  ap.add_argument("--dtypes", default="fp16,tf32", help=f"comma-separated, of {list(DTYPES)}")
  ap.add_argument("--modes", default="inference,train", help="comma-separated, of inference,train")
  ap.add_argument("--repeats", type=int, default=20)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--pipelined-calls", type=int, default=10,
                  help="also time batches of this many calls issued back to back, one sync a batch, on both sides "
                       "(FlexGEMM's own protocol); 0 = only calls each waited for")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/jsparse_bench")
  ap.add_argument("--impl", default=None, choices=("xla", "pallas"),
                  help="jsparse implementation (default: Pallas on a GPU, XLA elsewhere)")
  ap.add_argument("--algorithm", default="auto", choices=jsparse.ALGORITHMS,
                  help="jsparse submconv3d algorithm (Pallas only; auto = chosen per pass)")
  ap.add_argument("--weight-layout", default="ODHWI", choices=("ODHWI", "DHWIO"),
                  help="jsparse's weight layout: ODHWI = (Cout, 3, 3, 3, Cin), as FlexGEMM holds its weights; "
                       "DHWIO = flax's (3, 3, 3, Cin, Cout) (runs before 2026-11-23's fifth session)")
  ap.add_argument("--input-grad", action="store_true",
                  help="train: both sides also compute layer 0's input-feature gradient (FlexGEMM's own benchmark "
                       "does not; by default neither side does, so both compute the same gradients)")
  ap.add_argument("--time-budget", type=float, default=0,
                  help="seconds; start no new workload after this (0 = no limit)")
  ap.add_argument("--autotune", action="store_true",
                  help="autotune jsparse per (row, dtype) before timing (untimed); saves OUT/tuned.json")
  ap.add_argument("--tuned", default=None, help="a jsparse ConfigTable JSON to use (e.g. a previous tuned.json)")
  ap.add_argument("--smoke", action="store_true",
                  help=f"harness test: row {SMOKE_ROW.name} only, 2 repeats, 1 warm-up (runs on a CPU)")
  ap.add_argument("--report", nargs="+", metavar="JSON", help="only merge these suite.json files and render")
  args = ap.parse_args(argv)
  args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
  args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
  for d in args.dtypes:
    if d not in DTYPES:
      ap.error(f"unknown dtype {d!r}; choose from {list(DTYPES)}")
  for m in args.modes:
    if m not in MODES:
      ap.error(f"unknown mode {m!r}; choose from {list(MODES)}")
  if args.smoke:
    args.repeats, args.warmup, args.pipelined_calls = 2, 1, min(args.pipelined_calls, 2)
  return args


def main(argv=None):
  args = parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  if args.report:
    data = merge(args.report)
    with open(os.path.join(args.out, "suite.json"), "w") as f:
      json.dump(data, f, indent=1, default=str)
  else:
    if args.smoke:
      rows = [SMOKE_ROW]
    elif args.rows:
      rows = [workloads.SUITE[int(i)] for i in args.rows.split(",") if i.strip()]
    else:
      rows = list(workloads.SUITE)
    install_sigterm_handler()
    global TUNED
    if args.autotune or args.tuned:
      TUNED = jsparse.ConfigTable.load(args.tuned) if args.tuned else jsparse.ConfigTable()
      if TUNED.device_kind is None and jax.default_backend() == "gpu":
        TUNED.device_kind = jax.devices()[0].device_kind
      with TUNED:
        data = run_suite(args, rows, args.out)
    else:
      data = run_suite(args, rows, args.out)
  md = write_report(data, args.out)
  print(f"wrote {args.out}/suite.json, suite.md" + (", suite.png" if os.path.exists(
      os.path.join(args.out, "suite.png")) else ""))
  print()
  print(md, end="", flush=True)
  failed = any(not rec.get("skipped") and not rec.get("jsparse", {}).get("ok") for rec in data["results"])
  return 2 if data["meta"].get("interrupted") else (1 if failed else 0)


if __name__ == "__main__":
  sys.exit(main())
