"""Real networks: jsparse against spconv 2.3.8 (and optionally spconv-triton), side by side in one process.

Each network is written once, as a function of a backend (`JaxBackend` runs jsparse's functional ops, the ones
its flax modules call; `TorchBackend` runs spconv's modules), so both libraries compute the same network with
the same weights: parameters are drawn once in numpy, in spconv's (Cout, *kernel, Cin) layout, which is
jsparse's weight_layout="ODHWI". Networks:
- second: SECOND / VoxelNet's sparse backbone (OpenPCDet VoxelBackBone8x): SubMConv3d + BN + ReLU, three
  SparseConv3d k3 s2 downsamplings, 16 -> 128 channels, on KITTI's anisotropic grid (1408, 1600, 41).
- second_pool: the same stages with SparseMaxPool3d(2, 2) between them (after a ReLU, where spconv's max pool,
  which starts from 0, is a true max pool).
- minkunet: a MinkUNet-style segmentation UNet: residual SubMConv3d blocks, k2 s2 SparseConv3d down,
  SparseInverseConv3d up, concatenated skips, 32 -> 256 channels.
- decoder: a generative sparse-structure decoder (TRELLIS-like): wide residual blocks of GroupNorm + SiLU +
  SubMConv3d, SparseConvTranspose3d(2, 2) children pruned to the target shape's occupancy, 512 -> 128
  channels, on jsparse.shapes shapes.
Inputs: LiDAR networks read ray-cast street scans (jsparse.shapes.lidar_batch); the decoder reads shapes
(jsparse.shapes.random_shapes) at a quarter of the final resolution.

Timed as a user runs them: the neighbour maps / indice pairs are built inside every call (jsparse: inside the
jitted function; spconv: a new SparseConvTensor per call). inference = forward; train = forward + backward to
the input features, every weight and every norm parameter. Medians after warm-up, device-synchronised.
Outputs are cross-checked by coordinates (the two libraries order rows differently). Peak memory: jsparse's
compiled program (arguments + outputs + temporaries, XLA's buffer assignment), spconv's
torch.cuda.max_memory_allocated over one call.

  python -m benchmarks.networks --networks second,minkunet --sizes small --dtypes fp16,tf32 --out DIR

`--inputs-cache DIR` keeps the generated inputs as .npz files and reads them back in later processes (the large
LiDAR scans take about 20 s to ray-cast); benchmarks/probes/ab_networks.py shares one such cache between its trees.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import gzip
import hashlib
import inspect
import json
import math
import os
import re
import tempfile
import time
import zlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import jsparse
from jsparse import norm
from jsparse.progress import progress_bar
from benchmarks import suite, triton_tuning_shards

# name -> (jax dtype, jsparse precision). "fp32" (no TF32 on either side) is for exact cross-checks.
DTYPES = {"fp16": (jnp.float16, None), "tf32": (jnp.float32, None), "fp32": (jnp.float32, "highest")}
MODES = ("inference", "train")
LIDAR_CHANNELS = 4  # voxel mean (x, y, z) and mean intensity


# ---- parameters ---------------------------------------------------------------------------------------


class Params:
  """Named float32 numpy parameters, drawn on first use from a generator seeded by (seed, name)."""

  def __init__(self, seed: int = 0):
    self.seed = seed
    self.arrays: dict[str, np.ndarray] = {}

  def get(self, name: str, shape, kind: str = "conv") -> np.ndarray:
    if name not in self.arrays:
      rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
      if kind == "scale":
        a = 1.0 + 0.1 * rng.standard_normal(shape)
      elif kind == "shift":
        a = 0.1 * rng.standard_normal(shape)
      else:  # He-style fan-in scaling keeps activations O(1) through deep stacks
        fan_in = math.prod(shape[1:])
        a = rng.standard_normal(shape) * math.sqrt(2.0 / fan_in)
      self.arrays[name] = a.astype(np.float32)
    have = self.arrays[name].shape
    if have != tuple(shape):
      raise ValueError(f"parameter {name}: shape {have} requested again as {tuple(shape)}")
    return self.arrays[name]


# The loss is sum(out * probe(coords)): a fixed pseudo-random weight per (site, channel), the same on both sides
# whatever their row order (a plain sum would have about zero gradient through a final batch norm).
PROBE_AXES = (0.37, 1.31, 0.73, 2.17)
PROBE_CHANNEL_STEP = 0.113


def probe(xp, coords, channels: int):
  """xp: jax.numpy or torch; coords int [N, 4] -> float32 [N, channels]."""
  c = coords.astype(xp.float32) if xp is jnp else coords.float()
  axes = xp.asarray(PROBE_AXES, dtype=xp.float32) if xp is jnp else xp.tensor(PROBE_AXES, device=coords.device)
  steps = xp.arange(channels, dtype=xp.float32)
  steps = steps if xp is jnp else steps.to(coords.device)
  return xp.sin((c @ axes + 0.5)[:, None] * (1.0 + steps[None, :] * PROBE_CHANNEL_STEP))


# ---- the networks, each written once over a backend ----------------------------------------------------


def second(b, x, channels=(16, 32, 64, 64), out_channels=128):
  """OpenPCDet's VoxelBackBone8x in (x, y, z) order: the z axis (last here) is the short one."""
  c0, c1, c2, c3 = channels
  x = b.bn_relu(b.subm(x, "conv_input", c0, key="subm1"), "bn_input")
  x = b.bn_relu(b.subm(x, "conv1", c0, key="subm1"), "bn1")
  stages = [(c1, "2", (1, 1, 1)), (c2, "3", (1, 1, 1)), (c3, "4", (1, 1, 0))]
  for c, s, pad in stages:
    x = b.bn_relu(b.down(x, f"down{s}", c, 3, 2, pad, key=f"spconv{s}"), f"bn_down{s}")
    for i in range(2):
      x = b.bn_relu(b.subm(x, f"conv{s}_{i}", c, key=f"subm{s}"), f"bn{s}_{i}")
  x = b.bn_relu(b.down(x, "conv_out", out_channels, (1, 1, 3), (1, 1, 2), 0, key="spconv_down2"), "bn_out")
  return x


def second_pool(b, x, channels=(16, 32, 64, 128)):
  """SECOND's stages with max pooling instead of strided convolutions between them."""
  x = b.bn_relu(b.subm(x, "conv_input", channels[0], key="subm0"), "bn_input")
  for s, c in enumerate(channels):
    if s:
      x = b.maxpool(x, f"pool{s}", 2, 2, key=f"pool{s}")
    for i in range(2):
      x = b.bn_relu(b.subm(x, f"conv{s}_{i}", c, key=f"subm{s}"), f"bn{s}_{i}")
  return x


def _res_block(b, x, name, c, key, norm_kind="bn"):
  """Two 3x3x3 SubMConv3d with normalisation, a residual (1x1x1 projection when the width changes)."""
  if norm_kind == "bn":
    h = b.bn_relu(b.subm(x, f"{name}_a", c, key=key), f"{name}_bn_a")
    h = b.bn(b.subm(h, f"{name}_b", c, key=key), f"{name}_bn_b")
    skip = x if b.channels(x) == c else b.bn(b.linear(x, f"{name}_proj", c), f"{name}_bn_proj")
    return b.relu(b.add(h, skip))
  h = b.subm(b.gn_silu(x, f"{name}_gn_a"), f"{name}_a", c, key=key)
  h = b.subm(b.gn_silu(h, f"{name}_gn_b"), f"{name}_b", c, key=key)
  skip = x if b.channels(x) == c else b.linear(x, f"{name}_proj", c)
  return b.add(h, skip)


def minkunet(b, x, enc=(32, 64, 128, 256), dec=(128, 96, 96, 96), classes=20):
  """MinkUNet-style: stem, four (k2 s2 down + residual block) stages, four (inverse up + concat + residual
  block) stages, a per-voxel classifier."""
  x = b.bn_relu(b.subm(x, "stem_a", enc[0], key="subm0"), "stem_bn_a")
  x = b.bn_relu(b.subm(x, "stem_b", enc[0], key="subm0"), "stem_bn_b")
  skips = [x]
  for s, c in enumerate(enc, start=1):
    x = b.bn_relu(b.down(x, f"down{s}", b.channels(x), 2, 2, 0, key=f"down{s}"), f"down{s}_bn")
    x = _res_block(b, x, f"enc{s}", c, key=f"subm{s}")
    skips.append(x)
  for s, c in zip(range(len(enc), 0, -1), dec):
    like = skips[s - 1]
    x = b.bn_relu(b.up(x, like, f"up{s}", c, 2, 2, 0, key=f"down{s}"), f"up{s}_bn")
    x = _res_block(b, b.concat(x, like), f"dec{s}", c, key=f"subm{s - 1}")
  return b.linear(x, "classifier", classes)


def decoder(b, x, channels=(512, 256, 128), out_channels=8):
  """A sparse-structure decoder: at each level a wide residual block, then every site spawns its 8 children
  and only those inside the target's occupancy at the next level are kept (teacher-forced pruning, as in
  training; the occupancy logits are computed and enter the loss)."""
  x = b.linear(x, "in", channels[0])
  for level, c in enumerate(channels):
    x = _res_block(b, x, f"level{level}", c, key=f"subm{level}", norm_kind="gn")
    if level + 1 < len(channels):
      x = b.upsample(x, f"up{level}", channels[level + 1], level + 1, key=f"up{level}")
  logits = b.linear(b.gn_silu(x, "out_gn"), "out", out_channels)
  return logits


NETWORKS: dict[str, Callable] = {"second": second, "second_pool": second_pool, "minkunet": minkunet,
                                 "decoder": decoder}


# ---- inputs ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Workload:
  network: str
  size: str         # "small" (~100k voxels, batch 1) | "large" (~1M, batch 4) | "tiny" (CPU harness tests)
  batch_size: int
  # decoder only: the final resolution (inputs at resolution // 4)
  resolution: int = 0

  @property
  def name(self) -> str:
    return f"{self.network}/{self.size}"



def workload(network: str, size: str) -> Workload:
  if network == "decoder":
    res, batch = {"tiny": (16, 1), "small": (128, 1), "large": (256, 4)}[size]
    return Workload(network, size, batch, res)
  batch = {"tiny": 1, "small": 1, "large": 4}[size]
  return Workload(network, size, batch)


@dataclasses.dataclass
class Inputs:
  coords: np.ndarray            # int32 [N, 4] (batch, x, y, z)
  feats: np.ndarray             # float32 [N, C]
  spatial_shape: tuple
  batch_size: int
  targets: list = dataclasses.field(default_factory=list)  # decoder: sorted int64 keys of each finer level

  def __post_init__(self):
    # Row-major, whatever made them (np.argwhere's output is column-major): spconv reads its indices as a
    # row-major buffer (see indices_tensor).
    self.coords = np.ascontiguousarray(self.coords, np.int32)
    self.feats = np.ascontiguousarray(self.feats, np.float32)


@functools.lru_cache(maxsize=4)  # the three LiDAR networks read the same scans
def lidar_inputs(w: Workload, seed: int) -> Inputs:
  if w.size == "tiny":
    rng = np.random.default_rng(seed)
    shape = (24, 20, 41)  # SECOND's z extent, so its four z reductions fit
    occ = rng.random((w.batch_size,) + shape) < 0.03
    coords = np.argwhere(occ).astype(np.int32)
    feats = rng.standard_normal((len(coords), LIDAR_CHANNELS)).astype(np.float32)
    return Inputs(coords, feats, shape, w.batch_size)
  # small: one 128-beam scan (~100k voxels); large: four scans of ten sweeps each (~250k voxels each)
  options = {} if w.size == "small" else dict(sweeps=10, azimuth_step_deg=0.08)
  coords, feats, shape = jsparse.shapes.lidar_batch(seed, w.batch_size, preset="100k", **options)
  shape = (shape[0], shape[1], shape[2] + 1)  # SECOND's grid has one more z layer (41) than the voxel range
  return Inputs(coords.astype(np.int32), feats, shape, w.batch_size)


def decoder_inputs(w: Workload, seed: int, latent_channels: int = 8) -> Inputs:
  """Coarse sites of random shapes at resolution // 4 with random latents; targets: the sorted linear keys of
  the shapes' occupancy at resolution // 2 and resolution (restricted to children of kept parents)."""
  res = w.resolution
  masks = np.stack([jsparse.shapes.random_union_mask(seed * 1000 + i, res, num_shapes=(2, 3))
                    for i in range(w.batch_size)])  # [B, R, R, R] at the final resolution
  levels = [masks]
  for _ in range(2):
    m = levels[-1]
    b_, r = m.shape[0], m.shape[1] // 2
    levels.append(m.reshape(b_, r, 2, r, 2, r, 2).any(axis=(2, 4, 6)))
  coarse, mid, fine = levels[2], levels[1], levels[0]
  coords = np.argwhere(coarse).astype(np.int32)
  rng = np.random.default_rng(seed)
  feats = rng.standard_normal((len(coords), latent_channels)).astype(np.float32)
  targets = []
  for m in (mid, fine):
    keys = np.flatnonzero(m.reshape(-1)).astype(np.int64)  # linear keys (b, x, y, z), sorted
    targets.append(keys)
  return Inputs(coords, feats, coarse.shape[1:], w.batch_size, targets)


def make_inputs(w: Workload, seed: int = 0, cache_dir: str | None = None) -> Inputs:
  """The workload's inputs; with cache_dir, read from (or first written to) a .npz there, so that the processes
  of an A/B (benchmarks/probes/ab_networks.py) or the calls of a session ray-cast each scan once."""
  if cache_dir is None:
    return _generate_inputs(w, seed)
  path = os.path.join(cache_dir, f"{w.network if w.network == 'decoder' else 'lidar'}_{w.size}_b{w.batch_size}"
                      f"_r{w.resolution}_s{seed}_{_inputs_version()}.npz")
  if os.path.exists(path):
    with np.load(path) as z:
      targets = [z[f"target{i}"] for i in range(int(z["num_targets"]))]
      return Inputs(z["coords"], z["feats"], tuple(int(v) for v in z["spatial_shape"]), int(z["batch_size"]),
                    targets)
  inp = _generate_inputs(w, seed)
  os.makedirs(cache_dir, exist_ok=True)
  partial = f"{path}.{os.getpid()}.npz"  # written whole, then renamed: a concurrent reader never sees half a file
  np.savez(partial, coords=inp.coords, feats=inp.feats, spatial_shape=np.asarray(inp.spatial_shape),
           batch_size=inp.batch_size, num_targets=len(inp.targets),
           **{f"target{i}": t for i, t in enumerate(inp.targets)})
  os.replace(partial, path)
  return inp


def _generate_inputs(w: Workload, seed: int) -> Inputs:
  if w.network == "decoder":
    return decoder_inputs(w, seed)
  return lidar_inputs(dataclasses.replace(w, network="lidar"), seed)


@functools.lru_cache(maxsize=1)
def _inputs_version() -> str:
  """A digest of the code that draws the inputs (jsparse.shapes and the two input functions here, not the rest of
  this file, so the trees of an A/B share a cache), so that inputs drawn by other code are never read."""
  digest = hashlib.sha1()
  with open(jsparse.shapes.__file__, "rb") as f:
    digest.update(f.read())
  for fn in (lidar_inputs, decoder_inputs):
    digest.update(inspect.getsource(fn).encode())
  return digest.hexdigest()[:12]


# ---- per-op attribution ----------------------------------------------------------------------------------

def scoped(kind: str, enter: Callable[[str], Any]):
  """Runs a backend method inside `enter("op:<kind>")` (a jax.named_scope or a torch record_function), so a
  profile can attribute every kernel, forward and backward, to the network op that issued it."""

  def wrap(method):
    def run(self, *a, **kw):
      with enter(f"op:{kind}"):
        return method(self, *a, **kw)
    run.__name__ = method.__name__
    return run
  return wrap


def _jax_scope(name):
  return jax.named_scope(name)


def _torch_scope(name):
  import torch
  return torch.profiler.record_function(name)


# ---- jsparse backend ----------------------------------------------------------------------------------


class JaxBackend:
  """jsparse's functional ops. params: name -> array (already in the compute dtype); capacities: the static
  output rows of every site-creating op, by layer name (recorded by a planning run, `plan_capacities`)."""

  def __init__(self, params: Params | dict, dtype, train: bool, capacities: dict | None = None,
               targets=None, implementation=None, precision=None, buckets: int | None = None):
    self.params, self.dtype, self.train, self.precision = params, dtype, train, precision
    self.buckets = buckets
    self.capacities = capacities if capacities is not None else {}
    self.recording = capacities is None
    self.targets = targets or []
    self.impl = implementation

  def _p(self, name, shape, kind="conv"):
    if isinstance(self.params, Params):
      return jnp.asarray(self.params.get(name, shape, kind), self.dtype)
    return self.params[name].astype(self.dtype)

  def _cap(self, name):
    return None if self.recording else self.capacities[name]

  def _record(self, name, y):
    if self.recording:
      self.capacities[name] = capacity_for(int(y.num), self.buckets)

  def channels(self, x):
    return x.num_channels

  @scoped("subm", _jax_scope)
  def subm(self, x, name, cout, k=3, key=None):
    w = self._p(name, (cout, k, k, k, x.num_channels))
    return jsparse.submconv3d(x, w, None, weight_layout="ODHWI", implementation=self.impl, precision=self.precision)

  @scoped("down", _jax_scope)
  def down(self, x, name, cout, k, s, pad, key=None):
    ks = (k,) * 3 if isinstance(k, int) else tuple(k)
    w = self._p(name, (cout, *ks, x.num_channels))
    y = jsparse.sparse_conv3d(x, w, None, stride=s, padding=pad, out_capacity=self._cap(name),
                              weight_layout="ODHWI", implementation=self.impl, precision=self.precision)
    self._record(name, y)
    return y

  @scoped("up", _jax_scope)
  def up(self, y, like, name, cout, k, s, pad, key=None):
    ks = (k,) * 3 if isinstance(k, int) else tuple(k)
    w = self._p(name, (cout, *ks, y.num_channels))
    return jsparse.sparse_inverse_conv3d(y, w, None, like=like, stride=s, padding=pad, weight_layout="ODHWI",
                                         implementation=self.impl, precision=self.precision)

  @scoped("upsample", _jax_scope)
  def upsample(self, x, name, cout, level, key=None):
    """All 8 children, kept where the target occupancy of `level` has them."""
    w = self._p(name, (cout, 2, 2, 2, x.num_channels))
    target = self.targets[level - 1]
    off = jnp.asarray(np.array(np.unravel_index(np.arange(8), (2, 2, 2))).T, jnp.int32)  # [8, 3], C order
    child = x.coords[:, None, 1:] * 2 + off[None]
    sx, sy, sz = (2 * n for n in x.spatial_shape)
    keys = ((x.coords[:, None, 0] * sx + child[..., 0]) * sy + child[..., 1]) * sz + child[..., 2]
    pos = jnp.clip(jnp.searchsorted(target, keys), 0, target.shape[0] - 1)
    mask = (target[pos] == keys) & x.valid_mask()[:, None]
    y = jsparse.sparse_conv_transpose3d(x, w, None, stride=2, mask=mask, out_capacity=self._cap(name),
                                        weight_layout="ODHWI", implementation=self.impl, precision=self.precision)
    self._record(name, y)
    return y

  @scoped("maxpool", _jax_scope)
  def maxpool(self, x, name, k, s, key=None):
    y = jsparse.sparse_max_pool3d(x, k, s, out_capacity=self._cap(name), implementation=self.impl)
    self._record(name, y)
    return y

  @scoped("bn", _jax_scope)
  def bn(self, x, name):
    c = x.num_channels
    scale, shift = self._p(f"{name}/scale", (c,), "scale"), self._p(f"{name}/bias", (c,), "shift")
    if self.train:
      return norm.batch_norm(x, scale, shift)
    return norm.batch_norm(x, scale, shift, mean=jnp.zeros(c, jnp.float32), var=jnp.ones(c, jnp.float32))

  @scoped("bn_relu", _jax_scope)
  def bn_relu(self, x, name):
    """Batch norm and ReLU in one pass (norm.batch_norm's activation)."""
    c = x.num_channels
    scale, shift = self._p(f"{name}/scale", (c,), "scale"), self._p(f"{name}/bias", (c,), "shift")
    if self.train:
      return norm.batch_norm(x, scale, shift, activation=jax.nn.relu)
    return norm.batch_norm(x, scale, shift, mean=jnp.zeros(c, jnp.float32), var=jnp.ones(c, jnp.float32),
                           activation=jax.nn.relu)

  @scoped("gn", _jax_scope)
  def gn(self, x, name, groups=32):
    c = x.num_channels
    scale, shift = self._p(f"{name}/scale", (c,), "scale"), self._p(f"{name}/bias", (c,), "shift")
    return norm.group_norm(x, groups, scale, shift, epsilon=1e-5)

  @scoped("gn_silu", _jax_scope)
  def gn_silu(self, x, name, groups=32):
    """Group norm and SiLU in one pass (norm.group_norm's activation)."""
    c = x.num_channels
    scale, shift = self._p(f"{name}/scale", (c,), "scale"), self._p(f"{name}/bias", (c,), "shift")
    return norm.group_norm(x, groups, scale, shift, epsilon=1e-5, activation=jax.nn.silu)

  @scoped("relu", _jax_scope)
  def relu(self, x):
    return norm.activation(x, jax.nn.relu)

  @scoped("silu", _jax_scope)
  def silu(self, x):
    return norm.activation(x, jax.nn.silu)

  @scoped("add", _jax_scope)
  def add(self, a, b):
    return a.replace(feats=a.feats + b.feats)

  @scoped("concat", _jax_scope)
  def concat(self, a, b):
    return jsparse.concat(a, b)

  @scoped("linear", _jax_scope)
  def linear(self, x, name, cout):
    w = self._p(name, (cout, x.num_channels))
    prec = jax.lax.Precision.HIGHEST if self.precision == "highest" else None
    y = jnp.dot(x.feats, w.T, precision=prec)  # float32 accumulation inside, written in x's dtype
    return x.replace(feats=y)  # padding rows: 0 @ w = 0


def capacity_for(rows: int, buckets: int | None = None) -> int:
  """The static rows jsparse holds for `rows` sites: `jsparse.round_capacity`'s bucket, with `buckets` per
  power of two (None: the library's default), as a training loop over scans of varying size would."""
  return jsparse.round_capacity(rows) if buckets is None else jsparse.round_capacity(rows, buckets)


def jax_input(inp: Inputs, dtype, buckets: int | None = None) -> jsparse.SparseTensor:
  return jsparse.SparseTensor.from_coords(inp.coords, jnp.asarray(inp.feats, dtype), inp.spatial_shape,
                                          inp.batch_size, capacity=capacity_for(len(inp.coords), buckets))


def plan_capacities(network: Callable, inp: Inputs, params: Params, dtype, implementation=None,
                    precision=None, buckets: int | None = None) -> dict:
  """One eager forward that draws every parameter and records each site-creating op's output rows (bucketed
  by `capacity_for`)."""
  backend = JaxBackend(params, dtype, train=False, capacities=None,
                       targets=[jnp.asarray(t, jnp.int32) for t in inp.targets], implementation=implementation,
                       precision=precision, buckets=buckets)
  network(backend, jax_input(inp, dtype, buckets))
  return backend.capacities


def jax_functions(network: Callable, inp: Inputs, capacities: dict, dtype, implementation=None, precision=None):
  """(inference(params, x), train(params, x), probe): jitted-ready functions over a params dict."""
  targets = [jnp.asarray(t, jnp.int32) for t in inp.targets]

  def forward(params, x, train):
    b = JaxBackend(params, dtype, train, capacities, targets, implementation, precision)
    return network(b, x)

  def inference(params, x):
    y = forward(params, x, False)
    return y.coords, y.feats, y.num

  def loss(params, feats, x):
    y = forward(params, x.replace(feats=feats), True)
    valid = y.valid_mask()[:, None]
    return jnp.sum(jnp.where(valid, y.feats.astype(jnp.float32) * probe(jnp, y.coords, y.num_channels), 0))

  def train(params, x):
    value, grads = jax.value_and_grad(loss, argnums=(0, 1))(params, x.feats, x)
    return value, grads

  return inference, train


# ---- spconv backend -----------------------------------------------------------------------------------


def indices_tensor(torch, coords):
  """spconv's indices: int32, on the GPU, row-major. spconv's kernels read indices as a row-major [N, 4] buffer
  whatever the tensor's strides (spconv 2.3.8 does not check), and torch.from_numpy keeps a numpy array's layout:
  np.argwhere's output is column-major, and such coordinates (the decoder's) made spconv's SubMConv3d read other
  sites' features (relative error 0.59 against jsparse, 2026-11-24) and its SparseConvTranspose3d return 8 rows."""
  if isinstance(coords, np.ndarray):
    coords = torch.from_numpy(np.ascontiguousarray(coords, np.int32))
  return coords.cuda().int().contiguous()


class TorchBackend:
  """spconv's modules, created on first use with the shared parameters and reused on later calls."""

  def __init__(self, spconv, torch, params: Params, dtype, targets=None):
    self.spconv, self.torch, self.params, self.dtype = spconv, torch, params, dtype
    self.modules: dict[str, Any] = {}
    self.train = False
    self.targets = [torch.from_numpy(t).cuda() for t in (targets or [])]
    self.trace: list = []  # (layer, output rows) of the last call, for error reports

  def _tensor(self, a):
    return self.torch.nn.Parameter(self.torch.from_numpy(np.ascontiguousarray(a)).cuda().to(self.dtype))

  def _module(self, name, make, weight_shape=None):
    self.trace.append(name)
    if name not in self.modules:
      m = make()
      if weight_shape is not None:
        have = tuple(m.weight.shape)
        if have != tuple(weight_shape):
          raise ValueError(f"spconv {name}: weight {have}, expected {tuple(weight_shape)}")
        m.weight = self._tensor(self.params.get(name, weight_shape))
      self.modules[name] = m.cuda()
    m = self.modules[name]
    m.train(self.train)
    return m

  def channels(self, x):
    return x.features.shape[1]

  @scoped("subm", _torch_scope)
  def subm(self, x, name, cout, k=3, key=None):
    cin = self.channels(x)
    m = self._module(name, lambda: self.spconv.SubMConv3d(cin, cout, k, bias=False, indice_key=key),
                     (cout, k, k, k, cin))
    return m(x)

  @scoped("down", _torch_scope)
  def down(self, x, name, cout, k, s, pad, key=None):
    cin = self.channels(x)
    ks = (k,) * 3 if isinstance(k, int) else tuple(k)
    m = self._module(name, lambda: self.spconv.SparseConv3d(cin, cout, ks, s, pad, bias=False, indice_key=key),
                     (cout, *ks, cin))
    return m(x)

  @scoped("up", _torch_scope)
  def up(self, y, like, name, cout, k, s, pad, key=None):
    cin = self.channels(y)
    ks = (k,) * 3 if isinstance(k, int) else tuple(k)
    m = self._module(name, lambda: self.spconv.SparseInverseConv3d(cin, cout, ks, indice_key=key, bias=False),
                     (cout, *ks, cin))
    return m(y)

  @scoped("upsample", _torch_scope)
  def upsample(self, x, name, cout, level, key=None):
    """spconv's SparseConvTranspose3d(2, 2): child 2c + t of site c gets x[c] @ W[:, t] (spconv's transposed
    pairs are out = in * stride + t, with the KRSC weight (Cout, 2, 2, 2, Cin): jsparse's ODHWI convention, no
    flip). All 8 children are computed (spconv has no masked transposed conv), then those outside the target
    occupancy are dropped. Its earlier "8 output rows for 3530 sites" came from column-major indices (spconv
    reads indices as row-major [N, 4]; see `indices_tensor`), not from the op."""
    torch = self.torch
    cin = self.channels(x)
    m = self._module(name, lambda: self.spconv.SparseConvTranspose3d(cin, cout, 2, 2, bias=False),
                     (cout, 2, 2, 2, cin))
    y = m(x)
    idx = y.indices.long()
    sx, sy, sz = y.spatial_shape
    keys = ((idx[:, 0] * sx + idx[:, 1]) * sy + idx[:, 2]) * sz + idx[:, 3]
    keep = torch.isin(keys, self.targets[level - 1])
    out = self.spconv.SparseConvTensor(y.features[keep], indices_tensor(torch, y.indices[keep]),
                                       list(y.spatial_shape), y.batch_size)
    self.trace.append(f"{name}: {out.features.shape[0]} kept of {keys.numel()} children")
    return out

  @scoped("maxpool", _torch_scope)
  def maxpool(self, x, name, k, s, key=None):
    return self._module(name, lambda: self.spconv.SparseMaxPool3d(k, s, indice_key=key))(x)

  def _norm_params(self, m, name, c):
    m.weight = self._tensor(self.params.get(f"{name}/scale", (c,), "scale"))
    m.bias = self._tensor(self.params.get(f"{name}/bias", (c,), "shift"))
    return m

  @scoped("bn", _torch_scope)
  def bn(self, x, name):
    c = self.channels(x)
    m = self._module(name, lambda: self._norm_params(self.torch.nn.BatchNorm1d(c, eps=1e-5).to(self.dtype), name, c))
    return x.replace_feature(m(x.features))

  @scoped("bn_relu", _torch_scope)
  def bn_relu(self, x, name):
    return self.relu(self.bn(x, name))

  @scoped("gn_silu", _torch_scope)
  def gn_silu(self, x, name):
    return self.silu(self.gn(x, name))

  @scoped("gn", _torch_scope)
  def gn(self, x, name, groups=32):
    """Per batch item, torch's GroupNorm over that item's rows (as TRELLIS's sparse GroupNorm does)."""
    torch = self.torch
    c = self.channels(x)
    m = self._module(name, lambda: self._norm_params(torch.nn.GroupNorm(groups, c, eps=1e-5).to(self.dtype), name,
                                                     c))
    out = torch.empty_like(x.features)
    for item in range(x.batch_size):
      rows = x.indices[:, 0] == item
      f = x.features[rows]
      out[rows] = m(f.t().unsqueeze(0)).squeeze(0).t()
    return x.replace_feature(out)

  @scoped("relu", _torch_scope)
  def relu(self, x):
    return x.replace_feature(self.torch.relu(x.features))

  @scoped("silu", _torch_scope)
  def silu(self, x):
    return x.replace_feature(self.torch.nn.functional.silu(x.features))

  @scoped("add", _torch_scope)
  def add(self, a, b):
    return a.replace_feature(a.features + b.features)

  @scoped("concat", _torch_scope)
  def concat(self, a, b):
    return a.replace_feature(self.torch.cat([a.features, b.features], dim=1))

  @scoped("linear", _torch_scope)
  def linear(self, x, name, cout):
    cin = self.channels(x)
    if name not in self.modules:
      lin = self.torch.nn.Linear(cin, cout, bias=False)
      lin.weight = self._tensor(self.params.get(name, (cout, cin)))
      self.modules[name] = lin.cuda()
    return x.replace_feature(self.modules[name](x.features))


def import_spconv(which: str = "spconv"):
  """(spconv.pytorch-like module, torch, spconv constants module or None), or raises ImportError."""
  import torch
  if not torch.cuda.is_available():
    raise ImportError("torch sees no CUDA device")
  if which == "spconv":
    import spconv.constants as constants
    import spconv.pytorch as sp
    return sp, torch, constants
  import spconv_triton.pytorch as sp
  return sp, torch, None


# ---- timing, memory, cross-check --------------------------------------------------------------------


def sorted_by_site(coords: np.ndarray, feats: np.ndarray):
  """Rows ordered by (batch, x, y, z). Lexicographic on the coordinates themselves: a linear key needs the
  output's grid, and the input grid a caller has at hand is not it for up-sampling networks (the decoder's output
  grid is 4x its input's; keys over the input grid collided and the features were compared between other sites)."""
  c = np.asarray(coords, np.int64)
  order = np.lexsort(c.T[::-1])
  return c[order], np.asarray(feats)[order]


def cross_check(a, b) -> dict:
  """a, b: (coords [N, 4], feats [N, C]) in any row order. Same site set, and the relative error."""
  ca, fa = sorted_by_site(*a)
  cb, fb = sorted_by_site(*b)
  if ca.shape != cb.shape or not np.array_equal(ca, cb):
    return {"same_sites": False, "rows": [int(ca.shape[0]), int(cb.shape[0])]}
  if len(ca) > 1 and np.any(np.all(ca[1:] == ca[:-1], axis=1)):  # rows of one site could pair up either way
    return {"same_sites": False, "rows": int(ca.shape[0]), "duplicate_sites": True}
  return {"same_sites": True, "rows": int(ca.shape[0]), "rel_err": suite.rel_err(fa, fb)}


def bench_jsparse(w: Workload, inp: Inputs, dtype_name: str, args) -> dict:
  network = NETWORKS[w.network]
  dtype, precision = DTYPES[dtype_name]
  params = Params(args.seed)
  t0 = time.perf_counter()
  caps = plan_capacities(network, inp, params, dtype, args.impl, precision, args.buckets_per_octave)
  plan_s = time.perf_counter() - t0
  p = {k: jnp.asarray(v) for k, v in params.arrays.items()}
  x = jax_input(inp, dtype, args.buckets_per_octave)
  inference, train = jax_functions(network, inp, caps, dtype, args.impl, precision)
  out = {"plan_s": plan_s, "params": int(sum(v.size for v in params.arrays.values())),
         "input_rows_held": int(x.capacity), "buckets_per_octave": args.buckets_per_octave}
  for mode, fn in (("inference", inference), ("train", train)):
    if mode not in args.modes:
      continue
    res = {}
    try:
      t0 = time.perf_counter()
      compiled = jax.jit(fn).lower(p, x).compile()
      res["compile_s"] = time.perf_counter() - t0
      m = compiled.memory_analysis()
      res["peak_bytes"] = int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                              - m.alias_size_in_bytes)
      res.update(suite.time_calls(lambda: compiled(p, x), jax.block_until_ready, args.warmup, args.repeats))
      if args.profile:  # the tables show the training step; the JSON keeps both
        res["profile"] = guarded_profile(lambda: profile_jax(compiled, (p, x), 3, tempfile.mkdtemp()))
      result = compiled(p, x)
      if mode == "inference":
        coords, feats, num = (np.asarray(a) for a in result)
        res["check"] = (coords[: int(num)], feats[: int(num)].astype(np.float32))
      else:
        value, (gp, gx) = result
        first = first_layer(gp)
        res["check"] = {"loss": float(value), "input_grad": np.asarray(gx[: len(inp.coords)], np.float32),
                        "first_weight_grad": np.asarray(gp[first], np.float32), "first": first}
      res["ok"] = True
    except Exception as e:  # one failing cell must not stop the run
      res = {"ok": False, "error": suite.short_error(e)}
    out[mode] = res
  return out


def bench_spconv(lib, w: Workload, inp: Inputs, dtype_name: str, args) -> dict:
  sp, torch, constants = lib
  tdtype = {"fp16": torch.float16, "tf32": torch.float32, "fp32": torch.float32}[dtype_name]
  if constants is not None:
    constants.SPCONV_ALLOW_TF32 = dtype_name == "tf32"
  torch.backends.cuda.matmul.allow_tf32 = dtype_name == "tf32"
  torch.backends.cudnn.allow_tf32 = dtype_name == "tf32"
  network = NETWORKS[w.network]
  params = Params(args.seed)
  backend = TorchBackend(sp, torch, params, tdtype, inp.targets)
  coords = indices_tensor(torch, inp.coords)
  feats = torch.from_numpy(inp.feats).cuda().to(tdtype)

  def forward(f):
    backend.trace = []
    x = sp.SparseConvTensor(f, coords, list(inp.spatial_shape), inp.batch_size)
    return network(backend, x)

  def inference():
    with torch.no_grad():
      return forward(feats)

  def train():
    f = feats.detach().requires_grad_(True)
    y = forward(f)
    loss = (y.features.float() * probe(torch, y.indices, y.features.shape[1])).sum()
    params_ = [q for m in backend.modules.values() for q in m.parameters()]
    for q in params_:
      q.grad = None
    loss.backward()
    return loss, f

  out = {}
  for mode in args.modes:
    res = {}
    try:
      backend.train = mode == "train"
      call = inference if mode == "inference" else train
      call()  # creates the modules
      torch.cuda.synchronize()
      res.update(suite.time_calls(call, lambda _: torch.cuda.synchronize(), args.warmup, args.repeats))
      torch.cuda.synchronize()
      torch.cuda.reset_peak_memory_stats()
      result = call()
      torch.cuda.synchronize()
      res["peak_bytes"] = int(torch.cuda.max_memory_allocated())
      if args.profile and args.skip_jsparse and mode == "train":
        res["profile"] = guarded_profile(lambda: profile_torch(torch, call, 3))
      if mode == "inference":
        res["check"] = (result.indices.cpu().numpy(), result.features.float().cpu().numpy())
      else:
        loss, f = result
        first = first_layer(backend.modules)
        res["check"] = {"loss": float(loss), "input_grad": f.grad.float().cpu().numpy(),
                        "first_weight_grad": backend.modules[first].weight.grad.float().cpu().numpy(),
                        "first": first}
        del loss, f
      # The output holds every layer's index pairs (its indice_dict): kept alive, they would count in the next
      # mode's peak memory.
      del result
      res["ok"] = True
    except Exception as e:
      res = {"ok": False, "error": suite.short_error(e), "error_text": str(e)[:3000],
             "last_layers": backend.trace[-6:]}
    out[mode] = res
  return out


def first_layer(names) -> str:
  """The first weight of each network, whose gradient (it depends on the whole backward) is cross-checked."""
  return next(n for n in ("conv_input", "stem_a", "in") if n in names)


def compare(js: dict, ref: dict, mode: str) -> dict:
  a, b = js.get("check"), ref.get("check")
  if a is None or b is None:
    return {}
  if mode == "inference":
    return cross_check(a, b)
  return {"loss_rel_err": abs(a["loss"] - b["loss"]) / max(abs(b["loss"]), 1e-30),
          "input_grad_rel_err": suite.rel_err(a["input_grad"], b["input_grad"]),
          "first_weight_grad_rel_err": suite.rel_err(a["first_weight_grad"], b["first_weight_grad"])}


# ---- per-op profiles of a training step --------------------------------------------------------------

CONV_KINDS = ("subm", "down", "up", "upsample")
GEMM_NAME_PARTS = ("gather_gemm", "weight_grad", "gemm", "cutlass", "xmma", "cublas", "wgmma", "sm90_", "sm80_",
                   "cumm::conv")
# torch's autograd nodes of the backward pass, by the network op they belong to (the forward's record_function
# ranges do not cover the backward).
TORCH_BACKWARD_KINDS = (("batchnorm", "bn"), ("groupnorm", "gn"), ("relu", "relu"), ("threshold", "relu"),
                        ("silu", "silu"), ("maxpool", "maxpool"), ("cat", "concat"), ("addbackward", "add"),
                        ("mmbackward", "linear"), ("conv", "conv"), ("implicitgemm", "conv"), ("sparse", "conv"))


MAP_KERNEL_PREFIXES = ("hash_", "unique_", "occupancy_")  # jsparse's Pallas map kernels (neighbours, output sites)
PLAN_KERNEL_PREFIXES = ("masked_plan", "pair_list")  # jsparse's Pallas plan kernels (they carry no op metadata)


# XLA kernels that carry no op metadata (made by passes after lowering): cumulative sums become reduce_window
# trees, sorts run as cub radix sorts. In these networks only the map and plan builders scan or sort.
UNNAMED_MAP_KERNELS = ("reduce_window", "sort", "radix")


# Normalisation and its activation are one row: jsparse runs them as one op, torch as two.
FUSED_ROWS = {"bn": "bn + relu", "relu": "bn + relu", "bn_relu": "bn + relu", "gn": "gn + silu",
              "silu": "gn + silu", "gn_silu": "gn + silu"}


def op_group(kind: str, kernel: str) -> str:
  """The profile row of a kernel: convolution GEMMs, the map builders (jsparse's hash-table kernels and its
  scans / sorts, whichever op built the map), the rest of the convolutions (plans, map transposes,
  indexing), and every other op by kind."""
  low = kernel.lower()
  gemm = any(part in low for part in GEMM_NAME_PARTS)
  if kernel.startswith(MAP_KERNEL_PREFIXES):
    return "maps: Pallas map kernels"
  if kernel.startswith(PLAN_KERNEL_PREFIXES):
    return "conv: other"
  if "batch_norm" in low:  # torch's norm kernels, wherever the network's op ranges put them
    return FUSED_ROWS["bn"]
  if kind in CONV_KINDS + ("conv",) or (kind == "other" and gemm):
    return "conv: GEMM" if gemm else "conv: other"
  if kind == "other" and any(part in low for part in UNNAMED_MAP_KERNELS):
    return "maps: scans and sorts"
  return FUSED_ROWS.get(kind, kind)


def _as_kernel_names(found) -> dict:
  """{name: value} of (HLO instruction name, value) pairs, each name also with '.' and '-' as '_': a fusion's
  kernel is named that way (input_fusion.14 runs as input_fusion_14)."""
  out = dict(found)
  out.update({k.replace(".", "_").replace("-", "_"): v for k, v in found})
  return out


def hlo_op_names(hlo_text: str) -> dict:
  """HLO instruction name -> its metadata op_name (which carries the jax.named_scope path). Keys as
  `_as_kernel_names`."""
  return _as_kernel_names(re.findall(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name="([^"]*)"', hlo_text, re.M))


def hlo_instructions(hlo_text: str) -> dict:
  """HLO instruction name -> (result shape text, [operand names]). Keys as `_as_kernel_names`."""
  found = re.findall(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\(.*?\)|\S+) [\w\-]+\(([^)]*)\)", hlo_text, re.M)
  return _as_kernel_names([(name, (shape, re.findall(r"%([\w.\-]+)", args))) for name, shape, args in found])


_HLO_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                    "s64": 8, "u64": 8, "f64": 8}


def _shape_bytes(shape_text: str) -> int:
  """Bytes of an HLO shape such as 'f16[1000,64]{1,0}' or a tuple '(s32[8]{0}, u8[99]{0})'."""
  total = 0
  for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape_text):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _HLO_DTYPE_BYTES.get(dtype, 0)
  return total


def hlo_bytes(hlo_text: str) -> dict:
  """HLO instruction name -> bytes of its operands and result: what a kernel that reads every operand once and
  writes its result moves (XLA's own 'bytes accessed' model; a gather reads less of its operand than this).
  Keys as hlo_op_names'."""
  instructions = hlo_instructions(hlo_text)
  result = {name: _shape_bytes(shape) for name, (shape, _) in instructions.items()}
  return {name: result[name] + sum(result.get(o, 0) for o in operands)
          for name, (_, operands) in instructions.items()}


def train_step_hlo(network: str, size: str, dtype) -> str:
  """The optimised HLO text of a network's jitted training step, built as the benchmark builds it (its inputs,
  parameters and planned capacities), compiled for the default backend without running it."""
  net = NETWORKS[network]
  inp = make_inputs(workload(network, size))
  params = Params(0)
  caps = plan_capacities(net, inp, params, dtype)
  p = {k: jnp.asarray(v) for k, v in params.arrays.items()}
  _, train = jax_functions(net, inp, caps, dtype)
  return jax.jit(train).lower(p, jax_input(inp, dtype)).compile().as_text()


def hlo_computation(hlo_text: str, name: str) -> str | None:
  """The body of computation `name` in an HLO module's text (between its header and its closing brace)."""
  m = re.search(rf"^(?:ENTRY )?%{re.escape(name)} [^\n]*\{{\n(.*?)^\}}", hlo_text, re.M | re.S)
  return m.group(1) if m else None


def forward_masks(hlo_text: str) -> list[str]:
  """Fusions of a compiled training step's forward pass (op names without 'transpose(') that output a 2-D pred
  array computed from floating-point values: a mask of activations that XLA computed for the backward ahead of
  time and keeps alive until then. A mask of integers alone (a neighbour plan's empty slots, [blocks, K]) is
  structure computed once per map, not a [rows, C] copy of the activations, and is left out."""
  found = re.findall(r'^\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\S+) fusion\(.*?calls=%([\w.\-]+).*?op_name="([^"]*)"',
                     hlo_text, re.M)
  masks = []
  for name, shape, called, op in found:
    if not re.search(r"pred\[\d+,\d+\]", shape) or "transpose(" in op:
      continue
    body = hlo_computation(hlo_text, called)
    if body is None or re.search(r"\b(?:bf16|f16|f32|f64)\[", body):
      masks.append(name)
  return masks


def _scope_kind(op_name: str) -> str:
  m = re.search(r"op:(\w+)", op_name or "")
  return m.group(1) if m else "other"


def _trace_events(trace_dir: str):
  paths = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
  if not paths:
    raise FileNotFoundError(f"no perfetto trace under {trace_dir}")
  with gzip.open(max(paths, key=os.path.getmtime)) as f:
    data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


def device_kernel_events(events) -> tuple[list, list]:
  """Kernel events on the GPU's stream tracks (not the derived per-op tracks, which would count twice), and
  the thread names seen (for the log)."""
  procs = {e["pid"]: e["args"].get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e["tid"]): e["args"].get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  gpu = {pid for pid, name in procs.items() if "GPU" in name or "gpu" in name}
  names = sorted({threads.get(k, "") for k in threads if k[0] in gpu})
  stream = {k for k, name in threads.items() if k[0] in gpu and name.lower().startswith("stream")}
  kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu
             and (not stream or (e["pid"], e["tid"]) in stream)]
  return kernels, names


def guarded_profile(fn) -> dict:
  try:
    return fn()
  except Exception as e:  # a profile is extra information: never lose the timings over it
    return {"error": suite.short_error(e)}


def trace_kernels(compiled, call_args, calls: int, trace_dir: str, sync_each: bool = False) -> tuple[list, list]:
  """(kernel events, GPU thread names) of `calls` calls of a compiled function after one untimed call, traced
  into trace_dir. sync_each: wait for each call before the next, so that no two calls' kernels overlap (for
  matching launches call by call; without it the calls queue back to back, as in training)."""
  jax.block_until_ready(compiled(*call_args))
  jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
  for _ in range(calls):
    out = compiled(*call_args)
    if sync_each:
      jax.block_until_ready(out)
  jax.block_until_ready(out)
  jax.profiler.stop_trace()
  return device_kernel_events(_trace_events(trace_dir))


def profile_jax(compiled, call_args, calls: int, trace_dir: str) -> dict:
  """ms per call by profile row, from a trace of `calls` calls of a compiled function."""
  kernels, thread_names = trace_kernels(compiled, call_args, calls, trace_dir)
  text = compiled.as_text()
  meta, sizes = hlo_op_names(text), hlo_bytes(text)
  rows: dict[str, float] = {}
  row_bytes: dict[str, float] = {}
  by_name: dict[str, float] = {}
  name_bytes: dict[str, float] = {}
  for e in kernels:
    args = e.get("args", {})
    # Inside a command buffer (CUDA graph) hlo_op names the buffer, so the kernel's own name comes first.
    op_name = meta.get(e["name"], "") or meta.get(args.get("hlo_op", ""), "")
    group = op_group(_scope_kind(op_name), e["name"])
    rows[group] = rows.get(group, 0.0) + e.get("dur", 0.0) / 1e3 / calls
    size = sizes.get(e["name"]) or sizes.get(args.get("hlo_op", ""), 0)
    row_bytes[group] = row_bytes.get(group, 0.0) + size / calls
    key = f"{group} :: {e['name'][:60]} :: {op_name[-90:]}"
    by_name[key] = by_name.get(key, 0.0) + e.get("dur", 0.0) / 1e3 / calls
    name_bytes[key] = name_bytes.get(key, 0.0) + size / calls
  unattributed = sorted({e["name"] for e in kernels if not meta.get(e["name"]) and not e["name"].startswith(
      MAP_KERNEL_PREFIXES) and not any(p in e["name"] for p in GEMM_NAME_PARTS)})
  top = dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:300])
  # A kernel's GB/s tells a fusion that moves too many bytes (f32 intermediates) from one that runs slowly.
  top_gbps = {k: name_bytes[k] / (ms * 1e-3) / 1e9 for k, ms in top.items() if ms > 0}
  # GB/s by row: bytes its kernels' instructions read and write (hlo_bytes) over their time.
  gbps = {g: row_bytes.get(g, 0.0) / (ms * 1e-3) / 1e9 for g, ms in rows.items() if ms > 0}
  # First kernel start to last kernel end, per call: what the kernel total leaves of it is launch gaps and idle time.
  span = 0.0
  if kernels:
    span = (max(e["ts"] + e.get("dur", 0.0) for e in kernels) - min(e["ts"] for e in kernels)) / 1e3 / calls
  return {"ms": rows, "gbps": gbps, "kernels": len(kernels) // calls, "span_ms": span, "threads": thread_names,
          "unattributed": unattributed[:30], "top_kernels": top, "top_kernel_gbps": top_gbps}


def _torch_kind(event) -> str:
  """The network op a torch CPU event (and so the kernels it launched) belongs to."""
  e = event
  while e is not None:
    if e.name.startswith("op:"):
      return e.name[3:]
    low = e.name.lower()
    if "backward" in low or "evaluate_function" in low:
      for part, kind in TORCH_BACKWARD_KINDS:
        if part in low:
          return kind
    e = e.cpu_parent
  return "other"


# Device time no torch op launched: spconv launches its index generation (hash tables, pair and mask kernels,
# its mask sorts) from its own C++, so torch attaches those kernels to no op. They are found by name.
SPCONV_INDEX_KERNEL_PARTS = ("ops3d::", "tv::hash::", "cudakers::", "DeviceMergeSort", "DeviceRadixSort")
SPCONV_INDEX_ROW = "maps: spconv index generation"
NO_TORCH_OP = "outside torch ops"


def torch_device_kernels(events, cuda) -> list:
  """The device events (kernels, memsets, memcpys) among a torch.profiler run's events (`prof.events()`), in
  launch order, as FunctionEvents with .name and .time_range: also those no torch op launched (attached to no
  CPU event's .kernels). The GPU side of record_function ranges (user annotations, which span kernels rather
  than run) is left out. cuda: torch.autograd.DeviceType.CUDA."""
  return sorted((ev for ev in events if ev.device_type == cuda and not getattr(ev, "is_user_annotation", False)
                 and not ev.name.startswith("op:")), key=lambda ev: ev.time_range.start)


def torch_profile_rows(events, cuda, calls: int) -> dict:
  """ms per call by profile row, from a torch.profiler run of `calls` calls: each kernel a torch op launched in
  that op's row (`_torch_kind`), each one launched outside any op by its name (`SPCONV_INDEX_KERNEL_PARTS`)."""
  rows: dict[str, float] = {}
  by_name: dict[str, float] = {}
  attached: dict[str, float] = {}  # us of each kernel name that CPU events account for, not yet matched
  count = 0

  def add(group, name, us):
    rows[group] = rows.get(group, 0.0) + us / 1e3 / calls
    key = f"{group} :: {name[:90]}"
    by_name[key] = by_name.get(key, 0.0) + us / 1e3 / calls

  for ev in events:
    for k in getattr(ev, "kernels", []):
      add(op_group(_torch_kind(ev), k.name), k.name, k.duration)
      attached[k.name] = attached.get(k.name, 0.0) + k.duration
      count += 1
  for ev in torch_device_kernels(events, cuda):
    us = ev.time_range.elapsed_us()
    taken = min(us, attached.get(ev.name, 0.0))
    attached[ev.name] = attached.get(ev.name, 0.0) - taken
    if us - taken > 0:
      add(SPCONV_INDEX_ROW if any(part in ev.name for part in SPCONV_INDEX_KERNEL_PARTS) else NO_TORCH_OP,
          ev.name, us - taken)
      count += 1
  # As many as profile_jax keeps, so both sides' small kernels (map building, plans) can be compared.
  top = dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:300])
  return {"ms": rows, "kernels": count // calls, "top_kernels": top}


def profile_torch(torch, call, calls: int) -> dict:
  call()
  torch.cuda.synchronize()
  acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
  with torch.profiler.profile(activities=acts) as prof:
    for _ in range(calls):
      call()
    torch.cuda.synchronize()
  return torch_profile_rows(prof.events(), torch.autograd.DeviceType.CUDA, calls)


# ---- the run ------------------------------------------------------------------------------------------


def run(args) -> dict:
  libs = {}
  for name in args.anchors:
    try:
      lib = import_spconv(name)
      if name == "spconv-triton" and args.tune_shard is not None:
        triton_tuning_shards.share_triton_autotuning(*args.tune_shard)
      libs[name] = lib
    except Exception as e:
      print(f"{name} not available: {suite.short_error(e, 160)}", flush=True)
  results = []
  jobs = [(net, size) for net in args.networks for size in args.sizes]
  for net, size in progress_bar(jobs, "networks", unit="network"):
    w = workload(net, size)
    t0 = time.perf_counter()
    inp = make_inputs(w, args.seed, args.inputs_cache)
    gen_s = time.perf_counter() - t0
    print(f"== {w.name}: {len(inp.coords)} input sites, batch {w.batch_size}, grid {inp.spatial_shape} "
          f"(inputs {gen_s:.1f} s)", flush=True)
    for dname in args.dtypes:
      rec = {"network": net, "size": size, "batch_size": w.batch_size, "sites": int(len(inp.coords)),
             "spatial_shape": list(inp.spatial_shape), "dtype": dname, "jsparse": {}, "anchors": {}}
      try:
        if not args.skip_jsparse:
          rec["jsparse"] = bench_jsparse(w, inp, dname, args)
      except Exception as e:
        rec["jsparse"] = {"error": suite.short_error(e)}
      for lname, lib in libs.items():
        try:
          rec["anchors"][lname] = bench_spconv(lib, w, inp, dname, args)
        except Exception as e:
          rec["anchors"][lname] = {"error": suite.short_error(e)}
      for mode in args.modes:
        js = rec["jsparse"].get(mode, {})
        line = f"  {dname:5s} {mode:9s} jsparse {_ms(js)}"
        for lname in rec["anchors"]:
          an = rec["anchors"][lname].get(mode, {})
          cmp_ = compare(js, an, mode)
          an["cross_check"] = cmp_
          speed = an.get("median_ms", float("nan")) / js.get("median_ms", float("nan"))
          line += f" | {lname} {_ms(an)} ({speed:.2f}x) check {_fmt_check(cmp_)}"
        print(line + f" | mem {_mb(js)}" + "".join(f"/{_mb(rec['anchors'][l].get(mode, {}))}"
                                                   for l in rec["anchors"]), flush=True)
      if args.profile:
        print(render_profile(rec), flush=True)
      _strip_checks(rec)
      results.append(rec)
      if args.out:  # after every record: a run cut off by its time limit keeps what it measured
        write_results({"meta": suite.metadata(), "results": results}, args.out)
  return {"meta": suite.metadata(), "args": {k: v for k, v in vars(args).items() if k != "func"},
          "results": results}


def _strip_checks(rec):
  for side in [rec["jsparse"]] + list(rec["anchors"].values()):
    for mode in MODES:
      if isinstance(side.get(mode), dict):
        side[mode].pop("check", None)
        side[mode].pop("times_ms", None)


def _ms(r) -> str:
  return f"{r['median_ms']:.2f} ms" if r.get("ok") and "median_ms" in r else ("FAIL" if r else "-")


def _mb(r) -> str:
  return f"{r['peak_bytes'] / 2**20:.0f}" if r.get("peak_bytes") else "-"


def _fmt_check(c) -> str:
  if not c:
    return "-"
  if "same_sites" in c:
    return f"sites {'=' if c['same_sites'] else '!='} err {c.get('rel_err', float('nan')):.1e}"
  return f"loss {c['loss_rel_err']:.1e} dx {c['input_grad_rel_err']:.1e} dw {c['first_weight_grad_rel_err']:.1e}"


def render_markdown(data) -> str:
  meta = data["meta"]
  lines = [f"Networks benchmark, {meta['device_kind']}, {meta['date']}, jsparse {meta.get('commit')}, "
           f"jax {meta['jax']}. Times: median ms per call (maps built inside every call). Speed-up = anchor time / "
           "jsparse time. Memory: peak MB.", ""]
  anchors = sorted({a for r in data["results"] for a in r["anchors"]})
  head = "| network | size | sites | dtype | mode | jsparse ms |" + "".join(
      f" {a} ms | speed-up vs {a} | check vs {a} |" for a in anchors) + " jsparse MB |" + "".join(
      f" {a} MB |" for a in anchors)
  lines += [head, "|" + "---|" * (head.count("|") - 1)]
  for r in data["results"]:
    for mode in MODES:
      js = r["jsparse"].get(mode)
      if not js:
        continue
      row = f"| {r['network']} | {r['size']} (b{r['batch_size']}) | {r['sites']} | {r['dtype']} | {mode} | {_ms(js)} |"
      for a in anchors:
        an = r["anchors"].get(a, {}).get(mode, {})
        sp = (an["median_ms"] / js["median_ms"]) if an.get("ok") and js.get("ok") else float("nan")
        row += f" {_ms(an)} | {sp:.2f}x | {_fmt_check(an.get('cross_check'))} |"
      row += f" {_mb(js)} |" + "".join(f" {_mb(r['anchors'].get(a, {}).get(mode, {}))} |" for a in anchors)
      lines.append(row)
  return "\n".join(lines) + "\n"


def render_profile(rec) -> str:
  """One training step's GPU time by network op: jsparse and each anchor, ms per call."""
  sides = {"jsparse": rec["jsparse"].get("train", {}).get("profile", {})}
  sides.update({a: r.get("train", {}).get("profile", {}) for a, r in rec["anchors"].items()})
  groups = sorted({g for p in sides.values() for g in p.get("ms", {})},
                  key=lambda g: -max(p.get("ms", {}).get(g, 0.0) for p in sides.values()))
  head = f"Per-op GPU time of one training step, {rec['network']}/{rec['size']} {rec['dtype']} (ms)"
  # jsparse's GB/s per row (HLO bytes of its kernels over their time): how near each op runs to memory bandwidth.
  gbps = sides["jsparse"].get("gbps", {})
  lines = [head, "", "| op | " + " | ".join(sides) + " | jsparse GB/s |", "|---|" + "---|" * (len(sides) + 1)]
  for g in groups:
    rate = f"{gbps[g]:.0f}" if g in gbps and not g.startswith("conv: GEMM") else ""
    lines.append(f"| {g} | " + " | ".join(f"{p.get('ms', {}).get(g, 0.0):.3f}" for p in sides.values())
                 + f" | {rate} |")
  # Like for like: spconv's map building is split between its index generation and torch ops inside its
  # convolutions, jsparse's between its map kernels and the plans and sorts of its convolutions.
  lines.append("| convolution but GEMM (maps + conv: other) | " + " | ".join(
      f"{sum(ms for g, ms in p.get('ms', {}).items() if g.startswith(('maps', 'conv: other'))):.3f}"
      for p in sides.values()) + " | |")
  lines.append("| total (kernels) | " + " | ".join(f"{sum(p.get('ms', {}).values()):.3f}" for p in sides.values())
               + " | |")
  errors = {k: p["error"] for k, p in sides.items() if "error" in p}
  if errors:
    lines.append(f"profile errors: {errors}")
  return "\n".join(lines) + "\n"


def site_count(n: int) -> str:
  """A site count for a chart label: 3,530 -> "3.5k", 1,071,607 -> "1.07M"."""
  return f"{n / 1e6:.2f}M" if n >= 100_000 else f"{n / 1e3:.1f}k"


def plot_speedups(results, path: str, anchor: str = "spconv", device: str | None = None) -> str:
  """Bar chart of anchor time / jsparse time per network cell (one group per network and size, one bar per
  dtype and mode, each labelled with its value; "n/a" where either side has no time), with the 1x and 2x
  lines. device: named in the title when given."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  dtypes = [d for d in ("fp16", "tf32") if any(r["dtype"] == d for r in results)]  # only those measured
  cells = [(d, m) for d in dtypes for m in MODES]
  groups = []
  for r in results:
    key = f"{r['network']}\n{r['size']} ({site_count(r['sites'])} sites, b{r['batch_size']})"
    if key not in [g[0] for g in groups]:
      groups.append((key, {}))
    table = dict(groups)[key]
    for mode in MODES:
      js, an = r["jsparse"].get(mode, {}), r["anchors"].get(anchor, {}).get(mode, {})
      if js.get("ok") and an.get("ok"):
        table[(r["dtype"], mode)] = an["median_ms"] / js["median_ms"]
  fig, ax = plt.subplots(figsize=(max(6.5, 2.2 * len(groups)), 4.6))
  width = 0.8 / len(cells)
  palette = {("fp16", "inference"): "#1f77b4", ("fp16", "train"): "#aec7e8", ("tf32", "inference"): "#d62728",
             ("tf32", "train"): "#ff9896"}
  colours = [palette[c] for c in cells]
  top = max([v for _, t in groups for v in t.values()], default=2.0)
  for k, (cell, colour) in enumerate(zip(cells, colours)):
    xs = [i + (k - (len(cells) - 1) / 2) * width for i in range(len(groups))]
    ys = [g[1].get(cell, 0.0) for g in groups]
    bars = ax.bar(xs, ys, width, label=f"{cell[0]} {cell[1]}", color=colour)
    ax.bar_label(bars, [f"{y:.2f}" if y else "n/a" for y in ys], fontsize=7, padding=1)
  ax.axhline(1.0, color="black", linewidth=0.8)
  ax.axhline(2.0, color="grey", linewidth=0.8, linestyle="--")
  ax.set_ylim(0, max(top, 2.0) * 1.12)  # head room for the value labels
  ax.set_xticks(range(len(groups)), [g[0] for g in groups], fontsize=8)
  ax.set_xlabel("network, input size (sites, batch)", fontsize=9)
  ax.set_ylabel(f"speed-up ({anchor} time / jsparse time)", fontsize=9)
  where = f"\n{device}" if device else ""
  ax.set_title(f"jsparse vs {anchor}: whole networks, maps built every call{where}", fontsize=10)
  ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.25), frameon=False)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  csv = lambda s: [t for t in s.split(",") if t]  # noqa: E731
  ap.add_argument("--networks", type=csv, default=list(NETWORKS))
  ap.add_argument("--sizes", type=csv, default=["small", "large"])
  ap.add_argument("--dtypes", type=csv, default=["fp16", "tf32"], help=f"of {list(DTYPES)}")
  ap.add_argument("--modes", type=csv, default=list(MODES))
  ap.add_argument("--anchors", type=csv, default=["spconv"], help="spconv and/or spconv-triton ('' for none)")
  ap.add_argument("--impl", default=None, help="jsparse implementation (None: pallas on a GPU, xla elsewhere)")
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--inputs-cache", default=None, metavar="DIR",
                  help="keep the generated inputs as .npz files in DIR and read them from there next time (the "
                       "LiDAR scans of the large size take about 20 s to ray-cast)")
  ap.add_argument("--buckets-per-octave", type=int, default=None,
                  help="capacity buckets per power of two for jsparse's static row counts (round_capacity's "
                       "steps_per_octave; default: the library's)")
  ap.add_argument("--skip-jsparse", action="store_true",
                  help="anchors only (torch's profiler and JAX's cannot both hold CUPTI in one process)")
  ap.add_argument("--profile", action="store_true",
                  help="per-op GPU time of each step (traces; the tables show training): jsparse's, or the "
                       "anchors' with --skip-jsparse")
  ap.add_argument("--tune-shard", default=None, metavar="I/N",
                  help="tune only shard I of N of the anchors' Triton autotuning keys (spconv-triton's warm-up spread "
                       "over processes: benchmarks/triton_tuning_shards.py)")
  ap.add_argument("--out", default=None)
  ap.add_argument("--chart", metavar="RESULT_JSON", default=None,
                  help="only draw the speed-up charts of a saved networks.json beside it: NAME.png against the first "
                       "anchor, NAME_<anchor>.png against each other one")
  args = ap.parse_args(argv)
  for n in args.networks:
    if n not in NETWORKS:
      ap.error(f"unknown network {n!r}; have {list(NETWORKS)}")
  if args.tune_shard is not None:
    try:
      args.tune_shard = triton_tuning_shards.parse_shard(args.tune_shard)
    except ValueError as e:
      ap.error(str(e))
  return args


def write_results(data, out_dir: str) -> str:
  """networks.json and networks.md (tables, then the per-op profiles) in out_dir; returns the markdown."""
  md = render_markdown(data)
  profiled = [r for r in data["results"] if any(
      "profile" in side.get("train", {}) for side in [r["jsparse"]] + list(r["anchors"].values()))]
  if profiled:
    md += "\n" + "\n".join(render_profile(r) for r in profiled)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "networks.json"), "w") as f:
    json.dump(data, f, indent=1, default=str)
  with open(os.path.join(out_dir, "networks.md"), "w") as f:
    f.write(md)
  return md


def main(argv=None):
  args = parse_args(argv)
  if args.chart:
    with open(args.chart) as f:
      saved = json.load(f)
    anchors = saved.get("args", {}).get("anchors") or ["spconv"]
    stem = os.path.splitext(args.chart)[0]
    for anchor in anchors:  # one chart per anchor; the first keeps the plain name
      suffix = "" if anchor == anchors[0] else f"_{anchor}"
      print(plot_speedups(saved["results"], f"{stem}{suffix}.png", anchor,
                          device=saved.get("meta", {}).get("device_kind")))
    return saved
  data = run(args)
  print(write_results(data, args.out) if args.out else render_markdown(data))
  return data


if __name__ == "__main__":
  main()
