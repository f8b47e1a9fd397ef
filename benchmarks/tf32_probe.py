"""Why are float32 (TF32) Pallas GEMMs slow? Times forward and weight-gradient kernel variants.

    python -m benchmarks.tf32_probe [--out DIR] [--res 256] [--channels 256] [--only REGEX] [--repeats 20]

For the forward gather-GEMM (weight tile N-contiguous vs K-contiguous, tile shapes, warps, pipeline stages)
and the weight gradient, at float32 (TF32) and fp16, on a sphere shell: the median time, useful TFLOP/s and
the error against the XLA path (at full float32 precision). Appends to DIR/tf32_probe.log.
To see which tensor-core instructions a variant runs (HGMMA = Hopper warpgroup MMA, HMMA = mma.sync), run
one variant under Nsight Compute with --repeats 0, e.g.
    ncu --kernel-name regex:gather_gemm --launch-count 1 --section InstructionStats --print-details all \
        python -m benchmarks.tf32_probe --only fwd_f32_K_128x128x32_w4s3 --repeats 0
(XLA's --xla_dump_to does not write the PTX of Pallas kernels on jax 0.11.2: tried, 2026-11-22.)
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jsparse  # noqa: E402
from benchmarks.probe_setup import open_log, shell_layer  # noqa: E402
from jsparse.autotuning import median_ms  # noqa: E402
from pallas_kernels.gather_gemm import conv_forward, gather_gemm  # noqa: E402
from pallas_kernels.gemm_plan import gray_rank, masked_plan, pair_lists  # noqa: E402
from pallas_kernels.tiling import TileConfig  # noqa: E402
from pallas_kernels.weight_grad import weight_grad  # noqa: E402

INTERPRET = jax.default_backend() != "gpu"  # off the GPU: a logic check on small sizes


def run_variant(log, tag, fn, args, ref, flops, repeats):
  jitted = jax.jit(fn)
  try:
    out = jax.block_until_ready(jitted(*args))
    err = float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    if repeats == 0:  # (under a profiler: one more launch, no timing)
      jax.block_until_ready(jitted(*args))
      log(f"{tag:44s} ran once more; err {err:.1e}")
      return
    ms = median_ms(jitted, args, warmup=3, repeats=repeats)
  except Exception as e:  # noqa: BLE001 (a tile shape that does not compile: record, go on)
    log(f"{tag:44s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return
  log(f"{tag:44s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s  err {err:.1e}")


def forward_variants():
  """(dtype, K-contiguous weight?, tiles). Tiles with columns_fastest launch a row block's column blocks
  side by side (L2 reuse of the gathered rows). Stages: with the plan's gathered rows the data loads sit one
  indirection from the loop counter, so Triton prefetches them (stages - 1) // 2 steps ahead."""
  T = TileConfig
  out = []
  for bm, bn, bk, w in [(128, 128, 32, 4), (128, 256, 32, 8), (64, 256, 32, 4), (128, 64, 32, 4)]:
    for st in (3, 5, 7):
      out.append(("f32", True, T(bm, bn, bk, w, st, columns_fastest=True)))
  for bm, bn, bk, w in [(128, 256, 64, 8), (128, 128, 64, 8), (128, 128, 64, 4), (64, 256, 64, 4)]:
    for st in (3, 5, 7):
      out.append(("f16", True, T(bm, bn, bk, w, st, columns_fastest=True)))
  return out


def fwd_tag(dname, kmajor, t):
  return (f"fwd_{dname}_{'K' if kmajor else 'N'}_{t.block_m}x{t.block_n}x{t.block_k}_w{t.num_warps}s{t.num_stages}"
          + ("_cf" if t.columns_fastest else ""))


def weight_grad_variants():
  """(kind, tiles): f32 = float32 inputs at TF32 precision (run as bf16 hi/lo products); f16 = half."""
  T = TileConfig
  out = []
  for kind in ("f32", "f16"):
    for bm, bn, bk, w, st in [(128, 128, 64, 4, 5), (128, 128, 64, 4, 4), (128, 128, 32, 4, 5), (128, 128, 64, 8, 4),
                              (64, 128, 64, 4, 5)]:
      for split in (5, 10, 20):
        out.append((kind, T(bm, bn, bk, w, st, split=split)))
  return out


def time_map_and_plan(log, x, repeats):
  """The neighbour map (hash table) and the plans built from it, each jitted alone, median ms."""
  cache = jsparse.neighbor_map(x, 3)
  nbr, num = cache.nbr, x.num
  steps = [("neighbour map", jax.jit(lambda c, n: jsparse.neighbor_map(x.replace(coords=c, num=n), 3).nbr),
            (x.coords, x.num))]
  for bm in (64, 128):
    steps.append((f"masked plan (block {bm})", jax.jit(lambda nb, n, bm=bm: masked_plan(nb, n, bm)), (nbr, num)))
  steps.append(("pair lists", jax.jit(pair_lists), (nbr,)))

  def sort_only(nb, n):  # the masked plan's Gray-code sort alone (bitmask, rank, stable argsort)
    valid = jnp.arange(nb.shape[0]) < n
    mask = jnp.sum(jnp.where(nb[:, :27] >= 0, jnp.left_shift(1, jnp.arange(min(27, nb.shape[1]))), 0), axis=1)
    return jnp.argsort(jnp.where(valid, gray_rank(mask.astype(jnp.int32)), 2**31 - 1), stable=True)

  steps.append(("masked plan: Gray-code sort alone", jax.jit(sort_only), (nbr, num)))
  for name, fn, args in steps:
    log(f"{name:44s} {median_ms(fn, args, warmup=3, repeats=max(repeats, 5)):8.3f} ms")


def small_row_probe(log, res_list, channels, repeats):
  """Few rows, many channels (the suite's RES 8-32, C 1024 rows): where does a float32 forward's time go?

  Times, per RES: the per-call K-major weight copy alone; conv_forward as the heuristic runs it; and the
  gather-GEMM alone (weight already in each layout) over tiles x split-K, at float32 (TF32) and fp16.
  """
  T = TileConfig
  for res in res_list:
    x, w32, cache, flops = shell_layer(res, channels)
    nbr, num = cache.nbr, x.num
    log(f"-- small rows: RES {res}, {int(num)} voxels, C {channels}: {flops / 1e9:.1f} GFLOP per pass")
    ref = jsparse.submconv_xla(x.feats, w32, None, nbr, num, precision="highest")
    for dname, dt in (("f32", jnp.float32), ("f16", jnp.float16)):
      w = w32.astype(dt)
      wk = w[::-1].transpose(0, 2, 1)
      copy = jax.jit(lambda w: jnp.flip(w, 0).transpose(0, 2, 1))
      log(f"{'weight K-major copy ' + dname:44s} {median_ms(copy, (w,), warmup=3, repeats=repeats):8.3f} ms")
      heur = jsparse.tuning.heuristic("forward", x.capacity, channels, channels, 27, dt)
      plan = masked_plan(nbr, num, heur.tiles.block_m)
      fn = lambda f, w, t=heur.tiles, plan=plan: conv_forward(f, w, nbr, num, plan=plan, config=t, interpret=INTERPRET)
      run_variant(log, f"conv_forward {dname} heuristic {heur.tiles}"[:44], fn, (x.feats.astype(dt), w), ref, flops,
                  repeats)
      for bm in ((32, 64) if dname == "f32" else (64,)):
        plan = masked_plan(nbr, num, bm)
        for bn, warps in ((64, 4), (128, 4), (256, 8)) if dname == "f32" else ((128, 4), (256, 8)):
          bk = 32 if dname == "f32" else 64
          for stages in (5,):
            for split in (4, 8, 16, 32):
              t = T(bm, bn, bk, warps, stages, split=split, columns_fastest=True)
              for kmajor in ((True, False) if dname == "f32" and split == 16 else (True,)):
                tag = f"{fwd_tag(dname, kmajor, t)}_split{split}"
                fn = (lambda f, w, plan=plan, t=t, kmajor=kmajor:
                      gather_gemm(f, w, nbr, num, plan=plan, config=t, weight_axes="vnk" if kmajor else "vkn",
                                  flip_offsets=kmajor, interpret=INTERPRET))
                run_variant(log, tag, fn, (x.feats.astype(dt), wk if kmajor else w), ref, flops, repeats)


def sweep_variants(num_rows: int):
  """(dtype, weight read, tiles) for `--sweep`. Reads: "copy" = through the K-major copy (what conv_forward
  does for float32 by default), "straight" = the [V, Cin, Cout] weight as stored; "+swap" = the transposed
  product (TileConfig.swap_operands). Few rows (< 4096) get small row blocks with split-K."""
  T = TileConfig
  out = []
  if num_rows >= 4096:
    for i, (bm, bn, bk, w, st) in enumerate([
        (128, 128, 32, 4, 5), (128, 128, 32, 4, 4), (128, 128, 32, 4, 3), (128, 256, 32, 8, 3),
        (128, 256, 32, 8, 4), (256, 128, 32, 8, 3), (64, 256, 32, 4, 5), (128, 128, 64, 4, 3),
        (128, 128, 64, 8, 3), (128, 64, 32, 4, 5), (256, 64, 32, 4, 5)]):
      for read in (("copy", "straight+swap", "copy+swap") if i < 2 else ("copy", "straight+swap")):
        out.append(("f32", read, T(bm, bn, bk, w, st, columns_fastest=True)))
    for read in ("copy", "straight", "straight+swap"):
      out.append(("f16", read, T(128, 256, 64, 8, 5, columns_fastest=True)))
  else:
    for bm, bn, bk, w, st, splits, reads in [
        (32, 128, 32, 4, 5, (8, 16), ("straight", "straight+swap")), (64, 128, 32, 4, 5, (16,), ("straight+swap",)),
        (128, 256, 32, 8, 5, (16, 32), ("copy", "straight+swap")), (128, 128, 32, 4, 5, (16,), ("straight+swap",)),
        (32, 256, 32, 8, 5, (8, 16), ("straight+swap",)), (16, 256, 32, 8, 5, (8,), ("straight+swap",)),
        (64, 256, 32, 8, 5, (16,), ("copy", "straight+swap"))]:
      for split in splits:
        for read in reads:
          out.append(("f32", read, T(bm, bn, bk, w, st, split=split, columns_fastest=True)))
  return out


def sweep_probe(log, res, channels, only, repeats):
  """One forward layer over tiles x weight reads (`sweep_variants`), float32 (TF32) and fp16. The K-major
  copy is timed once per dtype and not included in the GEMM times."""
  x, w32, cache, flops = shell_layer(res, channels)
  nbr, num = cache.nbr, x.num
  log(f"-- sweep: RES {res}, {int(num)} voxels, C {channels}: {flops / 1e9:.1f} GFLOP per pass")
  ref = jsparse.submconv_xla(x.feats, w32, None, nbr, num, precision="highest")
  dtypes = {"f32": jnp.float32, "f16": jnp.float16}
  plans, copied = {}, set()
  for dname, read, t in sweep_variants(int(num)):
    tag = f"{fwd_tag(dname, read.startswith('copy'), t)}_{read}" + (f"_split{t.split}" if t.split > 1 else "")
    if not re.search(only, tag):
      continue
    dt = dtypes[dname]
    w = w32.astype(dt)
    if dname not in copied:
      copied.add(dname)
      copy = jax.jit(lambda w: jnp.swapaxes(w, 1, 2))
      log(f"{'weight K-major copy ' + dname:44s} {median_ms(copy, (w,), warmup=3, repeats=repeats):8.3f} ms")
    if t.block_m not in plans:
      plans[t.block_m] = masked_plan(nbr, num, t.block_m)
    kmajor = read.startswith("copy")
    t = dataclasses.replace(t, swap_operands=read.endswith("swap"))
    fn = (lambda f, w, plan=plans[t.block_m], t=t, kmajor=kmajor:
          gather_gemm(f, w, nbr, num, plan=plan, config=t, weight_axes="vnk" if kmajor else "vkn",
                      interpret=INTERPRET))
    run_variant(log, tag, fn, (x.feats.astype(dt), jnp.swapaxes(w, 1, 2) if kmajor else w), ref, flops, repeats)


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--out", default=os.environ.get("OUT", "/tmp/jsparse_bench"))
  p.add_argument("--res", type=int, default=256)
  p.add_argument("--channels", type=int, default=256)
  p.add_argument("--only", default="", help="regex: run only the variants whose tag matches")
  p.add_argument("--repeats", type=int, default=20, help="0: run each variant twice, untimed (for a profiler)")
  p.add_argument("--plan", action="store_true", help="also time the neighbour map and the GEMM plans")
  p.add_argument("--small", default="", help="comma-separated RES: run only the few-rows probe at those RES "
                 "(with --channels)")
  p.add_argument("--sweep", action="store_true", help="only the forward sweep over tiles and weight reads "
                 "(sweep_variants) at --res / --channels")
  a = p.parse_args(argv)
  log = open_log(a.out, "tf32_probe.log")
  if a.sweep:
    log(f"{jax.devices()[0].device_kind}; jax {jax.__version__}")
    sweep_probe(log, a.res, a.channels, a.only, a.repeats)
    return 0
  if a.small:
    log(f"{jax.devices()[0].device_kind}; jax {jax.__version__}")
    small_row_probe(log, [int(r) for r in a.small.split(",")], a.channels, a.repeats)
    return 0

  log(f"{jax.devices()[0].device_kind}; jax {jax.__version__}")
  res, c = a.res, a.channels
  x, w32, cache, flops = shell_layer(res, c)
  rng = np.random.default_rng(1)
  dy32 = jnp.asarray(rng.standard_normal((x.capacity, c)), jnp.float32)
  dy32 = jnp.where(x.valid_mask()[:, None], dy32, 0)
  nbr, num = cache.nbr, x.num
  log(f"RES {res}: {int(num)} voxels, {int(cache.num_pairs())} pairs, C {c}: {flops / 1e9:.1f} GFLOP per pass")
  dtypes = {"f32": jnp.float32, "f16": jnp.float16}
  plans = {}
  fwd = [(d, k, t) for d, k, t in forward_variants() if re.search(a.only, fwd_tag(d, k, t))]
  if a.plan:
    time_map_and_plan(log, x, a.repeats)
  if fwd:
    ref_fwd = jsparse.submconv_xla(x.feats, w32, None, nbr, num, precision="highest")
  for dname, kmajor, t in fwd:
    dt = dtypes[dname]
    wa = (w32[::-1].transpose(0, 2, 1) if kmajor else w32).astype(dt)
    if t.block_m not in plans:
      plans[t.block_m] = masked_plan(nbr, num, t.block_m)
    plan = plans[t.block_m]
    tag = fwd_tag(dname, kmajor, t)
    fn = (lambda f, w, plan=plan, t=t, kmajor=kmajor:
          gather_gemm(f, w, nbr, num, plan=plan, config=t, weight_axes="vnk" if kmajor else "vkn",
                                  flip_offsets=kmajor, interpret=INTERPRET))
    run_variant(log, tag, fn, (x.feats.astype(dt), wa), ref_fwd, flops, a.repeats)

  wgv = [(d, t) for d, t in weight_grad_variants()
         if re.search(a.only, f"wgrad_{d}_{t.block_m}x{t.block_n}x{t.block_k}_w{t.num_warps}s{t.num_stages}_split{t.split}")]
  if wgv:
    plist = pair_lists(nbr)
    gathered = jnp.where((nbr >= 0)[..., None], x.feats[jnp.maximum(nbr, 0)], 0)  # [M, V, C]
    ref_wgrad = jnp.einsum("mvc,md->vcd", gathered, dy32, precision="highest")
    del gathered
  for dname, t in wgv:
    dt = dtypes[dname]
    tag = f"wgrad_{dname}_{t.block_m}x{t.block_n}x{t.block_k}_w{t.num_warps}s{t.num_stages}_split{t.split}"
    fn = lambda f, g, t=t: weight_grad(  # noqa: E731
        f, g, nbr, pairs=plist, config=t, out_dtype=jnp.float32, interpret=INTERPRET)
    run_variant(log, tag, fn, (x.feats.astype(dt), dy32.astype(dt)), ref_wgrad, flops, a.repeats)


if __name__ == "__main__":
  sys.exit(main())
