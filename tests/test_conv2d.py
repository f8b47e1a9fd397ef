"""2D and 1D sparse tensors, convolutions, pools and modules against dense lax references on todense()."""
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st
from jax import lax

import jsparse
import jsparse.nn as snn
import jsparse.nnx as snnx
from reference import rel_err
from test_packaging import readme_snippet

DN2 = ("NHWC", "HWIO", "NHWC")
DN1 = ("NWC", "WIO", "NWC")
HIGHEST = lax.Precision.HIGHEST


def random_sparse_nd(rng, spatial_shape, channels, *, batch_size=2, density=0.3, pad=7, dtype=np.float32):
  """A random 1D/2D SparseTensor built from shuffled (batch, ...) rows, with `pad` padding rows."""
  while True:
    coords = np.argwhere(rng.random((batch_size,) + tuple(spatial_shape)) < density).astype(np.int32)
    if len(coords):
      break
  coords = coords[rng.permutation(len(coords))]
  feats = rng.standard_normal((len(coords), channels)).astype(dtype)
  return jsparse.SparseTensor.from_coords(coords, feats, spatial_shape, batch_size, capacity=len(coords) + pad)


def weights(rng, kernel_size, cin, cout, dtype=np.float32):
  w = rng.standard_normal(tuple(kernel_size) + (cin, cout)) / np.sqrt(np.prod(kernel_size) * cin)
  return jnp.asarray(w, dtype), jnp.asarray(rng.standard_normal(cout), dtype)


def occupancy(x: jsparse.SparseTensor) -> jax.Array:
  """float32 dense [B, ..., 1]: 1 at x's valid sites."""
  return x.replace(feats=x.valid_mask()[:, None].astype(jnp.float32)).todense()


def to_odhwi(w):
  return jnp.moveaxis(w, -1, 0)


def compare(sparse_fn, dense_fn, args, *, tol, cot_seed=0, host_sized=False):
  """Values and gradients (w.r.t. every arg) of sparse_fn(*args) -> SparseTensor against dense_fn(*args) -> the
  dense output already masked to the sparse output's sites, through one random dense cotangent.

  Each side's output and gradients come from one jitted program (jax.value_and_grad with the output as aux; run
  eagerly, every op would compile on its own). host_sized: sparse_fn sizes its output on the host (out_capacity
  None, which jit refuses), so its forward and its gradient run eagerly (the out_capacity=None gradient path)."""
  cot = jnp.asarray(np.random.default_rng(cot_seed).standard_normal(jax.eval_shape(dense_fn, *args).shape),
                    jnp.float32)
  argnums = tuple(range(len(args)))

  def sparse_loss(*a):
    out = sparse_fn(*a)
    got = out.todense()
    return jnp.sum(got.astype(jnp.float32) * cot), (out, got)

  def dense_loss(*a):
    want = dense_fn(*a)
    return jnp.sum(want.astype(jnp.float32) * cot), want

  if host_sized:
    out = sparse_fn(*args)
    got = out.todense()
    g_sparse = jax.grad(lambda *a: sparse_loss(*a)[0], argnums)(*args)
  else:
    (_, (out, got)), g_sparse = jax.jit(jax.value_and_grad(sparse_loss, argnums, has_aux=True))(*args)
  (_, want), g_dense = jax.jit(jax.value_and_grad(dense_loss, argnums, has_aux=True))(*args)
  assert out.spatial_ndim == 2 or out.spatial_ndim == 1
  assert got.shape == want.shape
  assert rel_err(got.astype(jnp.float32), want.astype(jnp.float32)) < tol
  for a, b in zip(g_sparse, g_dense):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert rel_err(a.astype(jnp.float32), b.astype(jnp.float32)) < tol
  return out


def test_tensor_2d_metadata():
  rng = np.random.default_rng(0)
  x = random_sparse_nd(rng, (5, 7), 3)
  assert x.spatial_ndim == 2 and x.spatial_shape == (1, 5, 7) and x.dense_shape == (2, 5, 7, 3)
  assert "spatial_shape=(5, 7)" in repr(x) and "spatial_ndim=2" in repr(x)
  assert x.indices.shape == (x.capacity, 3)
  n = int(x.num)
  np.testing.assert_array_equal(np.asarray(x.coords[:n, 1]), 0)
  np.testing.assert_array_equal(np.asarray(x.indices[:n]), np.asarray(x.coords[:n])[:, [0, 2, 3]])
  assert x.todense(channels_first=True).shape == (2, 3, 5, 7)
  # The rank is static pytree data: it survives jit and tree round trips.
  y = jax.jit(lambda t: t.replace(feats=t.feats * 2))(x)
  assert y.spatial_ndim == 2 and y.spatial_shape == (1, 5, 7)
  leaves, treedef = jax.tree_util.tree_flatten(x)
  assert jax.tree_util.tree_unflatten(treedef, leaves).spatial_ndim == 2
  assert treedef != jax.tree_util.tree_structure(x.replace(spatial_ndim=3))
  # A 2D tensor viewed as 3D is the depth-1 grid.
  as3d = x.replace(spatial_ndim=3)
  np.testing.assert_array_equal(np.asarray(as3d.todense()), np.asarray(x.todense())[:, None])
  with pytest.raises(ValueError, match="spatial_shape starts with 1 extent"):
    jsparse.SparseTensor.from_dense(np.ones((1, 2, 3, 4, 1), np.float32)).replace(spatial_ndim=2)
  with pytest.raises(ValueError, match=r"\[N, 3\] \(batch, y, x\)"):
    jsparse.SparseTensor.from_coords(np.zeros((1, 4), int), np.ones((1, 1)), (4, 4))
  with pytest.raises(ValueError, match=r"\[0, 1, 4\].*outside"):
    jsparse.SparseTensor.from_coords(np.array([[0, 1, 4]]), np.ones((1, 1)), (4, 4))
  # The coords of a batch of one may leave out the batch column, as in 3D.
  z = jsparse.SparseTensor.from_coords(np.array([[1, 2], [3, 0]]), np.ones((2, 1), np.float32), (4, 4))
  assert z.batch_size == 1 and float(z.todense()[0, 1, 2, 0]) == 1.0 and float(z.todense()[0, 3, 0, 0]) == 1.0


@settings(max_examples=5, deadline=None)  # every example's grid compiles its eager ops anew
@given(seed=st.integers(0, 2**16), ndim=st.sampled_from([1, 2]), batch=st.integers(1, 3), channels=st.integers(1, 4),
       density=st.sampled_from([0.05, 0.3, 0.9]))
def test_dense_round_trip(seed, ndim, batch, channels, density):
  rng = np.random.default_rng(seed)
  shape = tuple(rng.integers(1, 12, size=ndim))
  dense = rng.standard_normal((batch,) + shape + (channels,)).astype(np.float32)
  dense *= rng.random((batch,) + shape + (1,)) < density
  x = jsparse.SparseTensor.from_dense(dense)
  assert x.spatial_ndim == ndim and x.dense_shape == dense.shape
  assert int(x.num) == int(np.any(dense != 0, axis=-1).sum())
  np.testing.assert_array_equal(np.asarray(x.todense()), dense)
  # from_coords of the user-rank indices gives the same tensor.
  n = int(x.num)
  y = jsparse.SparseTensor.from_coords(np.asarray(x.indices[:n]), x.feats[:n], shape, batch)
  np.testing.assert_array_equal(np.asarray(y.todense()), dense)
  np.testing.assert_array_equal(np.asarray(y.coords[:n]), np.asarray(x.coords[:n]))


# (spatial shape, kernel size, dilation, cin, cout)
SUBM_CASES = [((9, 11), (3, 3), 1, 3, 4), ((7, 6), (5, 3), (1, 2), 2, 5), ((12, 5), (1, 1), 1, 4, 3),
              ((8, 8), (3, 5), 2, 3, 2)]
# Each case (here and in STRIDED_CASES) in one weight layout (the layout changes how the GEMMs read the weight,
# not the map the geometry builds): every case and both layouts, each layout with an anisotropic kernel.
LAYOUTS = ["DHWIO", "ODHWI", "ODHWI", "DHWIO"]


@pytest.mark.parametrize("case,layout", list(zip(SUBM_CASES, LAYOUTS)),
                         ids=[f"{i}-{layout}" for i, layout in enumerate(LAYOUTS)])
def test_submconv2d_matches_dense(case, layout):
  shape, ks, dil, cin, cout = case
  rng = np.random.default_rng(len(shape) + cin * 7 + cout)
  x = random_sparse_nd(rng, shape, cin)
  w, b = weights(rng, ks, cin, cout)
  dil2 = (dil, dil) if isinstance(dil, int) else dil
  mask = occupancy(x)

  def sparse_fn(feats, w, b):
    wl = to_odhwi(w) if layout == "ODHWI" else w
    return jsparse.submconv2d(x.replace(feats=feats), wl, b, dilation=dil, weight_layout=layout, precision="highest")

  def dense_fn(feats, w, b):
    out = lax.conv_general_dilated(x.replace(feats=feats).todense(), w, (1, 1), "SAME", rhs_dilation=dil2,
                                   dimension_numbers=DN2, precision=HIGHEST)
    return (out + b) * mask

  y = compare(sparse_fn, dense_fn, (x.feats, w, b), tol=1e-5)
  np.testing.assert_array_equal(np.asarray(y.coords), np.asarray(x.coords))  # submanifold: same sites
  assert any(k.startswith("subm/k1x") for k in y.caches)  # the map of the lifted kernel, carried on


@pytest.mark.parametrize("dtype, tol", [(jnp.float16, 1e-2), (jnp.bfloat16, 3e-2)])
def test_submconv2d_and_sparse_conv2d_half_precision(dtype, tol):
  rng = np.random.default_rng(3)
  x32 = random_sparse_nd(rng, (10, 9), 8)
  w, b = weights(rng, (3, 3), 8, 6)
  x = x32.replace(feats=x32.feats.astype(dtype))
  for op, kwargs, dense_kwargs in [
      (jsparse.submconv2d, {}, dict(window_strides=(1, 1), padding="SAME")),
      (jsparse.sparse_conv2d, dict(stride=2, padding=1), dict(window_strides=(2, 2), padding=[(1, 1)] * 2))]:
    def sparse_fn(feats, w, b):
      return op(x.replace(feats=feats), w.astype(dtype), b.astype(dtype), **kwargs)

    mask = occupancy(sparse_fn(x.feats, w, b))

    def dense_fn(feats, w, b):  # float32 reference, output in the input's dtype
      out = lax.conv_general_dilated(x.replace(feats=feats.astype(jnp.float32)).todense(), w, dimension_numbers=DN2,
                                     precision=HIGHEST, **dense_kwargs)
      return ((out + b) * mask).astype(dtype)

    y = compare(sparse_fn, dense_fn, (x.feats, w, b), tol=tol, host_sized=op is jsparse.sparse_conv2d)
    assert y.dtype == dtype


# (spatial shape, kernel size, stride, padding, dilation)
STRIDED_CASES = [((9, 11), (3, 3), 2, 1, 1), ((8, 8), (2, 2), 2, 0, 1), ((10, 7), (3, 2), (2, 1), (1, 0), 1),
                 ((11, 9), (3, 3), 1, 0, (2, 1))]


@pytest.mark.parametrize("case,layout", list(zip(STRIDED_CASES, LAYOUTS)),
                         ids=[f"{i}-{layout}" for i, layout in enumerate(LAYOUTS)])
def test_sparse_conv2d_matches_dense(case, layout):
  shape, ks, stride, padding, dil = case
  rng = np.random.default_rng(sum(shape) + sum(ks))
  x = random_sparse_nd(rng, shape, 3, density=0.25)
  w, b = weights(rng, ks, 3, 4)
  pair = lambda v: (v, v) if isinstance(v, int) else tuple(v)

  def sparse_fn(feats, w, b):
    wl = to_odhwi(w) if layout == "ODHWI" else w
    return jsparse.sparse_conv2d(x.replace(feats=feats), wl, b, stride=stride, padding=padding, dilation=dil,
                                 weight_layout=layout, precision="highest")

  y = sparse_fn(x.feats, w, b)
  # Output sites: the structural support of the dense convolution (an indicator convolved with ones).
  support = lax.conv_general_dilated(occupancy(x), jnp.ones(ks + (1, 1)), pair(stride),
                                     [(p, p) for p in pair(padding)], rhs_dilation=pair(dil), dimension_numbers=DN2)
  mask = occupancy(y)
  np.testing.assert_array_equal(np.asarray(mask > 0), np.asarray(support > 0))

  def dense_fn(feats, w, b):
    out = lax.conv_general_dilated(x.replace(feats=feats).todense(), w, pair(stride), [(p, p) for p in pair(padding)],
                                   rhs_dilation=pair(dil), dimension_numbers=DN2, precision=HIGHEST)
    return (out + b) * mask

  compare(sparse_fn, dense_fn, (x.feats, w, b), tol=1e-5, host_sized=True)


@pytest.mark.parametrize("layout", ["DHWIO", "ODHWI"])
def test_sparse_inverse_conv2d_matches_dense(layout):
  rng = np.random.default_rng(11)
  x = random_sparse_nd(rng, (9, 10), 3)
  w1, _ = weights(rng, (3, 3), 3, 5)
  w2, b2 = weights(rng, (3, 3), 5, 2)
  y = jsparse.sparse_conv2d(x, w1, stride=2, padding=1)
  mask = occupancy(x)

  def sparse_fn(feats, w, b):
    wl = to_odhwi(w) if layout == "ODHWI" else w
    return jsparse.sparse_inverse_conv2d(y.replace(feats=feats), wl, b, like=x, stride=2, padding=1,
                                         weight_layout=layout, precision="highest")

  def dense_fn(feats, w, b):
    # The transpose of the dense strided convolution with the kernel's channel axes swapped, at x's sites.
    conv = lambda d: lax.conv_general_dilated(d, w.swapaxes(2, 3), (2, 2), [(1, 1)] * 2, dimension_numbers=DN2,
                                              precision=HIGHEST)
    _, vjp = jax.vjp(conv, jnp.zeros(x.dense_shape[:-1] + (2,), jnp.float32))
    (out,) = vjp(y.replace(feats=feats).todense())
    return (out + b) * mask

  z = compare(sparse_fn, dense_fn, (y.feats, w2, b2), tol=1e-5)
  np.testing.assert_array_equal(np.asarray(z.coords), np.asarray(x.coords))


@pytest.mark.parametrize("stride,layout", [(2, "DHWIO"), ((1, 3), "ODHWI")])  # each stride in one layout
def test_sparse_conv_transpose2d_matches_dense(stride, layout):
  rng = np.random.default_rng(5)
  x = random_sparse_nd(rng, (5, 4), 3)
  st2 = (stride, stride) if isinstance(stride, int) else stride
  w, b = weights(rng, st2, 3, 2)
  t = int(np.prod(st2))
  keep = jnp.asarray(rng.random((x.capacity, t)) < 0.6)

  def run(feats, w, b, mask=None):
    wl = to_odhwi(w) if layout == "ODHWI" else w
    return jsparse.sparse_conv_transpose2d(x.replace(feats=feats), wl, b, stride=stride, mask=mask,
                                           weight_layout=layout, precision="highest")

  for mask in (None, keep):
    out_mask = occupancy(run(x.feats, w, b, mask))

    def dense_fn(feats, w, b):
      out = lax.conv_transpose(x.replace(feats=feats).todense(), w[::-1, ::-1], st2, "VALID", dimension_numbers=DN2,
                               precision=HIGHEST)
      return (out + b) * out_mask

    y = compare(lambda f, w, b: run(f, w, b, mask), dense_fn, (x.feats, w, b), tol=1e-5, host_sized=True)
    assert y.spatial_shape == (1, 5 * st2[0], 4 * st2[1])
    expected = int(x.num) * t if mask is None else int(jnp.sum(keep & x.valid_mask()[:, None]))
    assert int(y.num) == expected
  # The teacher-forcing mask of a 2D decoder: children of the coarse sites that are sites of the fine tensor.
  fine = run(x.feats, w, b, keep)
  labels = jsparse.child_labels(x, fine, stride)
  assert labels.shape == (x.capacity, t)
  np.testing.assert_array_equal(np.asarray(labels), np.asarray(keep & x.valid_mask()[:, None]))


@pytest.mark.parametrize("reduce", ["max", "avg"])
@pytest.mark.parametrize("ks, stride, padding", [(2, None, 0), (3, 2, 1), ((3, 2), (2, 1), (1, 0))])
def test_pool2d_matches_dense(reduce, ks, stride, padding):
  rng = np.random.default_rng(21)
  x = random_sparse_nd(rng, (9, 8), 3, density=0.35)
  pair = lambda v: (v, v) if isinstance(v, int) else tuple(v)
  k2, s2, p2 = pair(ks), pair(ks if stride is None else stride), pair(padding)
  window = (1,) + k2 + (1,)
  strides = (1,) + s2 + (1,)
  pads = ((0, 0),) + tuple((p, p) for p in p2) + ((0, 0),)
  op = jsparse.sparse_max_pool2d if reduce == "max" else jsparse.sparse_avg_pool2d
  sparse_fn = lambda feats: op(x.replace(feats=feats), ks, stride, padding)
  mask = occupancy(sparse_fn(x.feats))
  active = occupancy(x)

  def dense_fn(feats):
    d = x.replace(feats=feats).todense()
    if reduce == "max":  # inactive sites and the padding do not count
      out = lax.reduce_window(jnp.where(active > 0, d, -jnp.inf), -jnp.inf, lax.max, window, strides, pads)
    else:
      total = lax.reduce_window(d, 0.0, lax.add, window, strides, pads)
      count = lax.reduce_window(active, 0.0, lax.add, window, strides, pads)
      out = total / jnp.maximum(count, 1)
    return jnp.where(mask > 0, out, 0)

  compare(sparse_fn, dense_fn, (x.feats,), tol=1e-6, host_sized=True)


def test_conv1d_and_pool1d_match_dense():
  rng = np.random.default_rng(2)
  x = random_sparse_nd(rng, (23,), 3, batch_size=3)
  assert x.spatial_ndim == 1 and x.spatial_shape == (1, 1, 23) and x.dense_shape == (3, 23, 3)
  w, b = weights(rng, (3,), 3, 4)
  mask = occupancy(x)
  compare(lambda f, w, b: jsparse.submconv1d(x.replace(feats=f), w, b, dilation=2, precision="highest"),
          lambda f, w, b: (lax.conv_general_dilated(x.replace(feats=f).todense(), w, (1,), "SAME", rhs_dilation=(2,),
                                                    dimension_numbers=DN1, precision=HIGHEST) + b) * mask,
          (x.feats, w, b), tol=1e-5)
  y = jsparse.sparse_conv1d(x, w, b, stride=2, padding=1, weight_layout="DHWIO", precision="highest")
  ymask = occupancy(y)
  compare(lambda f, w, b: jsparse.sparse_conv1d(x.replace(feats=f), to_odhwi(w), b, stride=2, padding=1,
                                                weight_layout="ODHWI", precision="highest"),
          lambda f, w, b: (lax.conv_general_dilated(x.replace(feats=f).todense(), w, (2,), [(1, 1)],
                                                    dimension_numbers=DN1, precision=HIGHEST) + b) * ymask,
          (x.feats, w, b), tol=1e-5, host_sized=True)
  w2, b2 = weights(rng, (3,), 4, 2)
  z = jsparse.sparse_inverse_conv1d(y, w2, b2, like=x, stride=2, padding=1)
  assert z.spatial_ndim == 1 and z.num == x.num
  u = jsparse.sparse_conv_transpose1d(x, weights(rng, (2,), 3, 2)[0], stride=2)
  assert u.spatial_shape == (1, 1, 46) and int(u.num) == 2 * int(x.num)
  pooled = jsparse.sparse_max_pool1d(x, 2)
  dense = jnp.where(mask > 0, x.todense(), -jnp.inf)
  ref = lax.reduce_window(dense, -jnp.inf, lax.max, (1, 2, 1), (1, 2, 1), "VALID")
  got = pooled.todense()
  np.testing.assert_allclose(np.asarray(got), np.asarray(jnp.where(occupancy(pooled) > 0, ref, 0)), rtol=1e-6)
  assert jsparse.sparse_avg_pool1d(x, 3, 2, 1).spatial_shape == (1, 1, 12)


def test_ranks_do_not_mix():
  rng = np.random.default_rng(4)
  x2 = random_sparse_nd(rng, (6, 6), 3)
  x3 = jsparse.SparseTensor.from_dense(np.ones((1, 3, 3, 3, 3), np.float32))
  w2, _ = weights(rng, (3, 3), 3, 4)
  w3, _ = weights(rng, (3, 3, 3), 3, 4)
  with pytest.raises(ValueError, match="submconv3d: x is a 2D SparseTensor.*use submconv2d"):
    jsparse.submconv3d(x2, w3)
  with pytest.raises(ValueError, match="submconv2d: x is a 3D SparseTensor.*use submconv3d"):
    jsparse.submconv2d(x3, w2)
  with pytest.raises(ValueError, match=r"submconv2d: weight must be 4-D \(Kh, Kw, Cin, Cout\)"):
    jsparse.submconv2d(x2, w3)
  with pytest.raises(ValueError, match=r"weight must be 4-D \(Cout, Kh, Kw, Cin\)"):
    jsparse.sparse_conv2d(x2, to_odhwi(w3), weight_layout="ODHWI")
  with pytest.raises(ValueError, match="sparse_conv3d: x is a 2D"):
    jsparse.sparse_conv3d(x2, w3, stride=2)
  with pytest.raises(ValueError, match="stride must be an int or 2 ints"):
    jsparse.sparse_conv2d(x2, w2, stride=(2, 2, 2))
  with pytest.raises(ValueError, match="kernel_size must be an int or 2 ints"):
    jsparse.sparse_max_pool2d(x2, (2, 2, 2))
  with pytest.raises(ValueError, match="sparse_max_pool3d: x is a 2D"):
    jsparse.sparse_max_pool3d(x2, 2)
  y2 = jsparse.sparse_conv2d(x2, w2, stride=2, padding=1)
  with pytest.raises(ValueError, match="sparse_inverse_conv2d: like is a 3D"):
    jsparse.sparse_inverse_conv2d(y2, weights(rng, (3, 3), 4, 3)[0], like=x3, stride=2, padding=1)
  with pytest.raises(ValueError, match="sparse_conv_transpose3d: x is a 2D"):
    jsparse.sparse_conv_transpose3d(x2, weights(rng, (2, 2, 2), 3, 4)[0])
  with pytest.raises(ValueError, match="spatial_ndim"):
    jsparse.union(x2, x2.replace(spatial_ndim=3))
  with pytest.raises(ValueError, match="spatial_ndim"):
    jsparse.concat(x2, x2.replace(spatial_ndim=3))
  with pytest.raises(ValueError, match="SubMConv3d: x is a 2D SparseTensor.*use SubMConv2d"):
    snn.SubMConv3d(4).init(jax.random.key(0), x2)
  with pytest.raises(ValueError, match="SparseConv2d: x is a 3D SparseTensor"):
    snnx.SparseConv2d(3, 4, 3, rngs=nnx.Rngs(0))(x3)
  with pytest.raises(ValueError, match="kernel_size must be an int or 2 ints"):
    snnx.SubMConv2d(3, 4, (3, 3, 3), rngs=nnx.Rngs(0))


def _rank_error_cases(nd):
  """(what, call, text) for every size check the 2D (nd=2) or 1D ops reach: `text` is the message in the user's
  rank (the ops run in 3D on a lifted grid, whose checks once quoted e.g. kernel_size (1, 3, 3) for a 2D op)."""
  shape = (6, 5) if nd == 2 else (9,)
  x = jsparse.SparseTensor.from_coords(np.argwhere(np.arange(2 * math.prod(shape)).reshape((2,) + shape) % 3 == 0),
                                       np.ones(((2 * math.prod(shape) + 2) // 3, 3), np.float32), shape, 2)
  K = lambda v: (v,) * nd  # a size of every axis, as the user writes it
  grid = lambda f: str(tuple(f(n) for n in shape))
  w = lambda ks, cin=3, cout=4: jnp.ones(ks + (cin, cout), jnp.float32)
  op = lambda name: getattr(jsparse, f"{name}{nd}d")
  sub, conv = op("submconv"), op("sparse_conv")
  inverse, transpose = op("sparse_inverse_conv"), op("sparse_conv_transpose")
  y = conv(x, w(K(3)), stride=2, padding=1)
  coarse = op("sparse_max_pool")(x, 2)
  ln = lambda name, *a, **k: getattr(snn, f"{name}{nd}d")(*a, **k).init(jax.random.key(0), x)
  nx = lambda name, *a, **k: getattr(snnx, f"{name}{nd}d")(*a, **k, rngs=nnx.Rngs(0))
  empty_conv = (f"kernel_size={K(15)}, stride={K(1)}, padding={K(0)}, dilation={K(1)} on spatial_shape={shape} gives "
                f"an empty output grid {grid(lambda n: n - 14)}")
  empty_pool = (f"kernel_size={K(20)}, stride={K(20)}, padding={K(0)}, dilation={K(1)} on spatial_shape={shape} "
                f"gives an empty output grid {grid(lambda n: 0)}")
  output_padding = f"ConvTranspose{nd}d), got output_padding={K(2)}, stride={K(2)}, dilation={K(1)}"
  return [
      ("even submanifold kernel", lambda: sub(x, w(K(2))), f"odd and >= 1, got {K(2)}"),
      ("dilation 0", lambda: sub(x, w(K(3)), dilation=0), f"dilation must be >= 1, got {K(0)}"),
      ("offsets past int32", lambda: sub(x, w(K(5)), dilation=2**30),
       f"kernel_size {K(5)} with dilation {K(2**30)} reaches offsets past int32"),
      ("input channels", lambda: sub(x, w(K(3), cin=5)), f"(weight shape {K(3) + (5, 4)}, weight_layout='DHWIO')"),
      ("input channels ODHWI", lambda: sub(x, jnp.ones((4,) + K(3) + (5,)), weight_layout="ODHWI"),
       f"(weight shape {(4,) + K(3) + (5,)}, weight_layout='ODHWI')"),
      ("groups", lambda: sub(x, w(K(3), 1, 4), feature_group_count=3),
       f"must divide the output channels (4, weight shape {K(3) + (1, 4)}"),
      ("empty kernel", lambda: sub(x, w(K(0))), f"nonzero kernel sizes and channel counts, got shape {K(0) + (3, 4)}"),
      ("cache", lambda: sub(x, w(K(3)), cache=jsparse.neighbor_map(x, 5)),
       f"kernel_size={K(5)}, dilation={K(1)}, capacity={x.capacity} but this conv has kernel_size={K(3)}, "
       f"dilation={K(1)}"),
      # A map built on the 3D view (kernel 3x3x3) quotes its 3 entries: in the rank it read the same as the op's.
      ("cache of the 3D view", lambda: sub(x, w(K(3)), cache=jsparse.neighbor_map(x.replace(spatial_ndim=3), 3)),
       f"kernel_size={(3, 3, 3)}, dilation={K(1)}, capacity={x.capacity} but this conv has kernel_size={K(3)}"),
      ("stride 0", lambda: conv(x, w(K(3)), stride=0), f"stride must be >= 1, got {K(0)}"),
      ("padding -1", lambda: conv(x, w(K(3)), padding=-1), f"padding must be >= 0, got {K(-1)}"),
      ("empty output grid", lambda: conv(x, w(K(15))), empty_conv),
      ("inverse off the grid", lambda: inverse(y, w(K(3), 4, 3), like=x, stride=1, padding=1),
       f"y (spatial_shape={y.spatial_shape[3 - nd:]}, batch_size=2) is not on the output grid {shape} "),
      ("inverse of another geometry", lambda: inverse(y, w(K(1), 4, 3), like=x, stride=2),
       f"sparse_inverse_conv{nd}d: y was made from `like` by a convolution with kernel_size={K(3)}, stride={K(2)}, "
       f"padding={K(1)}, dilation={K(1)}, but this inverse has kernel_size={K(1)}, stride={K(2)}, padding={K(0)}, "
       f"dilation={K(1)}"),
      ("output_padding", lambda: transpose(x, w(K(3)), stride=2, output_padding=2), output_padding),
      ("output_padding -1", lambda: transpose(x, w(K(3)), stride=2, output_padding=-1),
       f"output_padding must be >= 0, got {K(-1)}"),
      ("transposed empty grid", lambda: transpose(x, w(K(1)), stride=1, padding=9),
       f"kernel_size={K(1)}, stride={K(1)}, padding={K(9)}, output_padding={K(0)}, dilation={K(1)} on "
       f"spatial_shape={shape} gives an empty output grid {grid(lambda n: n - 18)}"),
      ("mask", lambda: transpose(x, w(K(3)), stride=2, mask=jnp.ones((x.capacity, 2**nd), bool)),
       f"this transposed convolution has kernel_size={K(3)}, stride={K(2)}, padding={K(0)}, output_padding={K(0)}, "
       f"dilation={K(1)}"),
      ("grid past 21 bits", lambda: transpose(x, w(K(2)), stride=2**20),
       f"output grid: spatial_shape={grid(lambda n: (n - 1) * 2**20 + 2)}: every extent"),
      ("pool kernel 0", lambda: op("sparse_max_pool")(x, 0), f"kernel_size must be >= 1, got {K(0)}"),
      ("pool empty grid", lambda: op("sparse_avg_pool")(x, 20), empty_pool),
      ("pool dilation 0", lambda: op("sparse_avg_pool")(x, 2, dilation=0), f"dilation must be >= 1, got {K(0)}"),
      ("neighbor_map even", lambda: jsparse.neighbor_map(x, 2), f"odd and >= 1, got {K(2)}"),
      ("neighbor_map dilation", lambda: jsparse.neighbor_map(x, 3, 0), f"dilation must be >= 1, got {K(0)}"),
      ("with_maps even", lambda: jsparse.with_maps(x, 3, 4), f"odd and >= 1, got {K(4)}"),
      ("with_maps dilation", lambda: jsparse.with_maps(x, dilation=0), f"dilation must be >= 1, got {K(0)}"),
      ("strided_map stride", lambda: jsparse.strided_map(x, 3, 0), f"stride must be >= 1, got {K(0)}"),
      ("strided_map empty", lambda: jsparse.strided_map(x, 15), empty_conv),
      ("transpose_map", lambda: jsparse.transpose_map(x, 3, 2, output_padding=2), output_padding),
      ("child_labels stride", lambda: jsparse.child_labels(coarse, x, 0), f"stride must be >= 1, got {K(0)}"),
      ("child_labels grid", lambda: jsparse.child_labels(coarse, x, 3),
       f"coarse (spatial_shape={coarse.spatial_shape[3 - nd:]}, batch_size=2) is not the stride-{K(3)} grid of fine "
       f"(spatial_shape between {grid(lambda n: n // 3)} and {grid(lambda n: -(-n // 3))}"),
      ("from_coords grid", lambda: jsparse.SparseTensor.from_coords(np.zeros((1, nd + 1), int), np.ones((1, 1)),
                                                                     (2**21,) * nd),
       f"spatial_shape={K(2**21)}: every extent"),
      ("linen conv empty grid", lambda: ln("SparseConv", 4, K(15), padding="VALID"), empty_conv),
      ("linen conv SAME stride 0", lambda: ln("SparseConv", 4, K(3), strides=0),
       f"SparseConv{nd}d: stride must be >= 1, got {K(0)}"),
      ("linen transposed output_padding", lambda: ln("SparseConvTranspose", 4, 2, kernel_size=3, output_padding=2),
       f"SparseConvTranspose{nd}d: output_padding must be smaller than the stride or the dilation on every axis "
       f"(as PyTorch's {output_padding}"),
      ("linen pool kernel 0", lambda: ln("SparseMaxPool", 0), f"kernel_size must be >= 1, got {K(0)}"),
      ("linen pool empty grid", lambda: ln("SparseAvgPool", 20), empty_pool),
      ("nnx submanifold dilation", lambda: nx("SubMConv", 3, 4, 3, kernel_dilation=0)(x),
       f"dilation must be >= 1, got {K(0)}"),
      ("nnx conv empty grid", lambda: nx("SparseConv", 3, 4, K(15), padding="VALID")(x), empty_conv),
      ("nnx transposed output_padding", lambda: nx("SparseConvTranspose", 3, 4, 2, kernel_size=3, output_padding=2),
       f"SparseConvTranspose{nd}d: output_padding must be smaller"),
  ]


@pytest.mark.parametrize("nd", [2, 1])
def test_size_errors_quote_the_users_rank(nd):
  """Every size check that the 2D and 1D ops, maps and modules reach words its message in the user's rank: the
  sizes as passed (2 or 1 entries, not the lifted grid's 3) and the op's own rank."""
  wrong = {}
  for what, call, text in _rank_error_cases(nd):
    with pytest.raises(ValueError) as info:
      call()
    if text not in str(info.value):
      wrong[what] = str(info.value)
  assert not wrong, wrong  # every case that quotes other sizes, with its message


def test_maps_norms_and_topology_keep_the_rank():
  rng = np.random.default_rng(8)
  x = random_sparse_nd(rng, (8, 9), 4, batch_size=3)
  w, b = weights(rng, (3, 3), 4, 4)
  # A neighbour map built with 2D sizes is the one submconv2d uses (and reuses from the tensor's caches).
  cache = jsparse.neighbor_map(x, 3)
  assert cache.kernel_size == (1, 3, 3) and cache.nbr.shape == (x.capacity, 9)
  a = jsparse.submconv2d(x, w, b, cache=cache)
  c = jsparse.submconv2d(jsparse.with_maps(x, (3, 3)), w, b)
  np.testing.assert_array_equal(np.asarray(a.feats), np.asarray(c.feats))
  assert jsparse.strided_map(x, 3, 2, 1)[2].shape[1] == 9
  # Norms read only the features and the batch column: the same result as on the 3D view, rank kept.
  for fn in (lambda t: jsparse.norm.batch_norm(t), lambda t: jsparse.norm.group_norm(t, 2),
             lambda t: jsparse.norm.layer_norm(t)):
    got, ref = fn(x), fn(x.replace(spatial_ndim=3))
    assert got.spatial_ndim == 2
    np.testing.assert_array_equal(np.asarray(got.feats), np.asarray(ref.feats))
  feats = np.asarray(x.feats[:int(x.num)])
  got = np.asarray(jsparse.norm.batch_norm(x).feats[:int(x.num)])
  np.testing.assert_allclose(got, (feats - feats.mean(0)) / np.sqrt(feats.var(0) + 1e-5), atol=1e-5)
  keep = jnp.asarray(rng.random(x.capacity) < 0.5)
  for out in (jsparse.select(x, keep), *jsparse.union(x, jsparse.select(x, keep)),
              jsparse.broadcast_per_item(x, jnp.ones((3, 2))), jsparse.serialize.sort_by(x)[0]):
    assert out.spatial_ndim == 2 and out.spatial_shape == (1, 8, 9)
  assert jsparse.global_pool(x).shape == (3, 4)


@pytest.mark.parametrize("order, max_step", [("hilbert", 1), ("morton", None)])
def test_2d_serialization_is_the_plane_curve(order, max_step):
  side = 16
  dense = np.ones((1, side, side, 1), np.float32)
  x = jsparse.SparseTensor.from_dense(dense, capacity="exact")
  sorted_x, _ = jsparse.serialize.sort_by(x, order)
  assert sorted_x.spatial_ndim == 2
  yx = np.asarray(sorted_x.indices)[:, 1:]
  assert len({tuple(r) for r in yx.tolist()}) == side * side
  if max_step is not None:  # the 2D Hilbert curve: every step moves to an edge-adjacent cell
    assert np.abs(np.diff(yx, axis=0)).sum(axis=1).max() == max_step
  else:  # Z-order of the plane: the quadrants in turn, each a Z-order of its own
    quadrant = (yx[:, 0] >= side // 2) * 2 + (yx[:, 1] >= side // 2)
    np.testing.assert_array_equal(quadrant, np.repeat(np.arange(4), side * side // 4))


class BevNet(nn.Module):
  """A small 2D encoder-decoder: submanifold block, strided down, inverse up, dense head."""

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = snn.SubMConv2d(8, 3)(x)
    x = snn.SparseBatchNorm(use_running_average=not train, activation=nn.relu)(x)
    y = snn.SparseConv2d(16, 3, strides=2, out_capacity=x.capacity)(x)
    z = snn.SparseInverseConv2d(8, 3, strides=2)(y, like=x)
    pooled = snn.SparseMaxPool2d(2, out_capacity=x.capacity)(x)
    return snn.SubMConv2d(1, 1)(z).todense() + jnp.mean(pooled.feats)


def test_linen_and_nnx_modules_train_step():
  rng = np.random.default_rng(12)
  x = random_sparse_nd(rng, (12, 10), 3, batch_size=2)
  target = jnp.asarray(rng.standard_normal(x.dense_shape[:-1] + (1,)), jnp.float32) * occupancy(x)
  model = BevNet()
  variables = model.init(jax.random.key(0), x)
  assert variables["params"]["SubMConv2d_0"]["kernel"].shape == (3, 3, 3, 8)
  assert variables["params"]["SparseConv2d_0"]["kernel"].shape == (3, 3, 8, 16)

  @jax.jit
  def step(params, stats, x):
    def loss_fn(p):
      out, upd = model.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
      return jnp.mean((out - target) ** 2), upd["batch_stats"]
    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return jax.tree.map(lambda p, g: p - 0.05 * g, params, grads), stats, loss, grads

  params, stats = variables["params"], variables["batch_stats"]
  losses = []
  for _ in range(4):
    params, stats, loss, grads = step(params, stats, x)
    losses.append(float(loss))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
  assert losses[-1] < losses[0]
  assert float(jnp.abs(grads["SparseConv2d_0"]["kernel"]).sum()) > 0

  # The nnx twins with the same parameters give the same output.
  class BevNetNnx(nnx.Module):
    def __init__(self, rngs, capacity):
      self.SubMConv2d_0 = snnx.SubMConv2d(3, 8, 3, rngs=rngs)
      self.SparseBatchNorm_0 = snnx.SparseBatchNorm(8, activation=nnx.relu, rngs=rngs)
      self.SparseConv2d_0 = snnx.SparseConv2d(8, 16, 3, strides=2, rngs=rngs)
      self.pool = snnx.SparseMaxPool2d(2, out_capacity=capacity)
      self.SparseInverseConv2d_0 = snnx.SparseInverseConv2d(16, 8, 3, strides=2, rngs=rngs)
      self.SubMConv2d_1 = snnx.SubMConv2d(8, 1, 1, rngs=rngs)

    def __call__(self, x):
      h = self.SparseBatchNorm_0(self.SubMConv2d_0(x))
      y = self.SparseConv2d_0(h, out_capacity=h.capacity)
      pooled = self.pool(h)
      return self.SubMConv2d_1(self.SparseInverseConv2d_0(y, like=h)).todense() + jnp.mean(pooled.feats)

  twin = BevNetNnx(nnx.Rngs(1), x.capacity)
  twin.eval()
  nnx.update(twin, snnx.linen_to_nnx({"params": params, "batch_stats": stats}, twin))
  want = model.apply({"params": params, "batch_stats": stats}, x, train=False)
  np.testing.assert_allclose(np.asarray(twin(x)), np.asarray(want), rtol=1e-5, atol=1e-6)

  twin.train()
  optimizer = nnx.Optimizer(twin, __import__("optax").sgd(0.05), wrt=nnx.Param)

  @nnx.jit
  def nnx_step(model, optimizer, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  first = float(nnx_step(twin, optimizer, x))
  for _ in range(3):
    last = float(nnx_step(twin, optimizer, x))
  assert np.isfinite(last) and last < first


def test_modules_equal_flax_conv_on_the_dense_map():
  rng = np.random.default_rng(13)
  x = random_sparse_nd(rng, (11, 9), 3)
  dense = x.todense()
  for sparse, flax_conv in [
      (snn.SubMConv2d(4, (3, 5), precision="highest"), nn.Conv(4, (3, 5), padding="SAME", precision=HIGHEST)),
      (snn.SparseConv2d(4, 3, strides=2, precision="highest"),
       nn.Conv(4, (3, 3), strides=2, padding="SAME", precision=HIGHEST)),
      (snn.SparseConv2d(4, (2, 3), strides=(2, 1), padding=0, precision="highest"),
       nn.Conv(4, (2, 3), strides=(2, 1), padding="VALID", precision=HIGHEST))]:
    variables = sparse.init(jax.random.key(1), x)
    variables = jax.tree.map(lambda a: a + 0.1, variables)  # a nonzero bias
    y = sparse.apply(variables, x)
    want = flax_conv.apply(variables, dense) * occupancy(y)
    assert rel_err(y.todense(), want) < 1e-5
    kernel_odhwi = to_odhwi(variables["params"]["kernel"])
    twin = sparse.clone(kernel_layout="ODHWI")
    y_odhwi = twin.apply({"params": {"kernel": kernel_odhwi, "bias": variables["params"]["bias"]}}, x)
    np.testing.assert_allclose(np.asarray(y_odhwi.feats), np.asarray(y.feats), rtol=1e-5, atol=1e-6)


def test_1d_modules_equal_flax_conv():
  rng = np.random.default_rng(14)
  x = random_sparse_nd(rng, (19,), 3)
  for sparse, twin, flax_conv in [
      (snn.SubMConv1d(4, 3, precision="highest"), snnx.SubMConv1d(3, 4, 3, precision="highest", rngs=nnx.Rngs(0)),
       nn.Conv(4, (3,), padding="SAME", precision=HIGHEST)),
      (snn.SparseConv1d(4, 3, strides=2, precision="highest"),
       snnx.SparseConv1d(3, 4, 3, strides=2, precision="highest", rngs=nnx.Rngs(0)),
       nn.Conv(4, (3,), strides=2, padding="SAME", precision=HIGHEST))]:
    variables = jax.tree.map(lambda a: a + 0.1, sparse.init(jax.random.key(1), x))
    assert variables["params"]["kernel"].shape == (3, 3, 4)
    y = sparse.apply(variables, x)
    assert y.spatial_ndim == 1
    want = flax_conv.apply(variables, x.todense()) * occupancy(y)
    assert rel_err(y.todense(), want) < 1e-5
    nnx.update(twin, snnx.linen_to_nnx(variables, twin))
    np.testing.assert_allclose(np.asarray(twin(x).feats), np.asarray(y.feats), rtol=1e-6)
  pooled = snn.SparseAvgPool1d(2).apply({}, x)
  np.testing.assert_array_equal(np.asarray(pooled.feats), np.asarray(snnx.SparseAvgPool1d(2)(x).feats))
  assert pooled.dense_shape == (2, 9, 3)


def test_pallas_interpret_matches_xla():
  rng = np.random.default_rng(9)
  x = random_sparse_nd(rng, (7, 6), 3, batch_size=2, density=0.35, pad=5)
  w, b = weights(rng, (3, 3), 3, 4)
  ws, _ = weights(rng, (3, 3), 3, 4)
  wi, _ = weights(rng, (3, 3), 4, 2)
  wt, _ = weights(rng, (2, 2), 3, 2)

  def run(impl):
    def f(feats, w, b, ws, wi, wt):
      xx = x.replace(feats=feats)
      s = jsparse.submconv2d(xx, w, b, implementation=impl, precision="highest")
      y = jsparse.sparse_conv2d(xx, ws, stride=2, padding=1, out_capacity=x.capacity, implementation=impl,
                                precision="highest")
      z = jsparse.sparse_inverse_conv2d(y, wi, like=xx, stride=2, padding=1, implementation=impl,
                                        precision="highest")
      u = jsparse.sparse_conv_transpose2d(xx, wt, stride=2, out_capacity=x.capacity * 4, implementation=impl,
                                          precision="highest")
      loss = (jnp.sum(s.feats ** 2) + jnp.sum(y.feats ** 2) + jnp.sum(z.feats * jnp.arange(2.0))
              + jnp.sum(jnp.sin(u.feats)))
      return loss, (s.feats, y.feats, z.feats, u.feats)
    return jax.jit(jax.value_and_grad(f, argnums=tuple(range(6)), has_aux=True))(x.feats, w, b, ws, wi, wt)

  (_, outs_p), grads_p = run("pallas")
  (_, outs_x), grads_x = run("xla")
  for a, r in zip(outs_p + grads_p, outs_x + grads_x):
    assert rel_err(a, r) < 1e-5


def test_readme_bev_example():
  code = readme_snippet("### 2D maps (BEV) and 1D sequences")
  scope = {}
  exec(compile(code, "README.md", "exec"), scope)
  assert scope["dense"].shape == (2, 50, 44, 128)
  assert scope["down"].spatial_shape == (1, 100, 88) and not bool(jsparse.overflowed(scope["down"]))
  # The jitted Sequential has static out_capacities: the example's must hold every output site.
  bev, model, variables = scope["bev"], scope["model"], scope["variables"]
  y = model.clone(layers=model.layers[:-1]).apply(variables, bev)
  assert not bool(jsparse.overflowed(y))


def bev_map(rng, channels, dtype, shape=(200, 176), density=0.2, batch_size=2):
  """A BEV-sized 2D map (e.g. a KITTI pillar grid) with `density` of its cells active."""
  coords = np.argwhere(rng.random((batch_size,) + shape) < density).astype(np.int32)
  feats = rng.standard_normal((len(coords), channels)).astype(np.float32)
  return jsparse.SparseTensor.from_coords(coords, jnp.asarray(feats, dtype), shape, batch_size)


def bev_pallas_vs_xla(dtype, precision, tol, shape=(200, 176), channels=64):
  rng = np.random.default_rng(17)
  x = bev_map(rng, channels, dtype, shape)
  w, b = weights(rng, (3, 3), channels, channels, dtype)
  ws, _ = weights(rng, (3, 3), channels, 2 * channels, dtype)
  cot = jnp.asarray(rng.standard_normal((x.capacity, channels)), jnp.float32)
  out_capacity = 2 * -(-shape[0] // 2) * -(-shape[1] // 2)  # every cell of the stride-2 grid: no overflow

  def run(impl, x, w, b, ws, precision):
    def f(feats, w, b, ws):
      xx = x.replace(feats=feats)
      s = jsparse.submconv2d(xx, w, b, implementation=impl, precision=precision)
      y = jsparse.sparse_conv2d(s, ws, stride=2, padding=1, out_capacity=out_capacity, implementation=impl,
                                precision=precision)
      loss = jnp.sum(s.feats.astype(jnp.float32) * cot) + jnp.sum(y.feats.astype(jnp.float32) ** 2)
      return loss, (s.feats, y.feats)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))(x.feats, w, b, ws)

  (_, outs_p), grads_p = run("pallas", x, w, b, ws, precision)
  # Reference: the XLA path in float32 at full precision.
  f32 = lambda a: a.astype(jnp.float32)
  (_, outs_x), grads_x = run("xla", x.replace(feats=f32(x.feats)), f32(w), f32(b), f32(ws), "highest")
  for a, r in zip(outs_p + grads_p, outs_x + grads_x):
    assert rel_err(f32(a), r) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, precision, tol", [(jnp.float32, "highest", 1e-5), (jnp.float16, None, 5e-3)])
def test_gpu_bev_map_pallas_matches_xla(dtype, precision, tol):
  """A BEV-sized map (200 x 176, 20% of the cells): the Pallas kernels against the XLA path in float32."""
  bev_pallas_vs_xla(dtype, precision, tol)
