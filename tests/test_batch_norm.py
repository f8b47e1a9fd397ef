"""The one-unit batch norm (statistics, normalisation, affine, activation; custom_vjp) against plain autodiff
of the textbook formula on the valid rows: values, gradients of feats / scale / bias and of the returned
statistics, half precision, padding rows, and means far from zero."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from benchmarks import networks
from jsparse import norm
from reference import rel_err


def _tensor(rng, n, pad, c, dtype, offset=0.0, spread=1.0):
  feats = np.zeros((n + pad, c), np.float32)
  feats[:n] = rng.standard_normal((n, c)) * spread + offset
  coords = np.full((n + pad, 4), -1, np.int32)
  coords[:n] = np.stack([np.zeros(n), np.arange(n) % 7, np.arange(n) // 7 % 7, np.arange(n) // 49], 1)
  return jsparse.SparseTensor(jnp.asarray(coords), jnp.asarray(feats, dtype), jnp.asarray(n, jnp.int32), (7, 7, 9), 1)


def _reference(f, scale, bias, n, eps, act):
  v = f[:n].astype(jnp.float32)
  mean, var = jnp.mean(v, 0), jnp.var(v, 0)
  y = (v - mean) / jnp.sqrt(var + eps) * scale + bias
  y = act(y) if act is not None else y
  return jnp.concatenate([y, jnp.zeros((f.shape[0] - n, f.shape[1]))]), mean, var


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.float16, 3e-3), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("act", [None, jax.nn.relu, jax.nn.silu], ids=["none", "relu", "silu"])
def test_batch_norm_values_and_gradients(dtype, tol, act):
  rng = np.random.default_rng(0)
  n, pad, c, eps = 300, 13, 6, 1e-5
  x = _tensor(rng, n, pad, c, dtype, offset=3.0, spread=2.0)
  scale = jnp.asarray(rng.standard_normal(c) + 1, jnp.float32)
  bias = jnp.asarray(rng.standard_normal(c), jnp.float32)
  w_y = jnp.asarray(rng.standard_normal((n + pad, c)), jnp.float32)
  w_m, w_v = jnp.asarray(rng.standard_normal(c), jnp.float32), jnp.asarray(rng.standard_normal(c), jnp.float32)

  def loss_fused(f, s, b):
    y, (m, v) = norm.batch_norm(x.replace(feats=f), s, b, epsilon=eps, activation=act, return_statistics=True)
    return jnp.sum(y.feats.astype(jnp.float32) * w_y) + jnp.sum(m * w_m) + jnp.sum(v * w_v)

  def loss_ref(f, s, b):
    y, m, v = _reference(f, s, b, n, eps, act)
    return jnp.sum(y * w_y) + jnp.sum(m * w_m) + jnp.sum(v * w_v)

  y = norm.batch_norm(x, scale, bias, epsilon=eps, activation=act)
  assert y.dtype == dtype
  want, _, _ = _reference(x.feats, scale, bias, n, eps, act)
  assert rel_err(y.feats, want) < tol
  assert np.all(np.asarray(y.feats[n:]) == 0)
  got = jax.jit(jax.grad(loss_fused, argnums=(0, 1, 2)))(x.feats, scale, bias)
  ref = jax.jit(jax.grad(loss_ref, argnums=(0, 1, 2)))(x.feats.astype(jnp.float32), scale, bias)
  assert got[0].dtype == dtype
  for g, r in zip(got, ref):
    assert rel_err(g, r) < tol * 5
  assert np.all(np.asarray(got[0][n:]) == 0)


def test_batch_norm_backward_recomputes_the_activation_derivative_per_pass():
  """The dx pass computes ReLU's derivative again behind a barrier, so XLA cannot share one [rows, C] mask
  between it and the reduction pass (on a GPU it wrote that mask as a pass of its own: docs/perf_notes.md).
  Without an activation nothing is recomputed."""
  x = _tensor(np.random.default_rng(1), 50, 3, 4, jnp.float16)

  def program(act):
    def loss(f):
      return jnp.sum(norm.batch_norm(x.replace(feats=f), jnp.ones(4), jnp.zeros(4), activation=act).feats)
    return jax.jit(jax.grad(loss)).lower(x.feats).as_text()

  with_relu, without = program(jax.nn.relu), program(None)
  # With one mask shared by both passes the program held two such comparisons; now the dx pass has its own.
  assert with_relu.count("GT") == 3, with_relu.count("GT")
  assert with_relu.count("optimization_barrier") == without.count("optimization_barrier") + 1


def test_batch_norm_statistics_accurate_far_from_zero():
  """One-pass moments about the first row: a mean of 1000 with spread 0.1 keeps its variance (sums about zero
  would cancel it away in float32)."""
  rng = np.random.default_rng(1)
  x = _tensor(rng, 5000, 3, 4, jnp.float32, offset=1000.0, spread=0.1)
  _, (mean, var) = norm.batch_norm(x, return_statistics=True)
  f = np.asarray(x.feats[:5000], np.float64)
  np.testing.assert_allclose(np.asarray(mean), f.mean(0), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(var), f.var(0), rtol=1e-3)


def test_batch_statistics_of_a_constant_channel_are_exact():
  """batch_statistics on one device adds back the mean of the rows centred on its mean, as its cross-device
  combination does: 300 rows of 12345.678 gave a mean 1 ulp off (XLA divides by the count as a product with its
  rounded reciprocal), and batch_norm with those statistics gave +-0.3 instead of 0. The variance is the centred
  mean square less the centred mean's square, two roundings of ~1e-6 that need not cancel exactly (5.7e-14 on an
  H200): it must stay orders of magnitude below epsilon, where it cannot move the normalised rows."""
  x = _tensor(np.random.default_rng(4), 300, 3, 2, jnp.float32)
  x = x.replace(feats=jnp.where(x.valid_mask()[:, None], jnp.float32(12345.678), 0))
  mean, var = norm.batch_statistics(x)
  np.testing.assert_array_equal(np.asarray(mean), np.float32(12345.678))
  assert np.all((np.asarray(var) >= 0) & (np.asarray(var) < 1e-12)), var
  np.testing.assert_array_equal(np.asarray(norm.batch_norm(x, mean=mean, var=var).feats), 0.0)


def test_batch_norm_empty_and_module_matches_functional():
  x = _tensor(np.random.default_rng(2), 0, 5, 3, jnp.float32)
  y = norm.batch_norm(x, activation=jax.nn.relu)
  assert np.all(np.asarray(y.feats) == 0)
  x = _tensor(np.random.default_rng(3), 50, 5, 3, jnp.float32, offset=1.0)
  bn = jsparse.nn.SparseBatchNorm(activation=jax.nn.relu, momentum=0.5)
  variables = bn.init(jax.random.key(0), x, use_running_average=False)
  y, state = bn.apply(variables, x, use_running_average=False, mutable=["batch_stats"])
  want = norm.activation(norm.batch_norm(x), jax.nn.relu)
  np.testing.assert_allclose(np.asarray(y.feats), np.asarray(want.feats), rtol=1e-5, atol=1e-6)
  f = np.asarray(x.feats[:50], np.float64)
  np.testing.assert_allclose(np.asarray(state["batch_stats"]["mean"]), 0.5 * f.mean(0), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(state["batch_stats"]["var"]), 0.5 + 0.5 * f.var(0), rtol=1e-4)


def test_running_averages_skip_batches_without_rows():
  """A batch without valid rows (num 0; with axis_name, on every device) has no statistics: the running mean and
  var stay as they are, in jsparse.nn and jsparse.nnx (they once moved towards the placeholders 0 and 0, so an
  eval after such a step divided by a shrunken variance). A batch with rows on one device only still counts."""
  from flax import nnx

  x = _tensor(np.random.default_rng(5), 50, 5, 3, jnp.float32, offset=4.0, spread=3.0)
  empty = x.replace(num=0)
  f = np.asarray(x.feats[:50], np.float64)
  after_x = (0.5 * f.mean(0), 0.5 + 0.5 * f.var(0))  # from the initial (0, 1) with momentum 0.5

  bn = jsparse.nn.SparseBatchNorm(use_running_average=False, momentum=0.5)
  variables = bn.init(jax.random.key(0), x)
  step = jax.jit(lambda v, t: bn.apply(v, t, mutable=["batch_stats"])[1])
  stats = step(variables, x)
  np.testing.assert_allclose(np.asarray(stats["batch_stats"]["mean"]), after_x[0], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(stats["batch_stats"]["var"]), after_x[1], rtol=1e-5)
  unchanged = step({**variables, **stats}, empty)
  jax.tree.map(np.testing.assert_array_equal, unchanged, stats)

  module = jsparse.nnx.SparseBatchNorm(3, momentum=0.5, rngs=nnx.Rngs(0))
  module(x)
  before = (np.asarray(module.mean[...]), np.asarray(module.var[...]))
  np.testing.assert_allclose(before[1], after_x[1], rtol=1e-5)
  module(empty)
  np.testing.assert_array_equal(np.asarray(module.mean[...]), before[0])
  np.testing.assert_array_equal(np.asarray(module.var[...]), before[1])

  pooled = jsparse.nn.SparseBatchNorm(use_running_average=False, momentum=0.5, axis_name="d")
  run = jax.vmap(lambda t: pooled.apply(variables, t, mutable=["batch_stats"])[1], axis_name="d")
  stack = lambda *ts: jax.tree.map(lambda *a: jnp.stack(a), *ts)  # noqa: E731
  none = run(stack(empty, empty))
  jax.tree.map(lambda got, want: np.testing.assert_array_equal(got, np.stack([want, want])), none,
               {"batch_stats": variables["batch_stats"]})
  one = run(stack(empty, x))
  for device in range(2):
    np.testing.assert_allclose(np.asarray(one["batch_stats"]["var"][device]), after_x[1], rtol=1e-5)


def test_data_parallel_batch_norm_pools_the_row_count_once():
  """With axis_name, one cross-device reduction per layer and step: the pooled row count that decides whether a
  batch had rows comes with the pooled statistics (it once took a second psum, a second synchronisation point of
  a data-parallel step), in jsparse.nn and jsparse.nnx. The running averages equal one device's on all the rows
  together, and stay as they are when no device has a row."""
  from flax import nnx

  rng = np.random.default_rng(6)
  parts = [_tensor(rng, 40, 10, 3, jnp.float32, offset=2.0, spread=1.5),
           _tensor(rng, 17, 33, 3, jnp.float32, offset=-1.0, spread=0.5)]
  stack = lambda *ts: jax.tree.map(lambda *a: jnp.stack(a), *ts)  # noqa: E731
  rows = [np.asarray(p.feats[:int(p.num)]) for p in parts]
  whole = _tensor(rng, 57, 3, 3, jnp.float32)  # all the rows on one device (coordinates do not enter)
  whole = whole.replace(feats=jnp.asarray(np.concatenate(rows + [np.zeros((3, 3), np.float32)])))
  bn = jsparse.nn.SparseBatchNorm(use_running_average=False, momentum=0.5)
  pooled = jsparse.nn.SparseBatchNorm(use_running_average=False, momentum=0.5, axis_name="d")
  variables = bn.init(jax.random.key(0), whole)
  one_device = bn.apply(variables, whole, mutable=["batch_stats"])[1]["batch_stats"]
  f = np.concatenate(rows).astype(np.float64)
  np.testing.assert_allclose(np.asarray(one_device["mean"]), 0.5 * f.mean(0), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(one_device["var"]), 0.5 + 0.5 * f.var(0), rtol=1e-5)

  step = lambda v, t: pooled.apply(v, t, mutable=["batch_stats"])  # noqa: E731
  assert str(jax.make_jaxpr(step, axis_env=[("d", 2)])(variables, parts[0])).count("psum[") == 1
  run = jax.jit(jax.vmap(lambda t: step(variables, t)[1]["batch_stats"], axis_name="d"))
  got = run(stack(*parts))
  for device in range(2):
    for k in ("mean", "var"):
      np.testing.assert_allclose(np.asarray(got[k][device]), np.asarray(one_device[k]), rtol=1e-5, atol=1e-6)
  none = run(stack(*(p.replace(num=0) for p in parts)))
  for k in ("mean", "var"):
    np.testing.assert_array_equal(np.asarray(none[k]), np.stack([variables["batch_stats"][k]] * 2))

  module = jsparse.nnx.SparseBatchNorm(3, momentum=0.5, axis_name="d", rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(module)

  def member(state, t):
    model = nnx.merge(graphdef, state)
    model(t)
    return nnx.state(model, nnx.BatchStat)

  assert str(jax.make_jaxpr(member, axis_env=[("d", 2)])(state, parts[0])).count("psum[") == 1
  run = jax.jit(jax.vmap(member, in_axes=(None, 0), axis_name="d"))
  got = run(state, stack(*parts))
  for device in range(2):
    for k in ("mean", "var"):
      np.testing.assert_allclose(np.asarray(got[k][...][device]), np.asarray(one_device[k]), rtol=1e-5, atol=1e-6)
  none = run(state, stack(*(p.replace(num=0) for p in parts)))
  for k in ("mean", "var"):
    np.testing.assert_array_equal(np.asarray(none[k][...]), np.stack([np.asarray(state[k][...])] * 2))


def test_batch_statistics_return_count():
  """return_count adds the number of valid rows the statistics are over: x's own, or every device's with
  axis_name (the sum of the members' rows, in float32, on every member)."""
  rng = np.random.default_rng(8)
  x = _tensor(rng, 23, 4, 2, jnp.float32)
  mean, var, count = norm.batch_statistics(x, return_count=True)
  want = norm.batch_statistics(x)
  np.testing.assert_array_equal(np.asarray(mean), np.asarray(want[0]))
  np.testing.assert_array_equal(np.asarray(var), np.asarray(want[1]))
  assert count.dtype == jnp.float32 and float(count) == 23
  stacked = jax.tree.map(lambda *a: jnp.stack(a), x, x.replace(num=9))
  counts = jax.vmap(lambda t: norm.batch_statistics(t, axis_name="d", return_count=True)[2], axis_name="d")(stacked)
  np.testing.assert_array_equal(np.asarray(counts), [32.0, 32.0])


def test_batch_norm_bad_arguments():
  x = _tensor(np.random.default_rng(4), 20, 2, 3, jnp.float32)
  with pytest.raises(TypeError, match="activation"):
    norm.batch_norm(x, activation="relu")
  with pytest.raises(ValueError, match="scale"):
    norm.batch_norm(x, jnp.ones(4))
  with pytest.raises(ValueError, match="mean and var"):
    norm.batch_norm(x, mean=jnp.zeros(3))
  with pytest.raises(TypeError, match="SparseTensor"):
    norm.batch_norm(x.feats)
  # A negative or non-finite epsilon made every row NaN; a traced one is not a static constant.
  for op in (norm.batch_norm, norm.layer_norm, lambda x, **kw: norm.group_norm(x, 1, **kw)):
    for eps in (-1e-3, float("nan"), float("inf"), 10**400):  # 10**400: OverflowError, naming nothing
      with pytest.raises(ValueError, match="epsilon"):
        op(x, epsilon=eps)
    with pytest.raises(TypeError, match="epsilon"):
      op(x, epsilon=jnp.float32(1e-5))
    assert np.all(np.isfinite(np.asarray(op(x, epsilon=0).feats[: int(x.num)])))
    # An integer output dtype was refused only after the normalisation, as "feats", which the caller never passed.
    for dtype in (jnp.int32, jnp.bool_):
      with pytest.raises(TypeError, match="dtype must be real floating point"):
        op(x, dtype=dtype)
    assert op(x, dtype=jnp.bfloat16).dtype == jnp.bfloat16


def _garbage_padding(x):
  """x with nan / inf in the padding rows' features (statistics and gradients must not see them)."""
  pad = np.arange(x.capacity) >= int(x.num)
  fill = np.where(np.arange(x.capacity * x.num_channels).reshape(x.capacity, x.num_channels) % 2, np.nan, np.inf)
  return x.replace(feats=jnp.where(pad[:, None], jnp.asarray(fill, x.dtype), x.feats))


_BN_SHAPES = [(0, 5, 3), (1, 6, 16), (77, 23, 3), (300, 13, 96), (50, 0, 1), (0, 0, 4)]
_BN_DTYPES = [jnp.float32, jnp.float16, jnp.bfloat16]
_BN_ACTS = [(None, "none"), (jax.nn.relu, "relu"), (jax.nn.silu, "silu")]
# A covering set, not the full product (54 cases): every shape meets every dtype, and the activation rotates with
# both (act = (shape + dtype) mod 3), so every (shape, act) and every (dtype, act) pair still runs too.
_BN_PALLAS_CASES = [pytest.param(*shape, dtype, _BN_ACTS[(i + j) % 3][0],
                                 id=f"{shape}-{jnp.dtype(dtype).name}-{_BN_ACTS[(i + j) % 3][1]}")
                    for i, shape in enumerate(_BN_SHAPES) for j, dtype in enumerate(_BN_DTYPES)]


@pytest.mark.parametrize("n,pad,c,dtype,act", _BN_PALLAS_CASES)
def test_batch_norm_pallas_matches_xla(n, pad, c, dtype, act):
  """implementation="pallas" (the channel_moments kernels, interpret mode here) against "xla": outputs, returned
  statistics and the gradients of feats, scale and bias, with nan / inf in the padding rows."""
  rng = np.random.default_rng([n, c])
  x = _garbage_padding(_tensor(rng, n, pad, c, dtype, offset=3.0, spread=2.0))
  scale = jnp.asarray(rng.standard_normal(c) + 1, jnp.float32)
  bias = jnp.asarray(rng.standard_normal(c), jnp.float32)
  w_y = jnp.asarray(rng.standard_normal((n + pad, c)), jnp.float32)
  w_m, w_v = jnp.asarray(rng.standard_normal(c), jnp.float32), jnp.asarray(rng.standard_normal(c), jnp.float32)

  def run(implementation):
    def loss(f, s, b):
      y, (m, v) = norm.batch_norm(x.replace(feats=f), s, b, activation=act, return_statistics=True,
                                  implementation=implementation)
      return jnp.sum(y.feats.astype(jnp.float32) * w_y) + jnp.sum(m * w_m) + jnp.sum(v * w_v), (y.feats, m, v)

    grads, outs = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(x.feats, scale, bias)
    text = str(jax.make_jaxpr(jax.grad(lambda f: loss(f, scale, bias)[0]))(x.feats))
    # The statistics and the backward sums; an empty array needs no kernel.
    assert text.count("pallas_call") == (2 if implementation == "pallas" and n + pad else 0)
    return outs, grads

  (y, m, v), grads = run("pallas")
  (y_x, m_x, v_x), grads_x = run("xla")
  tol = {jnp.float32: 1e-5, jnp.float16: 2e-3, jnp.bfloat16: 1e-2}[dtype]
  for got, want in [(y, y_x), (m, m_x), (v, v_x), *zip(grads, grads_x)]:
    assert got.dtype == want.dtype and np.all(np.isfinite(np.asarray(got, np.float32)))
    assert rel_err(got, want) < tol
  assert not np.any(np.asarray(y[n:], np.float32)) and not np.any(np.asarray(grads[0][n:], np.float32))
  if n:  # the statistics are those of the valid rows
    f = np.asarray(x.feats[:n], np.float64)
    np.testing.assert_allclose(np.asarray(m), f.mean(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(v), f.var(0), rtol=1e-4, atol=1e-6)


def test_batch_norm_pallas_accurate_far_from_zero_and_bad_implementation():
  rng = np.random.default_rng(1)
  x = _tensor(rng, 5000, 3, 4, jnp.float32, offset=1000.0, spread=0.1)
  _, (mean, var) = norm.batch_norm(x, return_statistics=True, implementation="pallas")
  f = np.asarray(x.feats[:5000], np.float64)
  np.testing.assert_allclose(np.asarray(mean), f.mean(0), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(var), f.var(0), rtol=1e-3)
  with pytest.raises(ValueError, match="implementation"):
    norm.batch_norm(x, implementation="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("c", [16, 96, 256])
def test_gpu_batch_norm_pallas_matches_xla(c, dtype):
  """On the GPU: batch_norm + relu values and gradients with the real kernels against the XLA path, at 200k
  valid rows in a 2^18-row capacity."""
  n, cap = 200_001, 1 << 18
  rng = np.random.default_rng(c)
  x = _garbage_padding(_tensor(rng, n, cap - n, c, dtype, offset=1.0, spread=2.0))
  scale = jnp.asarray(rng.standard_normal(c) + 1, jnp.float32)
  bias = jnp.asarray(rng.standard_normal(c), jnp.float32)
  w_y = jnp.asarray(rng.standard_normal((cap, c)), jnp.float32)

  def run(implementation):
    def loss(f, s, b):
      y = norm.batch_norm(x.replace(feats=f), s, b, activation=jax.nn.relu, implementation=implementation)
      return jnp.sum(y.feats.astype(jnp.float32) * w_y), y.feats

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(x.feats, scale, bias)

  grads, y = run("pallas")
  grads_x, y_x = run("xla")
  # float32 sums of 200k rows in another order: the scale and bias gradients (the sums themselves) may differ by
  # more than the outputs do.
  tol = 1e-4 if dtype == jnp.float32 else 2e-3
  # Where the pre-activation is within rounding of 0, ReLU's derivative is 0 or 1 depending on how each path
  # fused its arithmetic: one such element among 19M moved dx's error to 2.4e-4 (H200, c 96, float32). The input
  # gradient is compared away from those few entries; everything else as computed.
  f = np.asarray(x.feats[:n], np.float64)
  z = (f - f.mean(0)) / np.sqrt(f.var(0) + 1e-5) * np.asarray(scale) + np.asarray(bias)
  ambiguous = np.zeros((cap, c), bool)
  ambiguous[:n] = np.abs(z) < 1e-5 * (1 + np.abs(np.asarray(bias)))
  assert ambiguous.mean() < 1e-4
  g_x, g_x_xla = (np.where(ambiguous, 0, np.asarray(a, np.float32)) for a in (grads[0], grads_x[0]))
  for got, want in [(y, y_x), (g_x, g_x_xla)]:
    assert np.all(np.isfinite(np.asarray(got, np.float32)))
    assert rel_err(got, want) < tol
  # The scale and bias gradients sum over every row, ambiguous ones included: each such entry adds dy * x_hat
  # (scale) or dy (bias) on one path and nothing on the other, so each channel may differ by up to their sum
  # (one entry moved the scale gradient's error to 2.3e-4, H200, c 96, float32).
  x_hat = np.zeros((cap, c))
  x_hat[:n] = (f - f.mean(0)) / np.sqrt(f.var(0) + 1e-5)
  w = np.asarray(w_y, np.float64)
  for got, want, per_entry in [(grads[1], grads_x[1], w * x_hat), (grads[2], grads_x[2], w)]:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got))
    flip_bound = np.sum(np.abs(np.where(ambiguous, per_entry, 0)), axis=0)
    assert np.all(np.abs(got - want) <= tol * np.linalg.norm(want) / np.sqrt(c) + flip_bound)


def test_batch_norm_modules_pass_the_implementation_on():
  """SparseBatchNorm (linen and nnx) and the residual blocks hand `implementation` to batch_norm: "pallas" runs
  the kernels (the same answer as "xla"), a bad name is refused."""
  from flax import nnx

  x = _garbage_padding(_tensor(np.random.default_rng(6), 40, 8, 5, jnp.float16, offset=1.0))
  outs = {}
  for impl in ("xla", "pallas"):
    bn = jsparse.nn.SparseBatchNorm(activation=jax.nn.relu, implementation=impl)
    variables = bn.init(jax.random.key(0), x, use_running_average=False)
    run = lambda v, t: bn.apply(v, t, use_running_average=False, mutable=["batch_stats"])  # noqa: E731
    assert str(jax.make_jaxpr(run)(variables, x)).count("pallas_call") == (impl == "pallas")
    outs[impl] = run(variables, x)
    model = jsparse.nnx.SparseBatchNorm(5, activation=nnx.relu, implementation=impl, rngs=nnx.Rngs(0))
    graph, state = nnx.split(model)
    text = str(jax.make_jaxpr(lambda s, t: nnx.merge(graph, s)(t).feats)(state, x))
    assert text.count("pallas_call") == (impl == "pallas")
    block = jsparse.nnx.SparseResNetBlock(5, 5, 1, implementation=impl, rngs=nnx.Rngs(0))
    assert block.norm1.implementation == impl
  (y_x, s_x), (y_p, s_p) = outs["xla"], outs["pallas"]
  assert rel_err(y_p.feats, y_x.feats) < 2e-3
  for k in ("mean", "var"):
    assert rel_err(s_p["batch_stats"][k], s_x["batch_stats"][k]) < 1e-5
  bn = jsparse.nn.SparseBatchNorm(implementation="cuda")
  with pytest.raises(ValueError, match="implementation"):
    bn.init(jax.random.key(0), x, use_running_average=False)


def _sharded_bn_grads(n, c, implementation):
  """(step, its args, its one-device twin): batch norm + relu per device inside shard_map (no axis_name),
  gradients of the features and of the replicated scale and bias."""
  from jax.sharding import Mesh, PartitionSpec as P

  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))

  def grads(f, num, s, b):
    x = jsparse.SparseTensor(jnp.zeros((f.shape[0], 4), jnp.int32), f, num[0], (1, 1, 1), 1)

    def loss(f, s, b):
      y = norm.batch_norm(x.replace(feats=f), s, b, activation=jax.nn.relu, implementation=implementation)
      return jnp.sum(jnp.sin(y.feats.astype(jnp.float32)))

    return jax.grad(loss, argnums=(0, 1, 2))(f, s, b)

  def step(f, num, s, b):
    g_f, g_s, g_b = grads(f, num, s, b)
    return g_f, jax.lax.psum(g_s, "data"), jax.lax.psum(g_b, "data")

  fn = jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P("data"), P(), P()), out_specs=(P("data"), P(), P()))
  rng = np.random.default_rng(7)
  args = (jnp.asarray(rng.standard_normal((n, c)), jnp.float16), jnp.asarray([n - 3], jnp.int32),
          jnp.asarray(rng.standard_normal(c), jnp.float32), jnp.asarray(rng.standard_normal(c), jnp.float32))
  return fn, args, grads


def test_batch_norm_gradients_inside_shard_map():
  """Per-device batch norm inside shard_map (check_vma=True): the replicated scale and bias get their cotangents
  (the custom_vjp once refused a per-device cotangent for a replicated input), equal to one device's."""
  fn, args, grads = _sharded_bn_grads(40, 6, "xla")
  got, want = jax.jit(fn)(*args), jax.jit(grads)(*args)
  for g, w in zip(got, want):
    assert g.shape == w.shape and rel_err(g, w) < 1e-6


def test_batch_norm_pallas_lowers_inside_shard_map(monkeypatch):
  """The same step on the Pallas kernels lowers to Triton for CUDA on the CPU (both kernels), the way the GPU
  runs it (interpret mode cannot run kernels inside shard_map, so this is what CI can check)."""
  from jsparse import dispatch
  from triton_lowering import lower_for_cuda

  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)  # "pallas" then resolves to the Triton kernels
  fn, args, _ = _sharded_bn_grads(4096, 96, "pallas")
  assert lower_for_cuda(fn, *args).count("__gpu$xla.gpu.triton") == 2



@pytest.mark.gpu
@pytest.mark.parametrize("implementation", ["xla", "pallas"])
@pytest.mark.parametrize("n,c", [(1_100_000, 32)])
def test_gpu_batch_norm_relu_chain_at_network_size(n, c, implementation):
  """A training step of batch norm + ReLU, a channel mix (a convolution's stand-in) and batch norm + ReLU again,
  compiled on the GPU at MinkUNet's full-resolution rows and width: gradients as the XLA path's, and no forward
  fusion keeps a [rows, C] mask for the backward. (This small graph did not show the masks even before the fix;
  tests/test_networks.py checks MinkUNet itself, where they were found.)"""
  rng = np.random.default_rng(1)
  pad = jsparse.round_capacity(n) - n
  x = _tensor(rng, n, pad, c, jnp.float16)
  scale = jnp.asarray(rng.standard_normal(c) + 1, jnp.float32)
  bias = jnp.asarray(rng.standard_normal(c), jnp.float32)
  mix = jnp.asarray(rng.standard_normal((c, c)) / np.sqrt(c), jnp.float16)
  w_y = jnp.asarray(rng.standard_normal((n + pad, c)), jnp.float16)

  def loss(f, s, b, impl):
    y = norm.batch_norm(x.replace(feats=f), s, b, activation=jax.nn.relu, implementation=impl)
    y = norm.batch_norm(y.replace(feats=y.feats @ mix), s * 0.5, b + 0.1, activation=jax.nn.relu,
                        implementation=impl)
    return jnp.sum((y.feats * w_y).astype(jnp.float32))

  step = jax.jit(jax.grad(loss, (0, 1, 2)), static_argnums=3)
  hlo = step.lower(x.feats, scale, bias, implementation).compile().as_text()
  assert networks.forward_masks(hlo) == []
  got = step(x.feats, scale, bias, implementation)
  want = step(x.feats, scale, bias, "xla")
  for g, w in zip(got, want):
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
    assert rel_err(g, w) < 2e-3


def test_a_constant_negative_running_var_raises_under_jit_too():
  # Running statistics closed over by a jitted inference function are concrete there: a negative var raised
  # ValueError at trace time, as eagerly; reporting it from the program alone made it a silent NaN under plain jit.
  x = _tensor(np.random.default_rng(3), 20, 4, 3, jnp.float32)
  mean, var = jnp.zeros(3), jnp.asarray([1.0, -1.0, 0.5])
  with pytest.raises(ValueError, match=r"batch_norm: var must be >= 0 .* 1 of its entries are negative"):
    jax.jit(lambda x: norm.batch_norm(x, mean=mean, var=var).feats)(x)
  with pytest.raises(ValueError, match=r"batch_norm: var must be >= 0 .* 1 of its entries are negative"):
    norm.batch_norm(x, mean=mean, var=var)
  y = jax.jit(lambda x, v: norm.batch_norm(x, mean=mean, var=v).feats)(x, var)  # traced: reported, unchecked here
  assert y.shape == x.feats.shape


def test_axis_index_groups_inside_shard_map_names_the_argument():
  """JAX's psum inside shard_map has no axis_index_groups and raised a NotImplementedError with an empty message;
  batch_statistics (and batch_norm through it) now says which argument and what to do instead."""
  from jax.sharding import Mesh, PartitionSpec as P
  x = _tensor(np.random.default_rng(0), 5, 3, 2, jnp.float32)
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  stacked = jax.tree.map(lambda a: a[None], x)

  def step(x):
    return norm.batch_statistics(jax.tree.map(lambda a: a[0], x), axis_name="data", axis_index_groups=[[0]])

  with pytest.raises(NotImplementedError, match="axis_index_groups"):
    jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P()))(stacked)


def test_axis_index_groups_under_vmap_keeps_jaxs_message():
  """Under jax.vmap JAX's psum refuses axis_index_groups in words of its own ("vmap collectives"); they were
  replaced by the shard_map advice, which named a transformation the caller did not use."""
  x = _tensor(np.random.default_rng(0), 5, 3, 2, jnp.float32)
  stacked = jax.tree.map(lambda a: jnp.stack([a, a]), x)
  step = lambda x: norm.batch_statistics(x, axis_name="i", axis_index_groups=[[0, 1]])
  with pytest.raises(NotImplementedError, match="vmap") as raised:
    jax.vmap(step, axis_name="i")(stacked)
  assert "shard_map" not in str(raised.value)


def test_epsilon_sits_inside_the_square_root():
  """(x - mean) / sqrt(var + eps), not / (sqrt(var) + eps), in every normalisation: batch norm on batch and on
  running statistics, layer norm and group norm, against float64 numpy on rows whose variance (1e-4) is comparable
  to epsilon (at a variance near 1 the two differ by ~eps / 2, inside any tolerance). Three items, padding rows."""
  rng = np.random.default_rng(5)
  n, pad, c, groups, eps, batch = 90, 11, 6, 3, 1e-4, 3
  sites = rng.choice(batch * 5 * 6 * 7, n, replace=False)
  coords = np.full((n + pad, 4), -1, np.int32)
  coords[:n] = np.stack(np.unravel_index(sites, (batch, 5, 6, 7)), 1)
  f = np.zeros((n + pad, c))
  f[:n] = rng.standard_normal((n, c)) * 0.01 * rng.uniform(0.5, 2.0, c) + rng.standard_normal(c)
  x = jsparse.SparseTensor(jnp.asarray(coords), jnp.asarray(f, jnp.float32), jnp.asarray(n, jnp.int32), (5, 6, 7),
                           batch)
  v = f[:n]
  check = lambda got, want: np.testing.assert_allclose(np.asarray(got.feats[:n]), want, rtol=2e-3, atol=2e-3)
  check(norm.batch_norm(x, epsilon=eps), (v - v.mean(0)) / np.sqrt(v.var(0) + eps))
  mean, var = rng.standard_normal(c), rng.uniform(0.5, 2.0, c) * 1e-4
  check(norm.batch_norm(x, mean=jnp.asarray(mean, jnp.float32), var=jnp.asarray(var, jnp.float32), epsilon=eps),
        (v - mean) / np.sqrt(var + eps))
  rows = np.zeros((n + pad, c))  # layer norm's statistics are over each row's channels: spread 0.01 there
  rows[:n] = rng.standard_normal((n, c)) * 0.01 + rng.standard_normal((n, 1))
  r = rows[:n]
  check(norm.layer_norm(x.replace(feats=jnp.asarray(rows, jnp.float32)), epsilon=eps),
        (r - r.mean(1, keepdims=True)) / np.sqrt(r.var(1, keepdims=True) + eps))
  # Group norm's are over an item's rows and a group's channels: an offset per (item, group), spread 0.01 about it.
  grouped = np.zeros((n + pad, c))
  grouped[:n] = rng.standard_normal((n, c)) * 0.01 + np.repeat(rng.standard_normal((batch, groups)), c // groups,
                                                                axis=1)[coords[:n, 0]]
  want = np.zeros((n, c))
  for b in range(batch):
    rows = coords[:n, 0] == b
    g = grouped[:n][rows].reshape(-1, groups, c // groups)
    m, s2 = g.mean((0, 2), keepdims=True), g.var((0, 2), keepdims=True)
    want[rows] = ((g - m) / np.sqrt(s2 + eps)).reshape(-1, c)
  check(norm.group_norm(x.replace(feats=jnp.asarray(grouped, jnp.float32)), groups, epsilon=eps), want)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.float16, 2e-3)])
def test_running_statistics_apply_the_affine_before_the_activation(dtype, tol):
  """batch_norm on given (running) statistics with a fused activation: act(xhat * scale + bias), against float64
  numpy, with negative scales and biases (relu before the affine, or the affine applied twice, differ there) and
  padding rows left zero; the module in eval mode gives the same."""
  rng = np.random.default_rng(7)
  n, pad, c = 60, 9, 5
  x = _tensor(rng, n, pad, c, dtype, offset=0.5, spread=1.5)
  mean, var = rng.standard_normal(c), rng.uniform(0.5, 3.0, c)
  scale, bias = rng.standard_normal(c) * 2, rng.standard_normal(c)
  f = np.asarray(x.feats[:n], np.float64)
  want = np.maximum((f - mean) / np.sqrt(var + 1e-5) * scale + bias, 0)
  as32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
  y = norm.batch_norm(x, as32(scale), as32(bias), mean=as32(mean), var=as32(var), activation=jax.nn.relu)
  assert y.dtype == dtype
  np.testing.assert_allclose(np.asarray(y.feats[:n], np.float64), want, rtol=tol, atol=tol * 4)
  assert np.all(np.asarray(y.feats[n:]) == 0)
  bn = jsparse.nn.SparseBatchNorm(activation=jax.nn.relu, use_running_average=True)
  variables = {"params": {"scale": as32(scale), "bias": as32(bias)},
               "batch_stats": {"mean": as32(mean), "var": as32(var)}}
  np.testing.assert_allclose(np.asarray(bn.apply(variables, x).feats, np.float32), np.asarray(y.feats, np.float32),
                             rtol=tol, atol=tol)


def test_half_precision_inputs_normalise_in_float32():
  """fp16 features far from zero (offset 200, spread 1: fp16's ulp there is 0.125) normalise in float32: batch,
  layer and group norm against float64 numpy of the same fp16 values, each output within fp16 rounding of itself.
  A mean rounded to fp16, or x - mean taken in fp16, is off by up to a few hundredths there. Three items, padding."""
  rng = np.random.default_rng(9)
  n, pad, c, groups, batch = 120, 7, 6, 2, 3
  sites = rng.choice(batch * 4 * 5 * 6, n, replace=False)
  coords = np.full((n + pad, 4), -1, np.int32)
  coords[:n] = np.stack(np.unravel_index(sites, (batch, 4, 5, 6)), 1)
  item = coords[:n, 0]
  offset = 200 + 20 * rng.standard_normal((batch, c))  # per item and channel: every statistic is far from zero
  f = np.zeros((n + pad, c), np.float16)
  f[:n] = rng.standard_normal((n, c)) + offset[item]
  x = jsparse.SparseTensor(jnp.asarray(coords), jnp.asarray(f), jnp.asarray(n, jnp.int32), (4, 5, 6), batch)
  v = f[:n].astype(np.float64)

  def check(y, want):
    assert y.dtype == jnp.float16
    np.testing.assert_allclose(np.asarray(y.feats[:n], np.float64), want, rtol=2e-3, atol=2e-3)
    assert np.all(np.asarray(y.feats[n:]) == 0)

  check(norm.batch_norm(x), (v - v.mean(0)) / np.sqrt(v.var(0) + 1e-5))
  check(norm.layer_norm(x), (v - v.mean(1, keepdims=True)) / np.sqrt(v.var(1, keepdims=True) + 1e-6))
  want = np.zeros((n, c))
  for b in range(batch):
    g = v[item == b].reshape(-1, groups, c // groups)
    g = (g - g.mean((0, 2), keepdims=True)) / np.sqrt(g.var((0, 2), keepdims=True) + 1e-6)
    want[item == b] = g.reshape(-1, c)
  check(norm.group_norm(x, groups), want)
