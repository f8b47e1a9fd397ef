"""Tests for pallas_kernels/hash_table.py (GPU hash-table neighbour map) and pallas_kernels/unique_keys.py
(strided-convolution output sites deduplicated with that hash table).

CPU: interpret-mode kernels against a numpy reference, and Triton lowering (no GPU needed).
GPU (``-m gpu``, skipped elsewhere): the real Triton kernels, including atomic_xchg.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from benchmarks.workloads import sphere_shell_coords
from pallas_kernels import unique_keys
from pallas_kernels.hash_table import EMPTY, MAX_BLOCK, MAX_PAIRS, _home, neighbor_map_hashed


def _cube(k=3, dilation=1):
  r = range(-(k // 2), k // 2 + 1)
  return tuple((a * dilation, b * dilation, c * dilation) for a in r for b in r for c in r)


OFFS_333 = _cube(3)
OFFS_331 = tuple((a, b, 0) for a in (-1, 0, 1) for b in (-1, 0, 1))
OFFS_DIL2 = _cube(3, dilation=2)
OFFS_ODD = ((0, 0, 0), (1, 0, 0), (0, 2, -1), (-3, 1, 1), (2, 2, 2))  # not symmetric


# ------------------------------------------------------------------------------------------
# References
# ------------------------------------------------------------------------------------------


def ref_dict(coords, num, spatial_shape, offsets):
  """Plain python/numpy reference: dict of coords -> row."""
  coords = np.asarray(coords)
  X, Y, Z = spatial_shape
  cap = coords.shape[0]
  table = {tuple(int(c) for c in coords[i]): i for i in range(num)}
  out = np.full((cap, len(offsets)), -1, np.int32)
  for i in range(num):
    b, x, y, z = (int(c) for c in coords[i])
    for v, (dx, dy, dz) in enumerate(offsets):
      nx, ny, nz = x + dx, y + dy, z + dz
      if 0 <= nx < X and 0 <= ny < Y and 0 <= nz < Z:
        out[i, v] = table.get((b, nx, ny, nz), -1)
  return out


def ref_sorted(coords, num, spatial_shape, offsets):
  """Vectorised numpy reference (sorted keys + searchsorted), fast for 1e5-1e6 points."""
  coords = np.asarray(coords, np.int64)
  X, Y, Z = spatial_shape
  cap = coords.shape[0]
  c = coords[:num]
  keys = ((c[:, 0] * X + c[:, 1]) * Y + c[:, 2]) * Z + c[:, 3]
  order = np.argsort(keys, kind="stable")
  skeys = keys[order]
  out = np.full((cap, len(offsets)), -1, np.int32)
  if num == 0:
    return out
  for v, (dx, dy, dz) in enumerate(offsets):
    nx, ny, nz = c[:, 1] + dx, c[:, 2] + dy, c[:, 3] + dz
    inside = (nx >= 0) & (nx < X) & (ny >= 0) & (ny < Y) & (nz >= 0) & (nz < Z)
    q = ((c[:, 0] * X + nx) * Y + ny) * Z + nz
    pos = np.minimum(np.searchsorted(skeys, q), num - 1)
    hit = inside & (skeys[pos] == q)
    out[:num, v] = np.where(hit, order[pos], -1)
  return out


def random_points(rng, spatial_shape, batch, num, capacity, pad="neg1"):
  """num distinct random sites over `batch` batches, shuffled, in a [capacity, 4] array."""
  X, Y, Z = spatial_shape
  vol = X * Y * Z
  lin = rng.choice(batch * vol, size=num, replace=False)
  b, r = np.divmod(lin, vol)
  x, r = np.divmod(r, Y * Z)
  y, z = np.divmod(r, Z)
  coords = np.empty((capacity, 4), np.int32)
  coords[:num] = np.stack([b, x, y, z], axis=1)
  if pad == "neg1":
    coords[num:] = -1
  elif pad == "garbage":
    coords[num:] = rng.integers(-50, 50, size=(capacity - num, 4))
    if capacity > num and num > 0:  # also copies of valid rows: must stay ignored
      coords[num] = coords[0]
  elif pad == "zero":
    coords[num:] = 0
  return coords


# ------------------------------------------------------------------------------------------
# CPU: interpret mode
# ------------------------------------------------------------------------------------------


def _run_interpret(coords, num, spatial_shape, offsets, **kw):
  nbr, ovf = neighbor_map_hashed(jnp.asarray(coords), jnp.int32(num), spatial_shape=spatial_shape,
                                 offsets=offsets, interpret=True, **kw)
  return np.asarray(nbr), bool(ovf)


def test_reference_self_consistent():
  rng = np.random.default_rng(1)
  coords = random_points(rng, (7, 5, 9), 2, 120, 150, pad="garbage")
  for offs in (OFFS_333, OFFS_DIL2, OFFS_ODD):
    np.testing.assert_array_equal(ref_sorted(coords, 120, (7, 5, 9), offs),
                                  ref_dict(coords, 120, (7, 5, 9), offs))


@pytest.mark.parametrize(
    "spatial_shape,batch,num,capacity,offsets,pad",
    [
        ((7, 5, 9), 1, 60, 64, OFFS_333, "neg1"),
        ((7, 5, 9), 3, 150, 200, OFFS_333, "garbage"),
        ((4, 11, 6), 2, 90, 128, OFFS_331, "neg1"),
        ((9, 9, 8), 2, 200, 237, OFFS_DIL2, "garbage"),
        ((5, 6, 7), 2, 100, 100, OFFS_ODD, "zero"),  # no padding rows at all
        ((3, 3, 3), 1, 27, 40, OFFS_333, "neg1"),  # dense: every in-grid neighbour exists
    ],
)
def test_interpret_matches_reference(spatial_shape, batch, num, capacity, offsets, pad):
  rng = np.random.default_rng(hash((spatial_shape, batch, num, capacity, pad)) % 2**32)
  coords = random_points(rng, spatial_shape, batch, num, capacity, pad=pad)
  nbr, ovf = _run_interpret(coords, num, spatial_shape, offsets)
  assert not ovf
  assert nbr.shape == (capacity, len(offsets)) and nbr.dtype == np.int32
  np.testing.assert_array_equal(nbr, ref_dict(coords, num, spatial_shape, offsets))


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("table_size", [256, 2048])  # load factor 100/256, 100/2048
def test_interpret_layouts_blocks_table_sizes(interleave, table_size):
  # Both table layouts; the smallest allowed table (2 x capacity, rounded up) and a large one;
  # block_pairs not dividing capacity*V.
  rng = np.random.default_rng(7)
  coords = random_points(rng, (6, 6, 6), 2, 100, 100, pad="garbage")
  nbr, ovf = _run_interpret(coords, 100, (6, 6, 6), OFFS_333, block_rows=8, block_pairs=64,
                            table_size=table_size, interleave=interleave)
  assert not ovf
  np.testing.assert_array_equal(nbr, ref_dict(coords, 100, (6, 6, 6), OFFS_333))


def test_interpret_empty():
  coords = np.full((16, 4), -1, np.int32)
  nbr, ovf = _run_interpret(coords, 0, (4, 4, 4), OFFS_333)
  assert not ovf
  np.testing.assert_array_equal(nbr, np.full((16, 27), -1, np.int32))


def test_interpret_jit_traced_num():
  rng = np.random.default_rng(3)
  shape = (8, 5, 7)
  cap = 96
  coords = random_points(rng, shape, 2, cap, cap, pad="neg1")  # first k rows valid for any k

  @jax.jit
  def f(c, n):
    return neighbor_map_hashed(c, n, spatial_shape=shape, offsets=OFFS_333, interpret=True)

  for num in (0, 1, 50, 96):
    c = coords.copy()
    c[num:] = rng.integers(-3, 9, size=(cap - num, 4))  # garbage padding
    nbr, ovf = f(jnp.asarray(c), jnp.int32(num))
    assert not bool(ovf)
    np.testing.assert_array_equal(np.asarray(nbr), ref_dict(c, num, shape, OFFS_333))
  assert f._cache_size() == 1  # num traced: one compilation


def test_interpret_overflow_flag_with_tiny_probe_bound():
  # max_probes=1: collisions are certain with 128 keys in 256 slots; must flag, not hang.
  rng = np.random.default_rng(5)
  coords = random_points(rng, (8, 8, 8), 1, 128, 128)
  _, ovf = _run_interpret(coords, 128, (8, 8, 8), OFFS_333, max_probes=1)
  assert ovf


@pytest.mark.parametrize("interleave", [True, False])
def test_interpret_padding_rows_next_to_valid_sites_are_never_neighbours(interleave):
  """Padding rows (>= num) may hold in-grid sites right next to valid rows (a shrunk tensor's stale rows): they
  must not be inserted, or a lookup of that site finds a key whose value no valid row wrote (with two tables
  the value table is not initialised)."""
  shape = (6, 6, 6)
  rng = np.random.default_rng(23)
  coords = random_points(rng, shape, 1, 40, 64)
  occupied = {tuple(c) for c in coords[:40].tolist()}
  stale = []
  for b, x, y, z in coords[:40].tolist():  # empty in-grid sites one step from a valid row
    for d in ((1, 0, 0), (0, 1, 0), (0, 0, 1), (-1, 0, 0)):
      site = (b, x + d[0], y + d[1], z + d[2])
      if all(0 <= c < n for c, n in zip(site[1:], shape)) and site not in occupied and site not in stale:
        stale.append(site)
  coords[40:] = np.asarray(stale[:24], np.int32)
  nbr, ovf = _run_interpret(coords, 40, shape, OFFS_333, interleave=interleave)
  assert not ovf
  np.testing.assert_array_equal(nbr, ref_dict(coords, 40, shape, OFFS_333))


def test_table_size_below_twice_the_capacity_raises():
  """table_size must hold the load factor at 1/2 or below (what bounds every probe loop): a table of exactly
  `capacity` slots is refused, in interpret mode too (no Triton lowering that could fail first)."""
  coords = jnp.asarray(random_points(np.random.default_rng(2), (4, 4, 4), 1, 16, 16))
  with pytest.raises(ValueError, match="table_size must be a power of two >= 2\\*capacity"):
    neighbor_map_hashed(coords, 16, spatial_shape=(4, 4, 4), offsets=OFFS_333, table_size=16, interpret=True)
  nbr, ovf = _run_interpret(coords, 16, (4, 4, 4), OFFS_333, table_size=32)
  assert not ovf
  np.testing.assert_array_equal(nbr, ref_dict(coords, 16, (4, 4, 4), OFFS_333))


def test_max_probes_bounds_the_probes_exactly():
  """Two sites with one home slot: the second insertion takes two swaps, so max_probes=1 must flag overflow and
  max_probes=2 must not (a bound of one too many probes would hide the first)."""
  shape, tsize = (4, 4, 4), 16
  sites = [(0, x, y, z) for x in range(4) for y in range(4) for z in range(4)]
  homes = [int(_home(jnp.int32(((b * 4 + x) * 4 + y) * 4 + z), tsize - 1)) for b, x, y, z in sites]
  first = 0
  second = next(i for i in range(1, len(sites)) if homes[i] == homes[first])
  coords = np.full((8, 4), -1, np.int32)
  coords[:2] = [sites[first], sites[second]]
  centre = ((0, 0, 0),)  # answered without a lookup: only the build and the fill probe
  _, ovf = _run_interpret(coords, 2, shape, centre, table_size=tsize, max_probes=1)
  assert ovf
  nbr, ovf = _run_interpret(coords, 2, shape, centre, table_size=tsize, max_probes=2)
  assert not ovf
  np.testing.assert_array_equal(nbr[:, 0], [0, 1, -1, -1, -1, -1, -1, -1])


def test_bad_arguments():
  c = jnp.zeros((8, 4), jnp.int32)
  with pytest.raises(ValueError):
    neighbor_map_hashed(c, 0, spatial_shape=(4, 4, 4), offsets=OFFS_333, table_size=8)
  with pytest.raises(ValueError):
    neighbor_map_hashed(c, 0, spatial_shape=(4, 4, 4), offsets=OFFS_333, block_pairs=100)
  with pytest.raises(ValueError, match="block_pairs must be a power of two up to"):
    neighbor_map_hashed(c, 0, spatial_shape=(4, 4, 4), offsets=OFFS_333, block_pairs=2 * MAX_BLOCK)


def test_tables_past_2_30_slots_raise_naming_the_capacity():
  """A general transposed convolution of 40M rows (k 3: 27 proposals each) sized its output-site table at 2**31
  slots, and a submanifold map of 300M rows with a (3, 1, 1) kernel at 2**31 too: their int32 slot masks and probe
  bounds failed in tracing with JAX's OverflowError, naming nothing the caller passed. Both raise ValueError now;
  the largest table that traces, 2**30 slots (20M rows here), still does. Shapes only: nothing is allocated."""
  S = jax.ShapeDtypeStruct

  def transpose(rows):
    def run(coords, feats, num, w):
      x = jsparse.SparseTensor(coords, feats, num, (700, 700, 700), 2)
      return jsparse.sparse_conv_transpose3d(x, w, stride=2, padding=1, out_capacity=1000,
                                             implementation="pallas").feats
    return jax.eval_shape(run, S((rows, 4), jnp.int32), S((rows, 8), jnp.float16), S((), jnp.int32),
                          S((3, 3, 3, 8, 8), jnp.float16))

  with pytest.raises(ValueError, match="x.capacity=40000000 rows x 27 kernel offsets needs a hash table of "
                                       "2147483648 slots.*implementation='xla'"):
    transpose(40_000_000)
  assert transpose(20_000_000).shape == (1000, 8)
  big = S((300_000_000, 4), jnp.int32)
  with pytest.raises(ValueError, match="capacity=300000000 rows needs a hash table of 2147483648 slots"):
    jax.eval_shape(lambda c: neighbor_map_hashed(c, 0, spatial_shape=(4, 4, 4), offsets=((-1, 0, 0), (0, 0, 0),
                                                                                          (1, 0, 0)))[0], big)


def test_pair_counts_leave_room_for_the_last_blocks_lanes():
  # A kernel's last block computes lane indices up to a block past the pair count, so a count within a block
  # of 2**31 would wrap int32 lane indices (shapes only: nothing is allocated).
  one_offset = ((0, 0, 0),)
  geom = unique_keys.ProposalGeometry(one_offset, (2, 2, 2), (0, 0, 0), (4, 4, 4))
  assert unique_keys.check_coords(jax.ShapeDtypeStruct((MAX_PAIRS, 4), jnp.int32), geom, 1) == (MAX_PAIRS, 1)
  too_many = jax.ShapeDtypeStruct((2**31 - 100, 4), jnp.int32)
  with pytest.raises(ValueError, match="flat int32 pair index"):
    unique_keys.check_coords(too_many, geom, 1)
  query = functools.partial(neighbor_map_hashed, spatial_shape=(4, 4, 4), offsets=one_offset)
  with pytest.raises(ValueError, match="flat int32 pair index"):
    jax.eval_shape(query, too_many, 1)


# ------------------------------------------------------------------------------------------
# Output sites (unique_keys.py), CPU: interpret mode against numpy
# ------------------------------------------------------------------------------------------


def _conv_geometry(kernel_size, stride, padding, dilation, in_shape):
  """ProposalGeometry of a strided convolution: offsets in C order, output grid as lax.conv."""
  offsets = tuple(tuple(a * dilation for a in o) for o in np.ndindex(*kernel_size))
  out_shape = tuple((n + 2 * padding - dilation * (k - 1) - 1) // stride + 1
                    for n, k in zip(in_shape, kernel_size))
  return unique_keys.ProposalGeometry(offsets, (stride,) * 3, (padding,) * 3, out_shape)


def ref_output_sites(coords, num, geometry, out_capacity, batch_size=None):
  """numpy: (out_keys, inv, count) of the proposals of rows < num (module docstring of unique_keys); given
  batch_size, rows whose batch lies outside [0, batch_size) propose nothing."""
  c = np.asarray(coords, np.int64)[:num]
  offs = np.asarray(geometry.offsets, np.int64).reshape(-1, 3)
  st, pad, out = (np.asarray(t, np.int64) for t in (geometry.stride, geometry.padding, geometry.out_shape))
  shifted = c[:, None, 1:] + pad - offs[None]  # [num, V, 3]
  o = shifted // st
  ok = np.all((shifted >= 0) & (shifted % st == 0) & (o < out), axis=-1)
  if batch_size is not None:
    ok &= ((c[:, 0] >= 0) & (c[:, 0] < batch_size))[:, None]
  keys = ((c[:, None, 0] * out[0] + o[..., 0]) * out[1] + o[..., 1]) * out[2] + o[..., 2]
  distinct = np.unique(keys[ok])
  kept = distinct[:out_capacity]
  out_keys = np.full(out_capacity, unique_keys.BIG, np.int64)
  out_keys[:len(kept)] = kept
  inv = np.full((len(coords), len(offs)), -1, np.int64)
  pos = np.searchsorted(kept, keys)
  hit = ok & (np.append(kept, -1)[pos] == keys)  # pos == len(kept) reads the -1 sentinel
  inv[:num] = np.where(hit, pos, -1)
  return out_keys, inv, len(distinct)


def _output_sites_interpret(coords, num, geometry, batch_size, out_capacity, **kw):
  table = unique_keys.dedupe_proposals(jnp.asarray(coords), jnp.int32(num), geometry=geometry,
                                       batch_size=batch_size, interpret=True, **kw)
  out_keys, inv, overflow = unique_keys.output_sites(jnp.asarray(coords), jnp.int32(num), table,
                                                     out_capacity, geometry=geometry, batch_size=batch_size,
                                                     interpret=True)
  return table, np.asarray(out_keys), np.asarray(inv), bool(overflow | table.overflow)


# (in_shape, batch, num, capacity, kernel_size, stride, padding, dilation); tests/test_occupancy_sites.py too.
OUTPUT_SITE_CASES = [
    ((7, 5, 9), 2, 60, 70, (3, 3, 3), 2, 1, 1),
    ((8, 6, 5), 1, 50, 50, (2, 2, 2), 2, 0, 1),  # kernel == stride: one proposal per site
    ((6, 7, 5), 3, 40, 45, (3, 2, 1), 1, 0, 1),  # stride 1: many duplicates per site
    ((9, 8, 7), 2, 40, 48, (3, 3, 3), 3, 2, 2),  # dilation, padding > 1
]


@pytest.mark.parametrize("in_shape,batch,num,capacity,kernel_size,stride,padding,dilation", OUTPUT_SITE_CASES)
def test_output_sites_interpret_matches_numpy(in_shape, batch, num, capacity, kernel_size, stride, padding,
                                              dilation):
  rng = np.random.default_rng(num * 31 + capacity)
  coords = random_points(rng, in_shape, batch, num, capacity, pad="garbage")
  geom = _conv_geometry(kernel_size, stride, padding, dilation, in_shape)
  count = ref_output_sites(coords, num, geom, 0)[2]
  distinct = ref_output_sites(coords, num, geom, count)[0]
  # Exact capacity, spare rows, and too few rows (then the smallest keys are kept).
  for out_capacity in (count, count + 9, count // 2, 1, 0):
    table, out_keys, inv, overflow = _output_sites_interpret(coords, num, geom, batch, out_capacity)
    ref_keys, ref_inv, _ = ref_output_sites(coords, num, geom, out_capacity)
    assert not overflow and int(table.count) == count
    np.testing.assert_array_equal(out_keys, ref_keys)
    np.testing.assert_array_equal(inv, ref_inv)
    unique = np.asarray(table.unique)  # every distinct key exactly once
    np.testing.assert_array_equal(np.sort(unique[unique != EMPTY]), distinct)
    # Inserted serially (one lane per program), repeated proposals never leave a second copy.
    assert np.sum(np.asarray(table.table) != EMPTY) == count


def test_output_sites_interpret_capacity_beyond_table_and_traced_num():
  # out_capacity larger than the table (no sort of more than T keys); num traced under jit.
  rng = np.random.default_rng(4)
  shape, cap = (5, 4, 6), 40
  coords = random_points(rng, shape, 2, cap, cap, pad="neg1")
  geom = _conv_geometry((2, 2, 2), 2, 0, 1, shape)
  tsize = unique_keys.default_table_size(cap, geom, 2)

  @jax.jit
  def f(c, n):
    table = unique_keys.dedupe_proposals(c, n, geometry=geom, batch_size=2, interpret=True)
    keys, inv, ovf = unique_keys.output_sites(c, n, table, tsize + 5, geometry=geom, batch_size=2, interpret=True)
    return table.count, keys, inv, ovf | table.overflow

  for num in (0, 17, cap):
    count, keys, inv, ovf = f(jnp.asarray(coords), jnp.int32(num))
    ref_keys, ref_inv, ref_count = ref_output_sites(coords, num, geom, tsize + 5)
    assert not bool(ovf) and int(count) == ref_count
    np.testing.assert_array_equal(np.asarray(keys), ref_keys)
    np.testing.assert_array_equal(np.asarray(inv), ref_inv)
  assert f._cache_size() == 1


def test_keep_first_copies_drops_later_copies():
  # On the GPU, racing swaps can leave a key in two slots of its probe run; interpret mode never does,
  # so build such a table by hand: a at its home h, b (home h+1) at h+1, copies of a at h+2 and h+3.
  tsize = 16
  home = lambda k: int(_home(jnp.int32(k), tsize - 1))
  a = 1234
  h = home(a)
  b = next(k for k in range(10_000) if k != a and home(k) == (h + 1) % tsize)
  table = np.full(tsize, EMPTY, np.int32)
  for i, k in enumerate((a, b, a, a)):
    table[(h + i) % tsize] = k
  unique, overflow = unique_keys._keep_first(jnp.asarray(table), block=8, num_warps=1, max_probes=tsize,
                                             interpret=True)
  expected = np.full(tsize, EMPTY, np.int32)
  expected[h], expected[(h + 1) % tsize] = a, b
  assert not bool(overflow)
  np.testing.assert_array_equal(np.asarray(unique), expected)


def test_output_sites_overflow_flag_with_tiny_probe_bound():
  rng = np.random.default_rng(6)
  coords = random_points(rng, (8, 8, 8), 1, 100, 100)
  geom = _conv_geometry((3, 3, 3), 1, 1, 1, (8, 8, 8))
  *_, overflow = _output_sites_interpret(coords, 100, geom, 1, 400, max_probes=1)
  assert overflow


def test_output_sites_bad_arguments():
  c = jnp.zeros((8, 4), jnp.int32)
  geom = _conv_geometry((3, 3, 3), 2, 1, 1, (4, 4, 4))
  dedupe = functools.partial(unique_keys.dedupe_proposals, geometry=geom, batch_size=1, interpret=True)
  assert unique_keys.default_table_size(8, geom, 1) == 16  # 2 x 2 x 2 output sites, x 1.5, >= 16
  for table_size in (8, 24):  # too small; not a power of two
    with pytest.raises(ValueError, match="table_size"):
      dedupe(c, 0, table_size=table_size)
  with pytest.raises(ValueError, match="block_pairs"):
    dedupe(c, 0, block_pairs=100)
  with pytest.raises(ValueError, match="max_probes"):
    dedupe(c, 0, max_probes=0)
  with pytest.raises(ValueError, match="coords"):
    dedupe(jnp.zeros((8, 3), jnp.int32), 0)
  table = unique_keys.dedupe_proposals(c, 0, geometry=geom, batch_size=1, interpret=True)
  with pytest.raises(ValueError, match="out_capacity"):
    unique_keys.output_sites(c, 0, table, -1, geometry=geom, batch_size=1, interpret=True)


def test_proposals_per_site_and_table_size():
  assert unique_keys.proposals_per_site(_conv_geometry((2, 2, 2), 2, 0, 1, (8, 8, 8))) == 1
  assert unique_keys.proposals_per_site(_conv_geometry((3, 3, 3), 2, 1, 1, (8, 8, 8))) == 8
  assert unique_keys.proposals_per_site(_conv_geometry((3, 3, 3), 1, 1, 1, (8, 8, 8))) == 27
  assert unique_keys.proposals_per_site(_conv_geometry((3, 3, 3), 2, 2, 2, (8, 8, 8))) == 27  # 2d = 0 mod 2
  # The smaller of capacity * P and the output grid, times 1.5, rounded up to a power of two.
  assert unique_keys.default_table_size(1000, _conv_geometry((3, 3, 3), 2, 1, 1, (8, 8, 8)), 1) == 128
  assert unique_keys.default_table_size(10, _conv_geometry((3, 3, 3), 2, 1, 1, (64, 64, 64)), 1) == 128
  assert unique_keys.default_table_size(11, _conv_geometry((3, 3, 3), 2, 1, 1, (64, 64, 64)), 1) == 256


# ------------------------------------------------------------------------------------------
# CPU: Triton lowering (GPU path, interpret=False)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("offsets,interleave", [(OFFS_333, True), (OFFS_331, False)])
def test_triton_lowering(offsets, interleave):
  from triton_lowering import lower_for_cuda

  def f(c, n):
    return neighbor_map_hashed(c, n, spatial_shape=(32, 17, 9), offsets=offsets,
                               interleave=interleave)

  text = lower_for_cuda(f, jnp.zeros((1000, 4), jnp.int32), jnp.int32(0))
  assert text.count("__gpu$xla.gpu.triton") == 3
  for name in ("hash_build", "hash_fill", "hash_query"):
    assert name in text


@pytest.mark.parametrize("kernel_size,stride,padding,dilation",
                         [((3, 3, 3), 2, 1, 1), ((2, 2, 2), 2, 0, 1), ((3, 1, 3), 1, 0, 2)])
def test_output_sites_triton_lowering(kernel_size, stride, padding, dilation):
  from triton_lowering import lower_for_cuda

  geom = _conv_geometry(kernel_size, stride, padding, dilation, (32, 17, 9))

  def f(c, n):
    table = unique_keys.dedupe_proposals(c, n, geometry=geom, batch_size=2)
    out_keys, inv, overflow = unique_keys.output_sites(c, n, table, 700, geometry=geom, batch_size=2)
    return out_keys, inv, table.count, overflow | table.overflow

  text = lower_for_cuda(f, jnp.zeros((1000, 4), jnp.int32), jnp.int32(0))
  # 700 rows < T: the overflow cut-off is searched on the device (the fourth kernel, no lax.cond).
  assert text.count("__gpu$xla.gpu.triton") == 4 and "stablehlo.case" not in text
  for name in ("unique_insert", "unique_mark", "unique_lookup", "unique_kth_smallest"):
    assert name in text


# ------------------------------------------------------------------------------------------
# GPU: real Triton kernels
# ------------------------------------------------------------------------------------------


_on_gpu = jax.default_backend() == "gpu"


@pytest.mark.gpu
@pytest.mark.skipif(not _on_gpu, reason="needs a CUDA GPU")
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("res", [64, 256])
def test_gpu_sphere_shell(res, interleave):
  pts = sphere_shell_coords(res)
  rng = np.random.default_rng(res)
  pts = pts[rng.permutation(len(pts))]
  num = len(pts)
  cap = num + 37
  coords = np.full((cap, 4), -1, np.int32)
  coords[:num] = pts
  shape = (res, res, res)
  f = jax.jit(lambda c, n: neighbor_map_hashed(c, n, spatial_shape=shape, offsets=OFFS_333,
                                               interleave=interleave))
  nbr, ovf = f(jnp.asarray(coords), jnp.int32(num))
  assert not bool(ovf)
  ref = ref_sorted(coords, num, shape, OFFS_333)
  nbr = np.asarray(nbr)
  mism = np.argwhere(nbr != ref)
  assert mism.size == 0, f"{len(mism)} mismatches, first {mism[:5].tolist()}"
  if res == 256:
    assert num > 200_000


@pytest.mark.gpu
@pytest.mark.skipif(not _on_gpu, reason="needs a CUDA GPU")
@pytest.mark.parametrize("offsets", [OFFS_333, OFFS_DIL2, OFFS_ODD])
def test_gpu_random_batched_padded(offsets):
  rng = np.random.default_rng(11)
  shape = (61, 40, 77)
  num, cap = 60_000, 70_001
  coords = random_points(rng, shape, 2, num, cap, pad="garbage")
  f = jax.jit(lambda c, n: neighbor_map_hashed(c, n, spatial_shape=shape, offsets=offsets))
  for n in (num, num // 3):  # traced num, same compiled function
    nbr, ovf = f(jnp.asarray(coords), jnp.int32(n))
    assert not bool(ovf)
    np.testing.assert_array_equal(np.asarray(nbr), ref_sorted(coords, n, shape, offsets))


def compare_pair_maps_on_sphere_shell(res, batch_size, kernel_size, stride, padding, implementation, grid=None):
  """jsparse.pair_map by `implementation` against the XLA path on a shuffled sphere shell (in a grid of `grid`
  sites per axis, default res) with garbage padding rows, under jit: exact, spare and too small out_capacity.
  Identical fields, order included. The Pallas path searches a small grid's output sites with the occupancy
  map and a large sparse one's with the hash table (occupancy_sites.fits); `grid` picks the side."""
  import jsparse
  from jsparse.sparse_conv import pair_map

  rng = np.random.default_rng(res * 10 + kernel_size)
  pts = sphere_shell_coords(res, batch_size)
  pts = pts[rng.permutation(len(pts))]
  num, cap = len(pts), len(pts) + 37
  x = jsparse.SparseTensor.from_coords(pts, np.zeros((num, 1), np.float32), (grid or res,) * 3, batch_size,
                                       capacity=cap)
  coords = np.asarray(x.coords).copy()
  coords[num:] = rng.integers(-3, res + 3, size=(cap - num, 4))  # padding rows must stay ignored
  coords[num] = coords[0]
  x = x.replace(coords=jnp.asarray(coords))
  from jsparse.sparse_conv import _proposal_geometry, geometry
  from pallas_kernels import occupancy_sites
  rule = _proposal_geometry(geometry(x.spatial_shape, (kernel_size,) * 3, (stride,) * 3, (padding,) * 3, (1,) * 3))
  assert occupancy_sites.fits(cap, rule, batch_size) == (grid is None)  # the side of the search `grid` picks
  count = int(pair_map(x, kernel_size, stride, padding, implementation="xla").out_num)
  fields = ("out_coords", "out_num", "nbr", "inv", "overflow")
  for out_capacity in (count, count + 1000, count - count // 3):
    maps = {}
    for impl in ("xla", implementation):
      f = jax.jit(lambda x, impl=impl: pair_map(x, kernel_size, stride, padding, out_capacity=out_capacity,
                                                implementation=impl))
      maps[impl] = [np.asarray(getattr(f(x), name)) for name in fields]
    ref, got = maps["xla"], maps[implementation]
    assert bool(ref[4]) == (out_capacity < count)
    for name, r, g in zip(fields, ref, got):
      mism = np.argwhere(np.atleast_1d(r != g))
      assert mism.size == 0, f"{name} (out_capacity={out_capacity}): {len(mism)} mismatches, first {mism[:5].tolist()}"
  return count


@pytest.mark.parametrize("grid", [None, 256], ids=["occupancy", "hash_table"])
def test_compare_pair_maps_on_sphere_shell_interpret(grid):
  # The GPU test's body, small and in interpret mode, so that it is known to be right before a GPU runs it.
  assert compare_pair_maps_on_sphere_shell(8, 2, 2, 2, 0, "pallas", grid) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not _on_gpu, reason="needs a CUDA GPU")
@pytest.mark.parametrize("grid", [None, 1024], ids=["occupancy", "hash_table"])
@pytest.mark.parametrize("kernel_size,stride,padding", [(3, 2, 1), (2, 2, 0), (3, 1, 1)])
def test_gpu_output_sites_sphere_shell(kernel_size, stride, padding, grid):
  # RES 128, two batch items: ~128k sites; (3, 1, 1) gives up to 27 racing inserts of each key (hash table)
  # and of each byte (occupancy map). In a 1024^3 grid the hash table serves (wide keys for stride 1).
  count = compare_pair_maps_on_sphere_shell(128, 2, kernel_size, stride, padding, "pallas", grid)
  assert count > 10_000
