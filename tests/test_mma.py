"""pallas_kernels.mma: float32 TF32 products reach Triton as one `tt.dot` that accumulates in place and is
marked so XLA does not round its operands first; everything else is the plain product. Also the swapped
product (TileConfig.swap_operands) against the XLA path."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jsparse
from pallas_kernels import gather_gemm as gather_gemm_lib
from pallas_kernels.gemm_plan import masked_plan
from pallas_kernels.mma import mma
from pallas_kernels.tiling import TileConfig
from reference import random_sparse, rel_err
from triton_lowering import triton_ir


def _dot_lines(dtype, precision, swap=None):
  m, v, cin, cout = 2000, 27, 64, 48
  spec = jax.ShapeDtypeStruct
  cfg = TileConfig(64, 32, 32, swap_operands=swap)
  (ttir,) = triton_ir(lambda x, w, nbr, num: gather_gemm_lib.gather_gemm(x, w, nbr, num, config=cfg,
                                                                         precision=precision),
                      spec((m, cin), dtype), spec((v, cin, cout), dtype), spec((m, v), jnp.int32),
                      spec((), jnp.int32))
  return ttir, [line for line in ttir.splitlines() if "tt.dot" in line]


@pytest.mark.parametrize("swap", [False, True])
def test_tf32_product_is_one_marked_dot_that_accumulates(swap):
  ttir, dots = _dot_lines(jnp.float32, "tf32", swap)
  assert len(dots) == 1
  assert "inputPrecision = tf32" in dots[0] and "tf32_arguments_rounded" in dots[0]
  # The accumulator is the dot's third operand (the loop-carried value), not a zero added to afterwards.
  acc = re.search(r"tt\.dot %\w+, %\w+, (%\w+)", dots[0]).group(1)
  assert not re.search(rf"{acc} = tt\.splat", ttir)


@pytest.mark.parametrize("dtype, precision", [(jnp.float16, None), (jnp.float32, "highest")])
def test_other_products_are_plain_dots(dtype, precision):
  _, dots = _dot_lines(dtype, precision)
  assert len(dots) == 1 and "tf32_arguments_rounded" not in dots[0]
  if precision == "highest":  # full float32 (IEEE, the default, which the printer leaves out)
    assert "inputPrecision" not in dots[0]


@pytest.mark.parametrize("jax_setting, tf32", [(None, True), ("bfloat16", True), ("tensorfloat32", True),
                                               ("float32", False), ("highest", False)])
def test_precision_none_follows_jax_default_matmul_precision(jax_setting, tf32):
  """precision=None is TF32 unless JAX's own setting asks for float32, as for `jnp.dot`; an explicit precision
  wins over the setting."""
  with jax.default_matmul_precision(jax_setting):
    _, dots = _dot_lines(jnp.float32, None)
    _, explicit_tf32 = _dot_lines(jnp.float32, "tf32")
  assert len(dots) == 1 and ("inputPrecision = tf32" in dots[0]) == tf32
  assert "inputPrecision = tf32" in explicit_tf32[0]


def _xla_dot_precisions(setting):
  """The precisions of the XLA path's products (forward and both gradients) under JAX's setting."""
  x = random_sparse(np.random.default_rng(3), (5, 4, 6), 8)
  w = jnp.ones((3, 3, 3, 8, 4), jnp.float32)
  loss = lambda f, w: jsparse.submconv3d(x.replace(feats=f), w, implementation="xla").feats.sum()
  with jax.default_matmul_precision(setting):
    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x.feats, w))
  return set(re.findall(r"precision=\(?Precision\.(\w+)", jaxpr))


def test_xla_path_precision_none_follows_jax_default_matmul_precision():
  """The XLA path's products (forward and both gradients) take the same precision as the kernels'."""
  assert _xla_dot_precisions("float32") == {"HIGHEST"}
  assert _xla_dot_precisions(None) == {"DEFAULT"}


@pytest.mark.parametrize("preset, want", [("BF16_BF16_F32_X9", "HIGHEST"), ("BF16_BF16_F32_X6", "HIGHEST"),
                                          ("TF32_TF32_F32_X3", "HIGHEST"), ("BF16_BF16_F32_X3", "HIGH"),
                                          ("BF16_BF16_F32", "DEFAULT"), ("TF32_TF32_F32", "DEFAULT")])
def test_multi_pass_presets_keep_their_accuracy(preset, want):
  """JAX's multi-pass algorithm presets ask for (near) float32 products: read as TF32 they lost the digits asked
  for (jnp.dot under the same setting keeps them); one-pass presets are the default."""
  assert _xla_dot_precisions(preset) == {want}


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the product off the GPU; test_gpu checks the GPU's")
def test_mma_off_the_gpu_is_the_float32_product():
  rng = np.random.default_rng(0)
  a, b, acc = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((16, 32), (32, 8), (16, 8)))
  want = acc + jnp.dot(a, b, precision="highest")
  for precision in (lax.Precision.DEFAULT, lax.Precision.HIGHEST):
    got = jax.jit(lambda a, b, acc, p=precision: mma(a, b, acc, p))(a, b, acc)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("weight_k_major", [True, False])
def test_swapped_product_matches_xla(weight_k_major, dtype):
  """Forward and input gradient, swapped or not (and as the rule decides), split or not, at the default
  precision (float32: the TF32 product, full float32 in interpret mode) against the XLA path."""
  rng = np.random.default_rng(41)
  x = random_sparse(rng, (7, 6, 5), 24, density=0.35, pad=9)
  w = jnp.asarray(rng.standard_normal((27, 24, 40)) / 10, dtype)
  g = jnp.asarray(rng.standard_normal((x.capacity, 40)), dtype)
  feats = x.feats.astype(dtype)
  nbr = jsparse.neighbor_map(x, 3, implementation="xla").nbr
  w32 = w.astype(jnp.float32)
  ref = jsparse.submconv_xla(feats.astype(jnp.float32), w32, None, nbr, x.num, precision="highest")
  ref_dx = jsparse.submconv_xla(g.astype(jnp.float32), jnp.swapaxes(w32[::-1], 1, 2), None, nbr, x.num,
                                precision="highest")
  tol = 1e-5 if dtype == jnp.float32 else 2e-3
  plan = masked_plan(nbr, x.num, 32, interpret=True)
  for split in (1, 3):
    for swap in (None, True, False):
      cfg = TileConfig(32, 16, 16, split=split, weight_k_major=weight_k_major, swap_operands=swap)
      y = gather_gemm_lib.conv_forward(feats, w, nbr, x.num, plan=plan, config=cfg, interpret=True)
      assert rel_err(y, ref) < tol, cfg
      dx = gather_gemm_lib.gather_gemm(g, w, nbr, x.num, plan=plan, weight_axes="vnk", flip_offsets=True, config=cfg,
                                       interpret=True)
      assert rel_err(dx, ref_dx) < tol, cfg


def test_swap_rule():
  from pallas_kernels.gather_gemm_config import swaps_operands as rule
  assert rule(TileConfig(), jnp.float32, True)
  assert not rule(TileConfig(), jnp.float32, False)
  assert not rule(TileConfig(), jnp.float16, True)
  assert rule(TileConfig(swap_operands=True), jnp.float16, False)
  assert not rule(TileConfig(swap_operands=False), jnp.float32, True)
  # Column tiles under 64 underfill the swapped product's MMA rows: unswapped unless asked.
  assert rule(TileConfig(block_n=64), jnp.float32, True)
  assert not rule(TileConfig(block_n=32), jnp.float32, True)
  assert rule(TileConfig(block_n=32, swap_operands=True), jnp.float32, True)
