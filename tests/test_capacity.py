"""Capacities jsparse picks for the user are buckets (round_capacity), so a jitted step over batches of varying
size compiles a handful of times, not once per batch; "exact" asks for the count; bad values are clear errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jsparse


def _cloud(rng, n, shape=(16, 16, 16)):
  flat = rng.choice(int(np.prod(shape)), n, replace=False)
  coords = np.stack(np.unravel_index(flat, shape), 1).astype(np.int32)
  return coords, rng.standard_normal((n, 3)).astype(np.float32)


def test_from_coords_and_from_dense_default_to_a_bucket():
  rng = np.random.default_rng(0)
  coords, feats = _cloud(rng, 300)
  x = jsparse.SparseTensor.from_coords(coords, feats, (16, 16, 16))
  assert x.capacity == jsparse.round_capacity(300) == 384 and int(x.num) == 300
  assert jsparse.SparseTensor.from_coords(coords, feats, (16, 16, 16), capacity="exact").capacity == 300
  assert jsparse.SparseTensor.from_coords(coords, feats, (16, 16, 16), capacity=1000).capacity == 1000
  d = jsparse.SparseTensor.from_dense(x.todense())
  assert d.capacity == 384 and int(d.num) == 300
  assert jsparse.SparseTensor.from_dense(x.todense(), capacity="exact").capacity == 300
  for bad, err in (("all", TypeError), (300.0, TypeError), (-1, ValueError), (True, TypeError)):
    with pytest.raises(err, match="capacity"):
      jsparse.SparseTensor.from_coords(coords, feats, (16, 16, 16), capacity=bad)


def test_jitted_step_over_varying_batches_compiles_per_bucket():
  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.standard_normal((3, 3, 3, 3, 4)) * 0.1, jnp.float32)

  @jax.jit
  def step(x, w):
    return jnp.sum(jsparse.submconv3d(x, w, implementation="xla").feats ** 2)

  sizes = rng.integers(150, 500, 20)
  for n in sizes:
    step(jsparse.SparseTensor.from_coords(*_cloud(rng, int(n)), (16, 16, 16)), w)
  buckets = {jsparse.round_capacity(int(n)) for n in sizes}
  assert step._cache_size() == len(buckets) <= 3  # exact capacities would have compiled ~20 times


def test_ops_pick_bucketed_output_capacities_outside_jit():
  rng = np.random.default_rng(2)
  x = jsparse.SparseTensor.from_coords(*_cloud(rng, 400), (16, 16, 16))
  w = jnp.ones((2, 2, 2, 3, 2), jnp.float32)
  for op in (lambda **kw: jsparse.sparse_conv3d(x, w, stride=2, implementation="xla", **kw),
             lambda **kw: jsparse.sparse_max_pool3d(x, 2, implementation="xla", **kw),
             lambda **kw: jsparse.sparse_conv_transpose3d(x, w, stride=2, implementation="xla", **kw)):
    y, exact = op(), op(out_capacity="exact")
    assert int(y.num) == int(exact.num) == exact.capacity
    assert y.capacity == jsparse.round_capacity(int(y.num))
    np.testing.assert_array_equal(np.asarray(y.feats[: int(y.num)]), np.asarray(exact.feats))
    with pytest.raises(TypeError, match="out_capacity"):
      op(out_capacity="bucket")
  with pytest.raises(TypeError, match="under jax.jit"):
    jax.jit(lambda x: jsparse.sparse_max_pool3d(x, 2, implementation="xla").feats)(x)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 2**30), steps=st.sampled_from([1, 2, 4, 8, 16]), minimum=st.sampled_from([1, 64, 128]))
def test_round_capacity_is_a_bounded_bucket(n, steps, minimum):
  """A bucket holds n, is a multiple of its step, and pads by less than one step: under n / steps_per_octave
  once the step exceeds `minimum` (the default's 12.5% bound), else under `minimum` rows."""
  cap = jsparse.round_capacity(n, steps, minimum)
  assert cap >= max(n, minimum) and cap % minimum == 0
  m = max(n, minimum)
  step = max((1 << (m.bit_length() - 1)) // steps, minimum)
  assert cap % step == 0 and cap - m < step
  if n >= minimum:
    assert cap - n < max(n / steps, minimum)
  else:
    assert cap == minimum


def test_default_buckets_pad_under_an_eighth():
  for n in (1_071_607, 1 << 20, (1 << 20) + 1, 300_001, 5_000_000):
    cap = jsparse.round_capacity(n)
    assert n <= cap < n * 1.125, (n, cap)
  assert jsparse.round_capacity(1_071_607) == 1_179_648  # the LiDAR UNet's input: 10% padding (4 a power: 22%)
