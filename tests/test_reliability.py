"""Regressions from an adversarial review: batch items independent of each other's non-finite values,
accurate cross-device batch statistics, float32 accumulation of half-precision duplicates, and clear errors
(not raw crashes or silent coercions) for bad arguments.

Run as a script (`python tests/test_reliability.py`), it checks the cross-device statistics inside
`jax.shard_map` over two CPU devices; the test of that name starts it in a subprocess (XLA only creates the
second CPU device when XLA_FLAGS is set before jax is imported).
"""
import os

if __name__ == "__main__":
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

import dataclasses
import json
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jsparse
from jsparse import neighbors, norm, per_item, serialize, tuning
from jsparse.sparse_tensor import SparseTensor
from pallas_kernels.tiling import TileConfig

FEW = settings(max_examples=25, deadline=None)


def _batch(rng, sites_per_item=(7, 5, 6), channels=4, pad=3, spatial=(4, 4, 4)):
  """A float32 SparseTensor whose item b has sites_per_item[b] rows (shuffled), plus padding rows."""
  coords = []
  for b, n in enumerate(sites_per_item):
    keys = rng.choice(int(np.prod(spatial)), size=n, replace=False)
    xyz = np.stack(np.unravel_index(keys, spatial), axis=-1)
    coords.append(np.concatenate([np.full((n, 1), b), xyz], axis=1))
  coords = np.concatenate(coords)[rng.permutation(sum(sites_per_item))]
  feats = rng.standard_normal((len(coords), channels)).astype(np.float32)
  return SparseTensor.from_coords(coords, feats, spatial, len(sites_per_item), capacity=len(coords) + pad)


def _with_rows(x: SparseTensor, item: int, channel: int, values) -> SparseTensor:
  """x with the first len(values) valid rows of `item` set to `values` in `channel`."""
  feats = np.asarray(x.feats).copy()
  rows = np.flatnonzero(np.asarray(x.coords[:, 0]) == item)[: len(values)]
  feats[rows, channel] = values
  return x.replace(feats=jnp.asarray(feats))


def _numpy_item_sums(x: SparseTensor) -> np.ndarray:
  n = int(x.num)
  items = np.asarray(x.coords[:n, 0])
  feats = np.asarray(x.feats[:n], np.float64)
  with np.errstate(invalid="ignore"):
    return np.stack([feats[items == b].sum(0) for b in range(x.batch_size)])


def _assert_same_non_finite(got, want, rtol=1e-5):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
  np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
  finite = np.isfinite(want)
  np.testing.assert_allclose(got[finite], want[finite], rtol=rtol, atol=1e-5)


# ---- 6. one non-finite voxel must not poison the other batch items ------------------------------------------


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_global_pool_items_independent_of_non_finite_values(reduce):
  x = _batch(np.random.default_rng(0))
  x = _with_rows(x, 1, 0, [np.inf])
  x = _with_rows(x, 2, 0, [-np.inf])
  x = _with_rows(x, 2, 1, [np.inf, -np.inf])  # +inf and -inf of one item: NaN there, as numpy's sum
  x = _with_rows(x, 2, 3, [np.nan])
  want = _numpy_item_sums(x)
  if reduce == "mean":
    want = want / np.bincount(np.asarray(x.coords[: int(x.num), 0]), minlength=3)[:, None]
  got = jsparse.global_pool(x, reduce)
  _assert_same_non_finite(got, want)
  assert np.all(np.isfinite(np.asarray(got[0])))  # item 0 is clean


def test_global_pool_ignores_non_finite_padding_rows():
  x = _batch(np.random.default_rng(1))
  inverted = x.replace(feats=1 / x.feats)  # padding rows: 1 / 0 = inf
  assert np.isinf(np.asarray(inverted.feats[int(x.num):])).all()
  valid = x.replace(feats=jnp.where(x.valid_mask()[:, None], 1 / x.feats, 0))
  for reduce in ("sum", "mean"):
    np.testing.assert_allclose(jsparse.global_pool(inverted, reduce), jsparse.global_pool(valid, reduce), rtol=1e-6)
    assert np.all(np.isfinite(np.asarray(jsparse.global_pool(inverted, reduce))))


def _flax_group_norm_per_item(x: SparseTensor, num_groups: int) -> np.ndarray:
  """flax's dense GroupNorm applied to each item's valid rows on their own (an item's rows as its sites)."""
  gn = nn.GroupNorm(num_groups=num_groups, epsilon=1e-6, use_bias=False, use_scale=False)
  n = int(x.num)
  items = np.asarray(x.coords[:n, 0])
  out = np.zeros(x.feats.shape, np.float32)
  for b in range(x.batch_size):
    rows = np.flatnonzero(items == b)
    out[rows] = np.asarray(gn.apply({}, x.feats[rows][None]))[0]
  return out


def test_group_norm_items_independent_of_non_finite_values():
  rng = np.random.default_rng(2)
  x = _batch(rng, channels=6)
  for poisoned in (_with_rows(x, 1, 4, [np.inf]), _with_rows(x, 2, 0, [np.nan]), _with_rows(x, 0, 2, [-np.inf])):
    got = norm.group_norm(poisoned, 3).feats
    want = _flax_group_norm_per_item(poisoned, 3)
    _assert_same_non_finite(got, want, rtol=1e-4)
    assert np.isfinite(np.asarray(got)).sum() > 0
  # inf in padding rows (after an elementwise 1 / x) reaches no item.
  inverted = x.replace(feats=1 / x.feats)
  valid = x.replace(feats=jnp.where(x.valid_mask()[:, None], 1 / x.feats, 0))
  np.testing.assert_allclose(norm.group_norm(inverted, 3).feats, norm.group_norm(valid, 3).feats, rtol=1e-6)
  mean, var = norm.group_statistics(inverted, 3)
  assert np.all(np.isfinite(np.asarray(mean))) and np.all(np.isfinite(np.asarray(var)))


def test_gradients_stay_per_item_with_non_finite_values():
  """Item 0's gradients are the same whether item 1 holds an inf or not, and whether the cotangent of item 1
  is finite or not (the backward's one-hot products must not multiply 0 * inf either)."""
  rng = np.random.default_rng(3)
  x = _batch(rng, channels=4)
  item0 = np.asarray(x.coords[:, 0] == 0) & np.asarray(x.valid_mask())
  clean_cot = rng.standard_normal((x.capacity, 4)).astype(np.float32)
  bad_cot = clean_cot.copy()
  bad_cot[np.asarray(x.coords[:, 0]) == 1] = np.inf

  def grads(fn, x, cot):
    _, vjp = jax.vjp(lambda f: fn(x.replace(feats=f)), x.feats)
    return np.asarray(vjp(jnp.asarray(cot))[0])

  group = lambda t: norm.group_norm(t, 2).feats  # noqa: E731
  want = grads(group, x, clean_cot)
  assert np.all(np.isfinite(want))
  for got in (grads(group, _with_rows(x, 1, 3, [np.inf]), clean_cot), grads(group, x, bad_cot)):
    np.testing.assert_allclose(got[item0], want[item0], rtol=1e-5, atol=1e-6)

  for reduce in ("sum", "mean"):
    pool = lambda t: jsparse.global_pool(t, reduce)  # noqa: E731
    cot = rng.standard_normal((3, 4)).astype(np.float32)
    want = grads(pool, x, cot)
    bad = cot.copy()
    bad[1] = np.nan
    for got in (grads(pool, _with_rows(x, 1, 0, [np.inf]), cot), grads(pool, x, bad)):
      np.testing.assert_allclose(got[item0], want[item0], rtol=1e-6)
    np.testing.assert_array_equal(grads(pool, x, cot)[~np.asarray(x.valid_mask())], 0)


def test_per_item_gradients_match_plain_sums_on_finite_values():
  rng = np.random.default_rng(4)
  x = _batch(rng)
  one_hot = per_item.item_one_hot(x)
  values = jnp.asarray(rng.standard_normal((x.capacity, 3)), jnp.float32)
  table = jnp.asarray(rng.standard_normal((3, 3)), jnp.float32)
  seg = jnp.where(x.valid_mask(), x.coords[:, 0], 3)

  def ours(v, t):
    return jnp.sum(jnp.sin(per_item.sum_per_item(one_hot, v))) + jnp.sum(per_item.per_row(one_hot, t) * v)

  def plain(v, t):
    sums = jax.ops.segment_sum(v, seg, num_segments=4)[:3]
    rows = jnp.concatenate([t, jnp.zeros((1, 3))])[seg]
    return jnp.sum(jnp.sin(sums)) + jnp.sum(rows * v)

  for a, b in zip(jax.grad(ours, argnums=(0, 1))(values, table), jax.grad(plain, argnums=(0, 1))(values, table)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


_SPECIAL = st.sampled_from([np.inf, -np.inf, np.nan])


_ROWS = 20  # fixed shapes: one compilation for all examples


@FEW
@given(items=st.lists(st.integers(0, 3), min_size=_ROWS, max_size=_ROWS), num=st.integers(0, _ROWS),
       seed=st.integers(0, 2**16), specials=st.lists(st.tuples(st.integers(0, _ROWS - 1), st.integers(0, 1), _SPECIAL),
                                                     max_size=4))
def test_sum_per_item_and_per_row_match_numpy(items, num, seed, specials):
  """Per-item sums equal numpy's sums of each item's rows, whatever non-finite values the rows (valid or
  padding) hold, and per_row broadcasts each item's entry (non-finite ones included) to that item's rows only."""
  rng = np.random.default_rng(seed)
  batch = 4
  coords = np.full((_ROWS, 4), -1, np.int32)
  coords[:num, 0] = items[:num]
  coords[:num, 1:] = 0  # per_item reads the batch column and the valid mask only
  x = SparseTensor(jnp.asarray(coords), jnp.zeros((_ROWS, 1)), jnp.asarray(num, jnp.int32), (1, 1, 1), batch)
  values = rng.standard_normal((_ROWS, 2)).astype(np.float32)
  for row, col, special in specials:
    values[row, col] = special
  one_hot = per_item.item_one_hot(x)
  valid_items = np.asarray(items[:num], np.int64)
  with np.errstate(invalid="ignore"):
    want = np.stack([values[:num][valid_items == b].astype(np.float64).sum(0) for b in range(batch)])
  _assert_same_non_finite(per_item.sum_per_item(one_hot, jnp.asarray(values)), want)
  table = values[:batch]
  rows = np.asarray(per_item.per_row(one_hot, jnp.asarray(table)))
  np.testing.assert_array_equal(rows[:num], table[valid_items])
  np.testing.assert_array_equal(rows[num:], 0)


# ---- 7. cross-device batch statistics as accurate as one device's ---------------------------------------------

# (mean, std, shift of the second device's mean) per case; the first two collapsed to var ~0 / 1696 vs 107.
_OFFSET_CASES = [(1000.0, 0.1, 0.0), (1e5, 10.0, 0.0), (1000.0, 0.1, 0.05), (-3e4, 1.0, 2e4), (0.0, 1.0, 0.0)]


def _offset_tensors(mean, std, shift, counts=(150, 90), capacity=200, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for i, n in enumerate(counts):
    keys = rng.choice(512, size=n, replace=False)
    coords = np.stack(np.unravel_index(keys, (8, 8, 8)), axis=-1)
    feats = (rng.standard_normal((n, 3)) * std + mean + i * shift).astype(np.float32)
    out.append(SparseTensor.from_coords(coords, feats, (8, 8, 8), capacity=capacity))
  return out


def _check_pooled(mean, var, tensors):
  rows = np.concatenate([np.asarray(t.feats[: int(t.num)], np.float64) for t in tensors])
  f = jnp.asarray(rows, jnp.float32)  # one device's float32 two-pass statistics of the same rows
  single_mean = jnp.mean(f, 0)
  single_var = jnp.mean(jnp.square(f - single_mean), 0)
  var_err = np.abs(np.asarray(var, np.float64) - rows.var(0)) / rows.var(0)
  single_err = np.abs(np.asarray(single_var, np.float64) - rows.var(0)) / rows.var(0)
  assert np.all(var_err <= np.maximum(2 * single_err, 2e-6)), (var_err, single_err)
  np.testing.assert_allclose(np.asarray(mean, np.float64), rows.mean(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mean,std,shift", _OFFSET_CASES)
def test_pooled_batch_statistics_far_from_zero(mean, std, shift):
  """The pooled statistics over a named axis (vmap here, shard_map in the next test) against float64 numpy
  on the union of the rows, at least as accurate as a float32 two-pass computation on one device."""
  tensors = _offset_tensors(mean, std, shift)
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *tensors)
  pooled = jax.vmap(lambda t: norm.batch_statistics(t, axis_name="d"), axis_name="d")(stacked)
  _check_pooled(pooled[0][0], pooled[1][0], tensors)
  np.testing.assert_array_equal(pooled[1][0], pooled[1][1])  # every device gets the same statistics


def test_pooled_batch_statistics_gradients_match_one_device():
  tensors = _offset_tensors(1000.0, 0.1, 0.05, counts=(40, 25), capacity=50)
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *tensors)
  w = jnp.asarray([1.0, -2.0, 0.5])

  def pooled_loss(feats):
    per_device = dataclasses.replace(stacked, feats=feats)  # (replace checks one tensor's [capacity, C] feats)
    stats = jax.vmap(lambda t: norm.batch_statistics(t, axis_name="d"), axis_name="d")(per_device)
    return jnp.sum(stats[1][0] * w) + jnp.sum(stats[0][0] * w) * 1e-3

  def single_loss(feats):
    valid = np.concatenate([np.arange(t.capacity) < int(t.num) for t in tensors])
    f = feats.reshape(-1, 3)[valid]
    mean = jnp.mean(f, 0)
    return jnp.sum(jnp.mean(jnp.square(f - mean), 0) * w) + jnp.sum(mean * w) * 1e-3

  g = jax.grad(pooled_loss)(stacked.feats)
  g_ref = jax.grad(single_loss)(stacked.feats)
  valid = np.stack([np.arange(t.capacity) < int(t.num) for t in tensors])
  np.testing.assert_allclose(np.asarray(g)[valid], np.asarray(g_ref).reshape(2, -1, 3)[valid], rtol=2e-3, atol=1e-4)
  np.testing.assert_array_equal(np.asarray(g)[~valid], 0)


def _two_device_check():
  from jax.sharding import Mesh, PartitionSpec as P

  assert jax.device_count() >= 2, jax.devices()
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  stats = jax.jit(jax.shard_map(lambda t: norm.batch_statistics(jax.tree.map(lambda a: a[0], t), axis_name="data"),
                                mesh=mesh, in_specs=P("data"), out_specs=P()))
  for case in _OFFSET_CASES:
    tensors = _offset_tensors(*case)
    mean, var = stats(jax.tree.map(lambda *a: jnp.stack(a), *tensors))
    _check_pooled(mean, var, tensors)


def test_pooled_batch_statistics_shard_map_two_cpu_devices():
  if jax.device_count() >= 2:
    _two_device_check()
    return
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


# ---- 8. half-precision duplicates accumulate in float32 ---------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_from_coords_half_precision_duplicates_accumulate_in_float32(dtype):
  n = 30_000
  coords = np.repeat(np.array([[0, 1, 1, 1], [0, 2, 2, 2], [0, 3, 3, 3]], np.int32), n, axis=0)
  threes = jnp.full((3 * n, 2), 3.0, dtype)
  mean = SparseTensor.from_coords(coords, threes, (4, 4, 4), reduce="mean", capacity="exact")
  assert mean.dtype == dtype
  np.testing.assert_array_equal(np.asarray(mean.feats, np.float32), 3.0)  # fp16 gave 0.273 (the sum overflowed)
  ones = jnp.ones((3 * n, 2), dtype)
  total = SparseTensor.from_coords(coords, ones, (4, 4, 4), reduce="sum", capacity="exact")
  want = np.asarray(jnp.asarray(float(n), jnp.float32).astype(dtype), np.float32)
  np.testing.assert_array_equal(np.asarray(total.feats, np.float32), want)  # fp16 stalled at 2048


# ---- 10. raw crashes become clear errors -------------------------------------------------------------------


def _small():
  coords = np.array([[0, 1, 1, 1], [1, 2, 2, 2]], np.int32)
  return SparseTensor.from_coords(coords, np.ones((2, 3), np.float32), (4, 4, 4), capacity=3)


def test_zero_channels_raise_value_error():
  x = _small()
  with pytest.raises(ValueError, match="at least one channel"):
    SparseTensor.from_coords(np.asarray(x.coords[:2]), np.zeros((2, 0), np.float32), (4, 4, 4))
  with pytest.raises(ValueError, match="nonzero extents"):
    SparseTensor.from_dense(jnp.ones((1, 2, 2, 2, 0)))
  with pytest.raises(ValueError, match="nonzero kernel sizes and channel counts"):
    jsparse.submconv3d(x, jnp.zeros((3, 3, 3, 3, 0)))
  empty = SparseTensor(x.coords, jnp.zeros((3, 0)), x.num, x.spatial_shape, x.batch_size)
  with pytest.raises(ValueError, match="nonzero kernel sizes and channel counts"):
    jsparse.submconv3d(empty, jnp.zeros((3, 3, 3, 0, 4)))
  with pytest.raises(ValueError, match="nonzero kernel sizes"):
    jsparse.sparse_conv3d(x, jnp.zeros((0, 2, 2, 3, 4)), stride=2)


def test_round_capacity_rejects_bad_arguments():
  with pytest.raises(ValueError, match="steps_per_octave"):
    jsparse.round_capacity(1000, steps_per_octave=0)
  with pytest.raises(ValueError, match="minimum"):
    jsparse.round_capacity(1000, minimum=0)
  with pytest.raises(ValueError, match="n must be >= 0"):
    jsparse.round_capacity(-5)
  with pytest.raises(TypeError, match="n must be an int"):
    jsparse.round_capacity(1000.5)
  assert jsparse.round_capacity(np.int64(1000)) == jsparse.round_capacity(1000)


def test_huge_dilation_raises_value_error():
  x = _small()
  for dilation in (2**31, (1, 1, 2**40)):
    with pytest.raises(ValueError, match="dilation must be < 2\\*\\*31"):
      jsparse.submconv3d(x, jnp.zeros((3, 3, 3, 3, 4)), dilation=dilation)
  with pytest.raises(ValueError, match="past int32"):
    neighbors.kernel_offsets(5, 2**31 - 1)
  assert neighbors.kernel_offsets(3, 2**31 - 1)[0] == (-(2**31 - 1),) * 3


def test_wrong_types_raise_type_error():
  x = _small()
  with pytest.raises(TypeError, match="feats must be an array"):
    x.replace(feats=[[1.0] * 3] * 3)
  with pytest.raises(TypeError, match="x must be a jsparse.SparseTensor"):
    jsparse.submconv3d(jnp.zeros((1, 4, 4, 4, 3)), jnp.zeros((3, 3, 3, 3, 4)))
  for fn in (lambda d: norm.batch_norm(d), lambda d: norm.group_norm(d, 1), lambda d: norm.layer_norm(d),
             lambda d: norm.batch_statistics(d), lambda d: norm.activation(d, jnp.tanh)):
    with pytest.raises(TypeError, match="SparseTensor"):
      fn(jnp.zeros((4, 3)))


_DENSE = jnp.zeros((3, 3))


@pytest.mark.parametrize("call,name", [
    (lambda: jsparse.neighbor_map(_DENSE, 3), "x"),
    (lambda: jsparse.with_maps(_DENSE, 3), "x"),
    (lambda: jsparse.global_pool(_DENSE), "x"),
    (lambda: jsparse.concat(_DENSE, _small()), "a"),
    (lambda: jsparse.concat(_small(), _DENSE), "b"),
    (lambda: jsparse.strided_map(_DENSE, 2, 2), "x"),
    (lambda: jsparse.transpose_map(_DENSE, 2, 2), "x"),
    (lambda: jsparse.voxelize.voxel_centres(_DENSE), "x"),
    (lambda: jsparse.sampling.grid_sample(_DENSE, jnp.zeros((2, 3))), "x"),
    (lambda: jsparse.serialize.sort_by(_DENSE), "x"),
])
def test_dense_array_for_a_sparse_tensor_raises_type_error(call, name):
  # A dense array where a SparseTensor belongs is a TypeError naming the argument, not an AttributeError
  # from deep inside the op.
  with pytest.raises(TypeError, match=f"{name} must be a jsparse.SparseTensor"):
    call()


def _entry(**fields):
  return {"algorithm": "masked", "block_m": 64, "block_n": 64, "block_k": 32, "num_warps": 4, "num_stages": 3,
          "split": 1, **fields}


_KEY = "forward/n1024/ci32/co64/v27/float32"


@pytest.mark.parametrize("table,match", [
    ({}, "'entries' object"),
    ({"entries": []}, "'entries' object"),
    ({"entries": {_KEY: {"block_m": 64}}}, "missing field 'algorithm'"),
    ({"entries": {_KEY: {"algorithm": "masked"}}}, "needs the tile fields"),
    ({"entries": {_KEY: {"algorithm": "masked_splitk", "block_m": 64, "block_n": 64}}}, "block_k"),
    ({"entries": {_KEY: _entry(algorithm="auto")}}, "not 'auto'"),
    ({"entries": {_KEY: {"algorithm": "explicit", "block_m": 64}}}, "takes no tile fields"),
    ({"entries": {_KEY: _entry(split=0)}}, "split"),
    ({"entries": {_KEY: _entry(block_n=64.0)}}, "block_n"),
    ({"entries": {_KEY: _entry(columns_fastest=1)}}, "columns_fastest"),
    ({"entries": {_KEY: _entry(weight_k_major="yes")}}, "weight_k_major"),
    ({"entries": {"fwd/n1024": _entry()}}, "table keys"),
    ({"entries": {_KEY: "masked"}}, "JSON object"),
])
def test_config_table_load_rejects_bad_tables(tmp_path, table, match):
  path = tmp_path / "table.json"
  path.write_text(json.dumps(table))
  with pytest.raises(ValueError, match=match) as info:
    tuning.ConfigTable.load(str(path))
  assert str(path) in str(info.value)


def test_config_table_rejects_entries_without_tiles():
  with pytest.raises(TypeError, match="tiles must be a TileConfig"):
    tuning.ConfigTable({_KEY: jsparse.Masked(None)})
  with pytest.raises(TypeError, match="PassConfig"):
    tuning.ConfigTable({_KEY: "masked"})
  with pytest.raises(ValueError, match="not valid JSON"):
    tuning.ConfigTable.from_json("{")
  good = tuning.ConfigTable.from_json(json.dumps({"entries": {_KEY: _entry(), "weight_grad/n1/ci1/co1/v1/float16":
                                                              {"algorithm": "explicit"}}}))
  assert good.get(_KEY) == jsparse.Masked(TileConfig(64, 64, 32, 4, 3, 1))
  tuned = os.path.join(os.path.dirname(jsparse.__file__), "tuned")
  for name in os.listdir(tuned):  # the shipped tables pass the checks
    assert len(tuning.ConfigTable.load(os.path.join(tuned, name))) > 0


# ---- 11. silent coercions become errors ----------------------------------------------------------------------

_COORDS = np.array([[0, 1, 1, 1], [1, 2, 2, 2]], np.int32)
_FEATS = np.ones((2, 3), np.float32)


@pytest.mark.parametrize("call,error,match", [
    (lambda: SparseTensor.from_coords(_COORDS, _FEATS, (4, 4, 4), capacity=5.7), TypeError, "capacity"),
    (lambda: SparseTensor.from_coords(_COORDS, _FEATS, (4, 4, 4), capacity=True), TypeError, "capacity"),
    (lambda: SparseTensor.from_coords(_COORDS, _FEATS, (4, 4, 4), batch_size=2.5), TypeError, "batch_size"),
    (lambda: SparseTensor.from_coords(_COORDS, _FEATS, (4, 4, 4), batch_size=0), ValueError, "batch_size"),
    (lambda: SparseTensor.from_coords(_COORDS, _FEATS, (8.9, 8, 8)), TypeError, "spatial_shape"),
    (lambda: SparseTensor.from_coords(_COORDS, _FEATS, "888"), TypeError, "spatial_shape"),
    (lambda: SparseTensor.from_coords(_COORDS, _FEATS, (True, 4, 4)), TypeError, "spatial_shape"),
    (lambda: SparseTensor.from_coords(_COORDS, _FEATS.astype(np.complex64), (4, 4, 4)), TypeError, "feats"),
    (lambda: SparseTensor.from_dense(jnp.ones((1, 2, 2, 2, 1), jnp.int32)), TypeError, "dense"),
    (lambda: SparseTensor.from_dense(jnp.ones((1, 2, 2, 2, 1), bool)), TypeError, "dense"),
    (lambda: SparseTensor.from_dense(jnp.ones((1, 2, 0, 2, 1))), ValueError, "nonzero extents"),
    (lambda: SparseTensor.from_dense(jnp.ones((1, 2, 2, 2, 1)), capacity=8.0), TypeError, "capacity"),
    (lambda: _small().replace(num=99), ValueError, "num"),
    (lambda: _small().replace(num=jnp.asarray(-1)), ValueError, "num"),
    (lambda: _small().replace(feats=jnp.ones((3, 3), jnp.complex64)), TypeError, "feats"),
    (lambda: _small().replace(feats=jnp.ones((3, 3), jnp.int32)), TypeError, "feats"),
    (lambda: _small().replace(coords=jnp.ones((3, 3), jnp.int32)), ValueError, "coords"),
    (lambda: _small().replace(coords=jnp.ones((4, 4), jnp.int32)), ValueError, "replace both together"),
    (lambda: jsparse.submconv3d(_small(), jnp.ones((3, 3, 3, 3, 4), jnp.complex64)), TypeError, "weight"),
    (lambda: jsparse.submconv3d(_small(), jnp.ones((3, 3, 3, 3, 4)), jnp.ones(4, jnp.complex64)), TypeError, "bias"),
    (lambda: jsparse.submconv3d(_small(), jnp.ones((3, 3, 3, 3, 4)), dilation=1.5), TypeError, "dilation"),
    (lambda: jsparse.submconv3d(_small(), jnp.ones((3, 3, 3, 3, 4)), dilation=True), TypeError, "dilation"),
    (lambda: jsparse.neighbor_map(_small(), "333"), TypeError, "kernel_size"),
    (lambda: jsparse.neighbor_map(_small(), 3.0), TypeError, "kernel_size"),
    (lambda: jsparse.sparse_conv3d(_small(), jnp.ones((2, 2, 2, 3, 4)), stride=2, out_capacity=5.7), TypeError,
     "out_capacity"),
    (lambda: jsparse.sparse_conv_transpose3d(_small(), jnp.ones((2, 2, 2, 3, 4)), out_capacity=20.5), TypeError,
     "out_capacity"),
    (lambda: norm.batch_norm(_small(), mean=jnp.zeros(3), var=jnp.asarray([1.0, -1.0, 1.0])), ValueError, "var"),
    (lambda: norm.group_norm(_small(), 1.0), TypeError, "num_groups"),
    (lambda: norm.group_norm(_small(), 1, activation="silu"), TypeError, "activation"),
    (lambda: serialize.encode_morton(jnp.asarray([[1024, 0, 0]]), 10), ValueError, "xyz"),
    (lambda: serialize.encode_morton(jnp.asarray([[-1024, 0, 0]]), 10), ValueError, "xyz"),
    (lambda: serialize.encode_morton(jnp.asarray([[1.0, 0, 0]]), 10), TypeError, "xyz"),
    (lambda: serialize.encode_hilbert(jnp.asarray([[0, 8, 0]]), 3), ValueError, "xyz"),
    (lambda: serialize.fold_batch(jnp.asarray([2]), jnp.asarray([5]), 10), ValueError, "batch"),
    (lambda: serialize.fold_batch(jnp.asarray([-1]), jnp.asarray([5]), 8), ValueError, "batch"),
    (lambda: serialize.fold_batch(jnp.asarray([0]), jnp.asarray([2**24]), 8), ValueError, "keys"),
    (lambda: serialize.encode_morton(jnp.zeros((1, 3), jnp.int32), 10.0), TypeError, "bits"),
])
def test_bad_arguments_raise_clear_errors(call, error, match):
  with pytest.raises(error, match=match):
    call()


def test_numpy_integers_still_accepted():
  x = SparseTensor.from_coords(_COORDS, _FEATS, np.array([4, 4, 4]), batch_size=np.int32(2), capacity=np.int64(5))
  assert (x.capacity, x.batch_size, x.spatial_shape) == (5, 2, (4, 4, 4))
  assert all(type(s) is int for s in x.spatial_shape) and type(x.batch_size) is int
  y = jsparse.submconv3d(x, jnp.ones((3, 3, 3, 3, 4)), dilation=np.int64(2))
  assert y.num_channels == 4
  assert neighbors.as_triple((np.int8(3), 3, np.uint16(1)), "kernel_size") == (3, 3, 1)
  z = jsparse.sparse_conv3d(x, jnp.ones((2, 2, 2, 3, 4)), stride=np.int64(2), out_capacity=np.int64(4))
  assert z.capacity == 4
  assert x.replace(num=np.int64(1)).num == 1 and x.replace(num=jnp.asarray(5)).num == 5
  assert SparseTensor.from_dense(x.todense(), capacity=np.int32(3)).capacity == 3
  np.testing.assert_allclose(norm.batch_norm(x, mean=np.zeros(3), var=np.ones(3)).feats[:2], 1 / np.sqrt(1 + 1e-5))


def test_out_of_range_keys_under_jit_are_minus_one():
  xyz = jnp.asarray([[1024, 0, 0], [-1024, 0, 0], [0, 0, 0], [1023, 1023, 1023]])
  keys = jax.jit(serialize.encode_morton)(xyz)
  assert keys.tolist()[:3] == [-1, -1, 0] and keys.tolist()[3] == 2**30 - 1
  assert jax.jit(serialize.encode_hilbert, static_argnums=1)(jnp.asarray([[8, 0, 0], [0, 0, 0]]), 3).tolist()[0] == -1
  folded = jax.jit(serialize.fold_batch, static_argnums=2)(jnp.asarray([0, 1, 2, -1]), jnp.asarray([5, 5, 5, 5]), 10)
  assert folded.tolist() == [5, 2**30 + 5, -1, -1]


@FEW
@given(xyz=st.lists(st.tuples(*[st.integers(-2048, 2047)] * 3), min_size=16, max_size=16),
       bits=st.sampled_from([1, 3, serialize.MAX_BITS]))
def test_curve_keys_never_alias(xyz, bits):
  """In-range points get distinct keys >= 0 that decode back; out-of-range ones raise (eager) or get -1 (jit)."""
  xyz = np.asarray(xyz, np.int32)
  inside = np.all((xyz >= 0) & (xyz < 2**bits), axis=-1)
  for encode, decode in ((serialize.encode_morton, serialize.decode_morton),
                         (serialize.encode_hilbert, serialize.decode_hilbert)):
    keys = np.asarray(jax.jit(encode, static_argnums=1)(jnp.asarray(xyz), bits))
    np.testing.assert_array_equal(keys < 0, ~inside)
    np.testing.assert_array_equal(np.asarray(decode(jnp.asarray(keys[inside]), bits)), xyz[inside])
    unique_points = {tuple(p) for p in xyz[inside]}
    assert len(set(keys[inside].tolist())) == len(unique_points)
    if not inside.all():
      with pytest.raises(ValueError, match="xyz"):
        encode(jnp.asarray(xyz), bits)


@pytest.mark.parametrize("decode", [serialize.decode_morton, serialize.decode_hilbert])
@pytest.mark.parametrize("bits, bad", [(10, [-1]), (10, [2**30]), (10, [2**31 - 1]), (1, [8]), (3, [0, 512]),
                                       (11, [[0, -1]]), (11, [[8, 0]]), (11, [[0, 2**30]]), (21, [[0, 0, 2**30]]),
                                       (21, [[8, 0, 0]])])
def test_decode_refuses_keys_outside_the_curve(decode, bits, bad):
  """A concrete key outside [0, 2**(3*bits)) (encode's -1, a word past 30 bits) decoded to some other site's
  coordinates (decode_morton(-1) gave (1023, 1023, 1023)); it raises naming `keys`. Under jit it is not checked."""
  with pytest.raises(ValueError, match="keys"):
    decode(np.asarray(bad), bits)
  with pytest.raises(TypeError, match="keys"):
    decode(np.asarray(bad, np.float32), bits)
  jax.jit(decode, static_argnums=1)(jnp.asarray(bad), bits)  # traced: left alone (documented)
  top = np.asarray([(1 << 3 * bits) - 1]) if bits <= 10 else np.full((1, serialize.num_words(bits)), 2**30 - 1)
  if bits % 10:
    top[..., 0] = (1 << 3 * (bits % 10)) - 1
  np.testing.assert_array_equal(np.asarray(serialize.decode_morton(top, bits)), [[2**bits - 1] * 3])


@pytest.mark.parametrize("bits, shape", [(11, (4,)), (11, (4, 3)), (21, (2, 2)), (11, ())])
def test_decode_refuses_keys_of_another_word_count(bits, shape):
  """Past 10 bits keys are [..., W] words: at bits=11 (W = 2) [N, 3] words decoded the first two of each row and
  [4] one-word keys decoded as one key of their first two entries, silently; they raise naming `keys`."""
  with pytest.raises(ValueError, match="keys must be"):
    serialize.decode_morton(np.zeros(shape, np.int32), bits)


@FEW
@given(bits=st.integers(1, serialize.MAX_BITS), data=st.data())
def test_fold_batch_keys_are_non_negative_and_batch_major(bits, data):
  top = serialize.max_folded_batch(bits)
  pairs = data.draw(st.lists(st.tuples(st.integers(0, top - 1), st.integers(0, 2 ** (3 * bits) - 1)), min_size=16,
                             max_size=16))
  batch, keys = (jnp.asarray(v, jnp.int32) for v in zip(*pairs))
  folded = np.asarray(serialize.fold_batch(batch, keys, bits)).tolist()
  assert min(folded) >= 0
  assert sorted(folded) == [f for _, f in sorted(zip(pairs, folded))]
  with pytest.raises(ValueError, match="batch"):
    serialize.fold_batch(jnp.asarray([top]), jnp.asarray([0]), bits)


@FEW
@given(value=st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.booleans(), st.text(max_size=3)))
def test_capacity_accepts_only_integers(value):
  with pytest.raises(TypeError, match="capacity"):
    SparseTensor.from_coords(_COORDS, _FEATS, (4, 4, 4), capacity=value)


if __name__ == "__main__":
  _two_device_check()
  print("OK")


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("row", [(0, 4, 1, 1), (0, 1, -1, 1), (1, 1, 1, 1), (-1, 3, 3, 3)],
                         ids=["x-past-extent", "negative-y", "batch-past-batch_size", "negative-batch"])
def test_neighbor_map_reports_rows_outside_the_grid(implementation, row):
  """A row outside the grid (only a tensor built without from_coords' checks can hold one) would alias another
  site's linear key: the neighbour map reports it, ValueError eagerly and through checkify under jit inside
  error_checks(), and stays silent (no cost) under plain jit; an in-grid tensor passes."""
  from jax.experimental import checkify

  coords = np.array([[0, 1, 1, 1], [0, 2, 1, 1], [0, 3, 3, 3]], np.int32)
  x = SparseTensor.from_coords(coords, np.ones((3, 4), np.float32), (4, 4, 4), 1)
  jsparse.neighbor_map(x, 3, implementation=implementation)  # in the grid: no report
  bad = x.replace(coords=x.coords.at[2].set(jnp.asarray(row, jnp.int32)))
  with pytest.raises(ValueError, match="1 valid rows whose coordinates lie outside the grid"):
    jsparse.neighbor_map(bad, 3, implementation=implementation)
  run = jax.jit(lambda t: jsparse.neighbor_map(t, 3, implementation=implementation).nbr)
  assert run(bad).shape == (x.capacity, 27)
  with jsparse.error_checks():
    err, _ = checkify.checkify(jax.jit(lambda t: jsparse.neighbor_map(t, 3, implementation=implementation).nbr))(bad)
  assert "outside the grid" in str(err.get())
  with jsparse.error_checks():
    err, _ = checkify.checkify(jax.jit(lambda t: jsparse.neighbor_map(t, 3, implementation=implementation).nbr))(x)
  assert err.get() is None


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("row", [(0, 0, 4, 0), (0, 0, 3, 4), (0, -1, 3, 3)], ids=["y-past-extent", "z-past-extent",
                                                                                   "negative-x"])
def test_rows_outside_the_grid_are_keyed_as_padding_under_jit(implementation, row):
  """Under plain jit (no report) a row outside the grid is keyed as padding by the submanifold map: the in-grid
  rows' values and gradients are those without it. (0, 0, 4, 0) and (0, 0, 3, 4) on a 4^3 grid have the linear key
  of (0, 1, 0, 0); the Pallas hash table took them for that site and gave its neighbours wrong values."""
  from jax import lax

  rng = np.random.default_rng(5)
  coords = np.array([[0, 1, 0, 0], [0, 1, 1, 0], [0, 2, 0, 0], [0, 0, 0, 0], [0, 0, 3, 3]], np.int32)
  feats = rng.standard_normal((6, 2)).astype(np.float32)
  weight = jnp.asarray(rng.standard_normal((3, 3, 3, 2, 3)), jnp.float32)
  bad = SparseTensor(jnp.asarray(np.concatenate([coords, [row], -np.ones((2, 4), np.int32)]), jnp.int32),
                     jnp.asarray(np.concatenate([feats, np.zeros((2, 2), np.float32)])), jnp.int32(6), (4, 4, 4), 1)
  good = SparseTensor(jnp.asarray(coords), jnp.asarray(feats[:5]), jnp.int32(5), (4, 4, 4), 1)
  cot = jnp.asarray(rng.standard_normal((3, 4, 4, 4, 3)), jnp.float32)[:1]

  def dense_loss(f):
    d = good.replace(feats=f).todense()
    y = lax.conv_general_dilated(d, weight, (1, 1, 1), "SAME", dimension_numbers=("NDHWC", "DHWIO", "NDHWC"))
    return jnp.sum(y[tuple(coords.T)] * cot[tuple(coords.T)])

  def sparse_loss(f):
    y = jsparse.submconv3d(bad.replace(feats=f), weight, implementation=implementation)
    return jnp.sum(y.feats[:5] * cot[tuple(coords.T)]), y.feats[:5]

  (_, values), grad = jax.jit(jax.value_and_grad(sparse_loss, has_aux=True))(bad.feats)
  ref = lax.conv_general_dilated(good.todense(), weight, (1, 1, 1), "SAME",
                                 dimension_numbers=("NDHWC", "DHWIO", "NDHWC"))[tuple(coords.T)]
  np.testing.assert_allclose(values, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(grad[:5], jax.grad(dense_loss)(jnp.asarray(feats[:5])), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_maps_report_rows_that_repeat_a_site(implementation):
  """A repeated site (only a tensor built without from_coords' checks can hold one) breaks the submanifold map's
  symmetry, which the Pallas gradients use, and a strided search would pair both rows with one output: the
  neighbour map and the strided convolution report it, ValueError eagerly and through checkify under jit inside
  error_checks(); padding rows (all -1) never count, and a distinct tensor passes."""
  from jax.experimental import checkify

  coords = np.array([[0, 1, 1, 1], [0, 2, 1, 1], [0, 3, 3, 3], [1, 2, 1, 1]], np.int32)
  x = SparseTensor.from_coords(coords, np.ones((4, 4), np.float32), (4, 4, 4), 2, capacity=8)
  bad = x.replace(coords=x.coords.at[2].set(jnp.asarray([0, 1, 1, 1], jnp.int32)))
  w = jnp.ones((3, 3, 3, 4, 2), jnp.float32)
  ops = {"neighbor_map": lambda t: jsparse.neighbor_map(t, 3, implementation=implementation).nbr,
         "sparse_conv3d": lambda t: jsparse.sparse_conv3d(t, w, stride=2, out_capacity=8,
                                                          implementation=implementation).feats}
  for name, op in ops.items():
    op(x)  # distinct sites (and 4 padding rows of -1): no report
    with pytest.raises(ValueError, match="1 valid rows that repeat an earlier row's coordinates"):
      op(bad)
    assert jax.jit(op)(bad).shape[0] == 8  # plain jit: not checked, no cost
    with jsparse.error_checks():
      err, _ = checkify.checkify(jax.jit(op))(bad)
      assert "repeat an earlier row's coordinates" in str(err.get()), name
      err, _ = checkify.checkify(jax.jit(op))(x)
      assert err.get() is None, name


def _small_tensor():
  coords = np.array([[0, 1, 1, 1], [0, 2, 1, 1], [1, 0, 0, 0]], np.int32)
  feats = np.arange(6, dtype=np.float32).reshape(3, 2)
  return SparseTensor.from_coords(coords, feats, (4, 4, 4), 2, capacity=8)


@pytest.mark.parametrize("to_array", [np.asarray, jnp.asarray, np.array])
def test_a_sparse_tensor_is_not_silently_an_array(to_array):
  # np.asarray made a 0-d object array of the tensor (a silent wrong array); jnp.asarray failed inside float().
  with pytest.raises(TypeError, match="todense"):
    to_array(_small_tensor())


def test_repr_of_abstract_tensors():
  # jax.eval_shape's output holds ShapeDtypeStructs: its repr raised inside np.any(np.asarray(overflow)).
  x = _small_tensor()
  w = jnp.ones((3, 3, 3, 2, 3), jnp.float32)
  out = jax.eval_shape(lambda t: jsparse.submconv3d(t, w, implementation="xla"), x)
  text = repr(out)
  assert "capacity=8, channels=3" in text and "OVERFLOWED" not in text
  assert out.coords.shape == (8, 4) and out.feats.shape == (8, 3)
  # Abstract inputs (ShapeDtypeStructs in the tensor) lower and compile, and the program gives the eager answer.
  conv = jax.jit(lambda t: jsparse.submconv3d(t, w, implementation="xla"))
  compiled = conv.lower(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x)).compile()
  np.testing.assert_array_equal(np.asarray(compiled(x).todense()),
                                np.asarray(jsparse.submconv3d(x, w, implementation="xla").todense()))


def test_error_checks_apply_to_an_already_jitted_function():
  # The setting was in JAX's trace context but not jit's key: a function jitted without the checks ran its old
  # program inside `with jsparse.error_checks()` (no error reported), and one jitted with them kept reporting.
  from jax.experimental import checkify
  coords = np.array([[0, 1, 1, 1], [0, 2, 1, 1], [1, 0, 0, 0], [1, 3, 3, 3]], np.int32)
  x = SparseTensor.from_coords(coords, np.ones((4, 2), np.float32), (4, 4, 4), 2, capacity=8)
  w = jnp.ones((3, 3, 3, 2, 2), jnp.float32)

  def step(t):  # 52 output sites, out_capacity 8: an overflow
    y = jsparse.sparse_conv3d(t, w, padding=1, out_capacity=8, implementation="xla")
    return y.feats.sum(), y.overflow

  for first_on in (False, True):
    f = jax.jit(checkify.checkify(step))
    for on in (first_on, not first_on, first_on):
      with jsparse.error_checks(on):
        err, (_, flag) = f(x)
      assert bool(flag)
      assert (err.get() is not None) == on, (first_on, on)
      if on:
        assert "out_capacity=8" in err.get()


@pytest.mark.parametrize("leaf", [jnp.shape, lambda a: a.dtype, lambda a: None, lambda a: True])
def test_repr_of_a_tensor_whose_leaves_a_tree_map_replaced(leaf):
  # jax.tree.map(jnp.shape, batch) and optimizers' masks leave other values than arrays at the leaves: printing
  # one raised AttributeError / IndexError reading its capacity.
  x = _small_tensor()
  text = repr(jax.tree.map(leaf, x))
  assert text.startswith("SparseTensor(coords=") and "spatial_shape=(4, 4, 4)" in text
  assert f"num={leaf(x.num)!r}" in text
