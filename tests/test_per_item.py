"""jsparse.per_item: per-batch-item sums and their broadcast, against numpy on random tensors with padding; and
every per-item op's results for one item independent of the other items."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jsparse
from jsparse import norm, per_item, sampling, serialize, voxelize
from reference import random_sparse


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_per_item_sums_match_numpy(seed):
  rng = np.random.default_rng(seed)
  x = random_sparse(rng, (5, 6, 4), 3, batch_size=3, pad=7)
  n = int(x.num)
  items = np.asarray(x.coords[:n, 0])
  values = rng.standard_normal((x.capacity, 2, 3)).astype(np.float32)
  one_hot = per_item.item_one_hot(x)
  sums = np.asarray(per_item.sum_per_item(one_hot, jnp.asarray(values)))
  want = np.zeros((3, 2, 3))
  np.add.at(want, items, values[:n])  # padding rows (and their nonzero values) must not count
  np.testing.assert_allclose(sums, want, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(per_item.count_per_item(one_hot)), np.bincount(items, minlength=3))
  table = rng.standard_normal((3, 4)).astype(np.float32)
  rows = np.asarray(per_item.per_row(one_hot, jnp.asarray(table)))
  np.testing.assert_array_equal(rows[:n], table[items])
  np.testing.assert_array_equal(rows[n:], 0)


@pytest.mark.parametrize("batch_size", [3, 12])
@pytest.mark.parametrize("capacity", [per_item.SUM_CHUNK_ROWS, 2 * per_item.SUM_CHUNK_ROWS + 276])
def test_per_item_sums_over_several_chunks(capacity, batch_size):
  """The sums run per chunk of SUM_CHUNK_ROWS rows, then over the chunks: a capacity of whole chunks and one
  that needs zero rows appended, items interleaved across chunk boundaries, padding rows holding garbage, and
  +inf / -inf / NaN in item 2 only, which must not reach the other items (float64 numpy reference); a few
  items and many."""
  rng = np.random.default_rng(capacity)
  n = capacity - 37
  items = rng.integers(0, batch_size, n)
  coords = np.zeros((capacity, 4), np.int32)
  coords[:n, 0] = items
  x = jsparse.SparseTensor(jnp.asarray(coords), jnp.zeros((capacity, 1)), jnp.asarray(n, jnp.int32), (4, 4, 4),
                           batch_size)
  one_hot = per_item.item_one_hot(x)
  values = rng.standard_normal((capacity, 5)).astype(np.float32) * 100
  values[n:] = np.nan  # padding: must not count
  rows2 = np.flatnonzero(items == 2)
  values[rows2[0], 0], values[rows2[1], 1], values[rows2[2], 2] = np.inf, -np.inf, np.nan
  values[rows2[3], 3], values[rows2[4], 3] = np.inf, -np.inf  # inf - inf: NaN
  sums = np.asarray(per_item.sum_per_item(one_hot, jnp.asarray(values)))
  want = np.zeros((batch_size, 5))
  with np.errstate(invalid="ignore"):  # inf + -inf in the reference
    np.add.at(want, items, values[:n].astype(np.float64))
  others = np.arange(batch_size) != 2
  np.testing.assert_allclose(sums[others], want[others], rtol=1e-5, atol=1e-3)
  np.testing.assert_array_equal(np.isposinf(sums[2]), np.isposinf(want[2]))
  np.testing.assert_array_equal(np.isneginf(sums[2]), np.isneginf(want[2]))
  np.testing.assert_array_equal(np.isnan(sums[2]), np.isnan(want[2]))
  np.testing.assert_allclose(sums[2, 4], want[2, 4], rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(per_item.count_per_item(one_hot)),
                                np.bincount(items, minlength=batch_size))


def test_non_finite_counts_decode_per_chunk():
  """The flag column holds n_up + FLAG_DOWN * n_down per chunk: a chunk whose every row is +inf must read as +inf
  (not as a -inf count), +inf and -inf of one item in different chunks as NaN, and the chunk size must keep the
  encoding exact (float32 integers below 2**24, a NaN's flag exact in TF32)."""
  chunk = per_item.SUM_CHUNK_ROWS
  assert chunk < per_item.FLAG_DOWN and per_item.FLAG_DOWN * (chunk + 1) < 2**24
  assert per_item.FLAG_DOWN + 1 <= 2**11  # a NaN's flag is exact in TF32's 11-bit significand too
  capacity, batch_size = 3 * chunk, 2
  items = np.zeros(capacity, np.int64)
  items[chunk:] = np.arange(2 * chunk) % 2  # chunk 0: item 0 only; chunks 1 and 2: both items
  coords = np.zeros((capacity, 4), np.int32)
  coords[:, 0] = items
  x = jsparse.SparseTensor(jnp.asarray(coords), jnp.zeros((capacity, 1)), jnp.asarray(capacity, jnp.int32),
                           (4, 4, 4), batch_size)
  values = np.random.default_rng(9).standard_normal((capacity, 6)).astype(np.float32)
  values[:chunk, 0] = np.inf  # a whole chunk of +inf: n_up = SUM_CHUNK_ROWS
  values[chunk + 1, 1], values[2 * chunk + 3, 1] = np.inf, -np.inf  # item 1, two chunks: NaN
  values[chunk + 2, 2] = np.nan  # item 0: NaN
  values[:chunk, 3] = -np.inf  # a whole chunk of -inf: item 0's -inf
  values[chunk, 3] = np.inf  # and a +inf of item 0 in the next chunk: NaN
  values[2 * chunk + 5, 4] = -np.inf  # item 1: -inf
  sums = np.asarray(per_item.sum_per_item(per_item.item_one_hot(x), jnp.asarray(values)))
  want = np.zeros((batch_size, 6))
  with np.errstate(invalid="ignore"):
    np.add.at(want, items, values.astype(np.float64))
  for check in (np.isposinf, np.isneginf, np.isnan):
    np.testing.assert_array_equal(check(sums), check(want), err_msg=check.__name__)
  assert np.isposinf(sums[0, 0]) and np.isnan(sums[1, 1]) and np.isneginf(sums[1, 4])
  finite = np.isfinite(want)
  np.testing.assert_allclose(sums[finite], want[finite], rtol=1e-5, atol=1e-4)


def test_per_row_reads_items_past_float32_integers():
  """per_row finds a row's table entry through a float32 product with the one-hot: items past 2**24 (batch_size
  is limited only by the grid's 2**62 keys) must still read their own entry, not a neighbour's or NaN."""
  batch_size = 2**24 + 3
  items = np.array([2**24 + 2, 2**24 + 1, 2**24, 2**24 - 1, 0])
  coords = np.zeros((len(items) + 1, 4), np.int32)  # and a padding row
  coords[:len(items), 0] = items
  x = jsparse.SparseTensor(jnp.asarray(coords), jnp.zeros((len(coords), 1)), jnp.asarray(len(items), jnp.int32),
                           (2, 2, 2), batch_size)
  table = (jnp.arange(batch_size, dtype=jnp.int32) % 1000).astype(jnp.float32)[:, None]  # exact in float32
  want = np.append(items % 1000, 0)
  np.testing.assert_array_equal(np.asarray(per_item.per_row(per_item.item_one_hot(x), table))[:, 0], want)
  np.testing.assert_array_equal(np.asarray(jsparse.broadcast_per_item(x, table).feats)[:, 0], want)


def test_global_pool_gradients_stay_row_sized():
  """global_pool's gradients need O(rows x C) memory, not O(rows x batch x C): a masked max over a
  [rows, batch, C] broadcast (once tried for "max") materialises that array in its gradient."""
  import jax

  n, b, c = 20_000, 32, 16
  coords = np.stack([np.arange(n) % b, np.arange(n) // b % 32, np.arange(n) // b // 32, np.zeros(n)], -1)
  x = jsparse.SparseTensor(jnp.asarray(coords, jnp.int32), jnp.ones((n, c), jnp.float32), jnp.asarray(n, jnp.int32),
                           (32, 32, 32), b)
  for reduce in ("max", "mean", "sum"):
    loss = lambda f: jnp.sum(jsparse.global_pool(x.replace(feats=f), reduce) ** 2)  # noqa: E731
    temp = jax.jit(jax.grad(loss)).lower(x.feats).compile().memory_analysis().temp_size_in_bytes
    assert temp < n * b * c * 4 / 4, (reduce, temp)


# ---- per-item independence of every op that is not a batch statistic ----------------------------------------------
# An item's output rows (by site) and the gradient w.r.t. its own features must not change when the other items'
# sites, counts, row positions and features change (batch_norm is the one op that legitimately mixes items: its
# statistics run over the whole batch, so it is not here). tests/test_invariants.py compares an item alone against
# it in a batch for the plain convolutions, pools and norms; this covers the other ops and swaps the other items
# for different ones at one capacity, so both runs are one compiled program.

_B, _C, _GRID, _CAP = 3, 4, (6, 6, 6), 64
_RNG_W = np.random.default_rng(1234)
_W = {k: jnp.asarray((_RNG_W.standard_normal(s) * 0.4).astype(np.float32)) for k, s in {
    "g2": (3, 3, 3, _C // 2, 6), "dw": (3, 3, 3, 1, _C), "s2g2": (3, 3, 3, _C // 2, 4), "tr": (2, 2, 2, _C, 3),
    "inv1": (3, 3, 3, _C, 3), "inv2": (3, 3, 3, 3, 2), "scale": (_C,), "bias": (_C,)}.items()}
_POINTS = jnp.asarray(np.random.default_rng(77).uniform(0, 6, (_B, 9, 3)).astype(np.float32))


def _item_ops(impl):
  subm = functools.partial(jsparse.submconv3d, implementation=impl, precision="highest")
  conv = functools.partial(jsparse.sparse_conv3d, implementation=impl, precision="highest", out_capacity=2 * _CAP)

  def inverse(x):
    y = conv(x, _W["inv1"], stride=2, padding=1)
    return jsparse.sparse_inverse_conv3d(y, _W["inv2"], like=x, stride=2, padding=1, implementation=impl,
                                         precision="highest")

  def topology(x):
    picked = jsparse.select(x.replace(feats=2 * x.feats), x.feats[:, 0] > 0, capacity=_CAP)
    shifted = subm(x, _W["g2"], feature_group_count=2)
    product = jsparse.multiply(x, x.replace(feats=shifted.feats[:, :_C]), capacity=_CAP)
    return jsparse.concat(jsparse.add(x, picked, capacity=_CAP), product)

  def labels(x):
    coarse = jsparse.sparse_max_pool3d(x, 2, out_capacity=2 * _CAP, implementation=impl)
    return coarse.replace(feats=jsparse.child_labels(coarse, x).astype(jnp.float32) * coarse.feats[:, :1])

  return {
      "grouped_submconv": lambda x: subm(x, _W["g2"], feature_group_count=2),
      "depthwise_submconv": lambda x: subm(x, _W["dw"], feature_group_count=_C),
      "grouped_strided_conv": lambda x: conv(x, _W["s2g2"], stride=2, padding=1, feature_group_count=2),
      "generative_transpose": lambda x: jsparse.sparse_conv_transpose3d(x, _W["tr"], stride=2, out_capacity=8 * _CAP,
                                                                        implementation=impl, precision="highest"),
      "inverse_conv": inverse,
      "max_pool": lambda x: jsparse.sparse_max_pool3d(x, 3, 2, 1, out_capacity=2 * _CAP, implementation=impl),
      "avg_pool": lambda x: jsparse.sparse_avg_pool3d(x, 2, out_capacity=2 * _CAP, implementation=impl),
      "global_max": lambda x: jsparse.global_pool(x, "max"),
      "layer_norm": lambda x: norm.layer_norm(x, _W["scale"], _W["bias"]),
      "group_norm": lambda x: norm.group_norm(x, 2, _W["scale"], _W["bias"], activation=jax.nn.silu),
      "topology": topology,
      "child_labels": labels,
      "hilbert_sort": lambda x: serialize.sort_by(x, "hilbert")[0],
      "grid_sample": lambda x: sampling.grid_sample(x, _POINTS),
  }


def _probe(coords, channels):
  """A cotangent fixed by the site (not the row), so a loss over the item's sites is independent of row order."""
  phase = coords[:, 1:].astype(jnp.float32) @ jnp.asarray([1.3, 0.7, 2.1])
  return jnp.cos(phase[:, None] + jnp.arange(channels))


@functools.partial(jax.jit, static_argnames=("name", "impl"))
def _item_result(x, item, name, impl):
  """(out, d loss / d x.feats) with loss reading item `item`'s outputs only."""
  op = _item_ops(impl)[name]

  def loss(feats):
    out = op(x.replace(feats=feats))
    if isinstance(out, jsparse.SparseTensor):
      mine = out.valid_mask() & (out.coords[:, 0] == item)
      return jnp.sum(jnp.where(mine[:, None], out.feats * _probe(out.coords, out.num_channels), 0)), out
    return jnp.sum(out[item] * jnp.cos(jnp.arange(out[item].size).reshape(out[item].shape))), out

  (_, out), grad = jax.value_and_grad(loss, has_aux=True)(x.feats)
  return out, grad


def _rows_of_item(coords, num, item, *values):
  """The item's valid rows as {site: (values...)}."""
  coords = np.asarray(coords)
  return {tuple(coords[r, 1:]): tuple(np.asarray(v[r]) for v in values)
          for r in range(int(num)) if coords[r, 0] == item}


def _batch(rng, item, mine, my_feats):
  """The item's sites and features at batch index `item`, other items random (0 to 20 sites each), rows shuffled."""
  coords, feats = [np.concatenate([np.full((len(mine), 1), item), mine], 1)], [my_feats]
  for b in range(_B):
    if b != item:
      sites = np.argwhere(rng.random(_GRID) < rng.uniform(0, 0.1))[:20]
      coords.append(np.concatenate([np.full((len(sites), 1), b), sites], 1))
      feats.append((rng.standard_normal((len(sites), _C)) * rng.choice([0.1, 1, 30])).astype(np.float32))
  coords, feats = np.concatenate(coords).astype(np.int32), np.concatenate(feats)
  order = rng.permutation(len(coords))
  return jsparse.SparseTensor.from_coords(coords[order], feats[order], _GRID, _B, capacity=_CAP)


def _independence_case(name, seed, item, impl):
  rng = np.random.default_rng(seed)
  mine = np.argwhere(rng.random(_GRID) < 0.06)[:16]
  mine = mine if len(mine) else np.zeros((1, 3), np.int64)
  my_feats = rng.standard_normal((len(mine), _C)).astype(np.float32)
  results = []
  for _ in range(2):
    x = _batch(rng, item, mine, my_feats)
    out, grad = _item_result(x, item, name, impl)
    if isinstance(out, jsparse.SparseTensor):
      assert not bool(out.overflow), name
      got = _rows_of_item(out.coords, out.num, item, out.feats)
    else:
      got = {(): (np.asarray(out[item]),)}
    results.append((got, _rows_of_item(x.coords, x.num, item, grad)))
  (out_a, grad_a), (out_b, grad_b) = results
  assert out_a.keys() == out_b.keys(), f"{name}: the item's output sites depend on the other items"
  for site in out_a:
    np.testing.assert_allclose(out_a[site][0], out_b[site][0], rtol=1e-5, atol=1e-5, err_msg=f"{name} {site}")
  assert grad_a.keys() == grad_b.keys()
  for site in grad_a:
    np.testing.assert_allclose(grad_a[site][0], grad_b[site][0], rtol=1e-5, atol=1e-5, err_msg=f"{name} {site}")


_ITEM_OP_NAMES = sorted(_item_ops("xla"))


@pytest.mark.parametrize("name", _ITEM_OP_NAMES)
@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**16), item=st.integers(0, _B - 1))
def test_an_items_results_ignore_the_other_items(name, seed, item):
  _independence_case(name, seed, item, "xla")


@pytest.mark.parametrize("name", ["depthwise_submconv", "generative_transpose", "grouped_strided_conv",
                                  "grouped_submconv", "max_pool"])
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**16), item=st.integers(0, _B - 1))
def test_an_items_results_ignore_the_other_items_pallas(name, seed, item):
  _independence_case(name, seed, item, "pallas")


@functools.partial(jax.jit, static_argnames="reduce")
def _voxelized_item(points, feats, batch, item, reduce):
  def loss(f):
    x, _ = voxelize.voxelize_jit(points, f, voxel_size=0.5, origin=jnp.zeros(3), spatial_shape=(8, 8, 8), capacity=256,
                                 batch=batch, batch_size=_B, reduce=reduce)
    mine = x.valid_mask() & (x.coords[:, 0] == item)
    return jnp.sum(jnp.where(mine[:, None], x.feats * _probe(x.coords, x.num_channels), 0)), x

  (_, x), grad = jax.value_and_grad(loss, has_aux=True)(feats)
  return x, grad


@pytest.mark.parametrize("reduce", ["mean", "max", "sum"])
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16), item=st.integers(0, _B - 1))
def test_an_items_voxels_ignore_the_other_items(reduce, seed, item):
  """voxelize_jit: the item's voxels, their features and the gradient w.r.t. its points' features do not depend on
  the other items' points (which share the item's voxels in space), nor on where the item's points sit in the list."""
  rng = np.random.default_rng(seed)
  mine = rng.uniform(0, 4, (30, 3)).astype(np.float32)
  my_feats = rng.standard_normal((30, 2)).astype(np.float32)
  results = []
  for _ in range(2):
    n = 90
    others = rng.uniform(0, 4, (n - 30, 3)).astype(np.float32)
    other_items = rng.choice([b for b in range(_B) if b != item], n - 30)
    order = rng.permutation(n)
    points = np.concatenate([mine, others])[order]
    feats = np.concatenate([my_feats, rng.standard_normal((n - 30, 2)).astype(np.float32) * 50])[order]
    batch = np.concatenate([np.full(30, item), other_items])[order].astype(np.int32)
    x, grad = _voxelized_item(points, feats, batch, item, reduce)
    assert not bool(x.overflow)
    back = np.argsort(order)[:30]  # the item's points' positions in the list
    results.append((_rows_of_item(x.coords, x.num, item, x.feats), np.asarray(grad)[back]))
  (out_a, grad_a), (out_b, grad_b) = results
  assert out_a.keys() == out_b.keys()
  for site in out_a:
    np.testing.assert_allclose(out_a[site][0], out_b[site][0], rtol=1e-5, atol=1e-5, err_msg=str(site))
  np.testing.assert_allclose(grad_a, grad_b, rtol=1e-5, atol=1e-5)
