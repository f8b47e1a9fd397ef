"""Grids of 2**31 sites or more (issue 16 item 1): sites keyed by two int32 words (sparse_tensor.key_width).

Sites are placed where int32 linear keys would wrap or collide (e.g. (0, 0, 0) and (1024, 0, 1) on 2048^3,
whose int32 keys differ by 2**32), and every op is checked against a brute-force reference over Python
ints (no dense grid): XLA everywhere, the Pallas kernels in interpret mode, their Triton lowering, and on a
GPU (``-m gpu``) the real kernels against the XLA path on random wide grids.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse import serialize
from jsparse.neighbors import neighbor_map, search_sorted_words
from jsparse.sparse_conv import pair_map
from jsparse.sparse_tensor import key_width, site_keys, sites_of_keys
from jsparse.voxelize import voxelize, voxelize_jit

BIG_GRID = ((2048, 2048, 2048), 4)  # 2**35 sites
LIDAR_GRID = ((41, 1600, 1408), 16)  # 1.48e9 sites: still one word
# Sites whose int32 keys wrap onto each other on 2048^3 (x differing by 1024 is 2**32 keys), batches >= 1
# (keys past 2**31), the far corner, and clusters so that neighbours exist.
SITES = [(0, 0, 0, 0), (0, 1024, 0, 1), (0, 0, 0, 1), (0, 1, 0, 0), (1, 0, 0, 0), (3, 2047, 2047, 2047),
         (3, 2047, 2047, 2046), (3, 2046, 2046, 2047), (2, 5, 5, 5), (2, 5, 6, 5), (2, 6, 6, 6), (0, 1023, 2047, 2047),
         (0, 1024, 0, 0), (1, 1024, 0, 0), (2, 1028, 5, 5)]


def _grid_sites(shape, batch):
  """SITES folded into the grid (coordinates clipped to it), distinct."""
  limits = np.array((batch,) + shape) - 1
  return np.unique(np.minimum(np.array(SITES), limits), axis=0)


def _tensor(sites, shape, batch, capacity=None, channels=2, seed=0):
  """A SparseTensor built directly (no from_coords), as code under jit does."""
  n = len(sites)
  capacity = capacity or n + 3
  coords = np.full((capacity, 4), -1, np.int32)
  coords[:n] = sites
  feats = np.zeros((capacity, channels), np.float32)
  feats[:n] = np.random.default_rng(seed).normal(size=(n, channels))
  return jsparse.SparseTensor(jnp.asarray(coords), jnp.asarray(feats), jnp.int32(n), shape, batch)


def _ref_neighbors(sites, capacity, shape, offsets):
  table = {tuple(map(int, s)): i for i, s in enumerate(sites)}
  out = np.full((capacity, len(offsets)), -1, np.int32)
  for i, (b, *c) in enumerate(sites):
    for v, off in enumerate(offsets):
      n = tuple(int(a + d) for a, d in zip(c, off))
      if all(0 <= a < s for a, s in zip(n, shape)):
        out[i, v] = table.get((int(b),) + n, -1)
  return out


def _ref_pair_map(sites, capacity, shape, kernel_size, stride, padding):
  """(sorted output sites, inv [capacity, V]) of a strided convolution, over Python ints."""
  out_shape = tuple((n + 2 * padding - k) // stride + 1 for n, k in zip(shape, kernel_size))
  offsets = list(itertools.product(*(range(k) for k in kernel_size)))
  proposals = {}
  for j, (b, *c) in enumerate(sites):
    for v, off in enumerate(offsets):
      num = [a + padding - d for a, d in zip(c, off)]
      if all(m >= 0 and m % stride == 0 and m // stride < o for m, o in zip(num, out_shape)):
        proposals[(j, v)] = (int(b),) + tuple(int(m // stride) for m in num)
  out = sorted(set(proposals.values()))
  row = {s: i for i, s in enumerate(out)}
  inv = np.full((capacity, len(offsets)), -1, np.int32)
  for (j, v), s in proposals.items():
    inv[j, v] = row[s]
  return np.array(out, np.int32).reshape(-1, 4), inv


# ---- keys --------------------------------------------------------------------------------------------


def test_key_width_and_limits():
  assert key_width(1, (1024, 1024, 2047)) == 1
  assert key_width(2, (1024, 1024, 1024)) == 2  # 2**31 sites: one past int32
  assert key_width(*reversed(BIG_GRID)) == 2 and key_width(16, LIDAR_GRID[0]) == 1
  assert key_width(8, (2048,) * 3) == 2
  with pytest.raises(ValueError, match="spatial_shape"):
    key_width(1, (2**21, 1, 1))
  with pytest.raises(ValueError, match=r"batch_size=4 .*2\*\*62"):
    key_width(4, (2**20,) * 3)
  with pytest.raises(ValueError, match=r"2\*\*62"):  # from_coords checks the same limit
    jsparse.SparseTensor.from_coords([[0, 1, 1, 1]], [[1.0]], spatial_shape=(2**20,) * 3, batch_size=4)


@pytest.mark.parametrize("batch,shape", [(4, (2048,) * 3), (16, (41, 1600, 1408)), (2**20, (2**20 - 1, 2**21 - 1, 1)),
                                         (1, (2**21 - 1, 2**21 - 1, 2**19))])
def test_site_keys_are_the_linear_index(batch, shape):
  rng = np.random.default_rng(0)
  c = np.stack([rng.integers(0, batch, 500)] + [rng.integers(0, s, 500) for s in shape], axis=1)
  c[0], c[1] = [batch - 1] + [s - 1 for s in shape], 0
  hi, lo = site_keys(jnp.asarray(c, jnp.int32), shape, 2)
  index = ((c[:, 0].astype(object) * shape[0] + c[:, 1]) * shape[1] + c[:, 2]) * shape[2] + c[:, 3]
  assert (np.asarray(hi).astype(object) * 2**31 + np.asarray(lo)).tolist() == index.tolist()
  assert np.asarray(lo).min() >= 0 and np.asarray(hi).min() >= 0
  np.testing.assert_array_equal(sites_of_keys((hi, lo), batch, shape), c)


def test_two_word_search_matches_numpy():
  rng = np.random.default_rng(1)
  keys = np.unique(rng.integers(0, 2**40, 300))
  hi, lo = (keys >> 31).astype(np.int32), (keys & (2**31 - 1)).astype(np.int32)
  query = np.concatenate([keys, rng.integers(0, 2**40, 200), [0, 2**40]])
  pos = search_sorted_words((jnp.asarray(hi), jnp.asarray(lo)),
                            (jnp.asarray(query >> 31, jnp.int32), jnp.asarray(query & (2**31 - 1), jnp.int32)))
  np.testing.assert_array_equal(pos, np.searchsorted(keys, query))


# ---- neighbour maps and submanifold convolution ----------------------------------------------------------


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("grid", [BIG_GRID, LIDAR_GRID], ids=["2048^3x4", "lidar_x16"])
def test_neighbor_map(grid, implementation):
  shape, batch = grid
  sites = _grid_sites(shape, batch)
  x = _tensor(sites, shape, batch)
  offsets = jsparse.neighbors.kernel_offsets(3)
  nbr = neighbor_map(x, 3, implementation=implementation).nbr
  np.testing.assert_array_equal(nbr, _ref_neighbors(sites, x.capacity, shape, offsets))


def test_wide_lookups_compare_the_batch_too():
  """Wide tables hold rows and compare the probed site's 4 coordinates: a site of another batch item at the same
  (x, y, z), met along the probe run (here at the looked-up site's very home slot), is no match."""
  from pallas_kernels.hash_table import neighbor_map_hashed, site_home

  shape, tsize = (2048,) * 3, 16
  xs = jnp.arange(200, dtype=jnp.int32)
  five = jnp.full_like(xs, 5)
  home0 = np.asarray(site_home((jnp.zeros_like(xs), xs, five, five), shape, tsize - 1))
  home1 = np.asarray(site_home((jnp.ones_like(xs), xs, five, five), shape, tsize - 1))
  x = int(np.flatnonzero(home0 == home1)[0])  # (0, x, 5, 5) sits where (1, x, 5, 5) is looked up first
  coords = np.full((4, 4), -1, np.int32)
  coords[:2] = [(0, x, 5, 5), (1, x, 5, 4)]  # row 1's +z neighbour would be (1, x, 5, 5): absent
  offsets = ((0, 0, -1), (0, 0, 0), (0, 0, 1))
  nbr, ovf = neighbor_map_hashed(jnp.asarray(coords), jnp.int32(2), spatial_shape=shape, offsets=offsets,
                                 interpret=True, table_size=tsize, wide_keys=True)
  assert not bool(ovf)
  np.testing.assert_array_equal(nbr, [[-1, 0, -1], [-1, 1, -1], [-1, -1, -1], [-1, -1, -1]])


def test_direct_tensor_under_jit_does_not_wrap():
  """Issue 16: a SparseTensor built under jit on 2048^3 gave (0,0,0) the feature of (1024,0,1) as its +z
  neighbour (their int32 keys differ by 2**32)."""
  shape, batch = (2048,) * 3, 1
  w = np.zeros((3, 3, 3, 1, 1), np.float32)
  w[1, 1, 2] = 1.0  # y[u] = x[u + (0, 0, 1)]

  @jax.jit
  def f(coords, feats, w):
    x = jsparse.SparseTensor(coords, feats, jnp.int32(2), shape, batch)
    return jsparse.submconv3d(x, w, implementation="xla").feats

  out = f(jnp.array([[0, 0, 0, 0], [0, 1024, 0, 1]], jnp.int32), jnp.array([[1.0], [5.0]]), w)
  np.testing.assert_array_equal(out, [[0.0], [0.0]])


def test_submconv_matches_reference():
  shape, batch = BIG_GRID
  sites = _grid_sites(shape, batch)
  x = _tensor(sites, shape, batch, channels=3)
  w = np.random.default_rng(2).normal(size=(3, 3, 3, 3, 4)).astype(np.float32)
  y = jsparse.submconv3d(x, w, implementation="xla", precision="highest")
  nbr = _ref_neighbors(sites, x.capacity, shape, jsparse.neighbors.kernel_offsets(3))
  f = np.asarray(x.feats)
  ref = np.einsum("nvc,vco->no", np.where((nbr >= 0)[..., None], f[np.maximum(nbr, 0)], 0), w.reshape(27, 3, 4))
  ref[len(sites):] = 0
  np.testing.assert_allclose(y.feats, ref, rtol=1e-5, atol=1e-5)


# ---- strided, pooled, inverse and transposed convolutions ----------------------------------------------


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("grid,kernel_size,stride,padding", [(BIG_GRID, 3, 2, 1), (BIG_GRID, 2, 2, 0),
                                                             (LIDAR_GRID, 3, 2, 1)],
                         ids=["2048^3x4-k3s2", "2048^3x4-k2s2", "lidar_x16-k3s2"])
def test_strided_output_sites(grid, kernel_size, stride, padding, implementation):
  shape, batch = grid
  sites = _grid_sites(shape, batch)
  x = _tensor(sites, shape, batch)
  pm = pair_map(x, kernel_size, stride, padding, out_capacity=64, implementation=implementation)
  out, inv = _ref_pair_map(sites, x.capacity, shape, (kernel_size,) * 3, stride, padding)
  assert int(pm.out_num) == len(out) and not bool(pm.overflow)
  np.testing.assert_array_equal(pm.out_coords[: len(out)], out)
  np.testing.assert_array_equal(pm.out_coords[len(out):], -1)
  np.testing.assert_array_equal(pm.inv, inv)


def test_strided_output_sites_overflow_keeps_smallest():
  shape, batch = BIG_GRID
  sites = _grid_sites(shape, batch)
  x = _tensor(sites, shape, batch)
  out, _ = _ref_pair_map(sites, x.capacity, shape, (3,) * 3, 2, 1)
  for implementation in ("xla", "pallas"):
    pm = pair_map(x, 3, 2, 1, out_capacity=5, check=False, implementation=implementation)
    assert bool(pm.overflow)
    np.testing.assert_array_equal(pm.out_coords, out[:5])


def test_conv_pool_inverse_transpose_values():
  """Values of the convolution family on 2048^3 x 4 against the reference pair map (XLA)."""
  shape, batch = BIG_GRID
  sites = _grid_sites(shape, batch)
  x = _tensor(sites, shape, batch, channels=2)
  f = np.asarray(x.feats)
  w = np.random.default_rng(3).normal(size=(3, 3, 3, 2, 3)).astype(np.float32)
  out, inv = _ref_pair_map(sites, x.capacity, shape, (3,) * 3, 2, 1)
  y = jsparse.sparse_conv3d(x, w, stride=2, padding=1, out_capacity=64, implementation="xla", precision="highest")
  ref = np.zeros((64, 3), np.float32)
  for j, v in zip(*np.nonzero(inv >= 0)):
    ref[inv[j, v]] += f[j] @ w.reshape(27, 2, 3)[v]
  np.testing.assert_allclose(y.feats, ref, rtol=1e-5, atol=1e-5)

  pooled = jsparse.sparse_max_pool3d(x, 3, 2, 1, out_capacity=64, implementation="xla")
  ref_max = np.full((64, 2), -np.inf, np.float32)
  for j, v in zip(*np.nonzero(inv >= 0)):
    ref_max[inv[j, v]] = np.maximum(ref_max[inv[j, v]], f[j])
  ref_max[len(out):] = 0
  np.testing.assert_allclose(pooled.feats, ref_max)

  # Inverse: from the cached map, and recomputed (a copy of y without its caches) by the two-word search.
  wi = np.random.default_rng(4).normal(size=(3, 3, 3, 3, 2)).astype(np.float32)
  g = np.asarray(y.feats)
  ref_inv = np.zeros((x.capacity, 2), np.float32)
  for j, v in zip(*np.nonzero(inv >= 0)):
    ref_inv[j] += g[inv[j, v]] @ wi.reshape(27, 3, 2)[v]
  for y_in in (y, jsparse.SparseTensor(y.coords, y.feats, y.num, y.spatial_shape, y.batch_size)):
    back = jsparse.sparse_inverse_conv3d(y_in, wi, like=x, stride=2, padding=1, implementation="xla",
                                         precision="highest")
    np.testing.assert_allclose(back.feats, ref_inv, rtol=1e-5, atol=1e-5)

  # Transposed (generative) upsampling of the 2048^3 grid onto 4096 x 2048 x 2048 (children computed from
  # coordinates, no keys; its output grid passes the wide-key check).
  small = _tensor(np.array([[0, 0, 0, 0], [3, 2047, 0, 5]]), shape, batch)
  up = jsparse.sparse_conv_transpose3d(small, np.ones((2, 1, 1, 2, 1), np.float32), stride=(2, 1, 1),
                                       out_capacity=8, implementation="xla")
  assert up.spatial_shape == (4096, 2048, 2048)
  np.testing.assert_array_equal(up.coords[:4], [[0, 0, 0, 0], [0, 1, 0, 0], [3, 4094, 0, 5], [3, 4095, 0, 5]])


def test_transposed_output_grid_past_the_limit_raises():
  x = _tensor(np.array([[0, 0, 0, 0]]), (2**20, 8, 8), 1)
  with pytest.raises(ValueError, match="output grid: spatial_shape"):
    jsparse.sparse_conv_transpose3d(x, np.ones((2, 2, 2, 2, 1), np.float32), stride=2, out_capacity=8)


# ---- voxelize, sampling, serialisation ---------------------------------------------------------------------


def test_voxelize_jit_does_not_merge_distant_voxels():
  """Issue 16: voxelize_jit on 2048^3 merged two points 1024 voxels apart into one voxel (num=1)."""
  points = np.array([[0.5, 0.5, 0.5], [1024.5, 0.5, 1.5], [0.6, 0.5, 0.5], [2047.5, 2047.5, 2047.5]])
  feats = np.arange(4.0, dtype=np.float32)
  batch = np.array([0, 0, 0, 3])
  expect = [[0, 0, 0, 0], [0, 1024, 0, 1], [3, 2047, 2047, 2047]]

  @jax.jit
  def f(p, feats, batch):
    return voxelize_jit(p, feats, voxel_size=1.0, origin=0.0, spatial_shape=(2048,) * 3, capacity=8, reduce="sum",
                        batch=batch, batch_size=4)

  t, overflow = f(points, feats, batch)
  assert int(t.num) == 3 and not bool(overflow)
  np.testing.assert_array_equal(t.coords[:3], expect)
  np.testing.assert_array_equal(t.feats[:3, 0], [2.0, 1.0, 3.0])
  for dedup in ("numpy", "xla"):
    t = voxelize(points, feats, voxel_size=1.0, origin=0.0, spatial_shape=(2048,) * 3, reduce="sum", batch=batch,
                 batch_size=4, dedup=dedup)
    np.testing.assert_array_equal(t.coords[:3], expect)
    np.testing.assert_array_equal(t.feats[:3, 0], [2.0, 1.0, 3.0])


def test_grid_sample_nearest_on_wide_grid():
  shape, batch = BIG_GRID
  x = _tensor(np.array([[0, 0, 0, 0], [0, 1024, 0, 1]]), shape, batch, channels=1)
  got = jsparse.sampling.grid_sample(x, np.array([[0.0, 0.0, 1.0], [1024.0, 0.0, 1.0], [0.0, 0.0, 0.0]]),
                                     mode="nearest")
  np.testing.assert_array_equal(got[:, 0], [0.0, x.feats[1, 0], x.feats[0, 0]])


def test_serialisation_on_wide_grids():
  shape, batch = BIG_GRID
  sites = _grid_sites(shape, batch)
  rng = np.random.default_rng(5)
  x = _tensor(sites[rng.permutation(len(sites))], shape, batch)
  n = len(sites)
  srt, _ = serialize.sort_by(x, "linear")
  np.testing.assert_array_equal(srt.coords[:n], sites)  # np.unique sorted them lexicographically
  lin = np.asarray(x.linear_keys())
  assert lin.shape == (x.capacity, 2) and (lin[n:] == -1).all()
  keys = np.asarray(serialize.serialization_keys(x, "morton"))  # bits_for(2048) = 11: two words
  assert keys.shape == (x.capacity, 2)
  srt, perm = serialize.sort_by(x, "morton")
  c = np.asarray(x.coords)[:n]
  full = [sum((((int(v) >> i) & 1) << (3 * i + 2 - a)) for i in range(11) for a, v in enumerate(row[1:])) for row in c]
  order = sorted(range(n), key=lambda i: (int(c[i, 0]), full[i]))
  np.testing.assert_array_equal(np.asarray(perm)[:n], order)
  # Hilbert keys in words: consecutive keys are face-adjacent voxels, across the word boundary too.
  for bits in (11, 21):
    start = 2**30 - 3  # the low word's last keys, then the high word's first
    full_keys = np.arange(start, start + 6, dtype=np.int64)
    words = np.stack([full_keys >> (30 * (serialize.num_words(bits) - 1 - i)) & (2**30 - 1)
                      for i in range(serialize.num_words(bits))], axis=-1).astype(np.int32)
    path = np.asarray(serialize.decode_hilbert(words, bits))
    assert (np.abs(np.diff(path, axis=0)).sum(axis=1) == 1).all()
    np.testing.assert_array_equal(serialize.encode_hilbert(path, bits), words)


def test_wide_mark_keeps_the_first_reference():
  """Racing inserts can leave a second reference to a site further along its probe run (interpret mode runs
  them serially, so the copies are placed by hand): the mark keeps the first, whatever its row."""
  from pallas_kernels import unique_keys
  from pallas_kernels.hash_table import EMPTY, site_home

  shape, tsize = (2048,) * 3, 64
  geom = unique_keys.ProposalGeometry(((0, 0, 0),), (1, 1, 1), (0, 0, 0), shape)  # p = j, site = coords[j]
  coords = jnp.array([[3, 1024, 7, 9], [3, 1024, 7, 9], [0, 0, 7, 9]], jnp.int32)  # rows 0, 1: one site
  home = int(site_home(tuple(coords[0]), shape, tsize - 1))
  for first, second in ((0, 1), (1, 0)):
    table = np.full(tsize, EMPTY, np.int32)
    table[home], table[(home + 1) % tsize] = first, second
    unique, overflow = unique_keys._keep_first(
        jnp.asarray(table), (jnp.array([3], jnp.int32), coords.reshape(-1), jnp.zeros(3, jnp.int32)), block=16,
        num_warps=1, max_probes=tsize, geometry=geom, batch_size=4, interpret=True)
    expect = np.full(tsize, EMPTY, np.int32)
    expect[home] = first
    np.testing.assert_array_equal(unique, expect)
    assert not bool(overflow)


# ---- Triton lowering of the wide kernels (CPU) -----------------------------------------------------------


def test_wide_kernels_lower_to_triton():
  from triton_lowering import lower_for_cuda

  from pallas_kernels import unique_keys
  from pallas_kernels.hash_table import neighbor_map_hashed

  offsets = jsparse.neighbors.kernel_offsets(3)
  text = lower_for_cuda(lambda c, n: neighbor_map_hashed(c, n, spatial_shape=(2048,) * 3, offsets=offsets,
                                                         wide_keys=True), jnp.zeros((1000, 4), jnp.int32), jnp.int32(0))
  assert text.count("__gpu$xla.gpu.triton") == 2 and "hash_build_wide" in text and "hash_query_wide" in text

  geom = unique_keys.ProposalGeometry(tuple(map(tuple, np.array(list(itertools.product(range(3), repeat=3))).tolist())),
                                      (2, 2, 2), (1, 1, 1), (1024, 1024, 1024))

  def f(c, n):
    table = unique_keys.dedupe_proposals(c, n, geometry=geom, batch_size=8, wide_keys=True)
    sites, inv, overflow = unique_keys.output_sites(c, n, table, 700, geometry=geom, batch_size=8, wide_keys=True)
    return sites, inv, table.count, overflow | table.overflow

  text = lower_for_cuda(f, jnp.zeros((1000, 4), jnp.int32), jnp.int32(0))
  assert text.count("__gpu$xla.gpu.triton") == 3
  for name in ("unique_insert_wide", "unique_mark_wide", "unique_lookup_wide"):
    assert name in text


# ---- GPU: the real kernels against the XLA path on random wide grids --------------------------------------


def _random_wide_tensor(seed, n, shape, batch):
  """n distinct random sites in clusters (so that neighbours and shared output sites exist), padded."""
  rng = np.random.default_rng(seed)
  centres = np.stack([rng.integers(0, batch, n // 8 + 1)] + [rng.integers(0, s, n // 8 + 1) for s in shape], axis=1)
  c = centres[rng.integers(0, len(centres), 2 * n)]
  c[:, 1:] = np.clip(c[:, 1:] + rng.integers(-2, 3, (2 * n, 3)), 0, np.array(shape) - 1)
  c = np.unique(c, axis=0)[:n]
  return _tensor(c[rng.permutation(len(c))], shape, batch, capacity=jsparse.round_capacity(len(c)), seed=seed)


def test_random_wide_grid_interpret():
  """Clustered random sites on 2048^3 x 8: Pallas (interpret) and XLA against the references."""
  shape, batch = (2048,) * 3, 8
  x = _random_wide_tensor(7, 120, shape, batch)
  n = int(x.num)
  sites = np.asarray(x.coords)[:n]
  ref = _ref_neighbors(sites, x.capacity, shape, jsparse.neighbors.kernel_offsets(3))
  out, inv = _ref_pair_map(sites, x.capacity, shape, (3,) * 3, 2, 1)
  for implementation in ("xla", "pallas"):
    np.testing.assert_array_equal(neighbor_map(x, 3, implementation=implementation).nbr, ref)
    pm = pair_map(x, 3, 2, 1, out_capacity=len(out) + 5, implementation=implementation)
    np.testing.assert_array_equal(pm.out_coords[: len(out)], out)
    np.testing.assert_array_equal(pm.inv, inv)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,batch", [((2048,) * 3, 8), ((2048,) * 3, 4), ((1024,) * 3, 2), ((1500, 1300, 1700), 3)])
def test_gpu_wide_grids_match_xla(shape, batch):
  assert key_width(batch, shape) == 2
  for seed, n in ((0, 5000), (1, 200_000)):
    x = _random_wide_tensor(seed, n, shape, batch)
    for ks, dil in ((3, 1), (5, 2)):
      a = neighbor_map(x, ks, dil, implementation="xla").nbr
      b = neighbor_map(x, ks, dil, implementation="pallas").nbr
      np.testing.assert_array_equal(a, b)
    for ks, st, pad in ((3, 2, 1), (2, 2, 0)):
      a = pair_map(x, ks, st, pad, implementation="xla")
      b = pair_map(x, ks, st, pad, out_capacity=a.out_capacity, implementation="pallas")
      for field in ("out_coords", "out_num", "nbr", "inv"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
