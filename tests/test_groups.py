"""Grouped and depthwise convolutions (feature_group_count) against lax.conv_general_dilated(...,
feature_group_count=G) on the dense tensor: submanifold, strided, inverse and transposed convolutions, values and
gradients, both weight layouts, half precision; the Pallas kernels (interpret mode) against the XLA path; their
Triton lowering; the linen and nnx modules."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import jsparse
from jsparse import pass_config
from jsparse.pass_config import Depthwise, Masked, ShapeKey
from pallas_kernels import depthwise
from pallas_kernels.gather_gemm import conv_forward, conv_input_grad
from pallas_kernels.tiling import TileConfig
from pallas_kernels.weight_grad import weight_grad
from reference import random_sparse, rel_err
from triton_lowering import lower_for_cuda

DN = ("NDHWC", "DHWIO", "NDHWC")
HI = lax.Precision.HIGHEST
# Relative error allowed per dtype: float32 products are exact up to summation order; half precision rounds
# the output (and, for gradients, the cotangent) to 11 or 8 mantissa bits.
TOL = {jnp.float32: 2e-5, jnp.float16: 4e-3, jnp.bfloat16: 3e-2}
# (input channels, output channels, feature_group_count); "depthwise" rows have G = Cin.
GROUPINGS = [(6, 9, 1), (8, 12, 2), (8, 8, 4), (6, 12, 6), (5, 5, 5)]
GROUP_IDS = ["g1", "g2", "g4", "depthwise_x2", "depthwise"]
# The strided and inverse cases take both layouts in turn over the groupings, and each one geometry of STRIDED in
# turn (shifted by one between the two tests): the grouping acts on the GEMM and the geometry on the map, so every
# grouping, layout and geometry (each geometry with two groupings, depthwise among them) still meets both maps.
GROUPINGS_LAYOUTS = [(g, i, layout) for g, i, layout in
                     zip(GROUPINGS, GROUP_IDS, ["DHWIO", "ODHWI", "DHWIO", "ODHWI", "ODHWI"])] + [
                         ((8, 8, 8), "depthwise", "DHWIO")]


def _groupings_layouts_geometries(shift):
  return [pytest.param(g, layout, k, id=f"{i}-{layout}-geom{k}")
          for k, (g, i, layout) in ((n % 3, row) for n, row in enumerate(GROUPINGS_LAYOUTS, shift))]


def _weight(rng, kernel_size, cin, cout, groups, dtype=np.float32):
  fan_in = np.prod(kernel_size) * cin // groups
  w = rng.standard_normal(tuple(kernel_size) + (cin // groups, cout)) / np.sqrt(fan_in)
  return jnp.asarray(w.astype(dtype)), jnp.asarray(rng.standard_normal(cout).astype(dtype))


def _odhwi(w):
  return jnp.moveaxis(w, -1, 0)


def _at(dense, t: jsparse.SparseTensor):
  """dense [B, X, Y, Z, C] read at t's valid sites, zeros at padding rows."""
  valid = t.valid_mask()
  c = jnp.where(valid[:, None], t.coords, 0)
  return jnp.where(valid[:, None], dense[c[:, 0], c[:, 1], c[:, 2], c[:, 3]], 0)


def _dense_conv(dense, w, groups, stride=1, padding="SAME", dilation=1):
  pad = padding if isinstance(padding, str) else [(padding, padding)] * 3
  return lax.conv_general_dilated(dense.astype(jnp.float32), w.astype(jnp.float32), (stride,) * 3, pad,
                                  rhs_dilation=(dilation,) * 3, dimension_numbers=DN, precision=HI,
                                  feature_group_count=groups)


def _group_transposed(w, groups):
  """(K.., Cin/G, Cout) -> (K.., Cout/G, Cin): every group's [Cin/G, Cout/G] block transposed, so that the
  grouped convolution with it is the adjoint (per group) of the one with w."""
  *ks, cin_g, cout = w.shape
  blocks = w.reshape(*ks, cin_g, groups, cout // groups)
  return jnp.swapaxes(blocks, -3, -1).reshape(*ks, cout // groups, groups * cin_g)


def _check_values_and_grads(sparse_fn, dense_fn, args, cot, tol):
  """Values and gradients (w.r.t. every arg) of sparse_fn against dense_fn. Each side's values come out of its
  jitted gradient program (as aux): one compilation, where calling the function eagerly first compiled every
  primitive of it separately (the modules test below runs the grouped ops eagerly)."""
  argnums = tuple(range(len(args)))

  def values_and_grads(f):
    def loss(*a):
      y = f(*a)
      return jnp.sum(y.astype(jnp.float32) * cot), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(*args)
    return y, grads

  out, got = values_and_grads(sparse_fn)
  want, ref = values_and_grads(dense_fn)
  assert out.dtype == args[0].dtype
  assert rel_err(out, want) < tol, rel_err(out, want)
  for name, a, r in zip(("input", "weight", "bias"), got, ref):
    assert a.shape == r.shape and a.dtype == r.dtype, name
    assert rel_err(a, r) < tol, (name, rel_err(a, r))


# ---- the XLA path against the dense convolution ------------------------------------------------------------


# Both layouts in turn over the groupings (as the strided cases): the layout only changes how the weight is read,
# which no grouping changes, and each layout still meets both a grouped and a depthwise convolution.
@pytest.mark.parametrize("grouping, layout", [pytest.param(g, layout, id=f"{i}-{layout}")
                                              for g, i, layout in GROUPINGS_LAYOUTS])
def test_submconv_matches_dense_grouped_conv(grouping, layout):
  cin, cout, groups = grouping
  rng = np.random.default_rng(cin * 100 + groups)
  x = random_sparse(rng, (6, 5, 7), cin, batch_size=2, density=0.3)
  w, b = _weight(rng, (3, 3, 3), cin, cout, groups)
  cot = jnp.asarray(rng.standard_normal((x.capacity, cout)).astype(np.float32))

  def sparse_fn(f, w, b):
    weight = w if layout == "DHWIO" else _odhwi(w)
    return jsparse.submconv3d(x.replace(feats=f), weight, b, implementation="xla", precision="highest",
                              weight_layout=layout, feature_group_count=groups).feats

  def dense_fn(f, w, b):
    return _at(_dense_conv(x.replace(feats=f).todense(), w, groups) + b, x).astype(f.dtype)

  _check_values_and_grads(sparse_fn, dense_fn, (x.feats, w, b), cot, TOL[jnp.float32])


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("grouping", [(8, 12, 2), (6, 12, 6)], ids=["g2", "depthwise_x2"])
def test_submconv_half_precision(grouping, dtype):
  cin, cout, groups = grouping
  rng = np.random.default_rng(7)
  x = random_sparse(rng, (6, 6, 5), cin, batch_size=2, density=0.3, dtype=np.float32)
  x = x.replace(feats=x.feats.astype(dtype))
  w, b = _weight(rng, (3, 3, 3), cin, cout, groups)
  w, b = w.astype(dtype), b.astype(dtype)
  cot = jnp.asarray(rng.standard_normal((x.capacity, cout)).astype(np.float32))

  def sparse_fn(f, w, b):
    return jsparse.submconv3d(x.replace(feats=f), w, b, implementation="xla", feature_group_count=groups).feats

  def dense_fn(f, w, b):
    return _at(_dense_conv(x.replace(feats=f).todense(), w, groups) + b.astype(jnp.float32), x).astype(dtype)

  _check_values_and_grads(sparse_fn, dense_fn, (x.feats, w, b), cot, TOL[dtype])


STRIDED = [((7, 6, 5), (3, 3, 3), 2, 1, 1), ((8, 6, 6), (2, 2, 2), 2, 0, 1), ((7, 7, 5), (3, 3, 3), 1, 0, 2)]


@pytest.mark.parametrize("grouping, layout, geometry", _groupings_layouts_geometries(0))
def test_strided_conv_matches_dense_grouped_conv(grouping, layout, geometry):
  cin, cout, groups = grouping
  rng = np.random.default_rng(cin * 10 + groups)
  for shape, ks, stride, pad, dil in STRIDED[geometry:geometry + 1]:
    x = random_sparse(rng, shape, cin, batch_size=2, density=0.25)
    w, b = _weight(rng, ks, cin, cout, groups)
    y = jsparse.sparse_conv3d(x, w, stride=stride, padding=pad, dilation=dil, feature_group_count=groups)
    cot = jnp.asarray(rng.standard_normal((y.capacity, cout)).astype(np.float32))

    def sparse_fn(f, w, b):
      weight = w if layout == "DHWIO" else _odhwi(w)
      return jsparse.sparse_conv3d(x.replace(feats=f), weight, b, stride=stride, padding=pad, dilation=dil,
                                   out_capacity=y.capacity, implementation="xla", precision="highest",
                                   weight_layout=layout, feature_group_count=groups).feats

    def dense_fn(f, w, b):
      return _at(_dense_conv(x.replace(feats=f).todense(), w, groups, stride, pad, dil) + b, y)

    _check_values_and_grads(sparse_fn, dense_fn, (x.feats, w, b), cot, TOL[jnp.float32])


@pytest.mark.parametrize("grouping, layout, geometry", _groupings_layouts_geometries(1))
def test_inverse_conv_matches_dense_grouped_transpose(grouping, layout, geometry):
  """The inverse convolution with grouped weight w is the adjoint of the dense grouped convolution whose
  weight holds each group's block of w transposed."""
  c_y, cout, groups = grouping
  rng = np.random.default_rng(c_y + 31 * groups)
  for shape, ks, stride, pad, dil in STRIDED[geometry:geometry + 1]:
    x = random_sparse(rng, shape, 3, batch_size=2, density=0.25)
    y = jsparse.sparse_conv3d(x, jnp.ones(ks + (3, c_y)), stride=stride, padding=pad, dilation=dil)
    y = y.replace(feats=jnp.asarray(rng.standard_normal(y.feats.shape).astype(np.float32)) * y.valid_mask()[:, None])
    w, b = _weight(rng, ks, c_y, cout, groups)
    cot = jnp.asarray(rng.standard_normal((x.capacity, cout)).astype(np.float32))

    def sparse_fn(fy, w, b):
      weight = w if layout == "DHWIO" else _odhwi(w)
      return jsparse.sparse_inverse_conv3d(y.replace(feats=fy), weight, b, like=x, stride=stride, padding=pad,
                                           dilation=dil, implementation="xla", precision="highest",
                                           weight_layout=layout, feature_group_count=groups).feats

    def dense_fn(fy, w, b):
      zeros = jnp.zeros(x.todense().shape[:-1] + (cout,))
      _, vjp = jax.vjp(lambda d: _dense_conv(d, _group_transposed(w, groups), groups, stride, pad, dil), zeros)
      return _at(vjp(y.replace(feats=fy).todense())[0] + b, x)

    _check_values_and_grads(sparse_fn, dense_fn, (y.feats, w, b), cot, TOL[jnp.float32])


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("grouping", [(8, 12, 2), (6, 6, 6)], ids=["g2", "depthwise"])
def test_conv_transpose_matches_dense_grouped_transpose(grouping, implementation):
  cin, cout, groups = grouping
  rng = np.random.default_rng(5)
  x = random_sparse(rng, (4, 5, 3), cin, batch_size=2, density=0.3)
  st = (2, 2, 2)
  w, b = _weight(rng, st, cin, cout, groups)
  y = jsparse.sparse_conv_transpose3d(x, w, stride=st, feature_group_count=groups)
  cot = jnp.asarray(rng.standard_normal((y.capacity, cout)).astype(np.float32))

  def sparse_fn(f, w, b):
    return jsparse.sparse_conv_transpose3d(x.replace(feats=f), w, b, stride=st, out_capacity=y.capacity,
                                           implementation=implementation, precision="highest",
                                           feature_group_count=groups).feats

  def dense_fn(f, w, b):
    zeros = jnp.zeros((x.batch_size,) + y.spatial_shape + (cout,))
    _, vjp = jax.vjp(lambda d: _dense_conv(d, _group_transposed(w, groups), groups, 2, 0), zeros)
    return _at(vjp(x.replace(feats=f).todense())[0] + b, y)

  _check_values_and_grads(sparse_fn, dense_fn, (x.feats, w, b), cot, TOL[jnp.float32])


# ---- the Pallas kernels (interpret mode) against the XLA path ----------------------------------------------


def _pallas_vs_xla(x, w, b, groups, algorithm, layout, dtype=jnp.float32, tol=2e-5):
  x = x.replace(feats=x.feats.astype(dtype))
  w, b = w.astype(dtype), b.astype(dtype)
  weight = w if layout == "DHWIO" else _odhwi(w)
  cot = jnp.asarray(np.random.default_rng(1).standard_normal((x.capacity, w.shape[-1])).astype(np.float32))

  def loss(f, w, b, impl, algo):
    y = jsparse.submconv3d(x.replace(feats=f), w, b, implementation=impl, precision="highest", algorithm=algo,
                           weight_layout=layout, feature_group_count=groups)
    return jnp.sum(y.feats.astype(jnp.float32) * cot), y.feats

  grad = lambda impl, algo: jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True),
                                    static_argnums=(3, 4))(x.feats, weight, b, impl, algo)
  (_, yp), gp = grad("pallas", algorithm)
  (_, yx), gx = grad("xla", "auto")
  assert rel_err(yp, yx) < tol
  for name, a, r in zip(("input", "weight", "bias"), gp, gx):
    assert a.dtype == r.dtype and rel_err(a, r) < tol, (name, rel_err(a, r))


ALGORITHMS = ["explicit", "masked", "implicit_splitk", "depthwise", "depthwise_splitk", "auto"]
# Every algorithm on wide groups (the grouped gather-GEMM) and on one of the two narrow groupings, which split the
# algorithms between them: one channel per group (depthwise) and three with a channel multiplier of 2 (g4), each
# with a depthwise kernel (split and not) and a GEMM algorithm.
NARROW = {"explicit": "g4", "masked": "depthwise", "implicit_splitk": "g4", "depthwise": "depthwise",
          "depthwise_splitk": "g4", "auto": "depthwise"}
GROUPINGS_BY_ID = {"g2_wide": (32, 48, 2), "depthwise": (24, 24, 24), "g4": (12, 24, 4)}


@pytest.mark.parametrize("grouping, algorithm", [
    pytest.param(GROUPINGS_BY_ID[gid], algorithm, id=f"{gid}-{algorithm}")
    for algorithm in ALGORITHMS for gid in ("g2_wide", NARROW[algorithm])])
def test_pallas_algorithms_match_xla(grouping, algorithm):
  """Every algorithm runs grouped convolutions: the grouped gather-GEMM (groups of >= 16 channels), the
  depthwise multiply-accumulate, and explicit (the XLA passes under the custom_vjp, whose gradients must equal
  JAX's autodiff of the XLA path)."""
  cin, cout, groups = grouping
  rng = np.random.default_rng(cin + groups)
  x = random_sparse(rng, (6, 5, 6), cin, batch_size=2, density=0.3)
  w, b = _weight(rng, (3, 3, 3), cin, cout, groups)
  layout = "ODHWI" if algorithm in ("masked", "depthwise") else "DHWIO"
  _pallas_vs_xla(x, w, b, groups, algorithm, layout)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_pallas_half_precision_matches_xla(dtype):
  rng = np.random.default_rng(2)
  x = random_sparse(rng, (6, 5, 6), 16, batch_size=1, density=0.35)
  w, b = _weight(rng, (3, 3, 3), 16, 16, 16)
  _pallas_vs_xla(x, w, b, 16, "auto", "DHWIO", dtype, TOL[dtype])
  w, b = _weight(rng, (3, 3, 3), 16, 32, 2)
  _pallas_vs_xla(x, w, b, 2, "masked", "ODHWI", dtype, TOL[dtype])


def test_pallas_strided_and_inverse_grouped_match_xla():
  rng = np.random.default_rng(9)
  x = random_sparse(rng, (8, 7, 6), 8, batch_size=2, density=0.3)
  w, b = _weight(rng, (3, 3, 3), 8, 8, 8)
  w2, b2 = _weight(rng, (3, 3, 3), 8, 8, 8)
  cot = jnp.asarray(rng.standard_normal((x.capacity, 8)).astype(np.float32))
  rows = jsparse.sparse_conv3d(x, w, stride=2, padding=1, feature_group_count=8).capacity

  def loss(f, w, b, w2, b2, impl):
    kw = dict(stride=2, padding=1, implementation=impl, precision="highest", feature_group_count=8)
    y = jsparse.sparse_conv3d(x.replace(feats=f), w, b, out_capacity=rows, **kw)
    z = jsparse.sparse_inverse_conv3d(y, w2, b2, like=x, **kw)
    return jnp.sum(z.feats * cot)

  gp = jax.jit(jax.grad(loss, range(5)), static_argnums=5)(x.feats, w, b, w2, b2, "pallas")
  gx = jax.jit(jax.grad(loss, range(5)), static_argnums=5)(x.feats, w, b, w2, b2, "xla")
  for a, r in zip(gp, gx):
    assert rel_err(a, r) < 2e-5


def test_depthwise_second_order_gradients_match_xla():
  """The depthwise passes are each other's vjps: a gradient of a gradient runs them and equals the XLA path's."""
  rng = np.random.default_rng(4)
  x = random_sparse(rng, (5, 5, 5), 8, batch_size=1, density=0.4)
  w, _ = _weight(rng, (3, 3, 3), 8, 8, 8)

  def inner(f, w, impl):
    y = jsparse.submconv3d(x.replace(feats=f), w, implementation=impl, precision="highest", algorithm="auto"
                           if impl == "xla" else "depthwise", feature_group_count=8)
    return jnp.sum(y.feats ** 2)

  def outer(f, w, impl):
    g_f, g_w = jax.grad(inner, (0, 1))(f, w, impl)
    return jnp.sum(g_f ** 2) + jnp.sum(g_w ** 2)

  gp = jax.jit(jax.grad(outer, (0, 1)), static_argnums=2)(x.feats, w, "pallas")
  gx = jax.jit(jax.grad(outer, (0, 1)), static_argnums=2)(x.feats, w, "xla")
  for a, r in zip(gp, gx):
    assert rel_err(a, r) < 1e-4


def test_depthwise_kernels_against_the_xla_passes_on_arrays():
  """The kernels at array level, with maps that have unused rows and more rows than valid ones: forward (with
  bias, split or not), input gradient over a transposed map, weight gradient (split rows), both layouts."""
  from jsparse.gemm_xla import input_grad_xla, submconv_xla, weight_grad_xla
  from pallas_kernels.weight_layout import WeightLayout

  rng = np.random.default_rng(0)
  m, v, cin, cout, groups, num = 300, 7, 12, 24, 4, 250
  nbr = jnp.asarray(np.where(rng.random((m, v)) < 0.6, rng.integers(0, 200, (m, v)), -1).astype(np.int32))
  nbr = jnp.where(jnp.arange(m)[:, None] < num, nbr, -1)
  x = jnp.asarray(rng.standard_normal((200, cin)).astype(np.float32))
  g = jnp.asarray(rng.standard_normal((m, cout)).astype(np.float32))
  w = jnp.asarray(rng.standard_normal((v, cin // groups, cout)).astype(np.float32))
  bias = jnp.asarray(rng.standard_normal(cout).astype(np.float32))
  t_map = jnp.asarray(rng.integers(-1, m, (200, v)).astype(np.int32))
  # Each layout with one split (the layout sets how the weight is read, the split how rows are cut: independent).
  for layout, split in ((WeightLayout.DHWIO, 1), (WeightLayout.ODHWI, 3)):
    wl = w if layout is WeightLayout.DHWIO else jnp.transpose(w, (2, 0, 1))
    kw = dict(precision="highest", weight_layout=layout, groups=groups)
    want = submconv_xla(x, wl, bias, nbr, num, **kw)
    cfg = TileConfig(32, 16, 16, split=split)
    got = depthwise.conv_forward(x, wl, nbr, num, bias, config=cfg, interpret=True, weight_layout=layout,
                                 groups=groups)
    assert rel_err(got, want) < 1e-6
    got = depthwise.conv_input_grad(g, wl, t_map, 180, config=cfg, interpret=True, weight_layout=layout,
                                    groups=groups)
    assert rel_err(got, input_grad_xla(g, wl, t_map, 180, **kw)) < 1e-6
    got = depthwise.weight_grad(x, g, nbr, num, config=cfg, interpret=True, weight_layout=layout, groups=groups)
    assert rel_err(got, weight_grad_xla(x, g, nbr, num, **kw)) < 1e-6


def test_grouped_gemm_kernels_against_the_xla_passes_on_arrays():
  from jsparse.gemm_xla import input_grad_xla, submconv_xla, weight_grad_xla
  from pallas_kernels.weight_layout import WeightLayout
  from pallas_kernels.gemm_plan import pair_lists

  rng = np.random.default_rng(1)
  m, v, cin, cout, groups, num = 200, 5, 48, 96, 3, 180
  nbr = jnp.asarray(np.where(rng.random((m, v)) < 0.6, rng.integers(0, m, (m, v)), -1).astype(np.int32))
  nbr = jnp.where(jnp.arange(m)[:, None] < num, nbr, -1)
  x = jnp.asarray(rng.standard_normal((m, cin)).astype(np.float32))
  g = jnp.asarray(rng.standard_normal((m, cout)).astype(np.float32))
  w = jnp.asarray(rng.standard_normal((v, cin // groups, cout)).astype(np.float32))
  for layout in (WeightLayout.DHWIO, WeightLayout.ODHWI):
    wl = w if layout is WeightLayout.DHWIO else jnp.transpose(w, (2, 0, 1))
    kw = dict(precision="highest", weight_layout=layout, groups=groups)
    for cfg in (TileConfig(32, 16, 16, split=1), TileConfig(64, 32, 16, split=2, weight_k_major=True)):
      got = conv_forward(x, wl, nbr, num, config=cfg, interpret=True, **kw)
      assert rel_err(got, submconv_xla(x, wl, None, nbr, num, **kw)) < 1e-6
      got = conv_input_grad(g, wl, nbr, num, config=cfg, interpret=True, **kw)
      assert rel_err(got, input_grad_xla(g, wl, nbr, num, **kw)) < 1e-6
      want = weight_grad_xla(x, g, nbr, num, **kw)
      got = weight_grad(x, g, nbr, config=cfg, interpret=True, **kw)
      assert rel_err(got, want) < 1e-6
      got = weight_grad(x, g, None, pairs=pair_lists(nbr, interpret=True),
                        config=dataclasses.replace(cfg, balanced=True, split=2), interpret=True, **kw)
      assert rel_err(got, want) < 1e-6


# ---- lowering ---------------------------------------------------------------------------------------------


def _spec(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("cin_group, cout", [(1, 64), (1, 128), (4, 32)], ids=["depthwise", "multiplier2", "g4"])
def test_depthwise_kernels_lower_to_triton(cin_group, cout, dtype):
  m, v, cin = 3000, 27, 64
  groups = cin // cin_group
  x, nbr, num = _spec((m, cin), dtype), _spec((m, v), jnp.int32), _spec((), jnp.int32)
  g, b = _spec((m, cout), dtype), _spec((cout,), dtype)
  for split in (1, 3):
    cfg = TileConfig(64, 64, 16, split=split)
    for layout, w in (("DHWIO", _spec((v, cin_group, cout), dtype)), ("ODHWI", _spec((cout, v, cin_group), dtype))):
      kw = dict(config=cfg, groups=groups, weight_layout=layout)
      assert "triton" in lower_for_cuda(lambda x, w, nbr, num, b: depthwise.conv_forward(x, w, nbr, num, b, **kw),
                                        x, w, nbr, num, b)
      lower_for_cuda(lambda g, w, nbr, num: depthwise.conv_input_grad(g, w, nbr, num, **kw), g, w, nbr, num)
      lower_for_cuda(lambda x, g, nbr, num: depthwise.weight_grad(x, g, nbr, num, **kw), x, g, nbr, num)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_grouped_gemm_kernels_lower_to_triton(dtype):
  from pallas_kernels.gemm_plan import masked_plan, pair_lists

  m, v, cin, cout, groups = 3000, 27, 64, 96, 2
  x, nbr, num = _spec((m, cin), dtype), _spec((m, v), jnp.int32), _spec((), jnp.int32)
  g, b = _spec((m, cout), dtype), _spec((cout,), dtype)
  for cfg in (TileConfig(64, 32, 32, columns_fastest=True), TileConfig(64, 32, 32, split=4)):
    for layout, w in (("DHWIO", _spec((v, cin // groups, cout), dtype)),
                      ("ODHWI", _spec((cout, v, cin // groups), dtype))):
      kw = dict(config=cfg, groups=groups, weight_layout=layout)
      assert "triton" in lower_for_cuda(
          lambda x, w, nbr, num, b: conv_forward(x, w, nbr, num, b, plan=masked_plan(nbr, num, 64), **kw),
          x, w, nbr, num, b)
      lower_for_cuda(lambda g, w, nbr, num: conv_input_grad(g, w, nbr, num, **kw), g, w, nbr, num)
      lower_for_cuda(lambda x, g, nbr: weight_grad(x, g, None, pairs=pair_lists(nbr, True), **kw), x, g, nbr)
      lower_for_cuda(lambda x, g, nbr: weight_grad(
          x, g, None, pairs=pair_lists(nbr), **dict(kw, config=dataclasses.replace(cfg, balanced=True))), x, g, nbr)


def test_depthwise_kernels_lower_inside_shard_map():
  """Inside shard_map (check_vma=True) the depthwise kernels' outputs say which mesh axes they vary over, as the
  GEMMs' do (data-parallel training)."""
  from jax.sharding import Mesh, PartitionSpec as P

  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  m, v, c = 512, 27, 32
  cfg = TileConfig(64, 32, 16, split=2)

  def step(x, w, nbr, num, g):
    kw = dict(config=cfg, groups=c)
    y = depthwise.conv_forward(x, w, nbr, num[0], **kw)
    dx = depthwise.conv_input_grad(g, w, nbr, num[0], **kw)
    return y, dx, jax.lax.psum(depthwise.weight_grad(x, g, nbr, num[0], **kw), "data")

  fn = jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P(), P("data"), P("data"), P("data")),
                     out_specs=(P("data"), P("data"), P()))
  text = lower_for_cuda(fn, _spec((m, c), jnp.float16), _spec((v, 1, c), jnp.float16), _spec((m, v), jnp.int32),
                        _spec((1,), jnp.int32), _spec((m, c), jnp.float16))
  assert text.count("__gpu$xla.gpu.triton") >= 3


# ---- configs ----------------------------------------------------------------------------------------------


def test_heuristic_and_shape_keys_with_groups():
  # Narrow groups take the depthwise kernels, wide ones the grouped GEMM, groups=1 what it took before.
  for pass_name in pass_config.PASSES:
    assert type(pass_config.heuristic(pass_name, 5000, 64, 64, 27, jnp.float16, groups=64)) is Depthwise
    assert type(pass_config.heuristic(pass_name, 5000, 64, 128, 27, jnp.float16, groups=8)) is Depthwise
    assert type(pass_config.heuristic(pass_name, 5000, 64, 64, 27, jnp.float16, groups=2)) is Masked
    assert type(pass_config.heuristic(pass_name, 5000, 8, 8, 27, jnp.float16)) is Masked
    cfg = pass_config.heuristic(pass_name, 5000, 64, 64, 27, jnp.float16, "depthwise_splitk", groups=64)
    assert cfg.tiles.split >= 2
    # What a convolution gets untuned: choose passes its groups on to the heuristic.
    from jsparse import map_gemm
    assert type(map_gemm.choose(pass_name, 5000, 64, 64, 27, jnp.float16, groups=64)) is Depthwise
  key = ShapeKey.of("forward", 1000, 64, 64, 27, jnp.float16, groups=64)
  assert str(key) == "forward/n1024/ci64/co64/v27/g64/float16"
  assert ShapeKey.parse(str(key)) == key
  assert str(ShapeKey.of("forward", 1000, 64, 64, 27, jnp.float16)) == "forward/n1024/ci64/co64/v27/float16"
  cfg = Depthwise(TileConfig(64, 64, 16, split=2))
  table = jsparse.ConfigTable({key: cfg})
  assert jsparse.ConfigTable.from_json(table.to_json()).get(key) == cfg
  assert pass_config.candidates("forward", 1000, 64, 64, 27, jnp.float16, jsparse.WeightLayout.DHWIO, groups=64)
  assert not Depthwise.candidates("forward", 1000, 64, 64, 27, jnp.float16, jsparse.WeightLayout.DHWIO)


def test_a_tuned_grouped_entry_is_used_only_for_its_groups():
  rng = np.random.default_rng(3)
  x = random_sparse(rng, (5, 5, 5), 16, batch_size=1, density=0.3)
  w, _ = _weight(rng, (3, 3, 3), 16, 16, 16)
  rows = x.capacity
  cfg = Depthwise(TileConfig(16, 16, 16, split=2))
  keys = [ShapeKey.of(p, rows, 16, 16, 27, jnp.float32, 16) for p in pass_config.PASSES]
  from jsparse import map_gemm

  with jsparse.ConfigTable({k: cfg for k in keys}):
    assert map_gemm.choose("forward", rows, 16, 16, 27, jnp.float32, groups=16) == cfg
    assert map_gemm.choose("forward", rows, 16, 16, 27, jnp.float32) != cfg
    y = jsparse.submconv3d(x, w, implementation="pallas", precision="highest", feature_group_count=16)
  want = jsparse.submconv3d(x, w, implementation="xla", precision="highest", feature_group_count=16)
  assert rel_err(y.feats, want.feats) < 1e-6


# ---- bad arguments ----------------------------------------------------------------------------------------


def test_bad_feature_group_counts_raise():
  rng = np.random.default_rng(0)
  x = random_sparse(rng, (5, 5, 5), 8, density=0.3)
  for bad in (0, -2, 1.5, True, "2"):
    with pytest.raises(ValueError, match="feature_group_count"):
      jsparse.submconv3d(x, jnp.ones((3, 3, 3, 8, 8)), feature_group_count=bad)
  with pytest.raises(ValueError, match="feature_group_count=3 must divide the input channels"):
    jsparse.submconv3d(x, jnp.ones((3, 3, 3, 2, 6)), feature_group_count=3)
  with pytest.raises(ValueError, match="feature_group_count=4 must divide the output channels"):
    jsparse.sparse_conv3d(x, jnp.ones((3, 3, 3, 2, 6)), stride=2, feature_group_count=4)
  with pytest.raises(ValueError, match="expects 8 input channels .* feature_group_count=4 = 2"):
    jsparse.submconv3d(x, jnp.ones((3, 3, 3, 8, 8)), feature_group_count=4)
  with pytest.raises(ValueError, match="expects 2 input channels"):
    jsparse.sparse_conv_transpose3d(x, jnp.ones((8, 2, 2, 2, 2)), feature_group_count=2, weight_layout="ODHWI")
  with pytest.raises(ValueError, match="feature_group_count"):
    jsparse.nn.SubMConv3d(6, feature_group_count=4).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="feature_group_count"):
    jsparse.nnx.SparseConv3d(8, 6, 3, feature_group_count=4, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="feature_group_count"):
    jsparse.nnx.SubMConv3d(8, 8, feature_group_count=0, rngs=nnx.Rngs(0))


# ---- modules ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["DHWIO", "ODHWI"])
def test_linen_and_nnx_modules_with_groups(layout):
  rng = np.random.default_rng(6)
  cin, cout, groups = 8, 12, 4
  x = random_sparse(rng, (6, 6, 6), cin, batch_size=2, density=0.3)
  kw = dict(feature_group_count=groups, kernel_layout=layout, implementation="xla", precision="highest")
  subm = jsparse.nn.SubMConv3d(cout, **kw)
  down = jsparse.nn.SparseConv3d(cout, 3, strides=2, **kw)
  up = jsparse.nn.SparseInverseConv3d(cin, 3, strides=2, **kw)
  grow = jsparse.nn.SparseConvTranspose3d(cout, strides=2, **kw)
  shape = lambda ks, i, o: (o, *ks, i // groups) if layout == "ODHWI" else (*ks, i // groups, o)
  twins = [(subm, jsparse.nnx.SubMConv3d(cin, cout, **kw, rngs=nnx.Rngs(0)), (3, 3, 3), cin, cout),
           (down, jsparse.nnx.SparseConv3d(cin, cout, 3, strides=2, **kw, rngs=nnx.Rngs(0)), (3, 3, 3), cin, cout),
           (grow, jsparse.nnx.SparseConvTranspose3d(cin, cout, strides=2, **kw, rngs=nnx.Rngs(0)), (2, 2, 2), cin,
            cout)]
  for linen_module, nnx_module, ks, i, o in twins:
    variables = linen_module.init(jax.random.key(1), x)
    kernel = variables["params"]["kernel"]
    assert kernel.shape == nnx_module.kernel.shape == shape(ks, i, o)
    y = linen_module.apply(variables, x)
    # The module computes the functional op with its kernel, which equals the dense grouped convolution.
    dense_w = kernel if layout == "DHWIO" else jnp.moveaxis(kernel, 0, -1)
    if linen_module is subm:
      want = _at(_dense_conv(x.todense(), dense_w, groups) + variables["params"]["bias"], x)
      assert rel_err(y.feats, want) < 2e-5
    # Parameters move to the nnx twin, which then gives the same output.
    nnx.update(nnx_module, jsparse.nnx.linen_to_nnx(variables, nnx_module))
    assert rel_err(nnx_module(x).feats, y.feats) < 1e-6
    back = jsparse.nnx.nnx_to_linen(nnx_module)
    assert rel_err(linen_module.apply(back, x).feats, y.feats) < 1e-6
  y = down.apply(down.init(jax.random.key(2), x), x)
  inverse = jsparse.nnx.SparseInverseConv3d(cout, cin, 3, strides=2, **kw, rngs=nnx.Rngs(0))
  variables = up.init(jax.random.key(3), y, like=x)
  assert variables["params"]["kernel"].shape == inverse.kernel.shape == shape((3, 3, 3), cout, cin)
  nnx.update(inverse, jsparse.nnx.linen_to_nnx(variables, inverse))
  assert rel_err(inverse(y, like=x).feats, up.apply(variables, y, like=x).feats) < 1e-6


# ---- GPU (the lead runs these) ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("grouping", [(64, 64, 64), (32, 64, 32), (64, 64, 8), (128, 128, 4)],
                         ids=["depthwise", "multiplier2", "g8_narrow", "g4_wide"])
def test_gpu_grouped_pallas_matches_xla(grouping, dtype):
  """On the GPU: every pass of a grouped convolution (the grouped gather-GEMM for 32-channel groups, the
  depthwise kernels below 16) against the XLA path, at a size with many row blocks and both layouts."""
  cin, cout, groups = grouping
  rng = np.random.default_rng(0)
  x = random_sparse(rng, (40, 40, 40), cin, batch_size=2, density=0.05)
  w, b = _weight(rng, (3, 3, 3), cin, cout, groups)
  tol = {jnp.float32: 1e-3, jnp.float16: 4e-3, jnp.bfloat16: 3e-2}[dtype]  # float32: TF32 GEMMs
  for layout in ("DHWIO", "ODHWI"):
    _pallas_vs_xla(x, w, b, groups, "auto", layout, dtype, tol)


def test_autotune_tunes_a_depthwise_convolution_under_its_groups(monkeypatch):
  """autotune records a grouped convolution's feature_group_count, times candidates for it and files the
  winners under keys with its groups, which then drive that convolution (and not an ungrouped one)."""
  from jsparse import autotuning

  rng = np.random.default_rng(8)
  x = random_sparse(rng, (5, 5, 5), 16, batch_size=1, density=0.3)
  w, b = _weight(rng, (3, 3, 3), 16, 16, 16)
  real = pass_config.candidates
  seen_groups = []

  def few_candidates(*args, groups=1):  # the depthwise candidates only (interpret mode is slow)
    seen_groups.append(groups)
    return [c for c in real(*args, groups=groups) if isinstance(c, Depthwise)][:2]

  monkeypatch.setattr(pass_config, "candidates", few_candidates)
  fn = lambda f, w, b: jsparse.submconv3d(x.replace(feats=f), w, b, implementation="pallas", precision="highest",
                                          feature_group_count=16).feats
  table = autotuning.autotune(fn, x.feats, w, b, warmup=0, repeats=1)
  assert seen_groups == [16, 16, 16]
  assert sorted(k.pass_name for k in table.entries) == sorted(pass_config.PASSES)
  assert all(k.groups == 16 and isinstance(c, Depthwise) for k, c in table.entries.items())
  with table:
    y = jax.jit(fn)(x.feats, w, b)
  want = jsparse.submconv3d(x, w, b, implementation="xla", precision="highest", feature_group_count=16).feats
  assert rel_err(y, want) < 1e-5


@pytest.mark.parametrize("algorithm", ["masked", "depthwise"])
@pytest.mark.parametrize("capacity, num", [(0, 0), (4, 0)], ids=["no_rows", "padding_only"])
def test_empty_grouped_convolutions_give_zeros(capacity, num, algorithm):
  """No rows, or only padding rows: the grouped kernels give the bias at no row and zero gradients."""
  coords = np.zeros((num, 4), np.int32)
  x = jsparse.SparseTensor.from_coords(coords, np.zeros((num, 4), np.float32), (4, 4, 4), batch_size=1,
                                       capacity=capacity)
  w, b = _weight(np.random.default_rng(0), (3, 3, 3), 4, 8, 4)

  def loss(f, w, b):
    y = jsparse.submconv3d(x.replace(feats=f), w, b, implementation="pallas", algorithm=algorithm,
                           feature_group_count=4)
    return jnp.sum(y.feats), y.feats

  (_, y), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(x.feats, w, b)
  assert y.shape == (capacity, 8) and not np.any(np.asarray(y))
  for a, r in zip(grads, (x.feats, w, b)):
    assert a.shape == r.shape and not np.any(np.asarray(a))


def test_2d_grouped_convolutions_and_modules():
  """The 2D ops and modules pass feature_group_count to the 3D ones: a depthwise and a grouped 2D convolution
  against lax's 2D convolution with feature_group_count, and SubMConv2d's kernel shape."""
  rng = np.random.default_rng(12)
  dense = rng.standard_normal((2, 9, 8, 8)).astype(np.float32) * (rng.random((2, 9, 8, 1)) < 0.3)
  x = jsparse.SparseTensor.from_dense(jnp.asarray(dense))
  occupied = x.replace(feats=x.valid_mask()[:, None].astype(jnp.float32)).todense()
  for cout, groups in ((8, 8), (12, 4)):
    w = jnp.asarray(rng.standard_normal((3, 3, 8 // groups, cout)).astype(np.float32))
    want = lax.conv_general_dilated(x.todense(), w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                    precision=HI, feature_group_count=groups) * occupied
    got = jsparse.submconv2d(x, w, precision="highest", feature_group_count=groups)
    assert rel_err(got.todense(), want) < 2e-5
    module = jsparse.nn.SubMConv2d(cout, feature_group_count=groups, precision="highest")
    variables = module.init(jax.random.key(0), x)
    assert variables["params"]["kernel"].shape == (3, 3, 8 // groups, cout)
    y = module.apply({"params": {"kernel": w, "bias": jnp.zeros(cout)}}, x)
    assert rel_err(y.todense(), want) < 2e-5
