"""Procedural voxel shapes (no downloads) for demos and tests.

Shapes are generated on the host with numpy. Geometry is in voxel units on a cubic grid of side
`resolution`: voxel (i, j, k) is occupied when its centre (i + 0.5, j + 0.5, k + 0.5) is inside the
shape. `*_mask` functions return the dense bool occupancy [R, R, R]; the others return a SparseTensor
(batch of one) with `channels` feature channels of ones. Random shapes take a jax.random key and are
deterministic per key (a numpy Generator is seeded from the key's bits).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jsparse.sparse_tensor import MAX_KEYS, SparseTensor, _as_spatial_shape, round_capacity

KINDS = ("sphere", "shell", "torus", "box")


def _centres(resolution):
  r = int(resolution)
  if r <= 0:
    raise ValueError(f"resolution must be positive, got {resolution}")
  c = np.arange(r) + 0.5
  return np.meshgrid(c, c, c, indexing="ij")


def _centre(resolution, center):
  return np.full(3, resolution / 2.0) if center is None else np.asarray(center, np.float64).reshape(3)


def sphere_mask(resolution, radius=None, center=None) -> np.ndarray:
  """Solid ball: |c - center| <= radius (default radius 0.4 * resolution, centred)."""
  radius = 0.4 * resolution if radius is None else radius
  x, y, z = _centres(resolution)
  o = _centre(resolution, center)
  return (x - o[0]) ** 2 + (y - o[1]) ** 2 + (z - o[2]) ** 2 <= radius**2


def shell_mask(resolution, radius=None, thickness=1.5, center=None) -> np.ndarray:
  """Hollow sphere: radius - thickness < |c - center| <= radius."""
  radius = 0.4 * resolution if radius is None else radius
  x, y, z = _centres(resolution)
  o = _centre(resolution, center)
  d2 = (x - o[0]) ** 2 + (y - o[1]) ** 2 + (z - o[2]) ** 2
  inner = max(radius - thickness, 0.0)
  return (d2 <= radius**2) & (d2 > inner**2)


def torus_mask(resolution, major=None, minor=None, center=None, axis=2) -> np.ndarray:
  """Solid torus around `axis` (0, 1 or 2): (dist to axis - major)^2 + (height)^2 <= minor^2."""
  major = 0.3 * resolution if major is None else major
  minor = 0.1 * resolution if minor is None else minor
  c = _centres(resolution)
  o = _centre(resolution, center)
  d = [c[i] - o[i] for i in range(3)]
  h = d[axis]
  ring = np.sqrt(sum(d[i] ** 2 for i in range(3) if i != axis))
  return (ring - major) ** 2 + h**2 <= minor**2


def box_mask(resolution, half_size=None, center=None) -> np.ndarray:
  """Axis-aligned box: |c - center| <= half_size per axis (scalar or 3 values, default 0.3 * res).

  With center - half_size an integer, it holds exactly prod(2 * half_size) voxels (when inside the grid).
  """
  half = np.full(3, 0.3 * resolution) if half_size is None else np.broadcast_to(
      np.asarray(half_size, np.float64), (3,))
  c = _centres(resolution)
  o = _centre(resolution, center)
  return np.all([np.abs(c[i] - o[i]) <= half[i] for i in range(3)], axis=0)


_MASKS = dict(sphere=sphere_mask, shell=shell_mask, torus=torus_mask, box=box_mask)


def masks_to_tensor(masks, channels: int = 1, capacity=None, dtype=np.float32) -> SparseTensor:
  """Dense bool occupancy [B, X, Y, Z] (or [X, Y, Z]) -> SparseTensor with `channels` channels of ones.

  capacity: None gives round_capacity(number of occupied voxels).
  """
  m = np.asarray(masks, bool)
  if m.ndim == 3:
    m = m[None]
  if m.ndim != 4:
    raise ValueError(f"masks must be [B, X, Y, Z] or [X, Y, Z], got shape {m.shape}")
  if m.shape[0] * m[0].size > MAX_KEYS:
    raise ValueError(f"masks of shape {m.shape} hold more than 2**31 - 1 sites: jsparse keys them by int32")
  coords = np.argwhere(m).astype(np.int32)  # row-major: sorted by linear key, no duplicates
  n = len(coords)
  capacity = round_capacity(n) if capacity is None else int(capacity)
  if capacity < n:
    raise ValueError(f"capacity {capacity} is smaller than the number of sites {n}")
  # The rows are valid by construction, so pad on the host and build the tensor directly: from_coords
  # would pad with jax ops, which compile anew for every number of sites (slow when making many batches).
  coords_p = np.full((capacity, 4), -1, np.int32)
  coords_p[:n] = coords
  feats_p = np.zeros((capacity, int(channels)), dtype)
  feats_p[:n] = 1
  return SparseTensor(jnp.asarray(coords_p), jnp.asarray(feats_p), jnp.asarray(n, jnp.int32),
                      _as_spatial_shape(m.shape[1:]), m.shape[0])


def _single(mask, channels, capacity, return_dense):
  t = masks_to_tensor(mask, channels, capacity)
  return (t, mask) if return_dense else t


def sphere(resolution, radius=None, center=None, *, channels=1, capacity=None, return_dense=False):
  """Ball as a SparseTensor (see sphere_mask); return_dense=True also returns the bool mask."""
  return _single(sphere_mask(resolution, radius, center), channels, capacity, return_dense)


def shell(resolution, radius=None, thickness=1.5, center=None, *, channels=1, capacity=None,
          return_dense=False):
  """Hollow sphere as a SparseTensor (see shell_mask)."""
  return _single(shell_mask(resolution, radius, thickness, center), channels, capacity, return_dense)


def torus(resolution, major=None, minor=None, center=None, axis=2, *, channels=1, capacity=None,
          return_dense=False):
  """Torus as a SparseTensor (see torus_mask)."""
  return _single(torus_mask(resolution, major, minor, center, axis), channels, capacity, return_dense)


def box(resolution, half_size=None, center=None, *, channels=1, capacity=None, return_dense=False):
  """Box as a SparseTensor (see box_mask)."""
  return _single(box_mask(resolution, half_size, center), channels, capacity, return_dense)


def _rng(key) -> np.random.Generator:
  """A numpy Generator seeded from a jax.random key (typed or raw uint32)."""
  try:
    data = jax.random.key_data(key)
  except TypeError:
    data = key
  return np.random.default_rng(np.asarray(data, np.uint32).ravel().tolist())


def _random_one(rng, resolution, kinds, num_shapes):
  r = float(resolution)
  lo, hi = num_shapes
  m = np.zeros((resolution,) * 3, bool)
  for _ in range(int(rng.integers(lo, hi + 1))):
    kind = kinds[int(rng.integers(len(kinds)))]
    size = rng.uniform(0.15, 0.3) * r  # characteristic radius
    size = max(size, 1.5)
    center = rng.uniform(size, r - size, 3) if r > 2 * size else np.full(3, r / 2)
    if kind == "sphere":
      s = sphere_mask(resolution, size, center)
    elif kind == "shell":
      s = shell_mask(resolution, size, max(1.0, 0.25 * size), center)
    elif kind == "torus":
      s = torus_mask(resolution, 0.7 * size, max(1.0, 0.3 * size), center, int(rng.integers(3)))
    else:
      s = box_mask(resolution, size * rng.uniform(0.5, 1.0, 3), center)
    m |= s
  if not m.any():  # tiny grids: never hand back an empty shape
    m[(resolution // 2,) * 3] = True
  return m


def _check_kinds(kinds):
  kinds = tuple(kinds)
  bad = [k for k in kinds if k not in KINDS]
  if not kinds or bad:
    raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {kinds!r}")
  return kinds


def random_union_mask(key, resolution, *, kinds=KINDS, num_shapes=(2, 4)) -> np.ndarray:
  """Dense bool [R, R, R] union of num_shapes=(min, max) shapes of random kinds, positions and sizes."""
  return _random_one(_rng(key), int(resolution), _check_kinds(kinds), num_shapes)


def random_union(key, resolution, *, kinds=KINDS, num_shapes=(2, 4), channels=1, capacity=None,
                 return_dense=False):
  """random_union_mask as a SparseTensor (batch of one)."""
  m = random_union_mask(key, resolution, kinds=kinds, num_shapes=num_shapes)
  return _single(m, channels, capacity, return_dense)


def random_shapes(key, batch_size, resolution, *, kinds=KINDS, num_shapes=(1, 3), channels=1,
                  capacity=None, return_dense=False):
  """A batch of random unions (one per batch element) as one SparseTensor, deterministic per key.

  Element i depends only on (key, i): it is generated from jax.random.split(key, batch_size)[i].
  num_shapes: (min, max) shapes per element. capacity: None gives round_capacity(total voxels).
  return_dense=True returns (tensor, bool occupancy [B, R, R, R]).
  """
  kinds = _check_kinds(kinds)
  keys = jax.random.split(key, int(batch_size))
  masks = np.stack([_random_one(_rng(k), int(resolution), kinds, num_shapes) for k in keys])
  t = masks_to_tensor(masks, channels, capacity)
  return (t, masks) if return_dense else t
