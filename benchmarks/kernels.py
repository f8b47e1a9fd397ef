"""Per-kernel microbenchmark: jsparse's neighbour map, forward, input-gradient and weight-gradient kernels, and
batch norm's column reductions.

    python -m benchmarks.kernels [--res 64,128,256,512] [--shapes 64x256,128x128,256x64,256x256]
                                 [--dtypes fp16,tf32] [--weight-layout DHWIO] [--groups 1] [--repeats 20]
                                 [--inner 8] [--sections matmul,neighbor_map,gemm,batch_norm]
                                 [--bn-rows 1048576] [--bn-channels 32,64,128,256] [--bn-sweep] [--out DIR]
                                 [--smoke]

- matmul peak: jnp.dot of two random 8192x8192 matrices (fp16, bf16, and float32 at default precision =
  TF32), the ceiling each kernel's useful rate is compared with (fp16 kernels with fp16, tf32 with TF32).
- neighbour map: jsparse.neighbor_map (jitted) on the sphere shells of RES in --res, alone, with the masked plan's
  row order, with the forward's plan and with every plan; FlexGEMM's SubMConv3dFunction._compute_neighbor_cache
  (masked forward, no backward data: the map, Gray codes and sorted rows) beside it, alone and with the per-block
  offset lists its forward adds on its first call (`compute_kernel_idx`, jsparse's block size).
- GEMM kernels on (RES, C) in --shapes, C -> C, 3x3x3, fp16 and tf32, the weight in --weight-layout: each
  pass exactly as jsparse.submconv3d runs it (`jsparse.map_gemm.run_pass` with the config
  `jsparse.map_gemm.choose` picks), and for a masked weight gradient beside it the same with
  TileConfig.balanced ("weight_grad_balanced")
  and FlexGEMM's forward layer (sparse_submanifold_conv3d with a prebuilt neighbour cache) beside them.
  Useful TFLOP/s = 2 * pairs * Cin * Cout / groups / time. --groups G > 1 times grouped convolutions
  (feature_group_count G, weight [27, C/G, C]; G = C is depthwise); FlexGEMM, which has none, is then skipped.
- batch norm (section "batch_norm", not run by default): on --bn-rows rows (all valid) x C in --bn-channels, in
  --dtypes (tf32 = float32), with implementation "pallas" (pallas_kernels/channel_moments.py) and "xla":
  "stats" (the training forward's per-channel moments), "grad_sums" (the backward's sum of g and of g * xhat,
  g = relu'-masked dy) and "bn_relu" (jsparse.norm.batch_norm with relu, forward and backward: y, dx, dscale,
  dbias from x and dy). GB/s counts minimal traffic of rows x C elements of the dtype: stats reads x once,
  grad_sums x and dy once, bn_relu 8 passes (forward: x for the statistics, x again and y written; backward: x and
  dy for the sums, x and dy again and dx written). --bn-sweep adds the Pallas reductions at the launch shapes of
  `pallas_kernels.channel_moments_config.candidates` (the json's "sweep" lists; the fastest can become the default).

Timing: one jitted function applies the op to `inner` distinct input sets (distinct buffers: no CSE, and
each set is read from device memory, not from L2), timed with perf_counter + block_until_ready; the
median over `repeats` divided by `inner` is the per-call time, so launch and synchronisation overhead
is amortised. FlexGEMM: the same, `inner` eager calls then torch.cuda.synchronize.
Outputs: kernels.json in --out (default $OUT or /tmp/jsparse_bench); the tables are printed last.
--smoke: tiny shapes on a CPU (Pallas kernels in interpret mode).
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # see suite.py: leave GPU memory to torch

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jsparse  # noqa: E402
from benchmarks import workloads  # noqa: E402
from benchmarks.suite import (Interrupted, import_flexgemm, install_sigterm_handler, metadata, rel_err,  # noqa: E402
                              short_error, time_calls)
from jsparse import map_gemm  # noqa: E402
from jsparse.pass_config import PASSES, PassInputs, RunOptions, describe  # noqa: E402
from pallas_kernels import channel_moments_config, gemm_plan  # noqa: E402

DTYPES = {"fp16": jnp.float16, "tf32": jnp.float32}
SECTIONS = ("matmul", "neighbor_map", "gemm", "batch_norm")
ON_GPU = jax.default_backend() == "gpu"


def bench_jax(fn, arg_sets, warmup, repeats) -> dict:
  """Per-call time of fn over len(arg_sets) distinct argument tuples inside one jitted function."""
  batched = jax.jit(lambda sets: [fn(*s) for s in sets])
  t0 = time.perf_counter()
  compiled = batched.lower(arg_sets).compile()
  compile_s = time.perf_counter() - t0
  t = time_calls(lambda: compiled(arg_sets), jax.block_until_ready, warmup, repeats)
  n = len(arg_sets)
  return {"ms": t["median_ms"] / n, "min_ms": t["min_ms"] / n, "compile_s": compile_s, "inner": n}


def bench_torch(torch, fn, arg_sets, warmup, repeats) -> dict:
  sync = lambda _: torch.cuda.synchronize()  # noqa: E731
  t = time_calls(lambda: [fn(*s) for s in arg_sets], sync, warmup, repeats)
  n = len(arg_sets)
  return {"ms": t["median_ms"] / n, "min_ms": t["min_ms"] / n, "inner": n}


def guarded(label, fn, *a, **kw):
  try:
    return fn(*a, **kw)
  except Exception as e:  # noqa: BLE001 (OOM, compile failure: record and go on)
    msg = short_error(e)
    print(f"  {label}: FAILED {msg}", flush=True)
    return {"error": msg}
  finally:
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
      sys.modules["torch"].cuda.empty_cache()  # FlexGEMM's tensors are gone: return torch's cached blocks


def matmul_peaks(args) -> dict:
  """TFLOP/s of a dense n x n x n product per dtype (median), on random normal data."""
  n = args.matmul_n
  out = {}
  key = jax.random.key(1)
  for name, dt in (("fp16", jnp.float16), ("bf16", jnp.bfloat16), ("tf32", jnp.float32)):
    sets = []
    for i in range(2):  # two pairs of operands, alternated
      ka, kb = jax.random.split(jax.random.fold_in(key, i))
      sets.append((jax.random.normal(ka, (n, n), dt), jax.random.normal(kb, (n, n), dt)))
    r = guarded(f"matmul {name}", bench_jax, lambda a, b: jnp.dot(a, b), sets, args.warmup, args.repeats)
    if "ms" in r:
      r["tflops"] = 2 * n**3 / (r["ms"] * 1e-3) / 1e12
      print(f"  matmul {name} {n}^3: {r['ms']:.3f} ms, {r['tflops']:.3g} TFLOP/s", flush=True)
    out[name] = r
    del sets
  return out


def sparse_tensor(res, coords, feats):
  return jsparse.SparseTensor.from_coords(coords, feats, spatial_shape=(res,) * 3, batch_size=1,
                                          capacity="exact")


def bench_neighbor_maps(args, fg) -> list[dict]:
  rows = []
  for res in args.res:
    coords = workloads.sphere_shell_coords(res)
    n = len(coords)
    rec = {"res": res, "voxels": n}
    xs = [sparse_tensor(res, coords, np.zeros((n, 1), np.float32)) for _ in range(args.inner)]
    # "map": the neighbour map alone; "map+plans": the whole NeighborCache a convolution uses (with the Pallas
    # implementation also the masked-GEMM plan and the weight-gradient pair lists); "map+plan": the map and the
    # forward's masked plan only, what inference builds; "map+order": the map and the plan's row order, what
    # FlexGEMM's cache holds (its per-block offset lists are built by the forward's first call).
    rec["jsparse_map"] = guarded(f"neighbor_map RES {res}", bench_jax,
                                 lambda x: jsparse.neighbor_map(x, 3, 1, implementation=args.impl).nbr,
                                 [(x,) for x in xs], args.warmup, args.repeats)
    rec["jsparse"] = guarded(f"neighbor_map+plans RES {res}", bench_jax,
                             lambda x: jsparse.neighbor_map(x, 3, 1, implementation=args.impl),
                             [(x,) for x in xs], args.warmup, args.repeats)

    def map_and_forward_plan(x):
      cache = jsparse.neighbor_map(x, 3, 1, implementation=args.impl)
      return cache.nbr, cache.plans  # the pair lists are left out, so jit drops them

    rec["jsparse_map_plan"] = guarded(f"neighbor_map+forward plan RES {res}", bench_jax, map_and_forward_plan,
                                      [(x,) for x in xs], args.warmup, args.repeats)

    def map_and_row_order(x):  # the plan's row order alone: jit drops the block kernel, whose outputs go unused
      cache = jsparse.neighbor_map(x, 3, 1, implementation=args.impl)
      return cache.nbr, [plan.order for plan in cache.plans.values()]

    rec["jsparse_map_order"] = guarded(f"neighbor_map+row order RES {res}", bench_jax, map_and_row_order,
                                       [(x,) for x in xs], args.warmup, args.repeats)
    try:
      rec["pairs"] = int(jsparse.neighbor_map(xs[0], 3, 1, implementation=args.impl).num_pairs())
    except Exception as e:  # noqa: BLE001
      rec["pairs_error"] = short_error(e)
    del xs
    if fg:
      rec["flexgemm"] = guarded(f"FlexGEMM neighbour cache RES {res}", flexgemm_neighbor_map, fg, res, coords, args)
      rec["flexgemm_plan"] = guarded(f"FlexGEMM neighbour cache + block offsets RES {res}", flexgemm_neighbor_map,
                                     fg, res, coords, args, gemm_plan.default_block_m(n))
    rows.append(rec)
    print(f"  neighbor map RES {res}: N {n:,}, jsparse map {fmt(rec['jsparse_map'])} ms, map+order "
          f"{fmt(rec['jsparse_map_order'])} ms, map+plan {fmt(rec['jsparse_map_plan'])} ms, map+plans "
          f"{fmt(rec['jsparse'])} ms"
          + (f", FlexGEMM cache {fmt(rec['flexgemm'])} ms, + block offsets {fmt(rec['flexgemm_plan'])} ms"
             if fg else ""), flush=True)
  return rows


def flexgemm_setup(fg):
  torch, flex_gemm = fg
  flex_gemm.ops.spconv.set_algorithm(flex_gemm.ops.spconv.Algorithm.MASKED_IMPLICIT_GEMM_SPLITK)
  flex_gemm.kernels.triton.spconv.config.allow_tf32 = True  # as its benchmark; only matters for float32
  from flex_gemm.ops.spconv import SubMConv3dFunction, sparse_submanifold_conv3d
  return torch, SubMConv3dFunction, sparse_submanifold_conv3d


def flexgemm_neighbor_map(fg, res, coords, args, block_m: int | None = None) -> dict:
  """FlexGEMM's neighbour cache for a masked forward (map, Gray codes, sorted rows); with block_m also the
  per-block offset lists of blocks of block_m rows (`compute_kernel_idx`), which its forward builds on its first
  call: then the same contents as jsparse's map + forward plan."""
  torch, fn_cls, _ = flexgemm_setup(fg)
  shape = torch.Size([1, 1, res, res, res])
  sets = [(torch.from_numpy(coords).cuda().contiguous(),) for _ in range(args.inner)]

  def cache(c):
    built = fn_cls._compute_neighbor_cache(c, shape, (3, 3, 3), (1, 1, 1), False)
    if block_m is not None:
      built.compute_kernel_idx(block_m)
    return built

  return bench_torch(torch, cache, sets, args.warmup, args.repeats)


def pass_fn(pass_name, cfg, interpret, weight_layout, groups=1):
  """The op one pass of jsparse.submconv3d runs for config `cfg` (a PassConfig) on a weight flattened in
  `weight_layout` (in `groups` feature groups), as f(x, g, w, b, maps)."""
  options = RunOptions(None, interpret, jsparse.WeightLayout.of(weight_layout), groups)

  def run(x, g, w, b, m):
    if pass_name == "forward":
      inputs = PassInputs(x, w, m["nbr"], m["num"], b, plan=m["plan_forward"])
    elif pass_name == "input_grad":
      inputs = PassInputs(g, w, m["nbr"], m["num"], plan=m["plan_input_grad"])
    else:
      inputs = PassInputs(x, g, m["nbr"], m["num"], pairs=m["pairs"])
    return map_gemm.run_pass(pass_name, cfg, inputs, options)

  return run


def bench_gemms(args, fg, peaks) -> list[dict]:
  """Each pass as jsparse.submconv3d runs it (map_gemm.choose picks the config) for --algorithms."""
  rows = []
  interpret = not ON_GPU
  for res, c in args.shapes:
    coords = workloads.sphere_shell_coords(res)
    n = len(coords)
    rng = np.random.default_rng([res, c])
    for dname in args.dtypes:
      dt = DTYPES[dname]
      groups = args.groups
      base = {"res": res, "channels": c, "dtype": dname, "voxels": n, "groups": groups}
      if c % groups:
        rows.append(dict(base, kernel="setup", jsparse={"error": f"--groups {groups} does not divide C {c}"}))
        continue
      try:
        x0 = sparse_tensor(res, coords, np.zeros((n, 1), np.float32))
        cache = jsparse.neighbor_map(x0, 3, 1, implementation=args.impl)
        pairs = int(cache.num_pairs())
        std = 1.0 / np.sqrt(27 * c // groups)
        data = []
        for _ in range(args.inner):  # distinct x, g, w, bias per set
          data.append(tuple(jnp.asarray(a, dt) for a in (
              rng.standard_normal((n, c), np.float32), rng.standard_normal((n, c), np.float32),
              flat_weight(rng.standard_normal((27, c // groups, c), np.float32) * std, args.weight_layout),
              rng.standard_normal((c,), np.float32) * 0.1)))
      except Exception as e:  # noqa: BLE001
        rows.append(dict(base, kernel="setup", jsparse={"error": short_error(e)}))
        print(f"  RES {res} C {c} {dname}: setup FAILED {short_error(e)}", flush=True)
        continue
      flops = 2.0 * pairs * c * c / groups
      peak = (peaks.get(dname) or {}).get("tflops")
      fr = None
      if fg and groups == 1:  # FlexGEMM's forward layer once per shape; compared with every algorithm's forward
        fr = guarded(f"FlexGEMM forward RES {res} C {c} {dname}", flexgemm_forward, fg, res, coords, data, dname,
                     args)
        if "ms" in fr:
          fr["tflops"] = flops / (fr["ms"] * 1e-3) / 1e12
      for algorithm in args.algorithms:
        for kernel in PASSES + ("weight_grad_balanced",):
          pass_name = kernel.removesuffix("_balanced")
          rec = dict(base, kernel=kernel, algorithm=algorithm, pairs=pairs)
          try:
            cfg = map_gemm.choose(pass_name, x0.capacity, c, c, 27, dt, algorithm, groups)
            if kernel != pass_name:  # the chosen weight-gradient tiles, balanced (needs pair lists: masked only)
              if not cfg.uses_plan or cfg.tiles.balanced:
                continue
              cfg = dataclasses.replace(cfg, tiles=dataclasses.replace(cfg.tiles, balanced=True))
            rec["config"] = f"{describe(cfg)} {cfg.tiles}" if cfg.tiles else describe(cfg)
            masked = cfg.uses_plan
            # The map and its plans are arguments (not jit constants), shared by all sets, built outside timing.
            plan = cache.plan(cfg.tiles.block_m, interpret) if masked and pass_name != "weight_grad" else None
            maps = {"nbr": cache.nbr, "num": x0.num,
                    "plan_forward": plan if pass_name == "forward" else None,
                    "plan_input_grad": plan if pass_name == "input_grad" else None,
                    "pairs": cache.pair_lists(interpret) if masked and pass_name == "weight_grad" else None}
            fn = pass_fn(pass_name, cfg, interpret, args.weight_layout, groups)
          except Exception as e:  # noqa: BLE001
            rec["jsparse"] = {"error": short_error(e)}
            rows.append(rec)
            continue
          sets = [d + (maps,) for d in data]
          r = guarded(f"{kernel} {algorithm} RES {res} C {c} {dname}", bench_jax, fn, sets, args.warmup,
                      args.repeats)
          if "ms" in r:
            r["tflops"] = flops / (r["ms"] * 1e-3) / 1e12
            r["pct_peak"] = 100 * r["tflops"] / peak if peak else None
          rec["jsparse"] = r
          if pass_name == "forward" and fr is not None:
            rec["flexgemm"] = {k: v for k, v in fr.items() if k != "out"}
            if "ms" in fr and "ms" in r:
              rec["ratio"] = fr["ms"] / r["ms"]
            if fr.get("out") is not None:
              try:
                rec["cross_check_rel_err"] = rel_err(np.asarray(fn(*sets[0]), np.float32), fr["out"])
              except Exception as e:  # noqa: BLE001
                rec["cross_check_error"] = short_error(e)
          rows.append(rec)
          print(f"  {kernel:11s} {algorithm:13s} RES {res:3d} C {c:3d} {dname}: {rec.get('config')}: "
                f"jsparse {fmt(r)} ms" + (f" ({r['tflops']:.3g} TFLOP/s)" if "tflops" in r else "")
                + (f", FlexGEMM {fmt(rec['flexgemm'])} ms" if "flexgemm" in rec else ""), flush=True)
      del data, x0, cache, fr
  return rows


BN_PASSES = {"stats": 1, "grad_sums": 2, "bn_relu": 8}  # element passes over [rows, C] (minimal traffic)


def batch_norm_fns(impl_name: str, config=None) -> dict:
  """The three timed batch-norm workloads on one implementation, each fn(x, dy, scale, bias); with a
  channel_moments_config.MomentsConfig, the Pallas reductions alone at that launch shape."""
  from jsparse import dispatch, norm
  from pallas_kernels import channel_moments

  impl = dispatch.resolve(impl_name)

  def stats(x, dy, scale, bias):
    if config is not None:
      return channel_moments.channel_moments(x, jnp.int32(x.shape[0]), bias, config=config,
                                             interpret=impl.interpret)
    return norm._moments(x, jnp.int32(x.shape[0]), impl)[1:]

  def grad_sums(x, dy, scale, bias):
    mean, inv_std, num = bias, scale, jnp.int32(x.shape[0])  # any [C] values: the traffic is the same
    if impl.is_pallas:
      return channel_moments.normalised_grad_sums(x, dy, num, mean, inv_std, scale, bias, activation=jax.nn.relu,
                                                  config=config, interpret=impl.interpret)
    xhat = (x.astype(jnp.float32) - mean) * inv_std
    g = jnp.where(xhat * scale + bias > 0, dy.astype(jnp.float32), 0)
    return jnp.sum(g, axis=0), jnp.sum(g * xhat, axis=0)

  def bn_relu(x, dy, scale, bias):
    rows = x.shape[0]

    def f(feats, s, b):
      # The sites do not matter to batch norm: traced zeros, which XLA drops (a concrete array would be a constant).
      t = jsparse.SparseTensor(jnp.zeros((rows, 4), jnp.int32), feats, jnp.int32(rows), (1, 1, 1), 1)
      return jsparse.norm.batch_norm(t, s, b, activation=jax.nn.relu, implementation=impl_name).feats

    y, vjp = jax.vjp(f, x, scale, bias)
    return (y, *vjp(dy))

  if config is not None:
    return {"stats": stats, "grad_sums": grad_sums}
  return {"stats": stats, "grad_sums": grad_sums, "bn_relu": bn_relu}


def bench_batch_norm(args) -> list[dict]:
  """Batch norm's reductions and the whole bn+relu step, Pallas against XLA (see the module docstring)."""
  rows_out = []
  n = args.bn_rows
  fns = {impl: batch_norm_fns(impl) for impl in ("pallas", "xla")}
  for c in args.bn_channels:
    for dname in args.dtypes:
      dt = DTYPES[dname]
      key = jax.random.key(c)
      sets = []
      for i in range(args.inner):  # distinct x, dy per set; generated on the device (no host copies)
        kx, kd, ks = jax.random.split(jax.random.fold_in(key, i), 3)
        sets.append((jax.random.normal(kx, (n, c), dt) + 1, jax.random.normal(kd, (n, c), dt),
                     jax.random.uniform(ks, (c,), jnp.float32, 0.5, 1.5), jnp.full((c,), 0.1, jnp.float32)))
      for kernel, passes in BN_PASSES.items():
        rec = {"kernel": kernel, "rows": n, "channels": c, "dtype": dname}
        gbytes = passes * n * c * jnp.dtype(dt).itemsize / 1e9
        for impl, table in fns.items():
          r = guarded(f"batch_norm {kernel} {impl} C {c} {dname}", bench_jax, table[kernel], sets, args.warmup,
                      args.repeats)
          if "ms" in r:
            r["gb_per_s"] = gbytes / (r["ms"] * 1e-3)
          rec[impl] = r
        p, x = rec["pallas"], rec["xla"]
        if "ms" in p and "ms" in x:
          rec["speedup"] = x["ms"] / p["ms"]
        rows_out.append(rec)
        print(f"  batch_norm {kernel:9s} C {c:3d} {dname}: pallas {fmt(p)} ms"
              + (f" ({p['gb_per_s']:.0f} GB/s)" if "gb_per_s" in p else "") + f", xla {fmt(x)} ms"
              + (f" ({x['gb_per_s']:.0f} GB/s)" if "gb_per_s" in x else ""), flush=True)
        if args.bn_sweep and kernel in ("stats", "grad_sums"):  # the Pallas kernel at other launch shapes
          rec["sweep"] = []
          for cfg in channel_moments_config.candidates(n, c, dt):
            r = guarded(f"batch_norm {kernel} {cfg}", bench_jax, batch_norm_fns("pallas", cfg)[kernel], sets,
                        args.warmup, args.repeats)
            if "ms" in r:
              r["gb_per_s"] = gbytes / (r["ms"] * 1e-3)
              print(f"    {cfg}: {r['ms']:.4f} ms ({r['gb_per_s']:.0f} GB/s)", flush=True)
            rec["sweep"].append(dict(r, config=str(cfg)))
      del sets
  return rows_out


def flat_weight(w_vio: np.ndarray, weight_layout: str) -> np.ndarray:
  """A [V, Cin, Cout] weight in the flattened form of `weight_layout` ([Cout, V, Cin] for ODHWI)."""
  return np.ascontiguousarray(np.transpose(w_vio, (2, 0, 1))) if weight_layout == "ODHWI" else w_vio


def flexgemm_forward(fg, res, coords, jax_sets, dname, args) -> dict:
  """FlexGEMM's forward layer on the same inputs (weights transposed to its (Cout, 3, 3, 3, Cin) layout)."""
  torch, fn_cls, conv = flexgemm_setup(fg)
  tdt = torch.float16 if dname == "fp16" else torch.float32
  c = jax_sets[0][0].shape[1]
  dev = torch.device("cuda")
  coords_t = torch.from_numpy(coords).to(dev).contiguous()
  shape = torch.Size([1, c, res, res, res])
  sets = []
  for x, _, w, b in jax_sets:
    xt = torch.from_numpy(np.array(x, np.float32)).to(dev, tdt).contiguous()
    w_vio = np.array(w, np.float32)
    w_vio = np.transpose(w_vio, (1, 2, 0)) if args.weight_layout == "ODHWI" else w_vio
    wt = torch.from_numpy(np.ascontiguousarray(w_vio).reshape(3, 3, 3, c, c)).to(dev).permute(4, 0, 1, 2, 3)
    sets.append((xt, wt.to(tdt).contiguous(), torch.from_numpy(np.array(b, np.float32)).to(dev, tdt)))
  with torch.no_grad():
    cache = fn_cls._compute_neighbor_cache(coords_t, shape, (3, 3, 3), (1, 1, 1), False)
    f = lambda xt, wt, bt: conv(xt, coords_t, shape, wt, bt, cache)[0]  # noqa: E731
    r = bench_torch(torch, f, sets, args.warmup, args.repeats)
    r["out"] = f(*sets[0]).float().cpu().numpy()
  return r


def fmt(r) -> str:
  if not r:
    return "-"
  return f"{r['ms']:.4f}" if "ms" in r else ("OOM" if "RESOURCE_EXHAUSTED" in r.get("error", "") else "FAILED")


def render(data) -> str:
  meta = data["meta"]
  lines = ["# jsparse kernel microbenchmark", "",
           f"- device: {meta.get('device_kind')}; jax {meta.get('jax')}; commit {meta.get('commit')}; "
           f"FlexGEMM: {meta.get('flexgemm')}",
           f"- per-call ms = median over {data['settings']['repeats']} timed runs of {data['settings']['inner']} "
           "calls on distinct inputs, divided by the count", ""]
  if meta.get("interrupted"):
    lines += [f"- INTERRUPTED: {meta['interrupted']}", ""]
  lines += ["## Dense matmul peak", "", "| dtype | ms | TFLOP/s |", "|---|---|---|"]
  for name, r in data.get("matmul", {}).items():
    lines.append(f"| {name} | {fmt(r)} | {r['tflops']:.1f} |" if "tflops" in r else f"| {name} | {fmt(r)} | - |")
  lines += ["", "## Neighbour map (FlexGEMM cache: _compute_neighbor_cache for a masked forward, no backward data: "
            "map, Gray codes, sorted rows; + offsets: also compute_kernel_idx(block_m), the per-block offset lists its "
            "forward builds on its first call. Ratios pair equal contents: cache / (jsparse map + row order), "
            "(cache + offsets) / (jsparse map + forward plan); map+plans adds the backward's pair lists)", "",
            "| RES | N | pairs | jsparse map ms | map + row order ms | map + forward plan ms | map+plans ms | "
            "FlexGEMM cache ms | cache + offsets ms | ratio order | ratio plan |", "|---" * 11 + "|"]
  ratio = lambda a, b: f"{a['ms'] / b['ms']:.2f}" if a and b and "ms" in a and "ms" in b else "-"  # noqa: E731
  for rec in data.get("neighbor_map", []):
    order, js, fgr, fgp = (rec.get(k) for k in ("jsparse_map_order", "jsparse_map_plan", "flexgemm", "flexgemm_plan"))
    lines.append(f"| {rec['res']} | {rec['voxels']:,} | {rec.get('pairs', 0):,} | {fmt(rec.get('jsparse_map'))} | "
                 f"{fmt(order)} | {fmt(js)} | {fmt(rec.get('jsparse'))} | {fmt(fgr)} | {fmt(fgp)} | "
                 f"{ratio(fgr, order)} | {ratio(fgp, js)} |")
  groups = data["settings"].get("groups", 1)
  lines += ["", "## GEMM kernels (ratio = FlexGEMM forward time / jsparse forward time)"
            + (f"; feature_group_count {groups}" if groups > 1 else ""), "",
            "| kernel | RES | C | dtype | algorithm | pairs | jsparse ms | TFLOP/s | % matmul peak | FlexGEMM ms | "
            "FlexGEMM TFLOP/s | ratio | rel. err |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for rec in data.get("gemm", []):
    js, fgr = rec.get("jsparse", {}), rec.get("flexgemm")
    tf = f"{js['tflops']:.1f}" if "tflops" in js else "-"
    pct = f"{js['pct_peak']:.0f}%" if js.get("pct_peak") is not None else "-"
    ftf = f"{fgr['tflops']:.1f}" if fgr and "tflops" in fgr else "-"
    ratio = f"{rec['ratio']:.2f}" if "ratio" in rec else "-"
    err = f"{rec['cross_check_rel_err']:.1e}" if "cross_check_rel_err" in rec else "-"
    algo = rec.get("algorithm", "-")
    chosen = rec.get("config", "").split(" ")[0]
    if chosen and chosen != algo:
      algo = f"{algo}: {chosen}"
    lines.append(f"| {rec['kernel']} | {rec['res']} | {rec['channels']} | {rec['dtype']} | {algo} | "
                 f"{rec.get('pairs', 0):,} | {fmt(js)} | {tf} | {pct} | {fmt(fgr)} | {ftf} | {ratio} | {err} |")
  if data.get("batch_norm"):
    lines += ["", "## Batch norm (Pallas channel_moments vs XLA; GB/s of minimal traffic, see the docstring)", "",
              "| kernel | rows | C | dtype | pallas ms | pallas GB/s | xla ms | xla GB/s | xla / pallas |",
              "|---|---|---|---|---|---|---|---|---|"]
    for rec in data["batch_norm"]:
      p, x = rec.get("pallas", {}), rec.get("xla", {})
      bw = lambda r: f"{r['gb_per_s']:.0f}" if "gb_per_s" in r else "-"  # noqa: E731
      speedup = f"{rec['speedup']:.2f}" if "speedup" in rec else "-"
      lines.append(f"| {rec['kernel']} | {rec['rows']:,} | {rec['channels']} | {rec['dtype']} | {fmt(p)} | {bw(p)} | "
                   f"{fmt(x)} | {bw(x)} | {speedup} |")
  errors = [f"{k}: {r['error']}" for k, r in data.get("matmul", {}).items() if "error" in r]
  for sec in ("neighbor_map", "gemm", "batch_norm"):
    for rec in data.get(sec, []):
      for side in ("jsparse_map", "jsparse_map_order", "jsparse_map_plan", "jsparse", "flexgemm", "flexgemm_plan",
                   "pallas", "xla"):
        if isinstance(rec.get(side), dict) and "error" in rec[side]:
          where = f"RES {rec['res']}" if "res" in rec else f"C {rec['channels']}"
          errors.append(f"{sec} {rec.get('kernel', '')} {where} {rec.get('dtype', '')} {side}: "
                        f"{rec[side]['error']}")
  errors += [f"section {k}: {v}" for k, v in data.get("section_errors", {}).items()]
  if errors:
    lines += ["", "## Errors", ""] + [f"- {e}" for e in errors]
  return "\n".join(lines) + "\n"


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description="jsparse per-kernel microbenchmark",
                               formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
  ap.add_argument("--res", default="64,128,256,512", help="neighbour-map resolutions")
  ap.add_argument("--shapes", default="64x256,128x128,256x64,256x256", help="GEMM workloads RESxC")
  ap.add_argument("--dtypes", default="fp16,tf32")
  ap.add_argument("--sections", default="matmul,neighbor_map,gemm", help="of matmul, neighbor_map, gemm, batch_norm")
  ap.add_argument("--bn-rows", type=int, default=1 << 20, help="batch_norm section: rows (all valid)")
  ap.add_argument("--bn-channels", default="32,64,128,256", help="batch_norm section: channel counts")
  ap.add_argument("--bn-sweep", action="store_true",
                  help="batch_norm section: also time the Pallas reductions at channel_moments_config.candidates")
  ap.add_argument("--repeats", type=int, default=20)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--inner", type=int, default=8, help="distinct input sets per timed run")
  ap.add_argument("--matmul-n", type=int, default=8192)
  ap.add_argument("--impl", default=None, choices=("xla", "pallas"), help="neighbour-map implementation")
  ap.add_argument("--weight-layout", default="DHWIO", choices=("DHWIO", "ODHWI"),
                  help="the weight layout the passes read (as submconv3d's weight_layout)")
  ap.add_argument("--groups", type=int, default=1, help="feature_group_count of the GEMM workloads (C: depthwise)")
  ap.add_argument("--algorithms", default="auto",
                  help=f"GEMM algorithms to time, of {list(jsparse.ALGORITHMS)} (auto = what submconv3d picks)")
  ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/jsparse_bench")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes, 2 repeats: tests the harness on a CPU")
  args = ap.parse_args(argv)
  if args.smoke:
    args.res, args.shapes, args.repeats, args.warmup, args.inner, args.matmul_n = "8", "8x16", 2, 1, 2, 256
    args.bn_rows, args.bn_channels = 300, "3,16"
  args.res = [int(r) for r in str(args.res).split(",") if r.strip()]
  args.shapes = [tuple(int(v) for v in s.split("x")) for s in str(args.shapes).split(",") if s.strip()]
  args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
  args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
  args.bn_channels = [int(c) for c in str(args.bn_channels).split(",") if c.strip()]
  args.algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
  for a in args.algorithms:
    if a not in jsparse.ALGORITHMS:
      ap.error(f"unknown algorithm {a!r}; choose from {list(jsparse.ALGORITHMS)}")
  for s in args.sections:
    if s not in SECTIONS:
      ap.error(f"unknown section {s!r}; choose from {', '.join(SECTIONS)}")
  for d in args.dtypes:
    if d not in DTYPES:
      ap.error(f"unknown dtype {d!r}; choose from {list(DTYPES)}")
  return args


def main(argv=None):
  args = parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  install_sigterm_handler()
  data = {"meta": metadata(), "settings": {k: getattr(args, k) for k in (
      "res", "shapes", "dtypes", "sections", "algorithms", "repeats", "warmup", "inner", "matmul_n", "impl",
      "weight_layout", "groups", "bn_rows", "bn_channels", "bn_sweep",
      "smoke")}}
  fg, why = import_flexgemm()
  data["meta"]["flexgemm"] = "available" if fg else f"not run: {why}"
  print(f"device: {data['meta']['device_kind']}; Pallas {'on the GPU' if ON_GPU else 'in interpret mode'}; "
        f"FlexGEMM: {data['meta']['flexgemm']}", flush=True)
  t0 = time.perf_counter()
  sections = {"matmul": lambda: matmul_peaks(args), "neighbor_map": lambda: bench_neighbor_maps(args, fg),
              "gemm": lambda: bench_gemms(args, fg, data.get("matmul", {})),
              "batch_norm": lambda: bench_batch_norm(args)}
  try:
    for name in args.sections:
      try:
        data[name] = sections[name]()
      except Exception as e:  # noqa: BLE001 (a broken section must not lose the others)
        data.setdefault("section_errors", {})[name] = short_error(e)
        print(f"section {name} FAILED: {short_error(e)}", flush=True)
  except (Interrupted, KeyboardInterrupt) as e:
    data["meta"]["interrupted"] = f"{type(e).__name__} {e} after {time.perf_counter() - t0:.0f} s"
  data["meta"]["wall_s"] = time.perf_counter() - t0
  with open(os.path.join(args.out, "kernels.json"), "w") as f:
    json.dump(data, f, indent=1, default=str)
  print(f"wrote {args.out}/kernels.json\n")
  print(render(data), end="", flush=True)
  return 2 if data["meta"].get("interrupted") else 0


if __name__ == "__main__":
  sys.exit(main())
