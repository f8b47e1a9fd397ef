"""Every GEMM kernel lowers to Triton IR (checked on the CPU; catches lowering breaks in CI)."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.gather_gemm import conv_forward, gather_gemm
from pallas_kernels.tiling import TileConfig
from pallas_kernels.weight_grad import weight_grad
from triton_lowering import lower_for_cuda

SHAPES = [(1000, 27, 64, 96), (300, 1, 19, 8), (5000, 125, 32, 32)]
DTYPES = [jnp.float16, jnp.bfloat16, jnp.float32]


def _spec(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gemm_kernels_lower_to_triton(shape, dtype):
  m, v, cin, cout = shape
  x, nbr, num = _spec((m, cin), dtype), _spec((m, v), jnp.int32), _spec((), jnp.int32)
  w, b, g = _spec((v, cin, cout), dtype), _spec((cout,), dtype), _spec((m, cout), dtype)
  for precision in (None, "highest"):
    text = lower_for_cuda(lambda x, w, nbr, num, b: gather_gemm(x, w, nbr, num, b, precision=precision),
                          x, w, nbr, num, b)
    assert "triton" in text
  lower_for_cuda(lambda g, w, nbr, num: gather_gemm(g, w, nbr, num, weight_axes="vnk", flip_offsets=True),
                 g, w, nbr, num)
  lower_for_cuda(lambda x, g, nbr: weight_grad(x, g, nbr), x, g, nbr)


@pytest.mark.parametrize("v,block_m", [(27, 128), (125, 64), (1, 64)])
def test_masked_plan_kernel_lowers(v, block_m):
  from pallas_kernels.gemm_plan import masked_plan

  text = lower_for_cuda(lambda nbr, num: masked_plan(nbr, num, block_m), _spec((3000, v), jnp.int32),
                        _spec((1,), jnp.int32))
  assert "masked_plan_blocks" in text


@pytest.mark.parametrize("mirrored", [False, True])
@pytest.mark.parametrize("v", [1, 27, 125])
def test_pair_list_kernels_lower(v, mirrored):
  """Both pair-list kernels lower (a capacity that is not a multiple of the chunk), the in-chunk prefix sum as a
  Triton scan."""
  from pallas_kernels.gemm_plan import pair_lists
  from triton_lowering import capture_triton_modules

  with capture_triton_modules() as captured:
    text = lower_for_cuda(lambda nbr: pair_lists(nbr, mirrored), _spec((3001, v), jnp.int32))
  assert "pair_list_counts" in text and "pair_lists" in text
  assert len(captured) == 2 and "tt.scan" in captured[1][0]


@pytest.mark.parametrize("v,block_m,mirrored", [(27, 128, True), (27, 64, False), (125, 64, True), (1, 64, False)])
def test_pair_lists_from_plan_lower(v, block_m, mirrored):
  """The pair-list kernels over a plan's blocks lower (a capacity that is not a multiple of the block)."""
  from pallas_kernels.gemm_plan import MaskedPlan, pair_lists_from_plan
  from triton_lowering import capture_triton_modules

  cap, blocks = 3001, -(-3001 // block_m)
  plan = MaskedPlan(_spec((cap,), jnp.int32), _spec((blocks, v), jnp.int32), _spec((blocks,), jnp.int32),
                    _spec((blocks, v, block_m), jnp.int32))
  with capture_triton_modules() as captured:
    text = lower_for_cuda(lambda *p: pair_lists_from_plan(MaskedPlan(*p), mirrored), *plan)
  assert "pair_list_counts" in text and "pair_lists" in text
  assert len(captured) == 2 and "tt.scan" in captured[1][0]


def test_explicit_tile_configs_lower():
  x, nbr, num = _spec((4096, 64), jnp.float16), _spec((4096, 27), jnp.int32), _spec((), jnp.int32)
  w, g = _spec((27, 64, 128), jnp.float16), _spec((4096, 128), jnp.float16)
  for cfg in (TileConfig(128, 128, 64, num_warps=8, num_stages=3), TileConfig(32, 32, 32, num_warps=2, num_stages=4)):
    lower_for_cuda(lambda x, w, nbr, num: gather_gemm(x, w, nbr, num, config=cfg, skip_empty=False), x, w, nbr, num)
    lower_for_cuda(lambda x, g, nbr: weight_grad(x, g, nbr, config=cfg), x, g, nbr)


@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_masked_and_splitk_variants_lower(split, dtype):
  from pallas_kernels.gemm_plan import masked_plan, pair_lists

  m, v, cin, cout = 3000, 27, 64, 32
  cfg = TileConfig(64, 32, 32, split=split)
  x, nbr, num = _spec((m, cin), dtype), _spec((m, v), jnp.int32), _spec((), jnp.int32)
  w, b, g = _spec((v, cin, cout), dtype), _spec((cout,), dtype), _spec((m, cout), dtype)

  def fwd_and_dgrad(x, w, nbr, num, b, g):
    plan = masked_plan(nbr, num, cfg.block_m)
    y = gather_gemm(x, w, nbr, num, b, plan=plan, config=cfg)
    dx = gather_gemm(g, w, nbr, num, plan=plan, weight_axes="vnk", flip_offsets=True, config=cfg)
    return y, dx

  lower_for_cuda(fwd_and_dgrad, x, w, nbr, num, b, g)
  for k_major in (True, False):  # the forward's two weight reads (K-major copy: transposed, offsets not reversed)
    for swap in (True, False):  # and the two operand orders (TileConfig.swap_operands)
      kcfg = dataclasses.replace(cfg, weight_k_major=k_major, swap_operands=swap)
      lower_for_cuda(lambda x, w, nbr, num, b: conv_forward(x, w, nbr, num, b, plan=masked_plan(nbr, num, 64),
                                                            config=kcfg), x, w, nbr, num, b)
  lower_for_cuda(lambda x, w, nbr, num, b: gather_gemm(x, w, nbr, num, b, config=cfg), x, w, nbr, num, b)
  lower_for_cuda(lambda x, g, nbr: weight_grad(x, g, nbr, pairs=pair_lists(nbr), config=cfg), x, g, nbr)
  # Mirrored lists (half the offsets stored, rows and sources swapped for the others), without the map.
  lower_for_cuda(lambda x, g, nbr: weight_grad(x, g, None, pairs=pair_lists(nbr, mirrored=True), config=cfg),
                 x, g, nbr)


def test_kernels_lower_inside_shard_map():
  """Inside shard_map (check_vma=True) every kernel's outputs must say which mesh axes they vary over:
  without that, data-parallel training failed on 2 H200s at trace time. A one-device mesh is enough."""
  import numpy as np
  from jax.sharding import Mesh, PartitionSpec as P

  from pallas_kernels.gemm_plan import masked_plan, pair_lists
  from pallas_kernels.hash_table import neighbor_map_hashed

  offsets = tuple((a, b, c) for a in (-1, 0, 1) for b in (-1, 0, 1) for c in (-1, 0, 1))
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
  m, cin, cout = 512, 16, 32

  def step(coords, num, x, w, g):
    nbr, _ = neighbor_map_hashed(coords, num[0], spatial_shape=(8, 8, 8), offsets=offsets)
    y = gather_gemm(x, w, nbr, num[0], plan=masked_plan(nbr, num[0], 64))
    dx = gather_gemm(g, w, nbr, num[0], weight_axes="vnk", flip_offsets=True)
    dw = weight_grad(x, g, nbr, pairs=pair_lists(nbr))
    return y, dx, jax.lax.psum(dw, "data")

  fn = jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P("data"), P("data"), P(), P("data")),
                     out_specs=(P("data"), P("data"), P()))
  text = lower_for_cuda(fn, _spec((m, 4), jnp.int32), _spec((1,), jnp.int32), _spec((m, cin), jnp.float16),
                        _spec((27, cin, cout), jnp.float16), _spec((m, cout), jnp.float16))
  assert text.count("__gpu$xla.gpu.triton") >= 6


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_balanced_weight_grad_lowers(dtype):
  """The balanced weight gradient (work items read from small int32 arrays; float32 as bf16 hi/lo products)."""
  from pallas_kernels.gemm_plan import pair_lists

  m, v, cin, cout = 3000, 27, 64, 48
  x, nbr, g = _spec((m, cin), dtype), _spec((m, v), jnp.int32), _spec((m, cout), dtype)
  for cfg in (TileConfig(64, 32, 32, split=4, balanced=True), TileConfig(128, 64, 64, split=1, balanced=True)):
    for precision in (None, "highest"):
      for mirrored in (False, True):
        text = lower_for_cuda(lambda x, g, nbr: weight_grad(x, g, nbr, pairs=pair_lists(nbr, mirrored), config=cfg,
                                                            precision=precision), x, g, nbr)
        assert "triton" in text
