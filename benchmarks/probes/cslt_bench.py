"""Probe: the gather-free 2:4 route (cuSPARSELt through jax.ffi) against dense GEMMs, and its bytes against torch.

  python -m benchmarks.probes.cslt_bench /tmp/cslt.json             # GPU (cuSPARSELt found, see sparse24 docs)
  python -m benchmarks.probes.cslt_bench /tmp/cslt.json --smoke     # CPU: tiny shapes, dense routes only

Three parts, float16 unless --dtypes says otherwise, every weight 2:4-pruned along its reduction axis:
  matmul  out [N, M] = x [N, K] W^T: `sparse24.cslt_matmul` on the compressed W (compressed once, outside the
          timing) against XLA's dense dot (cuBLAS) on the same pruned W, for N ~100k / ~1M and K = M in --channels.
  conv    a 1x1x1 submconv3d on a sphere shell (RES 160: ~100k sites, 512: ~1M), C -> C: the Compressed2to4
          weight inside `native_2to4()` (the cuSPARSELt route: in-graph compression, the matmul, the valid-row mask)
          against the dense Pallas path and the XLA path on the pruned weight.
  torch   when torch is importable: `torch._cslt_compress` of the same [M, K] weight byte for byte against
          `cslt_compress`, and `torch._cslt_sparse_mm` against `cslt_matmul`.
Per-call time = median of `repeats` timed calls (after `warmup`), synchronised, each applying the op to `inner`
distinct inputs in one jitted call, divided by `inner`.
"""
from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jsparse
from benchmarks.suite import short_error, time_calls
from benchmarks.workloads import sphere_shell_coords
from jsparse import sparse24, sparsity

DTYPES = {"fp16": jnp.float16, "bf16": jnp.bfloat16}


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("out", help="JSON output path")
  ap.add_argument("--channels", type=int, nargs="+", default=[128, 256, 512, 1024])
  ap.add_argument("--rows", type=int, nargs="+", default=[98_304, 1_048_576])
  ap.add_argument("--res", type=int, nargs="+", default=[160, 512], help="conv part: shell grid sizes")
  ap.add_argument("--conv-channels", type=int, nargs="+", default=[256, 512])
  ap.add_argument("--dtypes", nargs="+", default=["fp16"], choices=list(DTYPES))
  ap.add_argument("--inner", type=int, default=4)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: dense routes only)")
  args = ap.parse_args(argv)
  if args.smoke:
    args.channels, args.rows, args.res, args.conv_channels = [32], [64], [8], [32]
    args.inner, args.warmup, args.repeats = 2, 1, 2
  return args


def timed(fn, sets, operands, args) -> dict:
  batched = jax.jit(lambda s, ops: [fn(x, ops) for x in s])
  compiled = batched.lower(sets, operands).compile()
  t = time_calls(lambda: compiled(sets, operands), jax.block_until_ready, args.warmup, args.repeats)
  return {"ms": t["median_ms"] / len(sets), "min_ms": t["min_ms"] / len(sets),
          "out": np.asarray(compiled(sets, operands)[0], np.float32)}


def pruned_weight(rng, m, k, dtype):
  """A [M, K] weight, 2:4 along K (jsparse.sparsity's magnitude pruning of the [1,1,1,K,M] kernel)."""
  w = rng.standard_normal((1, 1, 1, k, m)).astype(np.float32) / np.sqrt(k)
  return sparsity.prune_2to4(jnp.asarray(w, dtype)).reshape(k, m).T


def run_routes(row, routes, base):
  outs = {}
  for name, (fn, sets, ops, runs, why) in routes.items():
    if not runs:
      row[name] = {"skipped": why}
      continue
    try:
      r = fn(sets, ops)
    except Exception as e:  # noqa: BLE001 (a failing route is reported, the others still run)
      row[name] = {"error": short_error(e)}
      continue
    outs[name] = r.pop("out")
    row[name] = r
  for name, out in outs.items():
    if base in outs:
      row[name]["max_abs_err_vs_" + base] = float(np.max(np.abs(out - outs[base])))
  return outs


def matmul_case(n, c, dtype, args, cslt_ok, cslt_why) -> dict:
  rng = np.random.default_rng(n + c)
  w = pruned_weight(rng, c, c, dtype)
  sets = [jnp.asarray(rng.standard_normal((n, c)), dtype) for _ in range(args.inner)]
  row = {"part": "matmul", "rows": n, "channels": c, "dtype": jnp.dtype(dtype).name}
  compressed = sparse24.cslt_compress(w) if cslt_ok else None  # once, outside the timing

  def dense(x, w):
    return jnp.dot(x, w.T, preferred_element_type=jnp.float32).astype(x.dtype)

  def sparse(x, cw):
    return sparse24.cslt_matmul(x, cw, c)

  routes = {"dense": (lambda s, o: timed(dense, s, o, args), sets, w, True, ""),
            "cusparselt": (lambda s, o: timed(sparse, s, o, args), sets, compressed, cslt_ok, cslt_why)}
  run_routes(row, routes, "dense")
  if "ms" in row.get("cusparselt", {}):
    row["speedup_cusparselt_vs_dense"] = row["dense"]["ms"] / row["cusparselt"]["ms"]
  flops = 2.0 * n * c * c
  for name in ("dense", "cusparselt"):
    if "ms" in row[name]:
      row[name]["tflops_dense_equivalent"] = flops / (row[name]["ms"] * 1e-3) / 1e12
  return row


def conv_case(res, c, dtype, args) -> dict:
  rng = np.random.default_rng(res + c)
  coords = sphere_shell_coords(res)
  x = jsparse.SparseTensor.from_coords(coords, np.zeros((len(coords), c), np.float32), (res,) * 3, 1)
  x = x.replace(feats=x.feats.astype(dtype))
  cache = jsparse.neighbor_map(x, 1)
  w = rng.standard_normal((1, 1, 1, c, c)).astype(np.float32) / np.sqrt(c)
  pruned = sparsity.prune_2to4(jnp.asarray(w, dtype))
  compressed = sparsity.compress_2to4(pruned)
  sets = [jnp.asarray(rng.standard_normal(x.feats.shape), dtype) for _ in range(args.inner)]
  on_gpu = jax.default_backend() == "gpu"
  route_ok, route_why = sparse24.cusparselt_route(dtype, compressed, implementation_is_pallas_on_gpu=on_gpu, cin=c,
                                                   cout=c)

  def conv(implementation):
    def run(f, ops):
      weight, x, cache = ops
      return jsparse.submconv3d(x.replace(feats=f), weight, cache=cache, implementation=implementation).feats
    return lambda s, o: timed(run, s, o, args)

  row = {"part": "conv", "res": res, "sites": int(len(coords)), "channels": c, "dtype": jnp.dtype(dtype).name,
         "route": route_why}
  routes = {"cusparselt": (conv(None), sets, (compressed, x, cache), route_ok, route_why),
            "pallas": (conv(None), sets, (pruned, x, cache), on_gpu, "no GPU"),
            "xla": (conv("xla"), sets, (pruned, x, cache), True, "")}
  outs = run_routes(row, routes, "pallas" if on_gpu else "xla")
  for name in outs:
    row[name]["max_abs_err_vs_xla"] = float(np.max(np.abs(outs[name][: len(coords)] - outs["xla"][: len(coords)])))
  if "ms" in row.get("cusparselt", {}) and "ms" in row.get("pallas", {}):
    row["speedup_cusparselt_vs_pallas"] = row["pallas"]["ms"] / row["cusparselt"]["ms"]
  return row


def torch_case(m, k, n, args) -> dict:
  row = {"part": "torch", "m": m, "k": k, "n": n}
  try:
    import torch
  except ImportError as e:
    row["skipped"] = f"no torch: {e}"
    return row
  rng = np.random.default_rng(m + k + n)
  w = np.asarray(pruned_weight(rng, m, k, jnp.float16).astype(jnp.float32))
  x = rng.standard_normal((n, k)).astype(np.float16)
  ours = np.asarray(sparse24.cslt_compress(jnp.asarray(w, jnp.float16)))
  w_t = torch.tensor(w, dtype=torch.float16, device="cuda")
  theirs = torch._cslt_compress(w_t)
  theirs_bytes = theirs.contiguous().view(torch.uint8).cpu().numpy().reshape(-1)
  row["bytes_ours"], row["bytes_torch"] = int(ours.size), int(theirs_bytes.size)
  common = min(ours.size, theirs_bytes.size)
  row["bytes_equal"] = bool(ours.size <= theirs_bytes.size and np.array_equal(ours, theirs_bytes[: ours.size]))
  row["first_differing_byte"] = (int(np.argmax(ours[:common] != theirs_bytes[:common]))
                                 if not np.array_equal(ours[:common], theirs_bytes[:common]) else None)
  out_ours = np.asarray(sparse24.cslt_matmul(jnp.asarray(x), jnp.asarray(ours), m), np.float32)
  x_t = torch.tensor(x, device="cuda")
  out_torch = torch._cslt_sparse_mm(theirs, x_t.t()).t().float().cpu().numpy()  # W x^T, transposed back
  # torch's compressed bytes fed to our matmul: the hand-off a torch-pruned, torch-compressed weight takes.
  theirs_in_ours = np.asarray(sparse24.cslt_matmul(jnp.asarray(x), jnp.asarray(theirs_bytes[: ours.size]), m),
                              np.float32)
  reference = x.astype(np.float32) @ w.T
  row["max_abs_err_ours_vs_numpy"] = float(np.max(np.abs(out_ours - reference)))
  row["max_abs_err_torch_vs_numpy"] = float(np.max(np.abs(out_torch - reference)))
  row["max_abs_err_torch_bytes_in_ours"] = float(np.max(np.abs(theirs_in_ours - reference)))
  return row


def main(argv=None):
  args = parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  cslt_ok, cslt_why = sparse24.cusparselt_status() if on_gpu else (False, "no GPU")
  print(f"devices: {jax.devices()}; cuSPARSELt: {cslt_ok} {cslt_why}", flush=True)
  rows = []

  def keep(row):
    rows.append(row)
    print(json.dumps(row, default=str), flush=True)
    write(args, rows, cslt_why)

  if cslt_ok:
    for m, k, n in ((256, 256, 4096), (128, 512, 1000 * 16)):
      try:
        keep(torch_case(m, k, n, args))
      except Exception as e:  # noqa: BLE001
        keep({"part": "torch", "m": m, "k": k, "n": n, "error": short_error(e)})
  for dname in args.dtypes:
    for n in args.rows:
      for c in args.channels:
        keep(matmul_case(n, c, DTYPES[dname], args, cslt_ok, cslt_why))
    for res in args.res:
      for c in args.conv_channels:
        with sparse24.native_2to4():
          keep(conv_case(res, c, DTYPES[dname], args))
  print("\nmatmul (ms; dense-equivalent TFLOP/s):")
  for r in rows:
    if r["part"] == "matmul":
      cells = [f"{name} {r[name]['ms']:.3f} ({r[name]['tflops_dense_equivalent']:.0f})" if "ms" in r[name]
               else f"{name} {next(iter(r[name].values()))}"[:60] for name in ("dense", "cusparselt")]
      print(f"{r['dtype']:8} N {r['rows']:8d} C {r['channels']:5d} | " + " | ".join(cells) +
            (f" | {r['speedup_cusparselt_vs_dense']:.2f}x" if "speedup_cusparselt_vs_dense" in r else ""))
  print("\n1x1x1 conv (ms):")
  for r in rows:
    if r["part"] == "conv":
      cells = [f"{name} {r[name]['ms']:.3f}" if "ms" in r[name] else f"{name} {next(iter(r[name].values()))}"[:60]
               for name in ("cusparselt", "pallas", "xla")]
      print(f"{r['dtype']:8} sites {r['sites']:8d} C {r['channels']:5d} | " + " | ".join(cells) +
            (f" | {r['speedup_cusparselt_vs_pallas']:.2f}x" if "speedup_cusparselt_vs_pallas" in r else ""))
  write(args, rows, cslt_why)
  print(f"wrote {args.out}")
  return 0


def write(args, rows, cslt_why) -> None:
  with open(args.out, "w") as f:
    json.dump({"device": str(jax.devices()[0]), "cusparselt_status": cslt_why,
               "settings": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}, f, indent=1,
              default=str)


if __name__ == "__main__":
  sys.exit(main())
