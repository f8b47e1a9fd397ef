"""The real Triton kernels on a GPU against the XLA path (run with `make gpu-test`; skipped without a GPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from reference import random_sparse, rel_err
from test_submconv import CASES, _weights

pytestmark = pytest.mark.gpu


def shell_tensor(res, channels, dtype, seed=0, batch_size=1, pad=0):
  from benchmarks.workloads import sphere_shell_coords

  coords = sphere_shell_coords(res, batch_size)
  rng = np.random.default_rng(seed)
  feats = rng.standard_normal((len(coords), channels)).astype(np.float32)
  x = jsparse.SparseTensor.from_coords(coords, jnp.asarray(feats, dtype), (res,) * 3, batch_size,
                                       capacity=len(coords) + pad)
  return x


def _grads(x, w, b, cache, impl, precision, cot, algorithm="auto"):
  def loss(feats, w, b):
    y = jsparse.submconv3d(x.replace(feats=feats), w, b, dilation=cache.dilation, cache=cache, implementation=impl,
                           precision=precision, algorithm=algorithm)
    return jnp.sum(y.feats.astype(jnp.float32) * cot), y.feats

  (_, y), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x.feats, w, b)
  return y, g


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_gpu_random_cases_match_xla(case):
  shape, batch, ks, dil, cin, cout, _ = case
  rng = np.random.default_rng(100 + cin)
  x = random_sparse(rng, shape, cin, batch_size=batch, density=0.3, pad=9)
  w, b = _weights(rng, ks, cin, cout, True)
  cache_p = jsparse.neighbor_map(x, ks, dil, implementation="pallas")
  cache_x = jsparse.neighbor_map(x, ks, dil, implementation="xla")
  np.testing.assert_array_equal(np.asarray(cache_p.nbr), np.asarray(cache_x.nbr))
  cot = jnp.asarray(rng.standard_normal((x.capacity, cout)).astype(np.float32))
  yp, gp = _grads(x, w, b, cache_p, "pallas", "highest", cot)
  yx, gx = _grads(x, w, b, cache_x, "xla", "highest", cot)
  assert rel_err(yp, yx) < 1e-5
  for a, r in zip(gp, gx):
    assert rel_err(a, r) < 1e-5


# (RES, C, dtype, precision, tolerance); RES 512 is ~1.03M voxels.
SHELLS = [
    (64, 64, jnp.float16, None, 5e-3),
    (64, 256, jnp.bfloat16, None, 2e-2),
    (128, 32, jnp.float32, "tf32", 3e-3),
    (128, 32, jnp.float32, "highest", 1e-5),
    (256, 64, jnp.float16, None, 5e-3),
    (512, 16, jnp.float16, None, 5e-3),
    (512, 8, jnp.float32, "highest", 1e-5),
]


@pytest.mark.parametrize("res, c, dtype, precision, tol", SHELLS, ids=[f"{s[0]}-{s[1]}-{jnp.dtype(s[2]).name}-{s[3]}" for s in SHELLS])
def test_gpu_sphere_shells_match_xla(res, c, dtype, precision, tol):
  x = shell_tensor(res, c, dtype, pad=1000)
  rng = np.random.default_rng(res + c)
  w, b = _weights(rng, (3, 3, 3), c, c, True)
  w, b = w.astype(dtype), b.astype(dtype)
  cache_p = jsparse.neighbor_map(x, 3, implementation="pallas")
  cache_x = jsparse.neighbor_map(x, 3, implementation="xla")
  np.testing.assert_array_equal(np.asarray(cache_p.nbr), np.asarray(cache_x.nbr))
  cot = jnp.asarray(rng.standard_normal((x.capacity, c)).astype(np.float32))
  # Reference: the XLA path on float32 inputs at full precision.
  x32 = x.replace(feats=x.feats.astype(jnp.float32))
  yr, gr = _grads(x32, w.astype(jnp.float32), b.astype(jnp.float32), cache_x, "xla", "highest", cot)
  yp, gp = _grads(x, w, b, cache_p, "pallas", precision, cot)
  assert rel_err(yp.astype(jnp.float32), yr) < tol
  for a, r in zip(gp, gr):
    assert rel_err(a.astype(jnp.float32), r) < tol
  # Same inputs, same answer: a race would show as a difference between two runs.
  yp2, gp2 = _grads(x, w, b, cache_p, "pallas", precision, cot)
  np.testing.assert_array_equal(np.asarray(yp2), np.asarray(yp))
  np.testing.assert_array_equal(np.asarray(gp2[0]), np.asarray(gp[0]))


@pytest.mark.parametrize("algorithm", ["implicit", "implicit_splitk", "masked", "masked_splitk", "explicit"])
def test_gpu_every_algorithm_matches_xla(algorithm):
  x = shell_tensor(48, 48, jnp.float32, pad=300)
  rng = np.random.default_rng(9)
  w, b = _weights(rng, (3, 3, 3), 48, 40, True)
  cache_p = jsparse.neighbor_map(x, 3, implementation="pallas")
  cot = jnp.asarray(rng.standard_normal((x.capacity, 40)).astype(np.float32))
  yr, gr = _grads(x, w, b, cache_p, "xla", "highest", cot)
  yp, gp = _grads(x, w, b, cache_p, "pallas", "highest", cot, algorithm)
  assert rel_err(yp, yr) < 1e-5
  for a, r in zip(gp, gr):
    assert rel_err(a, r) < 1e-5
