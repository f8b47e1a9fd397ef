"""Overflow is never silent (issue 16 item 3) and inputs on other coordinates are caught (item 9).

Ops whose output sites do not fit `out_capacity`: outside jit a ValueError naming the op; under jit the
output's flag (`jsparse.overflowed`, carried on by later layers) and a `jax.experimental.checkify` error naming
the op and the counts. Maps or tensors from other coordinates: ValueError outside jit, checkify under jit.
"""
import os
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jsparse
import jsparse.nn as snn
from reference import random_sparse

CHANNELS = 3


def _x(seed=0, shape=(6, 6, 6), pad=4):
  return random_sparse(np.random.default_rng(seed), shape, CHANNELS, batch_size=2, density=0.3, pad=pad)


def _w(shape, seed=1):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.1)


def _error(f, *args, checks=True):
  """checkify's error message of f(*args) under jit, or None (its default errors are the user checks)."""
  with jsparse.error_checks(checks):
    err, _ = jax.jit(checkify.checkify(f))(*args)
  return err.get()


# op name -> (fn(x, out_capacity, impl), number of output sites of x in the fixture)
_OPS = {
    "sparse_conv3d": lambda x, cap, impl: jsparse.sparse_conv3d(x, _w((2, 2, 2, CHANNELS, 4)), stride=2,
                                                                out_capacity=cap, implementation=impl),
    "sparse_conv_transpose3d": lambda x, cap, impl: jsparse.sparse_conv_transpose3d(
        x, _w((2, 2, 2, CHANNELS, 4)), stride=2, out_capacity=cap, implementation=impl),
    "sparse_max_pool3d": lambda x, cap, impl: jsparse.sparse_max_pool3d(x, 2, out_capacity=cap,
                                                                        implementation=impl),
    "sparse_avg_pool3d": lambda x, cap, impl: jsparse.sparse_avg_pool3d(x, 2, out_capacity=cap,
                                                                        implementation=impl),
}
_WHAT = {"sparse_conv_transpose3d": "children"}


def _count(name, x):
  return int(_OPS[name](x, None, "xla").num)


@pytest.mark.parametrize("name", list(_OPS))
def test_functional_ops_flag_report_and_raise(name):
  x = _x()
  n = _count(name, x)
  op = lambda cap: jax.jit(lambda x: _OPS[name](x, cap, "xla"))
  small, fits = op(n - 1)(x), op(n)(x)
  assert bool(jsparse.overflowed(small)) and int(small.num) == n - 1
  assert not bool(jsparse.overflowed(fits)) and int(fits.num) == n
  # checkify names the op and both counts; without checkify the same jitted code ran above.
  msg = _error(lambda x: _OPS[name](x, n - 1, "xla"), x)
  assert msg is not None and msg.startswith(f"{name}: {n} {_WHAT.get(name, 'output sites')}")
  assert f"out_capacity={n - 1}" in msg
  assert _error(lambda x: _OPS[name](x, n, "xla"), x) is None
  # Outside error_checks() nothing is emitted: checkify finds no error, the flag still tells.
  assert _error(lambda x: _OPS[name](x, n - 1, "xla"), x, checks=False) is None
  with pytest.raises(ValueError, match=f"{name}: {n} .* out_capacity={n - 1}"):
    _OPS[name](x, n - 1, "xla")


_FLAGGED = {
    "sparse_conv3d": lambda x, cap: jsparse.sparse_conv3d(x, _w((2, 2, 2, CHANNELS, 4)), stride=2, out_capacity=cap,
                                                          implementation="xla", with_overflow=True),
    "sparse_conv3d k3 s2 p1": lambda x, cap: jsparse.sparse_conv3d(
        x, _w((3, 3, 3, CHANNELS, 4)), stride=2, padding=1, out_capacity=cap, implementation="xla", with_overflow=True),
    "sparse_conv_transpose3d": lambda x, cap: jsparse.sparse_conv_transpose3d(
        x, _w((2, 2, 2, CHANNELS, 4)), stride=2, out_capacity=cap, implementation="xla", with_overflow=True),
    "sparse_conv_transpose3d k3": lambda x, cap: jsparse.sparse_conv_transpose3d(
        x, _w((3, 3, 3, CHANNELS, 4)), stride=2, padding=1, out_capacity=cap, implementation="xla",
        with_overflow=True),
    "sparse_max_pool3d": lambda x, cap: jsparse.sparse_max_pool3d(x, 2, out_capacity=cap, with_overflow=True,
                                                                  implementation="xla"),
    "sparse_avg_pool3d": lambda x, cap: jsparse.sparse_avg_pool3d(x, 2, out_capacity=cap, with_overflow=True,
                                                                  implementation="xla"),
}


@pytest.mark.parametrize("name", list(_FLAGGED))
def test_with_overflow_returns_the_flag_outside_jit(name):
  """README (Limits and errors): ops called with with_overflow=True return the flag instead of raising, as
  from_dense, select, union and voxelize_jit do. The strided and transposed convolutions and the pools raised
  ValueError outside jit all the same, so an eager loop that grows out_capacity on the flag never saw it. The
  eager result equals the jitted one (the out_capacity smallest-keyed sites, or the first children)."""
  x = _x(seed=3, pad=2)
  n = int(_FLAGGED[name](x, "exact")[0].num)
  eager, flag = _FLAGGED[name](x, n - 1)
  jitted, jit_flag = jax.jit(lambda x: _FLAGGED[name](x, n - 1))(x)
  assert bool(flag) and bool(jit_flag) and bool(jsparse.overflowed(eager)) and int(eager.num) == n - 1
  np.testing.assert_array_equal(np.asarray(eager.coords), np.asarray(jitted.coords))
  np.testing.assert_allclose(np.asarray(eager.feats), np.asarray(jitted.feats), rtol=1e-6, atol=1e-6)
  fits, ok = _FLAGGED[name](x, n)
  assert not bool(ok) and int(fits.num) == n


def test_without_error_checks_a_jitted_step_has_no_effects():
  # A check is an effect, and an effect costs jit its C++ dispatch path on every call: none by default.
  x = _x()
  n = _count("sparse_max_pool3d", x)
  step = lambda x: jsparse.sparse_max_pool3d(jsparse.submconv3d(x, _w((3, 3, 3, CHANNELS, 4))), 2,
                                             out_capacity=n).feats.sum()
  assert not jax.make_jaxpr(step)(x).effects
  with jsparse.error_checks():
    assert jax.make_jaxpr(step)(x).effects


def test_error_checks_are_part_of_the_trace_context():
  # A jitted function traced without the checks is traced again inside error_checks(), not reused from the cache.
  x = _x()
  n = _count("sparse_max_pool3d", x)
  step = jax.jit(lambda x: jsparse.sparse_max_pool3d(x, 2, out_capacity=n - 1))
  checked = checkify.checkify(step)
  err, _ = checked(x)
  assert err.get() is None
  with jsparse.error_checks():
    err, _ = checked(x)
  assert err.get() is not None and err.get().startswith("sparse_max_pool3d")



def test_error_checks_environment_variable_and_enabled_false():
  # README / error_checks: JSPARSE_ERROR_CHECKS=1 turns the checks on everywhere; error_checks(False) turns them
  # off inside a block. The variable is read when jsparse is imported, hence the fresh process.
  code = """
import jax, jsparse
from test_overflow import _x
step = lambda x: jsparse.sparse_max_pool3d(x, 2, out_capacity=128).feats.sum()
x = _x()
on = bool(jax.make_jaxpr(step)(x).effects)
with jsparse.error_checks(False):
  off = bool(jax.make_jaxpr(step)(x).effects)
print(on, off)
"""
  root = pathlib.Path(__file__).resolve().parent.parent
  env = {**os.environ, "JSPARSE_ERROR_CHECKS": "1", "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests"), os.environ.get("PYTHONPATH", "")])}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=root, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split()[-2:] == ["True", "False"]

@pytest.mark.parametrize("name", ["sparse_conv3d", "sparse_conv_transpose3d"])
def test_pallas_interpret_flags_and_reports(name):
  x = _x(seed=2, shape=(4, 4, 4), pad=2)
  n = _count(name, x)
  small = jax.jit(lambda x: _OPS[name](x, n - 1, "pallas"))(x)
  assert bool(jsparse.overflowed(small))
  msg = _error(lambda x: _OPS[name](x, n - 1, "pallas"), x)
  assert msg is not None and msg.startswith(f"{name}: {n} ")


class _Net(nn.Module):
  """A strided op with a static out_capacity, then layers on its sites: submconv, batch norm, concat."""
  layer: str
  out_capacity: int

  @nn.compact
  def __call__(self, x):
    cap = self.out_capacity
    down = {"SparseConv3d": lambda: snn.SparseConv3d(4, kernel_size=2, strides=2, out_capacity=cap),
            "SparseConvTranspose3d": lambda: snn.SparseConvTranspose3d(4, strides=2, out_capacity=cap),
            "SparseMaxPool3d": lambda: snn.SparseMaxPool3d(2, out_capacity=cap),
            "SparseAvgPool3d": lambda: snn.SparseAvgPool3d(2, out_capacity=cap)}[self.layer]()
    h = down(x)
    h = snn.SubMConv3d(4, implementation="xla")(h)
    h = snn.SparseBatchNorm(activation=nn.relu)(h, use_running_average=False)
    return jsparse.concat(h, snn.SubMConv3d(2, kernel_size=1, implementation="xla")(h))


_MODULE_OPS = {"SparseConv3d": "sparse_conv3d", "SparseConvTranspose3d": "sparse_conv_transpose3d",
               "SparseMaxPool3d": "sparse_max_pool3d", "SparseAvgPool3d": "sparse_avg_pool3d"}


@pytest.mark.parametrize("layer", list(_MODULE_OPS))
def test_flax_modules_flag_through_later_layers(layer):
  x = _x(seed=3)
  n = _count(_MODULE_OPS[layer], x)
  variables = jax.jit(_Net(layer, n).init)(jax.random.key(0), x)  # one program, not every op on its own

  def apply(cap):
    return lambda v, x: _Net(layer, cap).apply(v, x, mutable=["batch_stats"])[0]

  assert not bool(jsparse.overflowed(jax.jit(apply(n))(variables, x)))
  y = jax.jit(apply(n - 1))(variables, x)
  assert bool(jsparse.overflowed(y)) and y.num_channels == 6
  msg = _error(apply(n - 1), variables, x)
  assert msg is not None and msg.startswith(f"{_MODULE_OPS[layer]}: {n} ")
  with pytest.raises(ValueError, match=_MODULE_OPS[layer]):
    apply(n - 1)(variables, x)


def test_flag_propagates_and_is_part_of_the_pytree():
  x = _x(seed=4)
  n = _count("sparse_conv3d", x)

  @jax.jit
  def f(x):
    y = _OPS["sparse_conv3d"](x, n - 2, "xla")
    fine = _OPS["sparse_conv3d"](x, n, "xla")
    # Inverse back onto x's sites: x's flag or y's; concat: either input's.
    back = jsparse.sparse_inverse_conv3d(y, _w((2, 2, 2, 4, 2)), like=x, stride=2)
    # Transposed convolutions with room for every output: the general path and generative upsampling.
    up = jsparse.sparse_conv_transpose3d(y, _w((3, 3, 3, 4, 2)), stride=2, padding=1, out_capacity=27 * y.capacity)
    children = jsparse.sparse_conv_transpose3d(y, _w((2, 2, 2, 4, 2)), stride=2, out_capacity=8 * y.capacity)
    return (y, jsparse.norm.layer_norm(y), y.replace(feats=y.feats * 2), back, jsparse.concat(x, back),
            jsparse.concat(fine, fine), jsparse.sparse_max_pool3d(y, 1, out_capacity=y.capacity), up, children)

  y, normed, replaced, back, cat, fine, pooled, up, children = f(x)
  assert all(bool(jsparse.overflowed(t)) for t in (y, normed, replaced, back, cat, pooled, up, children))
  assert not bool(jsparse.overflowed(fine)) and not bool(jsparse.overflowed(x))
  leaves, treedef = jax.tree_util.tree_flatten(y)
  assert bool(jax.tree_util.tree_unflatten(treedef, leaves).overflow)
  assert "OVERFLOWED" in repr(y) and "OVERFLOWED" not in repr(x)
  with pytest.raises(ValueError, match="overflow"):
    x.replace(overflow=jnp.zeros(3, bool))


def test_from_dense_and_voxelize_jit_carry_the_flag():
  dense = np.zeros((1, 4, 4, 4, 1), np.float32)
  dense[0, :2, :2, :2] = 1.0
  t = jax.jit(lambda d: jsparse.SparseTensor.from_dense(d, capacity=5))(dense)
  assert bool(jsparse.overflowed(t)) and int(t.num) == 5
  msg = _error(lambda d: jsparse.SparseTensor.from_dense(d, capacity=5), dense)
  assert msg.startswith("from_dense: 8 active sites do not fit in capacity=5")
  assert not bool(jsparse.overflowed(jsparse.SparseTensor.from_dense(dense)))
  pts = jnp.asarray(np.random.default_rng(0).uniform(0, 4, (50, 3)).astype(np.float32))
  vox = lambda p: jsparse.voxelize.voxelize_jit(p, voxel_size=1.0, origin=0.0, spatial_shape=(4, 4, 4), capacity=3)
  t, flag = jax.jit(vox)(pts)
  assert bool(flag) and bool(jsparse.overflowed(t))
  assert "voxelize_jit: " in _error(lambda p: vox(p)[0].feats, pts)


def test_grad_and_scan_with_the_flag():
  x = _x(seed=5)
  n = _count("sparse_conv3d", x)
  w = _w((2, 2, 2, CHANNELS, 4))
  conv = lambda w, x: jsparse.sparse_conv3d(x, w, stride=2, out_capacity=n - 1, implementation="xla")
  loss = lambda w, x: jnp.sum(conv(w, x).feats ** 2)
  msg = _error(jax.grad(loss), w, x)
  assert msg is not None and msg.startswith(f"sparse_conv3d: {n} ")
  # A carry that overflowed keeps the flag through a scan over submconv layers (one pytree structure).
  y = jsparse.with_maps(jax.jit(conv)(w, x), 3, implementation="xla")
  ws = _w((2, 3, 3, 3, 4, 4))
  out = jax.jit(lambda y, ws: jax.lax.scan(lambda h, w: (jsparse.submconv3d(h, w, implementation="xla"), None),
                                           y, ws)[0])(y, ws)
  assert bool(jsparse.overflowed(out))


# ---- item 9: inputs from other coordinates -------------------------------------------------------------


def _other(x, seed):
  """A tensor of x's capacity, spatial shape and batch size on other sites."""
  rng = np.random.default_rng(seed)
  while True:
    o = random_sparse(rng, x.spatial_shape, x.num_channels, batch_size=x.batch_size, density=0.3, pad=0)
    if int(o.num) <= x.capacity:
      break
  coords = np.full((x.capacity, 4), -1, np.int32)
  coords[:int(o.num)] = np.asarray(o.coords)
  feats = np.zeros((x.capacity, x.num_channels), np.float32)
  feats[:int(o.num)] = np.asarray(o.feats)
  return jsparse.SparseTensor(jnp.asarray(coords), jnp.asarray(feats), o.num, x.spatial_shape, x.batch_size)


def test_neighbor_cache_of_other_coordinates():
  x = _x(seed=6)
  other = _other(x, 7)
  w = _w((3, 3, 3, CHANNELS, 2))
  cache = jsparse.neighbor_map(other, 3, implementation="xla")
  with pytest.raises(ValueError, match="submconv3d: cache .* other coordinates"):
    jsparse.submconv3d(x, w, cache=cache, implementation="xla")
  conv = lambda x, c: jsparse.submconv3d(x, w, cache=c, implementation="xla").feats
  assert "submconv3d: cache (a NeighborCache) is on other coordinates" in _error(conv, x, cache)
  assert _error(conv, x, jsparse.neighbor_map(x, 3, implementation="xla")) is None
  # A strided convolution's PairMap passed as cache: the same.
  pm = jsparse.sparse_conv.pair_map(other, 2, 2, out_capacity=x.capacity, implementation="xla")
  wd = _w((2, 2, 2, CHANNELS, 2))
  with pytest.raises(ValueError, match="sparse_conv3d: cache"):
    jsparse.sparse_conv3d(x, wd, stride=2, cache=pm, implementation="xla")
  strided = lambda x, c: jsparse.sparse_conv3d(x, wd, stride=2, cache=c, implementation="xla").feats
  assert "sparse_conv3d: cache (a PairMap) is on other coordinates" in _error(strided, x, pm)



def test_pair_map_cache_of_another_out_capacity():
  """sparse_conv3d with a PairMap `cache` and an int out_capacity: the map fixes the output rows, so another
  out_capacity raises ValueError naming both (it was ignored, the output had the map's rows); None or the
  map's own capacity runs, with the same values as building the map."""
  x = _x(seed=12)
  w = _w((2, 2, 2, CHANNELS, 2))
  pm = jsparse.sparse_conv.pair_map(x, 2, 2, out_capacity=x.capacity, implementation="xla")
  with pytest.raises(ValueError, match=f"out_capacity=7 .* cache .* {x.capacity} output rows"):
    jsparse.sparse_conv3d(x, w, stride=2, out_capacity=7, cache=pm, implementation="xla")
  built = jsparse.sparse_conv3d(x, w, stride=2, out_capacity=x.capacity, implementation="xla")
  for capacity in (None, x.capacity):
    y = jsparse.sparse_conv3d(x, w, stride=2, out_capacity=capacity, cache=pm, implementation="xla")
    assert y.capacity == x.capacity
    np.testing.assert_array_equal(np.asarray(y.feats), np.asarray(built.feats))

def test_inverse_conv_with_other_geometry_or_coordinates():
  x = _x(seed=8, shape=(8, 8, 8))
  y = jsparse.sparse_conv3d(x, _w((2, 2, 2, CHANNELS, 4)), stride=2, implementation="xla")
  wi = _w((3, 3, 3, 4, 2))
  # y came from x by kernel 2, padding 0; kernel 3, padding 1 gives the same output grid but other sites.
  with pytest.raises(ValueError, match="sparse_inverse_conv3d: y was made from `like` .* kernel_size=\\(2, 2, 2\\)"):
    jsparse.sparse_inverse_conv3d(y, wi, like=x, stride=2, padding=1, implementation="xla")
  inverse = lambda y, x: jsparse.sparse_inverse_conv3d(y, wi, like=x, stride=2, padding=1, implementation="xla").feats
  assert "y was made from `like`" in _error(inverse, y, x)
  # Under jit the cached map of the right geometry is trusted: checkify tells when `like` is not its input.
  back = lambda y, like: jsparse.sparse_inverse_conv3d(y, _w((2, 2, 2, 4, 2)), like=like, stride=2,
                                                       implementation="xla").feats
  assert _error(back, y, x) is None
  assert "the pair map that y carries is on other coordinates" in _error(back, y, _other(x, 9))


def test_inverse_off_the_forward_grid_names_its_sizes():
  """An inverse given another padding or stride than its forward's, whose output grid is not y's (a port that
  left out spconv's indice_key sizes): the ValueError named y's grid and the expected one only, not the op or
  the sizes to fix. It now names the op and quotes like's grid and the inverse's sizes."""
  x = _x(seed=8, shape=(8, 8, 8))
  down = snn.SparseConv3d(4, 3, strides=2, padding=1, implementation="xla")
  y = down.apply(down.init(jax.random.key(0), x), x)  # on the 4^3 grid
  up = snn.SparseInverseConv3d(2, 3, strides=2, padding=0, implementation="xla")
  match = ("^sparse_inverse_conv3d: y \\(spatial_shape=\\(4, 4, 4\\), batch_size=2\\) is not on the output grid "
           "\\(3, 3, 3\\) \\(batch_size=2\\) of this convolution of `like` \\(spatial_shape=\\(8, 8, 8\\), "
           "kernel_size=\\(3, 3, 3\\), stride=\\(2, 2, 2\\), padding=\\(0, 0, 0\\), dilation=\\(1, 1, 1\\)\\): "
           "pass the forward convolution's sizes")
  with pytest.raises(ValueError, match=match):
    up.init(jax.random.key(1), y, like=x)
  with pytest.raises(ValueError, match="of this convolution of `like` .*stride=\\(1, 1, 1\\), padding=\\(1, 1, 1\\)"):
    jsparse.sparse_inverse_conv3d(y, _w((3, 3, 3, 4, 2)), like=x, stride=1, padding=1, implementation="xla")


def test_inverse_on_a_padded_view_with_other_padding_raises():
  """spconv's SparseInverseConv3d takes no padding, so a port writes SparseConv3d(..., padding=1) and
  SparseInverseConv3d(...) with the module's default "SAME". On an even grid "SAME" pads `like` onto a grid one
  larger with padding 0: the same output grid as the forward's, other sites. The mismatch was not seen (the
  check compared the grids) and the inverse ran silently with the other geometry; it raises now, naming the
  paddings and the grids. The same sizes on a padded view of the grid give the same map, and run."""
  x = _x(seed=8, shape=(8, 8, 8))
  down = snn.SparseConv3d(4, 3, strides=2, padding=1, implementation="xla")
  y = down.apply(down.init(jax.random.key(0), x), x)
  up = snn.SparseInverseConv3d(2, 3, strides=2, implementation="xla")  # padding "SAME": (0, 0, 0) on a 9^3 grid
  match = ("y was made from `like` .* padding=\\(1, 1, 1\\).* but this inverse has .* padding=\\(0, 0, 0\\).* "
           "spatial_shape=\\(8, 8, 8\\), this inverse on \\(9, 9, 9\\)")
  with pytest.raises(ValueError, match=match):
    up.init(jax.random.key(1), y, like=x)
  wi = _w((3, 3, 3, 4, 2))
  inverse = lambda y, like: jsparse.sparse_inverse_conv3d(y, wi, like=like, stride=2, padding=0,
                                                          implementation="xla").feats
  padded = x.replace(spatial_shape=(9, 9, 9))
  with pytest.raises(ValueError, match="y was made from `like`"):
    inverse(y, padded)
  assert "y was made from `like`" in _error(inverse, y, padded)
  # Kernel 2, stride 2, padding 0 maps the 8^3 grid and its 9^3 view onto one 4^3 grid by the same pairs.
  y2 = jsparse.sparse_conv3d(x, _w((2, 2, 2, CHANNELS, 4)), stride=2, implementation="xla")
  back = lambda like: jsparse.sparse_inverse_conv3d(y2, _w((2, 2, 2, 4, 2)), like=like, stride=2,
                                                    implementation="xla").feats
  np.testing.assert_allclose(np.asarray(back(padded)), np.asarray(back(x)), rtol=1e-6, atol=1e-6)


def test_concat_of_other_coordinates_under_jit():
  x = _x(seed=10)
  other = _other(x, 11)
  cat = lambda a, b: jsparse.concat(a, b).feats
  assert "concat: b is on other coordinates" in _error(cat, x, other)
  assert _error(cat, x, x.replace(feats=x.feats * 2)) is None
  # Padding rows' coordinates are read by no op: other values there are the same sites, jitted or not.
  assert int(x.num) < x.capacity
  repadded = x.replace(coords=jnp.where(jnp.arange(x.capacity)[:, None] < x.num, x.coords, 7))
  assert _error(cat, x, repadded) is None
  np.testing.assert_array_equal(np.asarray(cat(x, repadded)), np.asarray(cat(x, x)))
  jax.jit(cat)(x, other)  # without checkify it runs (trusted)
  with pytest.raises(ValueError, match="coords"):
    cat(x, other)


def test_pair_map_cache_of_another_batch_size():
  """sparse_conv3d with a PairMap `cache` built on the same coordinates under another batch_size: the output
  took the map's batch_size (a grid other than its input's, without a word); it raises ValueError."""
  x = _x(seed=13)
  w = _w((2, 2, 2, CHANNELS, 2))
  pm = jsparse.sparse_conv.pair_map(x, 2, 2, implementation="xla")
  wider = jsparse.SparseTensor(x.coords, x.feats, x.num, x.spatial_shape, x.batch_size + 1)
  with pytest.raises(ValueError, match="cache .* batch_size"):
    jsparse.sparse_conv3d(wider, w, stride=2, cache=pm, implementation="xla")
  assert jsparse.sparse_conv3d(x, w, stride=2, cache=pm, implementation="xla").batch_size == x.batch_size


def test_cache_of_the_wrong_kind():
  """A cache that is not the op's kind of map (the tensor's caches dict, the other op's map, an array) raised
  AttributeError from inside the op; it is a TypeError naming `cache`."""
  x = _x(seed=14)
  nc = jsparse.neighbor_map(x, 3, implementation="xla")
  pm = jsparse.sparse_conv.pair_map(x, 2, 2, implementation="xla")
  for wrong in (pm, {"k": nc}, nc.nbr):
    with pytest.raises(TypeError, match="cache must be a NeighborCache"):
      jsparse.submconv3d(x, _w((3, 3, 3, CHANNELS, 2)), cache=wrong, implementation="xla")
  for wrong in (nc, {"k": pm}):
    with pytest.raises(TypeError, match="cache must be a PairMap"):
      jsparse.sparse_conv3d(x, _w((2, 2, 2, CHANNELS, 2)), stride=2, cache=wrong, implementation="xla")
