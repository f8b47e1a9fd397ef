"""Why are float32 (TF32) Pallas GEMMs slow? Times kernel variants and reads the PTX XLA compiled them to.

    python -m benchmarks.tf32_probe [--out DIR] [--res 256] [--channels 256]

For the forward gather-GEMM (weight tile N-contiguous vs K-contiguous, several tile shapes) and the weight
gradient, at float32 (TF32) and fp16, on a sphere shell: the median time, useful TFLOP/s, the error against
the XLA path, and per Pallas kernel the PTX instruction mix: `wgmma` (Hopper warpgroup MMA, the fast path)
vs `mma.sync` (Ampere-style MMA), `cp.async` (asynchronous global->shared copies, i.e. software pipelining),
`ldmatrix`, and local-memory traffic (register spills). XLA writes the PTX when --xla_dump_to is set, which
this script sets for modules named `probe_*` before importing jax.
Writes DIR/tf32_probe.log (the table) and DIR/tf32_probe_ptx.tar.gz (the probe modules' PTX).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tarfile
import tempfile

DUMP = tempfile.mkdtemp(prefix="xla_dump_")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_dump_to={DUMP} --xla_dump_hlo_module_re=.*probe_.*")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jsparse  # noqa: E402
from benchmarks.workloads import sphere_shell_coords  # noqa: E402
from jsparse.autotuning import _median_ms  # noqa: E402
from pallas_kernels.gather_gemm import gather_gemm  # noqa: E402
from pallas_kernels.gemm_plan import masked_plan, pair_lists  # noqa: E402
from pallas_kernels.tiling import TileConfig  # noqa: E402
from pallas_kernels.weight_grad import weight_grad  # noqa: E402

INTERPRET = jax.default_backend() != "gpu"  # off the GPU: a logic check on small sizes
PTX_PATTERNS = {
    "wgmma": r"wgmma\.mma_async",
    "mma.sync": r"\bmma\.sync",
    "tf32": r"\.tf32",
    "cp.async": r"cp\.async\.(?:ca|cg)",
    "ldmatrix": r"ldmatrix",
    "ld.global": r"ld\.global",
    "local": r"(?:ld|st)\.local",
}


def ptx_kernels(tag: str) -> dict:
  """PTX instruction counts of each Pallas kernel in the module jit_probe_<tag>."""
  files = [f for f in glob.glob(os.path.join(DUMP, "*.ptx")) if re.search(rf"probe_{tag}\b", os.path.basename(f))]
  out = {}
  for f in files:
    text = open(f).read()
    for entry in re.split(r"(?=\.visible \.entry|\.entry )", text)[1:]:
      name = re.match(r"\.(?:visible )?\.?entry\s+(\S+?)\(", entry)
      name = name.group(1) if name else "?"
      if "gather_gemm" not in name and "weight_grad" not in name:
        continue
      out[name] = {k: len(re.findall(p, entry)) for k, p in PTX_PATTERNS.items()}
  return out


def run_variant(log, tag, fn, args, ref, flops):
  fn.__name__ = f"probe_{tag}"
  jitted = jax.jit(fn)
  try:
    out = jitted(*args)
    err = float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    ms = _median_ms(jitted, args, warmup=3, repeats=20)
  except Exception as e:  # noqa: BLE001 (a tile shape that does not compile: record, go on)
    log(f"{tag:44s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return
  mix = ptx_kernels(tag)
  mix_s = "; ".join(f"{k}: " + " ".join(f"{n}={c}" for n, c in v.items()) for k, v in mix.items()) or "(no PTX found)"
  log(f"{tag:44s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s  err {err:.1e}  | {mix_s}")


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--out", default=os.environ.get("OUT", "/tmp/jsparse_bench"))
  p.add_argument("--res", type=int, default=256)
  p.add_argument("--channels", type=int, default=256)
  a = p.parse_args(argv)
  os.makedirs(a.out, exist_ok=True)
  logf = open(os.path.join(a.out, "tf32_probe.log"), "w")

  def log(msg):
    print(msg, flush=True)
    logf.write(msg + "\n")
    logf.flush()

  log(f"{jax.devices()[0].device_kind}; jax {jax.__version__}; dump {DUMP}")
  res, c = a.res, a.channels
  coords = sphere_shell_coords(res)
  rng = np.random.default_rng(0)
  feats32 = jnp.asarray(rng.standard_normal((len(coords), c)), jnp.float32)
  x = jsparse.SparseTensor.from_coords(coords, feats32, (res,) * 3)
  w32 = jnp.asarray(rng.standard_normal((27, c, c)) / np.sqrt(27 * c), jnp.float32)
  dy32 = jnp.asarray(rng.standard_normal((x.capacity, c)), jnp.float32)
  dy32 = jnp.where(x.valid_mask()[:, None], dy32, 0)
  cache = jsparse.neighbor_map(x, 3)
  nbr, num = cache.nbr, x.num
  pairs = int(cache.num_pairs())
  flops = 2 * pairs * c * c
  log(f"RES {res}: {int(num)} voxels, {pairs} pairs, C {c}: {flops / 1e9:.1f} GFLOP per pass")
  ref_fwd = jsparse.submconv_xla(x.feats, w32, None, nbr, num, precision="highest")
  plans = {bm: masked_plan(nbr, num, bm) for bm in (64, 128, 256)}
  plist = pair_lists(nbr)
  gathered = jnp.where((nbr >= 0)[..., None], x.feats[jnp.maximum(nbr, 0)], 0)  # [M, V, C]
  ref_wgrad = jnp.einsum("mvc,md->vcd", gathered, dy32, precision="highest")
  del gathered

  T = TileConfig
  fwd_variants = [  # (dtype, K-contiguous weight?, tiles)
      ("f32", False, T(128, 64, 32, 4, 3)),
      ("f32", True, T(128, 64, 32, 4, 3)),
      ("f32", False, T(128, 128, 32, 8, 3)),
      ("f32", True, T(128, 128, 32, 8, 3)),
      ("f32", True, T(128, 128, 32, 4, 3)),
      ("f32", True, T(128, 64, 32, 4, 4)),
      ("f32", True, T(128, 64, 16, 4, 4)),
      ("f32", True, T(64, 128, 32, 4, 3)),
      ("f32", True, T(128, 256, 32, 8, 3)),
      ("f32", True, T(256, 128, 32, 8, 3)),
      ("f32", True, T(128, 128, 64, 8, 2)),
      ("f16", False, T(128, 128, 64, 8, 3)),
      ("f16", True, T(128, 128, 64, 8, 3)),
      ("f16", False, T(128, 256, 64, 8, 3)),
  ]
  dtypes = {"f32": jnp.float32, "f16": jnp.float16}
  for dname, kmajor, t in fwd_variants:
    dt = dtypes[dname]
    xf = x.feats.astype(dt)
    wa = (w32[::-1].transpose(0, 2, 1) if kmajor else w32).astype(dt)
    plan = plans[t.block_m]
    tag = f"fwd_{dname}_{'K' if kmajor else 'N'}_{t.block_m}x{t.block_n}x{t.block_k}_w{t.num_warps}s{t.num_stages}"
    fn = (lambda f, w, plan=plan, t=t, kmajor=kmajor:
          gather_gemm(f, w, nbr, num, plan=plan, config=t, transpose_weight=kmajor, interpret=INTERPRET))
    run_variant(log, tag, fn, (xf, wa), ref_fwd, flops)

  wg_variants = [
      ("f32", T(128, 64, 32, 4, 3, split=10)),
      ("f32", T(128, 128, 32, 8, 3, split=10)),
      ("f32", T(64, 64, 32, 4, 3, split=10)),
      ("f16", T(128, 128, 64, 8, 3, split=10)),
  ]
  for dname, t in wg_variants:
    dt = dtypes[dname]
    tag = f"wgrad_{dname}_{t.block_m}x{t.block_n}x{t.block_k}_w{t.num_warps}s{t.num_stages}_split{t.split}"
    fn = lambda f, g, t=t: weight_grad(f, g, nbr, pairs=plist, config=t, out_dtype=jnp.float32,
                                                interpret=INTERPRET)  # noqa: E731
    run_variant(log, tag, fn, (x.feats.astype(dt), dy32.astype(dt)), ref_wgrad, flops)

  # Keep the probe modules' PTX for reading off the machine.
  ptx = sorted(glob.glob(os.path.join(DUMP, "*probe_*.ptx")))
  with tarfile.open(os.path.join(a.out, "tf32_probe_ptx.tar.gz"), "w:gz") as tar:
    for f in ptx:
      tar.add(f, arcname=os.path.basename(f))
  log(f"{len(ptx)} PTX files archived; dump had {len(os.listdir(DUMP))} files")
  if not ptx:
    log("dump listing: " + ", ".join(sorted(os.listdir(DUMP))[:40]))


if __name__ == "__main__":
  sys.exit(main())
