"""Empty tensors and empty outputs: every op gives zeros of the right shapes, and zero gradients, on both paths.

Three kinds of nothing: capacity 0 (no rows at all), num 0 (only padding rows) and out_capacity 0 (rows in,
none out; with sites present that is an overflow, so under jit).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse

IMPLEMENTATIONS = ["xla", "pallas"]
CIN, COUT = 3, 4
SHAPE = (4, 4, 4)


def _tensor(capacity, num, channels=CIN):
  coords = np.array([[0, 1, 1, 1], [0, 1, 1, 2], [0, 2, 1, 2]], np.int32)[:num]
  feats = np.arange(num * channels, dtype=np.float32).reshape(num, channels) / 7 + 1
  return jsparse.SparseTensor.from_coords(coords, feats, SHAPE, batch_size=1, capacity=capacity)


def _params(kernel_size, cin=CIN, cout=COUT):
  w = jnp.linspace(-1, 1, int(np.prod(kernel_size)) * cin * cout).reshape(tuple(kernel_size) + (cin, cout))
  return w, jnp.linspace(0.5, 1.5, cout)


def _ops(impl, out_capacity="exact"):
  """name -> (fn(x, w, b) -> SparseTensor, kernel size). `out_capacity` applies where the op takes one ("exact":
  as many rows as output sites, here none)."""
  def subm(x, w, b):
    return jsparse.submconv3d(x, w, b, implementation=impl)

  def conv(x, w, b):
    return jsparse.sparse_conv3d(x, w, b, stride=2, out_capacity=out_capacity, implementation=impl,
                                 with_overflow=True)[0]

  def inverse(x, w, b):
    y = jsparse.sparse_conv3d(x, w, None, stride=2, out_capacity=out_capacity, implementation=impl,
                              with_overflow=True)[0]
    w_back = jnp.full((2, 2, 2, COUT, COUT), 0.1)  # w is trained through the strided conv, b through this one
    return jsparse.sparse_inverse_conv3d(y, w_back, b, like=x, stride=2, implementation=impl)

  def transpose(x, w, b):
    return jsparse.sparse_conv_transpose3d(x, w, b, stride=2, out_capacity=out_capacity, implementation=impl,
                                           with_overflow=True)[0]

  return {"submconv3d": (subm, (3, 3, 3)), "sparse_conv3d": (conv, (2, 2, 2)),
          "sparse_inverse_conv3d": (inverse, (2, 2, 2)), "sparse_conv_transpose3d": (transpose, (2, 2, 2))}


def _check_value_and_grads(fn, x, w, b, out_rows, jit=False):
  """fn's output has out_rows rows of zeros; its gradients in feats, weight and bias are zeros of their shapes."""
  def loss(feats, w, b):
    y = fn(x.replace(feats=feats), w, b)
    return jnp.sum(y.feats ** 2 + y.feats), y

  grad_fn = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
  if jit:
    grad_fn = jax.jit(grad_fn)
  (value, y), (d_feats, d_w, d_b) = grad_fn(x.feats, w, b)
  assert y.feats.shape == (out_rows, COUT) and y.feats.dtype == x.dtype
  assert y.coords.shape == (out_rows, 4)
  assert int(y.num) == 0
  np.testing.assert_array_equal(np.asarray(y.feats), 0)
  assert float(value) == 0
  for grad, ref in ((d_feats, x.feats), (d_w, w), (d_b, b)):
    assert grad.shape == ref.shape
    np.testing.assert_array_equal(np.asarray(grad), 0)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("op", ["submconv3d", "sparse_conv3d", "sparse_inverse_conv3d", "sparse_conv_transpose3d"])
def test_capacity_zero(impl, op):
  fn, ks = _ops(impl)[op]
  w, b = _params(ks)
  _check_value_and_grads(fn, _tensor(0, 0), w, b, out_rows=0)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("op", ["submconv3d", "sparse_conv3d", "sparse_inverse_conv3d", "sparse_conv_transpose3d"])
def test_num_zero(impl, op):
  """Only padding rows: the sites are counted as none; submanifold and inverse outputs keep the capacity."""
  fn, ks = _ops(impl)[op]
  w, b = _params(ks)
  x = _tensor(5, 0)
  out_rows = {"submconv3d": 5, "sparse_inverse_conv3d": 5}.get(op, 0)
  _check_value_and_grads(fn, x, w, b, out_rows)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("op", ["sparse_conv3d", "sparse_inverse_conv3d", "sparse_conv_transpose3d"])
def test_out_capacity_zero_with_sites(impl, op):
  """Sites in, no rows out (an overflow, so under jit): zeros, and no gradient reaches the inputs."""
  fn, ks = _ops(impl, out_capacity=0)[op]
  w, b = _params(ks)
  x = _tensor(5, 3)
  if op == "sparse_inverse_conv3d":
    # The inverse lands back on x's rows, but from an empty y: bias only at x's valid rows.
    def loss(feats, w, b):
      return jnp.sum(fn(x.replace(feats=feats), w, b).feats)

    out = jax.jit(fn)(x, w, b)
    np.testing.assert_allclose(np.asarray(out.feats[:3]), np.broadcast_to(np.asarray(b), (3, COUT)), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.feats[3:]), 0)
    d_feats, d_w, d_b = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x.feats, w, b)
    np.testing.assert_array_equal(np.asarray(d_feats), 0)
    np.testing.assert_array_equal(np.asarray(d_w), 0)
    np.testing.assert_allclose(np.asarray(d_b), 3.0)
    return
  _check_value_and_grads(fn, x, w, b, out_rows=0, jit=True)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_out_capacity_zero_without_sites_outside_jit(impl):
  """With no sites an out_capacity of 0 is no overflow, so it also works eagerly."""
  w, b = _params((2, 2, 2))
  x = _tensor(5, 0)
  y = jsparse.sparse_conv3d(x, w, b, stride=2, out_capacity=0, implementation=impl)
  assert y.feats.shape == (0, COUT)
  y = jsparse.sparse_conv_transpose3d(x, w, b, stride=2, out_capacity=0, implementation=impl)
  assert y.feats.shape == (0, COUT)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("capacity", [0, 5])
def test_maps_pools_and_reductions_of_an_empty_tensor(impl, capacity):
  x = _tensor(capacity, 0)
  cache = jsparse.neighbor_map(x, 3, implementation=impl)
  assert cache.nbr.shape == (capacity, 27)
  np.testing.assert_array_equal(np.asarray(cache.nbr), -1)
  pm = jsparse.sparse_conv.pair_map(x, 2, 2, out_capacity="exact", implementation=impl)
  assert pm.nbr.shape == (0, 8) and pm.inv.shape == (capacity, 8) and int(pm.out_num) == 0
  for pool in (jsparse.sparse_max_pool3d, jsparse.sparse_avg_pool3d):
    y = pool(x, 2, out_capacity="exact", implementation=impl)
    assert y.feats.shape == (0, CIN) and int(y.num) == 0
    y = pool(x, 2, implementation=impl)  # the default bucket: padding rows only
    assert y.feats.shape == (jsparse.round_capacity(0), CIN) and int(y.num) == 0
    np.testing.assert_array_equal(np.asarray(y.feats), 0)
  for reduce in ("mean", "max", "sum"):
    np.testing.assert_array_equal(np.asarray(jsparse.global_pool(x, reduce)), np.zeros((1, CIN)))


_ALGORITHMS = ["implicit", "masked", "implicit_splitk", "masked_splitk", "explicit"]
# Capacity 0 (cheap: no kernel has rows to run on) with every algorithm in both layouts; capacity 5 (padding rows
# only: the kernels run) with every algorithm once, the layouts alternating, so every algorithm and every layout
# still meets both capacities (15 cases, not the full product's 20).
_ALGORITHM_CASES = ([(algorithm, layout, 0) for algorithm in _ALGORITHMS for layout in ["DHWIO", "ODHWI"]]
                    + [(algorithm, ["DHWIO", "ODHWI"][i % 2], 5) for i, algorithm in enumerate(_ALGORITHMS)])


@pytest.mark.parametrize("algorithm,weight_layout,capacity", _ALGORITHM_CASES)
def test_pallas_algorithms_and_layouts_on_empty_tensors(algorithm, weight_layout, capacity):
  w, b = _params((3, 3, 3))
  if weight_layout == "ODHWI":
    w = jnp.moveaxis(w, -1, 0)

  def subm(x, w, b):
    return jsparse.submconv3d(x, w, b, implementation="pallas", algorithm=algorithm, weight_layout=weight_layout)

  def loss(feats, w, b):
    y = subm(x.replace(feats=feats), w, b).feats
    return jnp.sum(y ** 2), y

  x = _tensor(capacity, 0)
  # Output and gradients from one jitted program (eagerly, every primitive compiled as its own program).
  (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x.feats, w, b)
  assert y.shape == (capacity, COUT)
  for grad, ref in zip(grads, (x.feats, w, b)):
    assert grad.shape == ref.shape
    np.testing.assert_array_equal(np.asarray(grad), 0)


def test_kernels_direct_on_empty_operands():
  """The kernel wrappers themselves: no rows out, no rows in, no channels."""
  from pallas_kernels.gather_gemm import gather_gemm
  from pallas_kernels.weight_grad import weight_grad

  bias = jnp.arange(4.0)
  out = gather_gemm(jnp.zeros((0, 3)), jnp.ones((27, 3, 4)), jnp.full((5, 27), -1, jnp.int32), jnp.int32(2), bias,
                    interpret=True)
  np.testing.assert_array_equal(np.asarray(out), [[0, 1, 2, 3]] * 2 + [[0] * 4] * 3)
  assert gather_gemm(jnp.ones((5, 3)), jnp.ones((27, 3, 4)), jnp.zeros((0, 27), jnp.int32), jnp.int32(0),
                     interpret=True).shape == (0, 4)
  assert weight_grad(jnp.zeros((0, 3)), jnp.zeros((0, 4)), jnp.zeros((0, 27), jnp.int32), interpret=True,
                     weight_layout="ODHWI").shape == (4, 27, 3)
  np.testing.assert_array_equal(
      np.asarray(weight_grad(jnp.ones((5, 0)), jnp.ones((5, 4)), jnp.zeros((5, 27), jnp.int32), interpret=True)),
      np.zeros((27, 0, 4)))


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("op", ["submconv3d", "sparse_conv_transpose3d"])
def test_capacity_zero_grouped(op, impl):
  # Grouped weights on no rows: every reshape must name its sizes (a -1 next to a zero extent is ambiguous).
  groups = 2
  ks = (3, 3, 3) if op == "submconv3d" else (2, 2, 2)
  w, b = _params(ks, cin=2, cout=4)

  def fn(x, w, b):
    if op == "submconv3d":
      return jsparse.submconv3d(x, w, b, implementation=impl, feature_group_count=groups)
    return jsparse.sparse_conv_transpose3d(x, w, b, stride=2, out_capacity="exact", implementation=impl,
                                           feature_group_count=groups)

  _check_value_and_grads(fn, _tensor(0, 0, channels=4), w, b, out_rows=0)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("out_capacity", [None, 8])
def test_capacity_zero_into_more_output_rows(impl, out_capacity):
  """A capacity-0 input (from_coords(..., capacity="exact") of no sites) into ops whose output has rows: the
  generative transposed convolution (default bucket of 128 rows, or 8) and union / add gathered from the empty
  arrays and failed with JAX's 'Slice size at index 0 in gather op is out of range'."""
  x = _tensor(0, 0)
  w, b = _params((2, 2, 2))
  fn = _ops(impl, out_capacity=out_capacity)["sparse_conv_transpose3d"][0]
  rows = jsparse.round_capacity(0) if out_capacity is None else out_capacity
  _check_value_and_grads(fn, x, w, b, out_rows=rows)
  mask = jnp.zeros((0, 8), bool)
  y = jsparse.sparse_conv_transpose3d(x, w, b, stride=2, mask=mask, out_capacity=out_capacity, implementation=impl)
  assert y.feats.shape == (rows, COUT) and int(y.num) == 0
  other = _tensor(5, 2)
  for a, c in ((x, x), (x, other), (other, x)):
    for op in (jsparse.add, jsparse.multiply):
      out = op(a, c, capacity=out_capacity)
      assert out.feats.shape == (rows, CIN) and int(out.num) == int(a.num) + int(c.num) - (a is c) * int(a.num)
    a_u, c_u = jsparse.union(a, c, capacity=out_capacity)
    dense = np.asarray(a.todense()) + np.asarray(c.todense())
    np.testing.assert_array_equal(np.asarray(jsparse.add(a, c, capacity=out_capacity).todense()), dense)
    grads = jax.grad(lambda fa, fc: jnp.sum(jsparse.add(a.replace(feats=fa), c.replace(feats=fc),
                                                         capacity=out_capacity).feats ** 2), argnums=(0, 1))(
                                                             a.feats, c.feats)
    for grad, t in zip(grads, (a, c)):  # one of the two is empty: the sum's gradient is 2 * the other's feats
      np.testing.assert_array_equal(np.asarray(grad), 2 * np.asarray(t.feats))
  y = jsparse.select(x, jnp.zeros((0,), bool), capacity=out_capacity)  # also gathered from the empty coords
  assert y.coords.shape == (rows if out_capacity else 0, 4) and int(y.num) == 0
  np.testing.assert_array_equal(np.asarray(y.coords), -1)
