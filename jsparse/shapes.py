"""Procedural voxel shapes (no downloads) for demos and tests.

Shapes are generated on the host with numpy. Geometry is in voxel units on a cubic grid of side
`resolution`: voxel (i, j, k) is occupied when its centre (i + 0.5, j + 0.5, k + 0.5) is inside the
shape. `*_mask` functions return the dense bool occupancy [R, R, R]; the others return a SparseTensor
(batch of one) with `channels` feature channels of ones. Random shapes take a jax.random key and are
deterministic per key (a numpy Generator is seeded from the key's bits).

LiDAR benchmark input (in metres, not voxel units): `street_scene` builds a random street of analytic
primitives, `lidar_scan` ray-casts a spinning multi-beam sensor driving along it (optionally several
sweeps), `lidar_voxels` turns the points into unique voxel coordinates with mean features, and
`lidar_batch` does all three for a batch with named presets (LIDAR_PRESETS).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jsparse.sparse_tensor import (SparseTensor, as_int, as_nonnegative_float, as_spatial_shape, check_capacity,
                                   key_width, resolve_capacity)

KINDS = ("sphere", "shell", "torus", "box")


def _resolution(resolution) -> int:
  # as_int, not int(): 8.7 became an 8-voxel grid while the default radius and centre used 8.7.
  return as_int(resolution, "resolution", minimum=1)


def _centres(resolution: int):
  c = np.arange(resolution) + 0.5
  return np.meshgrid(c, c, c, indexing="ij")


def _vec3(value, name):
  """A scalar or 3 values as float64 [3]; ValueError naming the argument (numpy's reshape error named none)."""
  a = np.asarray(value, np.float64)
  if a.shape not in ((), (3,)):
    raise ValueError(f"{name} must be a scalar or 3 values, got shape {a.shape}")
  return np.broadcast_to(a, (3,))


def _centre(resolution, center):
  return np.full(3, resolution / 2.0) if center is None else _vec3(center, "center")


def sphere_mask(resolution, radius=None, center=None) -> np.ndarray:
  """Solid ball: |c - center| <= radius (default radius 0.4 * resolution, centred)."""
  resolution = _resolution(resolution)
  radius = 0.4 * resolution if radius is None else as_nonnegative_float(radius, "radius")
  x, y, z = _centres(resolution)
  o = _centre(resolution, center)
  return (x - o[0]) ** 2 + (y - o[1]) ** 2 + (z - o[2]) ** 2 <= radius**2


def shell_mask(resolution, radius=None, thickness=1.5, center=None) -> np.ndarray:
  """Hollow sphere: radius - thickness < |c - center| <= radius."""
  resolution = _resolution(resolution)
  radius = 0.4 * resolution if radius is None else as_nonnegative_float(radius, "radius")
  thickness = as_nonnegative_float(thickness, "thickness")
  x, y, z = _centres(resolution)
  o = _centre(resolution, center)
  d2 = (x - o[0]) ** 2 + (y - o[1]) ** 2 + (z - o[2]) ** 2
  inner = max(radius - thickness, 0.0)
  return (d2 <= radius**2) & (d2 > inner**2)


def torus_mask(resolution, major=None, minor=None, center=None, axis=2) -> np.ndarray:
  """Solid torus around `axis` (0, 1 or 2): (dist to axis - major)^2 + (height)^2 <= minor^2."""
  resolution = _resolution(resolution)
  major = 0.3 * resolution if major is None else as_nonnegative_float(major, "major")
  minor = 0.1 * resolution if minor is None else as_nonnegative_float(minor, "minor")
  axis = as_int(axis, "axis")
  if axis not in (0, 1, 2):  # 3 raised IndexError, -1 read axis 2
    raise ValueError(f"axis must be 0, 1 or 2, got {axis}")
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
  resolution = _resolution(resolution)
  half = np.full(3, 0.3 * resolution) if half_size is None else _vec3(half_size, "half_size")
  if not np.all(np.isfinite(half) & (half >= 0)):  # a negative half size gave an empty box, NaN as well
    raise ValueError(f"half_size must be finite and >= 0, got {half_size!r}")
  c = _centres(resolution)
  o = _centre(resolution, center)
  return np.all([np.abs(c[i] - o[i]) <= half[i] for i in range(3)], axis=0)


_MASKS = dict(sphere=sphere_mask, shell=shell_mask, torus=torus_mask, box=box_mask)


def masks_to_tensor(masks, channels: int = 1, capacity=None, dtype=np.float32) -> SparseTensor:
  """Dense bool occupancy [B, X, Y, Z] (or [X, Y, Z]) -> SparseTensor with `channels` channels of ones.

  masks: bool, or numbers that are all 0 or 1 (ValueError otherwise: threshold probabilities first).

  capacity: None gives round_capacity(number of occupied voxels), "exact" that number, an int that many
  (ValueError if fewer). dtype: a floating dtype (TypeError otherwise, as from_coords).
  """
  capacity = check_capacity(capacity)  # int() truncated 300.9 and rejected "exact" with int()'s message
  channels = as_int(channels, "channels", minimum=0)
  if not jnp.issubdtype(dtype, jnp.floating):  # an int32 tensor was made, which the layers refuse
    raise TypeError(f"dtype must be floating point (float16, bfloat16, float32), got {np.dtype(dtype)}")
  raw = np.asarray(masks)
  if raw.dtype == object or not (raw.dtype == bool or np.issubdtype(raw.dtype, np.number)):
    raise TypeError(f"masks must be a bool (or 0/1) array, got dtype {raw.dtype}")
  # Probabilities or logits would read as occupied wherever they are non-zero (NaN included): only 0 and 1 pass.
  if raw.dtype != bool and not np.isin(raw, (0, 1)).all():
    raise ValueError("masks must hold occupancy (bool, or 0 and 1 only); threshold probabilities first, e.g. "
                     "masks > 0.5")
  m = raw.astype(bool)
  if m.ndim == 3:
    m = m[None]
  if m.ndim != 4:
    raise ValueError(f"masks must be [B, X, Y, Z] or [X, Y, Z], got shape {m.shape}")
  key_width(m.shape[0], m.shape[1:])  # ValueError past the grids jsparse can key
  coords = np.argwhere(m).astype(np.int32)  # row-major: sorted by linear key, no duplicates
  n = len(coords)
  capacity = resolve_capacity(capacity, n)
  if capacity < n:
    raise ValueError(f"capacity {capacity} is smaller than the number of sites {n}")
  # The rows are valid by construction, so pad on the host and build the tensor directly: from_coords
  # would pad with jax ops, which compile anew for every number of sites (slow when making many batches).
  coords_p = np.full((capacity, 4), -1, np.int32)
  coords_p[:n] = coords
  feats_p = np.zeros((capacity, channels), dtype)
  feats_p[:n] = 1
  # device_put: jnp.asarray of a numpy array compiles a program per new shape in this JAX.
  return SparseTensor(jax.device_put(coords_p), jax.device_put(feats_p), jnp.asarray(n, jnp.int32),
                      as_spatial_shape(m.shape[1:]), m.shape[0])


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
    # Raw key data must be integers: a float was truncated (1.5 drew seed 1's shapes), a negative one raised
    # numpy's OverflowError and a string int()'s ValueError, naming no argument.
    data = np.asarray(key)
    if not np.issubdtype(data.dtype, np.integer):
      raise TypeError(f"key must be a jax.random key (jax.random.key(seed)) or its raw uint32 data, "
                      f"got {key!r}") from None
    if np.any(data < 0) or np.any(data > np.iinfo(np.uint32).max):  # 2**32 wrapped to seed 0's shapes
      raise ValueError(f"key must be a jax.random key or its raw uint32 data (0 to 2**32 - 1), got {key!r}") from None
  return np.random.default_rng(np.asarray(data, np.uint32).ravel().tolist())


def _check_num_shapes(num_shapes) -> tuple[int, int]:
  """(min, max) shapes per element as ints with 0 <= min <= max; ValueError / TypeError naming num_shapes."""
  if isinstance(num_shapes, str) or not hasattr(num_shapes, "__len__") or len(num_shapes) != 2:
    raise TypeError(f"num_shapes must be a pair (min, max), got {num_shapes!r}")
  lo, hi = (as_int(v, "num_shapes entries", minimum=0) for v in num_shapes)
  if lo > hi:  # numpy's "low >= high" named no argument
    raise ValueError(f"num_shapes must be (min, max) with min <= max, got {num_shapes!r}")
  return lo, hi


def _random_one(rng, resolution, kinds, num_shapes):
  r = float(resolution)
  lo, hi = num_shapes
  m = np.zeros((resolution,) * 3, bool)
  count = int(rng.integers(lo, hi + 1))
  for _ in range(count):
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
  if count and not m.any():  # tiny grids: shapes drawn never hand back an empty mask (zero shapes drawn do)
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
  return _random_one(_rng(key), _resolution(resolution), _check_kinds(kinds), _check_num_shapes(num_shapes))


def random_union(key, resolution, *, kinds=KINDS, num_shapes=(2, 4), channels=1, capacity=None,
                 return_dense=False):
  """random_union_mask as a SparseTensor (batch of one)."""
  m = random_union_mask(key, resolution, kinds=kinds, num_shapes=num_shapes)
  return _single(m, channels, capacity, return_dense)


def random_shapes(key, batch_size, resolution, *, kinds=KINDS, num_shapes=(1, 3), channels=1,
                  capacity=None, return_dense=False):
  """A batch of random unions (one per batch element) as one SparseTensor, deterministic per key.

  Element i depends only on (key, i): it is generated from jax.random.split(key, n)[i], n = batch_size (with
  jax_threefry_partitionable off, where that key changes with n: n = i + 1).
  num_shapes: (min, max) shapes per element; an element that draws none has no sites (min 0 gives empty items).
  capacity: None gives round_capacity(total voxels).
  return_dense=True returns (tensor, bool occupancy [B, R, R, R]).
  """
  kinds, num_shapes, resolution = _check_kinds(kinds), _check_num_shapes(num_shapes), _resolution(resolution)
  batch_size = as_int(batch_size, "batch_size", minimum=1)  # int() made 2.7 two elements
  if jax.config.jax_threefry_partitionable:
    keys = jax.random.split(key, batch_size)
  else:  # there split(key, n)[i] changes with n: element i takes split(key, i + 1)[i], the same key for every n > i
    keys = [jax.random.split(key, i + 1)[i] for i in range(batch_size)]
  masks = np.stack([_random_one(_rng(k), resolution, kinds, num_shapes) for k in keys])
  t = masks_to_tensor(masks, channels, capacity)
  return (t, masks) if return_dense else t


# ---- Procedural LiDAR street scenes ----------------------------------------------------------------
#
# A street is a set of analytic primitives (ground surface, boxes, vertical cylinders, ellipsoids) in a
# world frame with x along the street, y to the left and z up, in metres. A spinning multi-beam sensor
# is ray-cast against them exactly (nearest hit per ray), which gives the properties of real scans that
# benchmarks depend on: rings on the ground, density falling with range, thin 2D surfaces and shadows.

SEMANTIC_CLASSES = ("road", "sidewalk", "terrain", "building", "car", "pole", "trunk", "vegetation", "pedestrian")
ROAD, SIDEWALK, TERRAIN, BUILDING, CAR, POLE, TRUNK, VEGETATION, PEDESTRIAN = range(len(SEMANTIC_CLASSES))
# Diffuse reflectivity per class in [0, 1]: asphalt is dark, painted metal and poles are bright.
CLASS_REFLECTIVITY = np.array([0.12, 0.30, 0.20, 0.35, 0.50, 0.60, 0.25, 0.30, 0.35], np.float32)
LANE_MARKING_REFLECTIVITY = 0.8
GROUND = -1  # the primitive index of ground hits
_T_MIN = 1e-6  # hits closer than this (metres along the ray) are the ray's own origin, not a surface


def _rows(value, width, dtype, name):
  """value as an array [n, width] (or [n] when width is None); None is empty."""
  tail = () if width is None else (width,)
  a = np.zeros((0,) + tail, dtype) if value is None else np.asarray(value, dtype)
  if a.size == 0:
    a = a.reshape((0,) + tail)
  if a.ndim == 1 and width is not None and a.size == width:
    a = a[None]
  if a.shape[1:] != tail:
    raise ValueError(f"{name} must be [n{', ' + str(width) if width else ''}], got shape {a.shape}")
  return a


@dataclasses.dataclass(frozen=True, eq=False)
class StreetScene:
  """A street of analytic primitives in the world frame (x along the street, y left, z up; metres).

  Ground: z = ground_slope * x - road_camber_m * min((y / road_half_width_m)^2, 1), a road crowned along
  y = 0 that falls by road_camber_m towards the kerbs at |y| = road_half_width_m and is level across y
  beyond them. Ground hits are labelled road within the kerbs and terrain beyond.
  Solids: axis-aligned boxes (corners box_lo, box_hi [B, 3]; box_velocity [B, 3] in m/s moves them
  between sweeps), vertical cylinders (cylinder_center [C, 2] xy, cylinder_radius [C], cylinder_z [C, 2]
  bottom and top) and axis-aligned ellipsoids (ellipsoid_center, ellipsoid_radii [E, 3]). Each has a
  label (index into SEMANTIC_CLASSES) and a reflectivity in [0, 1]. Primitive indices run over boxes,
  then cylinders, then ellipsoids; GROUND (-1) is the ground.

  Arrays left None are empty, labels default to building / pole / vegetation, reflectivities to the
  class's CLASS_REFLECTIVITY and velocities to zero, so a hand-made scene names only what it needs.
  ego_lane_y_m is the y of the line the sensor drives along (lidar_scan).
  """
  road_half_width_m: float = 7.0
  ground_slope: float = 0.0
  road_camber_m: float = 0.0
  ego_lane_y_m: float = -1.75
  lane_markings: bool = False
  box_lo: np.ndarray | None = None
  box_hi: np.ndarray | None = None
  box_label: np.ndarray | None = None
  box_reflectivity: np.ndarray | None = None
  box_velocity: np.ndarray | None = None
  cylinder_center: np.ndarray | None = None
  cylinder_radius: np.ndarray | None = None
  cylinder_z: np.ndarray | None = None
  cylinder_label: np.ndarray | None = None
  cylinder_reflectivity: np.ndarray | None = None
  ellipsoid_center: np.ndarray | None = None
  ellipsoid_radii: np.ndarray | None = None
  ellipsoid_label: np.ndarray | None = None
  ellipsoid_reflectivity: np.ndarray | None = None

  def __post_init__(self):
    def put(name, value):  # a frozen dataclass normalises its own fields through object.__setattr__
      object.__setattr__(self, name, value)

    f64, i32, f32 = np.float64, np.int32, np.float32
    for kind, geometry, default_label in (
        ("box", (("lo", 3), ("hi", 3)), BUILDING),
        ("cylinder", (("center", 2), ("radius", None), ("z", 2)), POLE),
        ("ellipsoid", (("center", 3), ("radii", 3)), VEGETATION)):
      arrays = [_rows(getattr(self, f"{kind}_{g}"), w, f64, f"{kind}_{g}") for g, w in geometry]
      n = len(arrays[0])
      if any(len(a) != n for a in arrays):
        raise ValueError(f"the {kind} arrays disagree on the number of {kind}es: {[len(a) for a in arrays]}")
      for (g, _), a in zip(geometry, arrays):
        put(f"{kind}_{g}", a)
      label = getattr(self, f"{kind}_label")
      label = np.full(n, default_label, i32) if label is None else _rows(label, None, i32, f"{kind}_label")
      refl = getattr(self, f"{kind}_reflectivity")
      refl = CLASS_REFLECTIVITY[label] if refl is None else _rows(refl, None, f32, f"{kind}_reflectivity")
      if len(label) != n or len(refl) != n:
        raise ValueError(f"{kind}_label and {kind}_reflectivity must have one entry per {kind} ({n})")
      put(f"{kind}_label", label)
      put(f"{kind}_reflectivity", refl.astype(f32))
    vel = np.zeros((len(self.box_lo), 3)) if self.box_velocity is None else _rows(self.box_velocity, 3, f64,
                                                                                    "box_velocity")
    if len(vel) != len(self.box_lo):
      raise ValueError(f"box_velocity must be [{len(self.box_lo)}, 3], got shape {vel.shape}")
    put("box_velocity", vel)

  @property
  def num_primitives(self) -> int:
    return len(self.box_lo) + len(self.cylinder_radius) + len(self.ellipsoid_radii)

  @property
  def labels(self) -> np.ndarray:
    """Semantic label per primitive index, int32 [num_primitives]."""
    return np.concatenate([self.box_label, self.cylinder_label, self.ellipsoid_label])

  @property
  def reflectivity(self) -> np.ndarray:
    return np.concatenate([self.box_reflectivity, self.cylinder_reflectivity, self.ellipsoid_reflectivity])

  def ground_height(self, x, y):
    """Ground z at world (x, y), numpy-broadcast."""
    w = self.road_half_width_m
    return self.ground_slope * np.asarray(x) - self.road_camber_m * np.minimum((np.asarray(y) / w) ** 2, 1.0)

  def at_time(self, time_s: float) -> "StreetScene":
    """The scene with every box moved by box_velocity * time_s (time_s < 0 looks into the past)."""
    shift = self.box_velocity * float(time_s)
    return dataclasses.replace(self, box_lo=self.box_lo + shift, box_hi=self.box_hi + shift)


def _as_rng(key_or_seed) -> np.random.Generator:
  """A numpy Generator from an int seed, a Generator, a SeedSequence or a jax.random key."""
  if isinstance(key_or_seed, np.random.Generator):
    return key_or_seed
  if isinstance(key_or_seed, (int, np.integer, np.random.SeedSequence)):
    return np.random.default_rng(key_or_seed)
  return _rng(key_or_seed)


def street_scene(key_or_seed, *, extent_m: float = 100.0, uneven_ground: bool = True, moving_cars: int = 6,
                 pedestrians: int = 12) -> StreetScene:
  """A random urban street along x in [-extent_m, extent_m], deterministic per seed (or jax key).

  Both sides have kerbed sidewalk slabs, building blocks (with alleys, cross streets and some balconies),
  parked cars and vans along the kerbs, street lights and trees (trunk cylinder and crown ellipsoid), and
  bushes; moving cars drive in both lanes and pedestrians stand or walk on the sidewalks. The sensor
  lane (y = -1.75) is kept clear for x in [-30, 9] so that scans of up to a second of driving never start
  inside a car. uneven_ground=False gives the flat plane z = 0 (no slope, no road camber).
  About 200 primitives with the default extent; with moving_cars > 0 extent_m must be at least 40 (cars are
  placed up to 35 m behind the sensor).
  """
  rng = _as_rng(key_or_seed)
  extent = float(extent_m)
  moving_cars = as_int(moving_cars, "moving_cars", minimum=0)  # int() truncated 1.5, range() ignored -1
  pedestrians = as_int(pedestrians, "pedestrians", minimum=0)
  # A shorter street failed inside numpy's uniform ("high - low < 0") when placing a car behind the sensor.
  if not (np.isfinite(extent) and (extent >= 40.0 if moving_cars else extent > 0.0)):
    raise ValueError(f"extent_m must be finite and >= 40 with moving_cars > 0 (else > 0), got {extent_m!r} with "
                     f"moving_cars={moving_cars}")
  w = rng.uniform(5.5, 8.0)  # road half width: two lanes plus parking
  slope = rng.uniform(-0.004, 0.004) if uneven_ground else 0.0
  camber = rng.uniform(0.04, 0.12) if uneven_ground else 0.0
  kerb = rng.uniform(0.1, 0.18)
  sidewalk = rng.uniform(2.5, 5.0)

  def level(x):  # ground height beyond the kerbs
    return slope * x - camber

  boxes, cylinders, ellipsoids = [], [], []  # rows of (geometry..., label, reflectivity[, velocity])

  def add_box(lo, hi, label, refl=None, velocity=0.0):
    boxes.append((lo, hi, label, CLASS_REFLECTIVITY[label] if refl is None else refl, (velocity, 0.0, 0.0)))

  def add_car(x, y, length, z0, velocity=0.0):
    refl = rng.uniform(0.2, 0.8)  # paint colour
    if rng.uniform() < 0.12:  # a van: one tall box
      add_box((x - 2.8, y - 1.05, z0 + 0.25), (x + 2.8, y + 1.05, z0 + 2.4), CAR, refl, velocity)
      return
    width = rng.uniform(1.7, 1.9)
    add_box((x - length / 2, y - width / 2, z0 + 0.25), (x + length / 2, y + width / 2, z0 + 0.95), CAR, refl,
            velocity)
    cabin = 0.3 * length  # the cabin sits slightly behind the middle
    add_box((x - cabin - 0.2, y - 0.45 * width, z0 + 0.95), (x + cabin - 0.2, y + 0.45 * width,
                                                              z0 + rng.uniform(1.4, 1.55)), CAR, refl, velocity)

  for side in (-1.0, 1.0):
    # Sidewalk slabs of varying length; a missing slab is a driveway.
    x = -extent
    while x < extent:
      length = rng.uniform(6.0, 12.0)
      if rng.uniform() > 0.1:
        top = level(x + length / 2) + kerb
        y0, y1 = sorted((side * w, side * (w + sidewalk)))
        add_box((x, y0, top - 0.5), (x + length, y1, top), SIDEWALK)
      x += length
    # Building blocks behind the sidewalk, with alleys and the odd cross street.
    x = -extent + rng.uniform(0.0, 10.0)
    while x < extent:
      width = rng.uniform(8.0, 30.0)
      front = w + sidewalk + rng.uniform(0.0, 2.0)
      depth = rng.uniform(8.0, 20.0)
      height = rng.uniform(5.0, 25.0)
      base = level(x) - 1.0
      y0, y1 = sorted((side * front, side * (front + depth)))
      add_box((x, y0, base), (x + width, y1, base + 1.0 + height), BUILDING, rng.uniform(0.25, 0.45))
      if height > 7.0 and rng.uniform() < 0.3:  # balconies: shallow slabs stuck out of the facade
        for z in np.arange(3.0, height - 1.0, 3.0):
          bx = x + rng.uniform(1.0, 3.0)
          b0, b1 = sorted((side * (front - 1.0), side * front))
          add_box((bx, b0, level(x) + z), (bx + 0.5 * width, b1, level(x) + z + 0.25), BUILDING)
      x += width + (rng.uniform(12.0, 18.0) if rng.uniform() < 0.08 else
                    rng.uniform(2.0, 6.0) if rng.uniform() < 0.3 else 0.0)
    # Parked cars along the kerb, in slots of random length, some empty.
    x = -extent + rng.uniform(0.0, 5.0)
    while x < extent - 6.0:
      slot = rng.uniform(5.5, 7.5)
      if rng.uniform() < 0.65:
        cx = x + slot / 2
        add_car(cx, side * (w - 1.1), rng.uniform(4.2, 4.8), float(slope * cx - camber * ((w - 1.1) / w) ** 2))
      x += slot
    # Street lights at the kerb, trees in the sidewalk, bushes in front of the facades.
    for x in np.arange(-extent + rng.uniform(0, 20), extent, 25.0) + rng.uniform(-3, 3):
      cylinders.append(((x, side * (w + 0.4)), rng.uniform(0.08, 0.15), (level(x) - 0.5, level(x) + rng.uniform(
          5.0, 9.0)), POLE, CLASS_REFLECTIVITY[POLE]))
    for x in np.arange(-extent + rng.uniform(0, 12), extent, 12.0):
      if rng.uniform() < 0.6:
        x += rng.uniform(-2.0, 2.0)
        y = side * (w + sidewalk * rng.uniform(0.5, 0.7))
        top = level(x) + rng.uniform(2.0, 3.5)
        cylinders.append(((x, y), rng.uniform(0.12, 0.25), (level(x) - 0.5, top), TRUNK, CLASS_REFLECTIVITY[TRUNK]))
        radii = rng.uniform((1.5, 1.5, 1.2), (3.0, 3.0, 2.5))
        ellipsoids.append(((x, y, top + 0.6 * radii[2]), radii, VEGETATION, rng.uniform(0.2, 0.4)))
    for _ in range(5):
      x = rng.uniform(-extent, extent)
      radii = rng.uniform((0.8, 0.8, 0.5), (2.0, 2.0, 1.0))
      ellipsoids.append(((x, side * (w + sidewalk + radii[1]), level(x)), radii, VEGETATION, rng.uniform(0.2, 0.4)))
  # Moving cars: oncoming in the left lane anywhere, ahead of or well behind the sensor in its own lane.
  for i in range(moving_cars):
    if i % 2:
      x, y, v = rng.uniform(-extent + 5, extent - 5), 1.75, -rng.uniform(8.0, 14.0)
    else:
      x = rng.uniform(12.0, extent - 5) if rng.uniform() < 0.6 else rng.uniform(-extent + 5, -35.0)
      y, v = -1.75, rng.uniform(8.0, 12.0)
    add_car(x, y, rng.uniform(4.2, 4.8), float(slope * x - camber * (y / w) ** 2), v)
  for _ in range(pedestrians):
    x, side = rng.uniform(-extent, extent), rng.choice((-1.0, 1.0))
    y = side * (w + sidewalk * rng.uniform(0.2, 0.9))
    v = rng.choice((0.0, rng.uniform(-1.5, 1.5)))
    z0 = level(x) + kerb
    add_box((x - 0.25, y - 0.25, z0), (x + 0.25, y + 0.25, z0 + rng.uniform(1.55, 1.9)), PEDESTRIAN, velocity=v)

  def cols(rows, i):
    return [r[i] for r in rows]

  return StreetScene(
      road_half_width_m=float(w), ground_slope=float(slope), road_camber_m=float(camber), lane_markings=True,
      box_lo=cols(boxes, 0), box_hi=cols(boxes, 1), box_label=cols(boxes, 2), box_reflectivity=cols(boxes, 3),
      box_velocity=cols(boxes, 4), cylinder_center=cols(cylinders, 0), cylinder_radius=cols(cylinders, 1),
      cylinder_z=cols(cylinders, 2), cylinder_label=cols(cylinders, 3), cylinder_reflectivity=cols(cylinders, 4),
      ellipsoid_center=cols(ellipsoids, 0), ellipsoid_radii=cols(ellipsoids, 1), ellipsoid_label=cols(ellipsoids, 2),
      ellipsoid_reflectivity=cols(ellipsoids, 3))


# ---- Ray casting -----------------------------------------------------------------------------------

BEAM_LAYOUTS = ("split", "uniform")


def beam_elevations(beams: int, elevation_deg=(-24.9, 2.0), layout: str = "split") -> np.ndarray:
  """Beam elevations in radians, ascending (ring 0 is the lowest beam), float64 [beams].

  layout="uniform" spaces them evenly over elevation_deg = (lowest, highest). layout="split" is the
  Velodyne HDL-64E arrangement: half the beams in the top 38% of the field of view (finer near the
  horizon, where distant objects are), the other half spread over the rest.
  """
  lo, hi = (float(e) for e in elevation_deg)
  beams = as_int(beams, "beams")  # int() truncated 2.5
  if beams < 1 or not lo < hi:
    raise ValueError(f"need beams >= 1 and elevation_deg=(low, high) with low < high, got {beams}, {elevation_deg}")
  if layout == "uniform" or beams < 4:
    deg = np.linspace(lo, hi, beams) if beams > 1 else np.array([(lo + hi) / 2])
  elif layout == "split":
    knee = hi - 0.38 * (hi - lo)
    lower = beams - beams // 2
    deg = np.concatenate([np.linspace(lo, knee, lower, endpoint=False), np.linspace(knee, hi, beams // 2)])
  else:
    raise ValueError(f"layout must be one of {BEAM_LAYOUTS}, got {layout!r}")
  return np.radians(deg)


def _ray_boxes(origin, d, lo, hi):
  """Slab test: (entry distance or inf, |cos| of the incidence on the entered face) per ray-box pair."""
  with np.errstate(divide="ignore", invalid="ignore"):
    inv = 1.0 / d
    t1, t2 = (lo - origin) * inv, (hi - origin) * inv
  near, far = np.minimum(t1, t2), np.maximum(t1, t2)
  axis = np.argmax(near, axis=1)
  t_near = np.take_along_axis(near, axis[:, None], 1)[:, 0]
  hit = (t_near <= far.min(axis=1)) & (t_near > _T_MIN)  # NaN (ray inside a face plane) never hits
  cos = np.abs(np.take_along_axis(d, axis[:, None], 1)[:, 0])
  return np.where(hit, t_near, np.inf), cos


def _ray_cylinders(origin, d, center, radius, z_range):
  """Vertical capped cylinders: (entry distance or inf, |cos| of the incidence) per ray-cylinder pair."""
  ox, oy = origin[0] - center[:, 0], origin[1] - center[:, 1]
  dx, dy, dz = d[:, 0], d[:, 1], d[:, 2]
  a = dx * dx + dy * dy
  half_b = ox * dx + oy * dy
  c = ox * ox + oy * oy - radius * radius
  disc = half_b * half_b - a * c
  with np.errstate(divide="ignore", invalid="ignore"):
    t_side = (-half_b - np.sqrt(np.maximum(disc, 0.0))) / a
    z = origin[2] + t_side * dz
    side = (disc >= 0) & (c > 0) & (t_side > _T_MIN) & (z >= z_range[:, 0]) & (z <= z_range[:, 1])
    t_cap = (np.where(dz < 0, z_range[:, 1], z_range[:, 0]) - origin[2]) / dz
  cx, cy = ox + t_cap * dx, oy + t_cap * dy
  cap = (t_cap > _T_MIN) & (cx * cx + cy * cy <= radius * radius)
  t_side = np.where(side, t_side, np.inf)
  t_cap = np.where(cap, t_cap, np.inf)
  on_side = t_side <= t_cap
  cos_side = np.abs((ox + t_side * dx) * dx + (oy + t_side * dy) * dy) / radius
  return np.minimum(t_side, t_cap), np.where(on_side, cos_side, np.abs(dz))


def _ray_ellipsoids(origin, d, center, radii):
  """Axis-aligned ellipsoids: (entry, exit distance or inf, |cos| of the incidence at the entry) per pair."""
  oc, dd = (origin - center) / radii, d / radii  # in the frame where the ellipsoid is the unit sphere
  a = np.einsum("ij,ij->i", dd, dd)
  half_b = np.einsum("ij,ij->i", oc, dd)
  c = np.einsum("ij,ij->i", oc, oc) - 1.0
  disc = half_b * half_b - a * c
  root = np.sqrt(np.maximum(disc, 0.0))
  t_in, t_out = (-half_b - root) / a, (-half_b + root) / a
  hit = (disc >= 0) & (c > 0) & (t_in > _T_MIN)
  normal = (oc + t_in[:, None] * dd) / radii  # gradient of the implicit function at the entry point
  cos = np.abs(np.einsum("ij,ij->i", normal, d)) / np.maximum(np.linalg.norm(normal, axis=1), 1e-30)
  return np.where(hit, t_in, np.inf), np.where(hit, t_out, np.inf), cos


def _ray_ground(scene, origin, d):
  """(distance or inf, |cos| of the incidence) of every ray with the crowned ground of `scene`."""
  s, camber, w = scene.ground_slope, scene.road_camber_m, scene.road_half_width_m
  dx, dy, dz = d[:, 0], d[:, 1], d[:, 2]
  ox, oy, oz = origin
  with np.errstate(divide="ignore", invalid="ignore"):
    # Beyond the kerbs the ground is the plane z = s x - camber.
    denom = s * dx - dz
    t_level = (oz - s * ox + camber) / denom
    level_ok = (denom > 0) & (np.abs(oy + t_level * dy) >= w)
    # Within them it is z = s x - k y^2: solve A t^2 + B t + C = 0 in the stable form (both roots).
    k = camber / w**2
    qa, qb, qc = k * dy * dy, dz - s * dx + 2 * k * oy * dy, oz - s * ox + k * oy * oy
    disc = qb * qb - 4 * qa * qc
    q = -0.5 * (qb + np.copysign(np.sqrt(np.maximum(disc, 0.0)), qb))
    roots = [qc / q, q / qa]
  best = np.where(level_ok & (t_level > _T_MIN), t_level, np.inf)
  for t in roots:
    ok = (disc >= 0) & (t > _T_MIN) & (np.abs(oy + t * dy) <= w)
    best = np.where(ok & (t < best), t, best)
  with np.errstate(invalid="ignore"):  # misses (inf) give NaN cosines, never used
    y = oy + best * dy
    slope_y = np.where(np.abs(y) < w, -2 * k * y, 0.0)
  normal_z = 1.0 / np.sqrt(1.0 + s * s + slope_y * slope_y)
  cos = np.abs(-s * dx - slope_y * dy + dz) * normal_z
  return best, cos


def _visible_rays(lo, hi, origin, elevations, azimuth0, step, n_cols, max_range):
  """Per primitive (by its bounding box): the first column, column count, first beam and beam count of
  the rays that may meet it, from its azimuth and elevation extent seen from origin (conservative)."""
  rel_lo, rel_hi = lo - origin, hi - origin
  gap = np.maximum(np.maximum(rel_lo[:, :2], -rel_hi[:, :2]), 0.0)  # per-axis distance outside the footprint
  d_min = np.hypot(gap[:, 0], gap[:, 1])
  far = np.maximum(np.abs(rel_lo[:, :2]), np.abs(rel_hi[:, :2]))
  d_max = np.hypot(far[:, 0], far[:, 1])
  # Azimuth extent: the footprint's corners, measured from its centre's azimuth so that wrapping at
  # +-pi needs no special case (a footprint not containing the sensor spans less than pi).
  mid = 0.5 * (rel_lo + rel_hi)
  centre = np.arctan2(mid[:, 1], mid[:, 0])
  cx = np.stack([rel_lo[:, 0], rel_hi[:, 0], rel_lo[:, 0], rel_hi[:, 0]], 1)
  cy = np.stack([rel_lo[:, 1], rel_lo[:, 1], rel_hi[:, 1], rel_hi[:, 1]], 1)
  delta = np.angle(np.exp(1j * (np.arctan2(cy, cx) - centre[:, None])))
  col0 = np.floor((centre + delta.min(1) - azimuth0) / step).astype(np.int64)
  cols = np.floor((centre + delta.max(1) - azimuth0) / step).astype(np.int64) - col0 + 2
  around = d_min == 0  # the sensor is above or below the footprint: every azimuth
  col0 = np.where(around, 0, col0 % n_cols)
  cols = np.where(around | (cols > n_cols), n_cols, cols)
  e_hi = np.arctan2(rel_hi[:, 2], np.where(rel_hi[:, 2] > 0, d_min, d_max))
  e_lo = np.arctan2(rel_lo[:, 2], np.where(rel_lo[:, 2] < 0, d_min, d_max))
  beam0 = np.searchsorted(elevations, e_lo, "left")
  beams = np.searchsorted(elevations, e_hi, "right") - beam0
  beams = np.where(d_min <= max_range, beams, 0)
  return col0, cols, beam0, beams


def _pair_chunks(col0, cols, beam0, beams, n_cols, n_beams, pair_chunk):
  """Yields (primitive, ray index) arrays of every ray-primitive pair to test, in chunks of whole
  primitives holding about pair_chunk pairs; ray index = column * n_beams + beam."""
  counts = cols * beams
  live = np.flatnonzero(counts > 0)
  ends = np.cumsum(counts[live])
  start = 0
  while start < len(live):
    base = ends[start - 1] if start else 0
    stop = max(int(np.searchsorted(ends, base + pair_chunk, "right")), start + 1)
    prims = live[start:stop]
    n = counts[prims]
    prim = np.repeat(prims, n)
    local = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    nb = beams[prim]
    col = (col0[prim] + local // nb) % n_cols
    yield prim, col * n_beams + beam0[prim] + local % nb
    start = stop


def _cast_sweep(scene, origin, elevations, azimuths, max_range, foliage_depth, rng, pair_chunk=1 << 19):
  """Nearest hit of every ray of one revolution: (t, primitive, |cos incidence|) per ray, t = inf on a miss.

  Rays are ordered column-major (ray = column * beams + beam). Solids are tested only against the rays
  their bounding boxes can meet, so the cost follows the pairs that matter rather than rays x primitives.
  """
  n_beams, n_cols = len(elevations), len(azimuths)
  cos_e, sin_e = np.cos(elevations), np.sin(elevations)
  cos_a, sin_a = np.cos(azimuths), np.sin(azimuths)

  def directions(ray):
    beam, col = ray % n_beams, ray // n_beams
    return np.stack([cos_e[beam] * cos_a[col], cos_e[beam] * sin_a[col], sin_e[beam]], axis=1)

  best_t, best_cos = _ray_ground(scene, origin, directions(np.arange(n_beams * n_cols)))
  best_prim = np.full(n_beams * n_cols, GROUND, np.int32)
  step = azimuths[1] - azimuths[0] if n_cols > 1 else 2 * np.pi
  offset = 0
  kinds = (
      ("box", scene.box_lo, scene.box_hi),
      ("cylinder", np.c_[scene.cylinder_center - scene.cylinder_radius[:, None], scene.cylinder_z[:, :1]],
       np.c_[scene.cylinder_center + scene.cylinder_radius[:, None], scene.cylinder_z[:, 1:]]),
      ("ellipsoid", scene.ellipsoid_center - scene.ellipsoid_radii, scene.ellipsoid_center + scene.ellipsoid_radii))
  for kind, lo, hi in kinds:
    visible = _visible_rays(lo, hi, origin, elevations, azimuths[0], step, n_cols, max_range)
    for prim, ray in _pair_chunks(*visible, n_cols, n_beams, pair_chunk):
      d = directions(ray)
      if kind == "box":
        t, cos = _ray_boxes(origin, d, scene.box_lo[prim], scene.box_hi[prim])
      elif kind == "cylinder":
        t, cos = _ray_cylinders(origin, d, scene.cylinder_center[prim], scene.cylinder_radius[prim],
                                scene.cylinder_z[prim])
      else:
        t, t_out, cos = _ray_ellipsoids(origin, d, scene.ellipsoid_center[prim], scene.ellipsoid_radii[prim])
        foliage = (scene.ellipsoid_label[prim] == VEGETATION) & np.isfinite(t)
        if foliage_depth > 0 and foliage.any():
          # Foliage is porous: a ray stops at a random depth inside the crown, or passes through it.
          t = t.copy()
          t[foliage] += rng.exponential(foliage_depth, int(foliage.sum()))
          t = np.where(t <= t_out, t, np.inf)
      hit = t < best_t[ray]
      ray, t, cos, prim = ray[hit], t[hit], cos[hit], prim[hit]
      np.minimum.at(best_t, ray, t)
      won = t == best_t[ray]
      best_prim[ray[won]] = prim[won] + offset
      best_cos[ray[won]] = cos[won]
    offset += len(lo)
  best_t[best_t > max_range] = np.inf
  return best_t, best_prim, best_cos


@dataclasses.dataclass(frozen=True, eq=False)
class LidarScan:
  """Points of one (multi-sweep) scan, in the sensor frame of the last sweep (x forward, y left, z up).

  points float32 [N, 3]; intensity float32 [N] in [0, 1]; ring int32 [N] (beam, 0 = lowest); sweep
  int32 [N] (0 = oldest); time_s float32 [N] (sweep time relative to the last sweep, <= 0); label int32
  [N] (SEMANTIC_CLASSES); primitive int32 [N] (index into the scene, GROUND for the ground);
  sensor_positions float64 [sweeps, 3]: the sensor's world position at each sweep (world = points +
  sensor_positions[-1]).
  """
  points: np.ndarray
  intensity: np.ndarray
  ring: np.ndarray
  sweep: np.ndarray
  time_s: np.ndarray
  label: np.ndarray
  primitive: np.ndarray
  sensor_positions: np.ndarray

  def __len__(self):
    return len(self.points)


def _ground_reflectivity(scene, x, y):
  """Asphalt or terrain by position, and painted lane markings: a dashed centre line and edge lines."""
  w = scene.road_half_width_m
  on_road = np.abs(y) <= w
  refl = np.where(on_road, CLASS_REFLECTIVITY[ROAD], CLASS_REFLECTIVITY[TERRAIN])
  if scene.lane_markings:
    centre = (np.abs(y) < 0.075) & (np.mod(x, 9.0) < 3.0)
    edge = (np.abs(y) > w - 0.35) & (np.abs(y) < w - 0.2)
    refl = np.where(on_road & (centre | edge), LANE_MARKING_REFLECTIVITY, refl)
  return refl, np.where(on_road, ROAD, TERRAIN).astype(np.int32)


def lidar_scan(scene: StreetScene, *, beams: int = 64, azimuth_step_deg: float = 0.2,
               elevation_deg=(-24.9, 2.0), beam_layout: str = "split", max_range_m: float = 80.0,
               sensor_height_m: float = 1.73, sweeps: int = 1, sweep_interval_s: float = 0.1,
               ego_speed_mps: float = 10.0, noise_m: float = 0.02, foliage_depth_m: float = 0.3,
               intensity_noise: float = 0.02, seed=0) -> LidarScan:
  """Simulates a spinning multi-beam LiDAR driving along `scene`, deterministic per seed.

  Each sweep casts beams x round(360 / azimuth_step_deg) rays (elevations from beam_elevations, a random
  azimuth phase per sweep) from the sensor at sensor_height_m above the ground on the line
  y = scene.ego_lane_y_m, and keeps the nearest hit within max_range_m; rays with no hit give no point.
  sweeps > 1 accumulates earlier sweeps taken every sweep_interval_s while the sensor drove along +x at
  ego_speed_mps and the boxes moved with their velocities (nuScenes-style multi-sweep aggregation: moving
  objects leave trails). The last sweep is at x = 0, earlier ones behind it.
  noise_m: standard deviation of the range noise (along the ray). foliage_depth_m: mean depth a ray
  travels into vegetation before it returns (0 gives hard surfaces). Intensity: the primitive's
  reflectivity times the cosine of the incidence angle, fading slowly with range, plus Gaussian noise of
  standard deviation intensity_noise, clipped to [0, 1].
  """
  rng = _as_rng(seed)
  sweeps = as_int(sweeps, "sweeps", minimum=1)  # int() truncated 1.5
  # NaN passed the <= 0 tests: a NaN step failed in int(round(...)), a NaN range gave no points.
  if not (np.isfinite(azimuth_step_deg) and azimuth_step_deg > 0 and np.isfinite(max_range_m) and max_range_m > 0):
    raise ValueError(f"need azimuth_step_deg > 0 and max_range_m > 0, finite; got {azimuth_step_deg}, {max_range_m}")
  elevations = beam_elevations(beams, elevation_deg, beam_layout)
  n_cols = max(int(round(360.0 / azimuth_step_deg)), 1)
  step = 2 * np.pi / n_cols
  reflectivity = scene.reflectivity
  labels = scene.labels
  times = -sweep_interval_s * np.arange(sweeps - 1, -1, -1, dtype=np.float64)
  positions = np.stack([times * ego_speed_mps, np.full_like(times, scene.ego_lane_y_m), np.zeros_like(times)], 1)
  positions[:, 2] = scene.ground_height(positions[:, 0], positions[:, 1]) + sensor_height_m
  parts = []
  for k, (time, origin) in enumerate(zip(times, positions)):
    azimuths = -np.pi + (np.arange(n_cols) + rng.uniform()) * step
    t, prim, cos = _cast_sweep(scene.at_time(time), origin, elevations, azimuths, max_range_m, foliage_depth_m, rng)
    ray = np.flatnonzero(np.isfinite(t))
    t, prim, cos = t[ray], prim[ray], cos[ray]
    beam, col = ray % len(elevations), ray // len(elevations)
    d = np.stack([np.cos(elevations[beam]) * np.cos(azimuths[col]), np.cos(elevations[beam]) * np.sin(azimuths[col]),
                  np.sin(elevations[beam])], axis=1)
    world = origin + t[:, None] * d
    ground = prim == GROUND
    refl = np.where(ground, 0.0, reflectivity[np.maximum(prim, 0)]) if len(reflectivity) else np.zeros(len(t))
    label = np.where(ground, 0, labels[np.maximum(prim, 0)]) if len(labels) else np.zeros(len(t), np.int32)
    ground_refl, ground_label = _ground_reflectivity(scene, world[:, 0], world[:, 1])
    refl = np.where(ground, ground_refl, refl)
    label = np.where(ground, ground_label, label)
    intensity = refl * cos * np.exp(-t / 200.0) + rng.normal(0.0, intensity_noise, len(t))
    if noise_m > 0:
      world = world + rng.normal(0.0, noise_m, len(t))[:, None] * d
    parts.append((world - positions[-1], np.clip(intensity, 0.0, 1.0), beam, np.full(len(t), k), np.full(len(t), time),
                  label, prim))
  cat = [np.concatenate(column) for column in zip(*parts)]
  return LidarScan(points=cat[0].astype(np.float32), intensity=cat[1].astype(np.float32),
                   ring=cat[2].astype(np.int32), sweep=cat[3].astype(np.int32), time_s=cat[4].astype(np.float32),
                   label=cat[5].astype(np.int32), primitive=cat[6].astype(np.int32), sensor_positions=positions)


# ---- Voxels for the networks benchmark -------------------------------------------------------------

KITTI_POINT_CLOUD_RANGE = (0.0, -40.0, -3.0, 70.4, 40.0, 1.0)  # SECOND / VoxelNet on KITTI: x_min, ..., z_max


def lidar_voxels(points, intensity=None, *, voxel_size=(0.05, 0.05, 0.1),
                 point_cloud_range=KITTI_POINT_CLOUD_RANGE):
  """Occupied voxels of a point cloud: (coords int32 [M, 3], feats float32 [M, C], spatial_shape).

  Axis order is (x, y, z) throughout, as in jsparse coords (batch, x, y, z); SECOND's spconv code uses
  (z, y, x) with one extra z layer, so KITTI's [41, 1600, 1408] there is (1408, 1600, 40) here.
  point_cloud_range = (x_min, y_min, z_min, x_max, y_max, z_max) in the points' frame; points outside
  [min, max) are dropped. spatial_shape = round((max - min) / voxel_size). Rows are unique and sorted by
  linear key (x, y, z). feats: the mean (x, y, z) of the voxel's points, and their mean intensity as a
  fourth channel when intensity [N] is given (the "mean VFE" input of SECOND-style backbones).
  """
  p = np.asarray(points, np.float64)
  if p.ndim != 2 or p.shape[1] != 3:
    raise ValueError(f"points must be [N, 3], got shape {p.shape}")
  pcr = np.asarray(point_cloud_range, np.float64)
  vs = _vec3(voxel_size, "voxel_size")  # 2 values failed in numpy's broadcast, naming nothing
  # NaN passed the <= tests and gave an empty result.
  if (pcr.shape != (6,) or not np.all(np.isfinite(pcr)) or not np.all(np.isfinite(vs) & (vs > 0))
      or np.any(pcr[3:] <= pcr[:3])):
    raise ValueError(f"need point_cloud_range (6 values, min < max) and positive voxel_size, got "
                     f"{point_cloud_range}, {voxel_size}")
  shape = np.maximum(np.round((pcr[3:] - pcr[:3]) / vs).astype(np.int64), 1)
  key_width(1, shape.tolist())  # ValueError past the grids jsparse can key
  idx = np.floor((p - pcr[:3]) / vs).astype(np.int64)
  keep = np.all((p >= pcr[:3]) & (p < pcr[3:]) & (idx >= 0) & (idx < shape), axis=1)
  p, idx = p[keep], idx[keep]
  if intensity is not None:
    intensity = np.asarray(intensity, np.float64).reshape(-1)
    if intensity.shape != keep.shape:  # a boolean-index IndexError named neither argument
      raise ValueError(f"intensity must have one value per point ({keep.shape[0]}), got shape {intensity.shape}")
  per_point = p if intensity is None else np.c_[p, intensity[keep]]
  keys = (idx[:, 0] * shape[1] + idx[:, 1]) * shape[2] + idx[:, 2]
  unique, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
  feats = np.stack([np.bincount(inverse, weights=f, minlength=len(unique)) for f in per_point.T], axis=1)
  feats = feats.reshape(len(unique), per_point.shape[1]) / counts[:, None]
  coords = np.stack([unique // (shape[1] * shape[2]), unique // shape[2] % shape[1], unique % shape[2]], axis=1)
  return coords.astype(np.int32), feats.astype(np.float32), tuple(int(s) for s in shape)


# Scan settings of lidar_batch, by name. Voxel counts are totals over the batch (see lidar_batch).
LIDAR_PRESETS = {
    "100k": dict(batch_size=1, beams=128, azimuth_step_deg=0.08, sweeps=1),
    "1m": dict(batch_size=8, beams=128, azimuth_step_deg=0.1, sweeps=2),
}


def lidar_batch(seed: int, batch_size: int | None = None, *, preset: str = "100k", voxel_size=(0.05, 0.05, 0.1),
                point_cloud_range=KITTI_POINT_CLOUD_RANGE, scene_options=None, **scan_options):
  """A batch of voxelised street scans for sparse-conv benchmarks: (coords, feats, spatial_shape).

  coords int32 [N, 4] (batch, x, y, z), unique and sorted by (batch, x, y, z); feats float32 [N, 4], the
  voxel's mean point (x, y, z) and mean intensity; spatial_shape (X, Y, Z) of one element (see
  lidar_voxels; the defaults are SECOND's KITTI grid, (1408, 1600, 40)). Element i is
  lidar_voxels(lidar_scan(street_scene(...))) with a scene and a scan drawn from (seed, i), so it does not
  depend on batch_size. seed: a non-negative int.

  preset names an entry of LIDAR_PRESETS (its batch_size and lidar_scan settings); batch_size and
  scan_options (lidar_scan keywords) override it, scene_options go to street_scene. N is the total over
  the batch:
  - "100k": one scan, 128 beams, 0.08 deg azimuth step, 1 sweep, 0.05 x 0.05 x 0.1 m voxels: about 100k
    voxels (75k to 120k by seed).
  - "1m": eight scans, 128 beams, 0.1 deg, 2 sweeps each, same voxels: about 1M voxels (about 120k per
    scan). One scan saturates well below 1M in this grid: ten sweeps give about 250k, since further
    sweeps mostly land in the near surfaces' voxels that are already occupied.
  - A 64-beam, 0.2 deg single sweep (KITTI's HDL-64E; beams=64, azimuth_step_deg=0.2) gives about 40k.
  """
  if preset not in LIDAR_PRESETS:
    raise ValueError(f"preset must be one of {tuple(LIDAR_PRESETS)}, got {preset!r}")
  settings = dict(LIDAR_PRESETS[preset])
  preset_batch = settings.pop("batch_size")
  settings.update(scan_options)
  # as_int, not int(): 1.7 made one scan, seed 1.5 seed 1.
  batch_size = preset_batch if batch_size is None else as_int(batch_size, "batch_size", minimum=1)
  seed = as_int(seed, "seed", minimum=0)
  coords, feats, shape = [], [], None
  for i in range(batch_size):
    scene_seed, scan_seed = np.random.SeedSequence([seed, i]).spawn(2)
    scene = street_scene(np.random.default_rng(scene_seed), **(scene_options or {}))
    scan = lidar_scan(scene, seed=np.random.default_rng(scan_seed), **settings)
    c, f, shape = lidar_voxels(scan.points, scan.intensity, voxel_size=voxel_size,
                               point_cloud_range=point_cloud_range)
    coords.append(np.c_[np.full(len(c), i, np.int32), c])
    feats.append(f)
  key_width(batch_size, shape)  # ValueError past the grids jsparse can key
  return np.concatenate(coords), np.concatenate(feats), shape
