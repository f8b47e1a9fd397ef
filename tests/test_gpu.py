"""The real Triton kernels on a GPU against the XLA path (run with `make gpu-test`; skipped without a GPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
import nn_data_parallel
from benchmarks.workloads import SUITE
from reference import SUBMCONV_CASES as CASES
from reference import gathered_operand_growth_per_layer, random_sparse, random_weights, rel_err

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


@pytest.mark.parametrize("res,block_m,pad", [(256, 128, 0), (96, 64, 1000), (64, 128, 77)])
def test_gpu_masked_plan_kernel_matches_xla_reference(res, block_m, pad):
  """The plan kernel on the GPU builds exactly the XLA reference's plan (a real submanifold map, num < rows)."""
  from pallas_kernels.gemm_plan import masked_plan, masked_plan_reference

  x = shell_tensor(res, 4, jnp.float16, pad=pad)
  nbr = jsparse.neighbor_map(x, 3).nbr
  got = jax.jit(masked_plan, static_argnums=2)(nbr, x.num, block_m)
  want = jax.jit(masked_plan_reference, static_argnums=2)(nbr, x.num, block_m)
  for name, a, b in zip(got._fields, got.comparable(), want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("res,kernel_size,pad", [(256, 3, 0), (96, 3, 1000), (64, 5, 77)])
@pytest.mark.parametrize("mirrored", [False, True])
def test_gpu_pair_list_kernels_match_xla_reference(res, kernel_size, pad, mirrored):
  """The pair-list kernels on the GPU build exactly the XLA reference's lists (a real submanifold map, padding
  rows, a capacity that is no multiple of the chunk)."""
  from pallas_kernels.gemm_plan import pair_lists, pair_lists_reference

  x = shell_tensor(res, 4, jnp.float16, pad=pad)
  nbr = jsparse.neighbor_map(x, kernel_size).nbr
  got = jax.jit(pair_lists, static_argnums=1)(nbr, mirrored)
  want = jax.jit(pair_lists_reference, static_argnums=1)(nbr, mirrored)
  for name, a, b in zip(got._fields, got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("res,kernel_size,pad,block_m", [(256, 3, 0, 128), (96, 3, 1000, 64), (64, 5, 77, 128)])
def test_gpu_pair_lists_from_plan_match_xla_reference(res, kernel_size, pad, block_m):
  """The pair-list kernels reading a plan on the GPU build exactly the XLA reference's lists, over the plan
  kernel's own plan (unused slots unwritten), and exactly the map's own lists."""
  from pallas_kernels.gemm_plan import (masked_plan, pair_lists_from_plan, pair_lists_from_plan_reference,
                                        pair_lists_reference)

  x = shell_tensor(res, 4, jnp.float16, pad=pad)
  nbr = jsparse.neighbor_map(x, kernel_size).nbr
  plan = jax.jit(masked_plan, static_argnums=2)(nbr, x.num, block_m)
  got = jax.jit(pair_lists_from_plan, static_argnums=1)(plan, True)
  want = jax.jit(pair_lists_from_plan_reference, static_argnums=1)(plan.comparable(), True)
  for name, a, b in zip(got._fields, got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  for name, a, b in zip(got._fields, got, pair_lists_reference(nbr, True)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_gpu_random_cases_match_xla(case):
  shape, batch, ks, dil, cin, cout, _ = case
  rng = np.random.default_rng(100 + cin)
  x = random_sparse(rng, shape, cin, batch_size=batch, density=0.3, pad=9)
  w, b = random_weights(rng, ks, cin, cout, True)
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


@pytest.mark.parametrize("res, c, dtype, precision, tol", SHELLS,
                         ids=[f"{s[0]}-{s[1]}-{jnp.dtype(s[2]).name}-{s[3]}" for s in SHELLS])
def test_gpu_sphere_shells_match_xla(res, c, dtype, precision, tol):
  x = shell_tensor(res, c, dtype, pad=1000)
  rng = np.random.default_rng(res + c)
  w, b = random_weights(rng, (3, 3, 3), c, c, True)
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
  w, b = random_weights(rng, (3, 3, 3), 48, 40, True)
  cache_p = jsparse.neighbor_map(x, 3, implementation="pallas")
  cot = jnp.asarray(rng.standard_normal((x.capacity, 40)).astype(np.float32))
  yr, gr = _grads(x, w, b, cache_p, "xla", "highest", cot)
  yp, gp = _grads(x, w, b, cache_p, "pallas", "highest", cot, algorithm)
  assert rel_err(yp, yr) < 1e-5
  for a, r in zip(gp, gr):
    assert rel_err(a, r) < 1e-5



@pytest.mark.parametrize("dtype, precision, tol", [(jnp.float16, None, 5e-3), (jnp.float32, "tf32", 3e-3),
                                                   (jnp.float32, "highest", 1e-5)],
                         ids=["float16", "float32-tf32", "float32-highest"])
def test_gpu_forward_weight_layouts_match_xla(dtype, precision, tol):
  """The forward reading the weight straight and through its K-major copy (TileConfig.weight_k_major, a
  tuner choice), both operand orders (TileConfig.swap_operands), with and without split-K, on few rows and
  many channels, against the XLA path."""
  from jsparse.pass_config import heuristic
  from pallas_kernels.gather_gemm import conv_forward
  from pallas_kernels.gemm_plan import masked_plan
  from pallas_kernels.tiling import TileConfig

  x = shell_tensor(16, 256, dtype, seed=4, pad=40)
  rng = np.random.default_rng(14)
  w = jnp.asarray(rng.standard_normal((27, 256, 192)) / np.sqrt(27 * 256), dtype)
  cache = jsparse.neighbor_map(x, 3, implementation="pallas")
  ref = jsparse.submconv_xla(x.feats.astype(jnp.float32), w.astype(jnp.float32), None, cache.nbr, x.num,
                             precision="highest")
  configs = [heuristic("forward", x.capacity, 256, 192, 27, dtype).tiles]
  for k_major in (True, False):
    for bm, bn, warps, split in ((32, 256, 8, 16), (64, 128, 4, 1), (32, 128, 4, 24)):
      bk = 32 if dtype == jnp.float32 else 64
      for swap in (None, not (k_major and dtype == jnp.float32)):  # the rule's operand order, and the other
        configs.append(TileConfig(bm, bn, bk, warps, 5, split, columns_fastest=True, weight_k_major=k_major,
                                  swap_operands=swap))
  for cfg in configs:
    fn = jax.jit(lambda f, w, plan, cfg=cfg: conv_forward(f, w, cache.nbr, x.num, plan=plan, config=cfg,
                                                          precision=precision))
    y = fn(x.feats, w, masked_plan(cache.nbr, x.num, cfg.block_m))
    assert rel_err(y, ref) < tol, cfg


@pytest.mark.parametrize("dtype, precision, tol", [(jnp.float16, None, 5e-3), (jnp.float32, "tf32", 3e-3),
                                                   (jnp.float32, "highest", 1e-5)],
                         ids=["float16", "float32-tf32", "float32-highest"])
def test_gpu_odhwi_weight_matches_xla(dtype, precision, tol):
  """A Cout-first (ODHWI) weight on the GPU: the forward's in-place read, the input gradient straight and through
  its copy, the Cout-major weight gradient (split, balanced), with and without split-K, on few and many rows,
  through submconv3d's gradients against the XLA path on the flax layout."""
  import dataclasses

  from jsparse import pass_config, tuning

  for res, c, pad in ((16, 256, 40), (64, 64, 7)):
    x = shell_tensor(res, c, dtype, seed=res, pad=pad)
    rng = np.random.default_rng(res)
    w = jnp.asarray(rng.standard_normal((3, 3, 3, c, c + 32)) / np.sqrt(27 * c), dtype)
    b = jnp.asarray(rng.standard_normal(c + 32), dtype)
    w_odhwi = jnp.transpose(w, (4, 0, 1, 2, 3))
    cache = jsparse.neighbor_map(x, 3, implementation="pallas")
    cot = jnp.asarray(rng.standard_normal((x.capacity, c + 32)), jnp.float32)
    y_ref, g_ref = _grads(x.replace(feats=x.feats.astype(jnp.float32)), w.astype(jnp.float32),
                          b.astype(jnp.float32), cache, "xla", "highest", cot)
    g_ref = (g_ref[0], jnp.transpose(g_ref[1], (4, 0, 1, 2, 3)), g_ref[2])
    for k_major, split, balanced in ((None, 1, False), (True, 4, True), (False, 1, False), (False, 8, False)):
      def table_for(rows, cin, cout):
        entries = {}
        for p in pass_config.PASSES:
          base = pass_config.heuristic(p, rows, cin, cout, 27, dtype)
          tiles = dataclasses.replace(base.tiles, weight_k_major=k_major, split=max(split, 1),
                                      balanced=balanced and p == "weight_grad")
          entries[jsparse.ShapeKey.of(p, rows, cin, cout, 27, dtype)] = jsparse.Masked(tiles)
        return tuning.ConfigTable(entries)

      def loss(feats, w_o, b):
        y = jsparse.submconv3d(x.replace(feats=feats), w_o, b, cache=cache, implementation="pallas",
                               precision=precision, weight_layout="ODHWI")
        return jnp.sum(y.feats.astype(jnp.float32) * cot), y.feats

      with table_for(x.capacity, c, c + 32):
        (_, y), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x.feats, w_odhwi, b)
      case = (res, k_major, split, balanced)
      assert rel_err(y, y_ref) < tol, case
      for got, want in zip(g, g_ref):
        assert rel_err(got, want) < tol, case


@pytest.mark.parametrize("dtype, precision, tol", [(jnp.float16, None, 5e-3), (jnp.float32, "tf32", 1e-4),
                                                   (jnp.float32, "highest", 1e-5)],
                         ids=["float16", "float32-tf32", "float32-highest"])
def test_gpu_balanced_weight_grad_matches_xla(dtype, precision, tol):
  """TileConfig.balanced on a 128^3 sphere shell, C 64 (offsets' pair counts differ up to ~2.7x): the
  weight gradient through submconv3d against the XLA path in float32, against the default split, and the
  same in two runs."""
  import dataclasses

  from jsparse import pass_config, tuning

  c = 64
  x = shell_tensor(128, c, dtype, pad=1000)
  rng = np.random.default_rng(64)
  w, b = random_weights(rng, (3, 3, 3), c, c, True)
  w, b = w.astype(dtype), b.astype(dtype)
  cache_p = jsparse.neighbor_map(x, 3, implementation="pallas")
  counts = np.asarray(cache_p.pair_lists().counts)
  assert counts.max() > 2 * counts.min() > 0
  cot = jnp.asarray(rng.standard_normal((x.capacity, c)).astype(np.float32))
  x32 = x.replace(feats=x.feats.astype(jnp.float32))
  _, gr = _grads(x32, w.astype(jnp.float32), b.astype(jnp.float32), cache_p, "xla", "highest", cot)
  default = pass_config.heuristic("weight_grad", x.capacity, c, c, 27, dtype)
  assert isinstance(default, jsparse.Masked) and default.tiles.split > 1 and not default.tiles.balanced
  balanced = dataclasses.replace(default, tiles=dataclasses.replace(default.tiles, balanced=True))
  key = jsparse.ShapeKey.of("weight_grad", x.capacity, c, c, 27, dtype)
  dws = {}
  for name, cfg in (("default", default), ("balanced", balanced), ("again", balanced)):
    with tuning.ConfigTable({key: cfg}):
      dws[name] = _grads(x, w, b, cache_p, "pallas", precision, cot)[1][1].astype(jnp.float32)
  assert rel_err(dws["balanced"], gr[1]) < tol
  assert rel_err(dws["balanced"], dws["default"]) < tol
  np.testing.assert_array_equal(np.asarray(dws["again"]), np.asarray(dws["balanced"]))

def test_gpu_strided_inverse_and_transposed_convs_match_xla():
  """The same GEMM kernels over rectangular maps (sparse_conv.py): values and gradients, 48^3 shell."""
  from jsparse.sparse_conv import sparse_conv3d, sparse_conv_transpose3d, sparse_inverse_conv3d

  x = shell_tensor(48, 32, jnp.float32, pad=77)
  rng = np.random.default_rng(15)
  w = jnp.asarray(rng.standard_normal((3, 3, 3, 32, 24)) / np.sqrt(27 * 32), jnp.float32)
  wi = jnp.asarray(rng.standard_normal((3, 3, 3, 24, 16)) / np.sqrt(27 * 24), jnp.float32)
  wt = jnp.asarray(rng.standard_normal((2, 2, 2, 32, 8)) / np.sqrt(32), jnp.float32)
  out_cap = x.capacity

  def run(impl):
    def f(feats, w, wi, wt):
      xx = x.replace(feats=feats)
      y = sparse_conv3d(xx, w, stride=2, padding=1, out_capacity=out_cap, implementation=impl, precision="highest")
      z = sparse_inverse_conv3d(y, wi, like=xx, stride=2, padding=1, implementation=impl, precision="highest")
      u = sparse_conv_transpose3d(xx, wt, stride=2, out_capacity=x.capacity * 8, implementation=impl,
                                  precision="highest")
      return jnp.sum(y.feats ** 2) + jnp.sum(jnp.sin(z.feats)) + jnp.sum(u.feats ** 2), (y.feats, z.feats, u.feats)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))(x.feats, w, wi, wt)

  (_, outs_p), grads_p = run("pallas")
  (_, outs_x), grads_x = run("xla")
  for a, r in zip(outs_p + grads_p, outs_x + grads_x):
    assert rel_err(a, r) < 1e-5


def test_gpu_flax_network_matches_xla():
  """A small U-Net-like flax stack (strided down, submanifold, inverse up) on the GPU against the XLA path."""
  from jsparse.nn import SparseConv3d, SparseInverseConv3d, SubMConv3d

  import flax.linen as nn

  class Net(nn.Module):
    implementation: str

    @nn.compact
    def __call__(self, x):
      h = SubMConv3d(16, implementation=self.implementation, precision="highest")(x)
      d = SparseConv3d(32, kernel_size=2, strides=2, out_capacity=x.capacity, implementation=self.implementation,
                       precision="highest")(h)
      d = SubMConv3d(32, implementation=self.implementation, precision="highest")(d)
      u = SparseInverseConv3d(16, kernel_size=2, strides=2, implementation=self.implementation,
                              precision="highest")(d, like=h)
      return u

  x = shell_tensor(40, 8, jnp.float32, pad=50)
  params = Net("xla").init(jax.random.key(0), x)
  loss = lambda p, impl: jnp.sum(jnp.sin(Net(impl).apply(p, x).feats))
  vp, gp = jax.jit(jax.value_and_grad(lambda p: loss(p, "pallas")))(params)
  vx, gx = jax.jit(jax.value_and_grad(lambda p: loss(p, "xla")))(params)
  assert rel_err(vp, vx) < 1e-5
  for a, r in zip(jax.tree_util.tree_leaves(gp), jax.tree_util.tree_leaves(gx)):
    assert rel_err(a, r) < 1e-5


def test_gpu_data_parallel_two_devices():
  """tests/nn_data_parallel.py's check on two GPUs (Pallas kernels, a cross-GPU all-reduce): different
  inputs per device; the pmean'd gradients and the pooled batch-norm statistics against single-device
  references."""
  if jax.device_count() < 2:
    pytest.skip(f"data parallelism needs 2 devices; this machine has {jax.device_count()} "
                f"({jax.devices()[0].device_kind})")
  from jax.flatten_util import ravel_pytree
  from jax.sharding import Mesh

  dp = nn_data_parallel
  precision = "highest"  # full float32 matmuls, so that 1e-4 measures the data parallelism, not TF32
  rng = np.random.default_rng(21)
  spatial = (18, 16, 20)
  cap = jsparse.round_capacity(2600)
  xs = [dp.make(rng, 1900, cap, spatial), dp.make(rng, 2400, cap, spatial)]  # different sites and counts
  targets = [jnp.asarray(rng.standard_normal((cap, 2)), jnp.float32) for _ in xs]
  variables = dp.Net(precision=precision).init(jax.random.key(0), xs[0])
  params, stats = variables["params"], variables["batch_stats"]
  mesh = Mesh(np.array(jax.devices()[:2]), (dp.AXIS,))
  grads, new_stats = dp.sharded_grads(mesh, params, stats, xs, targets, precision)

  # Both GPUs hold the same averaged gradient.
  for leaf in jax.tree.leaves(grads):
    copies = [np.asarray(s.data) for s in leaf.addressable_shards]
    assert len(copies) == 2
    np.testing.assert_array_equal(copies[0], copies[1])

  # Batch-norm statistics pooled over both GPUs = those of all valid rows on one device (momentum 0.5 from
  # the initial mean 0, var 1).
  mean, var = dp.pooled_statistics(params, xs, precision)
  got = new_stats["SparseBatchNorm_0"]
  assert rel_err(got["mean"], 0.5 * mean) < 1e-4
  assert rel_err(got["var"], 0.5 + 0.5 * var) < 1e-4

  # Gradients = the average of the two halves' gradients computed on one device with the pooled statistics.
  g_ref = dp.pooled_reference_grads(params, xs, targets, precision)
  flat, flat_ref = ravel_pytree(grads)[0], ravel_pytree(g_ref)[0]
  assert rel_err(flat, flat_ref) < 1e-4
  # Per leaf too; the first conv's bias feeds batch norm, so its true gradient is ~0: an absolute floor.
  floor = 1e-5 * float(jnp.max(jnp.abs(flat_ref)))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=floor), grads, g_ref)
  # and it is not one device's gradient alone
  g_first = dp.pooled_reference_grads(params, xs[:1], targets[:1], precision)
  assert rel_err(ravel_pytree(g_first)[0], flat_ref) > 1e-2


# The rows up to RES 128: their entries are the split-K and explicit launches tuned per row (RES 8's re-tuned in the
# twenty-seventh session). RES 256 and 512 run the unsplit 128x128 launch that every suite run cross-checks
# against FlexGEMM on the GPU, and their XLA references take 1-2 minutes each (docs/perf_notes.md).
SUITE_CASES = [(row.res, row.channels, name) for row in SUITE if row.res <= 128 for name in ("float16", "tf32")]


@pytest.mark.parametrize("res, c, dtype_name", SUITE_CASES, ids=[f"{r}-{c}-{d}" for r, c, d in SUITE_CASES])
def test_gpu_suite_rows_on_the_shipped_table_match_xla(res, c, dtype_name):
  """One layer of each FlexGEMM suite row as the suite runs it (exact capacity, ODHWI weights, the device's
  shipped table entries), forward and gradients, against the XLA path in full float32: a re-tuned entry is a new
  tile / split combination of the GEMM kernels, checked here on the GPU at the shape it was tuned for."""
  dtype, precision, tol = (jnp.float16, None, 5e-3) if dtype_name == "float16" else (jnp.float32, "tf32", 3e-3)
  x = shell_tensor(res, c, dtype, seed=res)
  rng = np.random.default_rng(res)
  w = jnp.asarray(rng.standard_normal((c, 3, 3, 3, c)) / np.sqrt(27 * c), dtype)
  cache = jsparse.neighbor_map(x, 3, implementation="pallas")
  cot = jnp.asarray(rng.standard_normal((x.capacity, c)), jnp.float32)

  def grads(x, w, impl, precision):
    def loss(feats, w):
      y = jsparse.submconv3d(x.replace(feats=feats), w, cache=cache, implementation=impl, precision=precision,
                             weight_layout="ODHWI")
      return jnp.sum(y.feats.astype(jnp.float32) * cot), y.feats

    (_, y), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x.feats, w)
    return (y,) + g

  want = grads(x.replace(feats=x.feats.astype(jnp.float32)), w.astype(jnp.float32), "xla", "highest")
  got = grads(x, w, "pallas", precision)
  for name, a, r in zip(("y", "d_feats", "d_weight"), got, want):
    assert rel_err(a.astype(jnp.float32), r) < tol, name


@pytest.mark.parametrize("path", ["xla", "explicit"])
def test_gpu_training_keeps_no_gathered_operand_per_layer(path):
  """test_submconv's per-layer memory test on the GPU, whose sibling fusion once gathered every layer's weight-
  gradient operand in one multi-output fusion (all of them alive at once): 4.36 MB a layer against a 4.18 MB
  operand before the input gradient waited for the weight gradient."""
  growth, gathered = gathered_operand_growth_per_layer(path)
  assert growth < gathered / 4, (growth, gathered)


def test_gpu_finetune_probe_compiles_and_keeps_the_pattern(tmp_path):
  """The 2:4 fine-tuning probe's training step crashed XLA's GPU emitter (a multi-output fusion of the occupancy
  grid's int32 zero fill with another int32 zero array, now kept apart); test_sparsity's smoke test on the GPU."""
  from test_sparsity import test_finetune_probe_smoke_keeps_the_pattern as finetune_smoke

  finetune_smoke(tmp_path)
