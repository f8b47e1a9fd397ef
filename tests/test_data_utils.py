"""Data utilities: voxelize, procedural shapes, space-filling-curve serialisation, grid_sample, plotting."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jsparse import SparseTensor
from jsparse import serialize, shapes
from jsparse import voxelize as voxelize_lib
from jsparse.sampling import grid_sample, lookup_rows
from jsparse.sparse_tensor import round_capacity
from jsparse.voxelize import voxel_centres, voxelize, voxelize_jit


# ---- voxelize ----------------------------------------------------------------------------------------

def _voxelize_ref(points, feats, batch, voxel_size, origin, reduce):
  """Plain-Python reference: dict from (b, i, j, k) to the list of point features, in input order."""
  groups = {}
  idx = np.floor((points - origin) / voxel_size).astype(np.int64)
  for n in range(len(points)):
    groups.setdefault((int(batch[n]),) + tuple(int(v) for v in idx[n]), []).append(feats[n])
  out = {}
  for k, fs in groups.items():
    fs = np.stack(fs)
    out[k] = dict(sum=fs.sum(0), mean=fs.mean(0), max=fs.max(0), first=fs[0])[reduce]
  return out


def _as_dict(t: SparseTensor):
  n = int(t.num)
  return {tuple(int(v) for v in c): np.asarray(f) for c, f in zip(np.asarray(t.coords[:n]), t.feats[:n])}


def _cloud(seed=0, n=400):
  rng = np.random.default_rng(seed)
  pts = rng.uniform(-1.0, 1.0, (n, 3)).astype(np.float32)
  feats = rng.normal(size=(n, 3)).astype(np.float32)
  batch = rng.integers(0, 2, n)
  return pts, feats, batch


@pytest.mark.parametrize("reduce", ["mean", "sum", "max", "first"])
def test_voxelize_matches_reference(reduce):
  pts, feats, batch = _cloud()
  t = voxelize(pts, feats, voxel_size=0.25, origin=(-1, -1, -1), spatial_shape=(8, 8, 8), batch=batch,
               reduce=reduce)
  ref = _voxelize_ref(pts, feats, batch, 0.25, np.array([-1.0, -1, -1]), reduce)
  got = _as_dict(t)
  assert got.keys() == ref.keys()
  for k in ref:
    np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-6)
  # Rows sorted by linear key, padding rows -1 / 0.
  keys = np.asarray(t.linear_keys()[: int(t.num)])
  assert np.all(np.diff(keys) > 0)
  assert np.all(np.asarray(t.coords[int(t.num):]) == -1) and np.all(np.asarray(t.feats[int(t.num):]) == 0)
  assert t.batch_size == 2 and t.spatial_shape == (8, 8, 8)


def test_voxelize_defaults_occupancy_and_grad():
  pts = np.array([[0.1, 0.1, 0.1], [0.2, 0.3, 0.1], [1.5, 0.1, 0.1]], np.float32)
  t = voxelize(pts, None, voxel_size=1.0, reduce="sum")  # origin = min, grid = smallest holding all
  assert t.spatial_shape == (2, 1, 1) and int(t.num) == 2 and t.num_channels == 1
  np.testing.assert_allclose(np.asarray(t.feats[:2, 0]), [2.0, 1.0])
  # Differentiable w.r.t. the point features.
  f = jnp.asarray(np.arange(6, dtype=np.float32).reshape(3, 2))
  g = jax.grad(lambda f: jnp.sum(voxelize(pts, f, voxel_size=1.0, reduce="mean").feats ** 2))(f)
  np.testing.assert_allclose(np.asarray(g), [[1, 2], [1, 2], [8, 10]], rtol=1e-6)  # 2*mean/2, 2*f


def test_voxelize_errors():
  pts = np.array([[0.5, 0.5, 0.5], [3.5, 0.5, 0.5], [-0.5, 0.5, 0.5]], np.float32)
  with pytest.raises(ValueError, match="2 of 3 points fall outside"):
    voxelize(pts, voxel_size=1.0, origin=0.0, spatial_shape=(2, 2, 2))
  with pytest.raises(ValueError, match="reduce"):
    voxelize(pts, voxel_size=1.0, reduce="median")
  with pytest.raises(ValueError, match="capacity"):
    voxelize(pts, voxel_size=1.0, capacity=2)
  with pytest.raises(ValueError, match="points must be"):
    voxelize(pts[:, :2], voxel_size=1.0)
  with pytest.raises(TypeError, match="voxelize_jit"):
    jax.jit(lambda p: voxelize(p, voxel_size=1.0))(pts)


@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_voxelize_jit_matches_and_flags_overflow(reduce):
  pts, feats, batch = _cloud(1)
  kw = dict(voxel_size=0.25, origin=(-1.0, -1.0, -1.0), spatial_shape=(8, 8, 8), batch_size=2, reduce=reduce)
  host = voxelize(pts, feats, batch=batch, **kw)
  n = int(host.num)

  @jax.jit
  def run(p, f, b):
    return voxelize_jit(p, f, batch=b, capacity=n + 5, **kw)

  t, overflow = run(pts, feats, batch)
  assert not bool(overflow) and int(t.num) == n
  np.testing.assert_array_equal(np.asarray(t.coords[:n]), np.asarray(host.coords[:n]))
  np.testing.assert_allclose(np.asarray(t.feats[:n]), np.asarray(host.feats[:n]), rtol=1e-6)
  assert np.all(np.asarray(t.coords[n:]) == -1) and np.all(np.asarray(t.feats[n:]) == 0)

  small, overflow = jax.jit(lambda p, f, b: voxelize_jit(p, f, batch=b, capacity=n - 3, **kw))(pts, feats, batch)
  assert bool(overflow) and int(small.num) == n - 3
  np.testing.assert_array_equal(np.asarray(small.coords), np.asarray(host.coords[: n - 3]))

  # Points outside the grid are dropped under jit, not raised on.
  far = np.concatenate([pts, [[5.0, 0, 0]]]).astype(np.float32)
  t2, overflow = voxelize_jit(far, None, capacity=n + 5, **{**kw, "batch_size": 1})
  assert not bool(overflow) and int(t2.num) == len(np.unique(np.floor((pts + 1) / 0.25), axis=0))


def _count_compiles(fn):
  """(fn's result, the number of XLA backend compilations while it ran)."""
  compiles = []
  listener = lambda event, duration, **kw: compiles.append(event) if event == _COMPILE_EVENT else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    out = fn()
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  return out, len(compiles)


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@pytest.mark.parametrize("dedup", ["numpy", "xla"])
def test_voxelize_compiles_once_per_size_bucket(dedup):
  """20 clouds of distinct sizes (and grids) share a few programs: one per bucket of N and of capacity."""
  rng = np.random.default_rng(7)
  sizes = rng.choice(np.arange(3000, 4000), 20, replace=False)
  extents = rng.uniform(0.9, 1.0, 20)
  clouds = [(rng.uniform(0, e, (n, 3)).astype(np.float32), rng.normal(size=(n, 2)).astype(np.float32))
            for n, e in zip(sizes, extents)]

  def stream():
    return [jax.block_until_ready(voxelize(p, f, voxel_size=0.02, dedup=dedup)) for p, f in clouds]

  tensors, compiles = _count_compiles(stream)
  point_buckets = {round_capacity(n) for n in sizes}
  programs = {(round_capacity(n), t.capacity) for n, t in zip(sizes, tensors)}  # (points, voxels) buckets
  print(f"{compiles} compilations; buckets: {len(point_buckets)} of N, {len(programs)} of (N, capacity)")
  assert 3 <= len(point_buckets) <= 5 and len(programs) <= 2 * len(point_buckets)  # 20 sizes, a handful of programs
  assert compiles <= len(programs) + (len(point_buckets) if dedup == "xla" else 0)
  assert len({t.spatial_shape for t in tensors}) > 1  # the grid is not part of the compiled program
  # Still right: the last cloud against the plain reference.
  (p, f), t = clouds[-1], tensors[-1]
  ref = _voxelize_ref(p, f, np.zeros(len(p), int), 0.02, p.min(axis=0).astype(np.float64), "mean")
  got = _as_dict(t)
  assert got.keys() == ref.keys()
  np.testing.assert_allclose(np.stack([got[k] for k in ref]), np.stack(list(ref.values())), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dedup", ["numpy", "xla"])
def test_host_data_of_new_sizes_compiles_nothing_within_a_bucket(dedup):
  """from_coords and voxelize(return_index=True) on numpy data of new sizes whose capacity bucket is known
  compile no program: jnp.asarray of numpy compiled one per shape, and the eager ops on [N] rows more."""
  rng = np.random.default_rng(11)
  sizes = [3001, 3003, 3005, 3007, 3011]
  clouds = [rng.uniform(0, 1, (n, 3)) for n in sizes]  # float64, as a LiDAR pipeline's numpy often is
  feats = [rng.normal(size=(n, 2)) for n in sizes]
  cells = [np.unique(np.floor(p / 0.02).astype(np.int32), axis=0) for p in clouds]
  coords = [np.concatenate([np.zeros((len(c), 1), np.int32), c], 1) for c in cells]

  def stream(i):
    t, rows = voxelize(clouds[i], feats[i], voxel_size=0.02, origin=(0.0, 0.0, 0.0), spatial_shape=(50, 50, 50),
                       dedup=dedup, return_index=True)
    s = SparseTensor.from_coords(coords[i], feats[i][:len(coords[i])], (50, 50, 50), 1)
    return jax.block_until_ready((t, rows, s))

  first = stream(0)
  outs, compiles = _count_compiles(lambda: [stream(i) for i in range(1, len(sizes))])
  assert len({t.capacity for t, _, _ in [first, *outs]}) == 1 and len({s.capacity for *_, s in [first, *outs]}) == 1
  assert compiles == 0
  for (t, rows, s), p, f, c in zip(outs, clouds[1:], feats[1:], coords[1:]):
    assert rows.dtype == jnp.int32 and rows.shape == (len(p),)
    np.testing.assert_array_equal(np.asarray(t.coords)[np.asarray(rows), 1:], np.floor(p / 0.02).astype(np.int32))
    assert s.feats.dtype == jnp.float32 and int(s.num) == len(c)
    np.testing.assert_array_equal(np.asarray(s.coords[: len(c)]), c)
    np.testing.assert_array_equal(np.asarray(s.feats), np.concatenate(
        [f[: len(c)].astype(np.float32), np.zeros((s.capacity - len(c), 2), np.float32)]))


def test_voxelize_capacity_and_dedup_options():
  pts, feats, batch = _cloud(3, 1000)
  kw = dict(voxel_size=0.5, batch=batch, reduce="sum")
  t = voxelize(pts, feats, **kw)
  n = int(t.num)
  assert t.capacity == round_capacity(n)
  exact = voxelize(pts, feats, capacity="exact", **kw)
  assert exact.capacity == n
  wide = voxelize(pts, feats, capacity=5000, **kw)  # more rows than points
  assert wide.capacity == 5000 and int(wide.num) == n and np.all(np.asarray(wide.coords[n:]) == -1)
  on_device = voxelize(pts, feats, dedup="xla", **kw)
  for other in (exact, wide, on_device):
    np.testing.assert_array_equal(np.asarray(other.coords[:n]), np.asarray(t.coords[:n]))
    np.testing.assert_allclose(np.asarray(other.feats[:n]), np.asarray(t.feats[:n]), rtol=1e-6)
  with pytest.raises(ValueError, match="capacity 3 is smaller"):
    voxelize(pts, feats, capacity=3, **kw)
  with pytest.raises(TypeError, match="capacity"):
    voxelize(pts, feats, capacity="auto", **kw)
  with pytest.raises(ValueError, match="dedup"):
    voxelize(pts, feats, dedup="cuda", **kw)
  # Under an outer jit that traces only the feats, both dedups still find the voxels concretely.
  for dedup in ("numpy", "xla"):
    traced = jax.jit(lambda f: voxelize(pts, f, dedup=dedup, **kw).feats)(feats)
    np.testing.assert_allclose(np.asarray(traced), np.asarray(t.feats), rtol=1e-6)


@pytest.mark.parametrize("dtype,reduce,values,expected", [
    (jnp.bfloat16, "mean", np.r_[np.zeros(300), np.ones(300)], 0.5),  # bf16 partial sums stall at 256
    (jnp.float16, "sum", np.ones(3000), 3000.0),  # fp16 partial sums stall at 2048
])
def test_voxelize_half_precision_accumulates_in_float32(dtype, reduce, values, expected):
  pts = np.full((len(values), 3), 0.5, np.float32)  # all in one voxel
  feats = jnp.asarray(values, dtype)
  t = voxelize(pts, feats, voxel_size=1.0, reduce=reduce)
  t_jit, _ = jax.jit(lambda p, f: voxelize_jit(p, f, voxel_size=1.0, origin=0.0, spatial_shape=(2, 2, 2),
                                               capacity=4, reduce=reduce))(pts, feats)
  for x in (t, t_jit):
    assert x.feats.dtype == dtype and float(x.feats[0, 0]) == expected
  # Both reduction paths (the GPU's segmented scan too).
  plan = jax.device_put(voxelize_lib._host_plan(np.zeros(len(values), np.int64), len(values), (1, 1, 1)))
  for segment_impl in ("scatter", "scan"):
    _, out, _ = voxelize_lib._reduce_jit(plan, feats[:, None], capacity=1, reduce=reduce, segment_impl=segment_impl)
    assert out.dtype == dtype and float(out[0, 0]) == expected, segment_impl


@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "first"])
def test_voxel_reductions_scan_matches_scatter(reduce):
  """The segmented scan (GPU) and the segment_sum/max (CPU) reductions agree, with their gradients, when
  the capacity cuts voxels off and when it exceeds the points."""
  rng = np.random.default_rng(4)
  keys = rng.integers(0, 60, 500).astype(np.int32)
  keys[rng.random(500) < 0.1] = voxelize_lib.DROPPED_KEY  # points outside the grid under jit
  feats = jnp.asarray(rng.normal(size=(500, 3)).astype(np.float32))
  plan = voxelize_lib._device_plan_jit(keys, np.array([60, 1, 1], np.int32))
  count = len(np.unique(keys[keys != voxelize_lib.DROPPED_KEY]))
  assert int(plan.count) == count
  for capacity in (count - 7, 600):
    def loss(f, segment_impl):
      coords, out, num = voxelize_lib._reduce(plan, f, capacity=capacity, reduce=reduce, segment_impl=segment_impl)
      return jnp.sum(out * jnp.arange(1.0, 4.0)), (coords, out, num)

    # Jitted (as voxelize_jit runs them): eagerly, every primitive of both passes compiled as its own program.
    value_and_grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (_, (c1, o1, n1)), g1 = value_and_grad(feats, "scatter")
    (_, (c2, o2, n2)), g2 = value_and_grad(feats, "scan")
    assert int(n1) == int(n2) == min(count, capacity)
    np.testing.assert_array_equal(np.asarray(c1), np.asarray(c2))
    np.testing.assert_allclose(np.asarray(o1), np.asarray(o2), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g2), rtol=1e-6, atol=1e-6)
    # Rows of points that were dropped get no gradient.
    assert np.all(np.asarray(g1)[keys == voxelize_lib.DROPPED_KEY] == 0)


def test_voxelize_grids_past_int32_keys():
  """2048^3 voxels need 33-bit keys: two points 1024 voxels apart used to merge silently under jit; now such
  grids take two-word keys (tests/test_wide_keys.py), and grids past 2**62 sites or 2**21 per axis raise."""
  pts = np.array([[0.5, 0.5, 0.5], [1024.5, 0.5, 0.5]], np.float32)
  t, overflow = voxelize_jit(pts, voxel_size=1.0, origin=0.0, spatial_shape=(2048, 2048, 2048), capacity=4)
  assert int(t.num) == 2 and not bool(overflow)
  assert int(voxelize(pts, voxel_size=1.0, origin=0.0, spatial_shape=(2048, 2048, 2048)).num) == 2
  with pytest.raises(ValueError, match=r"spatial_shape.*2\*\*21"):
    voxelize_jit(pts, voxel_size=1.0, origin=0.0, spatial_shape=(2**21, 4, 4), capacity=4)
  with pytest.raises(ValueError, match=r"batch_size=4.*2\*\*62"):
    voxelize(pts, voxel_size=1.0, origin=0.0, spatial_shape=(2**20, 2**20, 2**20), batch_size=4)
  t, overflow = voxelize_jit(pts, voxel_size=1.0, origin=0.0, spatial_shape=(2047, 1024, 1024), capacity=4)
  assert int(t.num) == 2 and not bool(overflow)


def test_voxel_centres():
  pts, feats, _ = _cloud(2, 50)
  t = voxelize(pts, feats, voxel_size=0.5, origin=(-1, -1, -1), spatial_shape=(4, 4, 4))
  centres, valid = voxel_centres(t, voxel_size=0.5, origin=(-1, -1, -1))
  n = int(t.num)
  assert np.asarray(valid).sum() == n and centres.shape == (t.capacity, 3)
  c = np.asarray(centres[:n])
  np.testing.assert_allclose(c, -1 + (np.asarray(t.coords[:n, 1:]) + 0.5) * 0.5)
  # Re-voxelising the centres gives back the same sites.
  again = voxelize(c, None, voxel_size=0.5, origin=(-1, -1, -1), spatial_shape=(4, 4, 4))
  np.testing.assert_array_equal(np.asarray(again.coords[:n]), np.asarray(t.coords[:n]))


# ---- shapes ------------------------------------------------------------------------------------------

def test_shape_geometry():
  r = 10.0
  t, m = shapes.sphere(32, radius=r, return_dense=True)
  assert abs(int(t.num) - 4 / 3 * math.pi * r**3) / (4 / 3 * math.pi * r**3) < 0.03
  assert int(t.num) == m.sum()
  # The dense mask and the sparse tensor agree.
  np.testing.assert_array_equal(np.asarray(t.todense())[0, ..., 0] > 0, m)
  b, bm = shapes.box(16, half_size=(3, 2, 4), center=(8, 8, 8), channels=4, return_dense=True)
  assert int(b.num) == 6 * 4 * 8 and b.num_channels == 4
  idx = np.argwhere(bm)
  np.testing.assert_array_equal(idx.min(0), [5, 6, 4])
  np.testing.assert_array_equal(idx.max(0), [10, 9, 11])
  tor = shapes.torus_mask(48, major=12, minor=4)
  assert abs(tor.sum() - 2 * math.pi**2 * 12 * 16) / (2 * math.pi**2 * 12 * 16) < 0.05
  sh = shapes.shell_mask(32, radius=10, thickness=2)
  vol = 4 / 3 * math.pi * (10**3 - 8**3)
  assert abs(sh.sum() - vol) / vol < 0.06
  assert not (sh & shapes.sphere_mask(32, radius=7.5)).any()  # hollow


def test_random_shapes_deterministic_and_nonempty():
  key = jax.random.key(3)
  t1, m1 = shapes.random_shapes(key, 4, 16, return_dense=True)
  t2 = shapes.random_shapes(key, 4, 16)
  np.testing.assert_array_equal(np.asarray(t1.coords), np.asarray(t2.coords))
  t3 = shapes.random_shapes(jax.random.key(4), 4, 16)
  assert t3.num != t1.num or not np.array_equal(np.asarray(t3.coords), np.asarray(t1.coords))
  assert t1.batch_size == 4 and m1.shape == (4, 16, 16, 16)
  assert all(m1[b].any() for b in range(4))
  np.testing.assert_array_equal(np.asarray(t1.todense())[..., 0] > 0, m1)
  # Raw uint32 keys work too; a single union; kinds are validated.
  u = shapes.random_union(jax.random.PRNGKey(0), 12, kinds=("box",), channels=2)
  assert int(u.num) > 0 and u.num_channels == 2
  with pytest.raises(ValueError, match="kinds"):
    shapes.random_shapes(key, 2, 8, kinds=("cone",))


@pytest.mark.parametrize("partitionable", [True, False])
@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_random_shapes_items_do_not_depend_on_the_batch_size(partitionable, impl):
  """Element i depends only on (key, i), as documented: with jax_threefry_partitionable off (JAX's default before
  0.5, still a supported setting) split(key, n)[i] changes with n, so a batch of 3 began with other shapes than a
  batch of 2 from the same key."""
  key = jax.random.key(3, impl=impl)
  with jax.threefry_partitionable(partitionable):
    _, two = shapes.random_shapes(key, 2, 8, return_dense=True)
    _, three = shapes.random_shapes(key, 3, 8, return_dense=True)
  np.testing.assert_array_equal(two, three[:2])

def test_masks_to_tensor_matches_from_coords():
  m = shapes.random_shapes(jax.random.key(5), 3, 8, return_dense=True)[1]
  t = shapes.masks_to_tensor(m, channels=2, capacity=1024)
  ref = SparseTensor.from_coords(np.argwhere(m), np.ones((int(m.sum()), 2), np.float32), (8, 8, 8), batch_size=3,
                                 capacity=1024)
  for a, b in ((t.coords, ref.coords), (t.feats, ref.feats), (t.num, ref.num)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert (t.spatial_shape, t.batch_size, t.feats.dtype) == ((8, 8, 8), 3, jnp.float32)
  np.testing.assert_array_equal(np.asarray(shapes.masks_to_tensor(m[0]).todense())[0, ..., 0] > 0, m[0])
  assert shapes.masks_to_tensor(np.zeros((2, 4, 4, 4), bool), capacity=8).num == 0
  with pytest.raises(ValueError, match="capacity"):
    shapes.masks_to_tensor(m, capacity=int(m.sum()) - 1)
  with pytest.raises(ValueError, match="masks must be"):
    shapes.masks_to_tensor(np.zeros((4, 4), bool))


# ---- serialisation -----------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [1, 3, 10])
def test_morton_hilbert_round_trip(bits):
  rng = np.random.default_rng(bits)
  xyz = rng.integers(0, 2**bits, (2000, 3)).astype(np.int32)
  for enc, dec in ((serialize.encode_morton, serialize.decode_morton),
                   (serialize.encode_hilbert, serialize.decode_hilbert)):
    k = jax.jit(lambda v: enc(v, bits))(xyz)
    assert k.dtype == jnp.int32 and int(k.min()) >= 0 and int(k.max()) < 2 ** (3 * bits)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda k: dec(k, bits))(k)), xyz)


def test_curves_are_bijections_and_hilbert_adjacent():
  g = np.stack(np.meshgrid(*[np.arange(8)] * 3, indexing="ij"), -1).reshape(-1, 3)
  for enc in (serialize.encode_morton, serialize.encode_hilbert):
    np.testing.assert_array_equal(np.sort(np.asarray(enc(g, 3))), np.arange(512))
  path = np.asarray(serialize.decode_hilbert(jnp.arange(512), 3))
  steps = np.abs(np.diff(path, axis=0)).sum(axis=1)
  assert np.all(steps == 1)  # consecutive Hilbert keys are face neighbours
  np.testing.assert_array_equal(path[0], [0, 0, 0])
  # Morton is the plain bit interleave (x most significant).
  assert int(serialize.encode_morton(np.array([1, 0, 0]), 3)) == 4
  assert int(serialize.encode_morton(np.array([0, 0, 2]), 3)) == 8
  assert int(serialize.fold_batch(3, 5, 8)) == 3 * 2**24 + 5 and serialize.max_folded_batch(10) == 2
  assert serialize.encode_morton(g, 11).shape == (512, 2)  # past 10 bits per axis: two int32 words
  with pytest.raises(ValueError, match="bits"):
    serialize.encode_morton(g, 22)
  with pytest.raises(ValueError, match="bits"):  # a folded key is one word
    serialize.fold_batch(0, 0, 11)


@pytest.mark.parametrize("order", ["morton", "hilbert", "linear"])
def test_sort_by(order):
  t = shapes.random_shapes(jax.random.key(0), 2, 12, channels=1)
  feats = jax.random.normal(jax.random.key(1), (t.capacity, 3))
  t = t.replace(feats=jnp.where(t.valid_mask()[:, None], feats, 0))
  # Scramble the row order first, so sorting has work to do.
  n = int(t.num)
  perm0 = np.concatenate([np.random.default_rng(0).permutation(n), np.arange(n, t.capacity)])
  t = t.replace(coords=t.coords[perm0], feats=t.feats[perm0])
  s, perm = jax.jit(lambda x: serialize.sort_by(x, order))(t)
  np.testing.assert_array_equal(np.asarray(s.coords), np.asarray(t.coords)[np.asarray(perm)])
  rows = lambda x: sorted(map(tuple, np.concatenate([np.asarray(x.coords[:n]), np.asarray(x.feats[:n])], 1)))
  assert rows(s) == rows(t)
  assert np.all(np.asarray(s.coords[n:]) == -1) and np.all(np.asarray(s.feats[n:]) == 0)
  assert int(s.num) == n
  c = np.asarray(s.coords[:n])
  assert np.all(np.diff(c[:, 0]) >= 0)  # batches stay contiguous
  k = np.asarray(serialize.serialization_keys(s, order))[:n]
  for b in range(2):
    assert np.all(np.diff(k[c[:, 0] == b]) > 0)
  if order == "hilbert":  # within a batch, the full-grid curve visits sites in key order
    path = np.asarray(serialize.decode_hilbert(k, serialize.bits_for(s.spatial_shape)))
    np.testing.assert_array_equal(path, c[:, 1:])


def test_random_shapes_zero_shapes_give_empty_items():
  # num_shapes=(0, k) allows elements with no shapes; such an element got one voxel at the grid's centre (the
  # fallback for drawn shapes too small to cover a voxel centre), so a batch meant to hold empty items had none.
  t, masks = shapes.random_shapes(jax.random.key(3), 4, 8, num_shapes=(0, 0), return_dense=True)
  assert int(t.num) == 0 and not masks.any()
  assert not shapes.random_union_mask(jax.random.key(3), 8, num_shapes=(0, 0)).any()
  # Drawn shapes still never give an empty mask, on a grid too small for them too.
  for k in range(4):
    assert shapes.random_union_mask(jax.random.key(k), 1, num_shapes=(1, 1)).sum() == 1
  t, masks = shapes.random_shapes(jax.random.key(5), 6, 8, num_shapes=(0, 1), return_dense=True)
  counts = masks.reshape(6, -1).sum(axis=1)
  assert (counts == 0).any() and (counts > 1).any()
  np.testing.assert_array_equal(np.asarray(t.todense())[..., 0] > 0, masks)


# ---- grid_sample -------------------------------------------------------------------------------------

def _sample_tensor(seed=0, channels=3):
  key = jax.random.key(seed)
  t = shapes.random_shapes(key, 2, 8, num_shapes=(2, 3))
  f = jax.random.normal(jax.random.fold_in(key, 1), (t.capacity, channels))
  return t.replace(feats=jnp.where(t.valid_mask()[:, None], f, 0))


@functools.partial(jax.jit, static_argnames="order")
def _map_coordinates_per_point(dense, u, batch, order=1):
  """scipy's map_coordinates of dense[batch[i], ..., c] at the point u[i] (voxel units, already shifted by half a
  voxel), every channel c: [P, C]. One jitted program, vmapped over the points (eagerly, every point's
  map_coordinates dispatched and compiled its primitives one by one)."""
  def one(q, b):
    return jnp.stack([jax.scipy.ndimage.map_coordinates(dense[b, ..., c], list(q[:, None]), order=order,
                                                        mode="constant", cval=0.0)[0]
                      for c in range(dense.shape[-1])])
  return jax.vmap(one)(u, jnp.asarray(batch))


def _dense_ref(t, points, batch, order):
  """scipy's map_coordinates at the points shifted by half a voxel (voxel centres sit at index + 0.5)."""
  return np.asarray(_map_coordinates_per_point(t.todense(), np.asarray(points) - 0.5, batch, order=order))


def test_grid_sample_trilinear_matches_dense():
  t = _sample_tensor()
  rng = np.random.default_rng(0)
  pts = rng.uniform(-1.5, 8.5, (300, 3)).astype(np.float32)  # some outside the grid
  pts[:20] = np.round(pts[:20]) + 0.5  # exactly on voxel centres
  batch = rng.integers(0, 2, 300)
  got = jax.jit(grid_sample)(t, pts, batch=batch)
  np.testing.assert_allclose(np.asarray(got), _dense_ref(t, pts, batch, 1), rtol=1e-5, atol=1e-5)
  # [B, P, 3] form: the leading axis is the batch. Jitted: eagerly, each primitive compiled as its own program.
  pts2 = pts[:100].reshape(2, 50, 3)
  ref2 = _dense_ref(t, pts2.reshape(-1, 3), np.repeat([0, 1], 50), 1).reshape(2, 50, -1)
  # A NaN point (the last of item 1) samples zeros instead of poisoning the output.
  pts2[1, -1] = np.nan
  got2 = np.asarray(jax.jit(grid_sample)(t, pts2))
  assert np.all(got2[1, -1] == 0)
  np.testing.assert_allclose(got2[0], ref2[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got2[1, :-1], ref2[1, :-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ndim", [2, 1])
def test_grid_sample_on_2d_and_1d_tensors_blends_over_their_own_axes(ndim):
  """A 2D / 1D tensor takes [P, 2] / [P, 1] points and blends bilinearly / linearly (scipy on its dense grid),
  values and gradients with respect to the points; 3-value points are refused (they blended across the lifted
  depth-1 axis, halving every value sampled at 0 there)."""
  rng = np.random.default_rng(ndim)
  shape = (6, 7)[:ndim] if ndim == 2 else (9,)
  full = np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij"), -1).reshape(-1, ndim)
  sites = full[rng.random(len(full)) < 0.5]
  coords = np.concatenate([rng.integers(0, 2, (len(sites), 1)), sites], 1).astype(np.int32)
  coords = np.unique(coords, axis=0)
  t = SparseTensor.from_coords(coords, rng.standard_normal((len(coords), 2)).astype(np.float32), shape,
                                       batch_size=2)
  pts = rng.uniform(-1.0, max(shape) + 1.0, (60, ndim)).astype(np.float32)
  batch = rng.integers(0, 2, 60)
  vs, org = 0.5, -0.25  # world units: u = (p - org) / vs

  def reference(p):
    return _map_coordinates_per_point(t.todense(), (p - org) / vs - 0.5, batch)  # t.todense(): (B, *shape, C)

  got = jax.jit(lambda p: grid_sample(t, p, batch=batch, voxel_size=vs, origin=org))(pts)
  np.testing.assert_allclose(np.asarray(got), np.asarray(reference(pts)), rtol=1e-5, atol=1e-5)
  probe = jnp.asarray(rng.standard_normal((60, 2)), jnp.float32)
  g = jax.jit(jax.grad(lambda p: jnp.sum(grid_sample(t, p, batch=batch, voxel_size=vs, origin=org) * probe)))(pts)
  g_ref = jax.jit(jax.grad(lambda p: jnp.sum(reference(p) * probe)))(pts)
  np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-4)
  near = grid_sample(t, pts, "nearest", batch=batch, voxel_size=vs, origin=org)
  dense = np.asarray(t.todense())
  cell = np.floor((pts - org) / vs).astype(int)
  inside = np.all((cell >= 0) & (cell < np.array(shape)), axis=1)
  want = np.array([dense[(b, *c)] if ok else np.zeros(2) for b, c, ok in zip(batch, cell, inside)])
  np.testing.assert_array_equal(np.asarray(near), want)
  with pytest.raises(ValueError, match=f"points of a {ndim}D SparseTensor"):
    grid_sample(t, np.zeros((3, 3), np.float32))


def test_grid_sample_nearest():
  t = _sample_tensor(1)
  rng = np.random.default_rng(1)
  pts = rng.uniform(-1, 8, (200, 3)).astype(np.float32)
  pts = np.where(np.abs(pts - np.round(pts)) < 0.01, pts + 0.02, pts)  # keep away from voxel faces
  batch = rng.integers(0, 2, 200)
  got = grid_sample(t, pts, mode="nearest", batch=batch)
  dense = np.asarray(t.todense())
  site = np.floor(pts).astype(int)  # the voxel whose cell [i, i+1)^3 holds the point
  ref = np.zeros((200, 3), np.float32)
  for i, (s, b) in enumerate(zip(site, batch)):
    if np.all((s >= 0) & (s < 8)):
      ref[i] = dense[b, s[0], s[1], s[2]]
  np.testing.assert_array_equal(np.asarray(got), ref)
  with pytest.raises(ValueError, match="mode"):
    grid_sample(t, pts, mode="cubic")


def test_grid_sample_gradients():
  t = _sample_tensor(2, channels=2)
  rng = np.random.default_rng(2)
  # Away from voxel centres (index + 0.5), where the trilinear blend is smooth.
  pts = (rng.integers(0, 7, (40, 3)) + 0.5 + rng.uniform(0.1, 0.9, (40, 3))).astype(np.float32)
  batch = rng.integers(0, 2, 40)
  # Jitted: check_grads evaluates the function, its jvp and its vjp many times, and eagerly each of those
  # compiles every primitive as its own program (test_grid_sample_nearest runs grid_sample eagerly).
  check_grads(jax.jit(lambda f: grid_sample(t.replace(feats=f), pts, batch=batch)), (t.feats,), order=1,
              modes=("rev",), atol=1e-2, rtol=1e-2)
  check_grads(jax.jit(lambda p: grid_sample(t, p, batch=batch)), (jnp.asarray(pts),), order=1, modes=("fwd", "rev"),
              atol=1e-2, rtol=1e-2, eps=1e-2)
  # Gradient w.r.t. feats in nearest mode: each voxel sums the cotangents of the points in it.
  g = jax.jit(jax.grad(lambda f: grid_sample(t.replace(feats=f), pts, mode="nearest", batch=batch).sum()))(t.feats)
  rows = np.asarray(jax.jit(lookup_rows)(t, np.concatenate([batch[:, None], np.floor(pts).astype(np.int32)], 1)))
  expected = np.zeros(t.capacity)
  np.add.at(expected, rows[rows >= 0], 1.0)
  np.testing.assert_allclose(np.asarray(g), np.repeat(expected[:, None], 2, 1))


def test_lookup_rows():
  t = _sample_tensor(3)
  n = int(t.num)
  rows = lookup_rows(t, t.coords[:n])
  np.testing.assert_array_equal(np.asarray(rows), np.arange(n))
  q = np.array([[0, -1, 0, 0], [2, 0, 0, 0], [0, 8, 0, 0], [-1, -1, -1, -1]], np.int32)
  np.testing.assert_array_equal(np.asarray(lookup_rows(t, q)), [-1, -1, -1, -1])


# ---- plotting ----------------------------------------------------------------------------------------

@pytest.fixture
def agg():
  mpl = pytest.importorskip("matplotlib")
  mpl.use("Agg")
  import matplotlib.pyplot as plt
  yield plt
  plt.close("all")


def test_plot_voxels(agg, tmp_path):
  t = shapes.random_shapes(jax.random.key(5), 2, 10, channels=2)
  ax = __import__("jsparse.plot", fromlist=["plot_voxels"]).plot_voxels(t, batch_index=1, color_by=0)
  assert len(ax.collections) > 0  # the voxel faces
  path = tmp_path / "voxels.png"
  ax.figure.savefig(path)
  assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"


def test_plot_grid_and_limits(agg, tmp_path):
  from jsparse.plot import plot_grid, plot_voxels
  batch = shapes.random_shapes(jax.random.key(6), 3, 8)
  fig = plot_grid(batch, ncols=2, titles=["a", "b", "c"])
  assert len(fig.axes) == 3 and [a.get_title() for a in fig.axes] == ["a", "b", "c"]
  assert all(len(a.collections) > 0 for a in fig.axes)
  fig2 = plot_grid([shapes.sphere(8), (batch, 2)], ncols=3)
  assert len(fig2.axes) == 2
  fig2.savefig(tmp_path / "grid.png")
  assert (tmp_path / "grid.png").exists()
  big = shapes.box(80, half_size=10)
  with pytest.raises(ValueError, match="exceeds 64"):
    plot_voxels(big, downsample=False)
  ax = plot_voxels(big)  # pooled 2x
  assert ax.get_title() == "downsampled x2" and len(ax.collections) > 0
  with pytest.raises(ValueError, match="titles"):
    plot_grid(batch, titles=["x"])



def _voxel_face_colours(ax):
  return np.concatenate([np.asarray(c.get_facecolor()) for c in ax.collections])


def _is_shade_of(faces, colour):
  """Per face: is its RGB `colour` darkened by ax.voxels' lighting (one factor in [0.3, 1] on every channel)?"""
  ratio = faces[:, :3] / np.asarray(colour[:3])
  return (np.ptp(ratio, axis=1) < 0.02) & (ratio.min(1) > 0.29) & (ratio.max(1) < 1.01)


def test_plot_axes_labels_titles_and_colour_bar(agg):
  from jsparse.plot import plot_grid, plot_voxels
  t = shapes.random_shapes(jax.random.key(7), 2, 12, channels=2)
  ax = plot_voxels(t, color_by=1, title="mine")
  assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_zlabel()) == ("x (voxel)", "y (voxel)", "z (voxel)")
  assert ax.get_title() == "mine"
  bars = [a for a in ax.figure.axes if a is not ax]
  assert len(bars) == 1 and bars[0].get_ylabel() == "channel 1"  # the colour bar, named by its channel
  assert plot_voxels(t, axis_labels=False).get_xlabel() == ""
  assert len(plot_voxels(t).figure.axes) == 1  # one colour: no colour bar
  # A pooled view keeps the user's title and says it is pooled; its axes still read in input voxels.
  big = shapes.box(80, half_size=10)
  ax = plot_voxels(big, title="a box")
  assert ax.get_title() == "a box\n(downsampled x2)" and ax.get_xlim() == (0.0, 80.0)
  fig = plot_grid([big, t], ncols=2, titles=["box", "shapes"], color_by=0, value_label="occupancy")
  assert [a.get_title() for a in fig.axes[:2]] == ["box\n(downsampled x2)", "shapes"]
  assert len(fig.axes) == 3 and fig.axes[2].get_ylabel() == "occupancy"  # one colour bar shared by the panels
  # Panels laid out without overlap: each panel's labels and title stay inside its own cell.
  fig = plot_grid(shapes.random_shapes(jax.random.key(8), 6, 8), ncols=3, panel_size=2.2,
                  titles=[f"a long title for panel number {i}" for i in range(6)])
  renderer = fig.canvas.get_renderer()
  boxes = [a.get_tightbbox(renderer) for a in fig.axes]
  for i, a in enumerate(boxes):
    assert a.x0 >= -1 and a.y0 >= -1 and a.x1 <= fig.bbox.x1 + 1 and a.y1 <= fig.bbox.y1 + 1
    for b in boxes[i + 1:]:
      assert not a.overlaps(b), (a, b)
  with pytest.raises(TypeError, match="color_by"):
    plot_voxels(t, color_by=0.5)
  with pytest.raises(ValueError, match="vmin"):
    plot_voxels(t, color_by=0, vmin=2.0, vmax=1.0)
  with pytest.raises(ValueError, match="panel_size"):
    plot_grid(t, panel_size=0)


def test_plot_colours_follow_values(agg):
  from jsparse.plot import plot_voxels, value_range
  cmap = __import__("matplotlib").colormaps["viridis"]
  # All values equal: every voxel takes the colour map's middle colour, and the scale is centred on the value.
  ones = shapes.random_shapes(jax.random.key(9), 1, 10)
  assert value_range(np.ones(5)) == (0.5, 1.5) and value_range(np.full(3, -40.0)) == (-42.0, -38.0)
  faces = _voxel_face_colours(plot_voxels(ones, color_by=0))
  assert len(faces) > 0 and _is_shade_of(faces, cmap(0.5)).all()
  assert value_range(np.array([1.0, np.nan, 3.0, np.inf])) == (1.0, 3.0)
  assert value_range(np.array([]), 0.0, 2.0) == (0.0, 2.0)
  # Two values on one grid: the low voxel's faces take the bottom colour, the high one's the top colour.
  coords = np.array([[0, 0, 0, 0], [0, 3, 3, 3]], np.int32)
  two = SparseTensor.from_coords(coords, np.array([[-1.0], [5.0]], np.float32), (4, 4, 4), capacity="exact")
  faces = _voxel_face_colours(plot_voxels(two, color_by=0))
  low, high = _is_shade_of(faces, cmap(0.0)), _is_shade_of(faces, cmap(1.0))
  assert (low | high).all() and low.sum() == high.sum() > 0
  # vmin / vmax fix the scale: 5.0 on a -1..11 scale is the middle colour.
  faces = _voxel_face_colours(plot_voxels(two, color_by=0, vmin=-1.0, vmax=11.0))
  assert _is_shade_of(faces, cmap(0.0)).sum() == _is_shade_of(faces, cmap(0.5)).sum() > 0

def test_empty_inputs():
  e = SparseTensor.from_coords(np.zeros((0, 4), np.int32), np.zeros((0, 2), np.float32), (4, 4, 4),
                               capacity="exact")
  assert grid_sample(e, np.ones((3, 3), np.float32)).shape == (3, 2)
  assert serialize.sort_by(e)[1].shape == (0,)
  t = voxelize(np.zeros((0, 3), np.float32), voxel_size=1.0)
  assert int(t.num) == 0
  t2, overflow = voxelize_jit(np.zeros((0, 3), np.float32), voxel_size=1.0, origin=0.0, spatial_shape=(4, 4, 4),
                              capacity=8)
  assert int(t2.num) == 0 and not bool(overflow)
  assert np.all(np.asarray(grid_sample(t2, np.ones((2, 3), np.float32))) == 0)


# ---- review: non-finite grid parameters, wide integers, truncated sizes ---------------------------------

@pytest.mark.parametrize("kwargs", [dict(voxel_size=np.nan), dict(voxel_size=np.inf),
                                    dict(voxel_size=[0.25, np.nan, 0.25]), dict(origin=[0.0, np.nan, 0.0]),
                                    dict(origin=np.inf)])
def test_voxelize_rejects_non_finite_voxel_size_and_origin(kwargs):
  # A NaN voxel size or origin made every quantised index NaN, which passed the range check (NaN < 0 is
  # False) and cast to garbage voxels: 20 points in one voxel, no error.
  pts = np.random.default_rng(0).random((20, 3))
  kwargs = {"voxel_size": 0.25, "origin": 0.0, **kwargs}
  name = "voxel_size" if not np.all(np.isfinite(kwargs["voxel_size"])) else "origin"
  with pytest.raises(ValueError, match=name):
    voxelize(pts, spatial_shape=(4, 4, 4), **kwargs)


def test_voxelize_jit_static_sizes_must_be_ints():
  pts = np.random.default_rng(0).random((20, 3))
  for kwargs in (dict(batch_size=2.7), dict(capacity=64.9), dict(capacity=True)):
    with pytest.raises(TypeError, match=next(iter(kwargs))):
      voxelize_jit(pts, voxel_size=0.25, origin=0.0, spatial_shape=(4, 4, 4), **{"capacity": 64, **kwargs})


def test_voxelize_jit_wide_or_float_batch_ids():
  pts = np.array([[0.1, 0.1, 0.1], [0.6, 0.6, 0.6]])
  # Batch id 2**32 wrapped to 0 in the int32 cast and joined batch item 0; it lies outside [0, 1): dropped.
  x, overflow = voxelize_jit(pts, voxel_size=0.5, origin=0.0, spatial_shape=(2, 2, 2), capacity=8,
                             batch=np.array([0, 2**32], np.int64))
  assert int(x.num) == 1 and not bool(overflow)
  np.testing.assert_array_equal(np.asarray(x.coords[0]), [0, 0, 0, 0])
  with pytest.raises(TypeError, match="batch"):
    voxelize_jit(pts, voxel_size=0.5, origin=0.0, spatial_shape=(2, 2, 2), capacity=8, batch=np.array([0.0, 0.7]))


def test_serialize_wide_integers_are_not_wrapped_onto_valid_keys():
  # int64 coordinates past 2**31 became int32 by wrapping (2**32 + 1 -> 1) and got a valid key.
  for xyz in (np.array([[2**32 + 1, 0, 0]], np.int64), np.array([[1, 2, 3]], np.uint64) + np.uint64(2**32)):
    for encode in (serialize.encode_morton, serialize.encode_hilbert):
      with pytest.raises(ValueError, match="out of range"):
        encode(xyz, 10)
  with pytest.raises(ValueError, match="batch"):
    serialize.fold_batch(np.array([2**32], np.int64), np.array([5]), 10)
  with pytest.raises(ValueError, match="keys"):
    serialize.fold_batch(np.array([0]), np.array([2**32 + 5], np.int64), 10)
  # In range, wide dtypes give the int32 inputs' keys.
  xyz = np.array([[1, 2, 3], [1023, 0, 511]])
  np.testing.assert_array_equal(np.asarray(serialize.encode_morton(xyz.astype(np.int64))),
                                np.asarray(serialize.encode_morton(xyz.astype(np.int32))))


def test_lookup_rows_wide_and_float_queries():
  t = SparseTensor.from_coords(np.array([[0, 1, 1, 1]]), np.ones((1, 2), np.float32), (4, 4, 4))
  # Batch 2**32 wrapped to 0 and found row 0; x 2**32 + 1 wrapped to 1.
  q = np.array([[2**32, 1, 1, 1], [0, 2**32 + 1, 1, 1], [0, 1, 1, 1], [-2**40, 1, 1, 1]], np.int64)
  np.testing.assert_array_equal(np.asarray(lookup_rows(t, q)), [-1, -1, 0, -1])
  with pytest.raises(TypeError, match="query"):
    lookup_rows(t, np.array([[0, 1.7, 1.2, 1.9]]))


@pytest.mark.parametrize("call, error, name", [
    (lambda: shapes.sphere(8.7), TypeError, "resolution"),  # int() made an 8-voxel grid, radius from 8.7
    (lambda: shapes.sphere_mask("8"), TypeError, "resolution"),
    (lambda: shapes.random_union(jax.random.key(0), -2), ValueError, "resolution"),
    (lambda: shapes.sphere(8, channels=2.5), TypeError, "channels"),  # truncated to 2
    (lambda: shapes.sphere(8, channels=-1), ValueError, "channels"),
    (lambda: shapes.sphere(8, capacity=300.9), TypeError, "capacity"),  # truncated to 300
    (lambda: shapes.sphere(8, center=[1.0, 2.0]), ValueError, "center"),
    (lambda: shapes.box(8, half_size=[1.0, 2.0]), ValueError, "half_size"),
    (lambda: shapes.torus(8, axis=3), ValueError, "axis"),  # IndexError
    (lambda: shapes.torus_mask(8, axis=-1), ValueError, "axis"),  # read axis 2
    (lambda: shapes.random_union(jax.random.key(0), 8, num_shapes=(3, 1)), ValueError, "num_shapes"),
    (lambda: shapes.random_union(jax.random.key(0), 8, num_shapes=3), TypeError, "num_shapes"),
    (lambda: shapes.random_shapes(jax.random.key(0), 2.7, 8), TypeError, "batch_size"),  # made 2 elements
    (lambda: shapes.random_shapes(jax.random.key(0), 0, 8), ValueError, "batch_size"),
    (lambda: shapes.masks_to_tensor(np.ones((4, 4, 4), bool), dtype=np.int32), TypeError, "dtype"),
    # Sizes enter squared: a negative radius or minor radius drew the ball or torus of its absolute value.
    (lambda: shapes.sphere_mask(8, radius=-3), ValueError, "radius"),
    (lambda: shapes.shell(8, radius=-3), ValueError, "radius"),
    (lambda: shapes.shell_mask(8, thickness=-1), ValueError, "thickness"),
    (lambda: shapes.torus_mask(8, minor=-2), ValueError, "minor"),
    (lambda: shapes.torus_mask(8, major=-2), ValueError, "major"),
    (lambda: shapes.box_mask(8, half_size=(2, -1, 2)), ValueError, "half_size"),
    (lambda: shapes.sphere_mask(8, radius=float("nan")), ValueError, "radius"),  # an empty mask
    (lambda: shapes.sphere_mask(8, radius=[1.0, 2.0]), ValueError, "radius"),  # broadcast, or numpy's shape error
    (lambda: shapes.random_union_mask(1.5, 8), TypeError, "key"),  # drew seed 1's shapes
    (lambda: shapes.random_union(jnp.asarray([0.0, 3.0]), 8), TypeError, "key"),  # drew key [0, 3]'s shapes
    (lambda: shapes.random_union_mask("a", 8), TypeError, "key"),  # int()'s ValueError, naming nothing
    (lambda: shapes.random_union_mask(-1, 8), ValueError, "key"),  # numpy's OverflowError
    (lambda: shapes.random_union_mask(2**32, 8), ValueError, "key"),  # wrapped to seed 0's shapes
    (lambda: shapes.random_union_mask([2**32 + 5, 1], 8), ValueError, "key"),  # wrapped to [5, 1]
    (lambda: shapes.sphere_mask(8, radius="3"), TypeError, "radius"),  # read as 3.0
    (lambda: shapes.shell_mask(8, thickness=True), TypeError, "thickness"),  # read as 1.0
    (lambda: shapes.sphere_mask(8, radius=10**400), ValueError, "radius"),  # OverflowError, naming nothing
    (lambda: shapes.shell_mask(8, thickness=None), TypeError, "thickness"),  # read as NaN: a ValueError
])
def test_shape_generators_name_bad_arguments(call, error, name):
  with pytest.raises(error, match=name):
    call()


def test_shape_generators_take_exact_capacity():
  t = shapes.sphere(8, capacity="exact")  # int("exact") raised
  assert t.capacity == int(t.num) == int(shapes.sphere_mask(8).sum())


@pytest.mark.parametrize("order", ["morton", "hilbert"])
def test_serialization_keys_of_negative_sites_are_not_aliased(order):
  # A tensor built directly is not validated; its valid row at x = -1 got the key of x = 0.
  coords = jnp.array([[0, -1, 0, 0], [0, 0, 0, 0], [-1, -1, -1, -1]], jnp.int32)
  bad = SparseTensor(coords, jnp.ones((3, 1)), jnp.int32(2), (4, 4, 4), 1)
  with pytest.raises(ValueError, match="out of range"):
    serialize.serialization_keys(bad, order)
  keys = np.asarray(jax.jit(serialize.serialization_keys, static_argnums=1)(bad, order))
  assert keys[0] == -1 and keys[1] >= 0 and keys[2] == np.iinfo(np.int32).max


@pytest.mark.parametrize("spatial_shape,batch_size", [((4, 4, 4), 1), ((1024, 1024, 1024), 2)], ids=["int32", "words"])
def test_linear_serialization_keys_of_sites_outside_the_grid_are_not_aliased(spatial_shape, batch_size):
  # (0, 1, Y, 0) has the linear key of (0, 2, 0, 0), which "linear" gave it (and sort_by placed it there) silently.
  y_extent = spatial_shape[1]
  coords = jnp.array([[0, 1, y_extent, 0], [0, 2, 0, 0], [0, 0, -1, 0], [-1, -1, -1, -1]], jnp.int32)
  bad = SparseTensor(coords, jnp.ones((4, 1)), jnp.int32(3), spatial_shape, batch_size)
  with pytest.raises(ValueError, match="out of range"):
    serialize.serialization_keys(bad, "linear")
  keys = np.asarray(jax.jit(serialize.serialization_keys, static_argnums=1)(bad, "linear")).reshape(4, -1)
  assert np.all(keys[0] == -1) and np.all(keys[2] == -1) and np.all(keys[1] >= 0)
  assert np.all(keys[3] == np.iinfo(np.int32).max)


def test_masks_to_tensor_takes_occupancy_only():
  # Probabilities (or NaN) read as occupied wherever non-zero: a 0.1 probability became a voxel silently.
  probs = np.zeros((4, 4, 4), np.float32)
  probs[1, 2, 3], probs[0, 0, 0] = 0.1, 0.9
  with pytest.raises(ValueError, match="masks > 0.5"):
    shapes.masks_to_tensor(probs)
  with pytest.raises(ValueError, match="occupancy"):
    shapes.masks_to_tensor(np.full((4, 4, 4), np.nan))
  with pytest.raises(TypeError, match="masks"):
    shapes.masks_to_tensor(np.full((4, 4, 4), "x"))
  t = shapes.masks_to_tensor(probs > 0.5)
  np.testing.assert_array_equal(np.asarray(t.coords[:int(t.num)]), [[0, 0, 0, 0]])
  u = shapes.masks_to_tensor((probs > 0.05).astype(np.float32))  # 0/1 numbers are occupancy
  np.testing.assert_array_equal(np.asarray(u.coords[:int(u.num)]), [[0, 0, 0, 0], [0, 1, 2, 3]])


def test_bits_for_refuses_a_grid_with_an_empty_axis():
  assert serialize.bits_for((5, 4, 4)) == 3
  with pytest.raises(ValueError, match="spatial_shape"):
    serialize.bits_for((0, 4, 4))
