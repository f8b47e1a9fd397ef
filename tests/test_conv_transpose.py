"""The general transposed sparse convolution (sparse_conv_transpose3d with any kernel, stride, padding,
output_padding and dilation) against lax.conv_transpose on todense(), the Pallas site search against XLA's,
its maps against the strided convolution's, and its modules."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import Phase, assume, example, given, settings, strategies as st
from jax import lax

import jsparse
import jsparse.nn as snn
import jsparse.nnx as snnx
from jsparse.neighbors import as_triple
from jsparse.sparse_conv import (pair_map, sparse_conv_transpose3d, sparse_inverse_conv3d, transpose_geometry,
                                 transpose_map)
from reference import random_sparse, rel_err

DN = ("NDHWC", "DHWIO", "NDHWC")
HI = lax.Precision.HIGHEST


def _weights(rng, kernel_size, cin, cout, dtype=np.float32):
  ks = as_triple(kernel_size, "kernel_size")
  w = rng.standard_normal(ks + (cin, cout)) / np.sqrt(np.prod(ks) * cin)
  return jnp.asarray(w.astype(dtype)), jnp.asarray(rng.standard_normal(cout).astype(dtype))


def _dense_transpose(dense, w, geom):
  """The documented reference: lax.conv_transpose with the flipped kernel and lax_padding (float32)."""
  return lax.conv_transpose(dense.astype(jnp.float32), w[::-1, ::-1, ::-1].astype(jnp.float32), geom.stride,
                            geom.lax_padding(), rhs_dilation=geom.dilation, dimension_numbers=DN,
                            transpose_kernel=False, precision=HI)


def _at(dense, t: jsparse.SparseTensor):
  """dense [B, X, Y, Z, C] read at t's valid rows, zeros at padding rows."""
  valid = t.valid_mask()
  c = jnp.where(valid[:, None], t.coords, 0)
  return jnp.where(valid[:, None], dense[c[:, 0], c[:, 1], c[:, 2], c[:, 3]], 0)


def _support(x: jsparse.SparseTensor, geom) -> set:
  """The sites the indicator of x's sites reaches through the dense transposed convolution (all-ones kernel)."""
  c = np.asarray(x.coords[:int(x.num)])
  indicator = np.zeros((x.batch_size,) + x.spatial_shape + (1,), np.float32)
  indicator[c[:, 0], c[:, 1], c[:, 2], c[:, 3]] = 1
  reach = jax.jit(lambda ind: _dense_transpose(ind, jnp.ones(geom.kernel_size + (1, 1)), geom))(indicator)
  return set(map(tuple, np.argwhere(np.asarray(reach[..., 0]) > 0.5).tolist()))


def _sites(t: jsparse.SparseTensor) -> list:
  return [tuple(r) for r in np.asarray(t.coords[:int(t.num)]).tolist()]


def _numpy_transpose(x: jsparse.SparseTensor, w, b, geom) -> dict:
  """{site: features} by accumulating x[j] @ w[v] at j*stride - padding + v*dilation (float64)."""
  out = {}
  c, f, w = np.asarray(x.coords), np.asarray(x.feats, np.float64), np.asarray(w, np.float64)
  for j in range(int(x.num)):
    for v in itertools.product(*map(range, geom.kernel_size)):
      o = tuple(c[j, 1 + a] * geom.stride[a] - geom.padding[a] + v[a] * geom.dilation[a] for a in range(3))
      if all(0 <= o[a] < geom.out_shape[a] for a in range(3)):
        site = (int(c[j, 0]),) + o
        out[site] = out.get(site, np.asarray(b, np.float64)) + f[j] @ w[v]
  return out


def _check_against_dense(x, w, b, *, stride, padding, output_padding, dilation=1, tol=1e-5, grad_tol=1e-5,
                         implementation="xla", weight_layout="DHWIO", w_dhwio=None):
  """Sites, values and gradients (features, weight, bias) of one transposed convolution against the dense
  reference; returns the output."""
  w_dhwio = w if w_dhwio is None else w_dhwio
  kw = dict(stride=stride, padding=padding, output_padding=output_padding, dilation=dilation,
            implementation=implementation, precision="highest", weight_layout=weight_layout)
  y = sparse_conv_transpose3d(x, w, b, out_capacity="exact", **kw)
  geom = transpose_geometry(x.spatial_shape, w_dhwio.shape[:3], stride, padding, output_padding, dilation)
  assert y.spatial_shape == geom.out_shape and y.batch_size == x.batch_size
  dense_like = jax.ShapeDtypeStruct(x.dense_shape, jnp.float32)
  assert jax.eval_shape(lambda d: _dense_transpose(d, w_dhwio, geom), dense_like).shape[1:4] == geom.out_shape
  sites = _sites(y)
  assert len(set(sites)) == len(sites) == y.capacity
  assert set(sites) == _support(x, geom)
  to_dhwio = (lambda w: jnp.moveaxis(w, 0, -1)) if weight_layout == "ODHWI" else (lambda w: w)

  def dense_fn(f, w, b):
    return (_at(_dense_transpose(x.replace(feats=f).todense(), to_dhwio(w), geom), y) + b).astype(jnp.float32)

  def sparse_fn(f, w, b):
    return sparse_conv_transpose3d(x.replace(feats=f), w, b, out_capacity=y.capacity, **kw).feats.astype(jnp.float32)

  cot = jnp.asarray(np.random.default_rng(0).standard_normal(y.feats.shape).astype(np.float32))

  def values_and_grads(fn):
    """fn's values (as the gradient program's aux: one compilation per side, not one per eager primitive) and
    its gradients."""
    def loss(*a):
      out = fn(*a)
      return jnp.sum(out * cot), out

    (_, values), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(x.feats, w, b)
    return values, grads

  _, grads = values_and_grads(sparse_fn)
  want, expected = values_and_grads(dense_fn)
  assert y.dtype == x.dtype
  assert rel_err(y.feats, want) < tol
  for name, g, r in zip(("features", "weight", "bias"), grads, expected):
    assert g.dtype == r.dtype and rel_err(g, r) < grad_tol, name
  return y


# A covering set of kernel {2, 3, 4} x stride {1, 2, 3} x padding {0, 1} x output_padding {0, 1} (q < s): every
# (kernel, stride) pair once, every stride with both paddings and both output_paddings, every kernel with both
# paddings, kernel < stride, == stride and > stride, and kernel == stride with padding 0 (the generative children
# path, k2s2 and k3s3) beside kernel == stride with padding (the general path, k2s2p1). Each case is another
# geometry through the same code, so the full product (30 cases) checked nothing these 10 do not.
GRID = [(2, 1, 1, 0), (3, 1, 0, 0), (4, 1, 1, 0),
        (2, 2, 0, 0), (2, 2, 1, 0), (3, 2, 1, 1), (4, 2, 0, 1),
        (2, 3, 0, 1), (3, 3, 0, 0), (4, 3, 1, 1)]


@pytest.mark.parametrize("k,s,p,q", GRID, ids=[f"k{k}s{s}p{p}op{q}" for k, s, p, q in GRID])
def test_matches_lax_conv_transpose(k, s, p, q):
  rng = np.random.default_rng(100 * k + 10 * s + 2 * p + q)
  x = random_sparse(rng, (4, 3, 5), 3, batch_size=2, density=0.3, pad=3)
  w, b = _weights(rng, k, 3, 4)
  _check_against_dense(x, w, b, stride=s, padding=p, output_padding=q)


ANISOTROPIC = [
    # (kernel, stride, padding, output_padding, dilation)
    ((3, 2, 4), (2, 1, 3), (1, 0, 1), (1, 0, 2), 1),
    ((2, 3, 1), (3, 2, 1), (0, 1, 0), (2, 0, 0), 1),
    (3, 1, 1, (0, 1, 0), (1, 2, 1)),  # output_padding < dilation with stride 1
    ((3, 3, 2), 2, (2, 0, 1), 0, (2, 1, 3)),
]


@pytest.mark.parametrize("case", ANISOTROPIC, ids=[str(i) for i in range(len(ANISOTROPIC))])
def test_anisotropic_and_dilated(case):
  ks, st_, pad, out_pad, dil = case
  rng = np.random.default_rng(7)
  x = random_sparse(rng, (5, 4, 3), 2, batch_size=2, density=0.3, pad=4)
  w, b = _weights(rng, ks, 2, 3)
  _check_against_dense(x, w, b, stride=st_, padding=pad, output_padding=out_pad, dilation=dil)


@pytest.mark.parametrize("k,s,p,q", [(3, 2, 1, 1), (4, 3, 0, 2)])
def test_float16(k, s, p, q):
  rng = np.random.default_rng(11)
  x = random_sparse(rng, (4, 5, 3), 8, batch_size=2, density=0.35, pad=2, dtype=np.float16)
  w, b = _weights(rng, k, 8, 8, np.float16)
  _check_against_dense(x, w, b, stride=s, padding=p, output_padding=q, tol=2e-3, grad_tol=5e-3)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_odhwi_layout(implementation):
  rng = np.random.default_rng(12)
  x = random_sparse(rng, (4, 3, 4), 3, batch_size=1, density=0.4, pad=3)
  w, b = _weights(rng, (3, 2, 3), 3, 5)
  w_odhwi = jnp.moveaxis(w, -1, 0)
  y = _check_against_dense(x, w_odhwi, b, stride=2, padding=(1, 0, 1), output_padding=1,
                           implementation=implementation, weight_layout="ODHWI", w_dhwio=w)
  same = sparse_conv_transpose3d(x, w, b, stride=2, padding=(1, 0, 1), output_padding=1, out_capacity=y.capacity,
                                 implementation=implementation, precision="highest")
  assert np.array_equal(same.coords, y.coords) and rel_err(same.feats, y.feats) < 1e-6


def test_batch_items_are_independent():
  rng = np.random.default_rng(13)
  x = random_sparse(rng, (4, 4, 5), 3, batch_size=3, density=0.3, pad=0)
  w, b = _weights(rng, 3, 3, 2)
  kw = dict(stride=2, padding=1, output_padding=1, precision="highest")
  y = sparse_conv_transpose3d(x, w, b, out_capacity="exact", **kw)
  c, f = np.asarray(x.coords), np.asarray(x.feats)
  yc, yf = np.asarray(y.coords[:int(y.num)]), np.asarray(y.feats[:int(y.num)])
  # One program for every item (same shapes: each item alone in x's capacity, the output in y's): one compilation
  # instead of one per item.
  run = jax.jit(lambda t: sparse_conv_transpose3d(t, w, b, out_capacity=y.capacity, **kw))
  # Bitwise independence compares one program with itself: the eager call and the jitted one may differ in the last
  # bit on a GPU (seen on an H200), which says nothing about items.
  same_program = np.asarray(run(x).feats)[:int(y.num)]
  for item in range(3):
    rows = c[:, 0] == item
    alone = jsparse.SparseTensor.from_coords(np.concatenate([np.zeros((rows.sum(), 1), np.int32), c[rows, 1:]], 1),
                                             f[rows], x.spatial_shape, 1, capacity=x.capacity)
    z = run(alone)
    mine = yc[:, 0] == item
    assert int(z.num) == int(mine.sum()) and not bool(z.overflow)
    assert np.array_equal(yc[mine, 1:], np.asarray(z.coords)[:int(z.num), 1:])
    np.testing.assert_allclose(yf[mine], np.asarray(z.feats)[:int(z.num)], rtol=1e-5, atol=1e-6)
    # Changing another item's features does not move this item's outputs.
    other = x.replace(feats=jnp.where((x.coords[:, 0] != item)[:, None], 7.0 * x.feats, x.feats))
    moved = np.asarray(run(other).feats)
    np.testing.assert_array_equal(moved[:int(y.num)][mine], same_program[mine])
    assert not np.array_equal(moved[:int(y.num)][~mine], same_program[~mine])  # the change reached the others


# Anisotropic and dilated: the isotropic 3/2/1/1 geometry on the Pallas path is checked by test_odhwi_layout (against
# the dense reference), test_groups_are_independent_convolutions and test_static_capacity_under_jit_and_overflow.
@pytest.mark.parametrize("ks,st_,pad,out_pad,dil", [((2, 4, 3), (3, 2, 1), (0, 1, 2), (2, 1, 0), 1), (3, 1, 0, 1, 2)])
def test_pallas_interpret_matches_xla(ks, st_, pad, out_pad, dil):
  rng = np.random.default_rng(14)
  x = random_sparse(rng, (5, 3, 4), 3, batch_size=2, density=0.3, pad=5)
  w, b = _weights(rng, ks, 3, 4)
  geo = dict(stride=st_, padding=pad, output_padding=out_pad, dilation=dil)
  maps = {impl: transpose_map(x, ks, out_capacity="exact", implementation=impl, **geo) for impl in ("xla", "pallas")}
  for a, b_ in zip(maps["xla"], maps["pallas"]):
    np.testing.assert_array_equal(a, b_)
  cap = int(maps["xla"][1])
  cot = jnp.asarray(rng.standard_normal((cap, 4)).astype(np.float32))

  def run(impl):
    def f(feats, w, b):
      y = sparse_conv_transpose3d(x.replace(feats=feats), w, b, out_capacity=cap, implementation=impl,
                                  precision="highest", **geo)
      return jnp.sum(y.feats * cot), y.feats
    (_, y), g = jax.jit(jax.value_and_grad(f, (0, 1, 2), has_aux=True))(x.feats, w, b)
    return (y,) + g

  for a, r in zip(run("pallas"), run("xla")):
    assert rel_err(a, r) < 1e-5


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_wide_grid_matches_numpy(implementation):
  # An output grid of 2 * 1401**3 > 2**31 sites: keys of two int32 words (the Pallas table holds proposal indices).
  rng = np.random.default_rng(15)
  shape = (700, 700, 700)
  corner = rng.integers(0, 3, (10, 3)) + np.array([[697, 0, 350]])
  coords = np.unique(np.concatenate([rng.integers(0, 2, (10, 1)), corner], 1).astype(np.int32), axis=0)
  x = jsparse.SparseTensor.from_coords(coords, rng.standard_normal((len(coords), 2)).astype(np.float32), shape, 2,
                                       capacity=len(coords) + 3)
  w, b = _weights(rng, 3, 2, 3)
  geom = transpose_geometry(shape, 3, 2, 1, 1)
  assert jsparse.key_width(2, geom.out_shape) == 2
  y = sparse_conv_transpose3d(x, w, b, stride=2, padding=1, output_padding=1, out_capacity="exact",
                              implementation=implementation, precision="highest")
  expected = _numpy_transpose(x, w, b, geom)
  sites = _sites(y)
  assert sites == sorted(expected)
  np.testing.assert_allclose(np.asarray(y.feats[:int(y.num)]), np.stack([expected[s] for s in sites]), rtol=1e-5,
                             atol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_static_capacity_under_jit_and_overflow(implementation):
  rng = np.random.default_rng(16)
  x = random_sparse(rng, (4, 4, 4), 2, batch_size=2, density=0.3, pad=3)
  w, b = _weights(rng, 3, 2, 2)
  kw = dict(stride=2, padding=1, output_padding=0, implementation=implementation, precision="highest")
  full = sparse_conv_transpose3d(x, w, b, out_capacity="exact", **kw)
  n = int(full.num)

  @jax.jit
  def run(x, w, b):
    return sparse_conv_transpose3d(x, w, b, out_capacity=n - 3, with_overflow=True, **kw)

  small, flag = run(x, w, b)
  assert bool(flag) and jsparse.overflowed(small) and int(small.num) == small.capacity == n - 3
  # The out_capacity smallest-keyed sites are kept, with their full values.
  np.testing.assert_array_equal(small.coords, full.coords[:n - 3])
  np.testing.assert_allclose(small.feats, full.feats[:n - 3], rtol=1e-6, atol=1e-6)
  roomy, flag = jax.jit(lambda x: sparse_conv_transpose3d(x, w, b, out_capacity=n + 5, with_overflow=True, **kw))(x)
  assert not bool(flag) and not jsparse.overflowed(roomy) and int(roomy.num) == n
  np.testing.assert_array_equal(roomy.coords[n:], -1)
  np.testing.assert_array_equal(roomy.feats[n:], 0)
  np.testing.assert_allclose(roomy.feats[:n], full.feats, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="out_capacity"):
    sparse_conv_transpose3d(x, w, b, out_capacity=n - 1, **kw)
  with pytest.raises(TypeError, match="out_capacity"):
    jax.jit(lambda x: sparse_conv_transpose3d(x, w, b, **kw))(x)


def test_generative_path_is_unchanged():
  # kernel == stride, padding 0: the children path (rows by parent and child), the same sites and values as
  # the dense reference of the general rule; any other argument takes the general path (rows by key).
  rng = np.random.default_rng(17)
  x = random_sparse(rng, (3, 4, 3), 2, batch_size=2, density=0.4, pad=2)
  w, b = _weights(rng, (2, 1, 3), 2, 3)
  y = _check_against_dense(x, w, b, stride=(2, 1, 3), padding=0, output_padding=0)
  c = np.asarray(x.coords)
  parents = np.asarray(y.coords[:, 1:]) // np.array([2, 1, 3])
  first_parent = [tuple(r) for r in c[:int(x.num)]][0]
  assert tuple(np.asarray(y.coords[0, :1]).tolist() + parents[0].tolist()) == first_parent
  assert y.caches == {}
  z = sparse_conv_transpose3d(x, w, b, stride=(2, 1, 3), output_padding=(1, 0, 0), out_capacity="exact",
                              precision="highest")
  keys = [tuple(r) for r in np.asarray(z.coords).tolist()]
  assert keys == sorted(keys) and set(keys) == set(_sites(y))
  order = {s: i for i, s in enumerate(_sites(y))}
  np.testing.assert_allclose(np.asarray(z.feats), np.asarray(y.feats)[[order[s] for s in keys]], rtol=1e-5,
                             atol=1e-6)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_generative_padding_rows_of_the_output_feed_no_gradient(implementation):
  """Generative upsampling with spare output rows (out_capacity past the kept children) and pruned children:
  the cotangent at the padding rows reaches neither gradient, so the values and gradients equal those of the
  exact capacity on the XLA path (checked against the dense reference by the tests above)."""
  rng = np.random.default_rng(23)
  x = random_sparse(rng, (3, 4, 3), 3, batch_size=2, density=0.4, pad=2)
  w, b = _weights(rng, (2, 1, 2), 3, 2)
  mask = jnp.asarray(rng.random((x.capacity, 4)) < 0.7)
  kw = dict(stride=(2, 1, 2), mask=mask, precision="highest")
  n = int(sparse_conv_transpose3d(x, w, b, out_capacity="exact", **kw).num)
  cot = jnp.asarray(rng.standard_normal((n + 6, 2)).astype(np.float32))

  def values_and_grads(capacity, impl):
    def loss(f, w, b):
      y = sparse_conv_transpose3d(x.replace(feats=f), w, b, out_capacity=capacity, implementation=impl, **kw)
      return jnp.sum(y.feats * cot[:capacity]), y.feats
    return jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(x.feats, w, b)

  (_, spare), grads = values_and_grads(n + 6, implementation)
  (_, exact), want = values_and_grads(n, "xla")
  np.testing.assert_array_equal(np.asarray(spare[n:]), 0)
  assert rel_err(spare[:n], exact) < 1e-6
  for name, g, r in zip(("features", "weight", "bias"), grads, want):
    assert rel_err(g, r) < 1e-5, name


def test_bad_arguments():
  rng = np.random.default_rng(18)
  x = random_sparse(rng, (4, 4, 4), 2, batch_size=1, density=0.4)
  w, _ = _weights(rng, 3, 2, 2)
  with pytest.raises(ValueError, match="output_padding"):
    sparse_conv_transpose3d(x, w, stride=2, output_padding=2)
  with pytest.raises(ValueError, match="output_padding"):
    sparse_conv_transpose3d(x, w, stride=1, output_padding=1)
  with pytest.raises(ValueError, match="output_padding"):
    sparse_conv_transpose3d(x, w, stride=(2, 2, 1), dilation=(1, 1, 2), output_padding=(1, 1, 2))
  with pytest.raises(ValueError, match="output_padding"):
    sparse_conv_transpose3d(x, w, stride=2, output_padding=-1)
  with pytest.raises(ValueError, match="padding"):
    sparse_conv_transpose3d(x, w, stride=2, padding=-1)
  with pytest.raises(ValueError, match="padding"):
    sparse_conv_transpose3d(x, _weights(rng, 1, 2, 2)[0], stride=1, padding=2)  # empty output grid
  with pytest.raises(ValueError, match="stride"):
    sparse_conv_transpose3d(x, w, stride=0)
  with pytest.raises(ValueError, match="dilation"):
    sparse_conv_transpose3d(x, w, stride=2, dilation=0)
  with pytest.raises(ValueError, match="mask"):
    sparse_conv_transpose3d(x, w, stride=2, mask=jnp.ones((x.capacity, 27), bool))
  with pytest.raises(ValueError, match="input channels"):
    sparse_conv_transpose3d(x, _weights(rng, 3, 3, 2)[0], stride=2)
  with pytest.raises(ValueError, match="output_padding"):
    snn.SparseConvTranspose3d(2, strides=2, kernel_size=3, output_padding=2).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="SparseConvTranspose3d: .*padding"):
    snnx.SparseConvTranspose3d(2, 2, 2, kernel_size=3, padding=-1, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="padding"):
    snnx.SparseConvTranspose3d(2, 2, 2, kernel_size=3, padding="SAME", rngs=nnx.Rngs(0))



@pytest.mark.parametrize("stride", [np.array(2), jnp.int32(2), np.array([2, 1, 3]), jnp.asarray([2, 1, 3])],
                         ids=["numpy_0d", "jax_0d", "numpy_3", "jax_3"])
def test_sizes_given_as_arrays(stride):
  """A stride held in a 0-d array (a config value read back through numpy or jax) is one int for every axis, as
  as_int takes it: it raised `TypeError: iteration over a 0-d array`, naming no argument."""
  rng = np.random.default_rng(19)
  x = random_sparse(rng, (3, 4, 2), 2, batch_size=2, density=0.4)
  st = tuple(np.broadcast_to(np.asarray(stride), (3,)).tolist())
  w, b = _weights(rng, st, 2, 3)
  y = sparse_conv_transpose3d(x, w, b, stride=stride, out_capacity="exact")
  want = sparse_conv_transpose3d(x, w, b, stride=st, out_capacity="exact")
  assert y.spatial_shape == want.spatial_shape and _sites(y) == _sites(want)
  np.testing.assert_array_equal(np.asarray(y.feats), np.asarray(want.feats))
  labels = jsparse.child_labels(x, y, stride)
  assert labels.shape == (x.capacity, int(np.prod(st))) and bool(labels[: int(x.num)].all())


@pytest.mark.parametrize("kernel_size,stride,padding,capacity,implementation", [
    (4, 4, 0, 2**25 + 8, "xla"), (4, 4, 0, 2**25 + 8, "pallas"),  # generative: capacity * 64 children
    ((2, 8, 8), (2, 8, 8), 0, 2**24 + 8, "xla"),
    (3, 2, 1, 2**27, "xla")])  # general: capacity * 27 proposals (the Pallas site search raised already)
def test_proposals_past_int32_raise_naming_the_capacity(kernel_size, stride, padding, capacity, implementation):
  # x.capacity * children (or kernel offsets) past 2**31 overflowed the flat int32 index of jnp.nonzero: JAX's
  # OverflowError about "an argument to a jitted computation", nothing about the op, at trace time. Traced
  # abstractly (eval_shape): no memory is allocated.
  ks = as_triple(kernel_size, "kernel_size")
  x = jsparse.SparseTensor(jax.ShapeDtypeStruct((capacity, 4), jnp.int32),
                           jax.ShapeDtypeStruct((capacity, 1), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32),
                           (256, 256, 256), 4)
  op = lambda x: sparse_conv_transpose3d(x, jnp.zeros(ks + (1, 1)), stride=stride, padding=padding,
                                         out_capacity=2**20, implementation=implementation)
  with pytest.raises(ValueError, match=f"capacity={capacity}"):
    jax.eval_shape(op, x)
  small = x.replace(coords=jax.ShapeDtypeStruct((2**20, 4), jnp.int32), feats=jax.ShapeDtypeStruct((2**20, 1),
                                                                                                     jnp.float32))
  assert jax.eval_shape(op, small).feats.shape == (2**20, 1)


def test_generative_out_capacity_past_int32_on_pallas_names_out_capacity():
  """Generative upsampling on the Pallas path builds a one-hot map [out_capacity, children] and its transpose: an
  out_capacity of 300M rows x 8 children (a batch of 2048^3 surfaces) failed in store_distinct, naming neither the
  op nor out_capacity. It raises naming them now; the XLA path has no such map and traces (eval_shape: nothing is
  allocated)."""
  x = jsparse.SparseTensor(jax.ShapeDtypeStruct((50_000_000, 4), jnp.int32),
                           jax.ShapeDtypeStruct((50_000_000, 1), jnp.float16), jax.ShapeDtypeStruct((), jnp.int32),
                           (1024, 1024, 1024), 8)
  op = lambda impl: lambda x: sparse_conv_transpose3d(x, jnp.zeros((2, 2, 2, 1, 1), jnp.float16), stride=2,
                                                      out_capacity=300_000_000, implementation=impl).feats
  with pytest.raises(ValueError, match="sparse_conv_transpose3d: out_capacity=300000000 rows x 8 children .*"
                                       "implementation='xla'"):
    jax.eval_shape(op("pallas"), x)
  assert jax.eval_shape(op("xla"), x).shape == (300_000_000, 1)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("kernel_size,padding", [(2, 0), (3, 1)], ids=["generative", "general"])
def test_non_finite_padding_rows_do_not_reach_the_gradients(kernel_size, padding, implementation):
  # x.replace(feats=jnp.log(x.feats)) leaves -inf in the padding rows. The generative XLA path multiplied every
  # row by the weight, so the weight gradient was 0 * inf = NaN there (the Pallas path and the general one read
  # only valid rows): values and gradients must be those of the clean tensor.
  rng = np.random.default_rng(19)
  x = random_sparse(rng, (3, 3, 3), 2, batch_size=2, density=0.4, pad=3)
  dirty = x.replace(feats=jnp.where(x.valid_mask()[:, None], x.feats, -jnp.inf))
  w, b = _weights(rng, kernel_size, 2, 3)
  kw = dict(stride=2, padding=padding, out_capacity=x.capacity * kernel_size ** 3, implementation=implementation,
            precision="highest")

  @jax.jit  # one program for both tensors (same shapes)
  def run(t):
    loss = lambda f, w, b: jnp.sum(jnp.sin(sparse_conv_transpose3d(t.replace(feats=f), w, b, **kw).feats))
    return jax.value_and_grad(loss, (0, 1, 2))(t.feats, w, b)

  (value, grads), (clean_value, clean_grads) = run(dirty), run(x)
  assert float(value) == pytest.approx(float(clean_value), rel=1e-6)
  for name, g, r in zip(("features", "weight", "bias"), grads, clean_grads):
    assert bool(jnp.all(jnp.isfinite(g))), name
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6, err_msg=name)

def _with_extra_row(x: jsparse.SparseTensor, row, feats_value=1.5) -> jsparse.SparseTensor:
  """x with one more valid row (at its first padding row), bypassing from_coords' checks as a direct build can."""
  n = int(x.num)
  return x.replace(coords=x.coords.at[n].set(jnp.asarray(row, jnp.int32)),
                   feats=x.feats.at[n].set(feats_value), num=x.num + 1)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("bad_row", [(2, 0, 1, 2), (0, 3, 1, 1), (1, 0, -1, 2)], ids=["batch", "x_past", "y_negative"])
def test_generative_rows_outside_the_grid_are_reported_and_spawn_nothing(bad_row, implementation):
  # A directly built tensor (batch_size 2, grid 3^3) with a valid row outside its grid silently spawned children
  # outside the output grid on both paths. Outside jit: ValueError. Under jit: the row spawns nothing (values and
  # gradients those of the tensor without it, the row's gradient zero), and inside error_checks() checkify says so.
  from jax.experimental import checkify
  rng = np.random.default_rng(23)
  x = random_sparse(rng, (3, 3, 3), 2, batch_size=2, density=0.4, pad=3)
  dirty = _with_extra_row(x, bad_row)
  w, b = _weights(rng, 2, 2, 3)
  kw = dict(stride=2, out_capacity=x.capacity * 8, implementation=implementation, precision="highest")
  with pytest.raises(ValueError, match="sparse_conv_transpose3d: x has 1 valid rows whose coordinates lie outside"):
    sparse_conv_transpose3d(dirty, w, b, **kw)

  def run(t):
    out = sparse_conv_transpose3d(t, w, b, **kw)
    loss = lambda f, w, b: jnp.sum(jnp.sin(sparse_conv_transpose3d(t.replace(feats=f), w, b, **kw).feats))
    return out, jax.value_and_grad(loss, (0, 1, 2))(t.feats, w, b)

  run = jax.jit(run)  # one program for both tensors (same shapes)
  (out, (value, grads)), (clean, (clean_value, clean_grads)) = run(dirty), run(x)
  assert int(out.num) == int(clean.num) == int(x.num) * 8
  np.testing.assert_array_equal(np.asarray(out.coords), np.asarray(clean.coords))
  np.testing.assert_allclose(np.asarray(out.feats), np.asarray(clean.feats), rtol=1e-6, atol=1e-6)
  assert float(value) == pytest.approx(float(clean_value), rel=1e-6)
  n = int(x.num)
  assert float(jnp.max(jnp.abs(grads[0][n]))) == 0.0  # the dropped row's gradient
  np.testing.assert_allclose(np.asarray(grads[0][:n]), np.asarray(clean_grads[0][:n]), rtol=1e-6, atol=1e-6)
  for name, g, r in zip(("weight", "bias"), grads[1:], clean_grads[1:]):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6, err_msg=name)
  with jsparse.error_checks():
    err, _ = jax.jit(checkify.checkify(lambda t: sparse_conv_transpose3d(t, w, b, **kw)))(dirty)
  assert "1 valid rows whose coordinates lie outside the grid" in (err.get() or "")


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_generative_repeated_sites_are_reported(implementation):
  # Two valid rows on one site spawned every child twice, silently. Concrete: ValueError; under jit, inside
  # error_checks(): checkify (the check is a sort, so it is traced only there).
  from jax.experimental import checkify
  rng = np.random.default_rng(29)
  x = random_sparse(rng, (3, 3, 3), 2, batch_size=2, density=0.4, pad=3)
  dirty = _with_extra_row(x, np.asarray(x.coords[0]))
  w, b = _weights(rng, 2, 2, 3)
  kw = dict(stride=2, out_capacity=x.capacity * 8, implementation=implementation)
  with pytest.raises(ValueError, match="sparse_conv_transpose3d: x has 1 valid rows that repeat"):
    sparse_conv_transpose3d(dirty, w, b, **kw)
  with jsparse.error_checks():
    err, _ = jax.jit(checkify.checkify(lambda t: sparse_conv_transpose3d(t, w, b, **kw)))(dirty)
  assert "1 valid rows that repeat" in (err.get() or "")
  sparse_conv_transpose3d(x, w, b, **kw)  # the clean tensor passes


# ---- the inverse relation to the strided convolution --------------------------------------------------------

# Each example compiles its own programs (~7 s on the CPU): no shrinking (minutes per failure), the failing example
# is printed; 4 random draws a run (each run draws others), besides the explicit examples and the saved failures.
INVERSE = settings(max_examples=4, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate))


@INVERSE
@example(seed=282, ks=1, stride=3, padding=1, dilation=1, implementation="xla")  # reads no site of x (CI, 11-28)
@given(seed=st.integers(0, 2**16), ks=st.sampled_from([1, 2, 3, 4, (3, 2, 4)]), stride=st.sampled_from([1, 2, 3]),
       padding=st.sampled_from([0, 1]), dilation=st.sampled_from([1, 2]),
       implementation=st.sampled_from(["xla", "pallas"]))
def test_transposed_map_inverts_the_strided_map(seed, ks, stride, padding, dilation, implementation):
  # y = sparse_conv3d(x) with some geometry; the transposed convolution of y with the same geometry (and the
  # output_padding that restores x's grid) reaches every site of x that the strided convolution reads (the
  # stride and the grid's border may skip some), and there its map is the strided convolution's map with
  # inputs and outputs swapped: nbr_T[row of site] = inv[x row]. Its values there are sparse_inverse_conv3d's.
  rng = np.random.default_rng(seed)
  x = random_sparse(rng, (7, 6, 8), 2, batch_size=2, density=0.2, pad=3)
  ks3, dil3 = as_triple(ks, "k"), as_triple(dilation, "d")
  if any(d * (k - 1) + 1 > n + 2 * padding for k, d, n in zip(ks3, dil3, x.spatial_shape)):
    return  # the dilated kernel does not fit: no strided convolution
  pm = pair_map(x, ks3, stride, padding, dilation, "exact", implementation=implementation)
  y = pm.output(jnp.asarray(rng.standard_normal((pm.out_capacity, 3)).astype(np.float32)), x)
  out_pad = tuple((n + 2 * padding - d * (k - 1) - 1) % stride for n, k, d in zip(x.spatial_shape, ks3, dil3))
  if any(q >= max(stride, d) for q, d in zip(out_pad, dil3)):
    return  # not a PyTorch-valid output_padding
  coords, num, nbr, inv, overflow = transpose_map(y, ks3, stride, padding, out_pad, dilation, "exact",
                                                  implementation=implementation)
  assert transpose_geometry(y.spatial_shape, ks3, stride, padding, out_pad, dilation).out_shape == x.spatial_shape
  row = {s: i for i, s in enumerate(tuple(r) for r in np.asarray(coords[:int(num)]).tolist())}
  x_sites = _sites(x)
  read = np.asarray(pm.inv)[:int(x.num)].max(1) >= 0
  assert not bool(overflow)
  assert {s for s, r in zip(x_sites, read) if r} == set(x_sites) & set(row)
  # A sparse input can have no site where the stride reads (1x1x1, stride 3: only x = 2 mod 3 on each axis):
  # nothing below would be checked, so such an example is discarded rather than failed.
  assume(read.any())
  rows = [row[s] for s, r in zip(x_sites, read) if r]
  np.testing.assert_array_equal(np.asarray(nbr)[rows], np.asarray(pm.inv)[:int(x.num)][read])
  # And the other way round: inv_T[y row, v] lands on x's site j exactly where the forward map has nbr[y row, v] = j.
  site_of_row = {i: s for s, i in row.items()}
  x_row = {s: j for j, s in enumerate(x_sites)}
  pm_nbr = np.asarray(pm.nbr)
  for i, v in zip(*np.nonzero(np.asarray(inv)[:int(y.num)] >= 0)):
    assert pm_nbr[i, v] == x_row.get(site_of_row[int(np.asarray(inv)[i, v])], -1)
  w, b = _weights(rng, ks3, 3, 2)
  t = sparse_conv_transpose3d(y, w, b, stride=stride, padding=padding, output_padding=out_pad, dilation=dilation,
                              out_capacity="exact", precision="highest")
  back = sparse_inverse_conv3d(y, w, b, like=x, stride=stride, padding=padding, dilation=dilation,
                               precision="highest")
  t_rows = {s: i for i, s in enumerate(_sites(t))}
  np.testing.assert_allclose(np.asarray(t.feats)[[t_rows[s] for s, r in zip(x_sites, read) if r]],
                             np.asarray(back.feats[:int(x.num)])[read], rtol=1e-5, atol=1e-5)


# ---- modules -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["DHWIO", "ODHWI"])
def test_modules_match_the_op(layout):
  rng = np.random.default_rng(19)
  x = random_sparse(rng, (4, 5, 3), 3, batch_size=2, density=0.3, pad=2)
  geo = dict(kernel_size=(3, 2, 3), padding=(1, 0, 1), output_padding=(1, 0, 0), kernel_dilation=(1, 1, 2))
  cap = int(sparse_conv_transpose3d(x, jnp.zeros((3, 2, 3, 3, 4)), stride=(2, 1, 2), padding=(1, 0, 1),
                                    output_padding=(1, 0, 0), dilation=(1, 1, 2), out_capacity="exact").num)
  linen = snn.SparseConvTranspose3d(4, (2, 1, 2), cap, kernel_layout=layout, precision="highest", **geo)
  variables = linen.init(jax.random.key(0), x)
  kernel, bias = variables["params"]["kernel"], variables["params"]["bias"]
  assert kernel.shape == ((4, 3, 2, 3, 3) if layout == "ODHWI" else (3, 2, 3, 3, 4))
  y = jax.jit(linen.apply)(variables, x)
  ref = sparse_conv_transpose3d(x, kernel, bias, stride=(2, 1, 2), padding=(1, 0, 1), output_padding=(1, 0, 0),
                                dilation=(1, 1, 2), out_capacity=cap, precision="highest", weight_layout=layout)
  np.testing.assert_array_equal(y.coords, ref.coords)
  assert y.spatial_shape == ref.spatial_shape and rel_err(y.feats, ref.feats) < 1e-6
  model = snnx.SparseConvTranspose3d(3, 4, (2, 1, 2), out_capacity=cap, kernel_layout=layout, precision="highest",
                                     rngs=nnx.Rngs(1), **geo)
  nnx.update(model, snnx.linen_to_nnx(variables, model))
  z = model(x)
  np.testing.assert_array_equal(z.coords, ref.coords)
  assert rel_err(z.feats, ref.feats) < 1e-6
  # The default kernel_size is the stride: the generative form, with its mask.
  gen = snn.SparseConvTranspose3d(4, 2, out_capacity=int(x.num) * 8)
  gv = gen.init(jax.random.key(2), x)
  assert gv["params"]["kernel"].shape == (2, 2, 2, 3, 4)
  mask = jnp.asarray(rng.random((x.capacity, 8)) < 0.5)
  masked = gen.apply(gv, x, mask=mask)
  assert int(masked.num) == int(np.sum(np.asarray(mask)[:int(x.num)]))


def test_module_defaults_agree():
  # The nnx constructor takes the linen fields' defaults (kernel_size None: the stride, the generative form).
  import dataclasses
  import inspect
  fields = {f.name: f.default for f in dataclasses.fields(snn.SparseConvTranspose3d)}
  params = inspect.signature(snnx.SparseConvTranspose3d.__init__).parameters
  for name in ("strides", "kernel_size", "padding", "output_padding", "kernel_dilation", "out_capacity",
               "use_bias", "precision", "implementation", "kernel_layout"):
    assert params[name].default == fields[name], name
  assert fields["kernel_size"] is None and fields["strides"] == 2


@pytest.mark.parametrize("ndim", [2, 1])
def test_lower_ranks_match_lax(ndim):
  # sparse_conv_transpose2d / 1d and their modules take the general arguments too (the 3D op of depth 1).
  rng = np.random.default_rng(21)
  shape = (6, 5)[:ndim]
  mask = rng.random((2,) + shape) < 0.35
  coords = np.argwhere(mask).astype(np.int32)
  x = jsparse.SparseTensor.from_coords(coords, rng.standard_normal((len(coords), 3)).astype(np.float32), shape, 2,
                                       capacity=len(coords) + 3)
  ks, st_, pad, out_pad, dil = ((3, 2), (2, 3), (1, 0), (1, 2), (1, 1))
  ks, st_, pad, out_pad, dil = (t[:ndim] for t in (ks, st_, pad, out_pad, dil))
  w, b = _weights(rng, ks + (1,) * (3 - ndim), 3, 4)
  w = w.reshape(ks + (3, 4))
  op = jsparse.sparse_conv_transpose2d if ndim == 2 else jsparse.sparse_conv_transpose1d
  y = op(x, w, b, stride=st_, padding=pad, output_padding=out_pad, dilation=dil, out_capacity="exact",
         precision="highest")
  assert y.spatial_ndim == ndim
  dn = ("NHWC", "HWIO", "NHWC") if ndim == 2 else ("NWC", "WIO", "NWC")
  lax_pad = [(d * (k - 1) - p, d * (k - 1) - p + q) for k, p, q, d in zip(ks, pad, out_pad, dil)]
  dense = lax.conv_transpose(x.todense(), w[(slice(None, None, -1),) * ndim], st_, lax_pad, rhs_dilation=dil,
                             dimension_numbers=dn, precision=HI) + b
  assert dense.shape[:-1] == y.dense_shape[:-1]
  c = np.asarray(y.coords[:int(y.num)])
  reached = np.argwhere(np.asarray(lax.conv_transpose(
      (jnp.abs(x.todense()).sum(-1, keepdims=True) > 0).astype(jnp.float32), jnp.ones(ks + (1, 1)), st_, lax_pad,
      rhs_dilation=dil, dimension_numbers=dn))[..., 0] > 0.5)
  lifted = np.concatenate([reached[:, :1], np.zeros((len(reached), 3 - ndim), np.int64), reached[:, 1:]], 1)
  assert {tuple(r) for r in c.tolist()} == {tuple(r) for r in lifted.tolist()}
  at = tuple(c[:, a] for a in [0] + list(range(4 - ndim, 4)))
  assert rel_err(y.feats[:int(y.num)], dense[at]) < 1e-5
  module = (snn.SparseConvTranspose2d if ndim == 2 else snn.SparseConvTranspose1d)(
      4, st_, y.capacity, kernel_size=ks, padding=pad, output_padding=out_pad, precision="highest")
  variables = {"params": {"kernel": w, "bias": b}}
  z = module.apply(variables, x)
  np.testing.assert_array_equal(z.coords, y.coords)
  assert rel_err(z.feats, y.feats) < 1e-6


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_groups_are_independent_convolutions(implementation):
  # feature_group_count=2 on the general path equals the two groups' own transposed convolutions side by side.
  rng = np.random.default_rng(22)
  x = random_sparse(rng, (4, 3, 4), 4, batch_size=1, density=0.4, pad=2)
  w, b = _weights(rng, 3, 2, 6)
  kw = dict(stride=2, padding=1, output_padding=1, precision="highest", implementation=implementation)
  y = sparse_conv_transpose3d(x, w, b, out_capacity="exact", feature_group_count=2, **kw)
  parts = [sparse_conv_transpose3d(x.replace(feats=x.feats[:, 2 * g:2 * g + 2]), w[..., 3 * g:3 * g + 3],
                                   b[3 * g:3 * g + 3], out_capacity=y.capacity, **kw) for g in range(2)]
  np.testing.assert_array_equal(parts[0].coords, y.coords)
  assert rel_err(y.feats, jnp.concatenate([p.feats for p in parts], 1)) < 1e-6


# ---- GPU ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
@pytest.mark.parametrize("ks,st_,pad,out_pad",
                         [(3, 2, 1, 1), (4, 3, 1, 2), ((3, 2, 5), (2, 1, 2), (1, 0, 2), (1, 0, 0))])
def test_gpu_pallas_matches_xla(dtype, ks, st_, pad, out_pad):
  rng = np.random.default_rng(20)
  x = random_sparse(rng, (40, 36, 30), 32, batch_size=2, density=0.05, pad=17, dtype=np.dtype(dtype))
  w, b = _weights(rng, ks, 32, 48, np.dtype(dtype))
  geo = dict(stride=st_, padding=pad, output_padding=out_pad)
  maps = {impl: transpose_map(x, ks, out_capacity="exact", implementation=impl, **geo) for impl in ("xla", "pallas")}
  for a, r in zip(maps["xla"], maps["pallas"]):
    np.testing.assert_array_equal(a, r)
  cap = int(maps["xla"][1])
  cot = jnp.asarray(rng.standard_normal((cap, 48)).astype(np.float32))

  def run(impl):
    def f(feats, w, b):
      y = sparse_conv_transpose3d(x.replace(feats=feats), w, b, out_capacity=cap, implementation=impl,
                                  precision="highest", **geo)
      return jnp.sum(y.feats.astype(jnp.float32) * cot), y.feats
    (_, y), g = jax.jit(jax.value_and_grad(f, (0, 1, 2), has_aux=True))(x.feats, w, b)
    return (y,) + g

  tol = 1e-4 if dtype == jnp.float32 else 2e-2
  for name, a, r in zip(("values", "features", "weight", "bias"), run("pallas"), run("xla")):
    assert rel_err(a, r) < tol, name
