"""Property-based tests (hypothesis, few examples so CI stays fast) over random valid sparse tensors, XLA path.

Every op against its dense reference (values and gradients), padding rows kept empty through a chain of ops,
determinism of a chain, and bad arguments of every family raising the documented error type. Shapes come from
a small fixed set and every tensor has one capacity, so the examples share compilations; the computations are
jitted once at module scope (geometry static), so that an example compiles a few programs, not each op eagerly.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax

import jsparse
from jsparse import norm
from reference import dense_submconv_at_sites, rel_err

FEW = settings(max_examples=6, deadline=None)
CAPACITY = 96
SHAPES = st.sampled_from([(5, 4, 6), (6, 6, 3), (4, 7, 5)])
XLA = "xla"


def _tensor(seed: int, shape, channels: int, batch: int = 2, density: float = 0.25, dtype=np.float32):
  """A random tensor of CAPACITY rows (shuffled sites, the rest padding), at least one site."""
  rng = np.random.default_rng(seed)
  mask = rng.random((batch,) + tuple(shape)) < density
  mask.reshape(-1)[rng.integers(mask.size)] = True
  coords = np.argwhere(mask).astype(np.int32)[: CAPACITY - 3]
  coords = coords[rng.permutation(len(coords))]
  feats = rng.standard_normal((len(coords), channels)).astype(dtype)
  return jsparse.SparseTensor.from_coords(coords, feats, shape, batch, capacity=CAPACITY), rng


def _at_sites(dense, x: jsparse.SparseTensor):
  """dense[b, x, y, z] at x's valid rows, zeros at padding rows."""
  valid = x.valid_mask()
  c = jnp.where(valid[:, None], x.coords, 0)
  return jnp.where(valid[:, None], dense[c[:, 0], c[:, 1], c[:, 2], c[:, 3]], 0)


def _dense_conv(dense, w, stride, padding, dilation):
  return lax.conv_general_dilated(dense, w, (stride,) * 3, [(padding, padding)] * 3, rhs_dilation=(dilation,) * 3,
                                  dimension_numbers=("NDHWC", "DHWIO", "NDHWC"), precision=lax.Precision.HIGHEST)


def _padding_rows_empty(t: jsparse.SparseTensor) -> None:
  num = int(t.num)
  assert np.all(np.asarray(t.feats)[num:] == 0), "padding rows must hold zero features"
  assert np.all(np.asarray(t.coords)[num:] == -1), "padding rows must hold coordinates -1"


@functools.partial(jax.jit, static_argnames="dilation")
def _submconv_sparse_and_dense_value_and_grads(x, w, b, probe, dilation):
  """((loss, out), gradients w.r.t. feats, w, b) of the sparse submconv and of the dense reference."""

  def sparse_loss(feats, w, b):
    y = jsparse.submconv3d(x.replace(feats=feats), w, b, dilation=dilation, implementation=XLA,
                           precision="highest")
    return jnp.sum(y.feats * probe), y.feats

  def dense_loss(feats, w, b):
    y = dense_submconv_at_sites(x, feats, w, b, dilation=dilation)
    return jnp.sum(y * probe), y

  return (jax.value_and_grad(sparse_loss, argnums=(0, 1, 2), has_aux=True)(x.feats, w, b),
          jax.value_and_grad(dense_loss, argnums=(0, 1, 2), has_aux=True)(x.feats, w, b))


@FEW
@given(seed=st.integers(0, 2**16), shape=SHAPES, ks=st.sampled_from([1, 3]), dilation=st.sampled_from([1, 2]))
def test_submconv_values_and_gradients_match_dense(seed, shape, ks, dilation):
  x, rng = _tensor(seed, shape, 3)
  w = jnp.asarray(rng.standard_normal((ks, ks, ks, 3, 4)).astype(np.float32))
  b = jnp.asarray(rng.standard_normal(4).astype(np.float32))
  probe = jnp.where(x.valid_mask()[:, None], jnp.asarray(rng.standard_normal((CAPACITY, 4)), jnp.float32), 0)
  ((_, ys), gs), ((_, yd), gd) = _submconv_sparse_and_dense_value_and_grads(x, w, b, probe, dilation)
  assert rel_err(ys, yd) < 1e-5
  for a, r in zip(gs, gd):
    assert rel_err(a, r) < 1e-5


@functools.partial(jax.jit, static_argnames=("stride", "padding"))
def _strided_sparse_and_dense(x, w, stride, padding):
  """The sparse strided conv, the dense conv, and the dense grid's positions whose receptive field holds a site."""
  ks = w.shape[0]
  y = jsparse.sparse_conv3d(x, w, stride=stride, padding=padding, out_capacity=4 * CAPACITY, implementation=XLA,
                            precision="highest")
  dense = _dense_conv(x.todense(), w, stride, padding, 1)
  occupied = _dense_conv(x.replace(feats=jnp.ones_like(x.feats[:, :1])).todense(), jnp.ones((ks, ks, ks, 1, 1)),
                         stride, padding, 1)[..., 0] > 0
  return y, dense, occupied


@functools.partial(jax.jit, static_argnames=("stride", "padding"))
def _strided_sparse_and_dense_grads(x, w, y, probe, stride, padding):
  """Gradients w.r.t. feats and w of the sparse conv and of the dense conv read at y's sites, through probe."""

  def sparse_loss(feats, w):
    out = jsparse.sparse_conv3d(x.replace(feats=feats), w, stride=stride, padding=padding,
                                out_capacity=4 * CAPACITY, implementation=XLA, precision="highest")
    return jnp.sum(out.feats * probe)

  def dense_loss(feats, w):
    return jnp.sum(_at_sites(_dense_conv(x.replace(feats=feats).todense(), w, stride, padding, 1), y) * probe)

  return jax.grad(sparse_loss, argnums=(0, 1))(x.feats, w), jax.grad(dense_loss, argnums=(0, 1))(x.feats, w)


@FEW
@given(seed=st.integers(0, 2**16), shape=SHAPES, ks=st.sampled_from([2, 3]), stride=st.sampled_from([1, 2]),
       padding=st.sampled_from([0, 1]))
def test_strided_conv_values_sites_and_gradients_match_dense(seed, shape, ks, stride, padding):
  """Output sites are the positions whose receptive field holds a valid input; values and gradients equal
  lax.conv_general_dilated with explicit padding there, and the dense output is zero everywhere else."""
  x, rng = _tensor(seed, shape, 2)
  w = jnp.asarray(rng.standard_normal((ks, ks, ks, 2, 3)).astype(np.float32))
  y, dense, occupied = _strided_sparse_and_dense(x, w, stride, padding)
  _padding_rows_empty(y)
  sites = np.argwhere(np.asarray(occupied))
  got = np.asarray(y.coords)[: int(y.num)]
  np.testing.assert_array_equal(np.asarray(sorted(map(tuple, got.tolist()))), sites.reshape(-1, 4))
  assert rel_err(y.feats, _at_sites(dense, y)) < 1e-5
  assert np.all(np.asarray(dense)[~np.asarray(occupied)] == 0)
  probe = jnp.asarray(rng.standard_normal((4 * CAPACITY, 3)), jnp.float32)
  for a, r in zip(*_strided_sparse_and_dense_grads(x, w, y, probe, stride, padding)):
    assert rel_err(a, r) < 1e-5


@FEW
@given(seed=st.integers(0, 2**16), shape=SHAPES)
def test_transposed_conv_children_match_dense(seed, shape):
  """Each valid site c spawns its 8 children 2c + t with x[c] @ w[t]: lax.conv_transpose with kernel == stride."""
  x, rng = _tensor(seed, shape, 3)
  w = jnp.asarray(rng.standard_normal((2, 2, 2, 3, 2)).astype(np.float32))
  y, dense_at_sites = _transposed_sparse_and_dense(x, w)
  _padding_rows_empty(y)
  assert int(y.num) == 8 * int(x.num)
  assert rel_err(y.feats, dense_at_sites) < 1e-5


@jax.jit
def _transposed_sparse_and_dense(x, w):
  """The sparse transposed conv (kernel == stride 2) and the dense lax.conv_transpose read at its sites."""
  y = jsparse.sparse_conv_transpose3d(x, w, stride=2, out_capacity=8 * CAPACITY, implementation=XLA,
                                      precision="highest")
  # The docstring's equivalence: lax.conv_transpose with the kernel flipped (child t gets w[t]).
  dense = lax.conv_transpose(x.todense(), jnp.flip(w, (0, 1, 2)), (2, 2, 2), "VALID",
                             dimension_numbers=("NDHWC", "DHWIO", "NDHWC"), precision=lax.Precision.HIGHEST)
  return y, _at_sites(dense, y)


@FEW
@given(seed=st.integers(0, 2**16), shape=SHAPES, dtype=st.sampled_from([np.float32, np.float16]))
def test_chain_keeps_padding_rows_empty_and_is_deterministic(seed, shape, dtype):
  """submconv -> batch norm + ReLU -> strided conv -> max pool -> group norm -> inverse conv: after every op the
  padding rows hold zero features and -1 coordinates, and running the chain twice gives identical bits."""
  x, rng = _tensor(seed, shape, 4, dtype=dtype)
  ws = [jnp.asarray(rng.standard_normal(s).astype(dtype) * 0.3) for s in [(3, 3, 3, 4, 4), (2, 2, 2, 4, 6),
                                                                           (2, 2, 2, 6, 4)]]
  first, second = _chain(x, ws), _chain(x, ws)
  for a, b in zip(first, second):
    _padding_rows_empty(a)
    np.testing.assert_array_equal(np.asarray(a.feats), np.asarray(b.feats))
    np.testing.assert_array_equal(np.asarray(a.coords), np.asarray(b.coords))
    assert np.all(np.isfinite(np.asarray(a.feats, np.float32)))


@jax.jit
def _chain(x, ws):
  """The chain's output after every stage (jitted once: examples of the same shape and dtype share it)."""
  stages = [jsparse.submconv3d(x, ws[0], implementation=XLA)]
  stages.append(norm.batch_norm(stages[-1], activation=jax.nn.relu))
  stages.append(jsparse.sparse_conv3d(stages[-1], ws[1], stride=2, out_capacity=CAPACITY, implementation=XLA))
  stages.append(jsparse.sparse_max_pool3d(stages[-1], 1, 1, out_capacity=CAPACITY))
  stages.append(norm.group_norm(stages[-1], 2))
  stages.append(jsparse.sparse_inverse_conv3d(stages[-1], ws[2], like=stages[1], stride=2, implementation=XLA))
  return stages


_BAD_STATIC = [2.5, "3", True, None, -1, 0]


@settings(max_examples=12, deadline=None)
@given(bad=st.sampled_from(_BAD_STATIC), which=st.sampled_from(["stride", "padding", "dilation", "out_capacity",
                                                                "kernel_size"]))
def test_bad_static_arguments_raise_documented_errors(bad, which):
  """Every static size argument: a non-int (float, str, bool) raises TypeError, a value out of range raises
  ValueError naming the argument; None is allowed only where documented (out_capacity)."""
  x, rng = _tensor(1, (4, 4, 4), 2)
  w = jnp.ones((3, 3, 3, 2, 2))
  if which == "kernel_size":
    call = lambda: jsparse.sparse_max_pool3d(x, bad, 1)  # noqa: E731
  else:
    kwargs = dict(stride=2, padding=1, dilation=1, out_capacity=None)
    kwargs[which] = bad
    call = lambda: jsparse.sparse_conv3d(x, w, implementation=XLA, **kwargs)  # noqa: E731
  if (bad is None and which == "out_capacity") or (bad == 0 and which == "padding" and bad is not False):
    call()  # documented: None is round_capacity of the number of sites; padding 0 is valid
    return
  is_int = isinstance(bad, int) and not isinstance(bad, bool)
  with pytest.raises(ValueError if is_int else TypeError) as info:
    call()
  assert which in str(info.value), str(info.value)


@settings(max_examples=8, deadline=None)
@given(shape=st.sampled_from([(3, 3, 3, 3), (3, 3, 3, 5, 4), (2, 3, 3, 2, 4), (3, 3, 3, 2)]))
def test_bad_weight_shapes_raise_value_error(shape):
  x, _ = _tensor(2, (4, 4, 4), 2)
  with pytest.raises(ValueError, match="weight|kernel"):
    jsparse.submconv3d(x, jnp.ones(shape), implementation=XLA)
