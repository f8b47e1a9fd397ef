"""Review of the convolution geometry and pooling ops: regressions for defects an adversarial review found."""
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse


@pytest.mark.parametrize("op", ["conv", "pool", "transpose"])
def test_positions_past_int32_raise_naming_the_sizes(op):
  """Kernel 1, stride 2**30, padding 2**31 - 2 on a 4^3 grid: the output grid is 4 per axis and output 2 reads input
  position 2, but position + padding wrapped in int32 and the site at (0, 2, 2, 2) was dropped without a word (no
  output sites). Sizes whose positions leave int32 now raise a ValueError naming them."""
  x = jsparse.SparseTensor.from_coords(np.array([[0, 2, 2, 2]], np.int32), np.ones((1, 1), np.float32), (4, 4, 4))
  w = jnp.ones((1, 1, 1, 1, 1))
  calls = {"conv": lambda: jsparse.sparse_conv3d(x, w, stride=2**30, padding=2**31 - 2),
           "pool": lambda: jsparse.sparse_max_pool3d(x, 1, 2**30, 2**31 - 2),
           "transpose": lambda: jsparse.sparse_conv_transpose3d(x, w, stride=2**31)}  # was an OverflowError
  with pytest.raises(ValueError, match=r"padding=.* must each stay below 2\*\*31"):
    calls[op]()


def test_positions_past_int32_in_a_lower_rank():
  x = jsparse.SparseTensor.from_coords(np.array([[0, 2]], np.int32), np.ones((1, 1), np.float32), (4,))
  with pytest.raises(ValueError, match=r"stride=\(1073741824,\), padding=\(2147483646,\)"):
    jsparse.sparse_conv1d(x, jnp.ones((1, 1, 1)), stride=2**30, padding=2**31 - 2)


def test_numpy_int_feature_group_count():
  """feature_group_count=np.int64(2) was refused ("must be a positive int, got np.int64(2)") where every other size
  takes numpy ints; it now runs, and equals the Python int's result."""
  rng = np.random.default_rng(0)
  x = jsparse.SparseTensor.from_coords(np.array([[0, 1, 1, 1], [0, 1, 2, 1]], np.int32),
                                       rng.standard_normal((2, 4)).astype(np.float32), (4, 4, 4))
  w = jnp.asarray(rng.standard_normal((3, 3, 3, 2, 4)), jnp.float32)
  got = jsparse.submconv3d(x, w, feature_group_count=np.int64(2))
  want = jsparse.submconv3d(x, w, feature_group_count=2)
  np.testing.assert_array_equal(np.asarray(got.feats), np.asarray(want.feats))
  with pytest.raises(ValueError, match="feature_group_count"):
    jsparse.submconv3d(x, w, feature_group_count=np.bool_(True))
