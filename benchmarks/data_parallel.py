"""Data-parallel weak scaling of a jsparse training step over 1, 2, ... devices.

    python -m benchmarks.data_parallel --out DIR [--devices 1 2 ...] [--res 128] [--channels 64]
                                       [--blocks 2] [--batch-size 1] [--dtype fp16|fp32]
                                       [--repeats 50] [--warmup 5] [--smoke]
    # on a CPU (two host devices must be asked for before jax starts):
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python -m benchmarks.data_parallel --smoke --out /tmp/dp

For each device count k (default 1 .. jax.device_count(); 1 is always measured, as the reference) a jitted
optax Adam training step is shard_map'd over a 1-D mesh of the first k devices. Weak scaling: every device
gets its own sphere-shell SparseTensor of the same size (the same RES^3 shell sites, batch_size copies, its
own random features and targets), so the global batch grows with k. The network: a SubMConv3d stem with
SparseBatchNorm and `blocks` SparseResNetBlocks (batch norm), all C -> C channels, a masked MSE loss. Batch
norm pools its statistics over the devices (axis_name) and the gradients are averaged with lax.pmean before
the Adam update. The neighbour maps are built inside the step, as in training on fresh data.

Per k:
- compile_s: the first call (compilation included).
- step_ms: median over `repeats` calls after `warmup`, each call timed alone up to block_until_ready
  (jsparse.autotuning's helper); samples/s = k * batch_size / step; efficiency = throughput(k) /
  (k * throughput(1)) (1.0 is perfect weak scaling).
- replicated: after one step on distinct inputs, every device's copy of the parameters, the optimizer state
  and the batch statistics is bitwise identical (max abs difference between the copies).
- grad rel err: the same input on every device must give the 1-device gradient (pooled statistics of k equal
  shards are the shard's own, the mean of k equal gradients is the gradient).

dtypes: fp16 (float16 features and compute, float32 parameters and Adam) or fp32 (on a GPU the Pallas
kernels then use TF32 matmuls, jsparse's default precision). Without a GPU, or with --smoke, the sizes
default to tiny ones (the harness is what runs there, not a measurement).
Writes DIR/data_parallel.json and DIR/data_parallel.md; the markdown is printed last. Exit status 1 if a
check failed or a device count could not run.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jsparse
import jsparse.nn as snn
from benchmarks.suite import metadata, short_error, time_calls, write_json
from benchmarks.workloads import sphere_shell_coords

AXIS = "data"
DTYPES = {"fp16": jnp.float16, "fp32": jnp.float32}
# Tolerances of the k-device vs 1-device gradient with identical inputs. Mathematically equal; the k-device
# program is compiled separately (fusions, reduction order), which costs a few float32 ulps (2e-7 seen on the
# CPU), and in float16 such a difference can flip activations by an ulp (5e-4 relative).
GRAD_TOL = {"fp16": 1e-2, "fp32": 1e-4}


@dataclasses.dataclass(frozen=True)
class Config:
  res: int
  channels: int
  blocks: int
  batch_size: int
  dtype: str
  repeats: int
  warmup: int
  learning_rate: float = 1e-3


GPU_DEFAULTS = Config(res=128, channels=64, blocks=2, batch_size=1, dtype="fp16", repeats=50, warmup=5)
SMALL_DEFAULTS = Config(res=12, channels=8, blocks=1, batch_size=1, dtype="fp32", repeats=3, warmup=1)


class Net(nn.Module):
  """SubMConv3d stem + batch norm + ReLU, then `blocks` residual blocks; every batch norm pools over axis_name."""

  channels: int
  blocks: int
  dtype: Any
  axis_name: str | None = None

  @nn.compact
  def __call__(self, x: jsparse.SparseTensor, train: bool = True) -> jsparse.SparseTensor:
    h = snn.SubMConv3d(self.channels, use_bias=False, dtype=self.dtype, name="stem")(x)
    h = snn.SparseBatchNorm(use_running_average=not train, dtype=self.dtype, axis_name=self.axis_name,
                            name="stem_norm")(h)
    h = jsparse.norm.activation(h, nn.relu)
    for i in range(self.blocks):
      h = snn.SparseResNetBlock(self.channels, norm="batch", dtype=self.dtype, axis_name=self.axis_name,
                                name=f"block{i}")(h, train)
    return h


def masked_mse(y: jsparse.SparseTensor, target: jax.Array) -> jax.Array:
  err = jnp.where(y.valid_mask()[:, None], y.feats.astype(jnp.float32) - target, 0)
  return jnp.sum(err**2) / (y.num * target.shape[-1])


def make_train_step(mesh: Mesh, model: Net, optimizer: optax.GradientTransformation):
  """jit(shard_map(step)): (params, opt_state, batch_stats, x, target) -> (the same three updated, loss, grads).

  x and target carry a leading device axis (one shard per device); the rest is replicated. The averaged
  gradients are returned too (for the checks; they exist anyway).
  """
  def step(params, opt_state, batch_stats, x, target):
    x, target = jax.tree.map(lambda a: a[0], (x, target))  # this device's shard, leading axis of size 1

    def loss_fn(params):
      y, updates = model.apply({"params": params, "batch_stats": batch_stats}, x, mutable=["batch_stats"])
      return masked_mse(y, target), updates["batch_stats"]

    # Differentiate w.r.t. a device-varying copy of the replicated params: otherwise the transpose of their
    # implicit broadcast would already sum the gradients over the devices.
    varying = jax.tree.map(lambda a: jax.lax.pcast(a, AXIS, to="varying"), params)
    (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(varying)
    grads, loss = jax.lax.pmean((grads, loss), AXIS)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, new_stats, loss, grads

  return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P(), P(AXIS), P(AXIS)),
                               out_specs=(P(), P(), P(), P(), P())))


def device_inputs(cfg: Config, count: int, seed: int = 0):
  """`count` (SparseTensor, target) pairs on the same shell sites, with their own features and targets."""
  coords = sphere_shell_coords(cfg.res, cfg.batch_size)
  capacity = jsparse.round_capacity(len(coords))
  pairs = []
  for i in range(count):
    rng = np.random.default_rng(seed + i)
    feats = rng.standard_normal((len(coords), cfg.channels)).astype(np.float32)
    x = jsparse.SparseTensor.from_coords(coords, jnp.asarray(feats, DTYPES[cfg.dtype]), (cfg.res,) * 3,
                                         cfg.batch_size, capacity=capacity)
    target = rng.standard_normal((capacity, cfg.channels)).astype(np.float32)
    pairs.append((x, target))
  return pairs


def shard_inputs(mesh: Mesh, pairs):
  """Stacks the per-device (x, target) pairs along a new leading axis, one slice per mesh device."""
  stacked = jax.tree.map(lambda *a: np.stack([np.asarray(v) for v in a]), *pairs)
  return jax.device_put(stacked, NamedSharding(mesh, P(AXIS)))


def replica_max_diff(tree) -> float:
  """Max abs difference between the devices' copies of every leaf of a replicated output (0.0: identical)."""
  worst = 0.0
  for leaf in jax.tree.leaves(tree):
    copies = [np.asarray(s.data, np.float64) for s in leaf.addressable_shards]
    worst = max([worst] + [float(np.max(np.abs(c - copies[0]), initial=0.0)) for c in copies[1:]])
  return worst


def rel_err(a, ref) -> float:
  a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-30))


def flat(tree) -> np.ndarray:
  return np.concatenate([np.asarray(leaf, np.float64).ravel() for leaf in jax.tree.leaves(tree)])


def log(msg: str):
  print(msg, flush=True)


def measure(cfg: Config, k: int, model: Net, optimizer, init_state, reference_grads):
  """One device count: compile, time, check. Returns (record, grads on identical inputs)."""
  mesh = Mesh(np.array(jax.devices()[:k]), (AXIS,))
  step = make_train_step(mesh, model, optimizer)
  state = jax.device_put(init_state, NamedSharding(mesh, P()))
  distinct = shard_inputs(mesh, device_inputs(cfg, k))
  identical = shard_inputs(mesh, device_inputs(cfg, 1) * k)
  voxels = int(np.sum(np.asarray(distinct[0].num)))

  t0 = time.perf_counter()
  out = jax.block_until_ready(step(*state, *distinct))
  compile_s = time.perf_counter() - t0
  replica_diff = replica_max_diff(out[:3])  # params, opt_state, batch_stats
  log(f"  k={k}: compiled + first step in {compile_s:.1f} s; replicas differ by {replica_diff:g}")

  ms = time_calls(lambda: step(*state, *distinct), jax.block_until_ready, cfg.warmup, cfg.repeats)["median_ms"]
  same = jax.block_until_ready(step(*state, *identical))
  grads = flat(same[4])
  grad_err = 0.0 if reference_grads is None else rel_err(grads, reference_grads)
  samples_per_s = k * cfg.batch_size * 1e3 / ms
  record = {
      "devices": k, "compile_s": compile_s, "step_ms": ms, "samples_per_s": samples_per_s,
      "voxels_per_step": voxels, "voxels_per_s": voxels * 1e3 / ms, "loss": float(out[3]),
      "replicated": replica_diff == 0.0, "replica_max_abs_diff": replica_diff,
      "grad_rel_err_vs_1": grad_err, "grad_tol": GRAD_TOL[cfg.dtype], "grad_ok": grad_err <= GRAD_TOL[cfg.dtype],
  }
  log(f"  k={k}: {ms:.3f} ms/step, {samples_per_s:.1f} samples/s, grad rel err vs 1 device {grad_err:.2e}")
  return record, grads


def run(cfg: Config, counts: list[int]) -> dict:
  meta = metadata()
  meta["device_count"] = jax.device_count()
  log(f"device: {meta['device_kind']} x {jax.device_count()} ({meta['platform']}); jax {jax.__version__}; "
      f"device counts {counts}; {cfg}")
  model = Net(cfg.channels, cfg.blocks, DTYPES[cfg.dtype], axis_name=AXIS)
  optimizer = optax.adam(cfg.learning_rate)
  x0 = device_inputs(cfg, 1)[0][0]
  log(f"input per device: RES {cfg.res} shell x {cfg.batch_size} = {int(x0.num)} voxels "
      f"(capacity {x0.capacity}), C = {cfg.channels}, {cfg.dtype}")
  # jitted: eager init dispatches every op of the forward pass; rbg keys are quick to compile on a CPU
  variables = jax.jit(model.init)(jax.random.key(0, impl="unsafe_rbg"), x0)
  params = variables["params"]
  init_state = (params, optimizer.init(params), variables["batch_stats"])
  log(f"parameters: {sum(a.size for a in jax.tree.leaves(params)):,}")

  results, reference_grads = [], None
  for k in counts:
    try:
      record, grads = measure(cfg, k, model, optimizer, init_state, reference_grads)
    except Exception as e:  # e.g. out of memory: record it and go on with the other counts
      log(f"  k={k}: FAILED {short_error(e)}")
      results.append({"devices": k, "error": short_error(e)})
      continue
    if k == 1:
      reference_grads = grads
    results.append(record)

  base = next((r for r in results if r["devices"] == 1 and "error" not in r), None)
  for r in results:
    if base is not None and "error" not in r:
      r["efficiency"] = r["samples_per_s"] / (r["devices"] * base["samples_per_s"])
  return {"meta": meta, "config": dataclasses.asdict(cfg), "results": results}


def render_markdown(data) -> str:
  meta, cfg = data["meta"], data["config"]
  lines = [
      "# Data-parallel weak scaling (jsparse training step, shard_map + pmean)",
      "",
      f"- device: {meta['device_kind']} x {meta['device_count']} ({meta['platform']}); jax {meta['jax']}; "
      f"date {meta['date']}; commit {meta.get('commit')}",
      f"- per device: RES {cfg['res']} sphere shell x batch {cfg['batch_size']}, C = {cfg['channels']}, "
      f"{cfg['dtype']}; SubMConv3d stem + SparseResNetBlock x {cfg['blocks']} (cross-device batch norm), Adam; "
      f"median of {cfg['repeats']} steps after {cfg['warmup']} warm-up",
      "",
      "| devices | step ms | samples/s | voxels/s | efficiency | compile s | replicated | grad rel err vs 1 |",
      "|--:|--:|--:|--:|--:|--:|:-:|--:|",
  ]
  for r in data["results"]:
    if "error" in r:
      lines.append(f"| {r['devices']} | failed: {r['error']} | | | | | | |")
      continue
    eff = f"{r['efficiency']:.3f}" if "efficiency" in r else "-"
    lines.append(f"| {r['devices']} | {r['step_ms']:.3f} | {r['samples_per_s']:.1f} | {r['voxels_per_s']:.3g} | "
                 f"{eff} | {r['compile_s']:.1f} | {'yes' if r['replicated'] else 'NO'} | "
                 f"{r['grad_rel_err_vs_1']:.1e}{'' if r['grad_ok'] else ' (FAIL)'} |")
  lines += ["", "efficiency = throughput(k) / (k * throughput(1)); replicated: every device's params, Adam "
            "state and batch stats bitwise equal after one step on distinct inputs; grad rel err: identical "
            f"input on every device vs 1 device (tolerance {GRAD_TOL[cfg['dtype']]:g})."]
  return "\n".join(lines) + "\n"


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
  ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/jsparse_data_parallel")
  ap.add_argument("--devices", type=int, nargs="+", default=None,
                  help="device counts to measure (default 1 .. jax.device_count(); 1 is always added)")
  ap.add_argument("--res", type=int, default=None, help=f"shell grid size (GPU default {GPU_DEFAULTS.res})")
  ap.add_argument("--channels", type=int, default=None, help=f"C (GPU default {GPU_DEFAULTS.channels})")
  ap.add_argument("--blocks", type=int, default=None, help=f"residual blocks (GPU default {GPU_DEFAULTS.blocks})")
  ap.add_argument("--batch-size", type=int, default=None, help="shells per device (default 1)")
  ap.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="GPU default fp16")
  ap.add_argument("--repeats", type=int, default=None)
  ap.add_argument("--warmup", type=int, default=None)
  ap.add_argument("--smoke", action="store_true", help="tiny sizes, few repeats (the default off a GPU)")
  args = ap.parse_args(argv)
  defaults = SMALL_DEFAULTS if args.smoke or jax.default_backend() != "gpu" else GPU_DEFAULTS
  overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(Config)
               if getattr(args, f.name, None) is not None}
  cfg = dataclasses.replace(defaults, **overrides)
  available = jax.device_count()
  counts = sorted(set(args.devices or range(1, available + 1)) | {1})
  if counts[0] < 1 or counts[-1] > available:
    ap.error(f"--devices must lie in 1 .. {available} (jax.device_count()), got {args.devices}")
  return args, cfg, counts


def main(argv=None) -> int:
  args, cfg, counts = parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  t0 = time.perf_counter()
  data = run(cfg, counts)
  data["meta"]["total_s"] = time.perf_counter() - t0
  md = render_markdown(data)
  write_json(data, os.path.join(args.out, "data_parallel.json"))
  with open(os.path.join(args.out, "data_parallel.md"), "w") as f:
    f.write(md)
  log(f"wrote {args.out}/data_parallel.json, data_parallel.md ({data['meta']['total_s']:.0f} s in all)\n")
  print(md, end="", flush=True)
  ok = all("error" not in r and r["replicated"] and r["grad_ok"] for r in data["results"])
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
