"""Non-finite values and float16 range: padding rows never reach valid outputs, and sums run in float32."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jsparse


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_submconv_float16_input_gradient_sums_in_float32(implementation):
  """Every site of a full 5^3 grid; the weight is +100 on the first 13 offsets and -100 on the last 13, so an
  input gradient's partial sum over the offsets reaches 13 * 100 * 60 = 78000 > 65504 while every final value
  (at most 54000) fits float16. The XLA path's scatter-add summed in float16 and gave inf."""
  coords = np.argwhere(np.ones((1, 5, 5, 5), bool)).astype(np.int32)
  n = len(coords)
  x = jsparse.SparseTensor.from_coords(coords, np.ones((n, 2), np.float16), (5, 5, 5), 1, capacity=n + 3)
  s = np.zeros(27, np.float32)
  s[:13], s[14:] = 100, -100
  w = np.zeros((3, 3, 3, 2, 2), np.float16)
  w[..., 0, 0] = s.reshape(3, 3, 3)
  w[..., 1, 1] = 1
  w = jnp.asarray(w)
  ct = jnp.zeros((n + 3, 2), jnp.float16).at[:n, 0].set(60)
  _, vjp = jax.vjp(lambda f: jsparse.submconv3d(x.replace(feats=f), w, implementation=implementation).feats, x.feats)
  got = np.asarray(vjp(ct)[0], np.float32)
  dense_ct = jnp.zeros((1, 5, 5, 5, 2), jnp.float32).at[..., 0].set(60)
  conv = lambda d: lax.conv_general_dilated(d, w.astype(jnp.float32), (1, 1, 1), "SAME",
                                            dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
                                            precision=lax.Precision.HIGHEST)
  ref = np.asarray(jax.vjp(conv, dense_ct)[1](dense_ct)[0])[0, coords[:, 1], coords[:, 2], coords[:, 3]]
  assert np.abs(ref).max() > 50000  # near the float16 limit, which the partial sums pass
  assert np.all(np.isfinite(got))
  np.testing.assert_allclose(got[:n], ref, rtol=1e-3, atol=1e-3)
  np.testing.assert_array_equal(got[n:], 0)
