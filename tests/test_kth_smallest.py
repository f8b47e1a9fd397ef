"""kth_smallest_if_over: the cut-off key of an overflowing site search, against numpy (interpret mode, Triton lowering,
and the real kernel on a GPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels.kth_smallest import NO_CUT, kth_smallest_if_over
from triton_lowering import lower_for_cuda

INT32_MAX = 2**31 - 1


def _table(rng, size, values):
  """Distinct non-negative values at random slots of an int32 [size] table, -1 elsewhere."""
  keys = np.full(size, -1, np.int32)
  keys[rng.choice(size, size=len(values), replace=False)] = values
  return keys


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), log_size=st.integers(4, 11), fill=st.floats(0.0, 1.0),
       top=st.sampled_from([8, 1000, 2**20, INT32_MAX]), data=st.data())
def test_matches_numpy_when_over_and_passes_when_not(seed, log_size, fill, top, data):
  rng = np.random.default_rng(seed)
  size = 2**log_size
  n = min(int(fill * size), top)
  values = rng.choice(top, size=n, replace=False) if top <= 2**20 else np.unique(rng.integers(0, top, 2 * n + 1))[:n]
  n = len(values)
  keys = jnp.asarray(_table(rng, size, values))
  block = data.draw(st.sampled_from([16, 64, 1024]))
  if n >= 1:
    k = data.draw(st.integers(1, n))
    got = kth_smallest_if_over(keys, n, k=k, limit=k - 1, interpret=True, block=block)
    assert int(got) == int(np.sort(values)[k - 1])
  # Not over the limit: no cut, whatever k says.
  assert int(kth_smallest_if_over(keys, n, k=max(n, 1), limit=n, interpret=True, block=block)) == NO_CUT


def test_keys_at_the_ends_of_the_int32_range():
  keys = jnp.asarray(_table(np.random.default_rng(0), 64, [0, 1, INT32_MAX - 1, INT32_MAX - 2, 2**30]))
  for k, want in [(1, 0), (2, 1), (3, 2**30), (4, INT32_MAX - 2), (5, INT32_MAX - 1)]:
    assert int(kth_smallest_if_over(keys, 5, k=k, limit=0, interpret=True, block=16)) == want


def test_count_is_traced_under_jit():
  keys = jnp.asarray(_table(np.random.default_rng(1), 256, np.arange(100, 300, 2)))
  f = jax.jit(lambda keys, count: kth_smallest_if_over(keys, count, k=10, limit=50, interpret=True))
  assert int(f(keys, jnp.int32(100))) == 118
  assert int(f(keys, jnp.int32(50))) == NO_CUT


def test_bad_arguments():
  keys = jnp.zeros((64,), jnp.int32)
  with pytest.raises(ValueError, match="k must be"):
    kth_smallest_if_over(keys, 1, k=0, limit=0, interpret=True)
  with pytest.raises(ValueError, match="block must be"):
    kth_smallest_if_over(keys, 1, k=1, limit=0, block=24, interpret=True)
  with pytest.raises(ValueError, match="multiple of block"):
    kth_smallest_if_over(jnp.zeros((96,), jnp.int32), 1, k=1, limit=0, block=64, interpret=True)


def test_lowers_to_triton():
  text = lower_for_cuda(lambda keys, count: kth_smallest_if_over(keys, count, k=1000, limit=5000),
                        jax.ShapeDtypeStruct((2**16,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))
  assert "triton" in text


@pytest.mark.gpu
@pytest.mark.parametrize("size", [2**12, 2**21])
def test_gpu_matches_numpy(size):
  rng = np.random.default_rng(size)
  values = np.unique(rng.integers(0, INT32_MAX, size // 2))
  keys = jnp.asarray(_table(rng, size, values))
  for k in (1, len(values) // 3, len(values)):
    assert int(kth_smallest_if_over(keys, len(values), k=k, limit=k - 1)) == int(np.sort(values)[k - 1])
  assert int(kth_smallest_if_over(keys, len(values), k=5, limit=len(values))) == NO_CUT
