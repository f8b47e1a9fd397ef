"""The per-channel column reductions of pallas_kernels/channel_moments.py (batch norm's statistics and backward
sums) in interpret mode against float64 numpy: rows not a multiple of the block, num 0 / 1 / all rows, C from
1 to 256 (padded to a power of two in the kernel), fp16 / bf16 / f32, and padding rows full of nan and inf that
must never be read. Triton lowering on the CPU; on a GPU (marked gpu) the real kernels against numpy."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import channel_moments as cm
from pallas_kernels.channel_moments_config import MomentsConfig, candidates, default_config
from triton_lowering import lower_for_cuda

# (rows, num, C, config): small configs force many pieces, channel blocks and a ragged last row block.
CASES = [
    (37, 37, 1, None),
    (100, 77, 3, MomentsConfig(block_rows=8, block_c=4, pieces=3)),
    (100, 0, 16, None),
    (64, 1, 16, MomentsConfig(block_rows=4, block_c=16, pieces=5)),
    (203, 150, 96, MomentsConfig(block_rows=16, block_c=32, pieces=4)),
    (130, 129, 256, None),
    (50, 50, 96, MomentsConfig(block_rows=2, block_c=128, pieces=64)),  # more pieces than row blocks
]
DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]


def _data(rng, rows, num, c, dtype, offset=2.0):
  """[rows, C] in dtype: normal rows about `offset` before num, nan / inf / huge garbage after."""
  x = np.empty((rows, c), np.float32)
  x[:num] = rng.standard_normal((num, c)) + offset
  garbage = np.array([np.nan, np.inf, -np.inf, 6e4], np.float32)
  x[num:] = garbage[np.arange((rows - num) * c).reshape(rows - num, c) % 4]
  return jnp.asarray(x, dtype)


def _ids(case):
  rows, num, c, cfg = case
  return f"r{rows}_n{num}_c{c}" + ("" if cfg is None else f"_b{cfg.block_rows}x{cfg.block_c}p{cfg.pieces}")


def _close(got, want, scale):
  got = np.asarray(got, np.float64)
  assert got.dtype == np.float64 and np.all(np.isfinite(got))
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(scale, 1.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_channel_moments_match_numpy(case, dtype):
  rows, num, c, cfg = case
  rng = np.random.default_rng([rows, num, c])
  x = _data(rng, rows, num, c, dtype)
  shift = jnp.asarray(rng.standard_normal(c) + 2.0, jnp.float32)
  s1, s2 = cm.channel_moments(x, jnp.int32(num), shift, config=cfg, interpret=True)
  assert s1.dtype == s2.dtype == jnp.float32 and s1.shape == s2.shape == (c,)
  d = np.asarray(x[:num].astype(jnp.float32), np.float64) - np.asarray(shift, np.float64)
  _close(s1, d.sum(0), np.abs(d).sum())
  _close(s2, (d * d).sum(0), (d * d).sum())


@pytest.mark.parametrize("activation", [None, jax.nn.relu, jax.nn.silu], ids=["none", "relu", "silu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", CASES[1::2], ids=_ids)
def test_normalised_grad_sums_match_numpy(case, dtype, activation):
  rows, num, c, cfg = case
  rng = np.random.default_rng([rows, num, c, 1])
  x = _data(rng, rows, num, c, dtype)
  dy = _data(rng, rows, num, c, dtype, offset=0.0)
  mean = jnp.asarray(rng.standard_normal(c) + 2.0, jnp.float32)
  inv_std = jnp.asarray(rng.uniform(0.5, 2.0, c), jnp.float32)
  scale = jnp.asarray(rng.standard_normal(c), jnp.float32)
  bias = jnp.asarray(rng.standard_normal(c), jnp.float32)
  sum_g, sum_gx = cm.normalised_grad_sums(x, dy, jnp.int32(num), mean, inv_std, scale, bias, activation=activation,
                                          config=cfg, interpret=True)
  f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
  xhat = (f64(x[:num]) - f64(mean)) * f64(inv_std)
  g = f64(dy[:num])
  z = xhat * f64(scale) + f64(bias)
  if activation is jax.nn.relu:
    g = g * (z > 0)
  elif activation is jax.nn.silu:
    sig = 1 / (1 + np.exp(-z))
    g = g * (sig * (1 + z * (1 - sig)))
  _close(sum_g, g.sum(0), np.abs(g).sum())
  _close(sum_gx, (g * xhat).sum(0), np.abs(g * xhat).sum())


def test_num_past_the_rows_and_empty_arrays():
  """num above the rows reads every row (and no more); zero rows or zero channels give zero sums."""
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((20, 5)), jnp.float32)
  s1, _ = cm.channel_moments(x, jnp.int32(1000), jnp.zeros(5), interpret=True)
  np.testing.assert_allclose(np.asarray(s1), np.asarray(x).sum(0), rtol=1e-5, atol=1e-5)
  for shape in ((0, 4), (6, 0)):
    z = jnp.zeros(shape, jnp.float16)
    v = jnp.zeros(shape[1])
    for out in (cm.channel_moments(z, jnp.int32(3), v, interpret=True),
                cm.normalised_grad_sums(z, z, jnp.int32(3), v, v, v, v, interpret=True)):
      assert all(o.shape == (shape[1],) and o.dtype == jnp.float32 and not np.any(np.asarray(o)) for o in out)


def test_bad_arguments():
  x = jnp.zeros((8, 3), jnp.float32)
  v = jnp.zeros(3)
  with pytest.raises(ValueError, match="x must be"):
    cm.channel_moments(jnp.zeros(8), jnp.int32(1), v)
  with pytest.raises(ValueError, match="x must be"):
    cm.channel_moments(x.astype(jnp.int32), jnp.int32(1), v)
  with pytest.raises(ValueError, match="shift"):
    cm.channel_moments(x, jnp.int32(1), jnp.zeros(4))
  with pytest.raises(ValueError, match="num"):
    cm.channel_moments(x, jnp.float32(1), v)
  with pytest.raises(ValueError, match="dy"):
    cm.normalised_grad_sums(x, jnp.zeros((8, 4)), jnp.int32(1), v, v, v, v)
  with pytest.raises(ValueError, match="inv_std"):
    cm.normalised_grad_sums(x, x, jnp.int32(1), v, jnp.zeros(2), v, v)
  with pytest.raises(TypeError, match="activation"):
    cm.normalised_grad_sums(x, x, jnp.int32(1), v, v, v, v, activation="relu")
  for bad in (dict(block_rows=24), dict(block_c=0), dict(pieces=0), dict(num_warps=0)):
    with pytest.raises(ValueError, match=next(iter(bad))):
      MomentsConfig(**bad)


@pytest.mark.parametrize("c", [1, 3, 16, 96, 256, 320])
def test_default_config(c):
  """All channels in one power-of-two block up to 256, 4096 accumulator values, pieces walking >= 4 blocks."""
  for rows in (1, 1000, 1 << 20):
    cfg = default_config(rows, c)
    assert cfg.block_c == min(256, 1 << (c - 1).bit_length()) and cfg.block_c >= min(c, 256)
    assert cfg.block_rows * cfg.block_c == 4096
    assert cfg.pieces == 1 or rows >= 4 * cfg.block_rows * (cfg.pieces - 1)
  assert default_config(1 << 20, 64).pieces >= 128  # a million rows fill the GPU
  sweep = candidates(1 << 20, c)
  assert sweep[0] == default_config(1 << 20, c) and len(set(sweep)) == len(sweep) >= 5


def test_sweep_configs_give_the_same_sums():
  """Every launch shape the benchmark sweeps computes the same sums (here on a small array)."""
  rng = np.random.default_rng(9)
  x = jnp.asarray(rng.standard_normal((300, 24)), jnp.float16)
  shift = jnp.zeros(24)
  want = np.asarray(x[:290], np.float64)
  for cfg in candidates(300, 24):
    s1, s2 = cm.channel_moments(x, jnp.int32(290), shift, config=cfg, interpret=True)
    _close(s1, want.sum(0), np.abs(want).sum())
    _close(s2, (want * want).sum(0), (want * want).sum())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("c", [1, 3, 16, 96, 256])
def test_kernels_lower_to_triton(c, dtype):
  """Both kernels (the backward with relu and silu traced in) lower to Triton IR for CUDA on the CPU."""
  x = jnp.zeros((1000, c), dtype)
  v = jnp.zeros(c, jnp.float32)
  num = jnp.int32(1)
  assert "triton" in lower_for_cuda(lambda x, n, s: cm.channel_moments(x, n, s), x, num, v)
  for act in (None, jax.nn.relu, jax.nn.silu):
    assert "triton" in lower_for_cuda(
        lambda x, dy, n, s: cm.normalised_grad_sums(x, dy, n, s, s, s, s, activation=act), x, x, num, v)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("c", [3, 96, 256])
def test_gpu_kernels_match_numpy(c, dtype):
  """On the GPU, at 250k rows in a 2^18-row capacity (garbage after num): the real kernels, many programs."""
  rows, num = 1 << 18, 250_003
  rng = np.random.default_rng(c)
  x = _data(rng, rows, num, c, dtype)
  dy = _data(rng, rows, num, c, dtype, offset=0.0)
  shift = x[0].astype(jnp.float32)
  s1, s2 = cm.channel_moments(x, jnp.int32(num), shift)
  d = np.asarray(x[:num].astype(jnp.float32), np.float64) - np.asarray(shift, np.float64)
  _close(s1, d.sum(0), np.abs(d).sum())
  _close(s2, (d * d).sum(0), (d * d).sum())
  mean, inv_std = jnp.asarray(d.mean(0) + np.asarray(shift), jnp.float32), jnp.ones(c, jnp.float32)
  ones, zeros = jnp.ones(c, jnp.float32), jnp.zeros(c, jnp.float32)
  sum_g, sum_gx = cm.normalised_grad_sums(x, dy, jnp.int32(num), mean, inv_std, ones, zeros, activation=jax.nn.relu)
  xhat = np.asarray(x[:num].astype(jnp.float32), np.float64) - np.asarray(mean, np.float64)
  g = np.asarray(dy[:num].astype(jnp.float32), np.float64) * (xhat > 0)
  _close(sum_g, g.sum(0), np.abs(g).sum())
  _close(sum_gx, (g * xhat).sum(0), np.abs(g * xhat).sum())
