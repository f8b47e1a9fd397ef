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



def _float_scatters(jaxpr) -> list[str]:
  """Names of the scatter equations with floating outputs anywhere in a jaxpr (sub-jaxprs included)."""
  from jax.extend.core import jaxprs_in_params

  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name.startswith("scatter") and any(jnp.issubdtype(v.aval.dtype, jnp.floating)
                                                        for v in eqn.outvars):
      found.append(eqn.primitive.name)
    for sub in jaxprs_in_params(eqn.params):
      found += _float_scatters(sub)
  return found


@pytest.mark.parametrize("op", ["submconv", "strided"])
def test_xla_path_gradients_have_no_scatter(op):
  """The XLA path's input gradient was JAX's transpose of the gather, a scatter-add: XLA runs it with atomics on
  the GPU, so its float32 sums changed in the last bits from run to run. It is now a gather over the
  input-gradient map, as on the Pallas path; its gradients match the Pallas path's (interpret mode) and, for the
  submanifold convolution, the dense convolution's. (The generative transposed convolution's XLA path picks rows
  of one dense product; the transpose of that pick writes distinct slots, so nothing collides there.)"""
  rng = np.random.default_rng(7)
  coords = np.argwhere(rng.random((1, 6, 6, 6)) < 0.4).astype(np.int32)
  x = jsparse.SparseTensor.from_coords(coords, rng.standard_normal((len(coords), 3)).astype(np.float32), (6, 6, 6),
                                       1, capacity=len(coords) + 4)
  w = jnp.asarray(rng.standard_normal((3, 3, 3, 3, 5)).astype(np.float32))

  def conv(f, w, implementation):
    y = x.replace(feats=f)
    kw = dict(implementation=implementation, precision="highest")
    if op == "submconv":
      return jsparse.submconv3d(y, w, **kw).feats
    return jsparse.sparse_conv3d(y, w, stride=2, padding=1, out_capacity=64, **kw).feats

  def grads(implementation):
    return jax.grad(lambda f, w: jnp.sum(jnp.sin(conv(f, w, implementation))), argnums=(0, 1))

  assert _float_scatters(jax.make_jaxpr(grads("xla"))(x.feats, w).jaxpr) == []
  g_f, g_w = jax.jit(grads("xla"))(x.feats, w)
  p_f, p_w = jax.jit(grads("pallas"))(x.feats, w)
  np.testing.assert_allclose(np.asarray(g_f), np.asarray(p_f), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(g_w), np.asarray(p_w), rtol=1e-5, atol=1e-5)
  if op == "submconv":
    dense = lambda d: lax.conv_general_dilated(d, w, (1, 1, 1), "SAME",  # noqa: E731
                                               dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
                                               precision=lax.Precision.HIGHEST)
    occupied = jnp.zeros((1, 6, 6, 6, 1)).at[0, coords[:, 1], coords[:, 2], coords[:, 3]].set(1)
    d_ref = jax.grad(lambda d: jnp.sum(jnp.sin(dense(d)) * occupied))(x.todense())
    np.testing.assert_allclose(np.asarray(g_f)[:len(coords)],
                               np.asarray(d_ref)[0, coords[:, 1], coords[:, 2], coords[:, 3]], rtol=1e-4, atol=1e-5)
