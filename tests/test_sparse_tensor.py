import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from reference import random_sparse


@pytest.mark.parametrize("shape", [(4, 6, 5), (5, 5, 5)])  # cubic too: an x / z mix-up keeps a cube's shape
def test_roundtrip_dense_and_padding(shape):
  rng = np.random.default_rng(0)
  x = random_sparse(rng, shape, 3, batch_size=2, pad=7)
  assert x.capacity == int(x.num) + 7
  assert np.all(np.asarray(x.coords[int(x.num):]) == -1)
  assert np.all(np.asarray(x.feats[int(x.num):]) == 0)
  dense = x.todense()
  assert dense.shape == (2, *shape, 3)
  c = np.asarray(x.coords[: int(x.num)])
  np.testing.assert_array_equal(np.asarray(dense)[c[:, 0], c[:, 1], c[:, 2], c[:, 3]],
                                np.asarray(x.feats[: int(x.num)]))
  assert int((np.abs(np.asarray(dense)).sum(-1) > 0).sum()) == int(x.num)
  y = jsparse.SparseTensor.from_dense(dense, capacity=int(x.num) + 3)
  assert int(y.num) == int(x.num) and y.spatial_shape == shape and y.batch_size == 2
  np.testing.assert_array_equal(np.asarray(y.todense()), np.asarray(dense))
  # from_dense's own sites, not only through todense (the two could share a transposition): numpy's C order.
  sites = np.argwhere(np.any(np.asarray(dense) != 0, axis=-1))
  np.testing.assert_array_equal(np.asarray(y.coords[: int(y.num)]), sites)
  np.testing.assert_array_equal(np.asarray(y.feats[: int(y.num)]), np.asarray(dense)[tuple(sites.T)])


def test_pytree_jit_and_grad():
  rng = np.random.default_rng(1)
  x = random_sparse(rng, (5, 5, 5), 2)
  leaves, treedef = jax.tree_util.tree_flatten(x)
  assert len(leaves) == 4  # coords, feats, num, overflow (no caches yet)
  y = jax.tree_util.tree_unflatten(treedef, leaves)
  assert y.spatial_shape == x.spatial_shape and y.batch_size == x.batch_size

  @jax.jit
  def f(t):
    return jnp.sum(t.todense() ** 2)

  np.testing.assert_allclose(f(x), jnp.sum(x.feats**2), rtol=1e-5)
  # Integer leaves (coords, num) need allow_int; their cotangents are float0.
  g = jax.grad(f, allow_int=True)(x)
  np.testing.assert_allclose(g.feats, 2 * x.feats, rtol=1e-5)
  gf = jax.grad(lambda feats: f(x.replace(feats=feats)))(x.feats)
  np.testing.assert_allclose(gf, 2 * x.feats, rtol=1e-5)


def test_from_dense_under_jit_reports_overflow():
  dense = jnp.zeros((1, 3, 3, 3, 1)).at[0, :, 0, 0, 0].set(1.0)

  @jax.jit
  def f(d):
    return jsparse.SparseTensor.from_dense(d, capacity=2, with_overflow=True)

  t, overflow = f(dense)
  assert bool(overflow) and int(t.num) == 2
  _, ok = jax.jit(lambda d: jsparse.SparseTensor.from_dense(d, capacity=4, with_overflow=True))(dense)
  assert not bool(ok)
  with pytest.raises(ValueError, match="do not fit"):
    jsparse.SparseTensor.from_dense(dense, capacity=2)


def test_from_dense_of_2_31_cells_raises_naming_dense():
  """A batch of two 1024^3 occupancy grids (2**31 cells, 4 GiB in float16) failed in jnp.nonzero's int32 flat index
  with JAX's OverflowError, naming no argument. Traced abstractly (eval_shape): nothing is allocated."""
  big = jax.ShapeDtypeStruct((2, 1024, 1024, 1024, 1), jnp.float16)
  with pytest.raises(ValueError, match="from_dense: dense of shape .* has 2147483648 cells.*from_coords"):
    jax.eval_shape(lambda d: jsparse.SparseTensor.from_dense(d, capacity=128), big)
  # One cell fewer than 2**31 is still indexed exactly (the output's shapes only).
  out = jax.eval_shape(lambda d: jsparse.SparseTensor.from_dense(d, capacity=128).coords,
                       jax.ShapeDtypeStruct((1, 1, 2**31 - 1, 1), jnp.float16))
  assert out.shape == (128, 4)


def test_duplicates_error_and_reductions():
  coords = np.array([[0, 1, 1, 1], [0, 2, 2, 2], [0, 1, 1, 1], [0, 1, 1, 1]])
  feats = np.array([[1.0], [5.0], [2.0], [6.0]], np.float32)
  with pytest.raises(ValueError, match="duplicate coordinates"):
    jsparse.SparseTensor.from_coords(coords, feats, (4, 4, 4))
  expect = {"sum": 9.0, "mean": 3.0, "max": 6.0, "first": 1.0}
  for reduce, value in expect.items():
    t = jsparse.SparseTensor.from_coords(coords, feats, (4, 4, 4), reduce=reduce)
    assert int(t.num) == 2
    d = np.asarray(t.todense())
    assert d[0, 1, 1, 1, 0] == value and d[0, 2, 2, 2, 0] == 5.0
  with pytest.raises(ValueError, match="reduce must be"):
    jsparse.SparseTensor.from_coords(coords, feats, (4, 4, 4), reduce="median")


@pytest.mark.parametrize(
    "coords, feats, kwargs, err, match",
    [
        ([[0, 1, 2, 3]], [[1.0]], dict(spatial_shape=(3, 3, 3)), ValueError, "outside"),
        ([[0, -1, 2, 2]], [[1.0]], dict(spatial_shape=(3, 3, 3)), ValueError, "negative"),
        ([[2, 1, 1, 1]], [[1.0]], dict(spatial_shape=(3, 3, 3), batch_size=2), ValueError, "outside"),
        ([[0.0, 1, 1, 1]], [[1.0]], dict(spatial_shape=(3, 3, 3)), TypeError, "integers"),
        ([[0, 1, 1, 1], [0, 2, 2, 2]], [[1.0]], dict(spatial_shape=(3, 3, 3)), ValueError, "rows"),
        ([[0, 1, 1, 1], [0, 2, 2, 2]], [[1.0], [2.0]], dict(spatial_shape=(3, 3, 3), capacity=1), ValueError,
         "capacity"),
        ([[0, 1, 1]], [[1.0]], dict(spatial_shape=(3, 3, 3, 3)), ValueError, "spatial_shape"),
        ([[0, 1, 1, 1]], [[1.0]], dict(spatial_shape=(3, 3)), ValueError, r"\[N, 3\] \(batch, y, x\)"),
        ([[0, 1, 1, 1, 1]], [[1.0]], dict(spatial_shape=(3, 3, 3)), ValueError, r"\[N, 4\]"),
        ([[0, 1, 1, 1]], [[1]], dict(spatial_shape=(3, 3, 3)), TypeError, "floating"),
        ([[0, 1, 1, 1]], [[1.0]], dict(spatial_shape=(2**21, 8, 8)), ValueError, "2\\*\\*21"),
        ([[0, 1, 1, 1]], [[1.0]], dict(spatial_shape=(2**20,) * 3, batch_size=4), ValueError, "2\\*\\*62"),
    ],
)
def test_bad_input(coords, feats, kwargs, err, match):
  with pytest.raises(err, match=match):
    jsparse.SparseTensor.from_coords(np.asarray(coords), np.asarray(feats), **kwargs)


def test_three_column_coords_and_round_capacity():
  t = jsparse.SparseTensor.from_coords(np.array([[1, 2, 3]]), np.ones((1, 2), np.float32), (4, 4, 4))
  assert t.batch_size == 1 and t.coords[:1].tolist() == [[0, 1, 2, 3]] and t.capacity == 128
  caps = [jsparse.round_capacity(n) for n in range(1, 100_000, 997)]
  assert all(c >= n for c, n in zip(caps, range(1, 100_000, 997)))
  assert all(c % 128 == 0 for c in caps)
  assert all(c <= max(1.125 * n, 128) for c, n in zip(caps, range(1, 100_000, 997)))
  assert len(set(caps)) < 40  # 101 sizes share 38 buckets (8 per power of two, multiples of 128)


def test_repr_of_stacked_tensors():
  # Tensors stacked leaf by leaf for jax.vmap (the class docstring's recipe) have a num per element: the repr
  # raised TypeError (int() of a [2] array) and would have shown the stack size as the capacity.
  x = jsparse.SparseTensor.from_coords(np.array([[0, 1, 1, 1], [0, 2, 2, 2]]), np.ones((2, 3), np.float32), (4, 4, 4))
  stacked = jax.tree.map(lambda *a: jnp.stack(a), x, x.replace(num=1))
  text = repr(stacked)
  assert "num=[2, 1]" in text and "capacity=128" in text and "stacked=(2,)" in text
  assert repr(x) == ("SparseTensor(num=2, capacity=128, channels=3, dtype=float32, spatial_shape=(4, 4, 4), "
                     "batch_size=1)")


def test_direct_construction_checks_static_metadata():
  # Building the pytree directly (the route under jit) or replacing its static fields took any value: a list
  # spatial_shape failed inside add as an unhashable jit static argument, a short one in todense's unpacking,
  # and batch_size=0 made a tensor whose every row fell outside the batch.
  coords = jnp.array([[0, 1, 1, 1], [1, 2, 2, 2], [-1, -1, -1, -1]], jnp.int32)
  feats = jnp.ones((3, 2))
  x = jsparse.SparseTensor(coords, feats, jnp.int32(2), [4, 4, 4], 2)
  assert x.spatial_shape == (4, 4, 4) and int(jsparse.add(x, x).num) == 2
  assert jsparse.SparseTensor(coords, feats, 2, (np.int64(4), 4, 4), np.int64(2)).batch_size == 2
  with pytest.raises(ValueError, match="spatial_shape"):
    jsparse.SparseTensor(coords, feats, jnp.int32(2), (4, 4), 2)
  with pytest.raises(ValueError, match="spatial_shape"):
    jsparse.SparseTensor(coords, feats, jnp.int32(2), (4, 0, 4), 2)
  with pytest.raises(TypeError, match="batch_size"):
    jsparse.SparseTensor(coords, feats, jnp.int32(2), (4, 4, 4), 2.0)
  with pytest.raises(ValueError, match="batch_size"):
    x.replace(batch_size=0)
  with pytest.raises(ValueError, match="spatial_shape"):
    x.replace(spatial_shape=(4, 4))


def test_direct_construction_checks_the_arrays():
  # The route under jit (and the one from_coords' error names) took arrays of any shape or dtype: coords of 3
  # columns made todense all zeros, 1-D feats of 2 rows became 2 channels on every row, float coords failed in
  # todense's scatter naming no argument, and a num past the capacity passed.
  coords = jnp.array([[0, 1, 1, 1], [0, 2, 2, 2]], jnp.int32)
  feats = jnp.array([[1.0], [2.0]])
  expected = np.zeros((1, 4, 4, 4, 1), np.float32)
  expected[0, 1, 1, 1, 0], expected[0, 2, 2, 2, 0] = 1.0, 2.0
  x = jsparse.SparseTensor(coords, feats, 2, (4, 4, 4), 1)
  np.testing.assert_array_equal(np.asarray(x.todense()), expected)
  bad = {r"coords must be integer \[capacity, 4\], got int32 \(2, 3\)": (coords[:, 1:], feats, 2),
         r"coords must be integer \[capacity, 4\], got float32": (coords.astype(jnp.float32), feats, 2),
         r"feats must be \[capacity=2, C\]": (coords, feats[:, 0], 2),
         r"feats must be \[capacity=2, C\], got shape \(3, 1\)": (coords, jnp.ones((3, 1)), 2),
         "num must be an integer scalar in": (coords, feats, 3)}
  for message, (c, f, n) in bad.items():
    with pytest.raises(ValueError, match=message):
      jsparse.SparseTensor(c, f, n, (4, 4, 4), 1)
  for num in (2.0, jnp.float32(2)):
    with pytest.raises(ValueError, match="num must be an integer scalar"):
      jsparse.SparseTensor(coords, feats, num, (4, 4, 4), 1)
  with pytest.raises(TypeError, match="feats must be real floating point"):
    jsparse.SparseTensor(coords, jnp.ones((2, 1), jnp.int32), 2, (4, 4, 4), 1)
  # Under jit the shapes and dtypes are checked as they are traced; a traced num is not compared.
  run = jax.jit(lambda c, f, n: jsparse.SparseTensor(c, f, n, (4, 4, 4), 1).todense())
  np.testing.assert_array_equal(np.asarray(run(coords, feats, jnp.int32(2))), expected)
  with pytest.raises(ValueError, match="coords must be integer"):
    run(coords[:, 1:], feats, jnp.int32(2))


def test_direct_construction_refuses_a_host_num_past_the_rows():
  """num=5 on 3 rows made batch_statistics divide the 3 rows' sum by 5 (mean 0.8 for rows 1, 3, 0, whose mean is
  4/3). A host num (Python or numpy integer) is checked against the capacity; a device num is not read back, so
  that building a tensor eagerly never waits on the device."""
  coords = jnp.array([[0, 0, 0, 0], [0, 1, 1, 1], [0, 2, 2, 2]], jnp.int32)
  feats = jnp.array([[1.0], [3.0], [0.0]])
  mean, var = jsparse.norm.batch_statistics(jsparse.SparseTensor(coords, feats, 3, (4, 4, 4), 1))
  np.testing.assert_allclose(np.asarray(mean), [4 / 3], rtol=1e-6)
  np.testing.assert_allclose(np.asarray(var), [np.var([1.0, 3.0, 0.0])], rtol=1e-6)
  for num in (5, 4, -1, np.int32(4), 2.0, np.array([1, 2])):
    with pytest.raises(ValueError, match=r"num must be an integer scalar in \[0, capacity=3\]"):
      jsparse.SparseTensor(coords, feats, num, (4, 4, 4), 1)
  # Traced num passes (checked where concrete), and so do tensors stacked for jax.vmap.
  out = jax.jit(lambda n: jsparse.SparseTensor(coords, feats, n, (4, 4, 4), 1).num)(jnp.int32(2))
  assert int(out) == 2
  stacked = jsparse.SparseTensor(jnp.stack([coords, coords]), jnp.stack([feats, feats]), np.array([3, 1]),
                                 (4, 4, 4), 1)
  assert stacked.coords.shape == (2, 3, 4)
  with pytest.raises(ValueError, match="num must be"):
    jsparse.SparseTensor(jnp.stack([coords, coords]), jnp.stack([feats, feats]), np.array([3, 4]), (4, 4, 4), 1)


@pytest.mark.parametrize("spatial_shape,batch_size", [((4, 4, 4), 1), ((1024, 1024, 1024), 2)], ids=["int32", "words"])
def test_linear_keys_of_rows_outside_the_grid_are_minus_one(spatial_shape, batch_size):
  # (0, 1, Y, 0) of a directly built tensor got the linear key of (0, 2, 0, 0), so a match on keys found that site.
  y_extent = spatial_shape[1]
  coords = jnp.array([[0, 1, y_extent, 0], [0, 2, 0, 0], [batch_size, 0, 0, 0], [-1, -1, -1, -1]], jnp.int32)
  x = jsparse.SparseTensor(coords, jnp.ones((4, 1)), jnp.int32(3), spatial_shape, batch_size)
  for keys in (np.asarray(x.linear_keys()), np.asarray(jax.jit(lambda t: t.linear_keys())(x))):
    keys = keys.reshape(4, -1)
    assert np.all(keys[[0, 2, 3]] == -1) and np.all(keys[1] >= 0)
    assert keys[1, -1] == 2 * spatial_shape[1] * spatial_shape[2]


def test_a_tree_map_that_cast_the_coordinates_is_named():
  # jax.tree.map(astype(bfloat16)) over a batch casts coords and num too (unflattening skips the constructor's
  # checks): a pool then failed with lax's "does not accept dtype bfloat16", todense with an indexer error.
  x = jsparse.SparseTensor.from_coords(np.array([[0, 1, 2, 3], [0, 3, 3, 3]]), np.ones((2, 3), np.float32),
                                       (4, 4, 4), 1, capacity=8)
  cast = jax.tree.map(lambda a: a.astype(jnp.bfloat16), x)
  with pytest.raises(TypeError, match=r"x\.coords must be integer, got dtype bfloat16"):
    jsparse.pool.sparse_max_pool3d(cast, 2, out_capacity=8)
  with pytest.raises(TypeError, match=r"coords must be integer"):
    cast.todense()
  with pytest.raises(TypeError, match=r"x\.num must be integer"):
    jsparse.norm.batch_norm(jax.tree.map(lambda a: a.astype(jnp.float32) if a.ndim == 0 else a, x))


def test_equality_and_hashing_are_clear():
  # The dataclass's == compared the fields' arrays as a tuple: "truth value of an array ... is ambiguous" for two
  # tensors; hash() named jaxlib's array type.
  x = jsparse.SparseTensor.from_coords(np.array([[0, 1, 2, 3]]), np.ones((1, 2), np.float32), (4, 4, 4), capacity=4)
  assert x == x and x != 3 and not (x == None)  # noqa: E711 (== None is the comparison tested)
  with pytest.raises(TypeError, match="not compared with ==.*array_equal"):
    x == x.replace(feats=2 * x.feats)  # noqa: B015
  with pytest.raises(TypeError, match="unhashable type: 'SparseTensor'"):
    hash(x)


def test_loop_carries_of_another_grid_name_the_static_fields():
  # JAX's error for a carry or branch whose tensor has another grid printed the bare metadata ((4, 4, 4), 1, 3).
  x = jsparse.SparseTensor.from_coords(np.array([[0, 1, 2, 3]]), np.ones((1, 2), np.float32), (4, 4, 4), capacity=4)
  wider = x.replace(batch_size=2)
  with pytest.raises(TypeError, match=r"spatial_shape=\(4, 4, 4\), batch_size=1.*batch_size=2"):
    jax.lax.cond(True, lambda: x, lambda: wider)
  with pytest.raises(TypeError, match=r"batch_size=1.*batch_size=2"):
    jax.lax.while_loop(lambda t: False, lambda t: wider, x)


def test_donating_a_tensor_without_its_maps():
  # A map holds its tensor's coords and num (the same arrays): donated together they are one buffer twice, which
  # XLA refuses; the class docstring's way out is to donate the tensor without its maps.
  x = jsparse.with_maps(jsparse.SparseTensor.from_coords(np.array([[0, 1, 2, 3], [0, 1, 2, 2]]),
                                                         np.ones((2, 2), np.float32), (4, 4, 4), capacity=4),
                        3, implementation="xla")
  w = jnp.ones((3, 3, 3, 2, 2), jnp.float32)
  step = jax.jit(lambda t: jsparse.submconv3d(t, w, implementation="xla"), donate_argnums=0)
  expected = np.asarray(jsparse.submconv3d(x, w, implementation="xla").todense())
  np.testing.assert_array_equal(np.asarray(step(x.replace(caches={})).todense()), expected)
