"""Which part of a shard_map'd jsparse step crashes or fails on a multi-GPU machine: each case runs in its
own subprocess (a segfault ends only that case) and prints one status line.

    python -m benchmarks.dp_diagnose [--cases a,b,...] [--flags "--xla_..."]

Cases go from plain JAX to the full training step: psum, a trivial Pallas kernel, the hash-table neighbour
map, the Pallas / XLA convolution forward, and its gradient with pmean.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

CASES = ("psum", "pallas_add", "neighbor_map", "conv_xla", "conv_pallas", "grad_xla", "grad_pallas",
         "grad_pallas_novma", "conv_pallas_xlamap")


def _case(name: str) -> None:
  import functools

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import pallas as pl
  from jax.sharding import Mesh, PartitionSpec as P

  import jsparse
  from pallas_kernels.out_struct import out_struct

  mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
  smap = functools.partial(jax.shard_map, mesh=mesh, check_vma=not name.endswith("_novma"))
  name = name.removesuffix("_novma")
  rng = np.random.default_rng(0)

  def tensors():
    xs = []
    for n in (900, 1100):
      keys = rng.choice(2 * 16 ** 3, size=n, replace=False)
      coords = np.stack(np.unravel_index(keys, (2, 16, 16, 16)), -1).astype(np.int32)
      feats = rng.standard_normal((n, 16)).astype(np.float32)
      xs.append(jsparse.SparseTensor.from_coords(coords, feats, (16,) * 3, 2, capacity=1280))
    return jax.tree.map(lambda *a: jnp.stack(a), *xs)

  if name == "psum":
    f = smap(lambda a: jax.lax.psum(a, "d"), in_specs=P("d"), out_specs=P())
    out = jax.jit(f)(jnp.arange(8.0))
  elif name == "pallas_add":
    def kernel(x_ref, o_ref):
      o_ref[...] = x_ref[...] + 1

    def body(a):
      return pl.pallas_call(kernel, out_shape=out_struct(a.shape, a.dtype, a), interpret=jax.default_backend() == "cpu")(a)
    out = jax.jit(smap(body, in_specs=P("d"), out_specs=P("d")))(jnp.arange(32.0))
  elif name == "neighbor_map":
    def body(x):
      x = jax.tree.map(lambda a: a[0], x)
      return jsparse.neighbor_map(x, 3, implementation="pallas").nbr[None]
    out = jax.jit(smap(body, in_specs=P("d"), out_specs=P("d")))(tensors())
  elif name == "conv_pallas_xlamap":  # XLA neighbour map, Pallas GEMMs
    w = jnp.asarray(rng.standard_normal((3, 3, 3, 16, 16)).astype(np.float32) * 0.1)

    def body(w, x):
      x = jax.tree.map(lambda a: a[0], x)
      cache = jsparse.neighbor_map(x, 3, implementation="xla")
      return jsparse.submconv3d(x, w, cache=cache, implementation="pallas").feats[None]
    out = jax.jit(smap(body, in_specs=(P(), P("d")), out_specs=P("d")))(w, tensors())
  elif name in ("conv_xla", "conv_pallas", "grad_xla", "grad_pallas"):
    impl = name.split("_")[1]
    w = jnp.asarray(rng.standard_normal((3, 3, 3, 16, 16)).astype(np.float32) * 0.1)

    def loss(w, x):
      return jnp.sum(jsparse.submconv3d(x, w, implementation=impl).feats ** 2)

    def body(w, x):
      x = jax.tree.map(lambda a: a[0], x)
      if name.startswith("conv"):
        return jsparse.submconv3d(x, w, implementation=impl).feats[None]
      if smap.keywords["check_vma"]:
        w = jax.lax.pcast(w, "d", to="varying")
      return jax.lax.pmean(jax.grad(loss)(w, x), "d")
    spec = P("d") if name.startswith("conv") else P()
    out = jax.jit(smap(body, in_specs=(P(), P("d")), out_specs=spec))(w, tensors())
  else:
    raise SystemExit(f"unknown case {name}")
  jax.block_until_ready(out)
  print(f"CASE_OK {name} shape={getattr(out, 'shape', None)}")


def _jax_env() -> str:
  return ",".join(f"{k}={v}" for k, v in os.environ.items() if k.startswith("JAX_")) or "-"


def main() -> int:
  p = argparse.ArgumentParser()
  p.add_argument("--cases", default=",".join(CASES))
  p.add_argument("--flags", default="", help="extra XLA_FLAGS for every case")
  p.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
  args = p.parse_args()
  if args.case:
    _case(args.case)
    return 0
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + args.flags).strip()
  failed = 0
  for name in args.cases.split(","):
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.dp_diagnose", "--case", name], env=env,
                          capture_output=True, text=True, timeout=300)
    ok = proc.returncode == 0 and "CASE_OK" in proc.stdout
    failed += not ok
    tail = " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-3:])[-400:]
    print(f"{name:14s} flags={args.flags or '-'} env={_jax_env()} rc={proc.returncode} {time.time() - t0:.1f}s "
          f"{'OK' if ok else 'FAIL'} {'' if ok else tail}", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
